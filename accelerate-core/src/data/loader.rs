//! [`DataLoader`]: batches of a dataset for one rank, shuffled per epoch, prefetched.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;

use super::dataset::Dataset;
use super::epoch_cursor::EpochCursor;
use super::epoch_iter::{EpochIter, EpochSpec};
use super::plan::BatchPlan;
use super::progress::LoaderProgress;
use super::window::WindowIter;
use crate::error::{Error, Result};

/// Default limit on the wait for one batch from the prefetch thread.
pub const DEFAULT_BATCH_TIMEOUT: Duration = Duration::from_secs(600);

/// Hands out one rank's batches of a dataset, epoch after epoch.
///
/// Batching, shuffling and sharding follow HF Accelerate's prepared data loader (see
/// [`BatchPlan`]): the order of an epoch depends only on `(seed, epoch)` and is the same on every
/// rank; global batch `i` goes to rank `i mod world_size`; on several ranks the last round is
/// completed by wrapping around to the start of the order, so every rank steps equally often.
///
/// Batches are gathered and moved to the device on a background thread, `prefetch` batches ahead.
pub struct DataLoader<D: Dataset> {
    dataset: Arc<D>,
    /// The batch layout; its world size is the number of ranks sharded over.
    plan: BatchPlan,
    prefetch: usize,
    device: Device,
    rank: usize,
    batch_timeout: Duration,
    progress: Arc<LoaderProgress>,
    /// Epoch and skip of the next [`DataLoader::iter`] call.
    cursor: EpochCursor,
}

impl<D: Dataset> DataLoader<D> {
    /// A loader of `dataset` in batches of `batch_size`: no shuffle, seed 0, drop_last off,
    /// prefetch 2, on the CPU, rank 0 of 1.
    pub fn new(dataset: Arc<D>, batch_size: usize) -> Self {
        let loader = Self {
            plan: BatchPlan::unchecked(dataset.len(), batch_size, 1),
            dataset,
            prefetch: 2,
            device: Device::Cpu,
            rank: 0,
            batch_timeout: DEFAULT_BATCH_TIMEOUT,
            progress: Arc::new(LoaderProgress::default()),
            cursor: EpochCursor::default(),
        };
        loader.refresh_progress();
        loader
    }

    /// Whether each epoch visits the samples in a seeded random order.
    pub fn shuffle(mut self, on: bool) -> Self {
        self.plan = self.plan.with_shuffle(on);
        self.refresh_progress();
        self
    }

    /// Seed of the shuffle; the order of an epoch depends only on the seed and the epoch.
    pub fn seed(mut self, seed: u64) -> Self {
        self.plan = self.plan.with_seed(seed);
        self.refresh_progress();
        self
    }

    /// Whether to drop a final partial batch (and, on several ranks, an incomplete last round)
    /// instead of completing it with samples from the start of the epoch.
    pub fn drop_last(mut self, on: bool) -> Self {
        self.plan = self.plan.with_drop_last(on);
        self.refresh_progress();
        self
    }

    /// How many finished batches may wait ahead of the training loop (the prefetch thread builds
    /// one more while they wait). 0 builds each batch on the calling thread when it is asked for,
    /// with no background thread; a panic in the dataset then reaches the caller directly.
    pub fn prefetch(mut self, depth: usize) -> Self {
        self.prefetch = depth;
        self
    }

    /// The device batches are moved to (on the prefetch thread).
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Longest wait for one batch from the prefetch thread before the iterator returns a timeout
    /// error (default [`DEFAULT_BATCH_TIMEOUT`]).
    pub fn batch_timeout(mut self, limit: Duration) -> Self {
        self.batch_timeout = limit;
        self
    }

    /// Makes this the loader of rank `rank` among `world_size` ranks. Every rank must use the same
    /// dataset length, batch size, shuffle, seed and drop_last.
    pub fn shard(mut self, rank: usize, world_size: usize) -> Self {
        self.rank = rank;
        self.plan = self.plan.with_world_size(world_size);
        self.refresh_progress();
        self
    }

    /// Publishes the plan to the shared progress (after any setting that changes it).
    fn refresh_progress(&self) {
        self.progress.set_plan(self.plan);
    }

    /// The batch plan this loader follows.
    pub fn plan(&self) -> BatchPlan {
        self.plan
    }

    /// Checks the configuration: positive batch and world sizes, rank inside the world.
    pub fn check(&self) -> Result<()> {
        self.plan().check()?;
        if self.rank >= self.plan.world_size() {
            return Err(Error::Config(format!(
                "the data loader is sharded as rank {} of {} ranks; DataLoader::shard takes a \
                 rank in 0..world_size",
                self.rank,
                self.plan.world_size()
            )));
        }
        Ok(())
    }

    /// Batches this rank gets per epoch.
    pub fn len(&self) -> usize {
        self.plan().batches_per_rank()
    }

    /// Whether this rank gets no batch per epoch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dataset.
    pub fn dataset(&self) -> &Arc<D> {
        &self.dataset
    }

    /// Samples per batch (per rank).
    pub fn batch_size(&self) -> usize {
        self.plan.batch_size()
    }

    /// Number of ranks the batches are dealt to.
    pub fn world_size(&self) -> usize {
        self.plan.world_size()
    }

    /// This loader's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The device batches are moved to.
    pub fn target_device(&self) -> &Device {
        &self.device
    }

    /// Where this rank's iteration stands; shared with every clone of the `Arc`.
    pub fn progress(&self) -> Arc<LoaderProgress> {
        Arc::clone(&self.progress)
    }

    /// The global batch list of `epoch` (sample indices), before sharding: this rank's batches are
    /// entries `rank, rank + N, rank + 2N, ...`. Includes the wrap-around completion.
    pub fn epoch_plan(&self, epoch: u64) -> Vec<Vec<usize>> {
        self.plan().epoch_batches(epoch)
    }

    /// Number of real (not wrapped-around) samples in an epoch, over all ranks: the dataset's
    /// length, or fewer with drop_last. They are the first samples of [`DataLoader::epoch_plan`].
    pub fn samples_per_epoch(&self) -> usize {
        self.plan().real_samples()
    }

    /// Number of wrapped-around duplicates in an epoch, over all ranks; they come last in
    /// [`DataLoader::epoch_plan`], so a gather of the last round keeps its first rows.
    pub fn wrapped_samples_per_epoch(&self) -> usize {
        self.plan().wrapped_samples()
    }

    /// Iterates this rank's batches of `epoch`, skipping the first `skip` of them (exact resume).
    ///
    /// Batches are built on a background thread (`prefetch` ahead; see [`DataLoader::prefetch`]).
    /// Starting the iteration marks the start of an epoch in [`DataLoader::progress`]. An invalid
    /// configuration, or `skip` beyond the epoch, makes the first item an error.
    pub fn iter_epoch(&self, epoch: u64, skip: usize) -> EpochIter<D> {
        let progress = Arc::clone(&self.progress);
        if let Err(e) = self.check() {
            return EpochIter::failed(e, epoch, self.rank, progress);
        }
        let plan = self.plan();
        let batches_per_epoch = plan.batches_per_rank();
        if skip > batches_per_epoch {
            let e = Error::Data(format!(
                "cannot resume epoch {epoch} after {skip} batches: rank {} has only \
                 {batches_per_epoch} batches per epoch (dataset of {} samples, batch size {}, {} \
                 ranks, drop_last {}); the position was saved with another dataset, batch size \
                 or number of processes",
                self.rank,
                plan.len(),
                plan.batch_size(),
                plan.world_size(),
                plan.drop_last()
            ));
            return EpochIter::failed(e, epoch, self.rank, progress);
        }
        let mut batches = plan.rank_batches(epoch, self.rank);
        batches.drain(..skip);
        EpochIter::start(EpochSpec {
            dataset: Arc::clone(&self.dataset),
            device: self.device.clone(),
            batches,
            epoch,
            rank: self.rank,
            skip,
            batches_per_epoch,
            prefetch: self.prefetch,
            batch_timeout: self.batch_timeout,
            progress,
        })
    }

    /// Iterates the next epoch: an internal counter that starts at 0 and advances with every call,
    /// like `for batch in loader` in PyTorch.
    pub fn iter(&mut self) -> EpochIter<D> {
        let (epoch, skip) = self.cursor.advance(&self.progress);
        self.iter_epoch(epoch, skip)
    }

    /// Sets the epoch of the next [`DataLoader::iter`] call.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.cursor.resume_at(&self.progress, epoch, 0);
    }

    /// Makes the next [`DataLoader::iter`] (or [`DataLoader::windows`]) call iterate `epoch` from
    /// batch `skip` on, as saved by a checkpoint; the calls after it start their epochs at 0.
    pub fn resume_at(&mut self, epoch: u64, skip: usize) {
        self.cursor.resume_at(&self.progress, epoch, skip);
    }

    /// Epoch of the next [`DataLoader::iter`] call (after `Accelerator::load_state`, the epoch the
    /// checkpoint resumes in).
    pub fn next_epoch(&self) -> u64 {
        self.cursor.next_epoch(&self.progress)
    }

    /// Iterates the next epoch (as [`DataLoader::iter`]) in windows of up to `k` consecutive batches;
    /// the last window may be shorter. A loop then knows a whole accumulation window (e.g. its token
    /// count) before its first backward pass.
    pub fn windows(&mut self, k: usize) -> WindowIter<EpochIter<D>> {
        let batches = self.iter();
        let (epoch, position) = (batches.epoch(), batches.position());
        let progress = Arc::clone(batches.progress_handle());
        WindowIter::new(batches, k, epoch, position, progress)
    }
}

impl<D: Dataset> IntoIterator for &mut DataLoader<D> {
    type Item = Result<D::Batch>;
    type IntoIter = EpochIter<D>;

    /// The next epoch, as [`DataLoader::iter`].
    fn into_iter(self) -> EpochIter<D> {
        self.iter()
    }
}

impl<D: Dataset> fmt::Debug for DataLoader<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataLoader")
            .field("plan", &self.plan)
            .field("prefetch", &self.prefetch)
            .field("device", &self.device)
            .field("rank", &self.rank)
            .field("cursor", &self.cursor)
            .finish()
    }
}
