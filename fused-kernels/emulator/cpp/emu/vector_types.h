// CUDA's built-in vector types (with CUDA's alignments, so that vector loads of device code see the
// same layout) and dim3.
#pragma once

#define EMU_VEC2(name, T, align)                                                 \
  struct alignas(align) name {                                                   \
    T x, y;                                                                      \
  };                                                                             \
  static inline name make_##name(T x, T y) { return name{x, y}; }
#define EMU_VEC3(name, T)                                                        \
  struct name {                                                                  \
    T x, y, z;                                                                   \
  };                                                                             \
  static inline name make_##name(T x, T y, T z) { return name{x, y, z}; }
#define EMU_VEC4(name, T, align)                                                 \
  struct alignas(align) name {                                                   \
    T x, y, z, w;                                                                \
  };                                                                             \
  static inline name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

EMU_VEC2(char2, signed char, 2)
EMU_VEC2(uchar2, unsigned char, 2)
EMU_VEC2(short2, short, 4)
EMU_VEC2(ushort2, unsigned short, 4)
EMU_VEC2(int2, int, 8)
EMU_VEC2(uint2, unsigned int, 8)
EMU_VEC2(float2, float, 8)
EMU_VEC2(longlong2, long long, 16)
EMU_VEC2(ulonglong2, unsigned long long, 16)
EMU_VEC2(double2, double, 16)
EMU_VEC3(int3, int)
EMU_VEC3(uint3, unsigned int)
EMU_VEC3(float3, float)
EMU_VEC3(double3, double)
EMU_VEC4(char4, signed char, 4)
EMU_VEC4(uchar4, unsigned char, 4)
EMU_VEC4(short4, short, 8)
EMU_VEC4(ushort4, unsigned short, 8)
EMU_VEC4(int4, int, 16)
EMU_VEC4(uint4, unsigned int, 16)
EMU_VEC4(float4, float, 16)

#undef EMU_VEC2
#undef EMU_VEC3
#undef EMU_VEC4

// A launch's grid or block shape; unspecified dimensions are 1.
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};
