//! The ring algorithms, on slices of elements, over a [`Session`].
//!
//! All-reduce is reduce-scatter then all-gather (Patarasuk and Yuan's bandwidth-optimal ring):
//! the data is cut into `world_size` segments; in step `t` rank `r` sends segment `(r - t) mod W`
//! to its successor and receives segment `(r - t - 1) mod W` from its predecessor, reducing it
//! into its own copy during the first `W - 1` steps and overwriting it during the last `W - 1`.
//! Each rank sends `2 (W - 1) / W` of the data, whatever `W`. Segments travel in chunks, and each
//! chunk is forwarded as soon as it is reduced, so steps overlap (pipelining).
//!
//! Every segment is reduced in the same order on its way around the ring and then copied, so all
//! ranks end with bit-identical results.

use std::ops::Range;

use super::element::{self, Element};
use super::transport::Session;
use crate::comm::ReduceOp;
use crate::error::Result;

/// Segment `i` of `len` elements cut into `parts` nearly equal segments (sizes differ by at
/// most one element).
pub(crate) fn segment(len: usize, parts: usize, i: usize) -> Range<usize> {
    let at = |k: usize| (len as u128 * k as u128 / parts as u128) as usize;
    at(i)..at(i + 1)
}

/// `range` cut into consecutive pieces of at most `size` elements.
fn chunks(range: Range<usize>, size: usize) -> impl Iterator<Item = Range<usize>> {
    let end = range.end;
    range
        .step_by(size.max(1))
        .map(move |start| start..(start + size.max(1)).min(end))
}

/// In-place all-reduce of `data` (the same length on every rank).
pub(crate) fn all_reduce<T: Element>(
    session: &mut Session<'_>,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let pos = session.pos();
    let (w, r) = (pos.world_size, pos.rank);
    if w == 1 {
        return Ok(());
    }
    let n = data.len();
    for c in chunks(segment(n, w, r), pos.chunk_elems) {
        session.send(&data[c]);
    }
    let steps = 2 * (w - 1);
    for t in 0..steps {
        let received = (r + 2 * w - t - 1) % w;
        for c in chunks(segment(n, w, received), pos.chunk_elems) {
            let bytes = session.recv(c.len() * T::SIZE)?;
            let dst = &mut data[c];
            if t < w - 1 {
                element::reduce_into(dst, bytes, op);
                if t == w - 2 && op == ReduceOp::Mean {
                    // The segment's sum is complete here, on its one owner; divide once so the
                    // all-gather spreads identical quotients.
                    element::divide(dst, w);
                }
            } else {
                element::decode_into(dst, bytes);
            }
            if t + 1 < steps {
                session.send(dst);
            }
        }
    }
    Ok(())
}

/// Ring reduce-scatter: `input` holds `world_size` blocks of `out.len()` elements (the same
/// lengths on every rank); `out` receives this rank's block of the reduction. The first half of
/// [`all_reduce`], with the chain shifted by one rank so that rank `r` ends owning block `r`: in
/// step `t` rank `r` sends block `(r - t - 1) mod W` and receives block `(r - t - 2) mod W`,
/// combining it with its own input into a chunk-sized scratch buffer that it forwards (the input
/// is only read). Each rank sends `(W - 1)` blocks: `(W - 1) / W` of the input, half of what an
/// all-reduce of it sends.
pub(crate) fn reduce_scatter<T: Element>(
    session: &mut Session<'_>,
    input: &[T],
    out: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let pos = session.pos();
    let (w, r) = (pos.world_size, pos.rank);
    let b = out.len();
    debug_assert_eq!(input.len(), w * b);
    let block = |k: usize, c: &Range<usize>| k * b + c.start..k * b + c.end;
    for c in chunks(0..b, pos.chunk_elems) {
        session.send(&input[block((r + w - 1) % w, &c)]);
    }
    let mut scratch: Vec<T> = Vec::with_capacity(pos.chunk_elems.min(b));
    for t in 0..w - 1 {
        let received = (r + 2 * w - t - 2) % w;
        for c in chunks(0..b, pos.chunk_elems) {
            let own = &input[block(received, &c)];
            let bytes = session.recv(c.len() * T::SIZE)?;
            if t == w - 2 {
                // The last contribution: block `r`, complete here.
                let dst = &mut out[c];
                dst.copy_from_slice(own);
                element::reduce_into(dst, bytes, op);
                if op == ReduceOp::Mean {
                    element::divide(dst, w);
                }
            } else {
                scratch.clear();
                scratch.extend_from_slice(own);
                element::reduce_into(&mut scratch, bytes, op);
                session.send(&scratch);
            }
        }
    }
    Ok(())
}

/// In-place broadcast of `data` from `root` along the ring (a pipelined chain).
pub(crate) fn broadcast<T: Element>(
    session: &mut Session<'_>,
    data: &mut [T],
    root: usize,
) -> Result<()> {
    let pos = session.pos();
    let whole = 0..data.len();
    if pos.rank == root {
        for c in chunks(whole, pos.chunk_elems) {
            session.send(&data[c]);
        }
        return Ok(());
    }
    let forward = pos.next() != root;
    for c in chunks(whole, pos.chunk_elems) {
        let bytes = session.recv(c.len() * T::SIZE)?;
        let dst = &mut data[c];
        element::decode_into(dst, bytes);
        if forward {
            session.send(dst);
        }
    }
    Ok(())
}

/// Ring all-gather: `out` holds `world_size` blocks of `out.len() / world_size` elements, this
/// rank's own block already in place; fills in the others.
pub(crate) fn all_gather<T: Element>(session: &mut Session<'_>, out: &mut [T]) -> Result<()> {
    let pos = session.pos();
    let (w, r) = (pos.world_size, pos.rank);
    let block = out.len() / w;
    let block_range = |i: usize| i * block..(i + 1) * block;
    for c in chunks(block_range(r), pos.chunk_elems) {
        session.send(&out[c]);
    }
    for t in 0..w - 1 {
        let received = (r + w - t - 1) % w;
        for c in chunks(block_range(received), pos.chunk_elems) {
            let bytes = session.recv(c.len() * T::SIZE)?;
            let dst = &mut out[c];
            element::decode_into(dst, bytes);
            if t + 1 < w - 1 {
                session.send(dst);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_tile_the_range_evenly() {
        for len in [0usize, 1, 2, 7, 10, 101] {
            for parts in 1..=5 {
                let segs: Vec<_> = (0..parts).map(|i| segment(len, parts, i)).collect();
                assert_eq!(segs[0].start, 0);
                assert_eq!(segs[parts - 1].end, len);
                for pair in segs.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start);
                }
                let sizes: Vec<_> = segs.iter().map(|s| s.len()).collect();
                let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                assert!(hi - lo <= 1, "{len} into {parts}: {sizes:?}");
            }
        }
    }

    #[test]
    fn chunks_cover_the_range_in_order() {
        let pieces: Vec<_> = chunks(3..10, 3).collect();
        assert_eq!(pieces, vec![3..6, 6..9, 9..10]);
        assert_eq!(chunks(4..4, 3).count(), 0);
    }
}
