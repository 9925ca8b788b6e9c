// Shared by every kernel of fused-kernels: the element types, their arithmetic type, block-wide
// reductions and launch-shape conventions.
//
// Every kernel is a template over the element type T, instantiated for f32, f64, bf16 and f16 as
// `extern "C"` functions named `<kernel>_<suffix>` (suffix f32, f64, bf16, f16), the names the
// Rust side loads. bf16 and f16 are widened to f32 for the arithmetic and rounded once when stored
// (round to nearest even, as the `half` crate does on the CPU); f64 computes in f64.
//
// Row kernels run one block per row (a grid-stride loop over rows when there are more rows than
// blocks); blockDim.x is a multiple of 32, at most 1024, and each thread strides over the row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned long long u64;

// The launch's dynamic shared memory (its shared_mem_bytes) as `T* name`, declared in a kernel's
// body. Every use names one untyped array: nvcc refuses `extern __shared__ T name[]` declared with
// two different T in one file, and every kernel here is instantiated for four dtypes. The CPU
// emulator (fused-kernels/emulator) defines its own.
#ifndef FUSED_KERNELS_EMULATOR
#define DYNAMIC_SHARED(T, name)                                        \
  extern __shared__ __align__(16) unsigned char fk_dynamic_shared_[]; \
  T* name = reinterpret_cast<T*>(fk_dynamic_shared_)
#endif

// The arithmetic type of an element type.
template <typename T> struct AccOf { typedef float type; };
template <> struct AccOf<double> { typedef double type; };

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }

template <typename T> struct Store;
template <> struct Store<float> {
  static __device__ __forceinline__ float from(float a) { return a; }
};
template <> struct Store<double> {
  static __device__ __forceinline__ double from(double a) { return a; }
};
template <> struct Store<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 from(float a) { return __float2bfloat16_rn(a); }
};
template <> struct Store<__half> {
  static __device__ __forceinline__ __half from(float a) { return __float2half_rn(a); }
};

// T rounded from its arithmetic type.
template <typename T>
__device__ __forceinline__ T from_acc(typename AccOf<T>::type a) { return Store<T>::from(a); }

// Math in the arithmetic type without fast-math intrinsics: sqrt and division are correctly
// rounded, expf/logf are within 2 ulp (CUDA's documented bound), so results agree with the CPU
// kernels to a tolerance, not to the bit.
__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_log(float x) { return logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }
__device__ __forceinline__ float acc_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double acc_sqrt(double x) { return sqrt(x); }
// A product nvcc never fuses into a neighbouring addition (it contracts `a * b + c` into one
// multiply-add by default): for a product used in two places whose uses must agree to the bit,
// e.g. a value and the mean it is compared with.
__device__ __forceinline__ float acc_mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double acc_mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float acc_nan(float) { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ double acc_nan(double) { return __longlong_as_double(0x7ff8000000000000ULL); }
__device__ __forceinline__ float acc_neg_inf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double acc_neg_inf(double) { return __longlong_as_double(0xfff0000000000000ULL); }

struct SumOp {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};
// The larger of two values, ignoring a NaN like Rust's `f32::max` (the CPU kernels' fold).
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ __forceinline__ double operator()(double a, double b) const { return fmax(a, b); }
};

template <typename A, typename Op>
__device__ __forceinline__ A warp_reduce(A v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// `op` over one value per thread of the block; every thread gets the result. Warps reduce with
// shuffles, then every thread combines the warps' results in warp order from shared memory, so
// all threads hold the same value and the result depends only on blockDim.x. Must be reached by
// every thread of the block (it synchronizes); may be called repeatedly.
template <typename A, typename Op>
__device__ A block_reduce(A v, Op op) {
  __shared__ A per_warp[32];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  v = warp_reduce(v, op);
  __syncthreads();  // the previous call's readers are done with per_warp
  if (lane == 0) per_warp[warp] = v;
  __syncthreads();
  A r = per_warp[0];
  const unsigned warps = blockDim.x >> 5;
  for (unsigned w = 1; w < warps; ++w) r = op(r, per_warp[w]);
  return r;
}

template <typename A> __device__ __forceinline__ A block_sum(A v) { return block_reduce(v, SumOp()); }
template <typename A> __device__ __forceinline__ A block_max(A v) { return block_reduce(v, MaxOp()); }

// out[j] = Σ_b partial[b · len + j] over `blocks` per-block partial sums, in block order (the same
// result on every run: no atomics), rounded to T. The second pass of every reduction over rows.
template <typename T>
__device__ void sum_partials(const typename AccOf<T>::type* __restrict__ partial, u64 blocks,
                             u64 len, T* __restrict__ out) {
  typedef typename AccOf<T>::type A;
  for (u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x; j < len; j += (u64)blockDim.x * gridDim.x) {
    A s = 0;
    for (u64 b = 0; b < blocks; ++b) s += partial[b * len + j];
    out[j] = from_acc<T>(s);
  }
}

// Instantiates `kernel` (a macro taking the suffix and the element type) for the four dtypes.
#define FOR_EACH_DTYPE(kernel) \
  kernel(f32, float)           \
  kernel(f64, double)          \
  kernel(bf16, __nv_bfloat16)  \
  kernel(f16, __half)
