// The interface between the kernels' registration (compiled into each .cu's translation unit) and
// the runtime: how a kernel is found by name, called with an array of argument pointers, and how
// its parameters are described so that a launch with the wrong arguments is refused.
#pragma once

#include <cstddef>
#include <cstdint>

namespace emu {

// A parameter's or an argument's type, as one number: the scalar kind in the low byte, then
// flags. A pointer's kind is its pointee's. The Rust side (src/ffi.rs) uses the same numbers.
enum Kind : std::uint32_t {
  kVoid = 0,
  kF32 = 1,
  kF64 = 2,
  kBF16 = 3,
  kF16 = 4,
  kI8 = 5,
  kU8 = 6,
  kI16 = 7,
  kU16 = 8,
  kI32 = 9,
  kU32 = 10,
  kI64 = 11,
  kU64 = 12,
  kBool = 13,
  kOther = 14,  // a struct or another type the launcher cannot pass
};
constexpr std::uint32_t kKindMask = 0xff;
constexpr std::uint32_t kPointer = 1u << 8;
constexpr std::uint32_t kConst = 1u << 9;  // a pointer to const: the kernel only reads it

// One parameter of a kernel.
struct ParamDesc {
  std::uint32_t code;     // Kind | kPointer | kConst
  std::uint32_t size;     // sizeof the parameter (a pointer: 8)
  const char* type_name;  // the C++ type, for error messages
};

// One `extern "C"` kernel.
struct KernelEntry {
  const char* name;
  void (*invoke)(void* const* args);  // calls the kernel with *args[i] as parameter i
  const ParamDesc* params;
  std::size_t param_count;
};

// The kernels of one .cu file.
struct KernelTable {
  const char* file;
  const KernelEntry* entries;
  std::size_t count;
};

}  // namespace emu
