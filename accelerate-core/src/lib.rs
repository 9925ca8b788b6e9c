//! # accelerate-core
//!
//! Everything a training process links to train with the same loop on one process (one GPU or the
//! CPU) or as one rank of many: [`Accelerator::prepare`] for the parameters, optimizer, data loader
//! and LR scheduler; [`Accelerator::accumulate`] to begin a micro-step of gradient accumulation;
//! [`Accelerator::backward`], which accumulates gradients by parameter name and averages them across
//! ranks on the micro-step where the optimizer steps.
//!
//! ## The canonical loop
//!
//! ```
//! use std::sync::Arc;
//! use accelerate_core::data::{DataLoader, TensorDataset};
//! use accelerate_core::optim::{AdamW, AdamWConfig, LrScheduler, Schedule};
//! use accelerate_core::Accelerator;
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, loss, Module, VarBuilder, VarMap};
//!
//! # fn main() -> accelerate_core::Result<()> {
//! let mut acc = Accelerator::builder().gradient_accumulation_steps(4).build()?;
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, acc.device());
//! let model = linear(8, 2, vb.pp("l1"))?;
//! let x = Tensor::randn(0f32, 1.0, (256, 8), &Device::Cpu)?;
//! let y = Tensor::zeros(256, DType::U32, &Device::Cpu)?;
//! let dataset = Arc::new(TensorDataset::new(x, y)?);
//!
//! let params = acc.prepare(&varmap)?;
//! let mut opt = acc.prepare(AdamW::new(params, AdamWConfig::default())?)?;
//! let mut loader = acc.prepare(DataLoader::new(dataset, 16).shuffle(true).seed(42))?;
//! let total = acc.num_update_steps(loader.len()) * 3;
//! let schedule = Schedule::CosineWithWarmup { warmup_steps: 2, total_steps: total };
//! let mut sched = acc.prepare(LrScheduler::new(opt.learning_rate_handle(), schedule)?)?;
//!
//! for _epoch in 0..3 {
//!     for batch in loader.iter() {
//!         let (x, y) = batch?;
//!         let _step = acc.accumulate();          // one micro-step
//!         let logits = model.forward(&x)?;
//!         let loss = loss::cross_entropy(&logits, &y)?;
//!         acc.backward(&loss)?;                   // scaled by 1/k; averaged across ranks on sync
//!         if acc.sync_gradients() {
//!             acc.clip_grad_norm(1.0)?;
//!         }
//!         opt.step()?;                            // no-ops unless this micro-step syncs
//!         sched.step();
//!         opt.zero_grad();
//!     }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! ## Mixed precision
//!
//! `Accelerator::builder().mixed_precision(MixedPrecision::Bf16)` (or `Fp16`; the default comes
//! from `ACCELERATE_MIXED_PRECISION`, which `accelerate-launch --mixed-precision` sets) runs the
//! forward and backward passes in half precision with f32 master weights. Build the model in
//! [`Accelerator::compute_dtype`], cast float inputs to it, and compute the loss in f32; the loop
//! is otherwise unchanged. See [`MixedPrecision`] for what is f32 and what is half.
//!
//! ```
//! use accelerate_core::optim::{AdamW, AdamWConfig};
//! use accelerate_core::{Accelerator, MixedPrecision};
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, loss, Module, VarBuilder, VarMap};
//!
//! # fn main() -> accelerate_core::Result<()> {
//! let mut acc = Accelerator::builder().mixed_precision(MixedPrecision::Fp16).build()?;
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, acc.compute_dtype(), acc.device()); // f16 model
//! let model = linear(8, 2, vb.pp("l1"))?;
//! let masters = acc.prepare(&varmap)?;                   // f32 copies, same names
//! let mut opt = acc.prepare(AdamW::new(masters, AdamWConfig::default())?)?;
//! let x = Tensor::randn(0f32, 1.0, (16, 8), &Device::Cpu)?;
//! let y = Tensor::zeros(16, DType::U32, &Device::Cpu)?;
//! for _ in 0..3 {
//!     let logits = model.forward(&x.to_dtype(acc.compute_dtype())?)?.to_dtype(DType::F32)?;
//!     acc.backward(&loss::cross_entropy(&logits, &y)?)?; // scaled by the fp16 loss scale
//!     opt.step()?;                           // skipped if the gradients overflowed; refreshes
//!     opt.zero_grad();                       // the f16 model from the f32 masters otherwise
//!     if acc.step_was_skipped() {
//!         println!("overflow: loss scale now {:?}", acc.loss_scale());
//!     }
//! }
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

mod accelerator;
#[cfg(doctest)]
mod book;
mod checkpoint;
pub mod comm;
mod cpu_slices;
#[cfg(feature = "cuda")]
mod cuda_accumulate;
#[cfg(feature = "cuda")]
mod cuda_slices;
pub mod data;
mod device;
pub mod env;
mod error;
mod files;
mod fsdp;
#[cfg(fuzzing)]
pub mod fuzzing;
#[cfg(all(test, not(fuzzing)))]
mod fuzzing;
mod grads;
mod malloc;
// Plain data: tested on the CPU, used by the CUDA gradient kernel.
#[cfg(any(feature = "cuda", test))]
mod merged_layout;
mod mixed_precision;
mod model;
mod no_sync;
pub mod optim;
mod prepared;
mod process;
mod rng;
// Used by the CUDA kernels; built without `cuda` too, so that its fallback logic is tested on any
// machine.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod runtime_kernels;
mod sync;
mod threads;
mod tracking;
mod training;
mod window;
mod zero;

pub use accelerator::{
    Accelerator, AcceleratorBuilder, Prepare, DEFAULT_OVERLAP_GRADIENT_REDUCTION,
};
pub use checkpoint::{
    check_no_newer_checkpoint, checkpoint_dir, latest_checkpoint, list_checkpoints,
    prune_checkpoints, prune_checkpoints_keeping, save_model, StateDictType,
    DEFAULT_MAX_SHARD_BYTES, MODEL_INDEX_FILE, MODEL_SAFETENSORS,
};
pub use comm::ReduceOp;
pub use device::{gpu_present, physical_gpu_count, select_device};
pub use error::{Error, Result};
pub use files::{load_into_vars, load_safetensors, save_safetensors, write_atomic};
pub use fsdp::{ShardedUnit, UnitParams, UnitSpec};
pub use grads::{GradientBuffers, DEFAULT_BUCKET_CAP_BYTES};
pub use malloc::keep_freed_memory;
pub use mixed_precision::{
    DynamicLossScaler, LossScalerConfig, LossScalerState, MasterWeights, MixedPrecision,
};
pub use model::{Model, PreparedModel};
pub use no_sync::NoSync;
pub use prepared::{PreparedOptimizer, PreparedScheduler};
pub use process::{Launcher, ProcessState, DEFAULT_MASTER_PORT};
pub use rng::{RankRng, RngState};
pub use sync::GradientSyncStats;
pub use tracking::{
    parse_report_to, TrackerErrors, TrackerKind, CURVES_PNG, DEFAULT_LOGGING_DIR, EVAL_ACCURACY,
    EVAL_LOSS, TRAIN_GRAD_NORM, TRAIN_LEARNING_RATE, TRAIN_LOSS,
};
pub use window::MicroStep;
