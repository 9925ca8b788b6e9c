//! # accelerate-trainer
//!
//! The third level of accelerate-rs, after a plain candle loop and the
//! [`Accelerator`](accelerate_core::Accelerator) loop: a `Trainer` that takes a model, datasets and
//! [`TrainingArguments`], and runs the loop (gradient accumulation, clipping, the schedule,
//! logging, evaluation, checkpoints, resume) as Hugging Face's `Trainer` does. It uses only the
//! public API of `accelerate-core`, so the same run written as an Accelerator loop gives the same
//! parameters.
#![warn(missing_docs)]

mod args;
mod error;

pub use args::{
    IntervalStrategy, ReportTo, ResumeFrom, SaveStrategy, SchedulerType, TrainingArguments,
};
pub use error::{Error, Result};
