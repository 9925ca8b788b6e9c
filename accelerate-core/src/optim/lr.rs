//! The learning rate as a shared, settable value.
//!
//! An optimizer and the schedulers that drive it must agree on one number that changes every step.
//! PyTorch keeps it in `optimizer.param_groups[i]["lr"]`, which a scheduler mutates; here both sides
//! hold a clone of one [`LearningRate`] handle, so neither needs a reference to the other.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Shared, settable learning rate: the optimizer reads it at every step, a scheduler writes it.
///
/// Clones share the value: a [`set`](Self::set) through one clone is seen by [`get`](Self::get) on
/// every other.
#[derive(Clone, Debug)]
pub struct LearningRate(Arc<AtomicU64>);

impl LearningRate {
    /// A new handle holding `lr`.
    pub fn new(lr: f64) -> Self {
        Self(Arc::new(AtomicU64::new(lr.to_bits())))
    }

    /// The current value.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Acquire))
    }

    /// Replaces the value for every clone of this handle.
    pub fn set(&self, lr: f64) {
        self.0.store(lr.to_bits(), Ordering::Release);
    }

    /// Whether `other` is a clone of this handle (shares its value).
    pub(crate) fn shares_value_with(&self, other: &LearningRate) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_one_value() {
        let a = LearningRate::new(0.5);
        let b = a.clone();
        assert_eq!(b.get(), 0.5);
        b.set(1e-4);
        assert_eq!(a.get(), 1e-4);
        let c = LearningRate::new(0.5);
        c.set(3.0);
        assert_eq!(a.get(), 1e-4, "a separate handle does not share the value");
    }

    #[test]
    fn values_survive_exactly() {
        // The bits are stored, not a rounded decimal: every f64 comes back unchanged.
        for x in [0.0, 1e-300, 0.1 + 0.2, f64::MAX, 3.0e-5] {
            assert_eq!(LearningRate::new(x).get().to_bits(), x.to_bits());
        }
    }
}
