// RMSNorm forward and backward (see rms_norm.rs for the formulas).
#include "common.cuh"

// r = 1 / √(mean(x²) + eps) of one row.
template <typename T>
__device__ __forceinline__ typename AccOf<T>::type rstd_of(const T* __restrict__ x, u64 d,
                                                           typename AccOf<T>::type eps) {
  typedef typename AccOf<T>::type A;
  A s = 0;
  for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
    const A v = to_acc(x[j]);
    s += v * v;
  }
  return A(1) / acc_sqrt(block_sum(s) / (A)d + eps);
}

template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                         u64 rows, u64 d, double eps_) {
  typedef typename AccOf<T>::type A;
  const A eps = (A)eps_;
  for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    const A rstd = rstd_of(xr, d, eps);
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
      yr[j] = from_acc<T>(to_acc(xr[j]) * rstd * to_acc(w[j]));
    }
  }
}

// First pass of the backward: dx for every row (plus dres, the gradient that reaches x along the
// residual path, when given), and each block's partial sum of d_weight over its
// rows into partial[blockIdx.x · d ..] (a column is always handled by the same thread: no atomics).
template <typename T>
__device__ void rms_norm_backward(const T* __restrict__ x, const T* __restrict__ w,
                                  const T* __restrict__ dy, const T* __restrict__ dres,
                                    T* __restrict__ dx,
                                  typename AccOf<T>::type* __restrict__ partial, u64 rows, u64 d,
                                  double eps_) {
  typedef typename AccOf<T>::type A;
  const A eps = (A)eps_, n = (A)d;
  A* pw = partial + blockIdx.x * d;
  for (u64 j = threadIdx.x; j < d; j += blockDim.x) pw[j] = 0;
  for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    const T* gr = dy + r * d;
    T* dxr = dx + r * d;
    const A rstd = rstd_of(xr, d, eps);
    A sgx = 0;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
      sgx += to_acc(gr[j]) * to_acc(w[j]) * to_acc(xr[j]) * rstd;
    }
    const A mean_gx = block_sum(sgx) / n;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
      const A xhat = to_acc(xr[j]) * rstd;
      const A g = to_acc(gr[j]);
      dxr[j] = from_acc<T>(rstd * (g * to_acc(w[j]) - xhat * mean_gx) +
                            (dres ? to_acc(dres[r * d + j]) : A(0)));
      pw[j] += g * xhat;
    }
  }
}

#define RMS_NORM(suffix, T)                                                                        \
  extern "C" __global__ void rms_norm_##suffix(const T* x, const T* w, T* y, u64 rows, u64 d,      \
                                               double eps) {                                       \
    rms_norm<T>(x, w, y, rows, d, eps);                                                            \
  }                                                                                                \
  extern "C" __global__ void rms_norm_backward_##suffix(const T* x, const T* w, const T* dy,       \
                                                        T* dx, AccOf<T>::type* partial, u64 rows,  \
                                                        u64 d, double eps) {                       \
    rms_norm_backward<T>(x, w, dy, nullptr, dx, partial, rows, d, eps);                                     \
  }                                                                                                \
  extern "C" __global__ void rms_norm_backward_residual_##suffix(                                  \
      const T* x, const T* w, const T* dy, const T* dres, T* dx, AccOf<T>::type* partial,         \
      u64 rows, u64 d, double eps) {                                                               \
    rms_norm_backward<T>(x, w, dy, dres, dx, partial, rows, d, eps);                               \
  }                                                                                                \
  extern "C" __global__ void rms_norm_sum_##suffix(const AccOf<T>::type* partial, u64 blocks,      \
                                                   u64 len, T* out) {                              \
    sum_partials<T>(partial, blocks, len, out);                                                    \
  }
FOR_EACH_DTYPE(RMS_NORM)
