// The fused linear cross-entropy's kernels (see linear_cross_entropy.rs): one pass over a chunk
// of logits that writes each row's weighted loss and overwrites the row with its gradient, and
// the backward pass's scaling of the kept gradients by the incoming gradient of the loss, read
// on the device. A target outside the row's classes makes the row's loss and gradient NaN, as in
// cross_entropy.cu.
#include "cross_entropy.cuh"

// For each row r of logits [n, v] (model dtype T): row_loss[r] = w_r · (lse_r − logits[r, t_r])
// and logits[r, :] = w_r · (softmax(logits[r, :]) − onehot(t_r)), computed in A and rounded to T.
// A row of weight 0 gets loss 0 and gradient 0 without being read.
template <typename T>
__device__ void cross_entropy_rows_grad(T* __restrict__ logits, const unsigned* __restrict__ targets,
                                        const typename AccOf<T>::type* __restrict__ weights,
                                        typename AccOf<T>::type* __restrict__ row_loss, u64 n, u64 v) {
  typedef typename AccOf<T>::type A;
  for (u64 r = blockIdx.x; r < n; r += gridDim.x) {
    const A w = weights[r];
    const u64 t = targets[r];
    T* row = logits + r * v;
    // Both conditions are the same for every thread of the block: no thread skips a reduction
    // that another one waits in.
    if (w == A(0) || t >= v) {
      const A fill = w == A(0) ? A(0) : acc_nan(A(0));
      for (u64 j = threadIdx.x; j < v; j += blockDim.x) row[j] = from_acc<T>(fill);
      if (threadIdx.x == 0) row_loss[r] = fill;
      continue;
    }
    // Every thread reads the target's logit before the reductions in logsumexp: their barriers
    // order these reads (and every read of the row) before any thread overwrites the row.
    const A picked = to_acc(row[t]);
    const A lse = logsumexp(row, v);
    if (threadIdx.x == 0) row_loss[r] = w * (lse - picked);
    for (u64 j = threadIdx.x; j < v; j += blockDim.x) {
      const A p = acc_exp(to_acc(row[j]) - lse);
      row[j] = from_acc<T>(j == t ? w * (p - A(1)) : w * p);
    }
  }
}

// y[i] = x[i] · s[0], computed in A and rounded to T. X is T (`scale`) or A (`scale_acc`).
template <typename X, typename T>
__device__ void scale(const X* __restrict__ x, const typename AccOf<T>::type* __restrict__ s,
                      T* __restrict__ y, u64 n) {
  const typename AccOf<T>::type k = s[0];
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)blockDim.x * gridDim.x) {
    y[i] = from_acc<T>(to_acc(x[i]) * k);
  }
}

#define LINEAR_CROSS_ENTROPY(suffix, T)                                                            \
  extern "C" __global__ void cross_entropy_rows_grad_##suffix(                                     \
      T* logits, const unsigned* targets, const AccOf<T>::type* weights, AccOf<T>::type* row_loss, \
      u64 n, u64 v) {                                                                              \
    cross_entropy_rows_grad<T>(logits, targets, weights, row_loss, n, v);                          \
  }                                                                                                \
  extern "C" __global__ void scale_##suffix(const T* x, const AccOf<T>::type* s, T* y, u64 n) {    \
    scale<T, T>(x, s, y, n);                                                                       \
  }                                                                                                \
  extern "C" __global__ void scale_acc_##suffix(const AccOf<T>::type* x, const AccOf<T>::type* s,  \
                                                T* y, u64 n) {                                     \
    scale<AccOf<T>::type, T>(x, s, y, n);                                                          \
  }
FOR_EACH_DTYPE(LINEAR_CROSS_ENTROPY)
