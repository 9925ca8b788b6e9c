// One warp-wide tensor-core product, D = A·B + C, of shape m16n8k16: A 16×16 and B 16×8 in bf16 or
// f16, C and D 16×8 in f32 (PTX `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32`,
// sm_80 and newer), with the operands spread over the warp's 32 lanes in registers.
//
// Fragment layouts, from the PTX ISA, section 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with
// floating point type" (groupID = %laneid >> 2, threadID_in_group = %laneid % 4; g and t below).
// A register of A or B holds two 16-bit elements, the one of lower index in the low 16 bits.
//   A (row-major 16×16, `a[4]`, elements a0..a7 two per register):
//     row = g      for a0, a1, a4, a5;  g + 8 otherwise
//     col = 2t + (i & 1) for ai, i < 4;  2t + (i & 1) + 8 for i >= 4
//     so a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1], a[2] = A[g][2t+8..2t+9],
//        a[3] = A[g+8][2t+8..2t+9].
//   B (16×8, "col": `b[2]`, elements b0..b3):
//     row = 2t + (i & 1) for bi, i < 2;  2t + (i & 1) + 8 for i >= 2;  col = g
//     so b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g].
//   C, D (16×8 f32, `c[4]`):
//     row = g for c0, c1;  g + 8 for c2, c3;  col = 2t + (i & 1)
//
// The layouts make a C/D fragment of two adjacent 8-column products the A fragment of a product
// over those 16 columns (FlashAttention-2 keeps the probabilities in registers that way):
// A[g][2t..] of columns 0..15 is c0, c1 of the first product, A[g+8][2t..] its c2, c3, and the same
// of the second product for columns 8..15.
//
// mma_m16n8k16<T> has three implementations, by where the code runs:
//   - nvcc for sm_80+: the PTX instruction;
//   - nvcc for older GPUs: mma_m16n8k16_shuffled, the same arithmetic from warp shuffles (slow,
//     but the kernels still run);
//   - the CPU emulator (FUSED_KERNELS_EMULATOR, fused-kernels/emulator): every lane gathers the
//     warp's fragments with emu_warp_gather and computes its own four results from the layouts
//     above, summing the 16 products in k order in f32 (bf16 and f16 products are exact in f32).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// The f32 value of a bf16 or f16 held as bits.
template <typename T> struct MmaElement;
template <> struct MmaElement<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(unsigned short bits) {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
  static __device__ __forceinline__ unsigned short from_float(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
};
template <> struct MmaElement<__half> {
  static __device__ __forceinline__ float to_float(unsigned short bits) {
    return __half2float(__ushort_as_half(bits));
  }
  static __device__ __forceinline__ unsigned short from_float(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
};

// Two floats rounded to T (nearest even) in one register, `lo` in the low half: the element of
// lower index in an A or B fragment register.
template <typename T>
__device__ __forceinline__ uint32_t mma_pack(float lo, float hi) {
  return (uint32_t)MmaElement<T>::from_float(lo) | ((uint32_t)MmaElement<T>::from_float(hi) << 16);
}

// The element of index `half` (0: low 16 bits, 1: high) of a fragment register, as f32.
template <typename T>
__device__ __forceinline__ float mma_unpack(uint32_t reg, int half) {
  return MmaElement<T>::to_float((unsigned short)(half ? reg >> 16 : reg & 0xffffu));
}

// The product from warp shuffles, for GPUs before sm_80 (and a test of the layouts in the
// emulator): every lane fetches the registers holding its rows of A and columns of B with
// shuffles (uniform register indices, per-lane source lanes) and sums in k order.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16_shuffled(float c[4], const uint32_t a[4],
                                                      const uint32_t b[2]) {
  const int lane = (int)(threadIdx.x & 31u), g = lane >> 2, t = lane & 3;
  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int kp = 0; kp < 8; ++kp) {  // k = 2kp, 2kp + 1
    const int reg_hi = kp / 4, src = kp % 4;
    // A rows g (register 2·reg_hi) and g + 8 (register 2·reg_hi + 1), from lane g·4 + src.
    const uint32_t a0 = __shfl_sync(0xffffffffu, a[2 * reg_hi], g * 4 + src);
    const uint32_t a1 = __shfl_sync(0xffffffffu, a[2 * reg_hi + 1], g * 4 + src);
    // B columns 2t and 2t + 1, from lanes (2t)·4 + src and (2t + 1)·4 + src.
    const uint32_t b0 = __shfl_sync(0xffffffffu, b[reg_hi], (2 * t) * 4 + src);
    const uint32_t b1 = __shfl_sync(0xffffffffu, b[reg_hi], (2 * t + 1) * 4 + src);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float x0 = mma_unpack<T>(a0, h), x1 = mma_unpack<T>(a1, h);
      const float y0 = mma_unpack<T>(b0, h), y1 = mma_unpack<T>(b1, h);
      sum[0] += x0 * y0;
      sum[1] += x0 * y1;
      sum[2] += x1 * y0;
      sum[3] += x1 * y1;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) c[i] += sum[i];
}

#if defined(FUSED_KERNELS_EMULATOR)

// A[row][k] lies in lane (row % 8)·4 + (k % 8) / 2, register row / 8 + 2·(k / 8), half k % 2 (the
// inverse of the layout above); B[k][col] in lane col·4 + (k % 8) / 2, register k / 8, half k % 2.
struct MmaOperands {
  uint32_t a[4];
  uint32_t b[2];
};

template <typename T>
inline void mma_m16n8k16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  MmaOperands mine, all[32];
  for (int i = 0; i < 4; ++i) mine.a[i] = a[i];
  for (int i = 0; i < 2; ++i) mine.b[i] = b[i];
  emu_warp_gather(mine, all);
  const int lane = (int)(threadIdx.x & 31u), g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) {
      const float x = mma_unpack<T>(all[(row % 8) * 4 + (k % 8) / 2].a[row / 8 + 2 * (k / 8)], k % 2);
      const float y = mma_unpack<T>(all[col * 4 + (k % 8) / 2].b[k / 8], k % 2);
      sum += x * y;
    }
    c[i] += sum;
  }
}

#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float c[4], const uint32_t a[4], const uint32_t b[2]);

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float c[4], const uint32_t a[4],
                                                            const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float c[4], const uint32_t a[4],
                                                     const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#else

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  mma_m16n8k16_shuffled<T>(c, a, b);
}

#endif
