// The activations' formulas in the arithmetic type, shared by activations.cu and the fused
// blocks' kernels (block_kernels.cu); the CPU kernels compute the same expressions.
#pragma once

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

