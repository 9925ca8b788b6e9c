//! The collectives over shared memory, on slices of elements, over a [`ShmSession`].
//!
//! All-reduce: the data is cut into `world_size` segments, segment `r` owned by rank `r`, and
//! processed in rounds of one piece per segment. In each round every rank stages its pieces of
//! the segments it does not own; each owner reduces its piece, reading its own tensor directly
//! and the others' staged copies, in rank order, and stages the result; then every rank copies
//! the other owners' results into its tensor. Per byte of payload a rank reads 2 bytes and
//! writes 2 (a memcpy moves 1 and 1), and the staged data is read back while still in the
//! shared cache. While the others reduce, a rank already stages its next round into its other
//! staging half.
//!
//! Broadcast: the root stages the tensor in rounds, the others copy. All-gather: every rank
//! stages its block, the others copy it. Barrier: one round with no data.

use std::ops::Range;

use super::region::Counter;
use super::session::ShmSession;
use crate::comm::cpu::element::Element;
use crate::comm::cpu::ring::segment;
use crate::comm::ReduceOp;
use crate::error::Result;

/// In-place all-reduce of `data` (the same length on every rank).
pub(crate) fn all_reduce<T: Element>(
    s: &mut ShmSession<'_>,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (w, r) = (s.world_size(), s.rank());
    let n = data.len();
    let piece = s.piece_elems::<T>();
    let rounds = n.div_ceil(w).div_ceil(piece);
    if rounds == 0 {
        return Ok(());
    }
    let first = s.begin(n, 0, rounds);
    // Piece `k` of segment `seg`; staged at element offset `seg * piece` of a half.
    let part = |seg: usize, k: usize| -> Range<usize> {
        let whole = segment(n, w, seg);
        let start = (whole.start + k * piece).min(whole.end);
        start..(start + piece).min(whole.end)
    };
    let stage_round = |s: &mut ShmSession<'_>, data: &[T], k: usize| -> Result<()> {
        let round = first + k as u64;
        s.reserve_half(round)?;
        for seg in s.peers() {
            s.stage(round, seg * piece, &data[part(seg, k)]);
        }
        s.mark(Counter::Published, round);
        Ok(())
    };
    stage_round(s, data, 0)?;
    for k in 0..rounds {
        let round = first + k as u64;
        for q in s.peers() {
            s.await_peer(q, Counter::Published, round)?;
        }
        s.reduce_owned(round, &mut data[part(r, k)], op);
        s.mark(Counter::Reduced, round);
        if k + 1 < rounds {
            stage_round(s, data, k + 1)?;
        }
        for q in s.peers() {
            s.await_peer(q, Counter::Reduced, round)?;
            s.fetch(q, round, q * piece, &mut data[part(q, k)]);
        }
        s.mark(Counter::Consumed, round);
    }
    Ok(())
}

/// Reduce-scatter: `input` holds `world_size` blocks of `out.len()` elements; `out` receives
/// this rank's block of the reduction. The first half of [`all_reduce`] over the same pieces, in
/// the same rank order (so block `r` has the bits of the all-reduce's segment `r` whenever the
/// length is a multiple of the world size): each round every rank stages its pieces of the
/// blocks it does not own, and each owner reduces its own input piece and the staged copies
/// into `out`. Nothing is staged back and nothing fetched.
pub(crate) fn reduce_scatter<T: Element>(
    s: &mut ShmSession<'_>,
    input: &[T],
    out: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let r = s.rank();
    let b = out.len();
    let piece = s.piece_elems::<T>();
    let rounds = b.div_ceil(piece);
    if rounds == 0 {
        return Ok(());
    }
    let first = s.begin(b, 0, rounds);
    // Piece `k` within a block.
    let part = |k: usize| (k * piece).min(b)..((k + 1) * piece).min(b);
    let of_block = |q: usize, k: usize| {
        let p = part(k);
        q * b + p.start..q * b + p.end
    };
    let stage_round = |s: &mut ShmSession<'_>, k: usize| -> Result<()> {
        let round = first + k as u64;
        s.reserve_half(round)?;
        for q in s.peers() {
            s.stage(round, q * piece, &input[of_block(q, k)]);
        }
        s.mark(Counter::Published, round);
        Ok(())
    };
    stage_round(s, 0)?;
    for k in 0..rounds {
        let round = first + k as u64;
        for q in s.peers() {
            s.await_peer(q, Counter::Published, round)?;
        }
        s.reduce_into(round, &input[of_block(r, k)], &mut out[part(k)], op);
        s.mark(Counter::Reduced, round);
        if k + 1 < rounds {
            stage_round(s, k + 1)?;
        }
        s.mark(Counter::Consumed, round);
    }
    Ok(())
}

/// In-place broadcast of `data` from `root`.
pub(crate) fn broadcast<T: Element>(
    s: &mut ShmSession<'_>,
    data: &mut [T],
    root: usize,
) -> Result<()> {
    let n = data.len();
    let area = s.area_elems::<T>();
    let rounds = n.div_ceil(area);
    if rounds == 0 {
        return Ok(());
    }
    let first = s.begin(n, root, rounds);
    for k in 0..rounds {
        let round = first + k as u64;
        let range = k * area..((k + 1) * area).min(n);
        // Every rank tags its half, so a rank in another collective is caught by whoever reads.
        s.reserve_half(round)?;
        if s.rank() == root {
            s.stage(round, 0, &data[range]);
            s.mark(Counter::Published, round);
            s.mark(Counter::Reduced, round);
        } else {
            s.mark(Counter::Published, round);
            s.mark(Counter::Reduced, round);
            s.await_peer(root, Counter::Published, round)?;
            s.fetch(root, round, 0, &mut data[range]);
        }
        s.mark(Counter::Consumed, round);
    }
    Ok(())
}

/// All-gather: `out` holds `world_size` blocks of `out.len() / world_size` elements, this rank's
/// own block already in place; fills in the others.
pub(crate) fn all_gather<T: Element>(s: &mut ShmSession<'_>, out: &mut [T]) -> Result<()> {
    let (w, r) = (s.world_size(), s.rank());
    let block = out.len() / w;
    let area = s.area_elems::<T>();
    let rounds = block.div_ceil(area);
    if rounds == 0 {
        return Ok(());
    }
    let first = s.begin(block, 0, rounds);
    for k in 0..rounds {
        let round = first + k as u64;
        let part = |q: usize| q * block + k * area..q * block + ((k + 1) * area).min(block);
        s.reserve_half(round)?;
        s.stage(round, 0, &out[part(r)]);
        s.mark(Counter::Published, round);
        s.mark(Counter::Reduced, round);
        for q in s.peers() {
            s.await_peer(q, Counter::Published, round)?;
            s.fetch(q, round, 0, &mut out[part(q)]);
        }
        s.mark(Counter::Consumed, round);
    }
    Ok(())
}

/// Returns once every rank has entered the barrier: each publishes an empty round and waits for
/// everyone else's.
pub(crate) fn barrier(s: &mut ShmSession<'_>) -> Result<()> {
    let round = s.begin(0, 0, 1);
    s.reserve_half(round)?;
    s.mark(Counter::Published, round);
    for q in s.peers() {
        s.await_peer(q, Counter::Published, round)?;
    }
    s.mark(Counter::Reduced, round);
    s.mark(Counter::Consumed, round);
    Ok(())
}
