// Embedding lookup and its gradient (see embedding.rs). Token ids are u32 or i64 (`I`); an id
// that is not a row of the table (negative, or >= v) makes its output row NaN in the forward
// pass and adds nothing in the backward pass: checking it would need the ids on the host, a
// synchronization in every step.
//
// The backward pass is a deterministic scatter-add without atomics: block b (a 1-D grid of
// row tiles × column tiles, b = by · ⌈v/R⌉ + bx) owns the table rows [bx·R, bx·R + R) and the
// columns [by·W, by·W + W) of the gradient, accumulates them
// in f32 (f64 for f64) in shared memory, and writes them once, rounded (zeros where no id fell).
// Its threads scan all ids in chunks of blockDim.x, compact the positions whose id falls in the
// block's rows in position order (a warp ballot, then the warps' counts in warp order), then add
// those rows of dy to the accumulators, each thread owning fixed columns. Every gradient element
// is therefore 0 + dy[p₁] + dy[p₂] + … over its positions in increasing order, the CPU kernel's
// order: both give the same bits.
#include "common.cuh"

// Most threads a backward block has (the chunk of ids it compacts at once). The accumulators,
// rows_per_block · cols_per_block values of A, are the launch's dynamic shared memory; with the
// static arrays below (4.2 KiB) they stay within the 48 KiB a block gets without an opt-in
// (embedding.rs, ACCUMULATOR_BYTES).
#define EMBEDDING_MAX_THREADS 1024

template <typename T, typename I>
__device__ void embedding(const T* __restrict__ table, const I* __restrict__ ids, T* __restrict__ out,
                          u64 n, u64 v, u64 c) {
  typedef typename AccOf<T>::type A;
  const u64 total = n * c;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)blockDim.x * gridDim.x) {
    const u64 p = i / c, j = i - p * c;
    // A negative i64 id converts to a value >= 2^63, so one comparison rejects it too.
    const u64 id = (u64)ids[p];
    out[i] = id < v ? table[id * c + j] : from_acc<T>(acc_nan(A(0)));
  }
}

template <typename T, typename I>
__device__ void embedding_backward(const T* __restrict__ dy, const I* __restrict__ ids,
                                   T* __restrict__ grad, u64 n, u64 v, u64 c, u64 rows_per_block,
                                   u64 cols_per_block) {
  typedef typename AccOf<T>::type A;
  DYNAMIC_SHARED(A, acc);
  // The chunk's positions that fall in this block's rows (as offsets in the chunk), in order,
  // and the accumulator row each one adds to.
  __shared__ unsigned short offset_of[EMBEDDING_MAX_THREADS];
  __shared__ unsigned short row_of[EMBEDDING_MAX_THREADS];
  __shared__ unsigned warp_count[EMBEDDING_MAX_THREADS / 32];

  const u64 row_tiles = (v + rows_per_block - 1) / rows_per_block;
  const u64 r0 = (blockIdx.x % row_tiles) * rows_per_block;
  const u64 c0 = (blockIdx.x / row_tiles) * cols_per_block;
  if (r0 >= v || c0 >= c) return;  // uniform over the block
  const u64 rows = v - r0 < rows_per_block ? v - r0 : rows_per_block;
  const u64 cols = c - c0 < cols_per_block ? c - c0 : cols_per_block;
  if (rows > 65536 || blockDim.x > EMBEDDING_MAX_THREADS) {
    // A launch shape the compaction arrays cannot hold (the Rust side never makes one): say so
    // loudly in the result rather than write out of bounds.
    for (u64 k = threadIdx.x; k < rows * cols; k += blockDim.x) {
      const u64 r = k / cols, j = k - r * cols;
      grad[(r0 + r) * c + c0 + j] = from_acc<T>(acc_nan(A(0)));
    }
    return;
  }
  for (u64 k = threadIdx.x; k < rows * cols; k += blockDim.x) acc[k] = A(0);

  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (u64 base = 0; base < n; base += blockDim.x) {
    const u64 p = base + threadIdx.x;
    // Out of range ids (and the padding past n) are never in [r0, r0 + rows): u64 arithmetic
    // wraps an id below r0 to a huge offset.
    const u64 row = p < n ? (u64)ids[p] - r0 : ~0ull;
    const bool mine = row < rows;
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    // The previous chunk's adders are done with offset_of/row_of/warp_count (barrier at the end
    // of the loop; the first chunk has the zeroing's writes to order, done by that barrier too).
    __syncthreads();
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    unsigned before = 0, found = 0;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned k = warp_count[w];
      if (w < warp) before += k;
      found += k;
    }
    if (mine) {
      const unsigned k = before + __popc(ballot & ((1u << lane) - 1u));
      offset_of[k] = (unsigned short)threadIdx.x;
      row_of[k] = (unsigned short)row;
    }
    __syncthreads();
    // found is the same for every thread: the block skips chunks with none of its rows.
    // Four rows at a time: their loads are independent, so they overlap; the adds stay in order.
    unsigned k = 0;
    for (; k + 4 <= found; k += 4) {
      const T* s0 = dy + (base + offset_of[k]) * c + c0;
      const T* s1 = dy + (base + offset_of[k + 1]) * c + c0;
      const T* s2 = dy + (base + offset_of[k + 2]) * c + c0;
      const T* s3 = dy + (base + offset_of[k + 3]) * c + c0;
      A* a0 = acc + row_of[k] * cols;
      A* a1 = acc + row_of[k + 1] * cols;
      A* a2 = acc + row_of[k + 2] * cols;
      A* a3 = acc + row_of[k + 3] * cols;
      for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
        const A v0 = to_acc(s0[j]), v1 = to_acc(s1[j]), v2 = to_acc(s2[j]), v3 = to_acc(s3[j]);
        a0[j] += v0;
        a1[j] += v1;
        a2[j] += v2;
        a3[j] += v3;
      }
    }
    for (; k < found; ++k) {
      const T* s = dy + (base + offset_of[k]) * c + c0;
      A* a = acc + row_of[k] * cols;
      for (u64 j = threadIdx.x; j < cols; j += blockDim.x) a[j] += to_acc(s[j]);
    }
  }
  __syncthreads();
  for (u64 k = threadIdx.x; k < rows * cols; k += blockDim.x) {
    const u64 r = k / cols, j = k - r * cols;
    grad[(r0 + r) * c + c0 + j] = from_acc<T>(acc[k]);
  }
}

#define EMBEDDING_FOR(suffix, T, id_suffix, I)                                                     \
  extern "C" __global__ void embedding_##id_suffix##_##suffix(const T* table, const I* ids, T* out, \
                                                              u64 n, u64 v, u64 c) {               \
    embedding<T, I>(table, ids, out, n, v, c);                                                     \
  }                                                                                                \
  /* 1024 threads a block: at most 64 registers each, also when a driver JITs the PTX */       \
  extern "C" __global__ void __launch_bounds__(1024)                                               \
      embedding_backward_##id_suffix##_##suffix(                                                    \
      const T* dy, const I* ids, T* grad, u64 n, u64 v, u64 c, u64 rows_per_block,                 \
      u64 cols_per_block) {                                                                        \
    embedding_backward<T, I>(dy, ids, grad, n, v, c, rows_per_block, cols_per_block);              \
  }
#define EMBEDDING(suffix, T)                   \
  EMBEDDING_FOR(suffix, T, u32, unsigned)      \
  EMBEDDING_FOR(suffix, T, i64, long long)
FOR_EACH_DTYPE(EMBEDDING)
