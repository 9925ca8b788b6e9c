//! Save and load the whole training state, atomically on disk and verified on load.
//!
//! A checkpoint is a directory:
//!
//! | file | written by | holds |
//! |---|---|---|
//! | `model.safetensors` | main process | the parameters, by name (the f32 master weights under mixed precision) |
//! | `optimizer_<i>.safetensors`, `optimizer_<i>.json` | main | optimizer `i`'s tensors (moments, buffers); its kind and scalars (step counts, hyper-parameters) |
//! | `scheduler_<i>.json` | main | scheduler `i`'s step count and base learning rate |
//! | `accumulation.json` | main | the micro-step counter of the current window, K, the optimizer step count |
//! | `loss_scaler.json` | main, fp16 only | the dynamic loss scale and its growth tracker |
//! | `rank_<r>.json` | rank `r` | the position of each of its data loaders (epoch, batches consumed) |
//! | `rank_<r>_gradients.safetensors` | rank `r` | its partial gradient sums, only when saved inside an accumulation window |
//! | `manifest.json` | main, last | format version, world size, parameter names/shapes/dtypes, size and CRC-32 of every file |
//!
//! There is no random state beyond the loaders': the shuffle order of an epoch is a pure function of
//! the loader's seed and the epoch, so the seed (from the run's configuration), the epoch and the
//! position within it are the whole random state of the training path.
//!
//! Every file is written into a temporary sibling directory and fsynced; the directory is then
//! renamed into place ([`staging`]), so a crash or a full disk leaves the previous checkpoint as it
//! was. Loading reads and verifies every file before changing anything ([`load`]).
//!
//! CRC-32 (`crc32fast`, already a dependency of the tree) detects what happens to files by accident
//! (truncation, bit flips, a file from another checkpoint); it is not a defence against someone
//! forging a file, which a checkpoint directory one can write to cannot have anyway.

mod exact;
mod files;
mod load;
pub mod manifest;
mod model;
pub mod naming;
mod save;
pub mod staging;

#[cfg(test)]
mod tests;

use candle_core::Var;

use crate::comm::Communicator;
use crate::prepared::TrainingState;

pub use manifest::{FileEntry, Manifest, ParameterEntry, FORMAT_VERSION, MANIFEST_FILE};
pub use model::{
    save_model, DEFAULT_MAX_SHARD_BYTES, MODEL_FILE as MODEL_SAFETENSORS, MODEL_INDEX_FILE,
};
pub use naming::{checkpoint_dir, latest_checkpoint, list_checkpoints, prune_checkpoints};

pub(crate) use load::load_state;
pub(crate) use save::save_state;

/// What saving and loading reach of a training process: who it is, how to wait for the others,
/// and the state shared with the prepared objects.
pub(crate) struct TrainingView<'a> {
    pub rank: usize,
    pub world_size: usize,
    pub comm: &'a dyn Communicator,
    pub params: &'a [(String, Var)],
    pub shared: &'a TrainingState,
}
