// Fiber stacks and context switches (see fiber.h).
#include "fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace emu {

namespace {
std::mutex g_stack_mutex;
std::vector<Stack> g_free_stacks;
}  // namespace

Stack stack_acquire() {
  {
    std::lock_guard<std::mutex> lock(g_stack_mutex);
    if (!g_free_stacks.empty()) {
      Stack s = g_free_stacks.back();
      g_free_stacks.pop_back();
      return s;
    }
  }
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  void* map = mmap(nullptr, kStackSize + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (map == MAP_FAILED) {
    std::fprintf(stderr, "fused-kernels-emulator: cannot map a %zu-byte fiber stack\n", kStackSize);
    std::abort();
  }
  mprotect(map, page, PROT_NONE);
  Stack s;
  s.guard = static_cast<char*>(map);
  s.guard_size = page;
  s.base = s.guard + page;
  s.size = kStackSize;
  return s;
}

void stack_release(const Stack& stack) {
  std::lock_guard<std::mutex> lock(g_stack_mutex);
  g_free_stacks.push_back(stack);
}

#ifdef EMU_FIBER_ASM

// emu_context_switch(void** save_sp, void* load_sp): pushes the callee-saved registers and the
// SSE/x87 control words on the current stack, saves its pointer, loads the other one and pops
// them. A new context starts in emu_context_start with the entry in r13 and its argument in r12.
extern "C" void emu_context_switch(void** save_sp, void* load_sp);
extern "C" void emu_context_start();
asm(R"(
    .text
    .p2align 4
    .globl emu_context_switch
    .hidden emu_context_switch
    .type emu_context_switch, @function
emu_context_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_context_switch, .-emu_context_switch

    .p2align 4
    .globl emu_context_start
    .hidden emu_context_start
    .type emu_context_start, @function
emu_context_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size emu_context_start, .-emu_context_start
)");

void context_init(Context* ctx, const Stack& stack, void (*entry)(void*), void* arg) {
  std::uintptr_t top = reinterpret_cast<std::uintptr_t>(stack.base + stack.size) & ~std::uintptr_t(15);
  std::uint64_t* sp = reinterpret_cast<std::uint64_t*>(top);
  std::uint32_t mxcsr;
  std::uint16_t fcw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fcw));
  *--sp = reinterpret_cast<std::uint64_t>(&emu_context_start);  // returned to by the first switch
  *--sp = 0;                                                     // rbp
  *--sp = 0;                                                     // rbx
  *--sp = reinterpret_cast<std::uint64_t>(arg);                  // r12
  *--sp = reinterpret_cast<std::uint64_t>(entry);                // r13
  *--sp = 0;                                                     // r14
  *--sp = 0;                                                     // r15
  *--sp = static_cast<std::uint64_t>(mxcsr) | (static_cast<std::uint64_t>(fcw) << 32);
  ctx->sp = sp;
}

void context_switch(Context* from, Context* to) { emu_context_switch(&from->sp, to->sp); }

#else

namespace {
// makecontext passes int arguments only: a new fiber finds its context through the OS thread.
thread_local Context* t_switching_to;
void start_fiber() {
  Context* c = t_switching_to;
  c->entry(c->arg);
  std::abort();
}
}  // namespace

void context_init(Context* ctx, const Stack& stack, void (*entry)(void*), void* arg) {
  getcontext(&ctx->uc);
  ctx->uc.uc_stack.ss_sp = stack.base;
  ctx->uc.uc_stack.ss_size = stack.size;
  ctx->uc.uc_link = nullptr;
  ctx->entry = entry;
  ctx->arg = arg;
  makecontext(&ctx->uc, start_fiber, 0);
}

void context_switch(Context* from, Context* to) {
  t_switching_to = to;
  swapcontext(&from->uc, &to->uc);
}

#endif

}  // namespace emu
