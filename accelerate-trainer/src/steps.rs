//! The optimizer steps of a training loop on the [`Accelerator`], shared by the [`Trainer`] and
//! the hand-written loops of the examples: how many steps a run takes, and one micro-batch's part
//! of a step.
//!
//! [`Trainer`]: crate::Trainer

use accelerate_core::optim::Optimizer;
use accelerate_core::{Accelerator, MicroStep, PreparedOptimizer, PreparedScheduler};
use candle_core::Tensor;

/// Optimizer steps of a whole run, given the optimizer steps of one epoch: `max_steps` when set,
/// whatever `epochs` says, else `ceil(epochs × steps_per_epoch)`. This is transformers' rule: its
/// `max_steps` overrides `num_train_epochs` (the run goes through as many epochs as the steps
/// take, and the learning-rate schedule spans them), and a fractional epoch count stops part-way
/// through the last epoch.
pub fn run_steps(max_steps: Option<u64>, epochs: f64, steps_per_epoch: u64) -> u64 {
    match max_steps {
        Some(steps) => steps,
        None => (epochs * steps_per_epoch as f64).ceil() as u64,
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_steps_overrides_the_epochs_and_fractional_epochs_round_up() {
        assert_eq!(run_steps(Some(300), 3.0, 126), 300);
        assert_eq!(run_steps(Some(5), 3.0, 126), 5);
        assert_eq!(run_steps(None, 3.0, 126), 378);
        // 2.5 epochs of 5 steps: 12.5, rounded up as transformers' math.ceil.
        assert_eq!(run_steps(None, 2.5, 5), 13);
    }
}
