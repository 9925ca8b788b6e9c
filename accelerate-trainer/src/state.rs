//! [`TrainerState`]: where a run is (step, epoch, best checkpoint) and what it logged, saved as
//! `trainer_state.json` with Hugging Face's keys in every checkpoint and in `output_dir`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// File name of the state in a checkpoint and in `output_dir`, as Hugging Face's.
pub const TRAINER_STATE_NAME: &str = "trainer_state.json";

/// The Trainer's progress, as Hugging Face's `TrainerState` (the keys it writes).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps taken.
    pub global_step: u64,
    /// Epochs trained, fractional within an epoch (optimizer steps / steps per epoch).
    pub epoch: f64,
    /// Optimizer steps of the whole run.
    pub max_steps: u64,
    /// Epochs of the whole run (rounded up).
    pub num_train_epochs: u64,
    /// `logging_steps` of the run.
    pub logging_steps: u64,
    /// Evaluation interval of the run (steps).
    pub eval_steps: u64,
    /// `save_steps` of the run.
    pub save_steps: u64,
    /// `per_device_train_batch_size` of the run.
    pub train_batch_size: usize,
    /// Every record logged: `{"loss", "learning_rate", "grad_norm", "epoch", "step"}` for
    /// training, `{"eval_loss", "eval_<metric>", "epoch", "step"}` for evaluations.
    pub log_history: Vec<BTreeMap<String, f64>>,
    /// The best `metric_for_best_model` value seen in an evaluation.
    pub best_metric: Option<f64>,
    /// The step of that evaluation.
    pub best_global_step: Option<u64>,
    /// The checkpoint saved at that step, if one was.
    pub best_model_checkpoint: Option<PathBuf>,
    /// Whether this process is the main one (the one that writes the file, so true there):
    /// callbacks gate side effects on it.
    pub is_world_process_zero: bool,
}

impl TrainerState {
    /// Reads `dir/trainer_state.json`.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(TRAINER_STATE_NAME);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Error::Args(format!(
                "{}: {e}; a Trainer checkpoint holds its trainer_state.json (resume from a \
                 checkpoint-<step> directory the Trainer wrote)",
                path.display()
            ))
        })?;
        serde_json::from_str(&text)
            .map_err(|e| Error::Args(format!("{}: not a trainer state: {e}", path.display())))
    }

    /// Writes `dir/trainer_state.json` atomically.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let json = serde_json::to_string_pretty(self).expect("TrainerState serializes to JSON");
        accelerate_core::write_atomic(dir.join(TRAINER_STATE_NAME), json.as_bytes())?;
        Ok(())
    }
}
