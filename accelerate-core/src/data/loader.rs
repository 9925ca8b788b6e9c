//! [`Loader`]: what the two loaders share (the batch plan, this rank, the device, prefetch, the
//! epoch cursor and progress); [`LoaderKind`] is what differs between a map-style
//! [`DataLoader`](super::DataLoader) and a [`StreamingLoader`](super::StreamingLoader).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;

use super::epoch_cursor::EpochCursor;
use super::plan::BatchPlan;
use super::progress::LoaderProgress;
use super::window::WindowIter;
use crate::error::{Error, Result};

/// Default limit on the wait for one batch from the prefetch thread.
pub const DEFAULT_BATCH_TIMEOUT: Duration = Duration::from_secs(600);

/// Hands out one rank's batches of a dataset, epoch after epoch: a [`DataLoader`] over a
/// map-style dataset or a [`StreamingLoader`] over a stream, as `K` says.
///
/// [`DataLoader`]: super::DataLoader
/// [`StreamingLoader`]: super::StreamingLoader
pub struct Loader<K: LoaderKind> {
    /// The dataset and the settings of this kind of loader only.
    pub(super) kind: K,
    /// The batch layout; its world size is the number of ranks sharded over.
    pub(super) plan: BatchPlan,
    pub(super) rank: usize,
    pub(super) prefetch: usize,
    pub(super) device: Device,
    pub(super) batch_timeout: Duration,
    pub(super) progress: Arc<LoaderProgress>,
    /// Epoch and skip of the next [`Loader::iter`] call.
    pub(super) cursor: EpochCursor,
}

/// What makes a [`Loader`] a [`DataLoader`](super::DataLoader) or a
/// [`StreamingLoader`](super::StreamingLoader): its dataset, its own settings and how it iterates
/// an epoch. Implemented by [`MapStyle`](super::MapStyle) and [`Streamed`](super::Streamed) only.
pub trait LoaderKind: Sized + sealed::Sealed {
    /// The dataset's type.
    type Dataset;
    /// The iterator over one epoch's batches.
    type Iter: Iterator;
    /// The loader's type name in messages.
    const NAME: &'static str;
    /// The loader in a sentence ("the data loader").
    const DESCRIPTION: &'static str;
    /// Whether every change of the plan is published to the progress at once (a map-style
    /// loader's length is known in advance; a stream's plan is published once its end is seen).
    const PUBLISHES_PLAN: bool;

    /// The dataset.
    fn dataset(&self) -> &Arc<Self::Dataset>;

    /// Checks of this kind's own settings, after the shared ones.
    fn check(loader: &Loader<Self>) -> Result<()>;

    /// Iterates `loader`'s batches of `epoch` after the first `skip`, as [`Loader::iter_epoch`].
    fn iter_epoch(loader: &Loader<Self>, epoch: u64, skip: usize) -> Self::Iter;

    /// Where windows over `batches` start: the epoch, the batch, and the progress they report to
    /// (that of the batches).
    fn window_start(batches: &Self::Iter) -> (u64, usize, Arc<LoaderProgress>);

    /// Writes this kind's own settings into `loader`'s `Debug` output.
    fn debug_fields(&self, f: &mut fmt::DebugStruct<'_, '_>);
}

pub(super) mod sealed {
    /// Keeps [`LoaderKind`](super::LoaderKind) to this crate's two kinds.
    pub trait Sealed {}
}

impl<K: LoaderKind> Loader<K> {
    /// A loader of `kind` with `plan` that reports to `progress`: prefetch 2, on the CPU, rank 0.
    pub(super) fn with_kind(kind: K, plan: BatchPlan, progress: LoaderProgress) -> Self {
        let loader = Self {
            kind,
            plan,
            rank: 0,
            prefetch: 2,
            device: Device::Cpu,
            batch_timeout: DEFAULT_BATCH_TIMEOUT,
            progress: Arc::new(progress),
            cursor: EpochCursor::default(),
        };
        loader.refresh_progress();
        loader
    }

    /// Publishes the plan to the shared progress (after any setting that changes it), if this
    /// kind of loader knows its length.
    pub(super) fn refresh_progress(&self) {
        if K::PUBLISHES_PLAN {
            self.progress.set_plan(self.plan);
        }
    }

    /// Whether to drop an incomplete last batch instead of completing it: for a dataset, the
    /// final partial batch (and, on several ranks, an incomplete last round) instead of completing
    /// it with samples from the start of the epoch; for a stream, an incomplete last global batch
    /// instead of completing it with the first records of the stream (or, on one rank, keeping
    /// the partial batch).
    pub fn drop_last(mut self, on: bool) -> Self {
        self.plan = self.plan.with_drop_last(on);
        self.refresh_progress();
        self
    }

    /// How many finished batches may wait ahead of the training loop. A [`DataLoader`]'s
    /// prefetch thread builds one more while they wait, and 0 builds each batch on the calling
    /// thread when it is asked for, with no background thread (a panic in the dataset then
    /// reaches the caller directly); a [`StreamingLoader`] raises the depth to its
    /// `num_workers`, so that every worker has a batch to build.
    ///
    /// [`DataLoader`]: super::DataLoader
    /// [`StreamingLoader`]: super::StreamingLoader
    pub fn prefetch(mut self, depth: usize) -> Self {
        self.prefetch = depth;
        self
    }

    /// The device batches are moved to (on the threads that build them).
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Longest wait for one batch before the iterator returns a timeout error (default
    /// [`DEFAULT_BATCH_TIMEOUT`]).
    pub fn batch_timeout(mut self, limit: Duration) -> Self {
        self.batch_timeout = limit;
        self
    }

    /// Makes this the loader of rank `rank` among `world_size` ranks. Every rank must use the same
    /// dataset (or stream), batch size and drop_last, and a map-style loader the same shuffle and
    /// seed.
    pub fn shard(mut self, rank: usize, world_size: usize) -> Self {
        self.rank = rank;
        self.plan = self.plan.with_world_size(world_size);
        self.refresh_progress();
        self
    }

    /// The batch plan this loader follows (a stream's length in it is 0, being unknown).
    pub fn plan(&self) -> BatchPlan {
        self.plan
    }

    /// Checks the configuration: positive batch and world sizes, rank inside the world, and a
    /// streaming loader's workers.
    pub fn check(&self) -> Result<()> {
        self.plan.check()?;
        if self.rank >= self.plan.world_size() {
            return Err(Error::Config(format!(
                "the {} is sharded as rank {} of {} ranks; {}::shard takes a rank in \
                 0..world_size",
                K::DESCRIPTION,
                self.rank,
                self.plan.world_size(),
                K::NAME
            )));
        }
        K::check(self)
    }

    /// The dataset.
    pub fn dataset(&self) -> &Arc<K::Dataset> {
        self.kind.dataset()
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

    /// Iterates this rank's batches of `epoch`, skipping the first `skip` of them (exact resume;
    /// a stream is read again from its start, the skipped batches counted but not transformed).
    ///
    /// Batches are built on background threads (see [`Loader::prefetch`]). Starting the
    /// iteration marks the start of an epoch in [`Loader::progress`]. An invalid configuration,
    /// or `skip` beyond the epoch, makes an item an error.
    pub fn iter_epoch(&self, epoch: u64, skip: usize) -> K::Iter {
        K::iter_epoch(self, epoch, skip)
    }

    /// Iterates the next epoch: an internal counter that starts at 0 and advances with every call,
    /// like `for batch in loader` in PyTorch. After `Accelerator::load_state`, the saved epoch
    /// from the saved batch on.
    pub fn iter(&mut self) -> K::Iter {
        let (epoch, skip) = self.cursor.advance(&self.progress);
        self.iter_epoch(epoch, skip)
    }

    /// Sets the epoch of the next [`Loader::iter`] call.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.cursor.resume_at(&self.progress, epoch, 0);
    }

    /// Makes the next [`Loader::iter`] (or [`Loader::windows`]) call iterate `epoch` from batch
    /// `skip` on, as saved by a checkpoint; the calls after it start their epochs at 0.
    pub fn resume_at(&mut self, epoch: u64, skip: usize) {
        self.cursor.resume_at(&self.progress, epoch, skip);
    }

    /// Epoch of the next [`Loader::iter`] call (after `Accelerator::load_state`, the epoch the
    /// checkpoint resumes in).
    pub fn next_epoch(&self) -> u64 {
        self.cursor.next_epoch(&self.progress)
    }

    /// Iterates the next epoch (as [`Loader::iter`]) in windows of up to `k` consecutive batches;
    /// the last window may be shorter. A loop then knows a whole accumulation window (e.g. its
    /// token count) before its first backward pass.
    pub fn windows(&mut self, k: usize) -> WindowIter<K::Iter> {
        let batches = self.iter();
        let (epoch, position, progress) = K::window_start(&batches);
        WindowIter::new(batches, k, epoch, position, progress)
    }
}

impl<K: LoaderKind> IntoIterator for &mut Loader<K> {
    type Item = <K::Iter as Iterator>::Item;
    type IntoIter = K::Iter;

    /// The next epoch, as [`Loader::iter`].
    fn into_iter(self) -> K::Iter {
        self.iter()
    }
}

impl<K: LoaderKind> fmt::Debug for Loader<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct(K::NAME);
        s.field("plan", &self.plan)
            .field("prefetch", &self.prefetch)
            .field("device", &self.device)
            .field("rank", &self.rank);
        self.kind.debug_fields(&mut s);
        s.field("cursor", &self.cursor).finish()
    }
}
