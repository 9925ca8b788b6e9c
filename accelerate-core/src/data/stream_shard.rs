//! How one rank takes its batches from a stream every rank reads: HF Accelerate's
//! `IterableDatasetShard`, with a look-ahead that tells the loader where the stream ends.
//!
//! - The stream is cut into global batches of `batch_size × world_size` records; rank `r` takes
//!   records `r·B .. (r+1)·B` of each. Every rank reads the same stream, so every rank knows the
//!   same number of batches without talking to the others, and they reach the end together.
//! - Without `drop_last`, on several ranks, an incomplete last global batch is completed with the
//!   first records of the stream (cycled when the stream is shorter than a global batch), so every
//!   rank gets a full last batch; on one rank the last batch keeps its partial size. With
//!   `drop_last` an incomplete last global batch is dropped.
//!
//! This is the same layout as the map-style loader's [`BatchPlan`] over a dataset of the stream's
//! length, without shuffle (global batch `i` of `B` records to rank `i mod N`), so once the end is
//! known the loader publishes that plan and `gather_for_metrics` drops the completing duplicates
//! as for a map-style loader.
//!
//! **Look-ahead.** A batch is released only once the reader has seen whether the batch
//! `lookahead` places after it exists. With a look-ahead of at least 1 the loader knows, when it
//! hands out a batch, whether it is the last one; with `K - 1` it knows at the first micro-step of
//! every accumulation window how long that window is (our windows are weighted by their true
//! length, so that must be known before the window's first backward pass, where Accelerate, which
//! divides by K regardless, looks ahead one batch). Only raw records of this rank's pending
//! batches are held for it, never transformed batches.

use std::collections::VecDeque;

use super::plan::BatchPlan;
use crate::error::{Error, Result};

/// One of this rank's batches, ready to be transformed: its records, in order.
#[derive(Debug)]
pub(crate) struct RankBatch<R> {
    /// Index of the batch among this rank's batches of the epoch.
    pub index: usize,
    pub records: Vec<R>,
    /// The number of records in the epoch's stream, if the reader had reached its end when the
    /// batch was released.
    pub stream_len: Option<usize>,
}

/// Cuts a stream, record by record, into this rank's batches.
#[derive(Debug)]
pub(crate) struct StreamSharder<R> {
    batch_size: usize,
    world_size: usize,
    rank: usize,
    drop_last: bool,
    lookahead: usize,
    /// Records seen so far.
    seen: usize,
    /// The first global batch's records: what completes an incomplete last one.
    first_round: Vec<R>,
    /// Index of the next batch to release.
    next: usize,
    /// This rank's records of batches `next, next + 1, ...`.
    pending: VecDeque<Vec<R>>,
}

impl<R: Clone> StreamSharder<R> {
    /// Rank `rank`'s share of a stream in batches of `batch_size` per rank over `world_size`
    /// ranks, releasing batches from index `skip` on (the earlier ones are counted, not kept),
    /// each once it is known whether the batch `lookahead` places after it exists.
    pub fn new(
        batch_size: usize,
        world_size: usize,
        rank: usize,
        drop_last: bool,
        skip: usize,
        lookahead: usize,
    ) -> Self {
        Self {
            batch_size,
            world_size,
            rank,
            drop_last,
            // Below 1 a batch could be released before its last record arrived.
            lookahead: lookahead.max(1),
            seen: 0,
            first_round: Vec::new(),
            next: skip,
            pending: VecDeque::new(),
        }
    }

    fn round(&self) -> usize {
        self.batch_size * self.world_size
    }

    /// Whether batch `index` exists, given the records seen so far (the end not reached yet).
    fn exists(&self, index: usize) -> bool {
        let round = self.round();
        if self.drop_last {
            self.seen >= (index + 1) * round
        } else {
            self.seen > index * round
        }
    }

    /// The records of batch `index` collected so far.
    fn slot(&mut self, index: usize) -> &mut Vec<R> {
        let offset = index - self.next;
        while self.pending.len() <= offset {
            self.pending.push_back(Vec::with_capacity(self.batch_size));
        }
        &mut self.pending[offset]
    }

    /// Takes the next record of the stream; returns the batches it made ready, in order.
    pub fn push(&mut self, record: R) -> Vec<RankBatch<R>> {
        let round = self.round();
        let position = self.seen;
        self.seen += 1;
        let (index, within) = (position / round, position % round);
        let mine = within / self.batch_size == self.rank;
        if mine && index >= self.next {
            if position < round {
                self.first_round.push(record.clone());
            }
            self.slot(index).push(record);
        } else if position < round {
            self.first_round.push(record);
        }
        let mut ready = Vec::new();
        while self.exists(self.next + self.lookahead) {
            let records = self.pending.pop_front().unwrap_or_default();
            ready.push(RankBatch {
                index: self.next,
                records,
                stream_len: None,
            });
            self.next += 1;
        }
        ready
    }

    /// The stream has ended: this rank's remaining batches (the last completed from the start of
    /// the stream when it has to be) and the stream's length. An error if the batches to skip are
    /// more than the stream has.
    pub fn finish(mut self) -> Result<(Vec<RankBatch<R>>, usize)> {
        let len = self.seen;
        let plan = BatchPlan::unchecked(len, self.batch_size, self.world_size)
            .with_drop_last(self.drop_last);
        let batches = plan.batches_per_rank();
        if self.next > batches {
            return Err(Error::Data(format!(
                "cannot resume after {} batches: the stream now makes only {batches} batches per \
                 epoch on rank {} ({len} records, batch size {}, {} ranks, drop_last {}); the \
                 position was saved with other data, batch size or number of processes",
                self.next, self.rank, self.batch_size, self.world_size, self.drop_last
            )));
        }
        let round = self.round();
        let mut ready = Vec::new();
        for index in self.next..batches {
            let mut records = self.pending.pop_front().unwrap_or_default();
            if self.world_size > 1 {
                // Complete the last round with the first records, as Accelerate does.
                let start = index * round + self.rank * self.batch_size;
                for position in start + records.len()..start + self.batch_size {
                    records.push(self.first_round[position % len].clone());
                }
            }
            ready.push(RankBatch {
                index,
                records,
                stream_len: Some(len),
            });
        }
        Ok((ready, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every batch of `rank` for a stream `0..len`, by pushing the records one by one.
    fn shard(
        len: usize,
        b: usize,
        n: usize,
        rank: usize,
        drop_last: bool,
        skip: usize,
        lookahead: usize,
    ) -> Vec<RankBatch<usize>> {
        let mut s = StreamSharder::new(b, n, rank, drop_last, skip, lookahead);
        let mut out = Vec::new();
        for r in 0..len {
            out.extend(s.push(r));
        }
        out.extend(s.finish().unwrap().0);
        out
    }

    fn records(batches: &[RankBatch<usize>]) -> Vec<Vec<usize>> {
        batches.iter().map(|b| b.records.clone()).collect()
    }

    #[test]
    fn matches_accelerates_iterable_dataset_shard_by_hand() {
        // IterableDatasetShard(range(11), batch_size=2, num_processes=2): global batches of 4,
        // rank 0 takes the first two of each; the last [8, 9, 10] completes with 0.
        assert_eq!(
            records(&shard(11, 2, 2, 0, false, 0, 1)),
            vec![vec![0, 1], vec![4, 5], vec![8, 9]]
        );
        assert_eq!(
            records(&shard(11, 2, 2, 1, false, 0, 1)),
            vec![vec![2, 3], vec![6, 7], vec![10, 0]]
        );
        // drop_last: the incomplete last global batch is gone.
        assert_eq!(
            records(&shard(11, 2, 2, 1, true, 0, 1)),
            vec![vec![2, 3], vec![6, 7]]
        );
        // A stream shorter than one global batch is cycled: [0, 1, 2] -> [0, 1, 2, 0, 1, 2].
        assert_eq!(
            records(&shard(3, 3, 2, 1, false, 0, 1)),
            vec![vec![0, 1, 2]]
        );
        // One rank keeps its partial last batch.
        assert_eq!(
            records(&shard(5, 2, 1, 0, false, 0, 1)),
            vec![vec![0, 1], vec![2, 3], vec![4]]
        );
    }

    #[test]
    fn equals_the_map_style_plan_of_the_streams_length() {
        for len in 0..40 {
            for (b, n) in [(1, 1), (3, 1), (2, 2), (3, 3), (4, 2)] {
                for drop_last in [false, true] {
                    let plan = BatchPlan::unchecked(len, b, n).with_drop_last(drop_last);
                    for rank in 0..n {
                        for lookahead in [1, 3] {
                            let ours = shard(len, b, n, rank, drop_last, 0, lookahead);
                            assert_eq!(
                                records(&ours),
                                plan.rank_batches(0, rank),
                                "len {len} b {b} n {n} rank {rank} drop_last {drop_last}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_batch_is_released_once_the_lookahead_is_known_and_the_last_knows_the_length() {
        // 10 records, batches of 2 on one rank: 5 batches. With a look-ahead of 2, batch 0 is
        // released when the record of batch 2 arrives (record 4).
        let mut s = StreamSharder::new(2, 1, 0, false, 0, 2);
        let mut released_at = Vec::new();
        for r in 0..10 {
            for batch in s.push(r) {
                assert_eq!(batch.stream_len, None);
                released_at.push((batch.index, r));
            }
        }
        assert_eq!(released_at, vec![(0, 4), (1, 6), (2, 8)]);
        let (rest, len) = s.finish().unwrap();
        assert_eq!(len, 10);
        assert_eq!(
            rest.iter()
                .map(|b| (b.index, b.stream_len))
                .collect::<Vec<_>>(),
            vec![(3, Some(10)), (4, Some(10))]
        );
    }

    #[test]
    fn skipped_batches_are_not_released_and_too_many_is_an_error() {
        let resumed = shard(11, 2, 2, 1, false, 2, 1);
        assert_eq!(resumed.len(), 1);
        assert_eq!(
            (resumed[0].index, resumed[0].records.clone()),
            (2, vec![10, 0])
        );
        let mut s = StreamSharder::new(2, 2, 0, false, 4, 1);
        for r in 0..11 {
            assert!(s.push(r).is_empty());
        }
        let e = s.finish().unwrap_err().to_string();
        assert!(
            e.contains("resume after 4 batches") && e.contains("only 3"),
            "{e}"
        );
    }
}
