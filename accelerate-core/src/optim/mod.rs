//! Optimizers with inspectable, savable state, and learning-rate schedulers.
//!
//! [`Sgd`] and [`AdamW`] follow PyTorch's `torch.optim.SGD` and `torch.optim.AdamW` (non-foreach)
//! operation by operation, with one or more [`ParamGroup`]s of their own hyper-parameters. Each is an [`UpdateRule`] (its configuration, which
//! writes the per-element update) inside the one [`ElementwiseOptimizer`], which owns the state,
//! the walk over the parameters, the fused/tensor-op split and save/load. With f32 tensors on the
//! CPU (or a GPU) each parameter is updated in one pass over its data, with no temporary tensors
//! (candle-nn's AdamW allocates one per elementwise operation and keeps its state private); other
//! devices and dtypes use tensor ops.
//!
//! [`Lion`] is a third rule on the same core.
//!
//! Any other type implementing [`Optimizer`] goes through `Accelerator::prepare` too; candle-nn's
//! optimizers do through [`CandleOptimizer`].
//!
//! The learning rates (one per group) live in a shared [`LearningRate`] handle that the optimizer
//! reads at every step and an [`LrScheduler`] writes.

/// [`Optimizer::learning_rate`] and [`Optimizer::params`] for an optimizer that keeps its
/// learning-rate handle in a field `lr` and its sorted parameters in a field `params`: written
/// once for every such optimizer, inside its `impl Optimizer` block.
macro_rules! lr_and_params_accessors {
    () => {
        fn learning_rate(&self) -> &$crate::optim::LearningRate {
            &self.lr
        }

        fn params(&self) -> &[(String, candle_core::Var)] {
            &self.params
        }
    };
}

mod adamw;
mod candle_adapter;
#[cfg(test)]
mod conformance;
#[cfg(feature = "cuda")]
mod cuda_kernels;
mod elementwise;
mod group;
mod kernels;
mod lion;
mod lr;
// The launch plan is plain data: built and tested on the CPU, used by the CUDA kernels.
#[cfg(any(feature = "cuda", test))]
mod multi_tensor;
mod rule;
mod scheduler;
mod sgd;
mod state;

pub use crate::grads::Gradients;
pub use adamw::{AdamW, AdamWConfig};
pub use candle_adapter::CandleOptimizer;
#[cfg(feature = "cuda")]
pub use cuda_kernels::CudaUpdate;
pub use elementwise::ElementwiseOptimizer;
pub use group::{is_no_decay, split_decay, DecaySplit, ParamGroup};
pub use lion::{Lion, LionConfig};
pub use lr::LearningRate;
pub use rule::{HyperParameter, Step, UpdateRule, Valid};
pub use scheduler::{LrScheduler, Schedule, SchedulerState};
pub use sgd::{Sgd, SgdConfig};
pub use state::OptimizerState;

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::Var;

use crate::error::{Error, Result};

/// An optimizer over named parameters, with state that can be saved and restored.
pub trait Optimizer {
    /// One update of every parameter that has a gradient in `grads` (by name); others are skipped.
    fn step(&mut self, grads: Gradients<'_>) -> Result<()>;

    /// The learning-rate handle this optimizer reads at every step (clone it for a scheduler).
    fn learning_rate(&self) -> &LearningRate;

    /// The parameters, sorted by name.
    fn params(&self) -> &[(String, Var)];

    /// A deep copy of the state (moments, buffers, step counts, hyper-parameters), on the CPU.
    fn state(&self) -> Result<OptimizerState>;

    /// Replaces the state with `state` (hyper-parameters and learning rate included, as PyTorch's
    /// `load_state_dict` does). Kind, parameter names and shapes are checked first: on a mismatch it
    /// returns an error and the optimizer is unchanged.
    fn load_state(&mut self, state: &OptimizerState) -> Result<()>;

    /// Mixed precision: from now on, every step also writes each parameter it updates into that
    /// parameter's half-precision compute copy, `copies[name]` (a bf16 or f16 `Var` of the
    /// parameter's shape, on its device), rounded to nearest-even as candle's `to_dtype` rounds,
    /// in the same pass over the data as the update itself. Under ZeRO only the parameter's piece
    /// of the copy is written. Parameters not named in `copies` get no copy; a later call replaces
    /// the earlier one.
    ///
    /// `prepare` calls this under `mixed_precision(bf16)` or `(fp16)`, and after every step casts
    /// the masters into the compute copies the step did not write whole
    /// ([`wrote_compute_copy`](Self::wrote_compute_copy)). The default keeps no copies, so that
    /// any optimizer works: the runtime then casts every compute copy after the step.
    fn set_compute_copies(&mut self, copies: &[(String, Var)]) -> Result<()> {
        let _ = copies;
        Ok(())
    }

    /// Whether the last [`step`](Self::step) wrote the whole compute copy of parameter `name`
    /// (one given to [`set_compute_copies`](Self::set_compute_copies)) from its updated value. The
    /// default, for optimizers that keep no copies: `false`.
    fn wrote_compute_copy(&self, name: &str) -> bool {
        let _ = name;
        false
    }

    /// ZeRO: from now on keep state for, and update, only `pieces[name]` (a range of the
    /// flattened elements) of each parameter, reading its gradient with
    /// [`Gradients::piece`]; a parameter absent from `pieces` is not updated here (another
    /// rank owns it) but, when it has a gradient, its step count advances. [`state`](Self::state)
    /// then holds 1-D pieces and [`load_state`](Self::load_state) expects them. `prepare` calls
    /// this under `zero_stage(1)` or `(2)`. The default refuses: an optimizer whose state cannot
    /// be cut into pieces cannot be sharded.
    fn shard(&mut self, pieces: &BTreeMap<String, Range<usize>>) -> Result<()> {
        let _ = pieces;
        Err(Error::Config(
            "this optimizer cannot be sharded by ZeRO (its state cannot be cut into pieces); use \
             accelerate_core::optim::AdamW, Sgd or Lion, or zero_stage(0)"
                .into(),
        ))
    }
}

/// Fails with a PyTorch-style message unless `ok`.
fn require(ok: bool, what: &str, value: f64, rule: &str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Optimizer(format!("invalid {what} {value}: {rule}")))
    }
}

#[cfg(test)]
mod test_util;

/// A boxed optimizer is an optimizer, so that a program can pick one at run time (e.g. from a
/// flag) and prepare it like any other: every method forwards to the boxed one, defaults
/// included, since the boxed type may override them.
impl Optimizer for Box<dyn Optimizer + Send> {
    fn step(&mut self, grads: Gradients<'_>) -> Result<()> {
        (**self).step(grads)
    }

    fn learning_rate(&self) -> &LearningRate {
        (**self).learning_rate()
    }

    fn params(&self) -> &[(String, Var)] {
        (**self).params()
    }

    fn state(&self) -> Result<OptimizerState> {
        (**self).state()
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        (**self).load_state(state)
    }

    fn set_compute_copies(&mut self, copies: &[(String, Var)]) -> Result<()> {
        (**self).set_compute_copies(copies)
    }

    fn wrote_compute_copy(&self, name: &str) -> bool {
        (**self).wrote_compute_copy(name)
    }

    fn shard(&mut self, pieces: &BTreeMap<String, Range<usize>>) -> Result<()> {
        (**self).shard(pieces)
    }
}
