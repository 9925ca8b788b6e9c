//! The optimizer around an [`UpdateRule`]: per-parameter state, the walk over the parameters, the
//! choice between the fused kernel and tensor ops, save and load, and the learning-rate handle.
//!
//! A parameter is updated by the fused path when it, its gradient and its state are contiguous f32
//! tensors on the CPU (the rule's slice kernel, several threads for large parameters) or on one
//! GPU (the rule's CUDA kernel, one launch); everything else (other dtypes, a gradient on another
//! device) takes the rule's tensor ops.

use candle_core::{Tensor, Var};

use super::kernels;
use super::rule::UpdateRule;
use super::state::{key, snapshot, state_dtype, OptimizerState, StateReader};
use super::{LearningRate, Optimizer};
use crate::cpu_slices::{with_f32, with_f32_mut};
use crate::error::{Error, Result};
use crate::grads::GradientBuffers;

/// The state of one parameter, created at its first update.
#[derive(Debug)]
struct ParamState {
    /// The rule's state tensors, in [`UpdateRule::state_names`] order.
    tensors: Vec<Tensor>,
    /// Updates so far (kept for every rule; saved only by rules that count steps).
    step: u64,
}

/// An optimizer over named parameters that applies the update rule `R` to each parameter with a
/// gradient; [`Sgd`](super::Sgd) and [`AdamW`](super::AdamW) are this type over their
/// configurations.
///
/// State tensors are f32 (f64 for f64 parameters), created at a parameter's first update; a
/// parameter that never had a gradient has no state and is not touched, as in PyTorch.
#[derive(Debug)]
pub struct ElementwiseOptimizer<R: UpdateRule> {
    params: Vec<(String, Var)>,
    states: Vec<Option<ParamState>>,
    rule: R,
    lr: LearningRate,
    /// Parameters with more elements are updated by several threads.
    pub(crate) parallel_min_elems: usize,
    /// Use the tensor-op path even where the fused one applies (tests compare the two).
    pub(crate) force_fallback: bool,
    /// How many parameter updates took the tensor-op path (tests prove the fused path ran).
    pub(crate) fallback_updates: u64,
}

impl<R: UpdateRule> ElementwiseOptimizer<R> {
    /// An optimizer over `params` (sorted by name here; names must be unique) with the
    /// hyper-parameters `rule`, whose learning rate starts the [`LearningRate`] handle.
    pub fn new(params: Vec<(String, Var)>, rule: R) -> Result<Self> {
        rule.validate()?;
        if params.is_empty() {
            return Err(Error::Optimizer(format!(
                "{} got an empty parameter list; pass the model's named variables \
                 (e.g. from the VarMap the model was built with)",
                R::NAME
            )));
        }
        let params = crate::grads::sorted_named_vars(params)?;
        let states = params.iter().map(|_| None).collect();
        Ok(Self {
            params,
            states,
            lr: LearningRate::new(rule.lr()),
            rule,
            parallel_min_elems: kernels::PARALLEL_MIN_ELEMS,
            force_fallback: false,
            fallback_updates: 0,
        })
    }

    /// The hyper-parameters, with the learning rate read from the learning-rate handle.
    pub fn config(&self) -> R {
        let mut rule = self.rule.clone();
        rule.set_lr(self.lr.get());
        rule
    }
}

impl<R: UpdateRule> Optimizer for ElementwiseOptimizer<R> {
    fn step(&mut self, grads: &GradientBuffers) -> Result<()> {
        let lr = current_lr(&self.lr)?;
        for ((name, var), slot) in self.params.iter().zip(self.states.iter_mut()) {
            let Some(grad) = grads.get(name) else {
                continue;
            };
            check_grad(name, var, grad)?;
            let first = slot.is_none();
            let state = match slot {
                Some(state) => state,
                None => slot.insert(ParamState {
                    tensors: zeros_like(var, self.rule.state_names().len())?,
                    step: 0,
                }),
            };
            let step = state.step + 1;
            let fused = !self.force_fallback
                && update_fused(
                    &self.rule,
                    var,
                    grad,
                    &state.tensors,
                    (lr, step, first),
                    self.parallel_min_elems,
                )?;
            if !fused {
                let dtype = state_dtype(var.dtype());
                let param = var.as_tensor().detach().to_dtype(dtype)?;
                let grad = grad.detach().to_device(var.device())?.to_dtype(dtype)?;
                let value =
                    self.rule
                        .update_tensors(&param, &grad, &mut state.tensors, lr, step, first)?;
                var.set(&value.to_dtype(var.dtype())?)?;
                self.fallback_updates += 1;
            }
            state.step = step;
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
        let mut saved = OptimizerState::new(R::KIND);
        for (k, v) in self.config().hyper_parameters() {
            saved.scalars.insert(k.to_string(), v);
        }
        let names = self.rule.state_names();
        for ((param, _), slot) in self.params.iter().zip(&self.states) {
            let Some(state) = slot else { continue };
            for (what, t) in names.iter().zip(&state.tensors) {
                saved.tensors.insert(key(what, param), snapshot(t)?);
            }
            if R::COUNTS_STEPS {
                saved.scalars.insert(key("step", param), state.step as f64);
            }
        }
        Ok(saved)
    }

    fn load_state(&mut self, saved: &OptimizerState) -> Result<()> {
        let mut reader = StateReader::new(saved, R::KIND)?;
        let rule = R::from_hyper_parameters(&mut |name| reader.scalar(name))?;
        rule.validate()?;
        let names = rule.state_names();
        let mut states = Vec::with_capacity(self.params.len());
        for (param, var) in &self.params {
            let dtype = state_dtype(var.dtype());
            let mut found = Vec::with_capacity(names.len());
            for what in names {
                found.push(reader.tensor(what, param, var, dtype)?);
            }
            let step = if R::COUNTS_STEPS {
                Some(reader.step(param)?)
            } else {
                None
            };
            let present = found.iter().filter(|t| t.is_some()).count()
                + usize::from(matches!(step, Some(Some(_))));
            let expected = names.len() + usize::from(R::COUNTS_STEPS);
            states.push(if present == 0 {
                None
            } else if present == expected {
                Some(ParamState {
                    tensors: found.into_iter().flatten().collect(),
                    step: step.flatten().unwrap_or(0),
                })
            } else {
                let mut entries: Vec<String> = names
                    .iter()
                    .zip(&found)
                    .map(|(what, t)| presence(what, param, t.is_some()))
                    .collect();
                if let Some(step) = step {
                    entries.push(presence("step", param, step.is_some()));
                }
                return Err(Error::Optimizer(format!(
                    "{} state of parameter {param:?} is incomplete: {} (all {expected} are \
                     written together by state(); the checkpoint is damaged)",
                    R::NAME,
                    entries.join(" ")
                )));
            });
        }
        reader.finish()?;
        self.lr.set(rule.lr());
        self.rule = rule;
        self.states = states;
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

/// `n` zero tensors of the parameter's shape, in its state dtype, on its device.
fn zeros_like(var: &Var, n: usize) -> Result<Vec<Tensor>> {
    let dtype = state_dtype(var.dtype());
    (0..n)
        .map(|_| Ok(Tensor::zeros(var.shape(), dtype, var.device())?))
        .collect()
}

/// The learning rate to use now, rejected if a scheduler or user set something meaningless.
fn current_lr(lr: &LearningRate) -> Result<f64> {
    let value = lr.get();
    if !(value.is_finite() && value >= 0.0) {
        return Err(Error::Optimizer(format!(
            "learning rate is {value}; it must be finite and >= 0 (check what set the \
             LearningRate handle: the optimizer config or a scheduler's base learning rate)"
        )));
    }
    Ok(value)
}

/// Checks that `grad` fits parameter `name`.
fn check_grad(name: &str, var: &Var, grad: &Tensor) -> Result<()> {
    if grad.shape() != var.shape() {
        return Err(Error::Optimizer(format!(
            "gradient of {name:?} has shape {:?} but the parameter has shape {:?}; the gradient \
             buffers were built for other parameters than the optimizer's",
            grad.dims(),
            var.dims()
        )));
    }
    Ok(())
}

/// Flattens one level of the `Result<Option<_>>` returned by nested slice-access calls: `Some`
/// only if every level ran.
fn nested<T>(r: Result<Option<Result<Option<T>>>>) -> Result<Option<T>> {
    Ok(r?.transpose()?.flatten())
}

/// The rule's fused update of one parameter, `(lr, step, first)` as in
/// [`UpdateRule::f32_kernel`]; `Ok(false)` (nothing touched) when some tensor is not a contiguous
/// f32 tensor on the CPU (or, with CUDA, on the parameter's GPU).
fn update_fused<R: UpdateRule>(
    rule: &R,
    var: &Var,
    grad: &Tensor,
    state: &[Tensor],
    (lr, step, first): (f64, u64, bool),
    parallel_min: usize,
) -> Result<bool> {
    let ran = if var.device().is_cpu() {
        let kernel = rule.f32_kernel(lr, step, first);
        nested(with_f32(grad, |g| {
            nested(with_f32_mut(var.as_tensor(), |p| {
                with_all_f32_mut(state, Vec::with_capacity(state.len()), &mut |s| {
                    kernels::apply_split(p, g, s, parallel_min, &kernel)
                })
            }))
        }))?
    } else {
        None
    };
    #[cfg(feature = "cuda")]
    if ran.is_none() {
        return update_fused_cuda(rule, var, grad, state, (lr, step, first));
    }
    Ok(ran.is_some())
}

/// Runs `f` on the f32 elements of every tensor of `tensors` (after the slices already `held`),
/// in place, if they are all contiguous f32 CPU tensors; `Ok(None)` and nothing run otherwise.
fn with_all_f32_mut<T>(
    tensors: &[Tensor],
    held: Vec<&mut [f32]>,
    f: &mut dyn FnMut(&mut [&mut [f32]]) -> T,
) -> Result<Option<T>> {
    let Some((tensor, rest)) = tensors.split_first() else {
        let mut held = held;
        return Ok(Some(f(&mut held)));
    };
    nested(with_f32_mut(tensor, move |slice| {
        // Rebound so that the vector holds borrows as short as `slice`'s.
        let mut held: Vec<&mut [f32]> = held;
        held.push(slice);
        with_all_f32_mut(rest, held, f)
    }))
}

/// [`update_fused`] on the GPU: one kernel launch; `Ok(false)` when some tensor is not a
/// contiguous f32 CUDA tensor, the gradient is on another GPU, or the rule has no kernel.
#[cfg(feature = "cuda")]
fn update_fused_cuda<R: UpdateRule>(
    rule: &R,
    var: &Var,
    grad: &Tensor,
    state: &[Tensor],
    (lr, step, first): (f64, u64, bool),
) -> Result<bool> {
    use crate::cuda_slices::{with_cuda_f32, with_cuda_f32_mut};
    // A kernel on the parameter's stream cannot read another GPU's memory: a gradient elsewhere
    // takes the tensor-op path, which moves it.
    if !grad.device().same_device(var.device()) {
        return Ok(false);
    }
    let ran = nested(with_cuda_f32(grad, |g| {
        nested(with_cuda_f32_mut(var.as_tensor(), |device, mut p| {
            with_all_cuda_f32_mut(state, Vec::with_capacity(state.len()), &mut |s| {
                rule.launch_cuda(device, &mut p, &g, s, lr, step, first)
            })
            .and_then(|launched| launched.transpose())
        }))
    }))?;
    Ok(ran == Some(true))
}

/// [`with_all_f32_mut`] for CUDA tensors.
#[cfg(feature = "cuda")]
fn with_all_cuda_f32_mut<T>(
    tensors: &[Tensor],
    held: Vec<candle_core::cuda_backend::cudarc::driver::CudaViewMut<'_, f32>>,
    f: &mut dyn FnMut(&mut [candle_core::cuda_backend::cudarc::driver::CudaViewMut<'_, f32>]) -> T,
) -> Result<Option<T>> {
    use candle_core::cuda_backend::cudarc::driver::CudaViewMut;
    let Some((tensor, rest)) = tensors.split_first() else {
        let mut held = held;
        return Ok(Some(f(&mut held)));
    };
    nested(crate::cuda_slices::with_cuda_f32_mut(
        tensor,
        move |_, view| {
            // Rebound so that the vector holds borrows as short as `view`'s.
            let mut held: Vec<CudaViewMut<'_, f32>> = held;
            held.push(view);
            with_all_cuda_f32_mut(rest, held, f)
        },
    ))
}
