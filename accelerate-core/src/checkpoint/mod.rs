//! Save and load the whole training state (the format: `Accelerator::save_state`).

mod agree;
mod custom;
mod exact;
mod files;
mod layout;
mod load;
pub mod manifest;
mod model;
pub mod naming;
mod removal;
mod reshard;
mod save;
mod scalars;
pub mod staging;
mod state_dict;

#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::Arc;

use candle_core::Device;

use crate::comm::Communicator;
use crate::data::PreparedLoaders;
use crate::error::Result;
use crate::rng::RankRng;
use crate::training::{TrainingSnapshot, TrainingState};

pub(crate) use agree::agree_with;
pub(crate) use custom::{custom_file, SharedCustomState};
pub(crate) use model::save_model_tensors;
pub use model::{
    save_model, DEFAULT_MAX_SHARD_BYTES, MODEL_FILE as MODEL_SAFETENSORS, MODEL_INDEX_FILE,
};
pub use naming::{
    check_no_newer_checkpoint, checkpoint_dir, latest_checkpoint, list_checkpoints,
    prune_checkpoints, prune_checkpoints_keeping,
};

pub(crate) use load::{load_state, Source};
pub(crate) use removal::warn;
pub(crate) use save::save_state;
pub use state_dict::StateDictType;

/// What saving and loading reach of a training process: who it is, how to wait for the others,
/// and the state shared with the prepared objects.
pub(crate) struct TrainingView<'a> {
    pub rank: usize,
    pub world_size: usize,
    pub comm: &'a dyn Communicator,
    /// Every prepared model's training state, the first first.
    pub models: &'a [Arc<TrainingState>],
    /// The prepared loaders, shared by the models.
    pub loaders: &'a PreparedLoaders,
    pub rng: &'a RankRng,
    pub device: &'a Device,
    /// The user's objects registered for checkpointing, in order of registration.
    pub custom: &'a [SharedCustomState],
}

impl TrainingView<'_> {
    /// Every model's snapshot, at this instant, in order of preparation; the shared state
    /// (optimizers, schedulers, loss scaler) on the main process only, which writes it.
    pub fn snapshots(&self) -> Result<Vec<TrainingSnapshot>> {
        let main = self.rank == 0;
        self.models.iter().map(|m| m.snapshot(main)).collect()
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

    /// Succeeds on every rank only if every rank made the same choice of `what` under `path`:
    /// `key` compared, `shown` in the error (see [`agree::agree_on_choice`]).
    pub fn agree_on_choice(&self, path: &Path, what: &str, key: &str, shown: &str) -> Result<()> {
        agree::agree_on_choice(
            |t| self.comm.all_gather(t),
            self.world_size,
            path,
            what,
            key,
            shown,
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
