// Diagnostics of memory faults in device code (see fault.h).
#include "fault.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "block.h"
#include "memory.h"

namespace emu {

namespace {

struct sigaction g_previous_segv;
struct sigaction g_previous_bus;
constexpr std::size_t kAltStackSize = 64 * 1024;

void chain(int sig, siginfo_t* info, void* context) {
  const struct sigaction& previous = sig == SIGSEGV ? g_previous_segv : g_previous_bus;
  if ((previous.sa_flags & SA_SIGINFO) && previous.sa_sigaction) {
    previous.sa_sigaction(sig, info, context);
    return;
  }
  if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN && previous.sa_handler) {
    previous.sa_handler(sig);
    return;
  }
  // The default action: returning re-executes the faulting access, which then kills the process.
  signal(sig, SIG_DFL);
}

void on_fault(int sig, siginfo_t* info, void* context) {
  BlockRun* run = tls_run;
  if (!run || !run->current()) {
    chain(sig, info, context);
    return;
  }
  char what[160];
  if (run->owns_stack_guard(info->si_addr)) {
    std::snprintf(what, sizeof what, "the thread's %zu-byte fiber stack overflowed (deep recursion or a large local array)",
                  kStackSize);
  } else if (!buffer_describe_fault(info->si_addr, what, sizeof what)) {
    std::snprintf(what, sizeof what, "the address is in no emulator buffer (a wild or null pointer, or a freed buffer)");
  }
  const uint3 b = run->view().block_idx, t = run->current()->view.thread_idx;
  char msg[512];
  const int n = std::snprintf(msg, sizeof msg,
                              "fused-kernels-emulator: kernel '%s', block (%u, %u, %u), thread (%u, %u, %u): invalid "
                              "memory access at %p: %s\n",
                              run->kernel_name(), b.x, b.y, b.z, t.x, t.y, t.z, info->si_addr, what);
  if (n > 0) {
    ssize_t ignored = write(2, msg, static_cast<std::size_t>(n) < sizeof msg ? static_cast<std::size_t>(n) : sizeof msg - 1);
    (void)ignored;
  }
  signal(SIGABRT, SIG_DFL);
  std::abort();
}

}  // namespace

void fault_handler_install() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action;
    std::memset(&action, 0, sizeof action);
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &g_previous_segv);
    sigaction(SIGBUS, &action, &g_previous_bus);
  });
}

void* fault_stack_ensure() {
  stack_t current;
  if (sigaltstack(nullptr, &current) == 0 && !(current.ss_flags & SS_DISABLE)) return nullptr;
  void* memory = std::malloc(kAltStackSize);
  if (!memory) return nullptr;
  stack_t s;
  s.ss_sp = memory;
  s.ss_size = kAltStackSize;
  s.ss_flags = 0;
  if (sigaltstack(&s, nullptr) != 0) {
    std::free(memory);
    return nullptr;
  }
  return memory;
}

void fault_stack_remove(void* token) {
  if (!token) return;
  stack_t s;
  std::memset(&s, 0, sizeof s);
  s.ss_flags = SS_DISABLE;
  sigaltstack(&s, nullptr);
  std::free(token);
}

}  // namespace emu
