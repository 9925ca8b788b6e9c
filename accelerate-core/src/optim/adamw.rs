//! AdamW (decoupled weight decay), as `torch.optim.AdamW`.
//!
//! Per parameter with a gradient `g`, at its own step `t` (counted from 1):
//! `p *= 1 - lr·wd; m = lerp(m, g, 1 - β1); v = β2·v + (1 - β2)·g²;
//! p -= (lr / (1 - β1^t)) · m / (sqrt(v) / sqrt(1 - β2^t) + eps)`.
//! That is PyTorch's numerical arrangement of `p -= lr·m̂ / (sqrt(v̂) + eps)`: the bias corrections
//! go into a scalar step size and a scalar divisor, `eps` stays outside the square root.

use candle_core::Tensor;

use super::kernels::{self, AdamWCoefficients};
use super::{ElementwiseOptimizer, Step, UpdateRule};
use crate::error::Result;

/// Hyper-parameters of [`AdamW`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (the initial value of the optimizer's [`LearningRate`](super::LearningRate) handle).
    pub lr: f64,
    /// Decay rate of the first moment, in `[0, 1)`.
    pub beta1: f64,
    /// Decay rate of the second moment, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the denominator, outside the square root.
    pub eps: f64,
    /// Decoupled weight decay: `p *= 1 - lr·weight_decay` before the Adam update.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// AdamW with PyTorch semantics over named parameters; see the module documentation for the
/// update. `AdamW::new(params, AdamWConfig { .. })` builds one.
pub type AdamW = ElementwiseOptimizer<AdamWConfig>;

impl AdamWConfig {
    /// The scalars of the update at learning rate `lr` and step `step` (from 1).
    fn coefficients(&self, lr: f64, step: u64) -> AdamWCoefficients {
        AdamWCoefficients::new(
            lr,
            self.beta1,
            self.beta2,
            self.eps,
            self.weight_decay,
            step,
        )
    }
}

impl UpdateRule for AdamWConfig {
    const KIND: &'static str = "adamw";
    const NAME: &'static str = "AdamW";
    const COUNTS_STEPS: bool = true;

    super::rule::hyper_parameters! {
        /// PyTorch's ranges, plus finiteness.
        lr: NonNegative, beta1: BelowOne, beta2: BelowOne,
        eps: NonNegative, weight_decay: NonNegative
    }

    fn state_names(&self) -> &'static [&'static str] {
        &["exp_avg", "exp_avg_sq"]
    }

    fn f32_kernel(&self, at: Step) -> impl Fn(&mut [f32], &[f32], &mut [&mut [f32]]) + Sync {
        let c = self.coefficients(at.lr, at.count);
        move |p, g, state| match state {
            [exp_avg, exp_avg_sq] => kernels::adamw(p, g, exp_avg, exp_avg_sq, &c),
            _ => unreachable!("AdamW keeps two state tensors per parameter"),
        }
    }

    fn update_tensors(&self, p: &Tensor, g: &Tensor, s: &mut [Tensor], at: Step) -> Result<Tensor> {
        let Step { lr, count, .. } = at;
        let [exp_avg, exp_avg_sq] = s else {
            unreachable!("AdamW keeps two state tensors per parameter")
        };
        let p = (p * (1.0 - lr * self.weight_decay))?;
        // lerp(m, g, 1 - β1) = m + (1 - β1)(g - m)
        *exp_avg = (&*exp_avg + ((g - &*exp_avg)? * (1.0 - self.beta1))?)?;
        *exp_avg_sq = ((&*exp_avg_sq * self.beta2)? + (g.sqr()? * (1.0 - self.beta2))?)?;
        let t = count as f64;
        let step_size = lr / (1.0 - self.beta1.powf(t));
        let bias_correction2_sqrt = (1.0 - self.beta2.powf(t)).sqrt();
        let denom = ((exp_avg_sq.sqrt()? / bias_correction2_sqrt)? + self.eps)?;
        Ok((p - ((&*exp_avg / &denom)? * step_size)?)?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_update(&self, at: Step) -> Option<super::CudaUpdate> {
        let c = self.coefficients(at.lr, at.count);
        let small_weight = if c.one_minus_beta1.abs() < 0.5 {
            1.0
        } else {
            0.0
        };
        Some(super::CudaUpdate {
            kernel: super::cuda_kernels::Kernel::AdamW,
            scalars: [
                c.decay,
                c.one_minus_beta1,
                c.beta2,
                c.one_minus_beta2,
                c.step_size,
                c.bias_correction2_sqrt,
                c.eps,
                small_weight,
            ],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::test_util::prelude::*;

    /// AdamW as published (Loshchilov & Hutter, in PyTorch's formulation), one scalar at a
    /// time in f64: `p *= 1 - lr·wd; m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²;
    /// p -= lr · (m / (1-β1^t)) / (sqrt(v / (1-β2^t)) + eps)`.
    // Indexed loops on purpose: the formula is written out element by element.
    #[allow(clippy::needless_range_loop)]
    fn reference(c: AdamWConfig, mut p: Vec<f64>) -> Reference {
        let (mut m, mut v, mut t) = (vec![0.0; p.len()], vec![0.0; p.len()], 0);
        Box::new(move |g| {
            t += 1;
            for i in 0..p.len() {
                p[i] *= 1.0 - c.lr * c.weight_decay;
                m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g[i];
                v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * g[i] * g[i];
                let m_hat = m[i] / (1.0 - c.beta1.powi(t));
                let v_hat = v[i] / (1.0 - c.beta2.powi(t));
                p[i] -= c.lr * m_hat / (v_hat.sqrt() + c.eps);
            }
            p.clone()
        })
    }

    crate::optim::conformance::suite! {
        AdamWConfig, tolerance: (f32 2e-6, f64 1e-12), reference: reference,
        configs: [
            ("no weight decay", |c| (c.lr, c.weight_decay) = (0.05, 0.0)),
            ("weight decay", |c| (c.lr, c.weight_decay) = (0.02, 0.1)),
            ("beta1 0.8", |c| {
                (c.lr, c.beta1, c.beta2, c.eps, c.weight_decay) = (0.02, 0.8, 0.95, 1e-6, 0.3)
            }),
            // Weight 1 - beta1 >= 0.5: the other branch of PyTorch's lerp.
            ("beta1 0.3", |c| {
                (c.lr, c.beta1, c.beta2, c.eps, c.weight_decay) = (0.02, 0.3, 0.95, 1e-6, 0.3)
            }),
        ],
        stateful: |c| (c.lr, c.weight_decay) = (0.03, 0.1),
        refused: [
            (|c| c.lr = -1e-3, "learning rate"),
            (|c| c.beta1 = 1.0, "beta1"),
            (|c| c.beta2 = -0.1, "beta2"),
            (|c| c.eps = -1.0, "eps"),
            (|c| c.weight_decay = f64::NAN, "weight_decay"),
        ],
    }

    #[test]
    fn first_step_by_hand() {
        // t = 1: m̂ = g, v̂ = g², so p -= lr · g / (|g| + eps) ≈ lr · sign(g); decay first.
        for (wd, expected) in [
            (0.0, 1.0 - 0.1 * 0.5 / (0.5 + 1e-8)),
            (0.01, 0.999 - 0.1 * 0.5 / (0.5 + 1e-8)),
        ] {
            let config = AdamWConfig {
                lr: 0.1,
                weight_decay: wd,
                ..AdamWConfig::default()
            };
            let mut opt = AdamW::new(named(&[("w", &[1.0])], DType::F32), config).unwrap();
            opt.step(buffers(opt.params(), &[("w", &[0.5])]).gradients())
                .unwrap();
            assert_close(&values(&opt.params()[0].1), &[expected], 1e-6, "w");
        }
    }

    #[test]
    fn default_config_is_pytorchs() {
        assert_eq!(
            AdamWConfig::default(),
            AdamWConfig {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01
            }
        );
    }
}
