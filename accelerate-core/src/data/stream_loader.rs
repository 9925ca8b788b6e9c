//! [`StreamingLoader`]: batches of an [`IterableDataset`] for one rank, read as a stream.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;

use super::epoch_cursor::EpochCursor;
use super::iterable::IterableDataset;
use super::loader::DEFAULT_BATCH_TIMEOUT;
use super::plan::BatchPlan;
use super::progress::LoaderProgress;
use super::stream_iter::{StreamIter, StreamSpec};
use super::window::WindowIter;
use crate::error::{Error, Result};

/// Hands out one rank's batches of a stream, epoch after epoch: PyTorch's `DataLoader` over an
/// `IterableDataset`, sharded as HF Accelerate's `IterableDatasetShard`.
///
/// Every rank reads the whole stream and takes its slice of each global batch of
/// `batch_size × world_size` records (rank `r` takes records `r·B .. (r+1)·B`), so the ranks agree
/// on every batch and reach the end together without talking to each other. The last, incomplete
/// global batch is dropped with `drop_last`, and otherwise completed with the first records of the
/// stream (Accelerate's behavior for iterable datasets; there are no "uneven batches" to allow
/// here, since a rank that ran out of data while others had some would have to learn of it from
/// them at every batch). `gather_for_metrics` drops those completing duplicates at the last batch,
/// as for a map-style loader. One rank keeps a partial last batch.
///
/// Unlike [`DataLoader`](super::DataLoader) the length is unknown in advance: the reader looks
/// ahead `lookahead` batches (at least the largest K − 1 of the models prepared on the same
/// accelerator, before or after the loader) so that the end of the stream, and so the length of the last accumulation window, is known
/// in time. There is no shuffle; the dataset gets the epoch and may vary its order by it.
/// Records are transformed into items on `num_workers` threads and the batches handed out in
/// stream order, identical to those of one worker.
pub struct StreamingLoader<S: IterableDataset> {
    dataset: Arc<S>,
    /// The batch layout: batch size, world size, drop_last (its length is unknown: 0).
    plan: BatchPlan,
    rank: usize,
    num_workers: usize,
    prefetch: usize,
    lookahead: usize,
    device: Device,
    batch_timeout: Duration,
    progress: Arc<LoaderProgress>,
    /// Epoch and skip of the next [`StreamingLoader::iter`] call.
    cursor: EpochCursor,
}

impl<S: IterableDataset> StreamingLoader<S> {
    /// A loader of `dataset` in batches of `batch_size`: drop_last off, 1 worker, prefetch 2,
    /// look-ahead 1 batch, on the CPU, rank 0 of 1.
    pub fn new(dataset: Arc<S>, batch_size: usize) -> Self {
        Self {
            dataset,
            plan: BatchPlan::unchecked(0, batch_size, 1),
            rank: 0,
            num_workers: 1,
            prefetch: 2,
            lookahead: 1,
            device: Device::Cpu,
            batch_timeout: DEFAULT_BATCH_TIMEOUT,
            progress: Arc::new(LoaderProgress::for_stream()),
            cursor: EpochCursor::default(),
        }
    }

    /// Whether to drop an incomplete last global batch instead of completing it with the first
    /// records of the stream (or, on one rank, keeping the partial batch).
    pub fn drop_last(mut self, on: bool) -> Self {
        self.plan = self.plan.with_drop_last(on);
        self
    }

    /// Threads that transform records into items and collate batches (at least 1). The batches
    /// are the same, in the same order, whatever the number.
    pub fn num_workers(mut self, workers: usize) -> Self {
        self.num_workers = workers;
        self
    }

    /// Batches that may be built ahead of the training loop; raised to `num_workers` so that
    /// every worker has a batch to build.
    pub fn prefetch(mut self, depth: usize) -> Self {
        self.prefetch = depth;
        self
    }

    /// How many batches past the one handed out the reader must have seen (at least 1, so the
    /// loader knows which batch is the last). Once prepared, each iteration reads at least the
    /// largest K − 1 of the accelerator's models ahead, so that each accumulation window's length
    /// is known at its first micro-step. Only the raw records
    /// of this rank's batches are held for it.
    pub fn lookahead(mut self, batches: usize) -> Self {
        self.lookahead = batches;
        self
    }

    /// The device batches are moved to (on the worker threads).
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Longest wait for the next batch before the iterator returns a timeout error (default
    /// [`DEFAULT_BATCH_TIMEOUT`]).
    pub fn batch_timeout(mut self, limit: Duration) -> Self {
        self.batch_timeout = limit;
        self
    }

    /// Makes this the loader of rank `rank` among `world_size` ranks. Every rank must read the
    /// same stream with the same batch size and drop_last.
    pub fn shard(mut self, rank: usize, world_size: usize) -> Self {
        self.rank = rank;
        self.plan = self.plan.with_world_size(world_size);
        self
    }

    /// Checks the configuration: positive batch size, world size and workers, rank inside the
    /// world.
    pub fn check(&self) -> Result<()> {
        self.plan.check()?;
        if self.rank >= self.plan.world_size() {
            return Err(Error::Config(format!(
                "the streaming loader is sharded as rank {} of {} ranks; StreamingLoader::shard \
                 takes a rank in 0..world_size",
                self.rank,
                self.plan.world_size()
            )));
        }
        if self.num_workers == 0 {
            return Err(Error::Config(
                "StreamingLoader::num_workers(0): at least one worker thread transforms the \
                 records; pass 1 or more"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The batch layout (batch size, world size, drop_last); its length is 0, the stream's being
    /// unknown.
    pub fn plan(&self) -> BatchPlan {
        self.plan
    }

    /// The dataset.
    pub fn dataset(&self) -> &Arc<S> {
        &self.dataset
    }

    /// Samples per batch (per rank).
    pub fn batch_size(&self) -> usize {
        self.plan.batch_size()
    }

    /// Number of ranks the stream is sharded over.
    pub fn world_size(&self) -> usize {
        self.plan.world_size()
    }

    /// This loader's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The look-ahead in batches.
    pub fn lookahead_batches(&self) -> usize {
        self.lookahead.max(1)
    }

    /// Where this rank's iteration stands; shared with every clone of the `Arc`.
    pub fn progress(&self) -> Arc<LoaderProgress> {
        Arc::clone(&self.progress)
    }

    /// Iterates this rank's batches of `epoch`, skipping the first `skip` of them (exact resume:
    /// the stream is read again from its start, the skipped batches counted but not transformed).
    /// An invalid configuration, or `skip` beyond the epoch, makes an item an error.
    pub fn iter_epoch(&self, epoch: u64, skip: usize) -> StreamIter<S> {
        if let Err(e) = self.check() {
            return StreamIter::failed(e, epoch, self.rank, self.plan, self.progress());
        }
        StreamIter::start(StreamSpec {
            dataset: Arc::clone(&self.dataset),
            device: self.device.clone(),
            epoch,
            rank: self.rank,
            plan: self.plan,
            skip,
            lookahead: self
                .lookahead_batches()
                .max(self.progress.window_lookahead()),
            num_workers: self.num_workers,
            prefetch: self.prefetch.max(self.num_workers),
            batch_timeout: self.batch_timeout,
            progress: self.progress(),
        })
    }

    /// Iterates the next epoch: an internal counter that starts at 0 and advances with every
    /// call. After `Accelerator::load_state`, the saved epoch from the saved batch on.
    pub fn iter(&mut self) -> StreamIter<S> {
        let (epoch, skip) = self.cursor.advance(&self.progress);
        self.iter_epoch(epoch, skip)
    }

    /// Sets the epoch of the next [`StreamingLoader::iter`] call.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.cursor.resume_at(&self.progress, epoch, 0);
    }

    /// Makes the next [`StreamingLoader::iter`] call iterate `epoch` from batch `skip` on.
    pub fn resume_at(&mut self, epoch: u64, skip: usize) {
        self.cursor.resume_at(&self.progress, epoch, skip);
    }

    /// Epoch of the next [`StreamingLoader::iter`] call (after `Accelerator::load_state`, the
    /// epoch the checkpoint resumes in).
    pub fn next_epoch(&self) -> u64 {
        self.cursor.next_epoch(&self.progress)
    }

    /// Iterates the next epoch in windows of up to `k` consecutive batches, as
    /// [`DataLoader::windows`](super::DataLoader::windows).
    pub fn windows(&mut self, k: usize) -> WindowIter<StreamIter<S>> {
        let batches = self.iter();
        let (epoch, position) = (batches.epoch(), batches.position());
        let progress = Arc::clone(batches.progress_handle());
        WindowIter::new(batches, k, epoch, position, progress)
    }
}

impl<S: IterableDataset> IntoIterator for &mut StreamingLoader<S> {
    type Item = Result<S::Batch>;
    type IntoIter = StreamIter<S>;

    /// The next epoch, as [`StreamingLoader::iter`].
    fn into_iter(self) -> StreamIter<S> {
        self.iter()
    }
}

impl<S: IterableDataset> fmt::Debug for StreamingLoader<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamingLoader")
            .field("batch_size", &self.plan.batch_size())
            .field("world_size", &self.plan.world_size())
            .field("drop_last", &self.plan.drop_last())
            .field("rank", &self.rank)
            .field("num_workers", &self.num_workers)
            .field("lookahead", &self.lookahead)
            .field("cursor", &self.cursor)
            .finish()
    }
}
