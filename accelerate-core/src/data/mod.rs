//! Datasets and the data loader.
//!
//! A [`Dataset`] gives random access to items and collates them into a [`Batch`];
//! [`TensorDataset`] is the in-memory one (optionally read from a safetensors file written by
//! PyTorch). A [`DataLoader`] hands out one rank's batches epoch after epoch: seeded per-epoch
//! shuffle identical on every rank, batch `i` to rank `i mod N`, even batches by wrapping around
//! (the [`BatchPlan`]), prefetch on a background thread, skip-to-position for exact resume, and a
//! shared [`LoaderProgress`] that tells the accelerator where the epoch stands.
//!
//! Data read as a stream is an [`IterableDataset`] (e.g. [`JsonlShards`], JSON Lines files read
//! lazily); a [`StreamingLoader`] shards it between ranks as Accelerate's
//! `IterableDatasetShard`, transforms its records on worker threads and resumes by re-reading.

mod batch;
mod data_loader;
mod dataset;
mod epoch_cursor;
mod epoch_iter;
mod fingerprint;
mod iterable;
mod iteration;
mod jsonl;
mod loader;
mod loader_stack;
#[cfg(feature = "cuda")]
mod pinned;
mod plan;
mod progress;
mod shuffle;
mod stream_iter;
mod stream_loader;
mod stream_shard;
mod tensor_dataset;
mod window;

#[cfg(test)]
mod loader_tests;
#[cfg(test)]
mod test_support;

pub use batch::Batch;
pub use data_loader::{DataLoader, MapStyle};
pub use dataset::Dataset;
pub use epoch_iter::EpochIter;
pub use fingerprint::LoaderSettings;
pub use iterable::{IterableDataset, Records};
pub(crate) use iteration::{LoaderPosition, PreparedLoaders};
pub use jsonl::{JsonlRecord, JsonlShards};
pub use loader::{Loader, LoaderKind, DEFAULT_BATCH_TIMEOUT};
pub use plan::BatchPlan;
pub use progress::{LoaderProgress, UNKNOWN_BATCHES_PER_EPOCH};
pub use shuffle::shuffled_indices;
pub use stream_iter::StreamIter;
pub use stream_loader::{Streamed, StreamingLoader};
pub use tensor_dataset::TensorDataset;
pub use window::WindowIter;
