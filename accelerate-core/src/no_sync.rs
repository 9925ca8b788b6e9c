//! The `no_sync` guard ([`NoSync`]): a scope in which backward passes skip the all-reduce.
//!
//! It only counts live guards in the training state, which decides with that count whether a
//! micro-step syncs (`training.rs`); it is its own module so that the accumulation counters
//! (`window.rs`), which the training state uses, do not depend on the training state back.

use std::sync::Arc;

use crate::training::TrainingState;

/// A scope in which backward passes accumulate gradients locally, without averaging them across
/// ranks, whatever K says (Accelerate's `accelerator.no_sync(model)`, DDP's `no_sync()`); from
/// [`Accelerator::no_sync`](crate::Accelerator::no_sync) or
/// [`PreparedModel::no_sync`](crate::PreparedModel::no_sync). The first backward pass after the
/// guard is dropped that ends a window averages everything accumulated, as DDP does.
///
/// While it lives, no micro-step syncs: `sync_gradients()` is false, and the optimizer's `step`,
/// `zero_grad` and the clipping calls do nothing. Accelerate leaves stepping inside `no_sync` to
/// the user, where it would step each rank with its own unaveraged gradients and the replicas
/// would drift apart; here it cannot happen. The loss is still scaled by the window's 1/k: with
/// the default K of 1, that is 1, and a loop doing its own accumulation with the guard divides
/// its losses itself, as under Accelerate.
#[must_use = "the guard ends when dropped: `let _guard = accelerator.no_sync();`"]
#[derive(Debug)]
pub struct NoSync {
    training: Arc<TrainingState>,
}

impl NoSync {
    pub(crate) fn new(training: Arc<TrainingState>) -> Self {
        training.begin_no_sync();
        Self { training }
    }
}

impl Drop for NoSync {
    fn drop(&mut self) {
        self.training.end_no_sync();
    }
}
