//! Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, as
//! `torch.optim.SGD`.
//!
//! Per parameter with a gradient: `g += wd·p`; with momentum, `buf = g` on the first step and
//! `buf = momentum·buf + (1 - dampening)·g` after, then `g = nesterov ? g + momentum·buf : buf`;
//! finally `p -= lr·g`.

use candle_core::{Tensor, Var};

use super::kernels::{self, SgdCoefficients};
use super::state::{key, snapshot, state_dtype, OptimizerState, StateReader};
use super::{check_grad, current_lr, detached, nested, require, sorted_params, write_param};
use super::{LearningRate, Optimizer};
use crate::cpu_slices::{with_f32, with_f32_mut};
use crate::error::{Error, Result};
use crate::grads::GradientBuffers;

const KIND: &str = "sgd";
const BUFFER: &str = "momentum_buffer";

/// Hyper-parameters of [`Sgd`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (the initial value of the optimizer's [`LearningRate`] handle).
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

impl SgdConfig {
    /// PyTorch's checks, plus finiteness.
    fn validate(&self) -> Result<()> {
        require(
            self.lr.is_finite() && self.lr >= 0.0,
            "SGD learning rate",
            self.lr,
            "must be >= 0",
        )?;
        require(
            self.momentum.is_finite() && self.momentum >= 0.0,
            "SGD momentum",
            self.momentum,
            "must be >= 0",
        )?;
        require(
            self.dampening.is_finite(),
            "SGD dampening",
            self.dampening,
            "must be finite",
        )?;
        require(
            self.weight_decay.is_finite() && self.weight_decay >= 0.0,
            "SGD weight_decay",
            self.weight_decay,
            "must be >= 0",
        )?;
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::Optimizer(format!(
                "Nesterov momentum requires a momentum > 0 and zero dampening (got momentum {}, \
                 dampening {}); set SgdConfig::momentum, or dampening to 0, or nesterov to false",
                self.momentum, self.dampening
            )));
        }
        Ok(())
    }

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

/// SGD with PyTorch semantics; see the module documentation for the update.
#[derive(Debug)]
pub struct Sgd {
    params: Vec<(String, Var)>,
    /// Momentum buffers, created at a parameter's first step with a gradient (momentum > 0 only).
    buffers: Vec<Option<Tensor>>,
    config: SgdConfig,
    lr: LearningRate,
    /// Parameters with more elements are updated by several threads.
    pub(crate) parallel_min_elems: usize,
    /// Use the tensor-op path even where the fused one applies (tests compare the two).
    pub(crate) force_fallback: bool,
    /// How many parameter updates took the tensor-op path (tests prove the fused path ran).
    pub(crate) fallback_updates: u64,
}

impl Sgd {
    /// An optimizer over `params` (sorted by name here; names must be unique).
    pub fn new(params: Vec<(String, Var)>, config: SgdConfig) -> Result<Self> {
        config.validate()?;
        let params = sorted_params(params, "SGD")?;
        let buffers = vec![None; params.len()];
        Ok(Self {
            params,
            buffers,
            config,
            lr: LearningRate::new(config.lr),
            parallel_min_elems: kernels::PARALLEL_MIN_ELEMS,
            force_fallback: false,
            fallback_updates: 0,
        })
    }

    /// The hyper-parameters, with `lr` read from the learning-rate handle.
    pub fn config(&self) -> SgdConfig {
        SgdConfig {
            lr: self.lr.get(),
            ..self.config
        }
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, grads: &GradientBuffers) -> Result<()> {
        let lr = current_lr(&self.lr)?;
        let c = self.config;
        let coefficients = c.coefficients(lr);
        for ((name, var), buffer) in self.params.iter().zip(self.buffers.iter_mut()) {
            let Some(grad) = grads.get(name) else {
                continue;
            };
            check_grad(name, var, grad)?;
            let first = c.momentum != 0.0 && buffer.is_none();
            if first {
                // Allocated once; the first update overwrites it with the gradient.
                let dtype = state_dtype(var.dtype());
                *buffer = Some(Tensor::zeros(var.shape(), dtype, var.device())?);
            }
            let fused = !self.force_fallback
                && update_fused(
                    var,
                    grad,
                    buffer.as_ref().filter(|_| c.momentum != 0.0),
                    first,
                    &coefficients,
                    self.parallel_min_elems,
                )?;
            if !fused {
                update_with_tensor_ops(var, grad, buffer, first, lr, &c)?;
                self.fallback_updates += 1;
            }
        }
        Ok(())
    }

    fn learning_rate(&self) -> &LearningRate {
        &self.lr
    }

    fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    fn state(&self) -> Result<OptimizerState> {
        let mut state = OptimizerState::new(KIND);
        let c = self.config();
        for (k, v) in [
            ("lr", c.lr),
            ("momentum", c.momentum),
            ("dampening", c.dampening),
            ("weight_decay", c.weight_decay),
            ("nesterov", if c.nesterov { 1.0 } else { 0.0 }),
        ] {
            state.scalars.insert(k.to_string(), v);
        }
        for ((name, _), buffer) in self.params.iter().zip(&self.buffers) {
            if let Some(b) = buffer {
                state.tensors.insert(key(BUFFER, name), snapshot(b)?);
            }
        }
        Ok(state)
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        let mut reader = StateReader::new(state, KIND)?;
        let nesterov = reader.scalar("nesterov")?;
        if nesterov != 0.0 && nesterov != 1.0 {
            return Err(Error::Optimizer(format!(
                "SGD state scalar \"nesterov\" is {nesterov}; it must be 0 or 1"
            )));
        }
        let config = SgdConfig {
            lr: reader.scalar("lr")?,
            momentum: reader.scalar("momentum")?,
            dampening: reader.scalar("dampening")?,
            weight_decay: reader.scalar("weight_decay")?,
            nesterov: nesterov == 1.0,
        };
        config.validate()?;
        let mut buffers = Vec::with_capacity(self.params.len());
        for (name, var) in &self.params {
            buffers.push(reader.tensor(BUFFER, name, var, state_dtype(var.dtype()))?);
        }
        reader.finish()?;
        self.config = config;
        self.lr.set(config.lr);
        self.buffers = buffers;
        Ok(())
    }
}

/// The single-pass CPU update; `Ok(false)` (nothing touched) when some tensor is not a contiguous
/// f32 CPU tensor. `buffer` is `None` without momentum.
fn update_fused(
    var: &Var,
    grad: &Tensor,
    buffer: Option<&Tensor>,
    first: bool,
    c: &SgdCoefficients,
    parallel_min: usize,
) -> Result<bool> {
    let run = |p: &mut [f32], g: &[f32], b: &mut [f32]| {
        kernels::apply_split(p, g, b, &mut [], parallel_min, |p, g, b, _| {
            kernels::sgd(p, g, b, first, c)
        })
    };
    let ran = nested(with_f32(grad, |g| {
        nested(with_f32_mut(var.as_tensor(), |p| match buffer {
            Some(buffer) => with_f32_mut(buffer, |b| run(p, g, b)),
            None => {
                run(p, g, &mut []);
                Ok(Some(()))
            }
        }))
    }))?;
    #[cfg(feature = "cuda")]
    if ran.is_none() {
        return update_fused_cuda(var, grad, buffer, first, c);
    }
    Ok(ran.is_some())
}

/// [`update_fused`] on the GPU: one kernel launch; `Ok(false)` when some tensor is not a
/// contiguous f32 CUDA tensor.
#[cfg(feature = "cuda")]
fn update_fused_cuda(
    var: &Var,
    grad: &Tensor,
    buffer: Option<&Tensor>,
    first: bool,
    c: &SgdCoefficients,
) -> Result<bool> {
    use crate::cuda_slices::{with_cuda_f32, with_cuda_f32_mut};
    // A kernel on the parameter's stream cannot read another GPU's memory: a gradient elsewhere
    // takes the tensor-op path, which moves it.
    if !grad.device().same_device(var.device()) {
        return Ok(false);
    }
    let ran = nested(with_cuda_f32(grad, |g| {
        nested(with_cuda_f32_mut(
            var.as_tensor(),
            |device, mut p| match buffer {
                Some(buffer) => nested(with_cuda_f32_mut(buffer, |_, mut b| {
                    super::cuda_kernels::sgd(device, &mut p, &g, Some(&mut b), first, c).map(Some)
                })),
                None => super::cuda_kernels::sgd(device, &mut p, &g, None, first, c).map(Some),
            },
        ))
    }))?;
    Ok(ran.is_some())
}

/// The same update with candle tensor ops, for any device and dtype.
fn update_with_tensor_ops(
    var: &Var,
    grad: &Tensor,
    buffer: &mut Option<Tensor>,
    first: bool,
    lr: f64,
    c: &SgdConfig,
) -> Result<()> {
    let dtype = state_dtype(var.dtype());
    let p = detached(var, dtype)?;
    let mut g = grad.detach().to_device(var.device())?.to_dtype(dtype)?;
    if c.weight_decay != 0.0 {
        g = (&g + (&p * c.weight_decay)?)?;
    }
    if c.momentum != 0.0 {
        let b = match buffer.as_ref() {
            Some(b) if !first => ((b * c.momentum)? + (&g * (1.0 - c.dampening))?)?,
            _ => g.force_contiguous()?,
        };
        g = if c.nesterov {
            (&g + (&b * c.momentum)?)?
        } else {
            b.clone()
        };
        *buffer = Some(b);
    }
    let p = (p - (g * lr)?)?;
    write_param(var, &p)
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;
    use crate::optim::test_util::{assert_close, buffers, named, pseudo_random, values};

    /// SGD as documented for `torch.optim.SGD`, one scalar at a time in f64.
    struct Reference {
        p: Vec<f64>,
        buf: Option<Vec<f64>>,
    }

    impl Reference {
        fn new(p: &[f64]) -> Self {
            Self {
                p: p.to_vec(),
                buf: None,
            }
        }

        // Indexed loops on purpose: the formula is written out element by element.
        #[allow(clippy::needless_range_loop)]
        fn step(&mut self, g: &[f64], c: &SgdConfig) {
            let mut d: Vec<f64> = (0..g.len())
                .map(|i| g[i] + c.weight_decay * self.p[i])
                .collect();
            if c.momentum != 0.0 {
                let buf = match self.buf.take() {
                    None => d.clone(),
                    Some(b) => (0..g.len())
                        .map(|i| c.momentum * b[i] + (1.0 - c.dampening) * d[i])
                        .collect(),
                };
                for i in 0..g.len() {
                    d[i] = if c.nesterov {
                        d[i] + c.momentum * buf[i]
                    } else {
                        buf[i]
                    };
                }
                self.buf = Some(buf);
            }
            for i in 0..g.len() {
                self.p[i] -= c.lr * d[i];
            }
        }
    }

    const A0: [f64; 5] = [0.5, -1.25, 2.0, 0.0, -0.3];
    const B0: [f64; 3] = [1.0, -2.0, 0.75];

    fn grads_at(s: usize) -> (Vec<f64>, Vec<f64>) {
        (
            pseudo_random(A0.len(), 30 + s as u32),
            pseudo_random(B0.len(), 300 + s as u32),
        )
    }

    fn optimizer(config: SgdConfig, dtype: DType) -> Sgd {
        Sgd::new(named(&[("b", &B0), ("a", &A0)], dtype), config).unwrap()
    }

    fn run(opt: &mut Sgd, steps: std::ops::Range<usize>) {
        for s in steps {
            let (ga, gb) = grads_at(s);
            opt.step(&buffers(opt.params(), &[("a", &ga), ("b", &gb)]))
                .unwrap();
        }
    }

    fn configs() -> Vec<(&'static str, SgdConfig)> {
        let base = SgdConfig {
            lr: 0.1,
            ..SgdConfig::default()
        };
        vec![
            ("plain", base),
            (
                "weight decay",
                SgdConfig {
                    weight_decay: 0.2,
                    ..base
                },
            ),
            (
                "momentum",
                SgdConfig {
                    momentum: 0.9,
                    ..base
                },
            ),
            (
                "dampening",
                SgdConfig {
                    momentum: 0.9,
                    dampening: 0.3,
                    ..base
                },
            ),
            (
                "nesterov",
                SgdConfig {
                    momentum: 0.8,
                    nesterov: true,
                    ..base
                },
            ),
            (
                "everything",
                SgdConfig {
                    momentum: 0.7,
                    weight_decay: 0.05,
                    nesterov: true,
                    ..base
                },
            ),
        ]
    }

    fn check_against_reference(dtype: DType, tol: f64, force_fallback: bool) {
        for (what, config) in configs() {
            let mut opt = optimizer(config, dtype);
            opt.force_fallback = force_fallback;
            let (mut ra, mut rb) = (Reference::new(&A0), Reference::new(&B0));
            for s in 0..4 {
                run(&mut opt, s..s + 1);
                let (ga, gb) = grads_at(s);
                ra.step(&ga, &config);
                rb.step(&gb, &config);
                assert_close(
                    &values(&opt.params()[0].1),
                    &ra.p,
                    tol,
                    &format!("{what}: a@{s}"),
                );
                assert_close(
                    &values(&opt.params()[1].1),
                    &rb.p,
                    tol,
                    &format!("{what}: b@{s}"),
                );
            }
            let fused_expected = dtype == DType::F32 && !force_fallback;
            assert_eq!(opt.fallback_updates == 0, fused_expected, "{what}");
        }
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
        opt.step(&buffers(opt.params(), &[("w", &[0.5])])).unwrap();
        assert_close(&values(&opt.params()[0].1), &[0.95], 1e-7, "plain");
        // Momentum 0.9, g = 1 twice: buf 1 then 1.9; p = 1 - 0.1 - 0.19.
        let config = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        };
        let mut opt = Sgd::new(named(&[("w", &[1.0])], DType::F32), config).unwrap();
        for _ in 0..2 {
            opt.step(&buffers(opt.params(), &[("w", &[1.0])])).unwrap();
        }
        assert_close(&values(&opt.params()[0].1), &[0.71], 1e-7, "momentum");
    }

    #[test]
    fn fused_matches_the_published_formula() {
        check_against_reference(DType::F32, 1e-6, false);
    }

    #[test]
    fn tensor_op_fallback_matches_the_published_formula() {
        check_against_reference(DType::F64, 1e-13, false);
        check_against_reference(DType::F32, 1e-6, true);
    }

    #[test]
    fn a_parameter_split_over_threads_equals_the_unsplit_update() {
        let n = 2049;
        let p0 = pseudo_random(n, 5);
        let config = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
            ..Default::default()
        };
        let make = || Sgd::new(named(&[("w", &p0)], DType::F32), config).unwrap();
        let (mut whole, mut split) = (make(), make());
        split.parallel_min_elems = 64;
        for s in 0..3 {
            let g = pseudo_random(n, 40 + s);
            whole.step(&buffers(whole.params(), &[("w", &g)])).unwrap();
            split.step(&buffers(split.params(), &[("w", &g)])).unwrap();
        }
        assert_eq!(values(&whole.params()[0].1), values(&split.params()[0].1));
        assert_ne!(values(&whole.params()[0].1), p0);
    }

    #[test]
    fn a_parameter_without_gradient_is_untouched_and_gets_no_buffer() {
        let config = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.5,
            ..Default::default()
        };
        let mut opt = optimizer(config, DType::F32);
        let mut rb = Reference::new(&B0);
        for s in 0..3 {
            let (_, gb) = grads_at(s);
            opt.step(&buffers(opt.params(), &[("b", &gb)])).unwrap();
            rb.step(&gb, &config);
        }
        assert_eq!(
            values(&opt.params()[0].1),
            A0.map(|x| x as f32 as f64).to_vec(),
            "bit for bit, as stored in f32"
        );
        assert_close(&values(&opt.params()[1].1), &rb.p, 1e-6, "b");
        let state = opt.state().unwrap();
        assert!(state.tensors.contains_key("momentum_buffer.b"));
        assert!(!state.tensors.contains_key("momentum_buffer.a"));
        // "a"'s first gradient initializes its buffer to that gradient (no momentum from before).
        let mut ra = Reference::new(&A0);
        let (ga, _) = grads_at(9);
        opt.step(&buffers(opt.params(), &[("a", &ga)])).unwrap();
        ra.step(&ga, &config);
        assert_close(&values(&opt.params()[0].1), &ra.p, 1e-6, "a");
    }

    #[test]
    fn state_round_trip_continues_identically() {
        let config = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            nesterov: false,
        };
        let mut straight = optimizer(config, DType::F32);
        run(&mut straight, 0..5);

        let mut first = optimizer(config, DType::F32);
        run(&mut first, 0..2);
        let saved = first.state().unwrap();
        let buffer_a: Vec<f32> = saved.tensors["momentum_buffer.a"].to_vec1().unwrap();
        run(&mut first, 2..3);
        assert_eq!(
            saved.tensors["momentum_buffer.a"].to_vec1::<f32>().unwrap(),
            buffer_a
        );

        let mut resumed = optimizer(SgdConfig::default(), DType::F32);
        let mut at_save = optimizer(config, DType::F32);
        run(&mut at_save, 0..2);
        for ((_, dst), (_, src)) in resumed.params().iter().zip(at_save.params()) {
            dst.set(src.as_tensor()).unwrap();
        }
        resumed.load_state(&saved).unwrap();
        assert_eq!(resumed.config(), config);
        run(&mut resumed, 2..5);
        assert_eq!(
            saved.tensors["momentum_buffer.a"].to_vec1::<f32>().unwrap(),
            buffer_a
        );
        for i in 0..2 {
            assert_eq!(
                values(&resumed.params()[i].1),
                values(&straight.params()[i].1)
            );
        }
    }

    #[test]
    fn mismatched_states_are_rejected_and_nothing_is_loaded() {
        let config = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        };
        let mut source = optimizer(config, DType::F32);
        run(&mut source, 0..2);
        let good = source.state().unwrap();
        let mut target = optimizer(SgdConfig { lr: 0.5, ..config }, DType::F32);

        let mut renamed = good.clone();
        let t = renamed.tensors.remove("momentum_buffer.a").unwrap();
        renamed.tensors.insert("momentum_buffer.a2".into(), t);
        let err = target.load_state(&renamed).unwrap_err().to_string();
        assert!(err.contains("momentum_buffer.a2"), "{err}");

        let mut reshaped = good.clone();
        reshaped.tensors.insert(
            "momentum_buffer.b".into(),
            Tensor::zeros((3, 1), DType::F32, &candle_core::Device::Cpu).unwrap(),
        );
        let err = target.load_state(&reshaped).unwrap_err().to_string();
        assert!(
            err.contains("momentum_buffer.b") && err.contains("[3, 1]"),
            "{err}"
        );

        let mut wrong_kind = good.clone();
        wrong_kind.kind = "adamw".into();
        assert!(target.load_state(&wrong_kind).is_err());

        let state = target.state().unwrap();
        assert!(state.tensors.is_empty(), "nothing was half-loaded");
        assert_eq!(
            (state.scalars["lr"], target.learning_rate().get()),
            (0.5, 0.5)
        );
        target.load_state(&good).unwrap();
        assert_eq!(
            target.learning_rate().get(),
            0.1,
            "lr comes from the state, as in PyTorch"
        );
    }

    #[test]
    fn invalid_hyper_parameters_are_rejected() {
        let params = || named(&[("w", &[1.0])], DType::F32);
        for (config, word) in [
            (
                SgdConfig {
                    lr: -0.1,
                    ..Default::default()
                },
                "learning rate",
            ),
            (
                SgdConfig {
                    momentum: -0.5,
                    ..Default::default()
                },
                "momentum",
            ),
            (
                SgdConfig {
                    weight_decay: -1.0,
                    ..Default::default()
                },
                "weight_decay",
            ),
            (
                SgdConfig {
                    nesterov: true,
                    ..Default::default()
                },
                "Nesterov",
            ),
            (
                SgdConfig {
                    nesterov: true,
                    momentum: 0.9,
                    dampening: 0.1,
                    ..Default::default()
                },
                "dampening",
            ),
        ] {
            let err = Sgd::new(params(), config).unwrap_err().to_string();
            assert!(err.contains(word), "{err}");
        }
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
    fn a_gradient_of_the_wrong_shape_is_an_error() {
        let mut opt = Sgd::new(
            named(&[("w", &[1.0, 2.0])], DType::F32),
            SgdConfig::default(),
        )
        .unwrap();
        let other = named(&[("w", &[1.0, 2.0, 3.0])], DType::F32);
        let err = opt
            .step(&buffers(&other, &[("w", &[1.0, 1.0, 1.0])]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("[3]") && err.contains("[2]"), "{err}");
    }

    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a GPU (scripts/gpu-build.sh build, then run on a GPU machine)"]
    fn the_cuda_kernel_matches_the_cpu_kernel_in_one_launch_per_parameter() {
        use crate::optim::test_util::{cuda_buffers, on_cuda};
        for (momentum, nesterov) in [(0.0, false), (0.9, false), (0.9, true)] {
            let config = SgdConfig {
                lr: 0.05,
                momentum,
                nesterov,
                weight_decay: 0.01,
                ..SgdConfig::default()
            };
            let mut cpu = optimizer(config, DType::F32);
            let mut gpu = Sgd::new(on_cuda(cpu.params()), config).unwrap();
            for s in 0..4 {
                let (ga, gb) = grads_at(s);
                run(&mut cpu, s..s + 1);
                gpu.step(&cuda_buffers(gpu.params(), &[("a", &ga), ("b", &gb)]))
                    .unwrap();
            }
            assert_eq!(gpu.fallback_updates, 0, "every update took the CUDA kernel");
            for i in 0..2 {
                let c = values(&cpu.params()[i].1);
                let what = format!("param on the GPU, momentum {momentum}, nesterov {nesterov}");
                assert_close(&values(&gpu.params()[i].1), &c, 1e-6, &what);
            }
        }
    }
}
