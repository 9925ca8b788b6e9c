//! The wrappers `Accelerator::prepare` returns. They keep the calls a loop already makes
//! (`optimizer.step()`, `optimizer.zero_grad()`, `scheduler.step()`) and turn them into no-ops on
//! the micro-steps where gradients do not sync, like Accelerate's `AcceleratedOptimizer` and
//! `AcceleratedScheduler`.

use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use crate::error::{Error, Result};
use crate::optim::{LearningRate, LrScheduler, Optimizer, OptimizerState, SchedulerState};
use crate::training::{lock, SharedOptimizer, TrainingState};

/// An optimizer that steps only when gradients sync.
///
/// The handle owns the optimizer: the loop reaches it only through the handle's calls, each of
/// which locks it for its own length (the lock exists so that the accelerator can save and
/// restore its state, `Accelerator::save_state`, without the loop handing it over). A call made
/// while the optimizer is lent to a closure ([`with_inner`](Self::with_inner)) fails with an
/// error naming the re-entry instead of waiting forever; the learning rate is readable anywhere.
pub struct PreparedOptimizer<O> {
    inner: Arc<Mutex<O>>,
    /// The optimizer's own handle (clones share the values), so that reading the rate takes no
    /// lock.
    learning_rate: LearningRate,
    training: Arc<TrainingState>,
}

impl<O: Optimizer + Send + 'static> PreparedOptimizer<O> {
    pub(crate) fn new(inner: O, training: Arc<TrainingState>) -> Self {
        let learning_rate = inner.learning_rate().clone();
        let inner = Arc::new(Mutex::new(inner));
        let registered: SharedOptimizer = inner.clone();
        training.register_optimizer(registered);
        Self {
            inner,
            learning_rate,
            training,
        }
    }
}

impl<O: Optimizer> PreparedOptimizer<O> {
    /// Updates the parameters from the window's accumulated (and, across ranks, averaged)
    /// gradients; does nothing on a micro-step that does not sync. Under fp16, a window whose
    /// gradients overflowed is skipped instead (its gradients are dropped; see
    /// [`step_was_skipped`](Self::step_was_skipped)); under mixed precision the model's compute
    /// copies take the updated master weights.
    pub fn step(&mut self) -> Result<()> {
        self.training.step_optimizer(&self.inner)
    }

    /// Forgets the accumulated gradients; does nothing on a micro-step that does not sync (the
    /// window's gradients are still being summed).
    pub fn zero_grad(&mut self) {
        self.training.zero_grad();
    }

    /// Whether the last sync micro-step skipped its update (fp16 overflow).
    pub fn step_was_skipped(&self) -> bool {
        self.training.step_was_skipped()
    }

    /// The current learning rate (of the first parameter group; `learning_rate_handle().get_all()`
    /// has every group's).
    pub fn learning_rate(&self) -> f64 {
        self.learning_rate.get()
    }

    /// The optimizer's training learning-rate handle, to build a scheduler from.
    pub fn learning_rate_handle(&self) -> LearningRate {
        self.learning_rate.clone()
    }

    /// The optimizer's savable state.
    pub fn state(&self) -> Result<OptimizerState> {
        self.lent("state()")?.state()
    }

    /// Restores a state saved by [`state`](Self::state).
    pub fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        self.lent("load_state()")?.load_state(state)
    }

    /// Lends the wrapped optimizer to `read` and returns what it returns
    /// (`opt.with_inner(|o| o.group_configs())`). The optimizer is locked only while `read`
    /// runs, and `read` cannot step it: [`step`](Self::step) takes `&mut self`, which the borrow
    /// checker refuses while `with_inner` borrows the handle. Inside `read`, the handle's other
    /// calls that need the optimizer (`state`, `with_inner`) and `Accelerator::save_state` or
    /// `load_state` fail with an error naming the re-entry; read what you need from `read`'s
    /// argument instead.
    ///
    /// # Errors
    /// If called inside another [`with_inner`](Self::with_inner) of the same optimizer.
    pub fn with_inner<R>(&self, read: impl FnOnce(&O) -> R) -> Result<R> {
        Ok(read(&*self.lent("with_inner()")?))
    }

    /// Lends the wrapped optimizer to `change` to change it in place (a hyper-parameter, say),
    /// locked only while `change` runs; as with [`with_inner`](Self::with_inner), `change`
    /// cannot step it.
    ///
    /// # Errors
    /// If the optimizer is already lent (see [`with_inner`](Self::with_inner)).
    pub fn with_inner_mut<R>(&mut self, change: impl FnOnce(&mut O) -> R) -> Result<R> {
        Ok(change(&mut *self.lent("with_inner_mut()")?))
    }

    /// The optimizer, locked for one call; an error instead of a wait if it is lent already
    /// (`call` names the call that re-entered). The handle is not `Sync` and the accelerator
    /// locks it only inside its own calls, so a held lock here can only be this thread's.
    fn lent(&self, call: &str) -> Result<MutexGuard<'_, O>> {
        match self.inner.try_lock() {
            Ok(guard) => Ok(guard),
            Err(TryLockError::Poisoned(poisoned)) => Ok(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => Err(Error::Optimizer(format!(
                "PreparedOptimizer::{call} while the optimizer is lent to a with_inner closure: \
                 read what you need from the closure's argument, or call it after the closure \
                 returns"
            ))),
        }
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
    training: Arc<TrainingState>,
}

impl PreparedScheduler {
    pub(crate) fn new(inner: LrScheduler, training: Arc<TrainingState>) -> Self {
        let inner = Arc::new(Mutex::new(inner));
        training.register_scheduler(inner.clone());
        Self { inner, training }
    }

    /// Advances the schedule if the optimizer stepped in this micro-step (not on micro-steps that
    /// only accumulate, nor when the step was skipped or not taken).
    pub fn step(&mut self) {
        self.training.step_scheduler(&self.inner);
    }

    /// The learning rate set by the last step (of the first parameter group; `inner().last_lrs()`
    /// has every group's).
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

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use crate::optim::{Sgd, SgdConfig};
    use crate::Accelerator;

    /// Calls that need the optimizer, made while it is lent to a `with_inner` closure, fail with
    /// an error naming the re-entry (a plain lock would wait forever on this thread), and work
    /// again once the closure has returned.
    #[test]
    fn reentry_inside_with_inner_is_an_error_not_a_hang() {
        let mut acc = Accelerator::builder().build().unwrap();
        let w = Var::from_tensor(&Tensor::ones(4, DType::F32, &Device::Cpu).unwrap()).unwrap();
        let params = acc.prepare(vec![("w".to_string(), w)]).unwrap();
        let opt = acc
            .prepare(Sgd::new(params, SgdConfig::default()).unwrap())
            .unwrap();
        let dir = tempfile::tempdir().unwrap();

        let (state, nested, saved, lr) = opt
            .with_inner(|_| {
                (
                    opt.state(),
                    opt.with_inner(|_| ()),
                    acc.save_state(dir.path().join("inside")),
                    opt.learning_rate(),
                )
            })
            .unwrap();
        for (what, err) in [
            ("state", state.err()),
            ("with_inner", nested.err()),
            ("save_state", saved.err()),
        ] {
            let message = err.unwrap_or_else(|| panic!("{what} inside with_inner succeeded"));
            assert!(
                message.to_string().contains("with_inner"),
                "{what}: {message}"
            );
        }
        assert_eq!(lr, SgdConfig::default().lr);

        assert!(opt.state().is_ok());
        acc.save_state(dir.path().join("after")).unwrap();
    }
}
