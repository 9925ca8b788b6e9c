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
//! | `rng_<r>.json` | rank `r` | the exact position of its own generator ([`crate::rng`]) |
//! | `manifest.json` | main, last | format version, world size, parameter names/shapes/dtypes, size and CRC-32 of every file |
//!
//! The random state is the loaders' and each rank's generator's: the shuffle order of an epoch is a
//! pure function of the loader's seed and the epoch, so the epoch and the position within it
//! restore it; each rank's [`RankRng`](crate::rng::RankRng) (dropout masks) is saved exactly in
//! `rng_<r>.json`. On a GPU, the device's own generator (whose position cannot be read) is reset to
//! a seed derived from the rank's generator at every save and load, so it too continues alike.
//! A checkpoint written before generators were saved has no `rng_<r>.json`; it still loads, with a
//! warning that the generators continue from where this run's are.
//!
//! Every file is written into a temporary sibling directory and fsynced; the directory is then
//! renamed into place ([`staging`]), so a crash or a full disk leaves the previous checkpoint as it
//! was, and the next save or load finishes or rolls back a replace that a crash interrupted between
//! its renames. Loading reads and verifies every file before changing anything ([`load`]).
//!
//! Saving and loading are collectives: what one rank fails at (rank 0 creating the directory, a
//! rank writing its part) is agreed on by all ([`Accelerator::agree_across_ranks`](crate::Accelerator::agree_across_ranks)), so every rank returns the
//! same outcome and none is left waiting.
//!
//! CRC-32 (`crc32fast`, already a dependency of the tree) detects what happens to files by accident
//! (truncation, bit flips, a file from another checkpoint); it is not a defence against someone
//! forging a file, which a checkpoint directory one can write to cannot have anyway.

mod agree;
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

use std::path::Path;

use candle_core::{Device, Var};

use crate::comm::Communicator;
use crate::error::Result;
use crate::rng::RankRng;
use crate::training::TrainingState;

pub(crate) use agree::agree_with;
pub use manifest::{FileEntry, Manifest, ParameterEntry, FORMAT_VERSION, MANIFEST_FILE};
pub use model::{
    save_model, DEFAULT_MAX_SHARD_BYTES, MODEL_FILE as MODEL_SAFETENSORS, MODEL_INDEX_FILE,
};
pub use naming::{
    check_no_newer_checkpoint, checkpoint_dir, latest_checkpoint, list_checkpoints,
    prune_checkpoints, prune_checkpoints_keeping,
};

pub(crate) use load::load_state;
pub(crate) use save::save_state;

/// What saving and loading reach of a training process: who it is, how to wait for the others,
/// and the state shared with the prepared objects.
pub(crate) struct TrainingView<'a> {
    pub rank: usize,
    pub world_size: usize,
    pub comm: &'a dyn Communicator,
    pub training: &'a TrainingState,
    pub rng: &'a RankRng,
    pub device: &'a Device,
}

impl TrainingView<'_> {
    /// The prepared parameters, sorted by name.
    pub fn params(&self) -> &[(String, Var)] {
        self.training.parameters()
    }

    /// Every rank's outcome of `what` on `path`, agreed (see [`agree`]).
    pub fn agree<T>(&self, path: &Path, what: &str, local: Result<T>) -> Result<T> {
        agree::agree_with(
            |t| self.comm.all_gather(t),
            self.world_size,
            path,
            what,
            local,
        )
    }

    /// On a GPU, resets the device's generator to a seed derived from this rank's generator (see
    /// the module documentation); returns the seed. Nothing to do on the CPU, whose candle
    /// generator cannot be seeded.
    pub fn reseed_device(&self) -> Result<Option<u64>> {
        if self.device.is_cpu() {
            return Ok(None);
        }
        let seed = self.rng.device_seed();
        self.device.set_seed(seed)?;
        Ok(Some(seed))
    }
}
