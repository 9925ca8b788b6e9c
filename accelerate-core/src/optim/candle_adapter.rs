//! candle-nn's optimizers (`candle_nn::SGD`, `candle_nn::AdamW`, or any type implementing
//! `candle_nn::Optimizer`) as an [`Optimizer`], so that they go through `Accelerator::prepare` and
//! step with the accelerator's averaged gradients, only on the micro-steps that sync.

use candle_core::backprop::GradStore;
use candle_core::Var;

use super::Gradients;
use super::{LearningRate, Optimizer, OptimizerState};
use crate::error::{Error, Result};

/// A candle-nn optimizer over named parameters.
///
/// At every step it builds the `GradStore` candle-nn's optimizers read (keyed by tensor) from the
/// accelerator's gradient buffers, for its own parameters, and sets the candle-nn optimizer's
/// learning rate from the [`LearningRate`] handle first, so schedulers drive it as they drive
/// ours. One parameter group.
///
/// Its state cannot be saved: candle-nn keeps AdamW's moments private, and a resume that silently
/// restarted them would not be the run that was saved. [`state`](Optimizer::state) and
/// [`load_state`](Optimizer::load_state) (hence `Accelerator::save_state` with it prepared) fail
/// with an error naming the adapter; use [`AdamW`](super::AdamW) or [`Sgd`](super::Sgd), the same
/// updates with savable state, to checkpoint.
pub struct CandleOptimizer<O> {
    inner: O,
    params: Vec<(String, Var)>,
    lr: LearningRate,
}

impl<O: candle_nn::Optimizer> CandleOptimizer<O> {
    /// The candle-nn optimizer `O` with `config` over `params` (sorted by name here; names must be
    /// unique), as `O::new(vars, config)` would build it.
    pub fn new(params: Vec<(String, Var)>, config: O::Config) -> Result<Self> {
        if params.is_empty() {
            return Err(Error::Optimizer(format!(
                "{} got an empty parameter list; pass the Vec returned by prepare",
                Self::name()
            )));
        }
        let params = crate::grads::sorted_named_vars(params)?;
        let inner = O::new(params.iter().map(|(_, v)| v.clone()).collect(), config)?;
        let lr = LearningRate::new(inner.learning_rate());
        Ok(Self { inner, params, lr })
    }

    /// The wrapped candle-nn optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The adapter's name in messages, with the candle-nn type it wraps.
    fn name() -> String {
        format!("CandleOptimizer<{}>", std::any::type_name::<O>())
    }

    fn refuse_state(&self, what: &str) -> Error {
        Error::Optimizer(format!(
            "{} cannot {what} its state: candle-nn keeps its optimizers' state (AdamW's moments) \
             private, so a checkpoint could not resume it; to save and load checkpoints, use \
             accelerate_core::optim::AdamW or Sgd (the same updates, with savable state)",
            Self::name()
        ))
    }
}

impl<O: candle_nn::Optimizer> Optimizer for CandleOptimizer<O> {
    fn step(&mut self, grads: Gradients<'_>) -> Result<()> {
        let mut store = GradStore::default();
        for (name, var) in &self.params {
            if let Some(grad) = grads.get(name) {
                let grad = grad.to_device(var.device())?.to_dtype(var.dtype())?;
                store.insert(var.as_tensor(), grad);
            }
        }
        self.inner.set_learning_rate(self.lr.get());
        self.inner.step(&store)?;
        Ok(())
    }

    lr_and_params_accessors!();

    fn state(&self) -> Result<OptimizerState> {
        Err(self.refuse_state("save"))
    }

    fn load_state(&mut self, _state: &OptimizerState) -> Result<()> {
        Err(self.refuse_state("load"))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;
    use crate::optim::test_util::{assert_close, buffers, named, values};

    #[test]
    fn candle_sgd_steps_from_our_buffers_at_the_handles_rate() {
        let mut opt = CandleOptimizer::<candle_nn::SGD>::new(
            named(&[("b", &[1.0, 2.0]), ("a", &[0.5])], DType::F32),
            0.1,
        )
        .unwrap();
        assert_eq!(opt.learning_rate().get(), 0.1);
        // p -= lr · g, and a parameter without gradient stays.
        opt.step(buffers(opt.params(), &[("b", &[1.0, -2.0])]).gradients())
            .unwrap();
        assert_close(&values(&opt.params()[1].1), &[0.9, 2.2], 1e-7, "b");
        assert_eq!(values(&opt.params()[0].1), vec![0.5]);
        // A scheduler's rate reaches candle-nn's optimizer.
        opt.learning_rate().set(1.0);
        opt.step(buffers(opt.params(), &[("a", &[0.25])]).gradients())
            .unwrap();
        assert_close(&values(&opt.params()[0].1), &[0.25], 1e-7, "a");
        assert_eq!(candle_nn::Optimizer::learning_rate(opt.inner()), 1.0);
    }

    #[test]
    fn candle_adamw_first_step_is_lr_times_sign() {
        // t = 1: m̂ = g, v̂ = g², so p -= lr · g / (|g| + eps) after p *= 1 - lr·wd.
        let config = candle_nn::ParamsAdamW {
            lr: 0.1,
            weight_decay: 0.0,
            ..Default::default()
        };
        let mut opt = CandleOptimizer::<candle_nn::AdamW>::new(
            named(&[("w", &[1.0, 1.0])], DType::F32),
            config,
        )
        .unwrap();
        opt.step(buffers(opt.params(), &[("w", &[0.5, -3.0])]).gradients())
            .unwrap();
        assert_close(&values(&opt.params()[0].1), &[0.9, 1.1], 1e-6, "w");
    }

    #[test]
    fn state_is_refused_naming_the_adapter() {
        let mut opt =
            CandleOptimizer::<candle_nn::SGD>::new(named(&[("w", &[1.0])], DType::F32), 0.1)
                .unwrap();
        let err = opt.state().unwrap_err().to_string();
        assert!(
            err.contains("CandleOptimizer<candle_nn::optim::SGD>") && err.contains("cannot save"),
            "{err}"
        );
        let err = opt
            .load_state(&OptimizerState::new("sgd"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cannot load") && err.contains("optim::AdamW"),
            "{err}"
        );
        assert!(CandleOptimizer::<candle_nn::SGD>::new(vec![], 0.1).is_err());
    }
}
