// The C ABI (declared in ../../src/ffi.rs): the kernel registry, launches with their checks, and
// the guarded buffers.
//
// A launch checks the kernel's name, the launch shape (CUDA's limits), and the arguments against
// the kernel's signature, then runs the grid's blocks on worker OS threads (one block at a time
// each, its threads as fibers), then checks the canaries of every buffer it was given.
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <exception>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../emu/abi.h"
#include "block.h"
#include "fault.h"
#include "memory.h"

extern "C" const emu::KernelTable* const fk_emu_tables[];
extern "C" const std::size_t fk_emu_table_count;

namespace emu {
namespace {

thread_local std::string t_last_error;

struct Registry {
  std::vector<const KernelEntry*> kernels;
  std::unordered_map<std::string, const KernelEntry*> by_name;
};

const Registry& registry() {
  static const Registry r = [] {
    Registry reg;
    for (std::size_t t = 0; t < fk_emu_table_count; ++t) {
      const KernelTable* table = fk_emu_tables[t];
      for (std::size_t i = 0; i < table->count; ++i) {
        reg.kernels.push_back(&table->entries[i]);
        reg.by_name.emplace(table->entries[i].name, &table->entries[i]);
      }
    }
    std::sort(reg.kernels.begin(), reg.kernels.end(),
              [](const KernelEntry* a, const KernelEntry* b) { return std::strcmp(a->name, b->name) < 0; });
    return reg;
  }();
  return r;
}

const char* kind_name(std::uint32_t kind) {
  switch (kind & kKindMask) {
    case kVoid: return "void";
    case kF32: return "f32";
    case kF64: return "f64";
    case kBF16: return "bf16";
    case kF16: return "f16";
    case kI8: return "i8";
    case kU8: return "u8";
    case kI16: return "i16";
    case kU16: return "u16";
    case kI32: return "i32";
    case kU32: return "u32";
    case kI64: return "i64";
    case kU64: return "u64";
    case kBool: return "bool";
    default: return "an unsupported type";
  }
}

// How the Rust API spells an argument of this code.
std::string arg_name(std::uint32_t code) {
  if (code & kPointer) {
    return std::string((code & kConst) ? "a read-only pointer (Arg::ptr) to " : "a writable pointer (Arg::ptr_mut) to ") +
           kind_name(code);
  }
  std::string k = kind_name(code);
  for (char& c : k) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return "a " + std::string(kind_name(code)) + " scalar (Arg::" + k + ")";
}

std::string signature(const KernelEntry* k) {
  std::string s = std::string(k->name) + "(";
  for (std::size_t i = 0; i < k->param_count; ++i) {
    if (i) s += ", ";
    s += k->params[i].type_name;
  }
  return s + ")";
}

// Empty if argument i fits parameter i.
std::string check_arg(const KernelEntry* k, std::size_t i, std::uint32_t arg) {
  const ParamDesc& p = k->params[i];
  const std::string head = "argument " + std::to_string(i) + " of " + signature(k) + ": ";
  if ((p.code & kKindMask) == kOther || (p.code & kKindMask) == kBool || ((p.code & kKindMask) == kVoid && !(p.code & kPointer))) {
    return head + "parameter type `" + p.type_name + "` cannot be passed by the emulator's launcher (use pointers and "
           "the scalar kinds u64, i64, u32, i32, f32, f64)";
  }
  if (p.code & kPointer) {
    if (!(arg & kPointer)) return head + "the parameter is a pointer `" + p.type_name + "`, but " + arg_name(arg) + " was given";
    if ((p.code & kKindMask) != kVoid && (p.code & kKindMask) != (arg & kKindMask)) {
      return head + "the parameter is `" + p.type_name + "`, but " + arg_name(arg) + " was given: pass a buffer of " +
             kind_name(p.code);
    }
    if (!(p.code & kConst) && (arg & kConst)) {
      return head + "the parameter `" + p.type_name + "` is not const, so the kernel may write through it, but " +
             arg_name(arg) + " was given: pass the buffer with Arg::ptr_mut";
    }
    return std::string();
  }
  if ((arg & kPointer) || (arg & kKindMask) != (p.code & kKindMask)) {
    return head + "the parameter is `" + p.type_name + "` (" + arg_name(p.code) + "), but " + arg_name(arg) + " was given";
  }
  return std::string();
}

std::string check_shape(const std::uint32_t grid[3], const std::uint32_t block[3], std::size_t smem) {
  for (int d = 0; d < 3; ++d) {
    if (grid[d] == 0 || block[d] == 0) {
      return "a launch dimension is 0 (grid (" + std::to_string(grid[0]) + ", " + std::to_string(grid[1]) + ", " +
             std::to_string(grid[2]) + "), block (" + std::to_string(block[0]) + ", " + std::to_string(block[1]) +
             ", " + std::to_string(block[2]) + ")): every dimension must be at least 1";
    }
  }
  const std::uint64_t threads = std::uint64_t(block[0]) * block[1] * block[2];
  if (threads > 1024 || block[2] > 64) {
    return "a block of " + std::to_string(block[0]) + " x " + std::to_string(block[1]) + " x " + std::to_string(block[2]) +
           " threads exceeds CUDA's limits (at most 1024 threads, blockDim.z at most 64)";
  }
  if (grid[0] > 0x7fffffffu || grid[1] > 65535 || grid[2] > 65535) {
    return "the grid exceeds CUDA's limits (gridDim.x at most 2^31 - 1, gridDim.y and gridDim.z at most 65535)";
  }
  if (smem > 48 * 1024) {
    return std::to_string(smem) + " bytes of dynamic shared memory exceed the 48 KiB a launch gets without "
           "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize), which fused-kernels does not set";
  }
  return std::string();
}

unsigned worker_count(std::uint64_t blocks) {
  // The CPUs this process may run on (hardware_concurrency counts the machine's).
  cpu_set_t set;
  unsigned n = sched_getaffinity(0, sizeof set, &set) == 0 ? static_cast<unsigned>(CPU_COUNT(&set))
                                                           : std::thread::hardware_concurrency();
  if (const char* env = std::getenv("FUSED_KERNELS_EMULATOR_THREADS")) {
    const long v = std::strtol(env, nullptr, 10);
    if (v > 0) n = static_cast<unsigned>(v);
  }
  n = std::max(1u, std::min(n, 64u));
  return static_cast<unsigned>(std::min<std::uint64_t>(n, blocks));
}

struct Launch {
  const KernelEntry* kernel;
  void* const* args;
  dim3 grid, block;
  std::size_t smem;
  Order order;
  std::uint64_t blocks;
  std::atomic<std::uint64_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex mutex;
  std::uint64_t error_block = UINT64_MAX;
  std::string error;
};

void work(Launch* l) {
  void* alt = fault_stack_ensure();
  {
    BlockRun run(l->kernel, l->args, l->grid, l->block, l->smem, l->order);
    for (;;) {
      if (l->stop.load(std::memory_order_relaxed)) break;
      const std::uint64_t k = l->next.fetch_add(1);
      if (k >= l->blocks) break;
      const std::uint64_t b = l->order == Order::kIncreasing ? k : l->blocks - 1 - k;
      const uint3 idx{static_cast<unsigned>(b % l->grid.x), static_cast<unsigned>((b / l->grid.x) % l->grid.y),
                      static_cast<unsigned>(b / (std::uint64_t(l->grid.x) * l->grid.y))};
      if (!run.run(idx)) {
        std::lock_guard<std::mutex> lock(l->mutex);
        if (b < l->error_block) {
          l->error_block = b;
          l->error = run.error();
        }
        l->stop.store(true);
      }
    }
  }
  fault_stack_remove(alt);
}

int launch(const char* name, const std::uint32_t grid[3], const std::uint32_t block[3], std::size_t smem,
           void* const* args, const std::uint32_t* arg_codes, std::size_t nargs, int order) {
  const Registry& reg = registry();
  auto it = reg.by_name.find(name ? name : "");
  if (it == reg.by_name.end()) {
    std::string similar;
    const std::string n = name ? name : "";
    const std::string stem = n.substr(0, n.find('_'));
    for (const KernelEntry* k : reg.kernels) {
      if (!stem.empty() && std::strncmp(k->name, stem.c_str(), stem.size()) == 0) {
        similar += similar.empty() ? " (kernels starting with '" + stem + "': " : ", ";
        similar += k->name;
      }
    }
    if (!similar.empty()) similar += ")";
    t_last_error = "no kernel named '" + n + "' among the " + std::to_string(reg.kernels.size()) +
                   " extern \"C\" __global__ functions of the emulated .cu files" + similar;
    return 1;
  }
  const KernelEntry* k = it->second;
  std::string problem = check_shape(grid, block, smem);
  if (!problem.empty()) {
    t_last_error = "kernel '" + std::string(name) + "': " + problem;
    return 1;
  }
  if (nargs != k->param_count) {
    t_last_error = "kernel " + signature(k) + " takes " + std::to_string(k->param_count) + " argument(s), but " +
                   std::to_string(nargs) + " were given";
    return 1;
  }
  if (arg_codes) {
    for (std::size_t i = 0; i < nargs; ++i) {
      problem = check_arg(k, i, arg_codes[i]);
      if (!problem.empty()) {
        t_last_error = problem;
        return 1;
      }
    }
  }
  if (order != 0 && order != 1) {
    t_last_error = "order must be 0 (increasing thread index) or 1 (decreasing), got " + std::to_string(order);
    return 1;
  }
  fault_handler_install();
  Launch l;
  l.kernel = k;
  l.args = args;
  l.grid = dim3(grid[0], grid[1], grid[2]);
  l.block = dim3(block[0], block[1], block[2]);
  l.smem = smem;
  l.order = order == 0 ? Order::kIncreasing : Order::kDecreasing;
  l.blocks = std::uint64_t(grid[0]) * grid[1] * grid[2];
  const unsigned workers = worker_count(l.blocks);
  std::vector<std::thread> threads;
  for (unsigned w = 1; w < workers; ++w) {
    try {
      threads.emplace_back(work, &l);
    } catch (...) {
      break;  // fewer workers: the blocks still all run
    }
  }
  work(&l);
  for (std::thread& t : threads) t.join();
  if (!l.error.empty()) {
    t_last_error = l.error;
    return 1;
  }
  for (std::size_t i = 0; i < nargs; ++i) {
    if (!(k->params[i].code & kPointer)) continue;
    void* p;
    std::memcpy(&p, args[i], sizeof p);
    problem = buffer_check(p);
    if (!problem.empty()) {
      t_last_error = "kernel '" + std::string(name) + "', argument " + std::to_string(i) + ": " + problem;
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace emu

extern "C" {

// 0 on success; otherwise 1, with the reason in emu_last_error(). `args[i]` points to argument
// i's value (a pointer argument: to the pointer); `arg_codes` (may be null: only the count is
// checked) gives each argument's kind as abi.h encodes it; `order` is 0 to run a block's threads
// in increasing index order between barriers, 1 for decreasing.
int emu_launch(const char* name, const std::uint32_t grid[3], const std::uint32_t block[3], std::size_t dynamic_smem,
               void* const* args, const std::uint32_t* arg_codes, std::size_t nargs, int order) {
  try {
    return emu::launch(name, grid, block, dynamic_smem, args, arg_codes, nargs, order);
  } catch (const std::exception& e) {
    emu::t_last_error = std::string("the emulator failed: ") + e.what();
  } catch (...) {
    emu::t_last_error = "the emulator failed with an unknown C++ exception";
  }
  return 1;
}

// The calling thread's last launch error (valid until its next launch).
const char* emu_last_error() { return emu::t_last_error.c_str(); }

std::size_t emu_kernel_count() { return emu::registry().kernels.size(); }

// Kernel i's name (in sorted order), or null.
const char* emu_kernel_name(std::size_t i) {
  const auto& k = emu::registry().kernels;
  return i < k.size() ? k[i]->name : nullptr;
}

// Writes the kernel's signature, NUL-terminated and cut to `cap`, and returns its length, or -1
// for an unknown kernel.
long emu_kernel_signature(const char* name, char* out, std::size_t cap) {
  const auto& by_name = emu::registry().by_name;
  auto it = by_name.find(name ? name : "");
  if (it == by_name.end()) return -1;
  const std::string s = emu::signature(it->second);
  if (cap > 0) {
    const std::size_t n = std::min(cap - 1, s.size());
    std::memcpy(out, s.data(), n);
    out[n] = 0;
  }
  return static_cast<long>(s.size());
}

void* emu_alloc(std::size_t bytes) { return emu::buffer_alloc(bytes); }
void emu_free(void* data) { emu::buffer_free(data); }

}  // extern "C"
