// The bias add (see add_bias.rs). Its gradient, the sum of dy's rows, is one cuBLAS product with
// a row of ones (add_bias.rs, column_sums), so it has no kernel here.
#include "common.cuh"

template <typename T>
__device__ void add_bias(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                         u64 total, u64 n) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)blockDim.x * gridDim.x) {
    y[i] = from_acc<T>(to_acc(x[i]) + to_acc(bias[i % n]));
  }
}

#define ADD_BIAS(suffix, T)                                                                        \
  extern "C" __global__ void add_bias_##suffix(const T* x, const T* bias, T* y, u64 total,         \
                                               u64 n) {                                            \
    add_bias<T>(x, bias, y, total, n);                                                             \
  }
FOR_EACH_DTYPE(ADD_BIAS)
