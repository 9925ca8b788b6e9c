// One thread block's execution: its threads as fibers on the calling OS thread, run in a fixed
// order (increasing or decreasing thread index) until each exits or waits at a barrier or warp
// collective; a barrier or collective releases its waiters when the last participant arrives.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../emu/abi.h"
#include "../emu/runtime.h"
#include "../emu/warp.h"
#include "fiber.h"

namespace emu {

enum class Order { kIncreasing = 0, kDecreasing = 1 };

enum class FiberState : std::uint8_t { kReady, kBarrier, kWarp, kExited };

struct Fiber {
  ThreadView view;
  unsigned linear = 0;  // x + y·bx + z·bx·by: the warp is linear / 32, the lane linear % 32
  FiberState state = FiberState::kReady;
  Context context;
  Stack stack;
  // Where it waits (a barrier or a collective) and, for a barrier, how many it passed before.
  const char* wait_name = nullptr;
  const char* file = nullptr;
  int line = 0;
  std::uint64_t barriers_passed = 0;
  int predicate = 0;
  int barrier_mode = 0;
  // Its part in the warp collective it waits in.
  LaneRecord record{};
  Resolve resolve = nullptr;
  int width = 0;
};

struct Warp {
  int size = 0;     // lanes that exist (32 unless blockDim's thread count is not a multiple of 32)
  int arrived = 0;  // lanes waiting in the current collective
  int exited = 0;
  Fiber* first = nullptr;  // the first lane to arrive, whose collective the others must match
};

// The state of the block an OS thread is running, reused for every block it runs in a launch.
class BlockRun {
 public:
  // Allocates the fibers' stacks of a launch with `block` threads per block.
  BlockRun(const KernelEntry* kernel, void* const* args, dim3 grid, dim3 block, std::size_t dynamic_shared,
           Order order);
  ~BlockRun();
  BlockRun(const BlockRun&) = delete;
  BlockRun& operator=(const BlockRun&) = delete;

  // Runs block `idx` to completion; false with error() set if the kernel failed or deadlocked.
  bool run(uint3 idx);
  const std::string& error() const { return error_; }

  // Entry points of device code (the current fiber is the caller).
  int barrier(int predicate, int mode, const char* file, int line);
  void collective(const char* name, Resolve resolve, unsigned mask, const void* in, void* out, int arg, int width,
                  const char* file, int line);
  [[noreturn]] void fail(const std::string& message);
  bool owns_stack_guard(const void* address) const;
  const char* kernel_name() const { return kernel_->name; }
  const Fiber* current() const { return current_; }
  const BlockView& view() const { return view_; }

 private:
  static void fiber_main(void* fiber);
  [[noreturn]] void exit_current();
  void suspend();
  void release_barrier();
  std::string deadlock_report() const;
  std::string where() const;

  const KernelEntry* kernel_;
  void* const* args_;
  Order order_;
  BlockView view_{};
  std::vector<unsigned char> dynamic_shared_;
  std::vector<Fiber> fibers_;
  std::vector<Warp> warps_;
  Context scheduler_;
  Fiber* current_ = nullptr;
  int live_ = 0;
  int at_barrier_ = 0;
  int barrier_result_ = 0;
  bool failed_ = false;
  bool restart_pass_ = false;
  std::string error_;
};

// The block the calling OS thread runs, or null outside a launch.
extern __thread BlockRun* tls_run;

}  // namespace emu
