// Kernels that test the emulator itself (tests/integration/emulator.rs), compiled with fused-kernels'
// kernels by build.rs. Valid CUDA C: each does what its comment says on a GPU too.
#include "common.cuh"

// out[i] = threadIdx.x + 1 of thread i, read by its neighbour through shared memory: with
// `sync` the neighbour reads after the barrier; without, it reads whatever is there (a race).
extern "C" __global__ void emu_test_neighbour(unsigned* out, int sync) {
  __shared__ unsigned cell[1024];
  const unsigned t = threadIdx.x;
  cell[t] = 0;
  __syncthreads();
  cell[t] = t + 1;
  if (sync) __syncthreads();
  out[blockIdx.x * blockDim.x + t] = cell[(t + 1) % blockDim.x];
}

// Two block sums of (t + 1)·(k + 1) through one shared array, as block_reduce in common.cuh
// does. Without `sync`, a warp can overwrite its slot for the second sum before the other warps
// have read the first (the barrier block_reduce begins with is missing).
extern "C" __global__ void emu_test_reuse(float* out, int sync) {
  __shared__ float per_warp[32];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int k = 0; k < 2; ++k) {
    float v = (float)(threadIdx.x + 1) * (float)(k + 1);
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (sync) __syncthreads();
    if (lane == 0) per_warp[warp] = v;
    __syncthreads();
    float r = 0;
    for (unsigned w = 0; w < warps; ++w) r += per_warp[w];
    out[2 * threadIdx.x + k] = r;
  }
}

// Threads below 16 wait at one barrier, the others at another: divergent __syncthreads.
extern "C" __global__ void emu_test_divergent_barrier(unsigned* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
    out[threadIdx.x] = 1;
  } else {
    __syncthreads();
    out[threadIdx.x] = 2;
  }
}

// Lanes below 16 shuffle while the others wait at a barrier: nobody can proceed.
extern "C" __global__ void emu_test_deadlock(float* out) {
  float v = threadIdx.x;
  if (threadIdx.x < 16) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

// Every shuffle and vote of one warp value: out[k · blockDim + t] for the k-th result of thread t.
extern "C" __global__ void emu_test_shuffles(const int* in, int* out, int width, int arg) {
  const unsigned t = threadIdx.x, n = blockDim.x;
  const int v = in[t];
  out[0 * n + t] = __shfl_sync(0xffffffffu, v, arg, width);
  out[1 * n + t] = __shfl_up_sync(0xffffffffu, v, arg, width);
  out[2 * n + t] = __shfl_down_sync(0xffffffffu, v, arg, width);
  out[3 * n + t] = __shfl_xor_sync(0xffffffffu, v, arg, width);
  out[4 * n + t] = (int)__ballot_sync(0xffffffffu, v & 1);
  out[5 * n + t] = __any_sync(0xffffffffu, v > 1000);
  out[6 * n + t] = __all_sync(0xffffffffu, v >= 0);
  out[7 * n + t] = (int)__reduce_add_sync(0xffffffffu, (unsigned)v);
  // A double through a shuffle (two words on a GPU).
  const double d = __shfl_xor_sync(0xffffffffu, (double)v * 0.5, 1);
  out[8 * n + t] = (int)(d * 2.0);
}

// A shuffle with a partial mask.
extern "C" __global__ void emu_test_partial_mask(int* out) {
  out[threadIdx.x] = __shfl_sync(0x0000ffffu, (int)threadIdx.x, 0);
}

// Odd lanes return before the warp shuffles.
extern "C" __global__ void emu_test_exited_lane(int* out) {
  if (threadIdx.x % 2 == 1) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 2);
}

// emu_warp_gather: out[t · 32 + i] = lane i's value as thread t received it.
struct GatherItem {
  int lane;
  float twice;
};
extern "C" __global__ void emu_test_gather(int* lanes, float* values) {
#ifdef FUSED_KERNELS_EMULATOR
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  GatherItem mine{(int)(threadIdx.x % 32), 2.0f * threadIdx.x};
  GatherItem all[32];
  emu_warp_gather(mine, all);
  for (int i = 0; i < 32; ++i) {
    lanes[t * 32 + i] = all[i].lane;
    values[t * 32 + i] = all[i].twice;
  }
#endif
}

// The order in which threads first run: out[t] = ticket of thread t.
extern "C" __global__ void emu_test_ticket(unsigned* counter, unsigned* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = atomicAdd(counter, 1u);
}

// Atomics from every thread of every block (blocks run on several OS threads).
extern "C" __global__ void emu_test_atomics(unsigned long long* count, float* fsum, double* dsum, int* imax,
                                            unsigned* umin, int* cas_winner) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(count, 1ull);
  atomicAdd(fsum, 1.0f);
  atomicAdd(dsum, 0.5);
  atomicMax(imax, t);
  atomicMin(umin, (unsigned)t + 7u);
  atomicCAS(cas_winner, -1, t);
}

// Thread and block indices of a 3-D launch: out[4·g + k] = (threadIdx, blockIdx, linear warp, lane).
extern "C" __global__ void emu_test_indices(unsigned* out) {
  const unsigned tl = threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
  const unsigned bl = blockIdx.x + blockIdx.y * gridDim.x + blockIdx.z * gridDim.x * gridDim.y;
  const unsigned g = bl * (blockDim.x * blockDim.y * blockDim.z) + tl;
  const unsigned lane0 = __shfl_sync(0xffffffffu, tl, 0);
  out[4 * g + 0] = tl;
  out[4 * g + 1] = bl;
  out[4 * g + 2] = lane0;  // the linear index of lane 0 of this thread's warp
  out[4 * g + 3] = __syncthreads_count(tl % 3 == 0);
}

// Dynamic shared memory: each thread writes its slot, then reads its mirror's.
extern "C" __global__ void emu_test_dynamic_shared(float* out) {
  DYNAMIC_SHARED(float, cells);
  const unsigned t = threadIdx.x, n = blockDim.x;
  cells[t] = 10.0f * t;
  __syncthreads();
  out[t] = cells[n - 1 - t];
}

// Writes one element past the end of `out` (n elements).
extern "C" __global__ void emu_test_write_past_end(float* out, unsigned long long n) {
  if (threadIdx.x == 0) out[n] = 1.0f;
}

// Reads 2 KiB past the start of `in` (4 floats): faults in the guard page after it.
extern "C" __global__ void emu_test_read_far(const float* in, float* out) {
  out[0] = in[threadIdx.x + 512];
}

// The conversions of cuda_bf16.h / cuda_fp16.h: float bits in, both rounded bits and the
// round trip out; and 16-bit patterns widened to float.
extern "C" __global__ void emu_test_convert(const unsigned* bits, unsigned short* bf, unsigned short* h,
                                            unsigned long long n) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)blockDim.x * gridDim.x) {
    const float f = __uint_as_float(bits[i]);
    bf[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f));
    h[i] = __half_as_ushort(__float2half_rn(f));
  }
}
extern "C" __global__ void emu_test_widen(const unsigned short* in, unsigned* from_bf, unsigned* from_h,
                                          unsigned long long n) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)blockDim.x * gridDim.x) {
    from_bf[i] = __float_as_uint(__bfloat162float(__ushort_as_bfloat16(in[i])));
    from_h[i] = __float_as_uint(__half2float(__ushort_as_half(in[i])));
    if (i % 2 == 0) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(1.0f, __bfloat162float(__ushort_as_bfloat16(in[i])));
      from_bf[i] = __float_as_uint(__high2float(pair));
    }
  }
}

// A deep recursion that overflows a fiber stack.
__device__ int emu_test_deep(volatile int* p, int n) {
  volatile char pad[512];
  pad[0] = (char)n;
  return n == 0 ? *p : emu_test_deep(p, n - 1) + pad[0];
}
extern "C" __global__ void emu_test_stack_overflow(int* out) { out[0] = emu_test_deep(out, 1 << 20); }

// CUDA's math functions by their CUDA names: out[k · n + i] for function k of x[i].
extern "C" __global__ void emu_test_math(const float* x, float* out, unsigned long long n) {
  for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = x[i];
    const float r[16] = {expf(v),
                         exp2f(v),
                         logf(fabsf(v)),
                         log2f(fabsf(v)),
                         sqrtf(fabsf(v)),
                         rsqrtf(fabsf(v)),
                         tanhf(v),
                         fmaxf(v, 0.25f),
                         fminf(v, 0.25f),
                         erff(v),
                         __expf(v),
                         __logf(fabsf(v)),
                         __fdividef(v, 3.0f),
                         max(v, -0.5f) + min(2, 3),
                         __low2float(__floats2half2_rn(v, -v)) + __high2float(__floats2half2_rn(v, -v)),
                         __ldg(&x[i]) + __uint_as_float(__float_as_uint(v))};
    for (int k = 0; k < 16; ++k) out[k * n + i] = r[k];
  }
}
