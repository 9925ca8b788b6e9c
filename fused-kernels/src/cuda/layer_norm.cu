// LayerNorm forward and backward (see layer_norm.rs for the formulas).
#include "common.cuh"

// (μ, r) of one row: two passes (mean, then the centred squares), as the CPU kernel.
template <typename T>
__device__ __forceinline__ void moments(const T* __restrict__ x, u64 d, typename AccOf<T>::type eps,
                                        typename AccOf<T>::type* mean,
                                        typename AccOf<T>::type* rstd) {
  typedef typename AccOf<T>::type A;
  const A n = (A)d;
  A s = 0;
  for (u64 j = threadIdx.x; j < d; j += blockDim.x) s += to_acc(x[j]);
  const A m = block_sum(s) / n;
  A v = 0;
  for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
    const A c = to_acc(x[j]) - m;
    v += c * c;
  }
  *mean = m;
  *rstd = A(1) / acc_sqrt(block_sum(v) / n + eps);
}

template <typename T>
__device__ void layer_norm(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                           T* __restrict__ y, u64 rows, u64 d, double eps_) {
  typedef typename AccOf<T>::type A;
  const A eps = (A)eps_;
  for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    A mean, rstd;
    moments(xr, d, eps, &mean, &rstd);
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
      yr[j] = from_acc<T>((to_acc(xr[j]) - mean) * rstd * to_acc(w[j]) + to_acc(b[j]));
    }
  }
}

// First pass of the backward: dx for every row (plus dres, the gradient that reaches x along the
// residual path, when given), and each block's partial sums of d_weight and
// d_bias over its rows into partial[blockIdx.x · 2d ..][d_weight (d), d_bias (d)]. A column j is
// always handled by the same thread of a block, so the partial sums need no atomics.
template <typename T>
__device__ void layer_norm_backward(const T* __restrict__ x, const T* __restrict__ w,
                                    const T* __restrict__ dy, const T* __restrict__ dres,
                                    T* __restrict__ dx,
                                    typename AccOf<T>::type* __restrict__ partial, u64 rows, u64 d,
                                    double eps_) {
  typedef typename AccOf<T>::type A;
  const A eps = (A)eps_, n = (A)d;
  A* pw = partial + blockIdx.x * 2 * d;
  A* pb = pw + d;
  for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
    pw[j] = 0;
    pb[j] = 0;
  }
  for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    const T* gr = dy + r * d;
    T* dxr = dx + r * d;
    A mean, rstd;
    moments(xr, d, eps, &mean, &rstd);
    // ĝ = dy · w is rounded alike in both loops (never fused into the sum or the difference
    // after it): over one element, ĝ − mean(ĝ) is then exactly 0, as in exact arithmetic and
    // on the CPU, where a fused product would leave its rounding error times rstd.
    A sg = 0, sgx = 0;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
      const A xhat = (to_acc(xr[j]) - mean) * rstd;
      const A ghat = acc_mul_rn(to_acc(gr[j]), to_acc(w[j]));
      sg += ghat;
      sgx += ghat * xhat;
    }
    const A mean_g = block_sum(sg) / n;
    const A mean_gx = block_sum(sgx) / n;
    for (u64 j = threadIdx.x; j < d; j += blockDim.x) {
      const A xhat = (to_acc(xr[j]) - mean) * rstd;
      const A g = to_acc(gr[j]);
      const A ghat = acc_mul_rn(g, to_acc(w[j]));
      dxr[j] = from_acc<T>(rstd * (ghat - mean_g - xhat * mean_gx) +
                              (dres ? to_acc(dres[r * d + j]) : A(0)));
      pw[j] += g * xhat;
      pb[j] += g;
    }
  }
}

#define LAYER_NORM(suffix, T)                                                                      \
  extern "C" __global__ void layer_norm_##suffix(const T* x, const T* w, const T* b, T* y,         \
                                                 u64 rows, u64 d, double eps) {                    \
    layer_norm<T>(x, w, b, y, rows, d, eps);                                                       \
  }                                                                                                \
  extern "C" __global__ void layer_norm_backward_##suffix(const T* x, const T* w, const T* dy,     \
                                                          T* dx, AccOf<T>::type* partial,          \
                                                          u64 rows, u64 d, double eps) {           \
    layer_norm_backward<T>(x, w, dy, nullptr, dx, partial, rows, d, eps);                                   \
  }                                                                                                \
  extern "C" __global__ void layer_norm_backward_residual_##suffix(                                \
      const T* x, const T* w, const T* dy, const T* dres, T* dx, AccOf<T>::type* partial,         \
      u64 rows, u64 d, double eps) {                                                               \
    layer_norm_backward<T>(x, w, dy, dres, dx, partial, rows, d, eps);                             \
  }                                                                                                \
  extern "C" __global__ void layer_norm_sum_##suffix(const AccOf<T>::type* partial, u64 blocks,    \
                                                     u64 len, T* out) {                            \
    sum_partials<T>(partial, blocks, len, out);                                                    \
  }
FOR_EACH_DTYPE(LAYER_NORM)
