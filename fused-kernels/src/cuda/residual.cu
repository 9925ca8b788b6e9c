// The residual add that ends a fused layer: out = x + z (+ bias on every row), in the arithmetic
// type, rounded once (see residual.rs).
#include "common.cuh"

template <typename T>
__device__ void residual_add(const T* __restrict__ x, const T* __restrict__ z, T* __restrict__ y,
                             u64 total) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)blockDim.x * gridDim.x) {
    y[i] = from_acc<T>(to_acc(x[i]) + to_acc(z[i]));
  }
}

template <typename T>
__device__ void residual_add_bias(const T* __restrict__ x, const T* __restrict__ z,
                                  const T* __restrict__ bias, T* __restrict__ y, u64 total, u64 n) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)blockDim.x * gridDim.x) {
    y[i] = from_acc<T>(to_acc(x[i]) + to_acc(z[i]) + to_acc(bias[i % n]));
  }
}

#define RESIDUAL(suffix, T)                                                                        \
  extern "C" __global__ void residual_add_##suffix(const T* x, const T* z, T* y, u64 total) {      \
    residual_add<T>(x, z, y, total);                                                               \
  }                                                                                                \
  extern "C" __global__ void residual_add_bias_##suffix(const T* x, const T* z, const T* bias,     \
                                                        T* y, u64 total, u64 n) {                  \
    residual_add_bias<T>(x, z, bias, y, total, n);                                                 \
  }
FOR_EACH_DTYPE(RESIDUAL)
