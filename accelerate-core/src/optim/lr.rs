//! The learning rates of an optimizer's parameter groups as a shared, settable value.
//!
//! An optimizer and the schedulers that drive it must agree on numbers that change every step.
//! PyTorch keeps them in `optimizer.param_groups[i]["lr"]`, which a scheduler mutates; here both
//! sides hold a clone of one [`LearningRate`] handle, with one rate per parameter group, so
//! neither needs a reference to the other.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};

/// Shared, settable learning rates, one per parameter group: the optimizer reads them at every
/// step, a scheduler writes them.
///
/// Clones share the values: a [`set`](Self::set) through one clone is seen by [`get`](Self::get)
/// on every other. An optimizer with one group (the common case) has a handle of one rate.
#[derive(Clone, Debug)]
pub struct LearningRate(Arc<[AtomicU64]>);

impl LearningRate {
    /// A new handle holding one rate, `lr`.
    pub fn new(lr: f64) -> Self {
        Self::per_group(&[lr])
    }

    /// A new handle holding one rate per parameter group, in group order. `rates` must not be
    /// empty (an optimizer has at least one group); an empty list holds the single rate 0.
    pub fn per_group(rates: &[f64]) -> Self {
        let rates: Vec<AtomicU64> = if rates.is_empty() {
            vec![AtomicU64::new(0f64.to_bits())]
        } else {
            rates.iter().map(|r| AtomicU64::new(r.to_bits())).collect()
        };
        Self(rates.into())
    }

    /// The rate of the first parameter group (the rate, with one group).
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0[0].load(Ordering::Acquire))
    }

    /// The rate of every parameter group, in group order.
    pub fn get_all(&self) -> Vec<f64> {
        self.0
            .iter()
            .map(|r| f64::from_bits(r.load(Ordering::Acquire)))
            .collect()
    }

    /// How many parameter groups this handle holds a rate for.
    pub fn groups(&self) -> usize {
        self.0.len()
    }

    /// Sets every group's rate to `lr`, for every clone of this handle.
    pub fn set(&self, lr: f64) {
        for r in self.0.iter() {
            r.store(lr.to_bits(), Ordering::Release);
        }
    }

    /// Sets each group's rate, in group order; `rates` must hold one rate per group.
    pub fn set_all(&self, rates: &[f64]) -> Result<()> {
        if rates.len() != self.0.len() {
            return Err(Error::Optimizer(format!(
                "got {} learning rates for an optimizer with {} parameter groups; give one rate \
                 per group, in group order",
                rates.len(),
                self.0.len()
            )));
        }
        for (r, v) in self.0.iter().zip(rates) {
            r.store(v.to_bits(), Ordering::Release);
        }
        Ok(())
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

    #[test]
    fn one_rate_per_group() {
        let a = LearningRate::per_group(&[0.1, 0.02]);
        let b = a.clone();
        assert_eq!(
            (a.groups(), a.get(), a.get_all()),
            (2, 0.1, vec![0.1, 0.02])
        );
        b.set_all(&[0.5, 0.25]).unwrap();
        assert_eq!(a.get_all(), vec![0.5, 0.25]);
        a.set(1.0);
        assert_eq!(b.get_all(), vec![1.0, 1.0]);
        let err = a.set_all(&[1.0]).unwrap_err().to_string();
        assert!(
            err.contains("1 learning rates") && err.contains("2 parameter groups"),
            "{err}"
        );
        assert_eq!(b.get_all(), vec![1.0, 1.0], "a refused set changes nothing");
    }
}
