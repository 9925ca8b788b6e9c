// The block scheduler, barriers and warp collectives (see block.h, warp.h and runtime.h).
#include "block.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>

namespace emu {

__thread const ThreadView* tls_thread = nullptr;
__thread const BlockView* tls_block = nullptr;
__thread BlockRun* tls_run = nullptr;

namespace {

std::string format(const char* fmt, va_list ap) {
  va_list copy;
  va_copy(copy, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string s(n > 0 ? static_cast<std::size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(&s[0], s.size() + 1, fmt, ap);
  return s;
}

std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string strf(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = format(fmt, ap);
  va_end(ap);
  return s;
}

std::string triple(uint3 v) { return strf("(%u, %u, %u)", v.x, v.y, v.z); }

// "0-15, 17, 20-31" for sorted indices.
std::string ranges(const std::vector<unsigned>& ids) {
  std::string s;
  for (std::size_t i = 0; i < ids.size();) {
    std::size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!s.empty()) s += ", ";
    s += j == i ? strf("%u", ids[i]) : strf("%u-%u", ids[i], ids[j]);
    i = j + 1;
  }
  return s;
}

std::string site(const char* file, int line) { return strf("%s:%d", file ? file : "?", line); }

}  // namespace

BlockRun::BlockRun(const KernelEntry* kernel, void* const* args, dim3 grid, dim3 block, std::size_t dynamic_shared,
                   Order order)
    : kernel_(kernel), args_(args), order_(order), dynamic_shared_(dynamic_shared + 16) {
  view_.block_dim = block;
  view_.grid_dim = grid;
  // 16-byte alignment, as CUDA's shared memory gives vector types.
  std::uintptr_t p = reinterpret_cast<std::uintptr_t>(dynamic_shared_.data());
  view_.dynamic_shared = dynamic_shared_.data() + ((16 - p % 16) % 16);
  view_.dynamic_shared_bytes = dynamic_shared;
  const unsigned n = block.x * block.y * block.z;
  fibers_.resize(n);
  warps_.resize((n + 31) / 32);
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = fibers_[i];
    f.linear = i;
    f.view.thread_idx = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
    f.stack = stack_acquire();
  }
  for (std::size_t w = 0; w < warps_.size(); ++w) {
    warps_[w].size = static_cast<int>(n - w * 32 < 32 ? n - w * 32 : 32);
  }
}

BlockRun::~BlockRun() {
  for (Fiber& f : fibers_) stack_release(f.stack);
}

bool BlockRun::owns_stack_guard(const void* address) const {
  const char* a = static_cast<const char*>(address);
  for (const Fiber& f : fibers_) {
    if (a >= f.stack.guard && a < f.stack.guard + f.stack.guard_size) return true;
  }
  return false;
}

std::string BlockRun::where() const {
  std::string s = strf("kernel '%s', block %s", kernel_->name, triple(view_.block_idx).c_str());
  if (current_) s += ", thread " + triple(current_->view.thread_idx);
  return s;
}

void BlockRun::fiber_main(void* p) {
  Fiber* f = static_cast<Fiber*>(p);
  BlockRun* run = tls_run;
  (void)f;
  run->kernel_->invoke(run->args_);
  run->exit_current();
}

bool BlockRun::run(uint3 idx) {
  view_.block_idx = idx;
  // Shared memory starts with garbage on a GPU: poison it so a kernel that reads it before
  // writing it computes NaN-ish values instead of the zeros of a fresh allocation.
  std::memset(view_.dynamic_shared, 0xFF, view_.dynamic_shared_bytes);
  for (Fiber& f : fibers_) {
    f.state = FiberState::kReady;
    f.barriers_passed = 0;
    context_init(&f.context, f.stack, &BlockRun::fiber_main, &f);
  }
  for (Warp& w : warps_) {
    w.arrived = 0;
    w.exited = 0;
    w.first = nullptr;
  }
  live_ = static_cast<int>(fibers_.size());
  at_barrier_ = 0;
  failed_ = false;
  error_.clear();
  BlockRun* const saved_run = tls_run;
  const BlockView* const saved_block = tls_block;
  tls_run = this;
  tls_block = &view_;
  const int n = static_cast<int>(fibers_.size());
  bool ok = true;
  for (;;) {
    int ran = 0;
    restart_pass_ = false;
    // A released barrier starts a new pass: the block's threads resume from the first in order.
    for (int k = 0; k < n && !failed_ && !restart_pass_; ++k) {
      Fiber& f = fibers_[order_ == Order::kIncreasing ? k : n - 1 - k];
      if (f.state != FiberState::kReady) continue;
      current_ = &f;
      tls_thread = &f.view;
      context_switch(&scheduler_, &f.context);
      ++ran;
    }
    current_ = nullptr;
    tls_thread = nullptr;
    if (failed_) {
      ok = false;
      break;
    }
    if (live_ == 0) break;
    if (ran == 0) {
      error_ = deadlock_report();
      ok = false;
      break;
    }
  }
  tls_run = saved_run;
  tls_block = saved_block;
  return ok;
}

void BlockRun::suspend() { context_switch(&current_->context, &scheduler_); }

void BlockRun::fail(const std::string& message) {
  if (!current_) {
    std::fprintf(stderr, "fused-kernels-emulator: %s: %s\n", where().c_str(), message.c_str());
    std::abort();
  }
  error_ = where() + ": " + message;
  failed_ = true;
  context_switch(&current_->context, &scheduler_);
  std::abort();  // a failed fiber is never resumed
}

void BlockRun::exit_current() {
  Fiber* f = current_;
  f->state = FiberState::kExited;
  --live_;
  Warp& w = warps_[f->linear / 32];
  ++w.exited;
  if (w.arrived > 0) {
    std::vector<unsigned> waiting;
    for (Fiber& g : fibers_) {
      if (g.linear / 32 == f->linear / 32 && g.state == FiberState::kWarp) waiting.push_back(g.linear);
    }
    fail(strf("the thread exited while threads %s of its warp wait in %s at %s: a warp collective needs all 32 "
              "lanes of the warp (return only after the last collective, or keep every lane in the loop)",
              ranges(waiting).c_str(), w.first->wait_name, site(w.first->file, w.first->line).c_str()));
  }
  if (at_barrier_ > 0 && at_barrier_ == live_) release_barrier();
  context_switch(&f->context, &scheduler_);
  std::abort();  // an exited fiber is never resumed
}

int BlockRun::barrier(int predicate, int mode, const char* file, int line) {
  Fiber* f = current_;
  f->state = FiberState::kBarrier;
  f->wait_name = mode == kBarrierPlain   ? "__syncthreads"
                 : mode == kBarrierCount ? "__syncthreads_count"
                 : mode == kBarrierAnd   ? "__syncthreads_and"
                                         : "__syncthreads_or";
  f->file = file;
  f->line = line;
  f->predicate = predicate;
  f->barrier_mode = mode;
  ++at_barrier_;
  // The last to arrive releases the others and waits its turn too, so that after the barrier the
  // threads start again in the chosen order.
  if (at_barrier_ == live_) release_barrier();
  suspend();
  ++f->barriers_passed;
  return barrier_result_;
}

// Every running thread waits at a barrier: they must wait at the same one (same place, same
// count of barriers passed), else the block's threads diverged around a __syncthreads.
void BlockRun::release_barrier() {
  const Fiber* first = nullptr;
  bool same = true;
  int count = 0, all = 1, any = 0;
  for (const Fiber& f : fibers_) {
    if (f.state != FiberState::kBarrier) continue;
    if (!first) {
      first = &f;
    } else if (f.line != first->line || std::strcmp(f.file, first->file) != 0 ||
               f.barriers_passed != first->barriers_passed || f.barrier_mode != first->barrier_mode) {
      same = false;
    }
    count += f.predicate != 0;
    all &= f.predicate != 0;
    any |= f.predicate != 0;
  }
  if (!same) {
    std::map<std::tuple<std::string, int, std::uint64_t, std::string>, std::vector<unsigned>> groups;
    for (const Fiber& f : fibers_) {
      if (f.state == FiberState::kBarrier) {
        groups[std::make_tuple(std::string(f.file), f.line, f.barriers_passed, std::string(f.wait_name))].push_back(
            f.linear);
      }
    }
    std::string detail;
    for (const auto& g : groups) {
      if (!detail.empty()) detail += "; ";
      detail += strf("threads %s at %s (%s) after passing %llu barrier(s)", ranges(g.second).c_str(),
                     site(std::get<0>(g.first).c_str(), std::get<1>(g.first)).c_str(), std::get<3>(g.first).c_str(),
                     static_cast<unsigned long long>(std::get<2>(g.first)));
    }
    const Fiber* saved = current_;
    current_ = nullptr;  // the error is the block's, not one thread's
    error_ = where() + ": divergent __syncthreads: every running thread waits at a barrier, but not at the same one (" +
             detail +
             "); __syncthreads must be reached by all threads of the block the same number of times, so keep it out "
             "of conditions and loops that differ between threads";
    current_ = const_cast<Fiber*>(saved);
    failed_ = true;
    if (current_) {
      context_switch(&current_->context, &scheduler_);
      std::abort();
    }
    return;
  }
  switch (first ? first->barrier_mode : kBarrierPlain) {
    case kBarrierCount: barrier_result_ = count; break;
    case kBarrierAnd: barrier_result_ = all; break;
    case kBarrierOr: barrier_result_ = any; break;
    default: barrier_result_ = 0; break;
  }
  for (Fiber& f : fibers_) {
    if (f.state == FiberState::kBarrier) f.state = FiberState::kReady;
  }
  at_barrier_ = 0;
  restart_pass_ = true;
}

void BlockRun::collective(const char* name, Resolve resolve, unsigned mask, const void* in, void* out, int arg,
                          int width, const char* file, int line) {
  Fiber* f = current_;
  Warp& w = warps_[f->linear / 32];
  if (mask != 0xffffffffu) {
    fail(strf("%s at %s with mask 0x%08x: the emulator runs warp collectives on full warps only (mask 0xffffffff, "
              "every lane participating)",
              name, site(file, line).c_str(), mask));
  }
  if (w.size != 32) {
    fail(strf("%s at %s in a warp of %d threads: the block has %u threads, not a multiple of 32, so its last warp "
              "is partial and a full-mask collective there is undefined; use a multiple of 32 threads per block",
              name, site(file, line).c_str(), w.size, view_.block_dim.x * view_.block_dim.y * view_.block_dim.z));
  }
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    fail(strf("%s at %s with width %d: the width must be a power of two from 1 to 32", name, site(file, line).c_str(),
              width));
  }
  if (w.exited > 0) {
    std::vector<unsigned> gone;
    for (const Fiber& g : fibers_) {
      if (g.linear / 32 == f->linear / 32 && g.state == FiberState::kExited) gone.push_back(g.linear);
    }
    fail(strf("%s at %s: threads %s of this warp have already exited, and a warp collective needs all 32 lanes "
              "(return only after the last collective, or keep every lane in the loop)",
              name, site(file, line).c_str(), ranges(gone).c_str()));
  }
  f->wait_name = name;
  f->file = file;
  f->line = line;
  f->record = LaneRecord{in, out, arg};
  f->resolve = resolve;
  f->width = width;
  if (w.arrived == 0) {
    w.first = f;
  } else if (std::strcmp(w.first->wait_name, name) != 0 || w.first->resolve != resolve || w.first->width != width) {
    fail(strf("the lanes of warp %u reached different warp collectives: this thread %s (width %d) at %s, thread %u "
              "%s (width %d) at %s; every lane must execute the same collective with the same width",
              f->linear / 32, name, width, site(file, line).c_str(), w.first->linear, w.first->wait_name,
              w.first->width, site(w.first->file, w.first->line).c_str()));
  }
  if (++w.arrived < 32) {
    f->state = FiberState::kWarp;
    suspend();
    return;
  }
  // The last lane computes every lane's result, releases the others and waits its turn too (the
  // lanes continue in the chosen order).
  LaneRecord records[32];
  Fiber* lanes = &fibers_[(f->linear / 32) * 32];
  for (int lane = 0; lane < 32; ++lane) {
    records[lane] = lanes[lane].record;
    lanes[lane].state = FiberState::kReady;
  }
  w.arrived = 0;
  w.first = nullptr;
  resolve(records, width);
  suspend();
}

std::string BlockRun::deadlock_report() const {
  std::map<std::tuple<std::string, std::string, int>, std::vector<unsigned>> groups;
  unsigned exited = 0;
  for (const Fiber& f : fibers_) {
    if (f.state == FiberState::kExited) {
      ++exited;
    } else {
      groups[std::make_tuple(std::string(f.wait_name ? f.wait_name : "?"), std::string(f.file ? f.file : "?"), f.line)]
          .push_back(f.linear);
    }
  }
  std::string detail;
  for (const auto& g : groups) {
    if (!detail.empty()) detail += "; ";
    detail += strf("threads %s wait in %s at %s", ranges(g.second).c_str(), std::get<0>(g.first).c_str(),
                   site(std::get<1>(g.first).c_str(), std::get<2>(g.first)).c_str());
  }
  if (exited > 0) detail += strf("; %u thread(s) exited", exited);
  return where() +
         ": deadlock: every running thread waits and none can proceed (" + detail +
         "). A barrier or warp collective was not reached by all the threads it waits for: __syncthreads or a "
         "shuffle inside a condition that differs between threads?";
}

void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string message = format(fmt, ap);
  va_end(ap);
  if (!tls_run) {
    std::fprintf(stderr, "fused-kernels-emulator: %s (outside a kernel)\n", message.c_str());
    std::abort();
  }
  tls_run->fail(message);
}

int block_barrier(int predicate, int mode, const char* file, int line) {
  if (!tls_run) fail("__syncthreads called outside a kernel");
  return tls_run->barrier(predicate, mode, file, line);
}

void warp_collective(const char* name, Resolve resolve, unsigned mask, const void* in, void* out, int arg, int width,
                     const char* file, int line) {
  if (!tls_run) fail("%s called outside a kernel", name);
  tls_run->collective(name, resolve, mask, in, out, arg, width, file, line);
}

}  // namespace emu
