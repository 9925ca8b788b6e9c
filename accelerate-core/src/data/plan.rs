//! The batch plan of an epoch: which samples form which batch, and which rank gets it.
//!
//! Semantics of HF Accelerate's `BatchSamplerShard` (non-split, `even_batches=True`), the default of
//! `Accelerator.prepare`:
//!
//! - The epoch's order is `0..len`, or a permutation fixed by `(seed, epoch)` when shuffling.
//! - Global batch `i` holds positions `i*B .. (i+1)*B` of that order and goes to rank `i mod N`.
//! - Without `drop_last`, on more than one rank, the global batch list is extended to a whole number
//!   of rounds of `N` full batches: the positions past the end of the order wrap around to its start
//!   (as often as needed when `len < B*N`). Every rank then steps the same number of times on full
//!   batches; the wrapped samples are duplicates that metrics must drop.
//! - With `drop_last`, a final partial batch is dropped and, on more than one rank, so is an
//!   incomplete last round (Accelerate's `len(batch_sampler) // num_processes`), so no sample is seen
//!   twice.
//! - On a single rank nothing is wrapped: without `drop_last` the last batch keeps its partial size
//!   (Accelerate does not shard the loader of a single process).

use super::shuffle::shuffled_indices;
use crate::error::{Error, Result};

/// Everything that determines the batches of an epoch, except the dataset's contents: the one
/// description of the batch layout, which the loader holds, its progress publishes and
/// `gather_for_metrics` asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPlan {
    len: usize,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    world_size: usize,
}

impl BatchPlan {
    /// The plan of `len` samples in batches of `batch_size` per rank, dealt to `world_size` ranks,
    /// in the order `0..len`, keeping a final partial batch (the settings of
    /// [`with_shuffle`](Self::with_shuffle), [`with_seed`](Self::with_seed) and
    /// [`with_drop_last`](Self::with_drop_last) change that). Refuses a batch size or world size
    /// of 0.
    pub fn new(len: usize, batch_size: usize, world_size: usize) -> Result<Self> {
        let plan = Self::unchecked(len, batch_size, world_size);
        plan.check()?;
        Ok(plan)
    }

    /// A plan a loader builds before its settings are complete: [`check`](Self::check) refuses it
    /// later if they never become valid.
    pub(crate) fn unchecked(len: usize, batch_size: usize, world_size: usize) -> Self {
        Self {
            len,
            batch_size,
            shuffle: false,
            seed: 0,
            drop_last: false,
            world_size,
        }
    }

    /// This plan with shuffling on or off.
    pub fn with_shuffle(self, shuffle: bool) -> Self {
        Self { shuffle, ..self }
    }

    /// This plan with seed `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        Self { seed, ..self }
    }

    /// This plan with drop_last on or off.
    pub fn with_drop_last(self, drop_last: bool) -> Self {
        Self { drop_last, ..self }
    }

    /// This plan dealt to `world_size` ranks.
    pub(crate) fn with_world_size(self, world_size: usize) -> Self {
        Self { world_size, ..self }
    }

    /// Number of samples in the dataset.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the dataset is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Samples per batch (per rank).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Whether the order is a seeded permutation instead of `0..len`.
    pub fn shuffle(&self) -> bool {
        self.shuffle
    }

    /// Seed of the permutation; combined with the epoch.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether a final partial batch (and, on several ranks, an incomplete last round) is dropped.
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }

    /// Number of ranks the batches are dealt to.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Checks that the plan can produce batches: a positive batch size and world size.
    pub fn check(&self) -> Result<()> {
        if self.batch_size == 0 {
            return Err(Error::Config(
                "the data loader's batch size is 0; pass a positive batch size to DataLoader::new"
                    .into(),
            ));
        }
        if self.world_size == 0 {
            return Err(Error::Config(
                "the data loader is sharded over 0 ranks; DataLoader::shard takes a world size of \
                 at least 1"
                    .into(),
            ));
        }
        Ok(())
    }

    fn is_degenerate(&self) -> bool {
        self.len == 0 || self.batch_size == 0 || self.world_size == 0
    }

    /// The sample order of `epoch`: `0..len`, or its permutation by `(seed, epoch)`.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        if self.shuffle {
            shuffled_indices(self.len, self.seed, epoch)
        } else {
            (0..self.len).collect()
        }
    }

    /// Number of batches made of real samples before any wrap-around or dropped round:
    /// `ceil(len / B)`, or `floor(len / B)` with `drop_last`.
    pub fn real_batches(&self) -> usize {
        if self.is_degenerate() {
            0
        } else if self.drop_last {
            self.len / self.batch_size
        } else {
            self.len.div_ceil(self.batch_size)
        }
    }

    /// Number of global batches handed out per epoch, over all ranks: a multiple of the world size.
    pub fn global_batches(&self) -> usize {
        let real = self.real_batches();
        if self.world_size <= 1 {
            real
        } else if self.drop_last {
            real / self.world_size * self.world_size
        } else {
            real.div_ceil(self.world_size) * self.world_size
        }
    }

    /// Number of batches each rank gets per epoch.
    pub fn batches_per_rank(&self) -> usize {
        self.global_batches()
            .checked_div(self.world_size)
            .unwrap_or(0)
    }

    /// Number of real (not wrapped-around) samples handed out per epoch, over all ranks: `len`, or
    /// fewer with `drop_last`. They are the first positions of the epoch's order.
    pub fn real_samples(&self) -> usize {
        if self.is_degenerate() {
            0
        } else if self.drop_last {
            self.global_batches() * self.batch_size
        } else {
            self.len
        }
    }

    /// Number of sample slots handed out per epoch, over all ranks, wrapped duplicates included.
    fn slots(&self) -> usize {
        if self.world_size == 1 {
            self.real_samples()
        } else {
            self.global_batches() * self.batch_size
        }
    }

    /// Number of wrapped-around duplicates handed out per epoch, over all ranks (they come last).
    pub fn wrapped_samples(&self) -> usize {
        self.slots() - self.real_samples()
    }

    /// How many rows of the last round's gather (every rank's last batch, in rank order) are real
    /// samples: the rest are wrapped-around duplicates that metrics drop.
    pub fn real_rows_of_last_round(&self) -> usize {
        let before = self.batches_per_rank().saturating_sub(1) * self.batch_size * self.world_size;
        self.real_samples().saturating_sub(before)
    }

    /// Global batch `index` of an epoch whose order is `order`.
    fn batch(&self, order: &[usize], index: usize) -> Vec<usize> {
        let start = index * self.batch_size;
        let end = ((index + 1) * self.batch_size).min(self.slots());
        (start..end).map(|pos| order[pos % order.len()]).collect()
    }

    /// Every global batch of `epoch`, in order; rank `r` gets entries `r, r+N, r+2N, ...`.
    pub fn epoch_batches(&self, epoch: u64) -> Vec<Vec<usize>> {
        let order = self.order(epoch);
        (0..self.global_batches())
            .map(|i| self.batch(&order, i))
            .collect()
    }

    /// The batches of `epoch` that go to `rank`, in order.
    pub fn rank_batches(&self, epoch: u64, rank: usize) -> Vec<Vec<usize>> {
        if self.world_size == 0 || rank >= self.world_size {
            return Vec::new();
        }
        let order = self.order(epoch);
        (rank..self.global_batches())
            .step_by(self.world_size)
            .map(|i| self.batch(&order, i))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(len: usize, batch_size: usize, world_size: usize, drop_last: bool) -> BatchPlan {
        BatchPlan::unchecked(len, batch_size, world_size).with_drop_last(drop_last)
    }

    /// The batches of each rank, for comparison with tables of expected shards.
    fn shards(p: &BatchPlan) -> Vec<Vec<Vec<usize>>> {
        (0..p.world_size).map(|r| p.rank_batches(0, r)).collect()
    }

    #[test]
    fn the_last_round_keeps_only_its_real_rows() {
        // (len, B, N, drop_last) -> real rows among the N·B gathered in the last round, counted
        // by hand from the shard tables: 10 samples, B 3, 2 ranks = batches [0-2][3-5] then
        // [6-8][9,0,1]: 4 real of 6.
        for (len, b, n, drop, want) in [
            (10, 3, 2, false, 4),
            (24, 3, 2, false, 6),
            (5, 3, 2, false, 5),
            (10, 3, 2, true, 6),
            (10, 3, 1, false, 1),
            (2, 3, 4, false, 2),
        ] {
            assert_eq!(
                plan(len, b, n, drop).real_rows_of_last_round(),
                want,
                "len {len}, batch {b}, {n} ranks, drop_last {drop}"
            );
        }
    }

    #[test]
    fn the_public_constructor_refuses_what_cannot_make_batches() {
        assert!(BatchPlan::new(10, 0, 1).is_err());
        assert!(BatchPlan::new(10, 3, 0).is_err());
        let p = BatchPlan::new(10, 3, 2)
            .unwrap()
            .with_shuffle(true)
            .with_seed(7)
            .with_drop_last(true);
        assert_eq!(
            (
                p.len(),
                p.batch_size(),
                p.shuffle(),
                p.seed(),
                p.drop_last(),
                p.world_size()
            ),
            (10, 3, true, 7, true, 2)
        );
    }

    /// Expected shards of two ranks for `range(len)` and batch size 3, as listed in HF Accelerate's
    /// `test_batch_sampler_shards_with_no_splits`.
    #[test]
    fn two_ranks_match_accelerates_batch_sampler_shard_tables() {
        // In every table of 20 samples or more the first three rounds are the same; they differ
        // in the fourth, which is complete, wrapped around or dropped.
        let three_rounds = [
            vec![vec![0, 1, 2], vec![6, 7, 8], vec![12, 13, 14]],
            vec![vec![3, 4, 5], vec![9, 10, 11], vec![15, 16, 17]],
        ];
        // (len, drop_last, the fourth round's batch of rank 0 and of rank 1, if any).
        for (len, drop_last, fourth_round) in [
            (24, false, Some([[18, 19, 20], [21, 22, 23]])),
            (24, true, Some([[18, 19, 20], [21, 22, 23]])),
            (21, false, Some([[18, 19, 20], [0, 1, 2]])),
            (21, true, None),
            (22, false, Some([[18, 19, 20], [21, 0, 1]])),
            (22, true, None),
            (20, false, Some([[18, 19, 0], [1, 2, 3]])),
            (20, true, None),
        ] {
            let mut want = three_rounds.to_vec();
            if let Some(batches) = fourth_round {
                for (rank, batch) in batches.into_iter().enumerate() {
                    want[rank].push(batch.to_vec());
                }
            }
            assert_eq!(
                shards(&plan(len, 3, 2, drop_last)),
                want,
                "len {len}, drop_last {drop_last}"
            );
        }
        assert_eq!(
            shards(&plan(2, 3, 2, false)),
            vec![vec![vec![0, 1, 0]], vec![vec![1, 0, 1]]]
        );
        assert_eq!(
            shards(&plan(2, 3, 2, true)),
            vec![Vec::<Vec<usize>>::new(), vec![]]
        );
    }

    #[test]
    fn a_single_rank_keeps_the_partial_last_batch_unless_dropped() {
        assert_eq!(
            plan(7, 3, 1, false).epoch_batches(0),
            vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]]
        );
        assert_eq!(
            plan(7, 3, 1, true).epoch_batches(0),
            vec![vec![0, 1, 2], vec![3, 4, 5]]
        );
        assert_eq!(plan(2, 3, 1, false).epoch_batches(0), vec![vec![0, 1]]);
        assert!(plan(2, 3, 1, true).epoch_batches(0).is_empty());
    }

    #[test]
    fn a_tiny_dataset_is_cycled_as_often_as_needed() {
        // len 2 < B*N = 12: one real batch, completed and extended to one round of 3 full batches
        // of 4, reading the order 0, 1 cyclically.
        assert_eq!(
            plan(2, 4, 3, false).epoch_batches(0),
            vec![vec![0, 1, 0, 1], vec![0, 1, 0, 1], vec![0, 1, 0, 1]]
        );
        assert_eq!(
            plan(5, 2, 4, false).epoch_batches(0),
            vec![vec![0, 1], vec![2, 3], vec![4, 0], vec![1, 2]]
        );
    }

    /// For many shapes: every sample appears exactly once among the real slots, and the duplicates
    /// are exactly the documented wrap-around, counted by the closed-form formula.
    #[test]
    fn every_sample_once_plus_exactly_the_wrapped_extras() {
        for len in [1, 2, 5, 7, 12, 13, 24, 31, 100] {
            for batch_size in [1, 2, 3, 4, 8] {
                for world_size in [1, 2, 3, 4, 8] {
                    for drop_last in [false, true] {
                        for shuffle in [false, true] {
                            let p = BatchPlan {
                                shuffle,
                                seed: 11,
                                ..plan(len, batch_size, world_size, drop_last)
                            };
                            check_counts(&p);
                        }
                    }
                }
            }
        }
    }

    fn check_counts(p: &BatchPlan) {
        let (n, b, w) = (p.len, p.batch_size, p.world_size);
        let what = format!("{p:?}");
        // Closed forms, written independently of the plan's own arithmetic.
        let real_batches = n / b + usize::from(!p.drop_last && n % b != 0);
        let per_rank = if w == 1 {
            real_batches
        } else if p.drop_last {
            real_batches / w
        } else {
            real_batches / w + usize::from(real_batches % w != 0)
        };
        let (real, extras) = if w == 1 {
            (if p.drop_last { real_batches * b } else { n }, 0)
        } else if p.drop_last {
            (per_rank * w * b, 0)
        } else {
            (n, per_rank * w * b - n)
        };

        let order = p.order(3);
        let ranks: Vec<_> = (0..w).map(|r| p.rank_batches(3, r)).collect();
        for (r, batches) in ranks.iter().enumerate() {
            assert_eq!(batches.len(), per_rank, "{what}: rank {r}");
            if w > 1 {
                assert!(batches.iter().all(|x| x.len() == b), "{what}: rank {r}");
            }
        }
        let mut counts = vec![0usize; n];
        for batch in ranks.iter().flatten() {
            for &s in batch {
                counts[s] += 1;
            }
        }
        assert_eq!(counts.iter().sum::<usize>(), real + extras, "{what}");
        assert_eq!(p.real_samples(), real, "{what}");
        assert_eq!(p.wrapped_samples(), extras, "{what}");
        // The k-th sample of the order appears once if real, plus once per wrap that reaches it.
        for (k, &s) in order.iter().enumerate() {
            let once = usize::from(k < real);
            let wraps = extras / n + usize::from(k < extras % n);
            assert_eq!(
                counts[s],
                once + wraps,
                "{what}: sample {s} at position {k}"
            );
        }
    }

    #[test]
    fn ranks_deal_the_global_batches_round_robin() {
        let p = BatchPlan {
            shuffle: true,
            seed: 5,
            ..plan(29, 3, 4, false)
        };
        let global = p.epoch_batches(2);
        for rank in 0..4 {
            let expected: Vec<_> = global.iter().skip(rank).step_by(4).cloned().collect();
            assert_eq!(p.rank_batches(2, rank), expected, "rank {rank}");
        }
        assert!(p.rank_batches(2, 4).is_empty());
    }

    #[test]
    fn shuffled_orders_change_with_epoch_and_seed_and_no_shuffle_is_identity() {
        let p = BatchPlan {
            shuffle: true,
            seed: 9,
            ..plan(50, 5, 2, false)
        };
        assert_ne!(p.order(1), p.order(2));
        assert_ne!(p.order(1), BatchPlan { seed: 10, ..p }.order(1));
        assert_eq!(
            BatchPlan {
                shuffle: false,
                ..p
            }
            .order(1),
            (0..50).collect::<Vec<_>>()
        );
    }

    #[test]
    fn zero_batch_or_world_size_is_rejected_and_plans_nothing() {
        let zero_batch = plan(10, 0, 1, false);
        assert!(zero_batch
            .check()
            .unwrap_err()
            .to_string()
            .contains("batch size is 0"));
        assert!(zero_batch.epoch_batches(0).is_empty());
        let zero_world = plan(10, 2, 0, false);
        assert!(zero_world
            .check()
            .unwrap_err()
            .to_string()
            .contains("DataLoader::shard"));
        assert_eq!(zero_world.batches_per_rank(), 0);
        let empty = plan(0, 2, 2, false);
        assert!(empty.check().is_ok());
        assert!(empty.epoch_batches(0).is_empty());
    }
}
