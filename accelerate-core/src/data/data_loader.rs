//! [`DataLoader`]: batches of a dataset for one rank, shuffled per epoch, prefetched.

use std::fmt;
use std::sync::Arc;

use super::dataset::Dataset;
use super::epoch_iter::{EpochIter, EpochSpec};
use super::loader::{sealed, Loader, LoaderKind};
use super::plan::BatchPlan;
use super::progress::LoaderProgress;
use crate::error::{Error, Result};

/// Hands out one rank's batches of a dataset, epoch after epoch.
///
/// Batching, shuffling and sharding follow HF Accelerate's prepared data loader (see
/// [`BatchPlan`]): the order of an epoch depends only on `(seed, epoch)` and is the same on every
/// rank; global batch `i` goes to rank `i mod world_size`; on several ranks the last round is
/// completed by wrapping around to the start of the order, so every rank steps equally often.
///
/// Batches are gathered and moved to the device on a background thread, `prefetch` batches ahead.
pub type DataLoader<D> = Loader<MapStyle<D>>;

/// The [`LoaderKind`] of a [`DataLoader`]: a dataset with random access, whose length is known.
pub struct MapStyle<D> {
    dataset: Arc<D>,
}

impl<D> sealed::Sealed for MapStyle<D> {}

impl<D: Dataset> LoaderKind for MapStyle<D> {
    type Dataset = D;
    type Iter = EpochIter<D>;
    const NAME: &'static str = "DataLoader";
    const DESCRIPTION: &'static str = "data loader";
    const PUBLISHES_PLAN: bool = true;

    fn dataset(&self) -> &Arc<D> {
        &self.dataset
    }

    fn check(_loader: &DataLoader<D>) -> Result<()> {
        Ok(())
    }

    /// Batches are built on a background thread (`prefetch` ahead; see [`Loader::prefetch`]).
    fn iter_epoch(loader: &DataLoader<D>, epoch: u64, skip: usize) -> EpochIter<D> {
        let progress = loader.progress();
        if let Err(e) = loader.check() {
            return EpochIter::failed(e, epoch, loader.rank, progress);
        }
        let plan = loader.plan;
        let batches_per_epoch = plan.batches_per_rank();
        if skip > batches_per_epoch {
            let e = Error::Data(format!(
                "cannot resume epoch {epoch} after {skip} batches: rank {} has only \
                 {batches_per_epoch} batches per epoch (dataset of {} samples, batch size {}, {} \
                 ranks, drop_last {}); the position was saved with another dataset, batch size \
                 or number of processes",
                loader.rank,
                plan.len(),
                plan.batch_size(),
                plan.world_size(),
                plan.drop_last()
            ));
            return EpochIter::failed(e, epoch, loader.rank, progress);
        }
        let mut batches = plan.rank_batches(epoch, loader.rank);
        batches.drain(..skip);
        EpochIter::start(EpochSpec {
            dataset: Arc::clone(&loader.kind.dataset),
            device: loader.device.clone(),
            batches,
            epoch,
            rank: loader.rank,
            skip,
            batches_per_epoch,
            prefetch: loader.prefetch,
            batch_timeout: loader.batch_timeout,
            progress,
        })
    }

    fn window_start(batches: &EpochIter<D>) -> (u64, usize, Arc<LoaderProgress>) {
        let progress = Arc::clone(batches.progress_handle());
        (batches.epoch(), batches.position(), progress)
    }

    fn debug_fields(&self, _f: &mut fmt::DebugStruct<'_, '_>) {}
}

impl<D: Dataset> Loader<MapStyle<D>> {
    /// A loader of `dataset` in batches of `batch_size`: no shuffle, seed 0, drop_last off,
    /// prefetch 2, on the CPU, rank 0 of 1.
    pub fn new(dataset: Arc<D>, batch_size: usize) -> Self {
        let plan = BatchPlan::unchecked(dataset.len(), batch_size, 1);
        Self::with_kind(MapStyle { dataset }, plan, LoaderProgress::default())
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

    /// Batches this rank gets per epoch.
    pub fn len(&self) -> usize {
        self.plan.batches_per_rank()
    }

    /// Whether this rank gets no batch per epoch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The global batch list of `epoch` (sample indices), before sharding: this rank's batches are
    /// entries `rank, rank + N, rank + 2N, ...`. Includes the wrap-around completion.
    pub fn epoch_plan(&self, epoch: u64) -> Vec<Vec<usize>> {
        self.plan.epoch_batches(epoch)
    }

    /// Number of real (not wrapped-around) samples in an epoch, over all ranks: the dataset's
    /// length, or fewer with drop_last. They are the first samples of [`DataLoader::epoch_plan`].
    pub fn samples_per_epoch(&self) -> usize {
        self.plan.real_samples()
    }

    /// Number of wrapped-around duplicates in an epoch, over all ranks; they come last in
    /// [`DataLoader::epoch_plan`], so a gather of the last round keeps its first rows.
    pub fn wrapped_samples_per_epoch(&self) -> usize {
        self.plan.wrapped_samples()
    }
}
