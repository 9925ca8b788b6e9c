// Element-wise kernels of the fused layers (see block_kernels.rs): in-place bias add, in-place add
// into a range of columns, bias + GELU
// and its backward, SwiGLU over a packed [gate | up] projection and its backward, rotary embeddings
// applied in place to a range of heads of a packed [B, T, heads, D] projection. Grid-stride loops;
// arithmetic in AccOf<T>, rounded once per stored element.
#include "activation_math.cuh"

template <typename T>
__device__ void add_bias_inplace(T* __restrict__ y, const T* __restrict__ bias, u64 total, u64 n) {
  GRID_STRIDE(i, total) y[i] = from_acc<T>(to_acc(y[i]) + to_acc(bias[i % n]));
}

// y[r, offset + j] += delta[r, j] for rows r of y (`total` wide) and delta (`width` wide).
template <typename T>
__device__ void add_into_columns(T* __restrict__ y, const T* __restrict__ delta, u64 rows,
                                 u64 total, u64 width, u64 offset) {
  GRID_STRIDE(i, rows * width) {
    const u64 r = i / width, j = i % width;
    T* p = y + r * total + offset + j;
    *p = from_acc<T>(to_acc(*p) + to_acc(delta[i]));
  }
}

// act = gelu(f + bias); `has_bias` 0 reads no bias.
template <typename T>
__device__ void bias_gelu(const T* __restrict__ f, const T* __restrict__ bias, T* __restrict__ act,
                          u64 total, u64 n, int has_bias) {
  typedef typename AccOf<T>::type A;
  GRID_STRIDE(i, total) {
    const A x = to_acc(f[i]) + (has_bias ? to_acc(bias[i % n]) : A(0));
    A value, slope;
    gelu_and_slope(x, &value, &slope);
    act[i] = from_acc<T>(value);
  }
}

// df = dg · gelu'(f + bias).
template <typename T>
__device__ void bias_gelu_backward(const T* __restrict__ f, const T* __restrict__ bias,
                                   const T* __restrict__ dg, T* __restrict__ df, u64 total, u64 n,
                                   int has_bias) {
  typedef typename AccOf<T>::type A;
  GRID_STRIDE(i, total) {
    const A x = to_acc(f[i]) + (has_bias ? to_acc(bias[i % n]) : A(0));
    A value, slope;
    gelu_and_slope(x, &value, &slope);
    df[i] = from_acc<T>(to_acc(dg[i]) * slope);
  }
}

// act[r, j] = silu(gu[r, j]) · gu[r, inner + j] for rows r of the packed [gate | up] (2·inner wide).
template <typename T>
__device__ void swiglu_packed(const T* __restrict__ gu, T* __restrict__ act, u64 rows, u64 inner) {
  typedef typename AccOf<T>::type A;
  GRID_STRIDE(i, rows * inner) {
    const u64 r = i / inner, j = i % inner;
    const A g = to_acc(gu[r * 2 * inner + j]), u = to_acc(gu[r * 2 * inner + inner + j]);
    act[i] = from_acc<T>(g * sigmoid(g) * u);
  }
}

// dgu[r, j] = da · u · silu'(g), dgu[r, inner + j] = da · silu(g).
template <typename T>
__device__ void swiglu_packed_backward(const T* __restrict__ gu, const T* __restrict__ da,
                                       T* __restrict__ dgu, u64 rows, u64 inner) {
  typedef typename AccOf<T>::type A;
  GRID_STRIDE(i, rows * inner) {
    const u64 r = i / inner, j = i % inner;
    const A g = to_acc(gu[r * 2 * inner + j]), u = to_acc(gu[r * 2 * inner + inner + j]);
    const A d = to_acc(da[i]);
    dgu[r * 2 * inner + j] = from_acc<T>(d * u * silu_slope(g));
    dgu[r * 2 * inner + inner + j] = from_acc<T>(d * g * sigmoid(g));
  }
}

// Rotates heads [first, first + count) of x [rows = B·T, heads, 2h] in place, the position of row r
// being r mod t; `inverse` rotates by −θ (the backward).
template <typename T>
__device__ void rotary_heads(T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                             u64 rows, u64 t, u64 heads, u64 first, u64 count, u64 h, int inverse) {
  typedef typename AccOf<T>::type A;
  GRID_STRIDE(i, rows * count * h) {
    const u64 k = i % h, head = first + (i / h) % count, r = i / (h * count);
    const u64 pos = r % t;
    T* row = x + (r * heads + head) * 2 * h;
    const A a = to_acc(row[k]), b = to_acc(row[k + h]);
    const A c = to_acc(cos[pos * h + k]);
    const A s = inverse ? -to_acc(sin[pos * h + k]) : to_acc(sin[pos * h + k]);
    row[k] = from_acc<T>(a * c - b * s);
    row[k + h] = from_acc<T>(b * c + a * s);
  }
}

#define BLOCK_KERNELS(suffix, T)                                                                   \
  extern "C" __global__ void add_bias_inplace_##suffix(T* y, const T* bias, u64 total, u64 n) {    \
    add_bias_inplace<T>(y, bias, total, n);                                                        \
  }                                                                                                \
  extern "C" __global__ void add_into_columns_##suffix(T* y, const T* delta, u64 rows, u64 total, \
                                                       u64 width, u64 offset) {                    \
    add_into_columns<T>(y, delta, rows, total, width, offset);                                     \
  }                                                                                                \
  extern "C" __global__ void bias_gelu_##suffix(const T* f, const T* bias, T* act, u64 total,      \
                                                u64 n, int has_bias) {                             \
    bias_gelu<T>(f, bias, act, total, n, has_bias);                                                \
  }                                                                                                \
  extern "C" __global__ void bias_gelu_backward_##suffix(const T* f, const T* bias, const T* dg,   \
                                                         T* df, u64 total, u64 n, int has_bias) {  \
    bias_gelu_backward<T>(f, bias, dg, df, total, n, has_bias);                                    \
  }                                                                                                \
  extern "C" __global__ void swiglu_packed_##suffix(const T* gu, T* act, u64 rows, u64 inner) {    \
    swiglu_packed<T>(gu, act, rows, inner);                                                        \
  }                                                                                                \
  extern "C" __global__ void swiglu_packed_backward_##suffix(const T* gu, const T* da, T* dgu,     \
                                                             u64 rows, u64 inner) {                \
    swiglu_packed_backward<T>(gu, da, dgu, rows, inner);                                           \
  }                                                                                                \
  extern "C" __global__ void rotary_heads_##suffix(T* x, const T* cos, const T* sin, u64 rows,     \
                                                   u64 t, u64 heads, u64 first, u64 count, u64 h,  \
                                                   int inverse) {                                  \
    rotary_heads<T>(x, cos, sin, rows, t, heads, first, count, h, inverse);                        \
  }
FOR_EACH_DTYPE(BLOCK_KERNELS)
