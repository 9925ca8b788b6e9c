//! # accelerate-trainer
//!
//! The third level of accelerate-rs, after a plain candle loop and the
//! [`Accelerator`](accelerate_core::Accelerator) loop: a [`Trainer`] that takes a model, datasets and
//! [`TrainingArguments`], and runs the loop (gradient accumulation, clipping, the schedule,
//! logging, evaluation, checkpoints, resume) as Hugging Face's `Trainer` does. It uses only the
//! public API of `accelerate-core`, so the same run written as an Accelerator loop gives the same
//! parameters.
//!
//! ## Usage
//!
//! ```
//! use std::sync::Arc;
//! use accelerate_core::data::TensorDataset;
//! use accelerate_trainer::{ModelOutput, Trainer, TrainerModel, TrainingArguments};
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, Linear, Module, VarBuilder, VarMap};
//!
//! /// The user's model: per-sample losses (and logits and labels for `compute_metrics`).
//! struct Classifier(Linear);
//!
//! impl TrainerModel<(Tensor, Tensor)> for Classifier {
//!     fn forward(&self, (x, y): &(Tensor, Tensor)) -> candle_core::Result<ModelOutput> {
//!         let logits = self.0.forward(x)?;
//!         let log_probs = candle_nn::ops::log_softmax(&logits, 1)?;
//!         let losses = log_probs.gather(&y.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?;
//!         Ok(ModelOutput::losses(losses).with_predictions(logits, y.clone()))
//!     }
//! }
//!
//! # fn main() -> accelerate_trainer::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! let args = TrainingArguments {
//!     output_dir: dir.path().join("run"),
//!     learning_rate: 1e-2,
//!     num_train_epochs: 2.0,
//!     eval_strategy: accelerate_trainer::IntervalStrategy::Epoch,
//!     disable_tqdm: true,
//!     ..Default::default()
//! };
//! let mut trainer = Trainer::new(args)?;
//! // The model in the accelerator's compute dtype, on its device (mixed precision, GPU).
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, trainer.compute_dtype(), trainer.device());
//! let model = Classifier(linear(4, 3, vb.pp("head"))?);
//! let x = Tensor::randn(0f32, 1.0, (64, 4), &Device::Cpu)?;
//! let y = Tensor::zeros(64, DType::U32, &Device::Cpu)?;
//! let train = Arc::new(TensorDataset::new(x.narrow(0, 0, 48)?, y.narrow(0, 0, 48)?)?);
//! let eval = Arc::new(TensorDataset::new(x.narrow(0, 48, 16)?, y.narrow(0, 48, 16)?)?);
//!
//! let out = trainer.train(&model, &varmap, train, Some(eval))?;
//! println!("eval_loss={}", out.metrics["eval_loss"]);
//! # Ok(())
//! # }
//! ```
//!
//! Under `accelerate-launch --num-processes N` the same program trains on N ranks; checkpoints
//! go to `output_dir/checkpoint-<step>` and `resume_from_checkpoint = latest` continues the run
//! exactly.
#![warn(missing_docs)]

mod args;
#[cfg(doctest)]
mod book;
mod callbacks;
mod checkpoints;
mod control;
mod error;
mod evaluation;
mod model;
mod progress;
mod state;
mod steps;
mod trainer;

pub use args::{
    IntervalStrategy, ReportTo, ResumeFrom, SaveStrategy, SchedulerType, TrainingArguments,
};
pub use callbacks::{EarlyStoppingCallback, TrainerCallback};
pub use checkpoints::CHECKPOINT_PREFIX;
pub use control::TrainerControl;
pub use error::{Error, Result};
pub use model::{ComputeMetrics, EvalPrediction, Metrics, ModelOutput, TrainerModel};
pub use state::{TrainerState, TRAINER_STATE_NAME};
pub use steps::{micro_step, run_steps, MicroStepDone};
pub use trainer::{TrainOutput, Trainer, TRAIN_EPOCH};
