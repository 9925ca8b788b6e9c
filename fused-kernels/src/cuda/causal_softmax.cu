// Causal softmax forward and backward (see causal_softmax.rs for the formulas). Row r of the
// [rows, t_k] scores is query r mod t_q, which sees keys 0 .. r mod t_q + (t_k − t_q).
#include "common.cuh"

template <typename T>
__device__ void causal_softmax(const T* __restrict__ x, T* __restrict__ p, u64 rows, u64 t_q,
                               u64 t_k, double scale_) {
  typedef typename AccOf<T>::type A;
  const A scale = (A)scale_;
  for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * t_k;
    T* pr = p + r * t_k;
    const u64 seen = r % t_q + (t_k - t_q) + 1;
    A m = acc_neg_inf(A(0));
    for (u64 j = threadIdx.x; j < seen; j += blockDim.x) m = MaxOp()(m, scale * to_acc(xr[j]));
    const A max = block_max(m);
    A s = 0;
    for (u64 j = threadIdx.x; j < seen; j += blockDim.x) s += acc_exp(scale * to_acc(xr[j]) - max);
    const A inv = A(1) / block_sum(s);
    for (u64 j = threadIdx.x; j < t_k; j += blockDim.x) {
      pr[j] = j < seen ? from_acc<T>(acc_exp(scale * to_acc(xr[j]) - max) * inv) : from_acc<T>(A(0));
    }
  }
}

template <typename T>
__device__ void causal_softmax_backward(const T* __restrict__ p, const T* __restrict__ dp,
                                        T* __restrict__ ds, u64 rows, u64 t_q, u64 t_k,
                                        double scale_) {
  typedef typename AccOf<T>::type A;
  const A scale = (A)scale_;
  for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* pr = p + r * t_k;
    const T* gr = dp + r * t_k;
    T* dr = ds + r * t_k;
    const u64 seen = r % t_q + (t_k - t_q) + 1;
    A s = 0;
    for (u64 j = threadIdx.x; j < seen; j += blockDim.x) s += to_acc(pr[j]) * to_acc(gr[j]);
    const A dot = block_sum(s);
    for (u64 j = threadIdx.x; j < t_k; j += blockDim.x) {
      dr[j] = j < seen ? from_acc<T>(scale * to_acc(pr[j]) * (to_acc(gr[j]) - dot))
                       : from_acc<T>(A(0));
    }
  }
}

#define CAUSAL_SOFTMAX(suffix, T)                                                                  \
  extern "C" __global__ void causal_softmax_##suffix(const T* x, T* p, u64 rows, u64 t_q, u64 t_k, \
                                                     double scale) {                               \
    causal_softmax<T>(x, p, rows, t_q, t_k, scale);                                                \
  }                                                                                                \
  extern "C" __global__ void causal_softmax_backward_##suffix(const T* p, const T* dp, T* ds,      \
                                                              u64 rows, u64 t_q, u64 t_k,          \
                                                              double scale) {                      \
    causal_softmax_backward<T>(p, dp, ds, rows, t_q, t_k, scale);                                  \
  }
FOR_EACH_DTYPE(CAUSAL_SOFTMAX)
