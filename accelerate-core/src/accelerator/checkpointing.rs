//! Checkpoints of the whole training state, and the model alone, from the accelerator.

use std::path::{Path, PathBuf};

use super::Accelerator;
use crate::checkpoint::{self, TrainingView};
use crate::error::Result;

impl Accelerator {
    /// Saves the whole training state into `dir` (see [`checkpoint`](crate::checkpoint)):
    /// parameters, every prepared optimizer and scheduler, the accumulation counters and, per
    /// rank, the data loaders' positions, its generator ([`rng`](Self::rng)) and a partial
    /// window's gradients. Call it on every rank at the same point of the loop; it returns once the
    /// checkpoint is complete on disk, with the same outcome on every rank: if any rank fails, all
    /// return an error naming it. An existing checkpoint at `dir` is replaced atomically, and a
    /// replace that a crash interrupted is finished or rolled back first.
    pub fn save_state(&self, dir: impl AsRef<Path>) -> Result<()> {
        checkpoint::save_state(&self.training_view(), dir.as_ref())
    }

    /// Saves the state as `<root>/checkpoint_<N>`, N being the optimizer steps taken, then deletes
    /// the oldest checkpoints beyond `keep` (main process), never the one just written. Refuses
    /// (on every rank, before writing anything) when `root` holds a checkpoint with a larger N:
    /// another run's, which would otherwise stay the latest (see
    /// [`check_no_newer_checkpoint`](checkpoint::check_no_newer_checkpoint)). Returns the
    /// checkpoint's directory.
    pub fn save_checkpoint(&self, root: impl AsRef<Path>, keep: Option<usize>) -> Result<PathBuf> {
        let root = root.as_ref();
        if keep == Some(0) {
            // Refused before anything is written.
            checkpoint::prune_checkpoints(root, 0)?;
        }
        let step = self.optimizer_steps();
        let dir = checkpoint::checkpoint_dir(root, step);
        let view = self.training_view();
        let checked = if self.is_main_process() {
            checkpoint::check_no_newer_checkpoint(root, step)
        } else {
            Ok(())
        };
        view.agree(root, "checking the checkpoint directory", checked)?;
        checkpoint::save_state(&view, &dir)?;
        let pruned = match (keep, self.is_main_process()) {
            (Some(keep), true) => {
                checkpoint::prune_checkpoints_keeping(root, keep, &dir).map(|_| ())
            }
            _ => Ok(()),
        };
        view.agree(root, "deleting the oldest checkpoints", pruned)?;
        Ok(dir)
    }

    /// Restores a state saved by [`save_state`](Self::save_state) from `dir`, or from the latest
    /// `checkpoint_<N>` under `dir` (under mixed precision: the f32 master weights, copied into
    /// the compute copies, and the fp16 loss scaler), with each rank's generator. Prepare the same
    /// parameters, optimizers, schedulers and loaders first, and call it on every rank. A save
    /// that a crash interrupted between its renames is finished or rolled back first (saying so on
    /// stderr). Every file is verified before anything changes: on an error on any rank nothing is
    /// loaded on any. Loaders continue from their saved position at their next `iter()`. Returns
    /// the directory loaded.
    pub fn load_state(&self, dir: impl AsRef<Path>) -> Result<PathBuf> {
        checkpoint::load_state(&self.training_view(), dir.as_ref())
    }

    /// Writes the model alone into `dir` as safetensors with PyTorch names and layouts
    /// (`model.safetensors`, or shards with a Hugging Face index above 5 GB). Main process only
    /// writes; every rank returns after it finished, with its outcome (an error naming rank 0 if
    /// it failed).
    pub fn save_model(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.save_model_sharded(dir, checkpoint::DEFAULT_MAX_SHARD_BYTES)
    }

    /// [`save_model`](Self::save_model) with shards of at most `max_shard_bytes`.
    pub fn save_model_sharded(&self, dir: impl AsRef<Path>, max_shard_bytes: u64) -> Result<()> {
        let dir = dir.as_ref();
        let written = if self.is_main_process() {
            checkpoint::save_model(self.training.parameters(), dir, max_shard_bytes).map(|_| ())
        } else {
            Ok(())
        };
        self.training_view()
            .agree(dir, "writing the model", written)
    }

    fn training_view(&self) -> TrainingView<'_> {
        TrainingView {
            rank: self.state.rank,
            world_size: self.state.world_size,
            comm: self.comm.as_ref(),
            training: &self.training,
            rng: &self.rng,
            device: &self.device,
        }
    }
}
