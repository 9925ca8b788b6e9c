// Rotary embeddings (see rotary.rs): one thread per pair (x_i, x_{i+h}) of a row, grid-stride.
// `inverse` rotates by −θ (the backward).
#include "common.cuh"

template <typename T>
__device__ void rotary(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                       T* __restrict__ y, u64 rows, u64 t, u64 h, int inverse) {
  typedef typename AccOf<T>::type A;
  const u64 pairs = rows * h, d = 2 * h;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < pairs; i += (u64)blockDim.x * gridDim.x) {
    const u64 r = i / h, k = i % h, pos = r % t;
    const A a = to_acc(x[r * d + k]), b = to_acc(x[r * d + k + h]);
    const A c = to_acc(cos[pos * h + k]);
    const A s = inverse ? -to_acc(sin[pos * h + k]) : to_acc(sin[pos * h + k]);
    y[r * d + k] = from_acc<T>(a * c - b * s);
    y[r * d + k + h] = from_acc<T>(b * c + a * s);
  }
}

#define ROTARY(suffix, T)                                                                          \
  extern "C" __global__ void rotary_##suffix(const T* x, const T* cos, const T* sin, T* y,         \
                                             u64 rows, u64 t, u64 h, int inverse) {                \
    rotary<T>(x, cos, sin, y, rows, t, h, inverse);                                                \
  }
FOR_EACH_DTYPE(ROTARY)
