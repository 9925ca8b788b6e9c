// Element-wise GELU (tanh approximation), SiLU and SwiGLU, forward and backward (see gelu.rs,
// silu.rs, swiglu.rs): grid-stride loops over the elements, the CPU kernels' formulas.
#include "activation_math.cuh"

template <typename T> __device__ void gelu(const T* __restrict__ x, T* __restrict__ y, u64 n) {
  typedef typename AccOf<T>::type A;
  GRID_STRIDE(i, n) {
    A value, slope;
    gelu_and_slope(to_acc(x[i]), &value, &slope);
    y[i] = from_acc<T>(value);
  }
}

template <typename T>
__device__ void gelu_backward(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                              u64 n) {
  typedef typename AccOf<T>::type A;
  GRID_STRIDE(i, n) {
    A value, slope;
    gelu_and_slope(to_acc(x[i]), &value, &slope);
    dx[i] = from_acc<T>(to_acc(dy[i]) * slope);
  }
}

template <typename T> __device__ void silu(const T* __restrict__ x, T* __restrict__ y, u64 n) {
  GRID_STRIDE(i, n) {
    const auto v = to_acc(x[i]);
    y[i] = from_acc<T>(v * sigmoid(v));
  }
}

template <typename T>
__device__ void silu_backward(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                              u64 n) {
  GRID_STRIDE(i, n) dx[i] = from_acc<T>(to_acc(dy[i]) * silu_slope(to_acc(x[i])));
}

template <typename T>
__device__ void swiglu(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ y,
                       u64 n) {
  GRID_STRIDE(i, n) {
    const auto g = to_acc(gate[i]);
    y[i] = from_acc<T>(g * sigmoid(g) * to_acc(up[i]));
  }
}

// out = [d_gate (n), d_up (n)].
template <typename T>
__device__ void swiglu_backward(const T* __restrict__ gate, const T* __restrict__ up,
                                const T* __restrict__ dy, T* __restrict__ out, u64 n) {
  GRID_STRIDE(i, n) {
    const auto g = to_acc(gate[i]);
    const auto u = to_acc(up[i]);
    const auto d = to_acc(dy[i]);
    out[i] = from_acc<T>(d * u * silu_slope(g));
    out[n + i] = from_acc<T>(d * g * sigmoid(g));
  }
}

#define ACTIVATIONS(suffix, T)                                                                     \
  extern "C" __global__ void gelu_##suffix(const T* x, T* y, u64 n) { gelu<T>(x, y, n); }          \
  extern "C" __global__ void gelu_backward_##suffix(const T* x, const T* dy, T* dx, u64 n) {       \
    gelu_backward<T>(x, dy, dx, n);                                                                \
  }                                                                                                \
  extern "C" __global__ void silu_##suffix(const T* x, T* y, u64 n) { silu<T>(x, y, n); }          \
  extern "C" __global__ void silu_backward_##suffix(const T* x, const T* dy, T* dx, u64 n) {       \
    silu_backward<T>(x, dy, dx, n);                                                                \
  }                                                                                                \
  extern "C" __global__ void swiglu_##suffix(const T* gate, const T* up, T* y, u64 n) {            \
    swiglu<T>(gate, up, y, n);                                                                     \
  }                                                                                                \
  extern "C" __global__ void swiglu_backward_##suffix(const T* gate, const T* up, const T* dy,     \
                                                      T* out, u64 n) {                             \
    swiglu_backward<T>(gate, up, dy, out, n);                                                      \
  }
FOR_EACH_DTYPE(ACTIVATIONS)
