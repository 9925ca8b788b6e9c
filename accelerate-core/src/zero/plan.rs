//! Which rank owns which elements of the flat parameter space: the ZeRO partition.
//!
//! The partition follows the gradient buckets, which every rank built alike at `prepare` (sorted
//! names, the same size cap). Bucket `b` of `E_b` parameter elements is padded to `W · block_b`
//! elements with `block_b = ceil(E_b / W)`, and rank `r` owns positions
//! `[r · block_b, (r + 1) · block_b) ∩ [0, E_b)`: PyTorch FSDP's flat-parameter padding, applied
//! per DDP bucket. A block is contiguous, so each rank holds at most one contiguous piece of each
//! parameter, and a reduce-scatter of a padded bucket leaves every rank its own block.

use std::ops::Range;

/// One bucket of the partition.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BucketShard {
    /// The bucket's parameters (indices into the sorted parameter list).
    params: Range<usize>,
    /// Where each of those parameters starts in the bucket.
    offsets: Vec<usize>,
    /// Each parameter's element count.
    lens: Vec<usize>,
    /// Parameter elements in the bucket (without padding).
    elems: usize,
    /// Elements per rank: `ceil(elems / world)`.
    block: usize,
    /// Where this bucket's block starts in a rank's shard (the sum of the earlier blocks).
    shard_offset: usize,
}

/// The ZeRO partition of a set of gradient buckets over `world` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardPlan {
    world: usize,
    buckets: Vec<BucketShard>,
    /// The bucket of each parameter.
    bucket_of: Vec<usize>,
}

impl ShardPlan {
    /// The partition of `buckets` (each: its parameter range and their element counts, in
    /// order, as [`GradientBuffers::layout`](crate::grads::GradientBuffers::layout) gives them).
    pub fn new(buckets: &[(Range<usize>, Vec<usize>)], world: usize) -> Self {
        assert!(world > 0, "a partition needs at least one rank");
        let mut shard_offset = 0;
        let mut bucket_of = Vec::new();
        let buckets = buckets
            .iter()
            .enumerate()
            .map(|(b, (params, lens))| {
                debug_assert_eq!(params.len(), lens.len());
                let mut offsets = Vec::with_capacity(lens.len());
                let mut elems = 0;
                for &n in lens {
                    offsets.push(elems);
                    elems += n;
                    bucket_of.push(b);
                }
                let block = elems.div_ceil(world);
                let shard = BucketShard {
                    params: params.clone(),
                    offsets,
                    lens: lens.clone(),
                    elems,
                    block,
                    shard_offset,
                };
                shard_offset += block;
                shard
            })
            .collect();
        Self {
            world,
            buckets,
            bucket_of,
        }
    }

    /// Each bucket's parameters and their element counts (what the plan was cut from).
    pub fn layout(&self) -> Vec<(Range<usize>, Vec<usize>)> {
        self.buckets
            .iter()
            .map(|b| (b.params.clone(), b.lens.clone()))
            .collect()
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The number of buckets.
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// The parameters of bucket `b`.
    pub fn bucket_params(&self, b: usize) -> Range<usize> {
        self.buckets[b].params.clone()
    }

    /// Elements per rank of bucket `b` (its padded length is `world` times this).
    pub fn block(&self, b: usize) -> usize {
        self.buckets[b].block
    }

    /// The padded length of bucket `b`: `world · block(b)`, a multiple of the world size.
    pub fn padded_len(&self, b: usize) -> usize {
        self.world * self.buckets[b].block
    }

    #[cfg(test)]
    /// Parameter elements of bucket `b`, without padding.
    pub fn elems(&self, b: usize) -> usize {
        self.buckets[b].elems
    }

    /// Where parameter `param` starts in its bucket, and its bucket.
    pub fn position(&self, param: usize) -> (usize, usize) {
        let b = self.bucket_of[param];
        let bucket = &self.buckets[b];
        (b, bucket.offsets[param - bucket.params.start])
    }

    /// Positions of bucket `b` that `rank` owns (within the bucket, padding excluded).
    pub fn owned(&self, b: usize, rank: usize) -> Range<usize> {
        let bucket = &self.buckets[b];
        let start = (rank * bucket.block).min(bucket.elems);
        let end = ((rank + 1) * bucket.block).min(bucket.elems);
        start..end
    }

    /// The piece of parameter `param` that `rank` owns, as a range of its flattened elements, or
    /// `None` if it owns none of it.
    pub fn piece(&self, param: usize, rank: usize) -> Option<Range<usize>> {
        let (b, offset) = self.position(param);
        let len = self.buckets[b].lens[param - self.buckets[b].params.start];
        let owned = self.owned(b, rank);
        let start = owned.start.max(offset);
        let end = owned.end.min(offset + len);
        (start < end).then(|| start - offset..end - offset)
    }

    /// [`piece`](Self::piece) of every parameter, in order.
    pub fn pieces(&self, rank: usize) -> Vec<Option<Range<usize>>> {
        (0..self.bucket_of.len())
            .map(|p| self.piece(p, rank))
            .collect()
    }

    #[cfg(test)]
    /// Elements of a rank's shard: the sum of the blocks (padding included, so every rank's shard
    /// has the same length).
    pub fn shard_len(&self) -> usize {
        self.buckets.iter().map(|b| b.block).sum()
    }

    #[cfg(test)]
    /// Where `rank`'s piece of parameter `param` lies in its shard, if it has one.
    pub fn piece_in_shard(&self, param: usize, rank: usize) -> Option<Range<usize>> {
        let piece = self.piece(param, rank)?;
        let (b, offset) = self.position(param);
        let bucket = &self.buckets[b];
        let start = bucket.shard_offset + offset + piece.start - rank * bucket.block;
        Some(start..start + piece.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn layout(sizes: &[&[usize]]) -> Vec<(Range<usize>, Vec<usize>)> {
        let mut start = 0;
        sizes
            .iter()
            .map(|lens| {
                let r = start..start + lens.len();
                start = r.end;
                (r, lens.to_vec())
            })
            .collect()
    }

    /// Every element of every parameter is owned by exactly one rank, the owner's shard holds it
    /// at a distinct position, and the blocks tile each padded bucket.
    fn check_tiling(sizes: &[&[usize]], world: usize) {
        let plan = ShardPlan::new(&layout(sizes), world);
        let lens: Vec<usize> = sizes.iter().flat_map(|b| b.iter().copied()).collect();
        for (p, &len) in lens.iter().enumerate() {
            let mut owners = vec![0usize; len];
            for rank in 0..world {
                if let Some(piece) = plan.piece(p, rank) {
                    assert!(!piece.is_empty() && piece.end <= len);
                    for e in piece.clone() {
                        owners[e] += 1;
                    }
                    let in_shard = plan.piece_in_shard(p, rank).unwrap();
                    assert_eq!(in_shard.len(), piece.len());
                    assert!(in_shard.end <= plan.shard_len());
                }
            }
            assert!(owners.iter().all(|&n| n == 1), "param {p}: {owners:?}");
        }
        for b in 0..plan.buckets() {
            assert_eq!(plan.padded_len(b) % world, 0);
            assert!(plan.padded_len(b) >= plan.elems(b));
            assert!(plan.padded_len(b) - plan.elems(b) < world.max(1));
            let covered: usize = (0..world).map(|r| plan.owned(b, r).len()).sum();
            assert_eq!(covered, plan.elems(b));
        }
        // Within one rank's shard the pieces do not overlap.
        for rank in 0..world {
            let mut used = vec![false; plan.shard_len()];
            for p in 0..lens.len() {
                if let Some(r) = plan.piece_in_shard(p, rank) {
                    for i in r {
                        assert!(!used[i]);
                        used[i] = true;
                    }
                }
            }
        }
    }

    #[test]
    fn pieces_tile_every_parameter_once() {
        check_tiling(&[&[6, 4], &[7]], 2);
        check_tiling(&[&[6, 4], &[7]], 3);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..200 {
            let world = rng.random_range(1..=5);
            let buckets: Vec<Vec<usize>> = (0..rng.random_range(1..4))
                .map(|_| {
                    (0..rng.random_range(1..5))
                        .map(|_| rng.random_range(1..30))
                        .collect()
                })
                .collect();
            let refs: Vec<&[usize]> = buckets.iter().map(Vec::as_slice).collect();
            check_tiling(&refs, world);
        }
    }

    /// Worked by hand: buckets [6, 4] (10 elements, blocks of 5) and [7] (blocks of 4, one
    /// padding element) over 2 ranks.
    #[test]
    fn a_small_layout_by_hand() {
        let plan = ShardPlan::new(&layout(&[&[6, 4], &[7]]), 2);
        assert_eq!(plan.piece(0, 0), Some(0..5));
        assert_eq!(plan.piece(0, 1), Some(5..6));
        assert_eq!(plan.piece(1, 0), None);
        assert_eq!(plan.piece(1, 1), Some(0..4));
        assert_eq!(plan.piece(2, 0), Some(0..4));
        assert_eq!(plan.piece(2, 1), Some(4..7));
        assert_eq!(plan.shard_len(), 9);
        assert_eq!(plan.padded_len(1), 8);
        assert_eq!(plan.piece_in_shard(1, 1), Some(1..5));
        assert_eq!(plan.piece_in_shard(2, 1), Some(5..8));
    }

    /// A bucket smaller than the world: the last ranks own nothing of it.
    #[test]
    fn a_lone_element_over_three_ranks() {
        let plan = ShardPlan::new(&layout(&[&[1]]), 3);
        assert_eq!(plan.piece(0, 0), Some(0..1));
        assert_eq!(plan.piece(0, 1), None);
        assert_eq!(plan.piece(0, 2), None);
        assert_eq!(plan.padded_len(0), 3);
    }
}
