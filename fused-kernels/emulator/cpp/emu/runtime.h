// What device code reaches of the runtime: the current thread's indices, block barriers, errors,
// dynamic shared memory and the fences. Each CUDA thread of a block is a fiber on the OS thread
// that runs the block, so the current thread's state is in `__thread` variables of that OS thread
// (the scheduler points them at the fiber it switches to).
#pragma once

#include "vector_types.h"

namespace emu {

// The per-fiber view device code reads (the first member of the runtime's fiber).
struct ThreadView {
  uint3 thread_idx;
};

// The per-block view (the block's index, the launch's shape, its dynamic shared memory).
struct BlockView {
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  unsigned char* dynamic_shared;
  unsigned long dynamic_shared_bytes;
};

extern __thread const ThreadView* tls_thread;
extern __thread const BlockView* tls_block;

// Ends the launch with an error: "kernel K, block (..), thread (..): <message>". Never returns.
[[noreturn]] void fail(const char* format, ...) __attribute__((format(printf, 1, 2)));

// __syncthreads and its counting variants: every non-exited thread of the block must reach a
// barrier at the same place, the same number of times.
int block_barrier(int predicate, int mode, const char* file, int line);
enum BarrierMode { kBarrierPlain = 0, kBarrierCount = 1, kBarrierAnd = 2, kBarrierOr = 3 };

}  // namespace emu

#define threadIdx (::emu::tls_thread->thread_idx)
#define blockIdx (::emu::tls_block->block_idx)
#define blockDim (::emu::tls_block->block_dim)
#define gridDim (::emu::tls_block->grid_dim)
static constexpr int warpSize = 32;

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::emu::block_barrier(1, ::emu::kBarrierPlain, file, line);
}
inline int __syncthreads_count(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::emu::block_barrier(predicate, ::emu::kBarrierCount, file, line);
}
inline int __syncthreads_and(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::emu::block_barrier(predicate, ::emu::kBarrierAnd, file, line);
}
inline int __syncthreads_or(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::emu::block_barrier(predicate, ::emu::kBarrierOr, file, line);
}

// Fences: the block's threads share one OS thread, so a block fence only has to stop the compiler
// from moving memory accesses across it; blocks run on several OS threads, so a device fence is a
// real one.
inline void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

[[noreturn]] inline void __trap() { ::emu::fail("the kernel called __trap()"); }
inline void __nanosleep(unsigned int) {}

// The launch's dynamic shared memory (its shared_mem_bytes) as `T* name`. Under nvcc the same
// macro (src/cuda/common.cuh) declares it `extern __shared__`.
#define DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::emu::tls_block->dynamic_shared)
