// Fibers: execution contexts with their own stacks, switched cooperatively on one OS thread. On
// x86-64 a hand-written switch saves the callee-saved registers and the floating-point control
// words (a few nanoseconds; swapcontext makes a system call per switch); elsewhere, or with
// FUSED_KERNELS_EMULATOR_UCONTEXT defined, makecontext/swapcontext.
#pragma once

#include <cstddef>

#if defined(__x86_64__) && !defined(FUSED_KERNELS_EMULATOR_UCONTEXT)
#define EMU_FIBER_ASM 1
#else
#include <ucontext.h>
#endif

namespace emu {

// A fiber's stack: `size` usable bytes above a guard page that faults on overflow.
struct Stack {
  char* base = nullptr;  // the lowest usable byte
  std::size_t size = 0;
  char* guard = nullptr;  // the guard page, just below base
  std::size_t guard_size = 0;
};

// The usable size of every fiber stack.
constexpr std::size_t kStackSize = 64 * 1024;

// A stack from the process-wide pool (mapped on first need, reused across launches).
Stack stack_acquire();
void stack_release(const Stack& stack);

// A saved execution context.
struct Context {
#ifdef EMU_FIBER_ASM
  void* sp = nullptr;
#else
  ucontext_t uc;
  void (*entry)(void*) = nullptr;
  void* arg = nullptr;
#endif
};

// Prepares `ctx` to run entry(arg) on `stack` when first switched to. `entry` must never return
// (it switches away for the last time instead).
void context_init(Context* ctx, const Stack& stack, void (*entry)(void*), void* arg);

// Saves the running context into `from` and resumes `to`.
void context_switch(Context* from, Context* to);

}  // namespace emu
