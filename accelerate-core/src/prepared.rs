//! The wrappers `Accelerator::prepare` returns. They keep the calls a loop already makes
//! (`optimizer.step()`, `optimizer.zero_grad()`, `scheduler.step()`) and turn them into no-ops on
//! the micro-steps where gradients do not sync, like Accelerate's `AcceleratedOptimizer` and
//! `AcceleratedScheduler`.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::accumulate::Accumulation;
use crate::data::LoaderProgress;
use crate::error::{Error, Result};
use crate::grads::GradientBuffers;
use crate::mixed_precision::MixedPrecisionState;
use crate::optim::{LearningRate, LrScheduler, Optimizer, OptimizerState, SchedulerState};

/// A prepared optimizer as the accelerator keeps it, to save and restore its state.
pub(crate) type SharedOptimizer = Arc<Mutex<dyn Optimizer + Send>>;

/// State shared by the `Accelerator` and the objects it prepared (one training process is one
/// thread of control; the mutexes only make the objects `Send`).
pub(crate) struct TrainingState {
    pub accumulation: Mutex<Accumulation>,
    pub grads: Mutex<Option<GradientBuffers>>,
    /// Progress of every prepared loader; the one in use decides where an epoch's last window
    /// ends.
    pub loaders: Mutex<Vec<Arc<LoaderProgress>>>,
    /// Every prepared optimizer, in preparation order (what `save_state` saves as `optimizer_<i>`).
    pub optimizers: Mutex<Vec<SharedOptimizer>>,
    /// Every prepared scheduler, in preparation order.
    pub schedulers: Mutex<Vec<Arc<Mutex<LrScheduler>>>>,
    /// Master weights and the fp16 loss scaler.
    pub mixed: Mutex<MixedPrecisionState>,
}

impl std::fmt::Debug for TrainingState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainingState")
            .field("accumulation", &self.accumulation)
            .field("loaders", &lock(&self.loaders).len())
            .field("optimizers", &lock(&self.optimizers).len())
            .field("schedulers", &lock(&self.schedulers).len())
            .finish_non_exhaustive()
    }
}

pub(crate) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere in the loop poisons nothing we cannot keep using.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An optimizer that steps only when gradients sync.
///
/// The optimizer itself lives behind a shared lock so that the accelerator can save and restore
/// its state (`Accelerator::save_state`) without the loop handing it over.
pub struct PreparedOptimizer<O> {
    inner: Arc<Mutex<O>>,
    shared: Arc<TrainingState>,
}

impl<O: Optimizer + Send + 'static> PreparedOptimizer<O> {
    pub(crate) fn new(inner: O, shared: Arc<TrainingState>) -> Self {
        let inner = Arc::new(Mutex::new(inner));
        let registered: SharedOptimizer = inner.clone();
        lock(&shared.optimizers).push(registered);
        Self { inner, shared }
    }
}

impl<O: Optimizer> PreparedOptimizer<O> {
    /// Updates the parameters from the window's accumulated (and, across ranks, averaged)
    /// gradients; does nothing on a micro-step that does not sync. Under fp16, a window whose
    /// gradients overflowed is skipped instead (its gradients are dropped; see
    /// [`step_was_skipped`](Self::step_was_skipped)); under mixed precision the model's compute
    /// copies take the updated master weights.
    pub fn step(&mut self) -> Result<()> {
        let mut acc = lock(&self.shared.accumulation);
        if !acc.sync_gradients() {
            return Ok(());
        }
        let mut grads = lock(&self.shared.grads);
        let grads = grads.as_mut().ok_or_else(|| {
            Error::Optimizer(
                "optimizer.step() before any gradient: call accelerator.backward(loss) first"
                    .into(),
            )
        })?;
        let mixed = lock(&self.shared.mixed);
        if mixed.window_overflowed {
            // PyTorch's GradScaler.step: no update, and the scheduler does not advance either
            // (it follows `optimizer_stepped`, left false).
            grads.zero();
            acc.step_was_skipped = true;
            return Ok(());
        }
        lock(&self.inner).step(grads)?;
        mixed.refresh_compute()?;
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
        lock(&self.inner).learning_rate().get()
    }

    /// The optimizer's shared learning-rate handle, to build a scheduler from.
    pub fn learning_rate_handle(&self) -> LearningRate {
        lock(&self.inner).learning_rate().clone()
    }

    /// The optimizer's savable state.
    pub fn state(&self) -> Result<OptimizerState> {
        lock(&self.inner).state()
    }

    /// Restores a state saved by [`state`](Self::state).
    pub fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        lock(&self.inner).load_state(state)
    }

    /// The wrapped optimizer (locked while the guard lives; the accelerator locks it only inside
    /// `save_state`/`load_state`).
    pub fn inner(&self) -> MutexGuard<'_, O> {
        lock(&self.inner)
    }
}

/// A learning-rate scheduler that advances once per optimizer step, not per micro-step, and not
/// when the step was skipped.
///
/// Accelerate steps its scheduler `num_processes` times per optimizer step so that schedules sized
/// from the unsharded loader line up; we count optimizer steps, so size `total_steps` with
/// `Accelerator::num_update_steps`.
pub struct PreparedScheduler {
    inner: Arc<Mutex<LrScheduler>>,
    shared: Arc<TrainingState>,
}

impl PreparedScheduler {
    pub(crate) fn new(inner: LrScheduler, shared: Arc<TrainingState>) -> Self {
        let inner = Arc::new(Mutex::new(inner));
        lock(&shared.schedulers).push(inner.clone());
        Self { inner, shared }
    }

    /// Advances the schedule if the optimizer stepped in this micro-step (not on micro-steps that
    /// only accumulate, nor when the step was skipped or not taken).
    pub fn step(&mut self) {
        let acc = lock(&self.shared.accumulation);
        if acc.optimizer_stepped && !acc.step_was_skipped {
            lock(&self.inner).step();
        }
    }

    /// The learning rate set by the last step.
    pub fn last_lr(&self) -> f64 {
        lock(&self.inner).last_lr()
    }

    /// Optimizer steps counted so far.
    pub fn steps(&self) -> usize {
        lock(&self.inner).steps()
    }

    /// The scheduler's savable state.
    pub fn state(&self) -> SchedulerState {
        lock(&self.inner).state()
    }

    /// Restores a state saved by [`state`](Self::state).
    pub fn load_state(&mut self, state: &SchedulerState) -> Result<()> {
        lock(&self.inner).load_state(state)
    }

    /// The wrapped scheduler (a copy: the accelerator shares the original to save its state).
    pub fn inner(&self) -> LrScheduler {
        lock(&self.inner).clone()
    }
}
