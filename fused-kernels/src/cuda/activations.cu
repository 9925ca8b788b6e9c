// Element-wise GELU (tanh approximation), SiLU and SwiGLU, forward and backward (see gelu.rs,
// silu.rs, swiglu.rs): grid-stride loops over the elements, the CPU kernels' formulas.
#include "common.cuh"

#define GRID_STRIDE(i, n) \
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

// tanh(u) through one exp, 1 − 2 / (1 + e^{2u}), as the CPU kernel (±1 at the extremes).
template <typename A> __device__ __forceinline__ A tanh_by_exp(A u) {
  return A(1) - A(2) / (A(1) + acc_exp(u + u));
}

template <typename A> __device__ __forceinline__ A sigmoid(A x) { return A(1) / (A(1) + acc_exp(-x)); }

template <typename A> __device__ __forceinline__ A silu_slope(A x) {
  const A s = sigmoid(x);
  return s * (A(1) + x * (A(1) - s));
}

// (gelu(x), gelu'(x)).
template <typename A> __device__ __forceinline__ void gelu_and_slope(A x, A* value, A* slope) {
  const A half = (A)0.5, k = (A)0.7978845608028654, c = (A)0.044715;
  const A x2 = x * x;
  const A t = tanh_by_exp(k * x * (A(1) + c * x2));
  *value = half * x * (A(1) + t);
  *slope = half * (A(1) + t) + half * x * (A(1) - t * t) * k * (A(1) + (A)3 * c * x2);
}

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
