//! Checkpoints of the whole training state, and the model alone, from the accelerator.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::Accelerator;
use crate::checkpoint::{self, TrainingView};
use crate::error::Result;

impl Accelerator {
    /// Saves the whole training state into `dir`:
    /// parameters, every prepared optimizer and scheduler, the accumulation counters and, per
    /// rank, the data loaders' positions, its generator ([`rng`](Self::rng)) and a partial
    /// window's gradients. Call it on every rank at the same point of the loop; it returns once the
    /// checkpoint is complete on disk, with the same outcome on every rank: if any rank fails, all
    /// return an error naming it. An existing checkpoint at `dir` is replaced atomically, and a
    /// replace that a crash interrupted is finished or rolled back first.
    ///
    /// # The checkpoint
    ///
    /// A checkpoint is a directory:
    ///
    /// | file | written by | holds |
    /// |---|---|---|
    /// | `model.safetensors` | main process | the parameters, by name (the f32 master weights under mixed precision) |
    /// | `model.rank_<r>.safetensors` | rank `r`, ZeRO stage 3 with sharded parameters | its pieces of the parameters, in place of `model.safetensors` |
    /// | `optimizer_<i>.safetensors`, `optimizer_<i>.json` | main | optimizer `i`'s tensors (moments, buffers); its kind and scalars (step counts, hyper-parameters) |
    /// | `optimizer_<i>.rank_<r>.safetensors` | rank `r`, under ZeRO | its pieces of optimizer `i`'s tensors, in place of `optimizer_<i>.safetensors` |
    /// | `scheduler_<i>.json` | main | scheduler `i`'s step count and base learning rate |
    /// | `accumulation.json` | main | the micro-step counter of the current window, K, the optimizer step count |
    /// | `loss_scaler.json` | main, fp16 only | the dynamic loss scale and its growth tracker |
    /// | `rank_<r>.json` | rank `r` | the position of each of its data loaders (epoch, batches consumed) |
    /// | `rank_<r>_gradients.safetensors` | rank `r` | its partial gradient sums, only when saved inside an accumulation window |
    /// | `rng_<r>.json` | rank `r` | the exact position of its own generator ([`RankRng`](crate::RankRng)) |
    /// | `custom_checkpoint_<i>.cbor` | main | object `i` registered with [`register_for_checkpointing`](Self::register_for_checkpointing), as CBOR |
    /// | `manifest.json` | main, last | format version, world size, parameter names/shapes/dtypes, size and CRC-32 of every file |
    ///
    /// Under ZeRO the manifest lists every rank's pieces by parameter name, and
    /// [`load_state`](Self::load_state) re-cuts them for its own stage and world size. Under
    /// stage 3 the parameters are saved as [`StateDictType`](checkpoint::StateDictType) says
    /// (`ACCELERATE_FSDP_STATE_DICT_TYPE`; each rank's own pieces without it): gathered unit by
    /// unit to the main process's host and written whole, or each rank's pieces; either loads at
    /// any stage and number of processes, each rank cutting its pieces on the host.
    ///
    /// The random state is the loaders' and each rank's generator's: the shuffle order of an epoch is a
    /// pure function of the loader's seed and the epoch, so the epoch and the position within it
    /// restore it; each rank's [`RankRng`](crate::RankRng) (dropout masks) is saved exactly in
    /// `rng_<r>.json`. On a GPU, the device's own generator (whose position cannot be read) is reset to
    /// a seed derived from the rank's generator at every save and load, so it too continues alike.
    /// A checkpoint without `rng_<r>.json` files still loads, with a
    /// warning that the generators continue from where this run's are.
    ///
    /// Every file is written into a temporary sibling directory and fsynced; the directory is then
    /// renamed into place, so a crash or a full disk leaves the previous checkpoint as it
    /// was, and the next save or load finishes or rolls back a replace that a crash interrupted between
    /// its renames. Loading reads and verifies every file it needs before changing anything.
    ///
    /// Saving and loading are collectives: what one rank fails at (rank 0 creating the directory, a
    /// rank writing its part) is agreed on by all ([`Accelerator::agree_across_ranks`](crate::Accelerator::agree_across_ranks)), so every rank returns the
    /// same outcome and none is left waiting.
    ///
    /// CRC-32 (`crc32fast`) detects what happens to files by accident
    /// (truncation, bit flips, a file from another checkpoint); it is not a defence against someone
    /// forging a file, which a checkpoint directory one can write to cannot have anyway.
    pub fn save_state(&self, dir: impl AsRef<Path>) -> Result<()> {
        checkpoint::save_state(&self.training_view(), dir.as_ref(), None)
    }

    /// [`save_state`](Self::save_state) with the parameters of a model under ZeRO stage 3 saved
    /// as `parameters` says, whatever `ACCELERATE_FSDP_STATE_DICT_TYPE` holds (the program's
    /// choice, as Accelerate's `fsdp_plugin.set_state_dict_type` makes it): gathered whole into
    /// `model.safetensors`, or each rank's pieces in its own `model.rank_<r>.safetensors`. Below
    /// stage 3 the parameters are whole on every rank and saved whole either way. Every rank
    /// passes the same choice.
    pub fn save_state_with(
        &self,
        dir: impl AsRef<Path>,
        parameters: checkpoint::StateDictType,
    ) -> Result<()> {
        checkpoint::save_state(&self.training_view(), dir.as_ref(), Some(parameters))
    }

    /// Saves the state as `<root>/checkpoint_<N>`, N being the optimizer steps taken, then deletes
    /// the oldest checkpoints beyond `keep` (main process), never the one just written; one it
    /// cannot delete is kept with a warning, since the new checkpoint is complete. Refuses
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
        checkpoint::save_state(&view, &dir, None)?;
        // Every rank agreed that the checkpoint is complete: pruning can only warn now (on NFS a
        // file still open elsewhere makes a deletion fail), never fail the save.
        if let (Some(keep), true) = (keep, self.is_main_process()) {
            if let Err(e) = checkpoint::prune_checkpoints_keeping(root, keep, &dir) {
                checkpoint::warn(&format!(
                    "{} is saved, but the oldest checkpoints beyond {keep} were not deleted: {e}",
                    dir.display()
                ));
            }
        }
        Ok(dir)
    }

    /// Registers `value` to be saved by [`save_state`](Self::save_state) and restored by
    /// [`load_state`](Self::load_state) with the rest of the training state (Accelerate's
    /// `register_for_checkpointing`): an epoch counter, a best metric, a struct of your own;
    /// anything serde writes as JSON. Returns the handle the loop and the accelerator share: change
    /// the value through it (`*epoch.lock().unwrap() += 1`); `save_state` writes it as it is then,
    /// and `load_state` replaces it.
    ///
    /// The main process's value is saved (`custom_checkpoint_<i>.cbor`, `i` in order of
    /// registration, listed in the manifest with its checksum), and every rank loads it. A
    /// checkpoint holding another number of registered objects, or a value that does not parse
    /// as the registered type, is refused before anything is loaded; a checkpoint without any
    /// loads when nothing is registered. Register the same objects in the same order in the run
    /// that resumes, before `load_state`. Unlike Accelerate, which takes any object with
    /// `state_dict`/`load_state_dict`, the value itself is the state.
    pub fn register_for_checkpointing<T>(&mut self, value: T) -> Arc<Mutex<T>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        let handle = Arc::new(Mutex::new(value));
        self.custom.push(handle.clone());
        handle
    }

    /// Restores a state saved by [`save_state`](Self::save_state) from `dir`, or from the latest
    /// `checkpoint_<N>` under `dir` (under mixed precision: the f32 master weights, copied into
    /// the compute copies, and the fp16 loss scaler), with each rank's generator. Prepare the same
    /// parameters, optimizers, schedulers and loaders first, and call it on every rank. A save
    /// that a crash interrupted between its renames is finished or rolled back first (saying so on
    /// stderr). The ranks first agree that they resolved the same checkpoint (its step and the
    /// checksum of its manifest: the same checkpoint copied to each machine's own path counts as
    /// one), and every rank refuses, naming each rank's pick, if they did not. Every file is
    /// verified before anything changes: on an error on any rank nothing is loaded on any.
    /// Loaders continue from their saved position at their next `iter()`. Returns the directory
    /// loaded. The first step [`log`](Self::log)ged after it starts the trackers' history over
    /// from that step (steps at or after it that an earlier run logged are dropped).
    ///
    /// To resume from a checkpoint that may not exist yet, use
    /// [`resume_latest`](Self::resume_latest) or [`resume_from`](Self::resume_from) rather than
    /// calling this only where one was found: a rank that found none would skip the collective
    /// the others wait in.
    pub fn load_state(&self, dir: impl AsRef<Path>) -> Result<PathBuf> {
        let dir = dir.as_ref();
        let loaded = checkpoint::load_state(&self.training_view(), checkpoint::Source::Dir(dir))?
            .ok_or_else(|| crate::Error::Checkpoint {
            path: dir.to_path_buf(),
            problem: "no checkpoint to load; pass the directory save_state wrote".into(),
        })?;
        self.resumed_logging();
        Ok(loaded)
    }

    /// Resumes from the latest `checkpoint_<N>` under `root` (as
    /// [`save_checkpoint`](Self::save_checkpoint) names them), or stays at the start when there is
    /// none: returns the directory loaded, or `None`. A collective: call it on every rank. The
    /// ranks agree on what they found, including "none", so ranks that see different latest
    /// checkpoints (machines that do not share `root`), or one that sees none, all stop with an
    /// error naming each rank's pick instead of training apart or waiting for each other. Loading
    /// itself is [`load_state`](Self::load_state)'s.
    pub fn resume_latest(&self, root: impl AsRef<Path>) -> Result<Option<PathBuf>> {
        let source = checkpoint::Source::Latest(root.as_ref());
        self.resume(source)
    }

    /// Resumes from `found`, the checkpoint this rank's caller resolved by its own rules (a
    /// latest of its own naming, a path from the command line), or stays at the start when it
    /// is `None` on every rank; returns the directory loaded. A collective: call it on every rank,
    /// with `None` where nothing was found, never skip it. The ranks agree on the checkpoint
    /// resolved (its step and manifest checksum) or on "none", and otherwise all stop with an
    /// error naming each rank's pick. Loading itself is [`load_state`](Self::load_state)'s
    /// (`found` may also be a directory of `checkpoint_<N>`).
    pub fn resume_from(&self, found: Option<impl AsRef<Path>>) -> Result<Option<PathBuf>> {
        let found = found.as_ref().map(|p| p.as_ref());
        self.resume(checkpoint::Source::Found(found))
    }

    fn resume(&self, source: checkpoint::Source<'_>) -> Result<Option<PathBuf>> {
        let loaded = checkpoint::load_state(&self.training_view(), source)?;
        if loaded.is_some() {
            self.resumed_logging();
        }
        Ok(loaded)
    }

    /// Writes the first model alone into `dir`, its trained and frozen parameters, as safetensors
    /// with PyTorch names and layouts (`model.safetensors`, or shards with a Hugging Face index
    /// above 5 GB). Main process only writes; every rank returns after it finished, with its
    /// outcome (an error naming rank 0 if it failed). A re-save replaces the set as a whole: a
    /// crash at any point leaves the previous model or the new one loadable, never a mix (see
    /// [`save_model`](checkpoint::save_model)).
    pub fn save_model(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.save_model_sharded(dir, checkpoint::DEFAULT_MAX_SHARD_BYTES)
    }

    /// [`save_model`](Self::save_model) with shards of at most `max_shard_bytes`.
    pub fn save_model_sharded(&self, dir: impl AsRef<Path>, max_shard_bytes: u64) -> Result<()> {
        let dir = dir.as_ref();
        let training = self.training();
        let written = if training.zero_stage() == 3 {
            // Every rank takes part in the gathers; the main process writes.
            let whole = training.whole_parameters(self.comm.as_ref(), self.is_main_process());
            match whole {
                Ok(tensors) if self.is_main_process() => {
                    checkpoint::save_model_tensors(tensors, dir, max_shard_bytes).map(|_| ())
                }
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            }
        } else if self.is_main_process() {
            checkpoint::save_model(&training.all_parameters(), dir, max_shard_bytes).map(|_| ())
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
            models: &self.models,
            loaders: &self.loaders,
            rng: &self.rng,
            device: &self.device,
            custom: &self.custom,
        }
    }
}
