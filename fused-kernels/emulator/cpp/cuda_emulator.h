// What CUDA device code uses, for g++: fused-kernels-emulator compiles every
// fused-kernels/src/cuda/*.cu with `-include cuda_emulator.h` and runs its kernels on the CPU with
// CUDA's execution model (see ../README.md). C++17.
//
// - Function qualifiers (__global__, __device__, ...) expand to nothing or to g++ attributes.
// - `__shared__` is `static thread_local`: a block's threads are fibers of one OS thread, and an
//   OS thread runs one block at a time, so a thread-local static is the block's shared variable.
//   Dynamic shared memory is DYNAMIC_SHARED(T, name) (an `extern __shared__` array under nvcc).
// - threadIdx, blockIdx, blockDim, gridDim read the current fiber's and block's state.
// - Barriers and warp collectives suspend the fiber until the block or warp arrives (runtime.h,
//   warp.h); atomics are real atomics (blocks run in parallel).
#pragma once

#define FUSED_KERNELS_EMULATOR_HEADER 1

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <climits>
#include <cfloat>

#ifdef FUSED_KERNELS_EMULATOR_SCAN
// Only while build.rs preprocesses a .cu to find its kernels: the marker survives macro expansion.
#define __global__ __fused_kernels_emulator_kernel__
#else
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__
#define __managed__
#define __shared__ static thread_local
#define __grid_constant__
#define __CUDACC_EMULATOR__ 1

#include "emu/vector_types.h"
#include "emu/fp16.h"
#include "emu/device_math.h"
#include "emu/runtime.h"
#include "emu/warp.h"
#include "emu/atomics.h"
