// Warp collectives: shuffles, votes, __syncwarp, the sm_80 reductions, and emu_warp_gather, the
// primitive other emulations (tensor-core mma in mma.cuh) build on.
//
// Every collective is one rendezvous of the warp's 32 lanes: each lane arrives with a pointer to
// its input and to its output and is suspended; the last lane to arrive runs the collective's
// `resolve` over all 32 records (writing every lane's output) and releases the others. The mask
// must be full (0xffffffff), the 32 lanes must exist (blockDim a multiple of 32 along the warp)
// and none may have exited; lanes of one warp must reach the same kind of collective with the same
// width. Anything else ends the launch with an error naming the kernel, block and thread.
#pragma once

#include <cstring>
#include <type_traits>

#include "runtime.h"

namespace emu {

// One lane's part in a collective.
struct LaneRecord {
  const void* in;  // the lane's input value
  void* out;       // where the lane's result goes
  int arg;         // srcLane / delta / laneMask, or a predicate
};

// Computes every lane's output from the 32 records; `width` is the shuffle width.
typedef void (*Resolve)(const LaneRecord* lanes, int width);

// The rendezvous. `name` identifies the kind of collective (lanes must agree on it), `resolve`
// computes the results once all 32 lanes have arrived.
void warp_collective(const char* name, Resolve resolve, unsigned mask, const void* in, void* out, int arg,
                     int width, const char* file, int line);

template <class T> inline T load_as(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// The source lane of lane `lane` in a shuffle, from PTX's shfl.sync: within segments of `width`
// lanes; a source outside the segment (above it for down and xor, below it for up) means the
// lane's own value.
enum ShuffleMode { kIdx, kUp, kDown, kXor };
template <int Mode> inline int shuffle_source(int lane, int arg, int width) {
  const int seg_start = lane & ~(width - 1);
  const int seg_end = seg_start + width - 1;
  int j;
  bool valid;
  switch (Mode) {
    case kIdx:
      j = seg_start | (arg & (width - 1));
      valid = true;
      break;
    case kUp:
      j = lane - arg;
      valid = j >= seg_start;
      break;
    case kDown:
      j = lane + arg;
      valid = j <= seg_end;
      break;
    default:
      j = lane ^ arg;
      valid = j <= seg_end;
      break;
  }
  return valid ? j : lane;
}

template <class T, int Mode> void resolve_shuffle(const LaneRecord* lanes, int width) {
  for (int lane = 0; lane < 32; ++lane) {
    const int src = shuffle_source<Mode>(lane, lanes[lane].arg, width);
    std::memcpy(lanes[lane].out, lanes[src].in, sizeof(T));
  }
}

inline unsigned ballot_of(const LaneRecord* lanes) {
  unsigned bits = 0;
  for (int lane = 0; lane < 32; ++lane) bits |= (lanes[lane].arg != 0 ? 1u : 0u) << lane;
  return bits;
}
inline void resolve_ballot(const LaneRecord* lanes, int) {
  const unsigned bits = ballot_of(lanes);
  for (int lane = 0; lane < 32; ++lane) std::memcpy(lanes[lane].out, &bits, sizeof bits);
}
inline void resolve_any(const LaneRecord* lanes, int) {
  const int r = ballot_of(lanes) != 0;
  for (int lane = 0; lane < 32; ++lane) std::memcpy(lanes[lane].out, &r, sizeof r);
}
inline void resolve_all(const LaneRecord* lanes, int) {
  const int r = ballot_of(lanes) == 0xffffffffu;
  for (int lane = 0; lane < 32; ++lane) std::memcpy(lanes[lane].out, &r, sizeof r);
}
inline void resolve_nothing(const LaneRecord*, int) {}

template <class T> void resolve_gather(const LaneRecord* lanes, int) {
  for (int lane = 0; lane < 32; ++lane) {
    T* all = static_cast<T*>(lanes[lane].out);
    for (int src = 0; src < 32; ++src) std::memcpy(&all[src], lanes[src].in, sizeof(T));
  }
}

enum ReduceOp { kReduceAdd, kReduceMin, kReduceMax, kReduceAnd, kReduceOr, kReduceXor };
template <class T, int Op> void resolve_reduce(const LaneRecord* lanes, int) {
  T r = load_as<T>(lanes[0].in);
  for (int lane = 1; lane < 32; ++lane) {
    const T v = load_as<T>(lanes[lane].in);
    switch (Op) {
      case kReduceAdd: r = static_cast<T>(r + v); break;
      case kReduceMin: r = v < r ? v : r; break;
      case kReduceMax: r = v > r ? v : r; break;
      case kReduceAnd: r = r & v; break;
      case kReduceOr: r = r | v; break;
      default: r = r ^ v; break;
    }
  }
  for (int lane = 0; lane < 32; ++lane) std::memcpy(lanes[lane].out, &r, sizeof r);
}

template <class T> inline void check_shuffle_type() {
  static_assert(std::is_trivially_copyable<T>::value, "a shuffled value must be trivially copyable");
  static_assert(sizeof(T) <= 16, "CUDA shuffles values of at most 16 bytes");
}

}  // namespace emu

template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize, const char* file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
  emu::check_shuffle_type<T>();
  T out;
  emu::warp_collective("__shfl_sync", &emu::resolve_shuffle<T, emu::kIdx>, mask, &var, &out, srcLane, width, file,
                       line);
  return out;
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned int delta, int width = warpSize,
                        const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  emu::check_shuffle_type<T>();
  T out;
  emu::warp_collective("__shfl_up_sync", &emu::resolve_shuffle<T, emu::kUp>, mask, &var, &out, static_cast<int>(delta),
                       width, file, line);
  return out;
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = warpSize,
                          const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  emu::check_shuffle_type<T>();
  T out;
  emu::warp_collective("__shfl_down_sync", &emu::resolve_shuffle<T, emu::kDown>, mask, &var, &out,
                       static_cast<int>(delta), width, file, line);
  return out;
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize, const char* file = __builtin_FILE(),
                         int line = __builtin_LINE()) {
  emu::check_shuffle_type<T>();
  T out;
  emu::warp_collective("__shfl_xor_sync", &emu::resolve_shuffle<T, emu::kXor>, mask, &var, &out, laneMask, width,
                       file, line);
  return out;
}

inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  unsigned out;
  emu::warp_collective("__ballot_sync", &emu::resolve_ballot, mask, nullptr, &out, predicate, 32, file, line);
  return out;
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  int out;
  emu::warp_collective("__any_sync", &emu::resolve_any, mask, nullptr, &out, predicate, 32, file, line);
  return out;
}
inline int __all_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  int out;
  emu::warp_collective("__all_sync", &emu::resolve_all, mask, nullptr, &out, predicate, 32, file, line);
  return out;
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  emu::warp_collective("__syncwarp", &emu::resolve_nothing, mask, nullptr, nullptr, 0, 32, file, line);
}

#define EMU_WARP_REDUCE(fn, T, op)                                                                        \
  inline T fn(unsigned mask, T value, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { \
    T out;                                                                                                \
    emu::warp_collective(#fn, &emu::resolve_reduce<T, op>, mask, &value, &out, 0, 32, file, line);        \
    return out;                                                                                           \
  }
EMU_WARP_REDUCE(__reduce_add_sync, unsigned, emu::kReduceAdd)
EMU_WARP_REDUCE(__reduce_add_sync, int, emu::kReduceAdd)
EMU_WARP_REDUCE(__reduce_min_sync, unsigned, emu::kReduceMin)
EMU_WARP_REDUCE(__reduce_min_sync, int, emu::kReduceMin)
EMU_WARP_REDUCE(__reduce_max_sync, unsigned, emu::kReduceMax)
EMU_WARP_REDUCE(__reduce_max_sync, int, emu::kReduceMax)
EMU_WARP_REDUCE(__reduce_and_sync, unsigned, emu::kReduceAnd)
EMU_WARP_REDUCE(__reduce_or_sync, unsigned, emu::kReduceOr)
EMU_WARP_REDUCE(__reduce_xor_sync, unsigned, emu::kReduceXor)
#undef EMU_WARP_REDUCE

// A collective of the current warp for emulating warp-wide instructions (tensor-core mma.sync,
// ldmatrix, ...): all 32 lanes call it, each with its own `mine`; when it returns, every lane's
// `all[i]` holds lane i's `mine` (i = lane index, threadIdx linearized, modulo 32). It is a full
// rendezvous like __shfl_sync (same rules: every lane must call it, none may have exited) and
// costs one suspension per lane plus 32 × 32 copies of T by the last lane to arrive, so gather a
// lane's whole fragment (a struct or array) in one call rather than register by register. T must
// be trivially copyable; `mine` may be any size.
template <class T>
inline void emu_warp_gather(const T& mine, T (&all)[32], const char* file = __builtin_FILE(),
                            int line = __builtin_LINE()) {
  static_assert(std::is_trivially_copyable<T>::value, "emu_warp_gather copies T bytewise");
  emu::warp_collective("emu_warp_gather", &emu::resolve_gather<T>, 0xffffffffu, &mine, all, 0, 32, file, line);
}
