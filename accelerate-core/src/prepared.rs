//! The wrappers `Accelerator::prepare` returns. They keep the calls a loop already makes
//! (`optimizer.step()`, `optimizer.zero_grad()`, `scheduler.step()`) and turn them into no-ops on
//! the micro-steps where gradients do not sync, like Accelerate's `AcceleratedOptimizer` and
//! `AcceleratedScheduler`.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::accumulate::Accumulation;
use crate::data::LoaderProgress;
use crate::error::{Error, Result};
use crate::grads::GradientBuffers;
use crate::optim::{LearningRate, LrScheduler, Optimizer, OptimizerState, SchedulerState};

/// State shared by the `Accelerator` and the objects it prepared (one training process is one
/// thread of control; the mutexes only make the objects `Send`).
#[derive(Debug)]
pub(crate) struct TrainingState {
    pub accumulation: Mutex<Accumulation>,
    pub grads: Mutex<Option<GradientBuffers>>,
    /// Progress of every prepared loader; the one in use decides where an epoch's last window
    /// ends.
    pub loaders: Mutex<Vec<Arc<LoaderProgress>>>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere in the loop poisons nothing we cannot keep using.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An optimizer that steps only when gradients sync.
pub struct PreparedOptimizer<O> {
    inner: O,
    shared: Arc<TrainingState>,
}

impl<O: Optimizer> PreparedOptimizer<O> {
    pub(crate) fn new(inner: O, shared: Arc<TrainingState>) -> Self {
        Self { inner, shared }
    }

    /// Updates the parameters from the window's accumulated (and, across ranks, averaged)
    /// gradients; does nothing on a micro-step that does not sync.
    pub fn step(&mut self) -> Result<()> {
        let mut acc = lock(&self.shared.accumulation);
        if !acc.sync_gradients() {
            return Ok(());
        }
        let grads = lock(&self.shared.grads);
        let grads = grads.as_ref().ok_or_else(|| {
            Error::Optimizer(
                "optimizer.step() before any gradient: call accelerator.backward(loss) first"
                    .into(),
            )
        })?;
        self.inner.step(grads)?;
        acc.optimizer_steps += 1;
        acc.step_was_skipped = false;
        acc.optimizer_stepped = true;
        Ok(())
    }

    /// Forgets the accumulated gradients; does nothing on a micro-step that does not sync (the
    /// window's gradients are still being summed).
    pub fn zero_grad(&mut self) {
        if lock(&self.shared.accumulation).sync_gradients() {
            if let Some(g) = lock(&self.shared.grads).as_mut() {
                g.zero();
            }
        }
    }

    /// Whether the last sync micro-step skipped its update (fp16 overflow).
    pub fn step_was_skipped(&self) -> bool {
        lock(&self.shared.accumulation).step_was_skipped
    }

    /// The current learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.inner.learning_rate().get()
    }

    /// The optimizer's shared learning-rate handle, to build a scheduler from.
    pub fn learning_rate_handle(&self) -> LearningRate {
        self.inner.learning_rate().clone()
    }

    /// The optimizer's savable state.
    pub fn state(&self) -> Result<OptimizerState> {
        self.inner.state()
    }

    /// Restores a state saved by [`state`](Self::state).
    pub fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        self.inner.load_state(state)
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The wrapped optimizer, mutably.
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// Unwraps the optimizer.
    pub fn into_inner(self) -> O {
        self.inner
    }
}

/// A learning-rate scheduler that advances once per optimizer step, not per micro-step, and not
/// when the step was skipped.
///
/// Accelerate steps its scheduler `num_processes` times per optimizer step so that schedules sized
/// from the unsharded loader line up; we count optimizer steps, so size `total_steps` with
/// `Accelerator::num_update_steps`.
pub struct PreparedScheduler {
    inner: LrScheduler,
    shared: Arc<TrainingState>,
}

impl PreparedScheduler {
    pub(crate) fn new(inner: LrScheduler, shared: Arc<TrainingState>) -> Self {
        Self { inner, shared }
    }

    /// Advances the schedule if the optimizer stepped in this micro-step (not on micro-steps that
    /// only accumulate, nor when the step was skipped or not taken).
    pub fn step(&mut self) {
        let acc = lock(&self.shared.accumulation);
        if acc.optimizer_stepped && !acc.step_was_skipped {
            self.inner.step();
        }
    }

    /// The learning rate set by the last step.
    pub fn last_lr(&self) -> f64 {
        self.inner.last_lr()
    }

    /// Optimizer steps counted so far.
    pub fn steps(&self) -> usize {
        self.inner.steps()
    }

    /// The scheduler's savable state.
    pub fn state(&self) -> SchedulerState {
        self.inner.state()
    }

    /// Restores a state saved by [`state`](Self::state).
    pub fn load_state(&mut self, state: &SchedulerState) -> Result<()> {
        self.inner.load_state(state)
    }

    /// The wrapped scheduler.
    pub fn inner(&self) -> &LrScheduler {
        &self.inner
    }
}
