// Kernels that test mma.cuh (tests/integration/flash_attention.rs): one warp loads a row-major A
// (16×16) and B (16×8) into fragments by the PTX ISA's layout formulas (section 9.7.14.5.8,
// written out again here from the table, independently of mma.cuh's inverse of them), adds
// A·B to C with mma_m16n8k16 and with mma_m16n8k16_shuffled, and stores both D row-major.
// Valid CUDA C for sm_80+.
#include "common.cuh"
#include "mma.cuh"

template <typename T>
__device__ void emu_test_mma(const T* a_, const T* b_, const float* c, float* d, float* d_shuffled) {
  const unsigned short* a = reinterpret_cast<const unsigned short*>(a_);
  const unsigned short* b = reinterpret_cast<const unsigned short*>(b_);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint32_t af[4], bf[2];
  for (int r = 0; r < 4; ++r) {  // register r: elements a_{2r} (low half), a_{2r+1}
    uint32_t e[2];
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * r + h;
      const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const int col = i < 4 ? t * 2 + (i & 1) : t * 2 + (i & 1) + 8;
      e[h] = a[row * 16 + col];
    }
    af[r] = e[0] | (e[1] << 16);
  }
  for (int r = 0; r < 2; ++r) {  // register r: elements b_{2r}, b_{2r+1}
    uint32_t e[2];
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * r + h;
      const int row = i < 2 ? t * 2 + (i & 1) : t * 2 + (i & 1) + 8;
      e[h] = b[row * 8 + g];
    }
    bf[r] = e[0] | (e[1] << 16);
  }
  float acc[4], acc2[4];
  for (int i = 0; i < 4; ++i) {
    const int row = i < 2 ? g : g + 8, col = t * 2 + (i & 1);
    acc[i] = acc2[i] = c[row * 8 + col];
  }
  mma_m16n8k16<T>(acc, af, bf);
  mma_m16n8k16_shuffled<T>(acc2, af, bf);
  for (int i = 0; i < 4; ++i) {
    const int row = i < 2 ? g : g + 8, col = t * 2 + (i & 1);
    d[row * 8 + col] = acc[i];
    d_shuffled[row * 8 + col] = acc2[i];
  }
}

extern "C" __global__ void emu_test_mma_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b,
                                             const float* c, float* d, float* d_shuffled) {
  emu_test_mma(a, b, c, d, d_shuffled);
}
extern "C" __global__ void emu_test_mma_f16(const __half* a, const __half* b, const float* c,
                                            float* d, float* d_shuffled) {
  emu_test_mma(a, b, c, d, d_shuffled);
}
