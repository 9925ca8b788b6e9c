// The row reductions shared by the cross-entropy kernels (cross_entropy.cu) and the fused
// linear cross-entropy (linear_cross_entropy.cu).
#pragma once

#include "common.cuh"

// logsumexp of one row (every thread gets it).
template <typename T>
__device__ __forceinline__ typename AccOf<T>::type logsumexp(const T* __restrict__ row, u64 v) {
  typedef typename AccOf<T>::type A;
  A m = acc_neg_inf(A(0));
  for (u64 j = threadIdx.x; j < v; j += blockDim.x) m = MaxOp()(m, to_acc(row[j]));
  const A max = block_max(m);
  A s = 0;
  for (u64 j = threadIdx.x; j < v; j += blockDim.x) s += acc_exp(to_acc(row[j]) - max);
  return max + acc_log(block_sum(s));
}
