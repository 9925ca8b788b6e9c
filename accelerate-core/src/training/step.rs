//! Where the optimizer steps: on the micro-step that syncs, a window whose fp16 gradients
//! overflowed is skipped (its gradients dropped); otherwise `Optimizer::step` updates the
//! parameters from the averaged gradients, ZeRO gathers the updated shards, the compute copies
//! take the new master weights, and the step is counted. The scheduler advances only after a
//! step taken; `zero_grad` forgets the window's gradients.

use std::sync::Mutex;

use super::{lock, TrainingState};
use crate::error::{Error, Result};
use crate::optim::{LrScheduler, Optimizer};

impl TrainingState {
    /// Steps `optimizer` from the window's averaged gradients on the micro-step that syncs (a
    /// no-op elsewhere). Under fp16 a window whose gradients overflowed is skipped and its
    /// gradients dropped; under mixed precision the compute copies take the updated masters.
    pub fn step_optimizer<O: Optimizer + ?Sized>(&self, optimizer: &Mutex<O>) -> Result<()> {
        let mut guard = self.steps();
        let steps = &mut *guard;
        if !steps.sync_now() {
            return Ok(());
        }
        let grads = steps.grads.as_mut().ok_or_else(|| {
            Error::Optimizer(
                "optimizer.step() before any gradient: call accelerator.backward(loss) first"
                    .into(),
            )
        })?;
        if steps.mixed.window_overflowed {
            // PyTorch's GradScaler.step: no update, and the scheduler does not advance either.
            grads.zero();
            steps.accumulation.record_skipped_step();
            return Ok(());
        }
        if let Some(fsdp) = &steps.fsdp {
            // Kept gathered units would go stale with the update.
            fsdp.release_gathered();
        }
        let mut optimizer = lock(optimizer);
        optimizer.step(grads.gradients())?;
        if let Some(zero) = &steps.zero {
            zero.gather_parameters(self.parameters())?;
        }
        // The compute copies the update wrote in its own pass are fresh; the others are cast.
        steps
            .mixed
            .refresh_compute_except(|name| optimizer.wrote_compute_copy(name))?;
        drop(optimizer);
        steps.accumulation.record_optimizer_step();
        Ok(())
    }

    /// Forgets the window's gradients on the micro-step that syncs (a no-op elsewhere: the
    /// window's gradients are still being summed).
    pub fn zero_grad(&self) {
        let mut steps = self.steps();
        if steps.sync_now() {
            steps.zero_gradients();
        }
    }

    /// Advances `scheduler` if the optimizer stepped in this micro-step (not on micro-steps that
    /// only accumulate, nor when the step was skipped or not taken).
    pub fn step_scheduler(&self, scheduler: &Mutex<LrScheduler>) {
        let steps = self.steps();
        if steps.accumulation.scheduler_steps_now() {
            lock(scheduler).step();
        }
    }
}
