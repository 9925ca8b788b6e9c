// Registration of `extern "C"` kernels, included after a .cu file in the translation unit that
// build.rs generates for it: `emu::Invoke<&kernel>` calls the kernel with its parameters read from
// an array of argument pointers (as cuLaunchKernel passes them), and `emu::Signature<&kernel>`
// describes each parameter, both deduced from the function pointer's type.
#pragma once

#include <cstring>
#include <type_traits>
#include <utility>

#include "abi.h"
#include "fp16.h"

namespace emu {

template <class T> struct KindOf {
  static constexpr std::uint32_t value =
      std::is_same<T, void>::value                                     ? kVoid
      : std::is_same<T, bool>::value                                   ? kBool
      : std::is_same<T, float>::value                                  ? kF32
      : std::is_same<T, double>::value                                 ? kF64
      : std::is_same<T, __nv_bfloat16>::value                          ? kBF16
      : std::is_same<T, __half>::value                                 ? kF16
      : !std::is_integral<T>::value                                    ? kOther
      : sizeof(T) == 1                                                 ? (std::is_signed<T>::value ? kI8 : kU8)
      : sizeof(T) == 2                                                 ? (std::is_signed<T>::value ? kI16 : kU16)
      : sizeof(T) == 4                                                 ? (std::is_signed<T>::value ? kI32 : kU32)
      : sizeof(T) == 8                                                 ? (std::is_signed<T>::value ? kI64 : kU64)
                                                                       : kOther;
};

// The C++ spelling of T, from the compiler's name of this function.
template <class T> const char* type_name() {
  static char name[128];
  if (name[0] == 0) {
    const char* pretty = __PRETTY_FUNCTION__;  // "const char* emu::type_name() [with T = float]"
    const char* start = std::strstr(pretty, "T = ");
    start = start ? start + 4 : pretty;
    std::size_t n = std::strcspn(start, ";]");
    if (n >= sizeof name) n = sizeof name - 1;
    std::memcpy(name, start, n);
    name[n] = 0;
  }
  return name;
}

template <class P> constexpr ParamDesc describe() {
  typedef typename std::remove_cv<P>::type Q;
  typedef typename std::remove_cv<typename std::remove_pointer<Q>::type>::type Pointee;
  return std::is_pointer<Q>::value
             ? ParamDesc{KindOf<Pointee>::value | kPointer |
                             (std::is_const<typename std::remove_pointer<Q>::type>::value ? kConst : 0u),
                         static_cast<std::uint32_t>(sizeof(Q)), nullptr}
             : ParamDesc{KindOf<Q>::value, static_cast<std::uint32_t>(sizeof(Q)), nullptr};
}

template <auto F> struct Kernel;
template <class... P, void (*F)(P...)> struct Kernel<F> {
  template <std::size_t... I> static void call(void* const* args, std::index_sequence<I...>) {
    F(load<P>(args[I])...);
  }
  template <class T> static typename std::remove_cv<T>::type load(const void* p) {
    typename std::remove_cv<T>::type v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void invoke(void* const* args) { call(args, std::index_sequence_for<P...>{}); }
  static const ParamDesc* params() {
    static ParamDesc descs[sizeof...(P) + 1] = {describe<P>()..., ParamDesc{kVoid, 0, nullptr}};
    static bool named = false;
    if (!named) {
      const char* names[sizeof...(P) + 1] = {type_name<P>()..., nullptr};
      for (std::size_t i = 0; i < sizeof...(P); ++i) descs[i].type_name = names[i];
      named = true;
    }
    return descs;
  }
  static constexpr std::size_t count = sizeof...(P);
};

}  // namespace emu

// One entry of a file's kernel table.
#define EMU_KERNEL_ENTRY(name) \
  ::emu::KernelEntry { #name, &::emu::Kernel<&name>::invoke, ::emu::Kernel<&name>::params(), ::emu::Kernel<&name>::count }
