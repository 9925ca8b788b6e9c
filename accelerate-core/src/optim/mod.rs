//! Optimizers with inspectable, savable state, and learning-rate schedulers.
//!
//! [`Sgd`] and [`AdamW`] follow PyTorch's `torch.optim.SGD` and `torch.optim.AdamW` (single parameter
//! group, non-foreach) operation by operation. On the CPU with f32 tensors each parameter is updated
//! in one pass over its data, with no temporary tensors (candle-nn's AdamW allocates one per
//! elementwise operation and keeps its state private); other devices and dtypes use tensor ops.
//!
//! The learning rate lives in a shared [`LearningRate`] handle that the optimizer reads at every step
//! and an [`LrScheduler`] writes.

mod adamw;
#[cfg(feature = "cuda")]
mod cuda_kernels;
mod kernels;
mod lr;
mod scheduler;
mod sgd;
mod state;

pub use adamw::{AdamW, AdamWConfig};
pub use lr::LearningRate;
pub use scheduler::{LrScheduler, Schedule, SchedulerState};
pub use sgd::{Sgd, SgdConfig};
pub use state::OptimizerState;

use candle_core::{Tensor, Var};

use crate::error::{Error, Result};
use crate::grads::GradientBuffers;

/// An optimizer over named parameters, with state that can be saved and restored.
pub trait Optimizer {
    /// One update of every parameter that has a gradient in `grads` (by name); others are skipped.
    fn step(&mut self, grads: &GradientBuffers) -> Result<()>;

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
}

/// Sorts `params` by name and rejects duplicates and an empty list.
fn sorted_params(params: Vec<(String, Var)>, optimizer: &str) -> Result<Vec<(String, Var)>> {
    if params.is_empty() {
        return Err(Error::Optimizer(format!(
            "{optimizer} got an empty parameter list; pass the model's named variables \
             (e.g. from the VarMap the model was built with)"
        )));
    }
    crate::grads::sorted_named_vars(params)
}

/// The learning rate to use now, rejected if a scheduler or user set something meaningless.
fn current_lr(lr: &LearningRate) -> Result<f64> {
    let value = lr.get();
    if !(value.is_finite() && value >= 0.0) {
        return Err(Error::Optimizer(format!(
            "learning rate is {value}; it must be finite and >= 0 (check what set the \
             LearningRate handle: the optimizer config or a scheduler's base learning rate)"
        )));
    }
    Ok(value)
}

/// Checks that `grad` fits parameter `name`.
fn check_grad(name: &str, var: &Var, grad: &Tensor) -> Result<()> {
    if grad.shape() != var.shape() {
        return Err(Error::Optimizer(format!(
            "gradient of {name:?} has shape {:?} but the parameter has shape {:?}; the gradient \
             buffers were built for other parameters than the optimizer's",
            grad.dims(),
            var.dims()
        )));
    }
    Ok(())
}

/// Fails with a PyTorch-style message unless `ok`.
fn require(ok: bool, what: &str, value: f64, rule: &str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Optimizer(format!("invalid {what} {value}: {rule}")))
    }
}

/// Flattens one level of the `Result<Option<_>>` returned by nested `cpu_slices` calls: `Some`
/// only if every level ran.
fn nested<T>(r: Result<Option<Result<Option<T>>>>) -> Result<Option<T>> {
    Ok(r?.transpose()?.flatten())
}

/// A parameter's value as a plain tensor in `dtype`, outside the autograd graph.
fn detached(var: &Var, dtype: candle_core::DType) -> Result<Tensor> {
    Ok(var.as_tensor().detach().to_dtype(dtype)?)
}

/// Writes `value` (in any dtype) into the parameter.
fn write_param(var: &Var, value: &Tensor) -> Result<()> {
    var.set(&value.to_dtype(var.dtype())?)?;
    Ok(())
}

#[cfg(test)]
mod test_util;
