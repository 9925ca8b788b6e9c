//! The optimizer around an [`UpdateRule`]: per-parameter state, the walk over the parameters, the
//! choice between the fused kernel and tensor ops, save and load, and the learning-rate handle.
//!
//! A parameter is updated by the fused path when it, its gradient and its state are contiguous f32
//! tensors on the CPU (the rule's slice kernel, several threads for large parameters) or on one
//! GPU (the rule's multi-tensor CUDA kernel: the step queues every such parameter and updates them
//! all in one launch per device); everything else (other dtypes, a gradient on another device)
//! takes the rule's tensor ops.
//!
//! Under mixed precision each parameter may have a half-precision compute copy
//! ([`Optimizer::set_compute_copies`]); every path writes it from the updated value, the fused ones
//! in the update's own pass over the data, so that no cast of the whole model follows the step.

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::{DType, Tensor, Var};

use super::group::ParamGroup;
use super::kernels;
use super::rule::{Step, UpdateRule};
use super::state::{key, snapshot, state_dtype, OptimizerState, StateReader};
use super::Gradients;
use super::{LearningRate, Optimizer};
use crate::cpu_slices::{with_f32, with_f32_mut};
use crate::cpu_slices::{with_half_mut, HalfSliceMut};
use crate::error::{Error, Result};

/// The state of one parameter, created at its first update.
#[derive(Debug)]
struct ParamState {
    /// The rule's state tensors, in [`UpdateRule::state_names`] order.
    tensors: Vec<Tensor>,
    /// Updates so far (kept for every rule; saved only by rules that count steps).
    step: u64,
}

/// An optimizer over named parameters, in one or more [`ParamGroup`]s, that applies the update
/// rule `R` to each parameter with a gradient, with its group's hyper-parameters;
/// [`Sgd`](super::Sgd) and [`AdamW`](super::AdamW) are this type over their configurations.
///
/// State tensors are f32 (f64 for f64 parameters), created at a parameter's first update; a
/// parameter that never had a gradient has no state and is not touched, as in PyTorch.
#[derive(Debug)]
pub struct ElementwiseOptimizer<R: UpdateRule> {
    /// Every group's parameters, sorted by name.
    params: Vec<(String, Var)>,
    /// The group of each parameter of `params`.
    group_of: Vec<usize>,
    states: Vec<Option<ParamState>>,
    /// Each group's hyper-parameters (their learning rates are the handle's initial ones).
    rules: Vec<R>,
    /// One rate per group.
    lr: LearningRate,
    /// Parameters with more elements are updated by several threads.
    pub(crate) parallel_min_elems: usize,
    /// Use the tensor-op path even where the fused one applies (tests compare the two).
    pub(crate) force_fallback: bool,
    /// How many parameter updates took the tensor-op path (tests prove the fused path ran).
    pub(crate) fallback_updates: u64,
    /// Under ZeRO: the piece (a range of its flattened elements) of each parameter that this
    /// optimizer keeps state for and updates; `None` inside for a parameter it has no piece of.
    pieces: Option<Vec<Option<Range<usize>>>>,
    /// Mixed precision: each parameter's half-precision compute copy, written by every update.
    copies: Vec<Option<Var>>,
    /// Which compute copies the last step wrote whole.
    copies_written: Vec<bool>,
    /// The tensor tables of the multi-tensor CUDA launches, kept on the devices between steps.
    #[cfg(feature = "cuda")]
    pub(crate) cuda: super::cuda_kernels::MultiTensorCache,
}

impl<R: UpdateRule> ElementwiseOptimizer<R> {
    /// An optimizer over `params` (sorted by name here; names must be unique) with the
    /// hyper-parameters `rule`, whose learning rate starts the [`LearningRate`] handle: one
    /// parameter group.
    pub fn new(params: Vec<(String, Var)>, rule: R) -> Result<Self> {
        Self::with_groups(vec![ParamGroup::new(params, rule)])
    }

    /// An optimizer over parameter groups, each with its own hyper-parameters, as PyTorch's
    /// `param_groups`; the [`LearningRate`] handle holds one rate per group, in this order. A
    /// parameter name may appear in only one group; a group may be empty, but not all of them.
    pub fn with_groups(groups: Vec<ParamGroup<R>>) -> Result<Self> {
        if groups.is_empty() {
            return Err(Error::Optimizer(format!(
                "{} got no parameter groups; use {}::new(params, config) for one group",
                R::NAME,
                R::NAME
            )));
        }
        let mut named = Vec::new();
        let mut rules = Vec::with_capacity(groups.len());
        for (g, group) in groups.into_iter().enumerate() {
            group.config.validate().map_err(|e| match (&e, g) {
                (Error::Optimizer(m), 1..) => Error::Optimizer(format!("parameter group {g}: {m}")),
                _ => e,
            })?;
            named.extend(group.params.into_iter().map(|(n, v)| (n, (v, g))));
            rules.push(group.config);
        }
        if named.is_empty() {
            return Err(Error::Optimizer(format!(
                "{} got an empty parameter list; pass the model's named variables \
                 (e.g. from the VarMap the model was built with)",
                R::NAME
            )));
        }
        named.sort_by(|a, b| a.0.cmp(&b.0));
        for pair in named.windows(2) {
            if pair[0].0 == pair[1].0 {
                let (a, b) = (pair[0].1 .1, pair[1].1 .1);
                return Err(Error::Optimizer(if a == b {
                    format!(
                        "parameter name {:?} appears twice in parameter group {a}; every \
                         parameter needs a unique name",
                        pair[0].0
                    )
                } else {
                    format!(
                        "parameter {:?} is in parameter groups {a} and {b}; a parameter may be in \
                         only one group (PyTorch refuses this too)",
                        pair[0].0
                    )
                }));
            }
        }
        let (params, group_of): (Vec<_>, Vec<usize>) =
            named.into_iter().map(|(n, (v, g))| ((n, v), g)).unzip();
        let lr = LearningRate::per_group(&rules.iter().map(R::lr).collect::<Vec<_>>());
        let states = group_of.iter().map(|_| None).collect();
        Ok(Self {
            copies: group_of.iter().map(|_| None).collect(),
            copies_written: vec![false; group_of.len()],
            params,
            group_of,
            states,
            lr,
            rules,
            parallel_min_elems: kernels::PARALLEL_MIN_ELEMS,
            force_fallback: false,
            fallback_updates: 0,
            pieces: None,
            #[cfg(feature = "cuda")]
            cuda: Default::default(),
        })
    }

    /// The hyper-parameters of the first parameter group (the only one, in the common case), with
    /// the learning rate read from the learning-rate handle.
    pub fn config(&self) -> R {
        self.group_configs().swap_remove(0)
    }

    /// Every parameter group's hyper-parameters, with the learning rates read from the handle.
    pub fn group_configs(&self) -> Vec<R> {
        self.rules
            .iter()
            .zip(self.lr.get_all())
            .map(|(rule, lr)| {
                let mut rule = rule.clone();
                rule.set_lr(lr);
                rule
            })
            .collect()
    }

    /// The names of each parameter group's parameters, sorted, in group order.
    pub fn group_params(&self) -> Vec<Vec<&str>> {
        let mut out = vec![Vec::new(); self.rules.len()];
        for ((name, _), &g) in self.params.iter().zip(&self.group_of) {
            out[g].push(name.as_str());
        }
        out
    }
}

/// The scalar holding the number of parameter groups (only states of several groups have it).
const GROUPS_KEY: &str = "param_groups";

/// The scalar holding hyper-parameter `what` of group `g`, in a state of several groups.
fn group_key(g: usize, what: &str) -> String {
    format!("{GROUPS_KEY}.{g}.{what}")
}

/// The scalar holding the group of parameter `name`, in a state of several groups.
fn membership_key(name: &str) -> String {
    key("param_group", name)
}

impl<R: UpdateRule> Optimizer for ElementwiseOptimizer<R> {
    fn step(&mut self, grads: Gradients<'_>) -> Result<()> {
        let lrs = current_lrs(&self.lr)?;
        self.copies_written.fill(false);
        // Parameters queued for the multi-tensor CUDA launch: (index, step, whole copy written).
        #[cfg(feature = "cuda")]
        let mut batch = super::cuda_kernels::CudaBatch::default();
        #[cfg(feature = "cuda")]
        let mut queued: Vec<(usize, u64, bool)> = Vec::new();
        // The tensors the queued launch reads, alive until it is queued.
        #[cfg(feature = "cuda")]
        let mut held: Vec<Tensor> = Vec::new();
        for i in 0..self.params.len() {
            let (name, var) = &self.params[i];
            let slot = &mut self.states[i];
            let piece = match &self.pieces {
                None => None,
                Some(pieces) => {
                    if !grads.has_gradient(name) {
                        continue;
                    }
                    match &pieces[i] {
                        Some(piece) => Some(piece.clone()),
                        None => {
                            // No piece here: only the step count advances, so that every rank
                            // counts every parameter's steps (a checkpoint's step counts are
                            // complete on any rank).
                            slot.get_or_insert_with(|| ParamState {
                                tensors: Vec::new(),
                                step: 0,
                            })
                            .step += 1;
                            continue;
                        }
                    }
                }
            };
            let (param, grad) = match &piece {
                None => {
                    let Some(grad) = grads.get(name) else {
                        continue;
                    };
                    check_grad(name, var, grad)?;
                    (var.as_tensor().clone(), grad.clone())
                }
                Some(piece) => {
                    let grad = grads.piece(name, piece.clone())?;
                    let flat = var.as_tensor().flatten_all()?;
                    (flat.narrow(0, piece.start, piece.len())?, grad)
                }
            };
            // The compute copy, or its piece: what this update writes besides the parameter.
            let copy = match (&self.copies[i], &piece) {
                (None, _) => None,
                (Some(copy), None) => Some(copy.as_tensor().clone()),
                (Some(copy), Some(piece)) => Some(copy.as_tensor().flatten_all()?.narrow(
                    0,
                    piece.start,
                    piece.len(),
                )?),
            };
            let whole_copy =
                copy.is_some() && piece.as_ref().is_none_or(|p| p.len() == var.elem_count());
            let g = self.group_of[i];
            let (rule, lr) = (&self.rules[g], lrs[g]);
            let n_state = rule.state_names().len();
            let first = slot.as_ref().is_none_or(|s| s.tensors.len() != n_state);
            let state = match slot {
                Some(state) if !first => state,
                _ => slot.insert(ParamState {
                    tensors: zeros_like(&param, n_state)?,
                    step: slot.as_ref().map_or(0, |s| s.step),
                }),
            };
            let step = state.step + 1;
            let fused = !self.force_fallback
                && update_fused(
                    rule,
                    &param,
                    &grad,
                    &state.tensors,
                    copy.as_ref(),
                    (lr, step, first),
                    self.parallel_min_elems,
                )?;
            if fused {
                state.step = step;
                self.copies_written[i] = whole_copy;
                continue;
            }
            #[cfg(feature = "cuda")]
            if let Some(update) = rule
                .cuda_update(Step {
                    lr,
                    count: step,
                    first,
                })
                .filter(|_| !self.force_fallback)
            {
                if batch.push(&update, &param, &grad, &state.tensors, copy.as_ref())? {
                    queued.push((i, step, whole_copy));
                    held.extend([param, grad]);
                    held.extend(state.tensors.iter().cloned());
                    held.extend(copy);
                    continue;
                }
            }
            let dtype = state_dtype(var.dtype());
            let p = param.detach().to_dtype(dtype)?;
            let grad = grad.detach().to_device(var.device())?.to_dtype(dtype)?;
            let value = rule.update_tensors(
                &p,
                &grad,
                &mut state.tensors,
                Step {
                    lr,
                    count: step,
                    first,
                },
            )?;
            let value = value.to_dtype(var.dtype())?;
            // The compute copy takes the new value rounded as a cast of the master rounds it.
            let rounded = match &copy {
                Some(copy) => Some(value.to_dtype(copy.dtype())?),
                None => None,
            };
            match &piece {
                None => var.set(&value)?,
                Some(piece) => {
                    var.as_tensor()
                        .flatten_all()?
                        .slice_set(&value, 0, piece.start)?;
                }
            }
            if let (Some(rounded), Some(copy)) = (rounded, &self.copies[i]) {
                match &piece {
                    None => copy.set(&rounded)?,
                    Some(piece) => {
                        copy.as_tensor()
                            .flatten_all()?
                            .slice_set(&rounded, 0, piece.start)?
                    }
                }
            }
            self.fallback_updates += 1;
            state.step = step;
            self.copies_written[i] = whole_copy;
        }
        #[cfg(feature = "cuda")]
        if !batch.is_empty() {
            batch.launch(&mut self.cuda)?;
            drop(held);
            for (i, step, whole_copy) in queued {
                if let Some(state) = &mut self.states[i] {
                    state.step = step;
                }
                self.copies_written[i] = whole_copy;
            }
        }
        Ok(())
    }

    fn set_compute_copies(&mut self, copies: &[(String, Var)]) -> Result<()> {
        let mut found: Vec<Option<Var>> = self.params.iter().map(|_| None).collect();
        for (name, copy) in copies {
            let i = self
                .params
                .binary_search_by(|(n, _)| n.as_str().cmp(name))
                .map_err(|_| {
                    Error::Optimizer(format!(
                        "compute copy {name:?} belongs to no parameter of this {} optimizer; give \
                         it the copies of its own parameters, by the same names",
                        R::NAME
                    ))
                })?;
            let master = &self.params[i].1;
            if copy.as_tensor().id() == master.as_tensor().id() {
                // A parameter kept in f32 is its own compute copy: nothing to write.
                continue;
            }
            let problem = if master.dtype() != DType::F32 {
                Some(format!("its master is {:?}, not F32", master.dtype()))
            } else if !matches!(copy.dtype(), DType::BF16 | DType::F16) {
                Some(format!("the copy is {:?}, not BF16 or F16", copy.dtype()))
            } else if copy.shape() != master.shape() {
                Some(format!(
                    "the copy has shape {:?} but the parameter {:?}",
                    copy.dims(),
                    master.dims()
                ))
            } else if !copy.device().same_device(master.device()) {
                Some(format!(
                    "the copy is on {:?} but the parameter on {:?}",
                    copy.device(),
                    master.device()
                ))
            } else {
                None
            };
            if let Some(problem) = problem {
                return Err(Error::Optimizer(format!(
                    "cannot keep the compute copy of parameter {name:?}: {problem}; compute copies \
                     are the bf16/f16 Vars of the model, paired with f32 masters of the same \
                     shape on the same device (MasterWeights does this under mixed precision)"
                )));
            }
            found[i] = Some(copy.clone());
        }
        self.copies = found;
        self.copies_written.fill(false);
        Ok(())
    }

    fn wrote_compute_copy(&self, name: &str) -> bool {
        self.params
            .binary_search_by(|(n, _)| n.as_str().cmp(name))
            .is_ok_and(|i| self.copies_written[i])
    }

    fn shard(&mut self, pieces: &BTreeMap<String, Range<usize>>) -> Result<()> {
        let ours: Vec<Option<Range<usize>>> = self
            .params
            .iter()
            .map(|(name, _)| pieces.get(name).cloned())
            .collect();
        // State the optimizer already has (loaded before `prepare`) is cut to the pieces.
        for ((slot, piece), (_, var)) in self.states.iter_mut().zip(&ours).zip(&self.params) {
            if let Some(state) = slot {
                state.tensors = match piece {
                    Some(piece) => state
                        .tensors
                        .iter()
                        .map(|t| {
                            Ok(t.flatten_all()?
                                .narrow(0, piece.start, piece.len())?
                                .force_contiguous()?)
                        })
                        .collect::<Result<_>>()?,
                    None => Vec::new(),
                };
                debug_assert!(piece.as_ref().is_none_or(|p| p.end <= var.elem_count()));
            }
        }
        self.pieces = Some(ours);
        Ok(())
    }

    lr_and_params_accessors!();

    /// With one group the hyper-parameters are saved under their bare names (`"lr"`, ...); with
    /// several, `"param_groups"` holds their number, `"param_groups.<g>.<name>"` group `g`'s
    /// hyper-parameters and `"param_group.<parameter>"` each parameter's group.
    fn state(&self) -> Result<OptimizerState> {
        let mut saved = OptimizerState::new(R::KIND);
        let configs = self.group_configs();
        if let [config] = configs.as_slice() {
            for (k, v) in config.hyper_parameters() {
                saved.scalars.insert(k.to_string(), v);
            }
        } else {
            saved
                .scalars
                .insert(GROUPS_KEY.into(), configs.len() as f64);
            for (g, config) in configs.iter().enumerate() {
                for (k, v) in config.hyper_parameters() {
                    saved.scalars.insert(group_key(g, k), v);
                }
            }
            for ((param, _), &g) in self.params.iter().zip(&self.group_of) {
                saved.scalars.insert(membership_key(param), g as f64);
            }
        }
        for (((param, _), slot), &g) in self.params.iter().zip(&self.states).zip(&self.group_of) {
            let Some(state) = slot else { continue };
            for (what, t) in self.rules[g].state_names().iter().zip(&state.tensors) {
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
        let rules = self.read_groups(&mut reader)?;
        let mut states = Vec::with_capacity(self.params.len());
        for (i, ((param, var), &g)) in self.params.iter().zip(&self.group_of).enumerate() {
            let names = rules[g].state_names();
            let dtype = state_dtype(var.dtype());
            let piece = self.pieces.as_ref().map(|p| p[i].clone());
            // Under ZeRO a parameter without a piece here keeps only its step count.
            let names = if matches!(piece, Some(None)) {
                &[][..]
            } else {
                names
            };
            let mut found = Vec::with_capacity(names.len());
            for what in names {
                found.push(reader.tensor(what, param, var, piece.clone().flatten(), dtype)?);
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
        self.lr
            .set_all(&rules.iter().map(R::lr).collect::<Vec<_>>())?;
        self.rules = rules;
        self.states = states;
        Ok(())
    }
}

impl<R: UpdateRule> ElementwiseOptimizer<R> {
    /// The saved groups' hyper-parameters (validated), after checking that the state has as many
    /// groups as this optimizer, with the same parameters in each.
    fn read_groups(&self, reader: &mut StateReader<'_>) -> Result<Vec<R>> {
        let saved_groups = match reader.optional_scalar(GROUPS_KEY)? {
            None => 1,
            Some(n) if n >= 2.0 && n.fract() == 0.0 && n < 1e6 => n as usize,
            Some(n) => {
                return Err(Error::Optimizer(format!(
                    "{} state scalar {GROUPS_KEY:?} is {n}; it must be a whole number >= 2 (a \
                     damaged checkpoint?)",
                    R::NAME
                )))
            }
        };
        let ours = self.rules.len();
        if saved_groups != ours {
            return Err(Error::Optimizer(format!(
                "the {} state was saved with {saved_groups} parameter group(s) but this optimizer \
                 has {ours}; build the optimizer with the same groups as the run that saved it",
                R::NAME
            )));
        }
        if ours == 1 {
            let rule = R::from_hyper_parameters(&mut |name| reader.scalar(name))?;
            rule.validate()?;
            return Ok(vec![rule]);
        }
        let mut moved = Vec::new();
        for ((param, _), &g) in self.params.iter().zip(&self.group_of) {
            let k = membership_key(param);
            let theirs = reader.scalar(&k)?;
            if theirs != g as f64 {
                moved.push(format!(
                    "{param:?} (saved in group {theirs}, here in group {g})"
                ));
            }
        }
        if !moved.is_empty() {
            return Err(Error::Optimizer(format!(
                "the {} state's parameter groups hold other parameters than this optimizer's: {}; \
                 build the groups as the run that saved the state did",
                R::NAME,
                moved.join(", ")
            )));
        }
        (0..ours)
            .map(|g| {
                let rule =
                    R::from_hyper_parameters(&mut |name| reader.scalar(&group_key(g, name)))?;
                rule.validate().map_err(|e| match e {
                    Error::Optimizer(m) => {
                        Error::Optimizer(format!("saved parameter group {g}: {m}"))
                    }
                    e => e,
                })?;
                Ok(rule)
            })
            .collect()
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

/// `n` zero tensors of the parameter's (or its piece's) shape, in its state dtype, on its device.
fn zeros_like(var: &Tensor, n: usize) -> Result<Vec<Tensor>> {
    let dtype = state_dtype(var.dtype());
    (0..n)
        .map(|_| Ok(Tensor::zeros(var.shape(), dtype, var.device())?))
        .collect()
}

/// Each group's learning rate to use now, rejected if a scheduler or user set something
/// meaningless.
fn current_lrs(lr: &LearningRate) -> Result<Vec<f64>> {
    let values = lr.get_all();
    for (g, &value) in values.iter().enumerate() {
        if !(value.is_finite() && value >= 0.0) {
            let group = if values.len() > 1 {
                format!(" of parameter group {g}")
            } else {
                String::new()
            };
            return Err(Error::Optimizer(format!(
                "learning rate{group} is {value}; it must be finite and >= 0 (check what set the \
                 LearningRate handle: the optimizer config or a scheduler's base learning rate)"
            )));
        }
    }
    Ok(values)
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

/// The rule's fused update of one parameter on the CPU, `(lr, step, first)` as in
/// [`UpdateRule::f32_kernel`], writing `copy` (a bf16/f16 compute copy, or its piece) in the same
/// pass; `Ok(false)` (nothing touched) when some tensor is not a contiguous CPU tensor of its
/// dtype.
fn update_fused<R: UpdateRule>(
    rule: &R,
    var: &Tensor,
    grad: &Tensor,
    state: &[Tensor],
    copy: Option<&Tensor>,
    (lr, step, first): (f64, u64, bool),
    parallel_min: usize,
) -> Result<bool> {
    if !var.device().is_cpu() {
        return Ok(false);
    }
    let kernel = rule.f32_kernel(Step {
        lr,
        count: step,
        first,
    });
    let update = |p: &mut [f32], g: &[f32], copy: Option<HalfSliceMut<'_>>| {
        let mut copy = copy;
        with_all_f32_mut(state, Vec::with_capacity(state.len()), &mut |s| {
            kernels::apply_split(p, g, s, copy.take(), parallel_min, &kernel)
        })
    };
    let ran = nested(with_f32(grad, |g| {
        nested(with_f32_mut(var, |p| match copy {
            None => update(p, g, None),
            Some(copy) => nested(with_half_mut(copy, |c| update(p, g, Some(c)))),
        }))
    }))?;
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
