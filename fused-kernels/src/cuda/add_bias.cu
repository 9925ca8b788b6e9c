// The bias add and its gradient, the sum of the rows (see add_bias.rs). The sum is two passes:
// block b sums rows b, b + gridDim.x, … of each column into partial[b · n ..], then one thread per
// column adds the blocks' partial sums in block order (no atomics: the same result on every run).
#include "common.cuh"

template <typename T>
__device__ void add_bias(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                         u64 total, u64 n) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)blockDim.x * gridDim.x) {
    y[i] = from_acc<T>(to_acc(x[i]) + to_acc(bias[i % n]));
  }
}

template <typename T>
__device__ void add_bias_partial(const T* __restrict__ dy, typename AccOf<T>::type* __restrict__ partial,
                                 u64 rows, u64 n) {
  typedef typename AccOf<T>::type A;
  for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
    A s = 0;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) s += to_acc(dy[r * n + j]);
    partial[blockIdx.x * n + j] = s;
  }
}

#define ADD_BIAS(suffix, T)                                                                        \
  extern "C" __global__ void add_bias_##suffix(const T* x, const T* bias, T* y, u64 total,         \
                                               u64 n) {                                            \
    add_bias<T>(x, bias, y, total, n);                                                             \
  }                                                                                                \
  extern "C" __global__ void add_bias_partial_##suffix(const T* dy, AccOf<T>::type* partial,       \
                                                       u64 rows, u64 n) {                          \
    add_bias_partial<T>(dy, partial, rows, n);                                                     \
  }                                                                                                \
  extern "C" __global__ void add_bias_sum_##suffix(const AccOf<T>::type* partial, u64 blocks,      \
                                                   u64 n, T* out) {                                \
    sum_partials<T>(partial, blocks, n, out);                                                      \
  }
FOR_EACH_DTYPE(ADD_BIAS)
