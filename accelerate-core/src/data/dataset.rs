//! The [`Dataset`] trait: random access to items, and how a list of items becomes a batch.

use super::batch::Batch;
use crate::error::Result;

/// A map-style dataset: `len` items addressed by index, as PyTorch's `Dataset`.
///
/// The data loader calls [`Dataset::get_batch`] from its prefetch thread, hence `Send + Sync`.
pub trait Dataset: Send + Sync + 'static {
    /// One sample, as returned by [`Dataset::get`].
    type Item: Send;
    /// A batch of samples, as built by [`Dataset::collate`].
    type Batch: Batch;

    /// Number of items.
    fn len(&self) -> usize;

    /// Whether the dataset has no items.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The item at `index` (`0..len`).
    fn get(&self, index: usize) -> Result<Self::Item>;

    /// Builds one batch out of items, in the given order.
    fn collate(&self, items: Vec<Self::Item>) -> Result<Self::Batch>;

    /// The batch of the items at `indices`, in that order.
    ///
    /// The default fetches each item with [`Dataset::get`] and collates them; in-memory datasets
    /// override it to gather all rows in one operation.
    fn get_batch(&self, indices: &[usize]) -> Result<Self::Batch> {
        let items = indices
            .iter()
            .map(|&i| self.get(i))
            .collect::<Result<Vec<_>>>()?;
        self.collate(items)
    }
}
