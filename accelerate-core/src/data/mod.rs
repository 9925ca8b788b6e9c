//! Datasets and the data loader.
//!
//! A [`Dataset`] gives random access to items and collates them into a [`Batch`];
//! [`TensorDataset`] is the in-memory one (optionally read from a safetensors file written by
//! PyTorch). A [`DataLoader`] hands out one rank's batches epoch after epoch: seeded per-epoch
//! shuffle identical on every rank, batch `i` to rank `i mod N`, even batches by wrapping around
//! (the [`BatchPlan`]), prefetch on a background thread, skip-to-position for exact resume, and a
//! shared [`LoaderProgress`] that tells the accelerator where the epoch stands.

mod batch;
mod dataset;
mod epoch_iter;
mod fingerprint;
mod iteration;
mod loader;
#[cfg(feature = "cuda")]
mod pinned;
mod plan;
mod progress;
mod shuffle;
mod tensor_dataset;
mod window;

#[cfg(test)]
mod loader_tests;
#[cfg(test)]
mod test_support;

pub use batch::Batch;
pub use dataset::Dataset;
pub use epoch_iter::EpochIter;
pub use fingerprint::LoaderSettings;
pub(crate) use iteration::{LoaderPosition, PreparedLoaders};
pub use loader::{DataLoader, DEFAULT_BATCH_TIMEOUT};
pub use plan::BatchPlan;
pub use progress::LoaderProgress;
pub use shuffle::shuffled_indices;
pub use tensor_dataset::TensorDataset;
pub use window::WindowIter;
