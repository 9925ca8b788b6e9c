// Weighted cross-entropy from logits, forward and backward (see cross_entropy.rs). The weights
// (forward) and dloss · weights (backward) are in the arithmetic type A. A target outside the
// row's classes makes that row's loss and gradient NaN: the CPU kernel's error would need the
// targets on the host, a synchronization in every training step.
#include "cross_entropy.cuh"

// First pass of the forward: each row's weighted loss into row_loss (A).
template <typename T>
__device__ void cross_entropy_rows(const T* __restrict__ logits, const unsigned* __restrict__ targets,
                                   const typename AccOf<T>::type* __restrict__ weights,
                                   typename AccOf<T>::type* __restrict__ row_loss, u64 n, u64 v) {
  typedef typename AccOf<T>::type A;
  for (u64 r = blockIdx.x; r < n; r += gridDim.x) {
    const A w = weights[r];
    const u64 t = targets[r];
    // Both conditions are the same for every thread of the block: no thread skips a reduction
    // that another one waits in.
    if (w == A(0)) {
      if (threadIdx.x == 0) row_loss[r] = 0;
      continue;
    }
    if (t >= v) {
      if (threadIdx.x == 0) row_loss[r] = acc_nan(A(0));
      continue;
    }
    const T* row = logits + r * v;
    const A lse = logsumexp(row, v);
    if (threadIdx.x == 0) row_loss[r] = w * (lse - to_acc(row[t]));
  }
}

// Second pass of the forward: the sum of the n row losses into out[0], by one block (the same
// result on every run: no atomics), added in f64 as the CPU kernel adds them and rounded once.
template <typename A>
__device__ void cross_entropy_total(const A* __restrict__ row_loss, u64 n, A* __restrict__ out) {
  double s = 0;
  for (u64 i = threadIdx.x; i < n; i += blockDim.x) s += (double)row_loss[i];
  const double total = block_sum(s);
  if (threadIdx.x == 0) out[0] = (A)total;
}

template <typename T>
__device__ void cross_entropy_backward(const T* __restrict__ logits,
                                       const unsigned* __restrict__ targets,
                                       const typename AccOf<T>::type* __restrict__ scaled,
                                       T* __restrict__ grad, u64 n, u64 v) {
  typedef typename AccOf<T>::type A;
  for (u64 r = blockIdx.x; r < n; r += gridDim.x) {
    const A w = scaled[r];
    const u64 t = targets[r];
    const T* row = logits + r * v;
    T* g = grad + r * v;
    if (w == A(0) || t >= v) {
      const T fill = from_acc<T>(w == A(0) ? A(0) : acc_nan(A(0)));
      for (u64 j = threadIdx.x; j < v; j += blockDim.x) g[j] = fill;
      continue;
    }
    const A lse = logsumexp(row, v);
    for (u64 j = threadIdx.x; j < v; j += blockDim.x) {
      const A p = acc_exp(to_acc(row[j]) - lse);
      g[j] = from_acc<T>(j == t ? w * (p - A(1)) : w * p);
    }
  }
}

#define CROSS_ENTROPY(suffix, T)                                                                   \
  extern "C" __global__ void cross_entropy_rows_##suffix(const T* logits, const unsigned* targets, \
                                                         const AccOf<T>::type* weights,            \
                                                         AccOf<T>::type* row_loss, u64 n, u64 v) { \
    cross_entropy_rows<T>(logits, targets, weights, row_loss, n, v);                               \
  }                                                                                                \
  extern "C" __global__ void cross_entropy_total_##suffix(const AccOf<T>::type* row_loss, u64 n,   \
                                                          AccOf<T>::type* out) {                   \
    cross_entropy_total<AccOf<T>::type>(row_loss, n, out);                                         \
  }                                                                                                \
  extern "C" __global__ void cross_entropy_backward_##suffix(                                      \
      const T* logits, const unsigned* targets, const AccOf<T>::type* scaled, T* grad, u64 n,      \
      u64 v) {                                                                                     \
    cross_entropy_backward<T>(logits, targets, scaled, grad, n, v);                                \
  }
FOR_EACH_DTYPE(CROSS_ENTROPY)
