//! The CPU kernels: tiles of [`BLOCK_Q`] queries × [`BLOCK_K`] keys, products through the `gemm`
//! crate (candle's own CPU matrix engine) on f32/f64 scratch tiles, the softmax online in the
//! arithmetic type, never more than one tile of scores at a time.
//!
//! Work is split over rayon by tiles: (batch, head, query tile) for the forward pass and for
//! `dq`, (batch, key/value head, key tile) for `dk`/`dv`. Each task computes its tile alone in a
//! fixed order and the tiles are copied into the result afterwards, so the bits do not depend on
//! the number of threads.

use super::{Dims, Strides};
use crate::element::Element;
use candle_core::CpuStorage;
use num_traits::{Float, One, Zero};
use rayon::prelude::*;

/// Query rows per tile. 64 × 64 tiles of f32 scores (16 KiB) stay in L1/L2 next to the `q`, `k`,
/// `v` tiles, and a 64-row product is long enough for gemm's micro-kernels.
pub(super) const BLOCK_Q: usize = 64;

/// Keys per tile.
pub(super) const BLOCK_K: usize = 64;

/// The arithmetic type of the kernels (f32 for f32/bf16/f16, f64 for f64): its matrix product
/// and exponential.
pub(crate) trait Arith: Float + Send + Sync + std::fmt::Debug + 'static {
    /// `dst` (`m × n`, rows of `n`) `= [dst +] beta · lhs · rhs`.
    ///
    /// # Safety
    /// `lhs` and `rhs` must cover every element their strides reach for `m`, `n`, `k` (checked by
    /// [`product`]).
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        m: usize,
        n: usize,
        k: usize,
        dst: *mut Self,
        accumulate: bool,
        lhs: (*const Self, usize, usize),
        rhs: (*const Self, usize, usize),
        beta: Self,
    );
    /// `e^x` (a vectorizable polynomial for f32, libm's for f64).
    fn fast_exp(x: Self) -> Self;
    /// `x ← e^(x − shift)` in place, returning the sum of the results.
    fn exp_shifted(x: &mut [Self], shift: Self) -> Self;
    /// Wraps values into storage.
    fn storage(values: Vec<Self>) -> CpuStorage;
    /// The storage's values when it holds this type.
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
}

macro_rules! arith {
    ($t:ty, $variant:ident, $exp:expr, $exp_shifted:expr) => {
        impl Arith for $t {
            unsafe fn gemm(
                m: usize,
                n: usize,
                k: usize,
                dst: *mut Self,
                accumulate: bool,
                lhs: (*const Self, usize, usize),
                rhs: (*const Self, usize, usize),
                beta: Self,
            ) {
                // SAFETY: the caller's bounds (see the trait); `dst` is `m × n` with rows of `n`.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        dst,
                        1,
                        n as isize,
                        accumulate,
                        lhs.0,
                        lhs.2 as isize,
                        lhs.1 as isize,
                        rhs.0,
                        rhs.2 as isize,
                        rhs.1 as isize,
                        1.0,
                        beta,
                        false,
                        false,
                        false,
                        // The tiles are the parallel tasks; a product stays on its thread.
                        gemm::Parallelism::None,
                    )
                }
            }
            #[inline(always)]
            fn fast_exp(x: Self) -> Self {
                $exp(x)
            }
            fn exp_shifted(x: &mut [Self], shift: Self) -> Self {
                $exp_shifted(x, shift)
            }
            fn storage(values: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(values)
            }
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
arith!(f32, F32, exp_f32, exp_shifted_f32);
arith!(f64, F64, f64::exp, exp_shifted_portable::<f64>);

/// `e^x` in f32 within 2 ulp (Cody–Waite reduction to `r ∈ [−ln2/2, ln2/2]`, Cephes' degree-6
/// polynomial for `e^r`, the power of two from the bits). Branch-free, so that the loops over a
/// tile's scores vectorize (libm's `expf` is a call per element, as costly as the products
/// themselves at head dim 64). Inputs below −87 give `e^−87` (≈ 1.6e−38 instead of a smaller
/// number or 0; the kernels never exponentiate a masked score); NaN stays NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n · LN2_HI is exact for |n| < 2⁹.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding it rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    // clamp keeps NaN.
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e_r = p * r * r + r + 1.0;
    // 2^n, n ∈ [−126, 127] for the clamped x: the biased exponent n + 127 is 1..=254.
    let bits = (t.to_bits() as i32 - ROUND.to_bits() as i32 + 127) << 23;
    e_r * f32::from_bits(bits as u32)
}

/// One of `q`, `k`, `v` (or a contiguous `o`, `d_o`) read in place.
#[derive(Clone, Copy)]
pub(crate) struct Source<'a, T> {
    /// The storage's elements.
    pub(crate) data: &'a [T],
    /// Where each head lies in them.
    pub(crate) at: Strides,
}

impl<T: Element> Source<'_, T> {
    /// Rows `t0 .. t0 + n` of head `h` of batch entry `b` (each `d` elements) into `dst` as the
    /// arithmetic type, rows of `d`.
    fn load(&self, b: usize, h: usize, t0: usize, n: usize, d: usize, dst: &mut [T::Acc]) {
        let base = self.at.offset + b * self.at.batch + h * self.at.head;
        for (r, row) in dst[..n * d].chunks_exact_mut(d).enumerate() {
            let start = base + (t0 + r) * self.at.token;
            for (x, y) in row.iter_mut().zip(&self.data[start..start + d]) {
                *x = y.to_acc();
            }
        }
    }
}

/// A matrix operand: elements, the stride between rows and the stride between columns.
#[derive(Clone, Copy)]
struct Operand<'a, A> {
    data: &'a [A],
    row: usize,
    col: usize,
}

/// A row-major `rows × cols` matrix.
fn row_major<A>(data: &[A], cols: usize) -> Operand<'_, A> {
    Operand {
        data,
        row: cols,
        col: 1,
    }
}

/// The transpose of a row-major matrix with `cols` columns.
fn transpose_of<A>(data: &[A], cols: usize) -> Operand<'_, A> {
    Operand {
        data,
        row: 1,
        col: cols,
    }
}

/// `dst` (`m × n`, rows of `n`) `= [dst +] beta · lhs · rhs` for `lhs` `m × k`, `rhs` `k × n`.
fn product<A: Arith>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [A],
    accumulate: bool,
    lhs: Operand<'_, A>,
    rhs: Operand<'_, A>,
    beta: A,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(A::zero());
        }
        return;
    }
    // The bounds gemm's raw pointers rely on.
    assert!(dst.len() >= m * n);
    assert!((m - 1) * lhs.row + (k - 1) * lhs.col < lhs.data.len());
    assert!((k - 1) * rhs.row + (n - 1) * rhs.col < rhs.data.len());
    // SAFETY: checked just above; `dst` does not alias the operands (a `&mut` borrow).
    unsafe {
        A::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            accumulate,
            (lhs.data.as_ptr(), lhs.row, lhs.col),
            (rhs.data.as_ptr(), rhs.row, rhs.col),
            beta,
        )
    }
}

/// Keys `j0 ..` a query `i` sees among the `cols` keys of a tile starting at `j0`.
#[inline]
fn seen(i: usize, j0: usize, cols: usize) -> usize {
    if i < j0 {
        0
    } else {
        (i - j0 + 1).min(cols)
    }
}

/// The largest of `x`, ignoring NaN like `f32::max` (eight running maxima, so that it
/// vectorizes).
fn max_of<A: Arith>(x: &[A]) -> A {
    let mut lanes = [A::neg_infinity(); 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l = l.max(*v);
        }
    }
    let mut m = chunks
        .remainder()
        .iter()
        .fold(A::neg_infinity(), |m, v| m.max(*v));
    for l in lanes {
        m = m.max(l);
    }
    m
}

/// `x ← e^(x − shift)` in place, returning the sum of the results (sixteen running sums in a
/// fixed order, so that it vectorizes and its result depends on nothing but `x`).
#[inline(always)]
fn exp_shifted_portable<A: Arith>(x: &mut [A], shift: A) -> A {
    let mut lanes = [A::zero(); 16];
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *v = A::fast_exp(*v - shift);
            *l = *l + *v;
        }
    }
    let mut s = A::zero();
    for v in chunks.into_remainder() {
        *v = A::fast_exp(*v - shift);
        s = s + *v;
    }
    lanes.iter().fold(s, |s, l| s + *l)
}

/// [`exp_shifted_portable`] compiled for AVX-512 (the crate is built for baseline x86-64, whose
/// 4-wide SSE makes the exponentials as costly as the tile products).
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_avx512(x: &mut [f32], shift: f32) -> f32 {
    exp_shifted_portable(x, shift)
}

/// [`exp_shifted_portable`] compiled for AVX2.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_shifted_avx2(x: &mut [f32], shift: f32) -> f32 {
    exp_shifted_portable(x, shift)
}

/// `x ← e^(x − shift)` in f32, with the widest vectors the CPU has. Every variant computes the
/// same bits: the same operations, element by element, and the same order of the sums (no
/// fused multiply-adds: Rust does not contract `a * b + c`).
fn exp_shifted_f32(x: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F is present.
            return unsafe { exp_shifted_avx512(x, shift) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present.
            return unsafe { exp_shifted_avx2(x, shift) };
        }
    }
    exp_shifted_portable(x, shift)
}

/// `x ← e^(x − shift)` in place, returning the sum of the results.
fn exp_shifted<A: Arith>(x: &mut [A], shift: A) -> A {
    A::exp_shifted(x, shift)
}

/// Runs `task(i)` for `i` in `0..n` over rayon's threads, results in order.
fn tasks<R: Send>(n: usize, task: impl Fn(usize) -> R + Send + Sync) -> Vec<R> {
    if n > 1 && rayon::current_num_threads() > 1 {
        (0..n).into_par_iter().map(task).collect()
    } else {
        (0..n).map(task).collect()
    }
}

/// The forward pass: `o` `[B, T, H, D]` and the log-sum-exp of every row `[B, H, T]`.
pub(crate) fn forward<T: Element>(
    q: Source<'_, T>,
    k: Source<'_, T>,
    v: Source<'_, T>,
    dims: Dims,
    scale: f64,
) -> (Vec<T>, Vec<T::Acc>)
where
    T::Acc: Arith,
{
    let Dims {
        batch,
        tokens,
        heads,
        head_dim: d,
        ..
    } = dims;
    let tiles = tokens.div_ceil(BLOCK_Q);
    let scale = crate::element::constant::<T::Acc>(scale);
    let results = tasks(batch * heads * tiles, |task| {
        let (bh, tile) = (task / tiles, task % tiles);
        forward_tile(q, k, v, dims, scale, bh / heads, bh % heads, tile * BLOCK_Q)
    });
    let mut o = vec![T::from_acc(T::Acc::zero()); batch * tokens * heads * d];
    let mut lse = vec![T::Acc::zero(); batch * heads * tokens];
    for (task, (o_tile, lse_tile)) in results.into_iter().enumerate() {
        let (bh, i0) = (task / tiles, (task % tiles) * BLOCK_Q);
        let (b, h) = (bh / heads, bh % heads);
        for (r, row) in o_tile.chunks_exact(d.max(1)).enumerate() {
            let start = ((b * tokens + i0 + r) * heads + h) * d;
            o[start..start + d].copy_from_slice(row);
        }
        let start = bh * tokens + i0;
        lse[start..start + lse_tile.len()].copy_from_slice(&lse_tile);
    }
    (o, lse)
}

/// The output rows and log-sum-exps of the queries `i0 ..` of head `h` of batch entry `b`.
#[allow(clippy::too_many_arguments)]
fn forward_tile<T: Element>(
    q: Source<'_, T>,
    k: Source<'_, T>,
    v: Source<'_, T>,
    dims: Dims,
    scale: T::Acc,
    b: usize,
    h: usize,
    i0: usize,
) -> (Vec<T>, Vec<T::Acc>)
where
    T::Acc: Arith,
{
    let d = dims.head_dim;
    let hk = h / dims.group();
    let rows = BLOCK_Q.min(dims.tokens - i0);
    let zero = T::Acc::zero();
    let mut qt = vec![zero; rows * d];
    let (mut kt, mut vt) = (vec![zero; BLOCK_K * d], vec![zero; BLOCK_K * d]);
    let mut s = vec![zero; rows * BLOCK_K];
    let mut acc = vec![zero; rows * d];
    let mut m = vec![T::Acc::neg_infinity(); rows];
    let mut l = vec![zero; rows];
    q.load(b, h, i0, rows, d, &mut qt);
    // The last key any row of the tile sees is its last query.
    let end = i0 + rows;
    for j0 in (0..end).step_by(BLOCK_K) {
        let cols = BLOCK_K.min(end - j0);
        k.load(b, hk, j0, cols, d, &mut kt);
        v.load(b, hk, j0, cols, d, &mut vt);
        let s = &mut s[..rows * cols];
        // s = scale · q kᵀ
        product(
            (rows, cols, d),
            s,
            false,
            row_major(&qt, d),
            transpose_of(&kt[..cols * d], d),
            scale,
        );
        for r in 0..rows {
            let row = &mut s[r * cols..(r + 1) * cols];
            let n = seen(i0 + r, j0, cols);
            if n == 0 {
                row.fill(zero);
                continue;
            }
            let m_new = m[r].max(max_of(&row[..n]));
            // The first tile a row sees has nothing to rescale (and e^(−∞ − m) is not computed).
            let correction = if m[r] == T::Acc::neg_infinity() {
                zero
            } else {
                T::Acc::fast_exp(m[r] - m_new)
            };
            let sum = exp_shifted(&mut row[..n], m_new);
            row[n..].fill(zero);
            l[r] = l[r] * correction + sum;
            if correction != T::Acc::one() {
                for a in &mut acc[r * d..(r + 1) * d] {
                    *a = *a * correction;
                }
            }
            m[r] = m_new;
        }
        // acc += p v
        product(
            (rows, d, cols),
            &mut acc,
            true,
            row_major(s, cols),
            row_major(&vt[..cols * d], d),
            T::Acc::one(),
        );
    }
    let mut o = Vec::with_capacity(rows * d);
    for r in 0..rows {
        let inv = l[r].recip();
        o.extend(
            acc[r * d..(r + 1) * d]
                .iter()
                .map(|a| T::from_acc(*a * inv)),
        );
    }
    let lse = (0..rows).map(|r| m[r] + l[r].ln()).collect();
    (o, lse)
}

/// The backward pass: `[dq, dk, dv]` packed into `[B, T, H + 2·Hkv, D]`, from `q`, `k`, `v`, the
/// contiguous `o` and `d_o` `[B, T, H, D]`, and the forward's log-sum-exp `[B, H, T]`.
pub(crate) fn backward<T: Element>(
    [q, k, v]: [Source<'_, T>; 3],
    o: &[T],
    d_o: &[T],
    lse: &[T::Acc],
    dims: Dims,
    scale: f64,
) -> Vec<T>
where
    T::Acc: Arith,
{
    let Dims {
        batch,
        tokens,
        heads,
        kv_heads,
        head_dim: d,
    } = dims;
    // Δ_i = Σ_d dO_id · O_id, per row [B, H, T].
    let mut delta = vec![T::Acc::zero(); batch * heads * tokens];
    let dot = |bh: usize, row: &mut [T::Acc]| {
        let (b, h) = (bh / heads, bh % heads);
        for (t, out) in row.iter_mut().enumerate() {
            let start = ((b * tokens + t) * heads + h) * d;
            *out = o[start..start + d]
                .iter()
                .zip(&d_o[start..start + d])
                .fold(T::Acc::zero(), |s, (x, y)| s + x.to_acc() * y.to_acc());
        }
    };
    if rayon::current_num_threads() > 1 {
        delta
            .par_chunks_mut(tokens.max(1))
            .enumerate()
            .for_each(|(bh, row)| dot(bh, row));
    } else {
        delta
            .chunks_mut(tokens.max(1))
            .enumerate()
            .for_each(|(bh, row)| dot(bh, row));
    }
    let d_o = Source {
        data: d_o,
        at: Strides::contiguous(tokens, heads, d),
    };
    let saved = Saved {
        d_o,
        lse,
        delta: &delta,
    };
    let scale = crate::element::constant::<T::Acc>(scale);
    let q_tiles = tokens.div_ceil(BLOCK_Q);
    let k_tiles = tokens.div_ceil(BLOCK_K);
    let dq = tasks(batch * heads * q_tiles, |task| {
        let (bh, tile) = (task / q_tiles, task % q_tiles);
        dq_tile(
            [q, k, v],
            saved,
            dims,
            scale,
            bh / heads,
            bh % heads,
            tile * BLOCK_Q,
        )
    });
    let dkv = tasks(batch * kv_heads * k_tiles, |task| {
        let (bh, tile) = (task / k_tiles, task % k_tiles);
        let (b, hk) = (bh / kv_heads, bh % kv_heads);
        dkv_tile([q, k, v], saved, dims, scale, b, hk, tile * BLOCK_K)
    });
    let packed = heads + 2 * kv_heads;
    let mut out = vec![T::from_acc(T::Acc::zero()); batch * tokens * packed * d];
    let mut put = |b: usize, head: usize, t0: usize, tile: &[T]| {
        for (r, row) in tile.chunks_exact(d.max(1)).enumerate() {
            let start = ((b * tokens + t0 + r) * packed + head) * d;
            out[start..start + d].copy_from_slice(row);
        }
    };
    for (task, tile) in dq.iter().enumerate() {
        let (bh, t0) = (task / q_tiles, (task % q_tiles) * BLOCK_Q);
        put(bh / heads, bh % heads, t0, tile);
    }
    for (task, (dk, dv)) in dkv.iter().enumerate() {
        let (bh, t0) = (task / k_tiles, (task % k_tiles) * BLOCK_K);
        let (b, hk) = (bh / kv_heads, bh % kv_heads);
        put(b, heads + hk, t0, dk);
        put(b, heads + kv_heads + hk, t0, dv);
    }
    out
}

/// What the backward tiles read besides `q`, `k`, `v`.
#[derive(Clone, Copy)]
struct Saved<'a, T: Element> {
    d_o: Source<'a, T>,
    lse: &'a [T::Acc],
    delta: &'a [T::Acc],
}

/// `p = e^(s − lse_i)` in place for the rows `i0 ..` of a score tile of `cols` keys from `j0`,
/// 0 where masked.
fn probabilities<A: Arith>(s: &mut [A], cols: usize, i0: usize, j0: usize, lse: &[A]) {
    for (r, row) in s.chunks_exact_mut(cols).enumerate() {
        let n = seen(i0 + r, j0, cols);
        exp_shifted(&mut row[..n], lse[r]);
        row[n..].fill(A::zero());
    }
}

/// `ds = p ∘ (dp − Δ_i)` in place in `dp`, rows `i0 ..` of a tile of `cols` keys.
fn score_gradients<A: Arith>(dp: &mut [A], p: &[A], cols: usize, delta: &[A]) {
    for (r, (dp, p)) in dp
        .chunks_exact_mut(cols)
        .zip(p.chunks_exact(cols))
        .enumerate()
    {
        for (g, p) in dp.iter_mut().zip(p) {
            *g = *p * (*g - delta[r]);
        }
    }
}

/// `dq` for the queries `i0 ..` of head `h` of batch entry `b`: `scale · Σ_keys ds k`.
#[allow(clippy::too_many_arguments)]
fn dq_tile<T: Element>(
    [q, k, v]: [Source<'_, T>; 3],
    saved: Saved<'_, T>,
    dims: Dims,
    scale: T::Acc,
    b: usize,
    h: usize,
    i0: usize,
) -> Vec<T>
where
    T::Acc: Arith,
{
    let d = dims.head_dim;
    let hk = h / dims.group();
    let rows = BLOCK_Q.min(dims.tokens - i0);
    let zero = T::Acc::zero();
    let (mut qt, mut dot) = (vec![zero; rows * d], vec![zero; rows * d]);
    let (mut kt, mut vt) = (vec![zero; BLOCK_K * d], vec![zero; BLOCK_K * d]);
    let (mut p, mut dp) = (vec![zero; rows * BLOCK_K], vec![zero; rows * BLOCK_K]);
    let mut dq = vec![zero; rows * d];
    q.load(b, h, i0, rows, d, &mut qt);
    saved.d_o.load(b, h, i0, rows, d, &mut dot);
    let row0 = (b * dims.heads + h) * dims.tokens + i0;
    let lse = &saved.lse[row0..row0 + rows];
    let delta = &saved.delta[row0..row0 + rows];
    let end = i0 + rows;
    for j0 in (0..end).step_by(BLOCK_K) {
        let cols = BLOCK_K.min(end - j0);
        k.load(b, hk, j0, cols, d, &mut kt);
        v.load(b, hk, j0, cols, d, &mut vt);
        let (kt, vt) = (&kt[..cols * d], &vt[..cols * d]);
        let (p, dp) = (&mut p[..rows * cols], &mut dp[..rows * cols]);
        product(
            (rows, cols, d),
            p,
            false,
            row_major(&qt, d),
            transpose_of(kt, d),
            scale,
        );
        probabilities(p, cols, i0, j0, lse);
        // dp = dO vᵀ
        product(
            (rows, cols, d),
            dp,
            false,
            row_major(&dot, d),
            transpose_of(vt, d),
            T::Acc::one(),
        );
        score_gradients(dp, p, cols, delta);
        // dq += ds k
        product(
            (rows, d, cols),
            &mut dq,
            true,
            row_major(dp, cols),
            row_major(kt, d),
            T::Acc::one(),
        );
    }
    dq.iter().map(|x| T::from_acc(*x * scale)).collect()
}

/// `(dk, dv)` for the keys `j0 ..` of key/value head `hk` of batch entry `b`, summed over the
/// group's query heads in order: `dk = scale · Σ dsᵀ q`, `dv = Σ pᵀ dO`.
#[allow(clippy::too_many_arguments)]
fn dkv_tile<T: Element>(
    [q, k, v]: [Source<'_, T>; 3],
    saved: Saved<'_, T>,
    dims: Dims,
    scale: T::Acc,
    b: usize,
    hk: usize,
    j0: usize,
) -> (Vec<T>, Vec<T>)
where
    T::Acc: Arith,
{
    let d = dims.head_dim;
    let tokens = dims.tokens;
    let cols = BLOCK_K.min(tokens - j0);
    let zero = T::Acc::zero();
    let (mut kt, mut vt) = (vec![zero; cols * d], vec![zero; cols * d]);
    let (mut qt, mut dot) = (vec![zero; BLOCK_Q * d], vec![zero; BLOCK_Q * d]);
    let (mut p, mut dp) = (vec![zero; BLOCK_Q * cols], vec![zero; BLOCK_Q * cols]);
    let (mut dk, mut dv) = (vec![zero; cols * d], vec![zero; cols * d]);
    k.load(b, hk, j0, cols, d, &mut kt);
    v.load(b, hk, j0, cols, d, &mut vt);
    let group = dims.group();
    for h in hk * group..(hk + 1) * group {
        // The first query tile with a query that sees key j0.
        for i0 in ((j0 / BLOCK_Q) * BLOCK_Q..tokens).step_by(BLOCK_Q) {
            let rows = BLOCK_Q.min(tokens - i0);
            q.load(b, h, i0, rows, d, &mut qt);
            saved.d_o.load(b, h, i0, rows, d, &mut dot);
            let (qt, dot) = (&qt[..rows * d], &dot[..rows * d]);
            let row0 = (b * dims.heads + h) * tokens + i0;
            let lse = &saved.lse[row0..row0 + rows];
            let delta = &saved.delta[row0..row0 + rows];
            let (p, dp) = (&mut p[..rows * cols], &mut dp[..rows * cols]);
            product(
                (rows, cols, d),
                p,
                false,
                row_major(qt, d),
                transpose_of(&kt, d),
                scale,
            );
            probabilities(p, cols, i0, j0, lse);
            // dv += pᵀ dO
            product(
                (cols, d, rows),
                &mut dv,
                true,
                transpose_of(p, cols),
                row_major(dot, d),
                T::Acc::one(),
            );
            // dp = dO vᵀ
            product(
                (rows, cols, d),
                dp,
                false,
                row_major(dot, d),
                transpose_of(&vt, d),
                T::Acc::one(),
            );
            score_gradients(dp, p, cols, delta);
            // dk += dsᵀ q
            product(
                (cols, d, rows),
                &mut dk,
                true,
                transpose_of(dp, cols),
                row_major(qt, d),
                T::Acc::one(),
            );
        }
    }
    (
        dk.iter().map(|x| T::from_acc(*x * scale)).collect(),
        dv.iter().map(|x| T::from_acc(*x)).collect(),
    )
}
