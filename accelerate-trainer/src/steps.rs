//! The optimizer steps of a training loop on the [`Accelerator`], shared by the [`Trainer`] and
//! the hand-written loops of the examples: one micro-batch's part of a step.
//!
//! [`Trainer`]: crate::Trainer

use accelerate_core::optim::Optimizer;
use accelerate_core::{Accelerator, MicroStep, PreparedOptimizer, PreparedScheduler};
use candle_core::Tensor;

/// What [`micro_step`] did.
#[derive(Debug, Clone)]
pub struct MicroStepDone {
    /// The micro-step: whether it synced (and so stepped the optimizer), and its loss scale.
    pub step: MicroStep,
    /// The loss the backward pass ran on.
    pub loss: Tensor,
    /// The learning rate of the optimizer step, read before the scheduler moved it.
    pub lr: f64,
    /// The gradient's global norm before clipping, on the micro-step that synced when it clipped.
    pub grad_norm: Option<f64>,
}

/// One micro-batch's part of an optimizer step, as every loop on the [`Accelerator`] takes it:
/// begins the micro-step, computes its loss with `loss` (after `accumulate`, so that a model
/// drawing dropout masks sees the micro-step begun), runs the backward pass, clips the gradient
/// to `max_grad_norm` on the micro-step that syncs (the only one where the gradient is whole),
/// then steps the optimizer and the scheduler and clears the gradients: all three do nothing on
/// micro-steps that do not sync, so the caller need not tell them apart.
pub fn micro_step<O, E>(
    acc: &Accelerator,
    opt: &mut PreparedOptimizer<O>,
    sched: &mut PreparedScheduler,
    max_grad_norm: Option<f64>,
    loss: impl FnOnce() -> Result<Tensor, E>,
) -> Result<MicroStepDone, E>
where
    O: Optimizer,
    E: From<accelerate_core::Error>,
{
    let step = acc.accumulate();
    let loss = loss()?;
    acc.backward(&loss)?;
    let grad_norm = match max_grad_norm {
        Some(max) if step.sync => acc.clip_grad_norm(max)?,
        _ => None,
    };
    let lr = opt.learning_rate();
    opt.step()?;
    sched.step();
    opt.zero_grad();
    Ok(MicroStepDone {
        step,
        loss,
        lr,
        grad_norm,
    })
}
