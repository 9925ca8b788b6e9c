//! Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, as
//! `torch.optim.SGD`.
//!
//! Per parameter with a gradient: `g += wd·p`; with momentum, `buf = g` on the first step and
//! `buf = momentum·buf + (1 - dampening)·g` after, then `g = nesterov ? g + momentum·buf : buf`;
//! finally `p -= lr·g`.

use candle_core::Tensor;

use super::kernels::{self, SgdCoefficients};
use super::{ElementwiseOptimizer, Step, UpdateRule};
use crate::error::{Error, Result};

/// Hyper-parameters of [`Sgd`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (the initial value of the optimizer's [`LearningRate`](super::LearningRate) handle).
    pub lr: f64,
    /// Momentum factor; 0 keeps no buffer.
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty: `weight_decay·p` is added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    /// lr 0.01, no momentum, no dampening, no weight decay, no Nesterov.
    fn default() -> Self {
        Self {
            lr: 0.01,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// SGD with PyTorch semantics over named parameters; see the module documentation for the update.
/// `Sgd::new(params, SgdConfig { .. })` builds one.
pub type Sgd = ElementwiseOptimizer<SgdConfig>;

impl SgdConfig {
    fn coefficients(&self, lr: f64) -> SgdCoefficients {
        SgdCoefficients {
            lr: lr as f32,
            momentum: self.momentum as f32,
            one_minus_dampening: (1.0 - self.dampening) as f32,
            weight_decay: self.weight_decay as f32,
            nesterov: self.nesterov,
        }
    }
}

impl UpdateRule for SgdConfig {
    const KIND: &'static str = "sgd";
    const NAME: &'static str = "SGD";
    const COUNTS_STEPS: bool = false;

    super::rule::hyper_parameters! {
        /// PyTorch's ranges, plus finiteness.
        lr: NonNegative, momentum: NonNegative, dampening: Finite, weight_decay: NonNegative;
        flags nesterov
    }

    /// PyTorch's condition on Nesterov momentum.
    fn check_together(&self) -> Result<()> {
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::Optimizer(format!(
                "Nesterov momentum requires a momentum > 0 and zero dampening (got momentum {}, \
                 dampening {}); set SgdConfig::momentum, or dampening to 0, or nesterov to false",
                self.momentum, self.dampening
            )));
        }
        Ok(())
    }

    /// The momentum buffer, with momentum only.
    fn state_names(&self) -> &'static [&'static str] {
        if self.momentum != 0.0 {
            &["momentum_buffer"]
        } else {
            &[]
        }
    }

    fn f32_kernel(&self, at: Step) -> impl Fn(&mut [f32], &[f32], &mut [&mut [f32]]) + Sync {
        let (c, first) = (self.coefficients(at.lr), at.first);
        move |p, g, state| match state {
            [buffer] => kernels::sgd(p, g, buffer, first, &c),
            _ => kernels::sgd(p, g, &mut [], first, &c),
        }
    }

    fn update_tensors(&self, p: &Tensor, g: &Tensor, s: &mut [Tensor], at: Step) -> Result<Tensor> {
        let mut g = g.clone();
        if self.weight_decay != 0.0 {
            g = (&g + (p * self.weight_decay)?)?;
        }
        if let [buffer] = s {
            *buffer = if at.first {
                g.force_contiguous()?
            } else {
                ((&*buffer * self.momentum)? + (&g * (1.0 - self.dampening))?)?
            };
            g = if self.nesterov {
                (&g + (&*buffer * self.momentum)?)?
            } else {
                buffer.clone()
            };
        }
        Ok((p - (g * at.lr)?)?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_update(&self, at: Step) -> Option<super::CudaUpdate> {
        let (c, first) = (self.coefficients(at.lr), at.first);
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        Some(super::CudaUpdate {
            kernel: super::cuda_kernels::Kernel::Sgd,
            scalars: [
                c.lr,
                c.momentum,
                c.one_minus_dampening,
                c.weight_decay,
                flag(c.nesterov),
                flag(first),
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

    /// SGD as documented for `torch.optim.SGD`, one scalar at a time in f64.
    // Indexed loops on purpose: the formula is written out element by element.
    #[allow(clippy::needless_range_loop)]
    fn reference(c: SgdConfig, mut p: Vec<f64>) -> Reference {
        let mut buf: Option<Vec<f64>> = None;
        Box::new(move |g| {
            let mut d: Vec<f64> = (0..g.len()).map(|i| g[i] + c.weight_decay * p[i]).collect();
            if c.momentum != 0.0 {
                let b = match buf.take() {
                    None => d.clone(),
                    Some(b) => (0..g.len())
                        .map(|i| c.momentum * b[i] + (1.0 - c.dampening) * d[i])
                        .collect(),
                };
                for i in 0..g.len() {
                    d[i] = if c.nesterov {
                        d[i] + c.momentum * b[i]
                    } else {
                        b[i]
                    };
                }
                buf = Some(b);
            }
            for i in 0..g.len() {
                p[i] -= c.lr * d[i];
            }
            p.clone()
        })
    }

    crate::optim::conformance::suite! {
        SgdConfig, tolerance: (f32 1e-6, f64 1e-13), reference: reference,
        configs: [
            ("plain", |c| c.lr = 0.1),
            ("weight decay", |c| (c.lr, c.weight_decay) = (0.1, 0.2)),
            ("momentum", |c| (c.lr, c.momentum) = (0.1, 0.9)),
            ("dampening", |c| (c.lr, c.momentum, c.dampening) = (0.1, 0.9, 0.3)),
            ("nesterov", |c| (c.lr, c.momentum, c.nesterov) = (0.1, 0.8, true)),
            ("everything", |c| {
                (c.lr, c.momentum, c.weight_decay, c.nesterov) = (0.1, 0.7, 0.05, true)
            }),
        ],
        stateful: |c| {
            (c.lr, c.momentum, c.dampening, c.weight_decay, c.nesterov) =
                (0.1, 0.9, 0.1, 0.01, false)
        },
        refused: [
            (|c| c.lr = -0.1, "learning rate"),
            (|c| c.momentum = -0.5, "momentum"),
            (|c| c.weight_decay = -1.0, "weight_decay"),
            (|c| c.nesterov = true, "Nesterov"),
            (|c| (c.nesterov, c.momentum, c.dampening) = (true, 0.9, 0.1), "dampening"),
        ],
    }

    #[test]
    fn by_hand() {
        // Plain: 1 - 0.1 · 0.5.
        let mut opt = Sgd::new(
            named(&[("w", &[1.0])], DType::F32),
            SgdConfig {
                lr: 0.1,
                ..Default::default()
            },
        )
        .unwrap();
        opt.step(buffers(opt.params(), &[("w", &[0.5])]).gradients())
            .unwrap();
        assert_close(&values(&opt.params()[0].1), &[0.95], 1e-7, "plain");
        // Momentum 0.9, g = 1 twice: buf 1 then 1.9; p = 1 - 0.1 - 0.19.
        let config = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        };
        let mut opt = Sgd::new(named(&[("w", &[1.0])], DType::F32), config).unwrap();
        for _ in 0..2 {
            opt.step(buffers(opt.params(), &[("w", &[1.0])]).gradients())
                .unwrap();
        }
        assert_close(&values(&opt.params()[0].1), &[0.71], 1e-7, "momentum");
    }

    #[test]
    fn default_config() {
        assert_eq!(
            SgdConfig::default(),
            SgdConfig {
                lr: 0.01,
                momentum: 0.0,
                dampening: 0.0,
                weight_decay: 0.0,
                nesterov: false
            }
        );
    }

    #[test]
    fn a_nesterov_flag_other_than_0_or_1_is_refused() {
        let mut opt = Sgd::new(named(&[("w", &[1.0])], DType::F32), SgdConfig::default()).unwrap();
        let mut state = opt.state().unwrap();
        state.scalars.insert("nesterov".into(), 0.5);
        let err = opt.load_state(&state).unwrap_err().to_string();
        assert!(err.contains("nesterov") && err.contains("0.5"), "{err}");
    }
}
