//! Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), a rule of the
//! elementwise optimizer core.
//!
//! Per parameter with a gradient `g`: `c = β1·m + (1-β1)·g; p = p·(1 - lr·wd) - lr·sign(c);
//! m = β2·m + (1-β2)·g`, with `sign(0) = 0`. The moment `m` starts at zero and is saved as
//! `"exp_avg.<parameter>"`, as the authors' `lion-pytorch` names it.

use candle_core::Tensor;

use super::{ElementwiseOptimizer, Step, UpdateRule};
use crate::error::Result;

/// Hyper-parameters of [`Lion`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LionConfig {
    /// Learning rate (the initial value of the optimizer's [`LearningRate`](super::LearningRate)
    /// handle). Lion's update has the size of `lr` in every element, so it wants a rate 3-10×
    /// smaller than AdamW's.
    pub lr: f64,
    /// Weight of the moment in the update's direction `c`, in `[0, 1]`.
    pub beta1: f64,
    /// Decay rate of the moment, in `[0, 1]`.
    pub beta2: f64,
    /// Decoupled weight decay: `p *= 1 - lr·weight_decay` before the update.
    pub weight_decay: f64,
}

impl Default for LionConfig {
    /// The paper's (and `lion-pytorch`'s) defaults: lr 1e-4, betas (0.9, 0.99), no weight decay.
    fn default() -> Self {
        Self {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.0,
        }
    }
}

/// Lion over named parameters; see the module documentation for the update.
/// `Lion::new(params, LionConfig { .. })` builds one.
pub type Lion = ElementwiseOptimizer<LionConfig>;

/// The scalars of one Lion update, computed in f64 and rounded once.
#[derive(Debug, Clone, Copy)]
struct LionCoefficients {
    /// `1 - lr * weight_decay`.
    decay: f32,
    lr: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
}

impl LionConfig {
    fn coefficients(&self, lr: f64) -> LionCoefficients {
        LionCoefficients {
            decay: (1.0 - lr * self.weight_decay) as f32,
            lr: lr as f32,
            beta1: self.beta1 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
        }
    }
}

/// `sign(x)` with `sign(0) = 0`, as candle's `sign` computes it (so that both paths agree).
fn sign(x: f32) -> f32 {
    f32::from(x > 0.0) - f32::from(x < 0.0)
}

impl UpdateRule for LionConfig {
    const KIND: &'static str = "lion";
    const NAME: &'static str = "Lion";
    const COUNTS_STEPS: bool = false;

    super::rule::hyper_parameters! {
        lr: NonNegative, beta1: UpToOne, beta2: UpToOne, weight_decay: NonNegative
    }

    fn state_names(&self) -> &'static [&'static str] {
        &["exp_avg"]
    }

    fn f32_kernel(&self, at: Step) -> impl Fn(&mut [f32], &[f32], &mut [&mut [f32]]) + Sync {
        let c = self.coefficients(at.lr);
        move |p, g, state| {
            let [exp_avg] = state else {
                unreachable!("Lion keeps one state tensor per parameter")
            };
            for ((p, &g), m) in p.iter_mut().zip(g).zip(exp_avg.iter_mut()) {
                let direction = c.beta1 * *m + c.one_minus_beta1 * g;
                *p = *p * c.decay - c.lr * sign(direction);
                *m = c.beta2 * *m + c.one_minus_beta2 * g;
            }
        }
    }

    fn update_tensors(&self, p: &Tensor, g: &Tensor, s: &mut [Tensor], at: Step) -> Result<Tensor> {
        let lr = at.lr;
        let [exp_avg] = s else {
            unreachable!("Lion keeps one state tensor per parameter")
        };
        let c = ((&*exp_avg * self.beta1)? + (g * (1.0 - self.beta1))?)?;
        let p = ((p * (1.0 - lr * self.weight_decay))? - (c.sign()? * lr)?)?;
        *exp_avg = ((&*exp_avg * self.beta2)? + (g * (1.0 - self.beta2))?)?;
        Ok(p)
    }

    #[cfg(feature = "cuda")]
    fn cuda_update(&self, at: Step) -> Option<super::CudaUpdate> {
        let c = self.coefficients(at.lr);
        Some(super::CudaUpdate {
            kernel: super::cuda_kernels::Kernel::Lion,
            scalars: [
                c.decay,
                c.lr,
                c.beta1,
                c.one_minus_beta1,
                c.beta2,
                c.one_minus_beta2,
                0.0,
                0.0,
            ],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::test_util::prelude::*;

    /// Lion as published (Chen et al. 2023, Program 1), one scalar at a time in f64.
    // Indexed loops on purpose: the formula is written out element by element.
    #[allow(clippy::needless_range_loop)]
    fn reference(c: LionConfig, mut p: Vec<f64>) -> Reference {
        let mut m = vec![0.0; p.len()];
        Box::new(move |g| {
            for i in 0..p.len() {
                let update = c.beta1 * m[i] + (1.0 - c.beta1) * g[i];
                let sign = if update > 0.0 {
                    1.0
                } else if update < 0.0 {
                    -1.0
                } else {
                    0.0
                };
                p[i] = p[i] * (1.0 - c.lr * c.weight_decay) - c.lr * sign;
                m[i] = c.beta2 * m[i] + (1.0 - c.beta2) * g[i];
            }
            p.clone()
        })
    }

    crate::optim::conformance::suite! {
        LionConfig, tolerance: (f32 1e-6, f64 1e-14), reference: reference,
        configs: [
            ("defaults", |c| c.lr = 0.01),
            ("weight decay", |c| (c.lr, c.weight_decay) = (0.02, 0.5)),
            ("other betas", |c| {
                (c.lr, c.beta1, c.beta2, c.weight_decay) = (0.03, 0.5, 0.8, 0.1)
            }),
        ],
        stateful: |c| (c.lr, c.weight_decay) = (0.02, 0.1),
        refused: [
            (|c| c.lr = -1e-4, "learning rate"),
            (|c| c.beta1 = 1.5, "beta1"),
            (|c| c.beta2 = -0.1, "beta2"),
            (|c| c.weight_decay = f64::INFINITY, "weight_decay"),
        ],
    }

    #[test]
    fn by_hand() {
        // Step 1 (m = 0): c = 0.1·g, so p moves by lr against the sign of g, and not where g = 0.
        // Step 2: m = 0.01·g1 = [0, 0.01, -0.02]; c = 0.9·m + 0.1·g2 with g2 = [1, -0.05, 0.1]
        // = [0.1, 0.004, -0.008]: in elements 2 and 3 the moment's sign wins over g2's.
        for fallback in [false, true] {
            let config = LionConfig {
                lr: 0.1,
                ..LionConfig::default()
            };
            let mut opt = Lion::new(named(&[("w", &[1.0, 1.0, 1.0])], DType::F32), config).unwrap();
            opt.force_fallback = fallback;
            opt.step(buffers(opt.params(), &[("w", &[0.0, 1.0, -2.0])]).gradients())
                .unwrap();
            assert_close(
                &values(&opt.params()[0].1),
                &[1.0, 0.9, 1.1],
                1e-7,
                "step 1",
            );
            opt.step(buffers(opt.params(), &[("w", &[1.0, -0.05, 0.1])]).gradients())
                .unwrap();
            assert_close(
                &values(&opt.params()[0].1),
                &[0.9, 0.8, 1.2],
                1e-7,
                "step 2",
            );
            let m = opt.state().unwrap().tensors["exp_avg.w"].to_dtype(DType::F64);
            let m: Vec<f64> = m.unwrap().to_vec1().unwrap();
            assert_close(
                &m,
                &[0.01, 0.99 * 0.01 - 0.0005, -0.0198 + 0.001],
                1e-7,
                "m",
            );
        }
    }

    #[test]
    fn defaults_are_the_papers() {
        assert_eq!(
            LionConfig::default(),
            LionConfig {
                lr: 1e-4,
                beta1: 0.9,
                beta2: 0.99,
                weight_decay: 0.0
            }
        );
    }
}
