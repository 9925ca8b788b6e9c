// __nv_bfloat16 and __half (and their pairs) with CUDA's conversion intrinsics. Conversions from
// float round to nearest even and keep NaN a NaN, bit for bit as the Rust `half` crate converts
// (the fused-kernels CPU kernels use it), so a kernel's rounding is compared exactly.
// Conversions from double round correctly (CUDA's __double2bfloat16 / __double2half).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vector_types.h"

namespace emu {

inline std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// half::bf16::from_f32.
inline std::uint16_t f32_to_bf16(float value) {
  const std::uint32_t x = f32_bits(value);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  const std::uint32_t round_bit = 0x00008000u;
  if ((x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0) {
    return static_cast<std::uint16_t>((x >> 16) + 1);
  }
  return static_cast<std::uint16_t>(x >> 16);
}

// half::bf16::to_f32.
inline float bf16_to_f32(std::uint16_t i) {
  if ((i & 0x7FFFu) > 0x7F80u) return bits_f32((static_cast<std::uint32_t>(i) | 0x0040u) << 16);
  return bits_f32(static_cast<std::uint32_t>(i) << 16);
}

// half::f16::from_f32.
inline std::uint16_t f32_to_f16(float value) {
  const std::uint32_t x = f32_bits(value);
  const std::uint32_t sign = x & 0x80000000u, exp = x & 0x7F800000u, man = x & 0x007FFFFFu;
  if (exp == 0x7F800000u) {
    const std::uint32_t nan_bit = man == 0 ? 0 : 0x0200u;
    return static_cast<std::uint16_t>((sign >> 16) | 0x7C00u | nan_bit | (man >> 13));
  }
  const std::uint32_t half_sign = sign >> 16;
  const int half_exp = static_cast<int>(exp >> 23) - 127 + 15;
  if (half_exp >= 0x1F) return static_cast<std::uint16_t>(half_sign | 0x7C00u);
  if (half_exp <= 0) {
    if (14 - half_exp > 24) return static_cast<std::uint16_t>(half_sign);
    const std::uint32_t m = man | 0x00800000u;
    std::uint32_t half_man = m >> (14 - half_exp);
    const std::uint32_t round_bit = 1u << (13 - half_exp);
    if ((m & round_bit) != 0 && (m & (3 * round_bit - 1)) != 0) half_man += 1;
    return static_cast<std::uint16_t>(half_sign | half_man);
  }
  const std::uint32_t bits = half_sign | (static_cast<std::uint32_t>(half_exp) << 10) | (man >> 13);
  const std::uint32_t round_bit = 0x00001000u;
  if ((man & round_bit) != 0 && (man & (3 * round_bit - 1)) != 0) return static_cast<std::uint16_t>(bits + 1);
  return static_cast<std::uint16_t>(bits);
}

// half::f16::to_f32.
inline float f16_to_f32(std::uint16_t i) {
  if ((i & 0x7FFFu) == 0) return bits_f32(static_cast<std::uint32_t>(i) << 16);
  const std::uint32_t half_sign = i & 0x8000u, half_exp = i & 0x7C00u, half_man = i & 0x03FFu;
  if (half_exp == 0x7C00u) {
    if (half_man == 0) return bits_f32((half_sign << 16) | 0x7F800000u);
    return bits_f32((half_sign << 16) | 0x7FC00000u | (half_man << 13));
  }
  const std::uint32_t sign = half_sign << 16;
  if (half_exp == 0) {
    const int e = __builtin_clz(half_man) - 16 - 6;  // leading zeros of the 16-bit value, − 6
    const std::uint32_t exp = static_cast<std::uint32_t>(127 - 15 - e) << 23;
    const std::uint32_t man = (half_man << (14 + e)) & 0x7FFFFFu;
    return bits_f32(sign | exp | man);
  }
  const std::uint32_t exp = static_cast<std::uint32_t>((static_cast<int>(half_exp) >> 10) - 15 + 127) << 23;
  return bits_f32(sign | exp | ((half_man & 0x03FFu) << 13));
}

// `d` rounded to float with round-to-odd: rounding that float to a type of at most 22 significant
// bits then rounds `d` correctly (no double rounding).
inline float f64_to_f32_odd(double d) {
  float f = static_cast<float>(d);
  if (static_cast<double>(f) != d && !std::isnan(d) && (f32_bits(f) & 1u) == 0) {
    f = static_cast<double>(f) > d ? std::nextafter(f, -INFINITY) : std::nextafter(f, INFINITY);
  }
  return f;
}

}  // namespace emu

struct __nv_bfloat16_raw {
  unsigned short x;
};
struct __half_raw {
  unsigned short x;
};

// bfloat16: 8 exponent bits, 8 significant bits.
struct alignas(2) __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(emu::f32_to_bf16(f)) {}
  __nv_bfloat16(double d) : __x(emu::f32_to_bf16(emu::f64_to_f32_odd(d))) {}
  template <class I, typename std::enable_if<std::is_integral<I>::value, int>::type = 0>
  __nv_bfloat16(I v) : __nv_bfloat16(static_cast<double>(v)) {}
  __nv_bfloat16(__nv_bfloat16_raw r) : __x(r.x) {}
  operator float() const { return emu::bf16_to_f32(__x); }
  operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
};

// IEEE binary16: 5 exponent bits, 11 significant bits.
struct alignas(2) __half {
  unsigned short __x;
  __half() = default;
  __half(float f) : __x(emu::f32_to_f16(f)) {}
  __half(double d) : __x(emu::f32_to_f16(emu::f64_to_f32_odd(d))) {}
  template <class I, typename std::enable_if<std::is_integral<I>::value, int>::type = 0>
  __half(I v) : __half(static_cast<double>(v)) {}
  __half(__half_raw r) : __x(r.x) {}
  operator float() const { return emu::f16_to_f32(__x); }
  operator __half_raw() const { return __half_raw{__x}; }
};
typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;

struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct alignas(4) __half2 {
  __half x, y;
};
typedef __half2 half2;
typedef __nv_bfloat162 nv_bfloat162;

// Arithmetic of the half types: in float, rounded once (as sm_80+ does for one operation).
#define EMU_HALF_OPS(H)                                                                   \
  inline H operator+(const H& a, const H& b) { return H(float(a) + float(b)); }          \
  inline H operator-(const H& a, const H& b) { return H(float(a) - float(b)); }          \
  inline H operator*(const H& a, const H& b) { return H(float(a) * float(b)); }          \
  inline H operator/(const H& a, const H& b) { return H(float(a) / float(b)); }          \
  inline H operator-(const H& a) {                                                        \
    H r = a;                                                                              \
    r.__x ^= 0x8000u;                                                                     \
    return r;                                                                             \
  }                                                                                       \
  inline H operator+(const H& a) { return a; }                                            \
  inline H& operator+=(H& a, const H& b) { return a = a + b; }                            \
  inline H& operator-=(H& a, const H& b) { return a = a - b; }                            \
  inline H& operator*=(H& a, const H& b) { return a = a * b; }                            \
  inline H& operator/=(H& a, const H& b) { return a = a / b; }                            \
  inline bool operator==(const H& a, const H& b) { return float(a) == float(b); }        \
  inline bool operator!=(const H& a, const H& b) { return float(a) != float(b); }        \
  inline bool operator<(const H& a, const H& b) { return float(a) < float(b); }          \
  inline bool operator<=(const H& a, const H& b) { return float(a) <= float(b); }        \
  inline bool operator>(const H& a, const H& b) { return float(a) > float(b); }          \
  inline bool operator>=(const H& a, const H& b) { return float(a) >= float(b); }
EMU_HALF_OPS(__nv_bfloat16)
EMU_HALF_OPS(__half)
#undef EMU_HALF_OPS

// bfloat16 conversions.
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(d); }
inline float __bfloat162float(__nv_bfloat16 h) { return float(h); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__nv_bfloat16(a), __nv_bfloat16(b)}; }
inline __nv_bfloat162 __float2bfloat162_rn(float a) { return {__nv_bfloat16(a), __nv_bfloat16(a)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return {__nv_bfloat16(f.x), __nv_bfloat16(f.y)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{float(h.x), float(h.y)}; }
inline float __low2float(__nv_bfloat162 h) { return float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return float(h.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return {a, b}; }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return {a, a}; }
inline __nv_bfloat162 __lows2bfloat162(__nv_bfloat162 a, __nv_bfloat162 b) { return {a.x, b.x}; }
inline __nv_bfloat162 __highs2bfloat162(__nv_bfloat162 a, __nv_bfloat162 b) { return {a.y, b.y}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline short __bfloat16_as_short(__nv_bfloat16 h) { return static_cast<short>(h.__x); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16(__nv_bfloat16_raw{u}); }
inline __nv_bfloat16 __short_as_bfloat16(short s) {
  return __nv_bfloat16(__nv_bfloat16_raw{static_cast<unsigned short>(s)});
}
inline __nv_bfloat16 __int2bfloat16_rn(int v) { return __nv_bfloat16(v); }
inline int __bfloat162int_rn(__nv_bfloat16 h) { return static_cast<int>(std::nearbyint(float(h))); }
inline int __bfloat162int_rz(__nv_bfloat16 h) { return static_cast<int>(float(h)); }

// half conversions.
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __double2half(double d) { return __half(d); }
inline float __half2float(__half h) { return float(h); }
inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
inline __half2 __float2half2_rn(float a) { return {__half(a), __half(a)}; }
inline __half2 __float22half2_rn(float2 f) { return {__half(f.x), __half(f.y)}; }
inline float2 __half22float2(__half2 h) { return float2{float(h.x), float(h.y)}; }
inline float __low2float(__half2 h) { return float(h.x); }
inline float __high2float(__half2 h) { return float(h.y); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
inline __half2 __half2half2(__half a) { return {a, a}; }
inline __half2 __lows2half2(__half2 a, __half2 b) { return {a.x, b.x}; }
inline __half2 __highs2half2(__half2 a, __half2 b) { return {a.y, b.y}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return static_cast<short>(h.__x); }
inline __half __ushort_as_half(unsigned short u) { return __half(__half_raw{u}); }
inline __half __short_as_half(short s) { return __half(__half_raw{static_cast<unsigned short>(s)}); }
inline __half __int2half_rn(int v) { return __half(v); }
inline int __half2int_rn(__half h) { return static_cast<int>(std::nearbyint(float(h))); }
inline int __half2int_rz(__half h) { return static_cast<int>(float(h)); }

// Arithmetic intrinsics of both types (one rounding from float).
#define EMU_HALF_INTRINSICS(H, H2)                                                              \
  inline H __hadd(H a, H b) { return a + b; }                                                   \
  inline H __hsub(H a, H b) { return a - b; }                                                   \
  inline H __hmul(H a, H b) { return a * b; }                                                   \
  inline H __hdiv(H a, H b) { return a / b; }                                                   \
  inline H __hneg(H a) { return -a; }                                                           \
  inline H __habs(H a) {                                                                        \
    a.__x &= 0x7FFFu;                                                                           \
    return a;                                                                                   \
  }                                                                                             \
  inline H __hfma(H a, H b, H c) { return H(std::fma(float(a), float(b), float(c))); }         \
  inline H __hmax(H a, H b) { return H(std::fmax(float(a), float(b))); }                       \
  inline H __hmin(H a, H b) { return H(std::fmin(float(a), float(b))); }                       \
  inline bool __hisnan(H a) { return std::isnan(float(a)); }                                    \
  inline int __hisinf(H a) { return std::isinf(float(a)) ? (float(a) > 0 ? 1 : -1) : 0; }     \
  inline bool __heq(H a, H b) { return a == b; }                                                \
  inline bool __hlt(H a, H b) { return a < b; }                                                 \
  inline bool __hgt(H a, H b) { return a > b; }                                                 \
  inline H2 __hadd2(H2 a, H2 b) { return {a.x + b.x, a.y + b.y}; }                              \
  inline H2 __hsub2(H2 a, H2 b) { return {a.x - b.x, a.y - b.y}; }                              \
  inline H2 __hmul2(H2 a, H2 b) { return {a.x * b.x, a.y * b.y}; }                              \
  inline H2 __hfma2(H2 a, H2 b, H2 c) { return {__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)}; }
EMU_HALF_INTRINSICS(__nv_bfloat16, __nv_bfloat162)
EMU_HALF_INTRINSICS(__half, __half2)
#undef EMU_HALF_INTRINSICS
