// CUDA's atomic functions on the types CUDA provides them for. Blocks run in parallel on several
// OS threads, so these are real atomic read-modify-writes (relaxed, as CUDA's are); a block's own
// threads are fibers of one OS thread and never interleave inside one.
#pragma once

#include <cstring>

#include "fp16.h"

namespace emu {

// An atomic read-modify-write of `*address` by compare-and-swap on its bits: f(old) is stored.
template <class T, class Bits, class F> inline T atomic_update(T* address, F f) {
  static_assert(sizeof(T) == sizeof(Bits), "the bit type must have the value's size");
  Bits* bits = reinterpret_cast<Bits*>(address);
  Bits expected = __atomic_load_n(bits, __ATOMIC_RELAXED);
  for (;;) {
    T old;
    std::memcpy(&old, &expected, sizeof(T));
    const T value = f(old);
    Bits desired;
    std::memcpy(&desired, &value, sizeof(T));
    if (__atomic_compare_exchange_n(bits, &expected, desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return old;
  }
}

}  // namespace emu

#define EMU_ATOMIC_INT(T)                                                                                        \
  inline T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_RELAXED); }                          \
  inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_RELAXED); }                          \
  inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_RELAXED); }                        \
  inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_RELAXED); }                          \
  inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_RELAXED); }                            \
  inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_RELAXED); }                          \
  inline T atomicMin(T* a, T v) {                                                                                \
    return emu::atomic_update<T, T>(a, [v](T old) { return v < old ? v : old; });                               \
  }                                                                                                              \
  inline T atomicMax(T* a, T v) {                                                                                \
    return emu::atomic_update<T, T>(a, [v](T old) { return v > old ? v : old; });                               \
  }                                                                                                              \
  inline T atomicCAS(T* a, T compare, T v) {                                                                     \
    __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);                     \
    return compare;                                                                                              \
  }
EMU_ATOMIC_INT(int)
EMU_ATOMIC_INT(unsigned int)
EMU_ATOMIC_INT(unsigned long long)
#undef EMU_ATOMIC_INT

inline long long atomicMin(long long* a, long long v) {
  return emu::atomic_update<long long, long long>(a, [v](long long old) { return v < old ? v : old; });
}
inline long long atomicMax(long long* a, long long v) {
  return emu::atomic_update<long long, long long>(a, [v](long long old) { return v > old ? v : old; });
}
inline unsigned short atomicCAS(unsigned short* a, unsigned short compare, unsigned short v) {
  __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}
// ((old >= v) ? 0 : old + 1) and ((old == 0 || old > v) ? v : old − 1), CUDA's wrapping counters.
inline unsigned int atomicInc(unsigned int* a, unsigned int v) {
  return emu::atomic_update<unsigned, unsigned>(a, [v](unsigned old) { return old >= v ? 0u : old + 1; });
}
inline unsigned int atomicDec(unsigned int* a, unsigned int v) {
  return emu::atomic_update<unsigned, unsigned>(a, [v](unsigned old) { return (old == 0 || old > v) ? v : old - 1; });
}

inline float atomicAdd(float* a, float v) {
  return emu::atomic_update<float, unsigned>(a, [v](float old) { return old + v; });
}
inline double atomicAdd(double* a, double v) {
  return emu::atomic_update<double, unsigned long long>(a, [v](double old) { return old + v; });
}
inline float atomicExch(float* a, float v) {
  return emu::atomic_update<float, unsigned>(a, [v](float) { return v; });
}
inline __half atomicAdd(__half* a, __half v) {
  return emu::atomic_update<__half, unsigned short>(a, [v](__half old) { return old + v; });
}
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* a, __nv_bfloat16 v) {
  return emu::atomic_update<__nv_bfloat16, unsigned short>(a, [v](__nv_bfloat16 old) { return old + v; });
}
inline __half2 atomicAdd(__half2* a, __half2 v) {
  return emu::atomic_update<__half2, unsigned>(a, [v](__half2 old) { return __hadd2(old, v); });
}
inline __nv_bfloat162 atomicAdd(__nv_bfloat162* a, __nv_bfloat162 v) {
  return emu::atomic_update<__nv_bfloat162, unsigned>(a, [v](__nv_bfloat162 old) { return __hadd2(old, v); });
}
