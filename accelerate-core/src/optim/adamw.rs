//! AdamW (decoupled weight decay), as `torch.optim.AdamW`.
//!
//! Per parameter with a gradient `g`, at its own step `t` (counted from 1):
//! `p *= 1 - lr·wd; m = lerp(m, g, 1 - β1); v = β2·v + (1 - β2)·g²;
//! p -= (lr / (1 - β1^t)) · m / (sqrt(v) / sqrt(1 - β2^t) + eps)`.
//! That is PyTorch's numerical arrangement of `p -= lr·m̂ / (sqrt(v̂) + eps)`: the bias corrections
//! go into a scalar step size and a scalar divisor, `eps` stays outside the square root.

use candle_core::{Tensor, Var};

use super::kernels::{self, AdamWCoefficients};
use super::state::{key, snapshot, state_dtype, OptimizerState, StateReader};
use super::{check_grad, current_lr, detached, nested, require, sorted_params, write_param};
use super::{LearningRate, Optimizer};
use crate::cpu_slices::{with_f32, with_f32_mut};
use crate::error::Result;
use crate::grads::GradientBuffers;

const KIND: &str = "adamw";

/// Hyper-parameters of [`AdamW`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (the initial value of the optimizer's [`LearningRate`] handle).
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

impl AdamWConfig {
    /// PyTorch's checks, plus finiteness.
    fn validate(&self) -> Result<()> {
        require(
            self.lr.is_finite() && self.lr >= 0.0,
            "AdamW learning rate",
            self.lr,
            "must be >= 0",
        )?;
        require(
            self.eps.is_finite() && self.eps >= 0.0,
            "AdamW eps",
            self.eps,
            "must be >= 0",
        )?;
        require(
            (0.0..1.0).contains(&self.beta1),
            "AdamW beta1",
            self.beta1,
            "must be in [0, 1)",
        )?;
        require(
            (0.0..1.0).contains(&self.beta2),
            "AdamW beta2",
            self.beta2,
            "must be in [0, 1)",
        )?;
        require(
            self.weight_decay.is_finite() && self.weight_decay >= 0.0,
            "AdamW weight_decay",
            self.weight_decay,
            "must be >= 0",
        )
    }
}

/// The state of one parameter, created at its first step with a gradient.
#[derive(Debug, Clone)]
struct Moments {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: u64,
}

/// AdamW with PyTorch semantics; see the module documentation for the update.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<(String, Var)>,
    moments: Vec<Option<Moments>>,
    config: AdamWConfig,
    lr: LearningRate,
    /// Parameters with more elements are updated by several threads.
    pub(crate) parallel_min_elems: usize,
    /// Use the tensor-op path even where the fused one applies (tests compare the two).
    pub(crate) force_fallback: bool,
    /// How many parameter updates took the tensor-op path (tests prove the fused path ran).
    pub(crate) fallback_updates: u64,
}

impl AdamW {
    /// An optimizer over `params` (sorted by name here; names must be unique).
    pub fn new(params: Vec<(String, Var)>, config: AdamWConfig) -> Result<Self> {
        config.validate()?;
        let params = sorted_params(params, "AdamW")?;
        let moments = vec![None; params.len()];
        Ok(Self {
            params,
            moments,
            config,
            lr: LearningRate::new(config.lr),
            parallel_min_elems: kernels::PARALLEL_MIN_ELEMS,
            force_fallback: false,
            fallback_updates: 0,
        })
    }

    /// The hyper-parameters, with `lr` read from the learning-rate handle.
    pub fn config(&self) -> AdamWConfig {
        AdamWConfig {
            lr: self.lr.get(),
            ..self.config
        }
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, grads: &GradientBuffers) -> Result<()> {
        let lr = current_lr(&self.lr)?;
        let c = self.config;
        for ((name, var), slot) in self.params.iter().zip(self.moments.iter_mut()) {
            let Some(grad) = grads.get(name) else {
                continue;
            };
            check_grad(name, var, grad)?;
            if slot.is_none() {
                let dtype = state_dtype(var.dtype());
                *slot = Some(Moments {
                    exp_avg: Tensor::zeros(var.shape(), dtype, var.device())?,
                    exp_avg_sq: Tensor::zeros(var.shape(), dtype, var.device())?,
                    step: 0,
                });
            }
            let Some(m) = slot.as_mut() else {
                unreachable!("moments were created above")
            };
            let step = m.step + 1;
            let coefficients =
                AdamWCoefficients::new(lr, c.beta1, c.beta2, c.eps, c.weight_decay, step);
            let fused = !self.force_fallback
                && update_fused(var, grad, m, &coefficients, self.parallel_min_elems)?;
            if !fused {
                update_with_tensor_ops(var, grad, m, lr, &c, step)?;
                self.fallback_updates += 1;
            }
            m.step = step;
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
            ("beta1", c.beta1),
            ("beta2", c.beta2),
            ("eps", c.eps),
            ("weight_decay", c.weight_decay),
        ] {
            state.scalars.insert(k.to_string(), v);
        }
        for ((name, _), slot) in self.params.iter().zip(&self.moments) {
            let Some(m) = slot else { continue };
            state
                .tensors
                .insert(key("exp_avg", name), snapshot(&m.exp_avg)?);
            state
                .tensors
                .insert(key("exp_avg_sq", name), snapshot(&m.exp_avg_sq)?);
            state.scalars.insert(key("step", name), m.step as f64);
        }
        Ok(state)
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        let mut reader = StateReader::new(state, KIND)?;
        let config = AdamWConfig {
            lr: reader.scalar("lr")?,
            beta1: reader.scalar("beta1")?,
            beta2: reader.scalar("beta2")?,
            eps: reader.scalar("eps")?,
            weight_decay: reader.scalar("weight_decay")?,
        };
        config.validate()?;
        let mut moments = Vec::with_capacity(self.params.len());
        for (name, var) in &self.params {
            let dtype = state_dtype(var.dtype());
            let exp_avg = reader.tensor("exp_avg", name, var, dtype)?;
            let exp_avg_sq = reader.tensor("exp_avg_sq", name, var, dtype)?;
            let step = reader.step(name)?;
            moments.push(match (exp_avg, exp_avg_sq, step) {
                (Some(exp_avg), Some(exp_avg_sq), Some(step)) => Some(Moments {
                    exp_avg,
                    exp_avg_sq,
                    step,
                }),
                (None, None, None) => None,
                (a, b, s) => {
                    return Err(crate::Error::Optimizer(format!(
                        "AdamW state of parameter {name:?} is incomplete: {} {} {} (all three \
                         are written together by state(); the checkpoint is damaged)",
                        presence("exp_avg", name, a.is_some()),
                        presence("exp_avg_sq", name, b.is_some()),
                        presence("step", name, s.is_some()),
                    )))
                }
            });
        }
        reader.finish()?;
        self.config = config;
        self.lr.set(config.lr);
        self.moments = moments;
        Ok(())
    }
}

fn presence(what: &str, name: &str, present: bool) -> String {
    let k = key(what, name);
    if present {
        format!("{k:?} present,")
    } else {
        format!("{k:?} missing,")
    }
}

/// The single-pass CPU update; `Ok(false)` (nothing touched) when some tensor is not a contiguous
/// f32 CPU tensor.
fn update_fused(
    var: &Var,
    grad: &Tensor,
    m: &Moments,
    c: &AdamWCoefficients,
    parallel_min: usize,
) -> Result<bool> {
    let ran = nested(with_f32(grad, |g| {
        nested(with_f32_mut(var.as_tensor(), |p| {
            nested(with_f32_mut(&m.exp_avg, |exp_avg| {
                with_f32_mut(&m.exp_avg_sq, |exp_avg_sq| {
                    kernels::apply_split(p, g, exp_avg, exp_avg_sq, parallel_min, |p, g, a, b| {
                        kernels::adamw(p, g, a, b, c)
                    })
                })
            }))
        }))
    }))?;
    #[cfg(feature = "cuda")]
    if ran.is_none() {
        return update_fused_cuda(var, grad, m, c);
    }
    Ok(ran.is_some())
}

/// [`update_fused`] on the GPU: one kernel launch; `Ok(false)` when some tensor is not a
/// contiguous f32 CUDA tensor.
#[cfg(feature = "cuda")]
fn update_fused_cuda(var: &Var, grad: &Tensor, m: &Moments, c: &AdamWCoefficients) -> Result<bool> {
    use crate::cuda_slices::{with_cuda_f32, with_cuda_f32_mut};
    // A kernel on the parameter's stream cannot read another GPU's memory: a gradient elsewhere
    // takes the tensor-op path, which moves it.
    if !grad.device().same_device(var.device()) {
        return Ok(false);
    }
    let ran = nested(with_cuda_f32(grad, |g| {
        nested(with_cuda_f32_mut(var.as_tensor(), |device, mut p| {
            nested(with_cuda_f32_mut(&m.exp_avg, |_, mut exp_avg| {
                nested(with_cuda_f32_mut(&m.exp_avg_sq, |_, mut exp_avg_sq| {
                    super::cuda_kernels::adamw(device, &mut p, &g, &mut exp_avg, &mut exp_avg_sq, c)
                        .map(Some)
                }))
            }))
        }))
    }))?;
    Ok(ran.is_some())
}

/// The same update with candle tensor ops, for any device and dtype (state in f32, or f64 for f64
/// parameters).
fn update_with_tensor_ops(
    var: &Var,
    grad: &Tensor,
    m: &mut Moments,
    lr: f64,
    c: &AdamWConfig,
    step: u64,
) -> Result<()> {
    let dtype = m.exp_avg.dtype();
    let g = grad.detach().to_device(var.device())?.to_dtype(dtype)?;
    let p = (detached(var, dtype)? * (1.0 - lr * c.weight_decay))?;
    // lerp(m, g, 1 - β1) = m + (1 - β1)(g - m)
    let exp_avg = (&m.exp_avg + ((&g - &m.exp_avg)? * (1.0 - c.beta1))?)?;
    let exp_avg_sq = ((&m.exp_avg_sq * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
    let t = step as f64;
    let step_size = lr / (1.0 - c.beta1.powf(t));
    let bias_correction2_sqrt = (1.0 - c.beta2.powf(t)).sqrt();
    let denom = ((exp_avg_sq.sqrt()? / bias_correction2_sqrt)? + c.eps)?;
    let p = (p - ((&exp_avg / &denom)? * step_size)?)?;
    write_param(var, &p)?;
    m.exp_avg = exp_avg;
    m.exp_avg_sq = exp_avg_sq;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use candle_core::DType;

    use super::*;
    use crate::optim::test_util::{assert_close, buffers, named, pseudo_random, values};

    /// AdamW as published (Loshchilov & Hutter, in PyTorch's formulation), one scalar at a time in
    /// f64: `p *= 1 - lr·wd; m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²;
    /// p -= lr · (m / (1-β1^t)) / (sqrt(v / (1-β2^t)) + eps)`.
    struct Reference {
        p: Vec<f64>,
        m: Vec<f64>,
        v: Vec<f64>,
        t: i32,
    }

    impl Reference {
        fn new(p: &[f64]) -> Self {
            Self {
                p: p.to_vec(),
                m: vec![0.0; p.len()],
                v: vec![0.0; p.len()],
                t: 0,
            }
        }

        // Indexed loops on purpose: the formula is written out element by element.
        #[allow(clippy::needless_range_loop)]
        fn step(&mut self, g: &[f64], c: &AdamWConfig) {
            self.t += 1;
            for i in 0..self.p.len() {
                self.p[i] *= 1.0 - c.lr * c.weight_decay;
                self.m[i] = c.beta1 * self.m[i] + (1.0 - c.beta1) * g[i];
                self.v[i] = c.beta2 * self.v[i] + (1.0 - c.beta2) * g[i] * g[i];
                let m_hat = self.m[i] / (1.0 - c.beta1.powi(self.t));
                let v_hat = self.v[i] / (1.0 - c.beta2.powi(self.t));
                self.p[i] -= c.lr * m_hat / (v_hat.sqrt() + c.eps);
            }
        }
    }

    const A0: [f64; 5] = [0.5, -1.25, 2.0, 0.0, -0.3];
    const B0: [f64; 3] = [1.0, -2.0, 0.75];

    /// Gradients of "a" and "b" at step `s`: they change every step, signs included.
    fn grads_at(s: usize) -> (Vec<f64>, Vec<f64>) {
        let a = pseudo_random(A0.len(), 10 + s as u32);
        let b: Vec<f64> = pseudo_random(B0.len(), 100 + s as u32)
            .iter()
            .map(|x| x * 3.0)
            .collect();
        (a, b)
    }

    fn optimizer(config: AdamWConfig, dtype: DType) -> AdamW {
        // Given out of order: `new` sorts by name.
        let params = named(&[("b", &B0), ("a", &A0)], dtype);
        AdamW::new(params, config).unwrap()
    }

    fn run(opt: &mut AdamW, steps: std::ops::Range<usize>) {
        for s in steps {
            let (ga, gb) = grads_at(s);
            let g = buffers(opt.params(), &[("a", &ga), ("b", &gb)]);
            opt.step(&g).unwrap();
        }
    }

    fn check_against_reference(config: AdamWConfig, dtype: DType, tol: f64) -> AdamW {
        let mut opt = optimizer(config, dtype);
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
                &format!("a after {s}"),
            );
            assert_close(
                &values(&opt.params()[1].1),
                &rb.p,
                tol,
                &format!("b after {s}"),
            );
        }
        opt
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
            opt.step(&buffers(opt.params(), &[("w", &[0.5])])).unwrap();
            assert_close(&values(&opt.params()[0].1), &[expected], 1e-6, "w");
        }
    }

    #[test]
    fn fused_matches_the_published_formula_without_weight_decay() {
        let config = AdamWConfig {
            lr: 0.05,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        };
        let opt = check_against_reference(config, DType::F32, 2e-6);
        assert_eq!(
            opt.fallback_updates, 0,
            "f32 CPU parameters take the fused path"
        );
    }

    #[test]
    fn fused_matches_the_published_formula_with_weight_decay() {
        // beta1 0.3 takes the other branch of PyTorch's lerp (weight 1 - beta1 >= 0.5).
        for beta1 in [0.8, 0.3] {
            let config = AdamWConfig {
                lr: 0.02,
                beta1,
                beta2: 0.95,
                eps: 1e-6,
                weight_decay: 0.3,
            };
            let opt = check_against_reference(config, DType::F32, 2e-6);
            assert_eq!(opt.fallback_updates, 0);
        }
    }

    #[test]
    fn tensor_op_fallback_matches_the_published_formula_in_f64() {
        let config = AdamWConfig {
            lr: 0.02,
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let opt = check_against_reference(config, DType::F64, 1e-12);
        assert_eq!(
            opt.fallback_updates, 8,
            "f64 parameters take the tensor-op path"
        );
    }

    #[test]
    fn fused_and_tensor_op_paths_agree_on_f32() {
        let config = AdamWConfig {
            lr: 0.01,
            weight_decay: 0.05,
            ..AdamWConfig::default()
        };
        let mut fused = optimizer(config, DType::F32);
        let mut ops = optimizer(config, DType::F32);
        ops.force_fallback = true;
        run(&mut fused, 0..5);
        run(&mut ops, 0..5);
        assert_eq!((fused.fallback_updates, ops.fallback_updates), (0, 10));
        for i in 0..2 {
            let f = values(&fused.params()[i].1);
            assert_close(&values(&ops.params()[i].1), &f, 1e-6, "param");
        }
        let (fs, os) = (fused.state().unwrap(), ops.state().unwrap());
        for (k, t) in &fs.tensors {
            let f: Vec<f64> = t.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
            let o: Vec<f64> = os.tensors[k]
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_close(&o, &f, 1e-6, k);
        }
    }

    #[test]
    fn a_parameter_split_over_threads_equals_the_unsplit_update() {
        let n = 3001;
        let p0 = pseudo_random(n, 7);
        let make = || AdamW::new(named(&[("w", &p0)], DType::F32), AdamWConfig::default()).unwrap();
        let (mut whole, mut split) = (make(), make());
        split.parallel_min_elems = 100;
        for s in 0..3 {
            let g = pseudo_random(n, 20 + s);
            whole.step(&buffers(whole.params(), &[("w", &g)])).unwrap();
            split.step(&buffers(split.params(), &[("w", &g)])).unwrap();
        }
        assert_eq!(values(&whole.params()[0].1), values(&split.params()[0].1));
        assert_ne!(values(&whole.params()[0].1), p0, "the parameter did move");
    }

    #[test]
    fn a_parameter_without_gradient_is_untouched_and_keeps_its_step_count() {
        let config = AdamWConfig {
            lr: 0.1,
            weight_decay: 0.5,
            ..AdamWConfig::default()
        };
        let mut opt = optimizer(config, DType::F32);
        let (mut ra, mut rb) = (Reference::new(&A0), Reference::new(&B0));
        for s in 0..3 {
            let (ga, _) = grads_at(s);
            opt.step(&buffers(opt.params(), &[("a", &ga)])).unwrap();
            ra.step(&ga, &config);
        }
        // Not even weight decay reached "b".
        assert_eq!(
            values(&opt.params()[1].1),
            B0.map(|x| x as f32 as f64).to_vec(),
            "bit for bit, as stored in f32"
        );
        let state = opt.state().unwrap();
        assert_eq!(state.scalars["step.a"], 3.0);
        assert!(!state.scalars.contains_key("step.b"));
        assert!(!state.tensors.contains_key("exp_avg.b"));
        // Its first gradient is its step 1 (full bias correction), while "a" is at step 4.
        let (ga, gb) = grads_at(3);
        opt.step(&buffers(opt.params(), &[("a", &ga), ("b", &gb)]))
            .unwrap();
        ra.step(&ga, &config);
        rb.step(&gb, &config);
        assert_close(&values(&opt.params()[0].1), &ra.p, 2e-6, "a");
        assert_close(&values(&opt.params()[1].1), &rb.p, 2e-6, "b");
        let state = opt.state().unwrap();
        assert_eq!(
            (state.scalars["step.a"], state.scalars["step.b"]),
            (4.0, 1.0)
        );
    }

    #[test]
    fn the_learning_rate_is_read_at_every_step() {
        let config = AdamWConfig {
            lr: 0.1,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::new(named(&[("w", &[1.0])], DType::F32), config).unwrap();
        opt.learning_rate().clone().set(0.0);
        opt.step(&buffers(opt.params(), &[("w", &[0.5])])).unwrap();
        assert_eq!(values(&opt.params()[0].1), vec![1.0], "lr 0 moves nothing");
        assert_eq!(opt.config().lr, 0.0);
    }

    fn contents(s: &OptimizerState) -> (BTreeMap<String, Vec<f32>>, BTreeMap<String, f64>) {
        let tensors = s
            .tensors
            .iter()
            .map(|(k, t)| (k.clone(), t.flatten_all().unwrap().to_vec1().unwrap()))
            .collect();
        (tensors, s.scalars.clone())
    }

    #[test]
    fn state_round_trip_continues_identically() {
        let config = AdamWConfig {
            lr: 0.03,
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let mut straight = optimizer(config, DType::F32);
        run(&mut straight, 0..5);

        let mut first = optimizer(config, DType::F32);
        run(&mut first, 0..2);
        let saved = first.state().unwrap();
        let saved_contents = contents(&saved);
        // Moving on does not reach the saved copy.
        run(&mut first, 2..3);
        assert_eq!(contents(&saved), saved_contents, "state() is a deep copy");

        // A fresh optimizer over parameters holding the values at the time of saving.
        let mut resumed = AdamW::new(
            named(&[("a", &A0), ("b", &B0)], DType::F32),
            AdamWConfig::default(),
        )
        .unwrap();
        let mut at_save = optimizer(config, DType::F32);
        run(&mut at_save, 0..2);
        for ((_, dst), (_, src)) in resumed.params().iter().zip(at_save.params()) {
            dst.set(src.as_tensor()).unwrap();
        }
        resumed.load_state(&saved).unwrap();
        assert_eq!(
            resumed.config(),
            config,
            "hyper-parameters come from the state"
        );
        run(&mut resumed, 2..5);
        assert_eq!(
            contents(&saved),
            saved_contents,
            "load_state copies the tensors"
        );
        for i in 0..2 {
            assert_eq!(
                values(&resumed.params()[i].1),
                values(&straight.params()[i].1)
            );
        }
        assert_eq!(
            contents(&resumed.state().unwrap()),
            contents(&straight.state().unwrap())
        );
    }

    #[test]
    fn mismatched_states_are_rejected_and_nothing_is_loaded() {
        let config = AdamWConfig::default();
        let mut source = optimizer(config, DType::F32);
        run(&mut source, 0..2);
        let good = source.state().unwrap();

        let mut target = optimizer(config, DType::F32);
        run(&mut target, 0..1);
        let before = contents(&target.state().unwrap());

        // The model's "b" is called "c" in the state.
        let mut renamed = good.clone();
        for what in ["exp_avg", "exp_avg_sq"] {
            let t = renamed.tensors.remove(&format!("{what}.b")).unwrap();
            renamed.tensors.insert(format!("{what}.c"), t);
        }
        let step = renamed.scalars.remove("step.b").unwrap();
        renamed.scalars.insert("step.c".into(), step);
        let err = target.load_state(&renamed).unwrap_err().to_string();
        assert!(
            err.contains("exp_avg.c") && err.contains("parameter names"),
            "{err}"
        );

        let mut incomplete = good.clone();
        incomplete.tensors.remove("exp_avg_sq.b");
        let err = target.load_state(&incomplete).unwrap_err().to_string();
        assert!(err.contains("\"exp_avg_sq.b\" missing"), "{err}");

        let mut unknown = good.clone();
        unknown.scalars.insert("step.z".into(), 1.0);
        let err = target.load_state(&unknown).unwrap_err().to_string();
        assert!(
            err.contains("step.z") && err.contains("parameter names"),
            "{err}"
        );

        let mut reshaped = good.clone();
        reshaped.tensors.insert(
            "exp_avg_sq.a".into(),
            Tensor::zeros(4, DType::F32, &candle_core::Device::Cpu).unwrap(),
        );
        let err = target.load_state(&reshaped).unwrap_err().to_string();
        assert!(
            err.contains("exp_avg_sq.a") && err.contains("[4]") && err.contains("[5]"),
            "{err}"
        );

        let mut wrong_kind = good.clone();
        wrong_kind.kind = "sgd".into();
        let err = target.load_state(&wrong_kind).unwrap_err().to_string();
        assert!(
            err.contains("\"sgd\"") && err.contains("\"adamw\""),
            "{err}"
        );

        let mut no_beta = good.clone();
        no_beta.scalars.remove("beta2");
        let err = target.load_state(&no_beta).unwrap_err().to_string();
        assert!(err.contains("beta2"), "{err}");

        let mut bad_beta = good.clone();
        bad_beta.scalars.insert("beta1".into(), 1.0);
        let err = target.load_state(&bad_beta).unwrap_err().to_string();
        assert!(err.contains("beta1"), "{err}");

        assert_eq!(
            contents(&target.state().unwrap()),
            before,
            "failed loads change nothing"
        );
        target.load_state(&good).unwrap();
        assert_eq!(contents(&target.state().unwrap()), contents(&good));
    }

    #[test]
    fn invalid_hyper_parameters_are_rejected() {
        let params = || named(&[("w", &[1.0])], DType::F32);
        for (config, word) in [
            (
                AdamWConfig {
                    lr: -1e-3,
                    ..Default::default()
                },
                "learning rate",
            ),
            (
                AdamWConfig {
                    beta1: 1.0,
                    ..Default::default()
                },
                "beta1",
            ),
            (
                AdamWConfig {
                    beta2: -0.1,
                    ..Default::default()
                },
                "beta2",
            ),
            (
                AdamWConfig {
                    eps: -1.0,
                    ..Default::default()
                },
                "eps",
            ),
            (
                AdamWConfig {
                    weight_decay: f64::NAN,
                    ..Default::default()
                },
                "weight_decay",
            ),
        ] {
            let err = AdamW::new(params(), config).unwrap_err().to_string();
            assert!(err.contains(word), "{err}");
        }
        let dup = vec![
            named(&[("w", &[1.0])], DType::F32).remove(0),
            named(&[("w", &[2.0])], DType::F32).remove(0),
        ];
        let err = AdamW::new(dup, AdamWConfig::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"w\"") && err.contains("twice"), "{err}");
        let err = AdamW::new(vec![], AdamWConfig::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("empty"), "{err}");
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

    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a GPU (scripts/gpu-build.sh build, then run on a GPU machine)"]
    fn the_cuda_kernel_matches_the_cpu_kernel_in_one_launch_per_parameter() {
        use crate::optim::test_util::{cuda_buffers, on_cuda};
        let config = AdamWConfig {
            lr: 0.01,
            weight_decay: 0.05,
            ..AdamWConfig::default()
        };
        let mut cpu = optimizer(config, DType::F32);
        let mut gpu = AdamW::new(on_cuda(cpu.params()), config).unwrap();
        for s in 0..5 {
            let (ga, gb) = grads_at(s);
            run(&mut cpu, s..s + 1);
            gpu.step(&cuda_buffers(gpu.params(), &[("a", &ga), ("b", &gb)]))
                .unwrap();
        }
        assert_eq!(gpu.fallback_updates, 0, "every update took the CUDA kernel");
        for i in 0..2 {
            let c = values(&cpu.params()[i].1);
            assert_close(&values(&gpu.params()[i].1), &c, 1e-6, "param on the GPU");
        }
    }
}
