//! [`StreamingLoader`]: batches of an [`IterableDataset`] for one rank, read as a stream.

use std::fmt;
use std::sync::Arc;

use super::iterable::IterableDataset;
use super::loader::{sealed, Loader, LoaderKind};
use super::plan::BatchPlan;
use super::progress::LoaderProgress;
use super::stream_iter::{StreamIter, StreamSpec};
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
pub type StreamingLoader<S> = Loader<Streamed<S>>;

/// The [`LoaderKind`] of a [`StreamingLoader`]: a stream of unknown length, transformed on worker
/// threads.
pub struct Streamed<S> {
    dataset: Arc<S>,
    num_workers: usize,
    lookahead: usize,
}

impl<S> sealed::Sealed for Streamed<S> {}

impl<S: IterableDataset> LoaderKind for Streamed<S> {
    type Dataset = S;
    type Iter = StreamIter<S>;
    const NAME: &'static str = "StreamingLoader";
    const DESCRIPTION: &'static str = "streaming loader";
    const PUBLISHES_PLAN: bool = false;

    fn dataset(&self) -> &Arc<S> {
        &self.dataset
    }

    /// At least one worker.
    fn check(loader: &StreamingLoader<S>) -> Result<()> {
        if loader.kind.num_workers == 0 {
            return Err(Error::Config(
                "StreamingLoader::num_workers(0): at least one worker thread transforms the \
                 records; pass 1 or more"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The stream is read again from its start, the skipped batches counted but not transformed.
    fn iter_epoch(loader: &StreamingLoader<S>, epoch: u64, skip: usize) -> StreamIter<S> {
        if let Err(e) = loader.check() {
            return StreamIter::failed(e, epoch, loader.rank, loader.plan, loader.progress());
        }
        StreamIter::start(StreamSpec {
            dataset: Arc::clone(&loader.kind.dataset),
            device: loader.device.clone(),
            epoch,
            rank: loader.rank,
            plan: loader.plan,
            skip,
            lookahead: loader
                .lookahead_batches()
                .max(loader.progress.window_lookahead()),
            num_workers: loader.kind.num_workers,
            prefetch: loader.prefetch.max(loader.kind.num_workers),
            batch_timeout: loader.batch_timeout,
            progress: loader.progress(),
        })
    }

    fn window_start(batches: &StreamIter<S>) -> (u64, usize, Arc<LoaderProgress>) {
        let progress = Arc::clone(batches.progress_handle());
        (batches.epoch(), batches.position(), progress)
    }

    fn debug_fields(&self, f: &mut fmt::DebugStruct<'_, '_>) {
        f.field("num_workers", &self.num_workers)
            .field("lookahead", &self.lookahead);
    }
}

impl<S: IterableDataset> Loader<Streamed<S>> {
    /// A loader of `dataset` in batches of `batch_size`: drop_last off, 1 worker, prefetch 2,
    /// look-ahead 1 batch, on the CPU, rank 0 of 1.
    pub fn new(dataset: Arc<S>, batch_size: usize) -> Self {
        let kind = Streamed {
            dataset,
            num_workers: 1,
            lookahead: 1,
        };
        Self::with_kind(
            kind,
            BatchPlan::unchecked(0, batch_size, 1),
            LoaderProgress::for_stream(),
        )
    }

    /// Threads that transform records into items and collate batches (at least 1). The batches
    /// are the same, in the same order, whatever the number.
    pub fn num_workers(mut self, workers: usize) -> Self {
        self.kind.num_workers = workers;
        self
    }

    /// How many batches past the one handed out the reader must have seen (at least 1, so the
    /// loader knows which batch is the last). Once prepared, each iteration reads at least the
    /// largest K − 1 of the accelerator's models ahead, so that each accumulation window's length
    /// is known at its first micro-step. Only the raw records
    /// of this rank's batches are held for it.
    pub fn lookahead(mut self, batches: usize) -> Self {
        self.kind.lookahead = batches;
        self
    }

    /// The look-ahead in batches.
    pub fn lookahead_batches(&self) -> usize {
        self.kind.lookahead.max(1)
    }
}
