//! The [`IterableDataset`] trait: items produced in order by an iterator, length unknown.

use super::batch::Batch;
use crate::error::Result;

/// The records of one epoch, in stream order, as [`IterableDataset::records`] returns them.
pub type Records<'a, R> = Box<dyn Iterator<Item = Result<R>> + Send + 'a>;

/// A dataset read as a stream, as PyTorch's `IterableDataset`: its records come in order from an
/// iterator whose length is not known in advance (lines of files on disk, read lazily), and each
/// record becomes an item through [`transform`](IterableDataset::transform).
///
/// Reading and transforming are two steps because they cost differently: every rank reads the
/// whole stream, in order, on one thread (cheap: a line of text), and transforms only the records
/// of its own batches, on [`StreamingLoader::num_workers`](super::StreamingLoader::num_workers)
/// threads (the costly part: parsing, tokenizing). A record is cloned once per epoch for each of
/// the first `batch_size × world_size` records, which complete an incomplete last round.
pub trait IterableDataset: Send + Sync + 'static {
    /// One raw record of the stream (a line of text, say).
    type Record: Clone + Send + 'static;
    /// One item, as [`transform`](IterableDataset::transform) makes it from a record.
    type Item: Send;
    /// A batch of items, as built by [`collate`](IterableDataset::collate).
    type Batch: Batch;

    /// The records of `epoch`, in order. Every rank must get the same stream for the same epoch
    /// (the ranks shard it by position); the epoch lets a dataset vary the order between epochs
    /// deterministically. An error item ends the epoch's iteration with that error.
    fn records(&self, epoch: u64) -> Result<Records<'_, Self::Record>>;

    /// Turns a record into an item; called on the loading workers, so it must give the same
    /// result whichever thread calls it.
    fn transform(&self, record: Self::Record) -> Result<Self::Item>;

    /// Builds one batch out of items, in the given order.
    fn collate(&self, items: Vec<Self::Item>) -> Result<Self::Batch>;
}
