// Causal flash attention (FlashAttention-2), forward and backward; see flash_attention.rs for the
// formulas and the Rust side (flash_attention/cuda.rs) for the launch shapes.
//
// Inputs: q [B, T, H, D], k and v [B, T, Hkv, D], each read in place through its own batch, token
// and head strides (in elements, the head dimension contiguous) from a pointer at its view's
// offset; query head h reads key/value head h / (H / Hkv). Outputs are contiguous: o [B, T, H, D],
// the log-sum-exp lse [B, H, T] (in the arithmetic type), and the packed gradient dqkv
// [B, T, H + 2·Hkv, D] (query heads, then key heads, then value heads).
//
// The kernels:
//   - `*_mma_d{64,128}_{bf16,f16}`: tensor-core kernels (mma.cuh) for bf16/f16 and head dims 64
//     and 128. Four warps per block; each warp owns 16 rows of the block's 64 (queries in the
//     forward pass and dq, keys in dk/dv). Products go through m16n8k16 tiles whose accumulators
//     hold the scores; the causal mask, the online softmax and the probabilities are computed on
//     those registers, and the probabilities are re-packed in place as the A operand of the next
//     product (the C layout of two 8-column tiles is the A layout of one 16-wide k-slice). Keys,
//     values (and in dk/dv the queries and dO) pass through shared memory rows padded by 8
//     elements, so that the fragment loads of a warp hit 32 different banks. The softmax runs in
//     base 2 (exp2 of scores scaled by scale·log2(e)).
//   - `flash_delta_{f32,f64,bf16,f16}`: Δ of the backward pass.
// Other dtypes and head dims are computed on CUDA with cuBLAS products over materialized scores
// (attention_reference.rs, and the public op's fallback), which a kernel without tensor cores
// does not beat.
//
// The backward pass is deterministic: flash_delta computes Δ_i = Σ_d dO_id·O_id per row; dk and
// dv are summed in registers over the group's query heads and the query tiles in a fixed order by
// the one block that owns the key tile; dq by the one block that owns the query tile. No atomics.
#include "common.cuh"
#include "mma.cuh"

// Threads of every kernel here.
#define FLASH_THREADS 128
// Rows per block of the tensor-core kernels: 4 warps × 16.
#define FLASH_ROWS 64
// Padding of a shared-memory row, in 16-bit elements.
#define FLASH_PAD 8

// log2(e): the scores are scaled into base 2 once, so that the exponentials are exp2.
#define FLASH_LOG2E 1.4426950408889634f
#define FLASH_LN2 0.6931471805599453f

// ------------------------------------------------------------------------------------------------
// Tensor-core kernels
// ------------------------------------------------------------------------------------------------

typedef unsigned short u16;

// Two consecutive 16-bit elements as one fragment register (two 16-bit loads: a view's rows need
// not be 4-byte aligned), or 0 for a row at or past `limit`.
__device__ __forceinline__ uint32_t flash_pair(const u16* p, u64 row, u64 limit, u64 stride, int col) {
  if (row >= limit) return 0u;
  const u16* q = p + row * stride + col;
  return (uint32_t)q[0] | ((uint32_t)q[1] << 16);
}

// Rows r0 .. r0 + ROWS of one head (`g`: its token 0; `st`: elements between tokens) into shared
// rows of D + FLASH_PAD elements; rows at or past `limit` become zeros. 16-byte copies when every
// row start is 16-byte aligned, else 2-byte ones.
template <int D, int ROWS>
__device__ __forceinline__ void flash_load_tile(u16* s, const u16* g, u64 st, u64 r0, u64 limit) {
  const bool vec = ((reinterpret_cast<unsigned long long>(g) | (st * 2)) & 15ull) == 0;
  if (vec) {
    for (int idx = threadIdx.x; idx < ROWS * (D / 8); idx += blockDim.x) {
      const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
      uint4 val = make_uint4(0u, 0u, 0u, 0u);
      if (r0 + r < limit) val = *reinterpret_cast<const uint4*>(g + (r0 + r) * st + c);
      *reinterpret_cast<uint4*>(s + r * (D + FLASH_PAD) + c) = val;
    }
  } else {
    for (int idx = threadIdx.x; idx < ROWS * D; idx += blockDim.x) {
      const int r = idx / D, c = idx % D;
      s[r * (D + FLASH_PAD) + c] = r0 + r < limit ? g[(r0 + r) * st + c] : (u16)0;
    }
  }
}

// A B-fragment register whose two elements lie along a shared row: X[row][col], X[row][col + 1]
// (B[k][n] = X[n][k], X row-major by n: keys in q·kᵀ).
__device__ __forceinline__ uint32_t flash_row_pair(const u16* s, int pitch, int row, int col) {
  return *reinterpret_cast<const uint32_t*>(s + row * pitch + col);
}

// A B-fragment register whose two elements lie along a shared column: X[row][col],
// X[row + 1][col] (B[k][n] = X[k][n], X row-major by k: values in p·v).
__device__ __forceinline__ uint32_t flash_col_pair(const u16* s, int pitch, int row, int col) {
  return (uint32_t)s[row * pitch + col] | ((uint32_t)s[(row + 1) * pitch + col] << 16);
}

// The A fragments of 16 rows × D (rows r, r + 8 for this lane), read from global memory.
template <int D>
__device__ __forceinline__ void flash_a_from_global(uint32_t f[D / 16][4], const u16* g, u64 st,
                                                    u64 row, u64 limit, int t) {
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    f[kc][0] = flash_pair(g, row, limit, st, kc * 16 + 2 * t);
    f[kc][1] = flash_pair(g, row + 8, limit, st, kc * 16 + 2 * t);
    f[kc][2] = flash_pair(g, row, limit, st, kc * 16 + 2 * t + 8);
    f[kc][3] = flash_pair(g, row + 8, limit, st, kc * 16 + 2 * t + 8);
  }
}

// The A fragment of k-slice `kc` of 16 shared rows from `row` (rows row + g, row + g + 8).
template <int D>
__device__ __forceinline__ void flash_a_from_shared(uint32_t a[4], const u16* s, int row, int kc,
                                                    int g, int t) {
  const int pitch = D + FLASH_PAD;
  a[0] = flash_row_pair(s, pitch, row + g, kc * 16 + 2 * t);
  a[1] = flash_row_pair(s, pitch, row + g + 8, kc * 16 + 2 * t);
  a[2] = flash_row_pair(s, pitch, row + g, kc * 16 + 2 * t + 8);
  a[3] = flash_row_pair(s, pitch, row + g + 8, kc * 16 + 2 * t + 8);
}

// s[N/8] += A · Xᵀ for the A fragments `a` (16 rows × D) and N shared rows of X (D wide): the
// scores of 16 queries against N keys (or of 16 keys against N queries).
template <typename T, int D, int N>
__device__ __forceinline__ void flash_scores(float s[N / 8][4], const uint32_t a[D / 16][4],
                                             const u16* x, int g, int t) {
  const int pitch = D + FLASH_PAD;
#pragma unroll
  for (int nc = 0; nc < N / 8; ++nc) {
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      const uint32_t b[2] = {flash_row_pair(x, pitch, nc * 8 + g, kc * 16 + 2 * t),
                             flash_row_pair(x, pitch, nc * 8 + g, kc * 16 + 2 * t + 8)};
      mma_m16n8k16<T>(s[nc], a[kc], b);
    }
  }
}

// acc[D/8] += P · X for P (16 rows × K) in C-fragment registers `p` (K/8 tiles of 8 columns) and
// K shared rows of X (D wide): p·v, ds·k, pᵀ·dO, dsᵀ·q. P is rounded to T, packed in place as A.
template <typename T, int D, int K>
__device__ __forceinline__ void flash_accumulate(float acc[D / 8][4], const float p[K / 8][4],
                                                 const u16* x, int g, int t) {
  const int pitch = D + FLASH_PAD;
#pragma unroll
  for (int kc = 0; kc < K / 16; ++kc) {
    const uint32_t a[4] = {mma_pack<T>(p[2 * kc][0], p[2 * kc][1]),
                           mma_pack<T>(p[2 * kc][2], p[2 * kc][3]),
                           mma_pack<T>(p[2 * kc + 1][0], p[2 * kc + 1][1]),
                           mma_pack<T>(p[2 * kc + 1][2], p[2 * kc + 1][3])};
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      const uint32_t b[2] = {flash_col_pair(x, pitch, kc * 16 + 2 * t, nd * 8 + g),
                             flash_col_pair(x, pitch, kc * 16 + 2 * t + 8, nd * 8 + g)};
      mma_m16n8k16<T>(acc[nd], a, b);
    }
  }
}

// The maximum over the four lanes of a row (lanes 4g .. 4g + 3 hold its columns).
__device__ __forceinline__ float flash_row_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float flash_row_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Writes 16 rows × D of f32 accumulators times `mul[r]` (r = 0: row `row`, 1: row `row + 8`) as
// T into rows of `out` (`st` elements apart; rows at or past `limit` skipped).
template <typename T, int D>
__device__ __forceinline__ void flash_store(const float acc[D / 8][4], const float mul[2], u16* out,
                                            u64 st, u64 row, u64 limit, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const u64 rr = row + 8 * r;
    if (rr >= limit) continue;
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      u16* p = out + rr * st + nd * 8 + 2 * t;
      p[0] = MmaElement<T>::from_float(acc[nd][2 * r] * mul[r]);
      p[1] = MmaElement<T>::from_float(acc[nd][2 * r + 1] * mul[r]);
    }
  }
}

// The query tile, (batch, head) and head indices of a forward or dq block. Tiles run last first:
// the last queries see the most keys, so the longest blocks start first.
struct FlashBlock {
  u64 b, h, hk, i0;
};
__device__ __forceinline__ FlashBlock flash_query_block(u64 tokens, u64 heads, u64 kv_heads) {
  const u64 tiles = (tokens + FLASH_ROWS - 1) / FLASH_ROWS;
  const u64 bh = blockIdx.y;
  FlashBlock f;
  f.b = bh / heads;
  f.h = bh % heads;
  f.hk = f.h / (heads / kv_heads);
  f.i0 = (tiles - 1 - blockIdx.x) * FLASH_ROWS;
  return f;
}

// Forward: o and lse for 64 queries of one (batch, head), keys in tiles of BC.
template <typename T, int D, int BC>
__device__ void flash_forward_mma(const T* q_, u64 q_sb, u64 q_st, u64 q_sh, const T* k_, u64 k_sb,
                                  u64 k_st, u64 k_sh, const T* v_, u64 v_sb, u64 v_st, u64 v_sh,
                                  T* o_, float* lse, u64 tokens, u64 heads, u64 kv_heads,
                                  double scale_) {
  __shared__ __align__(16) u16 sk[BC * (D + FLASH_PAD)];
  __shared__ __align__(16) u16 sv[BC * (D + FLASH_PAD)];
  const FlashBlock blk = flash_query_block(tokens, heads, kv_heads);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const u16* q = reinterpret_cast<const u16*>(q_) + blk.b * q_sb + blk.h * q_sh;
  const u16* k = reinterpret_cast<const u16*>(k_) + blk.b * k_sb + blk.hk * k_sh;
  const u16* v = reinterpret_cast<const u16*>(v_) + blk.b * v_sb + blk.hk * v_sh;
  const float scale = (float)scale_ * FLASH_LOG2E;
  // This lane's query rows: row0 (r = 0) and row0 + 8 (r = 1).
  const u64 row0 = blk.i0 + warp * 16 + g;
  uint32_t qf[D / 16][4];
  flash_a_from_global<D>(qf, q, q_st, row0, tokens, t);
  float acc[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  // Keys up to the tile's last query.
  const u64 end = min(tokens, blk.i0 + FLASH_ROWS);
  for (u64 j0 = 0; j0 < end; j0 += BC) {
    __syncthreads();  // every warp is done with the previous tile
    flash_load_tile<D, BC>(sk, k, k_st, j0, tokens);
    flash_load_tile<D, BC>(sv, v, v_st, j0, tokens);
    __syncthreads();
    float s[BC / 8][4];
#pragma unroll
    for (int nc = 0; nc < BC / 8; ++nc) s[nc][0] = s[nc][1] = s[nc][2] = s[nc][3] = 0.0f;
    flash_scores<T, D, BC>(s, qf, sk, g, t);
    // Mask (keys after the query, keys past the end) and scale; the row maxima.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nc = 0; nc < BC / 8; ++nc) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u64 row = row0 + 8 * (i >> 1), col = j0 + nc * 8 + 2 * t + (i & 1);
        const float x = (col <= row && col < tokens) ? s[nc][i] * scale : -INFINITY;
        s[nc][i] = x;
        mx[i >> 1] = fmaxf(mx[i >> 1], x);
      }
    }
    float base[2], corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], flash_row_max(mx[r]));
      // A row that has seen no key yet has nothing to rescale (and no e^(−∞ + ∞)).
      base[r] = m_new == -INFINITY ? 0.0f : m_new;
      corr[r] = exp2f(m[r] - base[r]);
      m[r] = m_new;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int nc = 0; nc < BC / 8; ++nc) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = exp2f(s[nc][i] - base[i >> 1]);
        s[nc][i] = p;
        l[i >> 1] += p;  // this lane's part of the row sum; the lanes are added at the end
      }
    }
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[nd][i] *= corr[i >> 1];
    }
    flash_accumulate<T, D, BC>(acc, s, sv, g, t);
  }
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = flash_row_sum(l[r]);
    inv[r] = 1.0f / l[r];
  }
  const u64 o_st = heads * D;
  flash_store<T, D>(acc, inv, reinterpret_cast<u16*>(o_) + blk.b * tokens * o_st + blk.h * D, o_st,
                    row0, tokens, t);
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const u64 row = row0 + 8 * r;
      if (row < tokens) lse[(blk.b * heads + blk.h) * tokens + row] = (m[r] + log2f(l[r])) * FLASH_LN2;
    }
  }
}

// dq for 64 queries of one (batch, head): dq = scale · Σ_keys ds k, ds = p ∘ (dO vᵀ − Δ).
template <typename T, int D, int BC>
__device__ void flash_dq_mma(const T* q_, u64 q_sb, u64 q_st, u64 q_sh, const T* k_, u64 k_sb,
                             u64 k_st, u64 k_sh, const T* v_, u64 v_sb, u64 v_st, u64 v_sh,
                             const T* do_, const float* lse, const float* delta, T* dqkv,
                             u64 tokens, u64 heads, u64 kv_heads, double scale_) {
  __shared__ __align__(16) u16 sk[BC * (D + FLASH_PAD)];
  __shared__ __align__(16) u16 sv[BC * (D + FLASH_PAD)];
  const FlashBlock blk = flash_query_block(tokens, heads, kv_heads);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const u16* q = reinterpret_cast<const u16*>(q_) + blk.b * q_sb + blk.h * q_sh;
  const u16* k = reinterpret_cast<const u16*>(k_) + blk.b * k_sb + blk.hk * k_sh;
  const u16* v = reinterpret_cast<const u16*>(v_) + blk.b * v_sb + blk.hk * v_sh;
  const u64 o_st = heads * D;
  const u16* dout = reinterpret_cast<const u16*>(do_) + blk.b * tokens * o_st + blk.h * D;
  const float scale = (float)scale_ * FLASH_LOG2E;
  const u64 row0 = blk.i0 + warp * 16 + g;
  uint32_t qf[D / 16][4], df[D / 16][4];
  flash_a_from_global<D>(qf, q, q_st, row0, tokens, t);
  flash_a_from_global<D>(df, dout, o_st, row0, tokens, t);
  // The rows' log-sum-exp in base 2 and Δ (0 for rows past the end, which are never stored).
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const u64 row = row0 + 8 * r;
    const u64 at = (blk.b * heads + blk.h) * tokens + row;
    lse2[r] = row < tokens ? lse[at] * FLASH_LOG2E : 0.0f;
    dl[r] = row < tokens ? delta[at] : 0.0f;
  }
  float dq[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) dq[nd][0] = dq[nd][1] = dq[nd][2] = dq[nd][3] = 0.0f;
  const u64 end = min(tokens, blk.i0 + FLASH_ROWS);
  for (u64 j0 = 0; j0 < end; j0 += BC) {
    __syncthreads();
    flash_load_tile<D, BC>(sk, k, k_st, j0, tokens);
    flash_load_tile<D, BC>(sv, v, v_st, j0, tokens);
    __syncthreads();
    float s[BC / 8][4], dp[BC / 8][4];
#pragma unroll
    for (int nc = 0; nc < BC / 8; ++nc) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nc][i] = dp[nc][i] = 0.0f;
    }
    flash_scores<T, D, BC>(s, qf, sk, g, t);
    flash_scores<T, D, BC>(dp, df, sv, g, t);  // dp = dO vᵀ
#pragma unroll
    for (int nc = 0; nc < BC / 8; ++nc) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u64 row = row0 + 8 * (i >> 1), col = j0 + nc * 8 + 2 * t + (i & 1);
        const float p = (col <= row && col < tokens) ? exp2f(s[nc][i] * scale - lse2[i >> 1]) : 0.0f;
        s[nc][i] = p * (dp[nc][i] - dl[i >> 1]);  // ds
      }
    }
    flash_accumulate<T, D, BC>(dq, s, sk, g, t);
  }
  const u64 width = heads + 2 * kv_heads;
  const float mul[2] = {(float)scale_, (float)scale_};
  flash_store<T, D>(dq, mul, reinterpret_cast<u16*>(dqkv) + blk.b * tokens * width * D + blk.h * D,
                    width * D, row0, tokens, t);
}

// dk and dv for 64 keys of one (batch, key/value head), summed over the group's query heads and
// their queries (BR at a time): dv = Σ pᵀ dO, dk = scale · Σ dsᵀ q, computed as the transposed
// products (keys are the rows of every tile).
template <typename T, int D, int BR>
__device__ void flash_dkv_mma(const T* q_, u64 q_sb, u64 q_st, u64 q_sh, const T* k_, u64 k_sb,
                              u64 k_st, u64 k_sh, const T* v_, u64 v_sb, u64 v_st, u64 v_sh,
                              const T* do_, const float* lse, const float* delta, T* dqkv,
                              u64 tokens, u64 heads, u64 kv_heads, double scale_) {
  __shared__ __align__(16) u16 sk[FLASH_ROWS * (D + FLASH_PAD)];
  __shared__ __align__(16) u16 sv[FLASH_ROWS * (D + FLASH_PAD)];
  __shared__ __align__(16) u16 sq[BR * (D + FLASH_PAD)];
  __shared__ __align__(16) u16 sd[BR * (D + FLASH_PAD)];
  __shared__ float slse[BR], sdelta[BR];
  const u64 bh = blockIdx.y, b = bh / kv_heads, hk = bh % kv_heads;
  const u64 group = heads / kv_heads;
  // Key tiles first to last: the first keys are seen by the most queries.
  const u64 j0 = (u64)blockIdx.x * FLASH_ROWS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const u16* k = reinterpret_cast<const u16*>(k_) + b * k_sb + hk * k_sh;
  const u16* v = reinterpret_cast<const u16*>(v_) + b * v_sb + hk * v_sh;
  const u64 o_st = heads * D;
  const float scale = (float)scale_ * FLASH_LOG2E;
  // This lane's keys: key0 (r = 0) and key0 + 8 (r = 1).
  const u64 key0 = j0 + warp * 16 + g;
  flash_load_tile<D, FLASH_ROWS>(sk, k, k_st, j0, tokens);
  flash_load_tile<D, FLASH_ROWS>(sv, v, v_st, j0, tokens);
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dk[nd][i] = dv[nd][i] = 0.0f;
  }
  for (u64 h = hk * group; h < (hk + 1) * group; ++h) {
    const u16* q = reinterpret_cast<const u16*>(q_) + b * q_sb + h * q_sh;
    const u16* dout = reinterpret_cast<const u16*>(do_) + b * tokens * o_st + h * D;
    const u64 rows = (b * heads + h) * tokens;
    // The first query tile with a query that sees key j0.
    for (u64 i0 = (j0 / BR) * BR; i0 < tokens; i0 += BR) {
      __syncthreads();  // every warp is done with the previous queries
      flash_load_tile<D, BR>(sq, q, q_st, i0, tokens);
      flash_load_tile<D, BR>(sd, dout, o_st, i0, tokens);
      for (int r = threadIdx.x; r < BR; r += blockDim.x) {
        const bool in = i0 + r < tokens;
        slse[r] = in ? lse[rows + i0 + r] * FLASH_LOG2E : 0.0f;
        sdelta[r] = in ? delta[rows + i0 + r] : 0.0f;
      }
      __syncthreads();
      // sᵀ = k qᵀ and dpᵀ = v dOᵀ: this warp's 16 keys against the BR queries.
      float st[BR / 8][4], dpt[BR / 8][4];
#pragma unroll
      for (int nc = 0; nc < BR / 8; ++nc) {
#pragma unroll
        for (int i = 0; i < 4; ++i) st[nc][i] = dpt[nc][i] = 0.0f;
      }
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t ka[4], va[4];
        flash_a_from_shared<D>(ka, sk, warp * 16, kc, g, t);
        flash_a_from_shared<D>(va, sv, warp * 16, kc, g, t);
#pragma unroll
        for (int nc = 0; nc < BR / 8; ++nc) {
          const int pitch = D + FLASH_PAD;
          const uint32_t bq[2] = {flash_row_pair(sq, pitch, nc * 8 + g, kc * 16 + 2 * t),
                                  flash_row_pair(sq, pitch, nc * 8 + g, kc * 16 + 2 * t + 8)};
          const uint32_t bd[2] = {flash_row_pair(sd, pitch, nc * 8 + g, kc * 16 + 2 * t),
                                  flash_row_pair(sd, pitch, nc * 8 + g, kc * 16 + 2 * t + 8)};
          mma_m16n8k16<T>(st[nc], ka, bq);
          mma_m16n8k16<T>(dpt[nc], va, bd);
        }
      }
      // pᵀ and dsᵀ = pᵀ ∘ (dpᵀ − Δ_query), 0 where the query does not see the key.
#pragma unroll
      for (int nc = 0; nc < BR / 8; ++nc) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const u64 key = key0 + 8 * (i >> 1);
          const int c = nc * 8 + 2 * t + (i & 1);
          const u64 query = i0 + c;
          const float p = (query >= key && query < tokens && key < tokens)
                              ? exp2f(st[nc][i] * scale - slse[c])
                              : 0.0f;
          st[nc][i] = p;
          dpt[nc][i] = p * (dpt[nc][i] - sdelta[c]);
        }
      }
      flash_accumulate<T, D, BR>(dv, st, sd, g, t);   // dv += pᵀ dO
      flash_accumulate<T, D, BR>(dk, dpt, sq, g, t);  // dk += dsᵀ q
    }
  }
  const u64 width = heads + 2 * kv_heads;
  u16* out = reinterpret_cast<u16*>(dqkv) + b * tokens * width * D;
  const float mk[2] = {(float)scale_, (float)scale_}, mv[2] = {1.0f, 1.0f};
  flash_store<T, D>(dk, mk, out + (heads + hk) * D, width * D, key0, tokens, t);
  flash_store<T, D>(dv, mv, out + (heads + kv_heads + hk) * D, width * D, key0, tokens, t);
}

#define FLASH_QKV_PARAMS(T)                                                                     \
  const T *q, u64 q_sb, u64 q_st, u64 q_sh, const T *k, u64 k_sb, u64 k_st, u64 k_sh, const T *v, \
      u64 v_sb, u64 v_st, u64 v_sh
#define FLASH_QKV_ARGS q, q_sb, q_st, q_sh, k, k_sb, k_st, k_sh, v, v_sb, v_st, v_sh

// BC: keys per tile of the forward pass and dq; BR: queries per step of dk/dv. Chosen so that the
// static shared memory stays under 48 KiB and the accumulators in registers.
#define FLASH_MMA(suffix, T, D, BC, BR)                                                           \
  extern "C" __global__ void __launch_bounds__(FLASH_THREADS)                                     \
      flash_forward_mma_d##D##_##suffix(FLASH_QKV_PARAMS(T), T* o, float* lse, u64 tokens,         \
                                        u64 heads, u64 kv_heads, double scale) {                   \
    flash_forward_mma<T, D, BC>(FLASH_QKV_ARGS, o, lse, tokens, heads, kv_heads, scale);          \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(FLASH_THREADS)                                     \
      flash_dq_mma_d##D##_##suffix(FLASH_QKV_PARAMS(T), const T* d_o, const float* lse,            \
                                   const float* delta, T* dqkv, u64 tokens, u64 heads,            \
                                   u64 kv_heads, double scale) {                                   \
    flash_dq_mma<T, D, BC>(FLASH_QKV_ARGS, d_o, lse, delta, dqkv, tokens, heads, kv_heads, scale); \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(FLASH_THREADS)                                     \
      flash_dkv_mma_d##D##_##suffix(FLASH_QKV_PARAMS(T), const T* d_o, const float* lse,           \
                                    const float* delta, T* dqkv, u64 tokens, u64 heads,           \
                                    u64 kv_heads, double scale) {                                  \
    flash_dkv_mma<T, D, BR>(FLASH_QKV_ARGS, d_o, lse, delta, dqkv, tokens, heads, kv_heads,       \
                            scale);                                                               \
  }
FLASH_MMA(bf16, __nv_bfloat16, 64, 64, 64)
FLASH_MMA(bf16, __nv_bfloat16, 128, 32, 16)
FLASH_MMA(f16, __half, 64, 64, 64)
FLASH_MMA(f16, __half, 128, 32, 16)

// ------------------------------------------------------------------------------------------------
// Δ
// ------------------------------------------------------------------------------------------------

// Δ for every row of the contiguous o and dO [B, T, H, D] into [B, H, T]: one warp per row (row r
// is token (r / H) mod T, head r mod H of batch entry r / (T·H)), rows in a grid-stride loop.
template <typename T>
__device__ void flash_delta(const T* o, const T* d_o, typename AccOf<T>::type* delta, u64 rows,
                            u64 tokens, u64 heads, u64 d) {
  typedef typename AccOf<T>::type A;
  const u64 warps = blockDim.x / 32, lane = threadIdx.x & 31;
  for (u64 r = (u64)blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += (u64)gridDim.x * warps) {
    A s = 0;
    for (u64 c = lane; c < d; c += 32) s += to_acc(o[r * d + c]) * to_acc(d_o[r * d + c]);
    s = warp_reduce(s, SumOp());
    const u64 b = r / (tokens * heads), t = (r / heads) % tokens, h = r % heads;
    if (lane == 0) delta[(b * heads + h) * tokens + t] = s;
  }
}

#define FLASH_DELTA(suffix, T)                                                                    \
  extern "C" __global__ void flash_delta_##suffix(const T* o, const T* d_o,                       \
                                                  AccOf<T>::type* delta, u64 rows, u64 tokens,    \
                                                  u64 heads, u64 d) {                             \
    flash_delta<T>(o, d_o, delta, rows, tokens, heads, d);                                        \
  }
FOR_EACH_DTYPE(FLASH_DELTA)
