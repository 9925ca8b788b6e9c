//! A model to prepare ([`Model`]: its parameters, which are frozen, its own accumulation steps)
//! and the handle `prepare` returns for it ([`PreparedModel`]).
//!
//! Each prepared model has a training state of its own: its gradient buffers, its accumulation
//! counters, its optimizers and schedulers. Two models in one loop (a generator and a
//! discriminator) accumulate, sync and step independently; the data loaders are the
//! accelerator's, shared by all.

use std::sync::Arc;

use candle_core::{Tensor, Var};
use candle_nn::VarMap;

use crate::comm::ReduceOp;
use crate::error::Result;
use crate::fsdp::{ShardedUnit, UnitSpec};
use crate::training::{ModelParts, SharedSync, TrainingState};
use crate::window::MicroStep;
use crate::zero::CommLink;

/// Named parameters.
type NamedVars = Vec<(String, Var)>;

/// Which parameters a name pattern freezes.
type FrozenPredicate = Box<dyn Fn(&str) -> bool>;

/// A model to hand to [`Accelerator::prepare`](crate::Accelerator::prepare): its named
/// parameters, optionally some of them frozen, and optionally its own number of accumulation
/// steps.
///
/// Preparing a plain `Vec<(String, Var)>` or a `&VarMap` prepares the accelerator's first model
/// with every parameter trained. A `Model` also prepares a second (and third, ...) model, each
/// with its own gradients, accumulation, optimizer and scheduler.
///
/// Frozen parameters (PyTorch's `requires_grad = False`) get no gradient buffer, take no part in
/// the all-reduce, and no optimizer may hold them. They are broadcast from rank 0 once, at
/// `prepare`, so that every rank starts from the same weights, and never again. candle still
/// differentiates a `Var` the forward pass reads: build the frozen part from plain tensors
/// (`var.as_detached_tensor()`, or a `VarBuilder` over loaded tensors) to skip that work.
pub struct Model {
    params: NamedVars,
    frozen: Option<FrozenPredicate>,
    accumulation_steps: Option<usize>,
    units: Option<Vec<UnitSpec>>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("parameters", &self.params.len())
            .field("freezes", &self.frozen.is_some())
            .field("accumulation_steps", &self.accumulation_steps)
            .field("units", &self.units.as_ref().map(Vec::len))
            .finish()
    }
}

impl Model {
    /// A model of these named parameters, all trained, with the accelerator's accumulation steps.
    pub fn new(params: Vec<(String, Var)>) -> Self {
        Self {
            params,
            frozen: None,
            accumulation_steps: None,
            units: None,
        }
    }

    /// A model of every variable of `varmap`.
    pub fn from_varmap(varmap: &VarMap) -> Self {
        let params = crate::training::lock(varmap.data())
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        Self::new(params)
    }

    /// Freezes every parameter whose name `frozen` returns true for (for LoRA: everything but the
    /// adapters, `|name| !name.contains("lora_")`).
    pub fn freeze(mut self, frozen: impl Fn(&str) -> bool + 'static) -> Self {
        self.frozen = Some(Box::new(frozen));
        self
    }

    /// This model's own number of micro-steps per optimizer step (K), instead of the
    /// accelerator's: a discriminator that steps every micro-step (1) beside a generator that
    /// accumulates.
    pub fn gradient_accumulation_steps(mut self, k: usize) -> Self {
        self.accumulation_steps = Some(k);
        self
    }

    /// Declares the model's units (FSDP's wrapped modules): each is gathered, computed and
    /// freed as one under ZeRO stage 3, which needs them; every parameter must be in exactly
    /// one. At the other stages they only group the parameters, so one model code, computing
    /// each unit through [`PreparedModel::unit`], runs at every stage.
    pub fn units(mut self, units: Vec<UnitSpec>) -> Self {
        self.units = Some(units);
        self
    }

    /// The parameters split into trained and frozen, in the order given, with the rest.
    pub(crate) fn into_parts(self) -> ModelParts {
        let (frozen, trained) = match &self.frozen {
            Some(is_frozen) => self.params.into_iter().partition(|(n, _)| is_frozen(n)),
            None => (Vec::new(), self.params),
        };
        ModelParts {
            trained,
            frozen,
            accumulation_steps: self.accumulation_steps,
            units: self.units,
        }
    }
}

/// A prepared model: which of the accelerator's models it is, its trained and frozen
/// parameters, and its own accumulation state, with the calls of one model's training loop:
/// [`accumulate`](Self::accumulate) begins a micro-step, [`backward`](Self::backward) runs the
/// backward pass into this model's gradients, [`clip_grad_norm`](Self::clip_grad_norm) clips
/// them, and the optimizer prepared over its parameters steps with its gradients only.
///
/// `prepare(Model::new(..))` returns one for each further model;
/// [`Accelerator::model`](crate::Accelerator::model) returns the first model's, the one the
/// accelerator's own loop calls (`acc.backward`, `acc.accumulate`) act on.
///
/// The calls that average across ranks ([`backward`](Self::backward) on the micro-step that
/// syncs, [`set_window_items`](Self::set_window_items)) are collectives through the
/// accelerator's communicator: make them on the thread that built the accelerator, while it
/// lives (an error says so otherwise).
#[derive(Clone)]
pub struct PreparedModel {
    index: usize,
    training: Arc<TrainingState>,
    /// The accelerator's communicator, reachable from this handle (which is `Send`, while the
    /// communicator is not).
    comm: CommLink,
    /// How gradients are averaged across ranks, shared by every model of the accelerator.
    sync: SharedSync,
}

impl std::fmt::Debug for PreparedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedModel")
            .field("index", &self.index)
            .field("training", &self.training)
            .finish_non_exhaustive()
    }
}

impl PreparedModel {
    pub(crate) fn new(
        index: usize,
        training: Arc<TrainingState>,
        comm: CommLink,
        sync: SharedSync,
    ) -> Self {
        Self {
            index,
            training,
            comm,
            sync,
        }
    }

    pub(crate) fn training(&self) -> &Arc<TrainingState> {
        &self.training
    }

    /// Which of the accelerator's models this is, in order of preparation (0 is the model a plain
    /// `Vec<(String, Var)>` or `&VarMap` prepares). Checkpoints name its files by it.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The trained parameters, sorted by name (under mixed precision, the f32 master weights):
    /// build this model's optimizer from them.
    pub fn parameters(&self) -> &[(String, Var)] {
        self.training.parameters()
    }

    /// The unit called `name` (declared with [`Model::units`]), to compute it through
    /// [`ShardedUnit::forward`].
    pub fn unit(&self, name: &str) -> Result<ShardedUnit> {
        self.training.unit(name)
    }

    /// Every trained parameter whole, by name (sorted), on the host: under ZeRO stage 3
    /// all-gathered unit by unit (a collective: every rank calls it), else copied. What
    /// `save_model` writes; also how to read the weights of a sharded model.
    pub fn whole_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.comm.with("whole_parameters", |comm| {
            self.training.whole_parameters(comm, true)
        })
    }

    /// [`whole_parameters`](Self::whole_parameters) held by the main process only: every rank
    /// takes part in the gathers, the others get an empty list. What a writer on the main
    /// process needs, without the whole model on every rank's host.
    pub fn whole_parameters_on_main(&self) -> Result<Vec<(String, Tensor)>> {
        self.comm.with("whole_parameters_on_main", |comm| {
            self.training.whole_parameters(comm, comm.rank() == 0)
        })
    }

    /// The frozen parameters, sorted by name.
    pub fn frozen_parameters(&self) -> &[(String, Var)] {
        self.training.frozen()
    }

    /// K: this model's micro-steps per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.training.accumulation_steps()
    }

    /// Number of this model's gradient buckets (each is one all-reduce per optimizer step).
    pub fn gradient_buckets(&self) -> usize {
        self.training.gradient_buckets()
    }

    /// Begins a micro-step of this model: decides whether its gradients sync and how its loss is
    /// scaled, by its own accumulation steps. Call it once per batch, after taking the batch
    /// from the prepared loader.
    pub fn accumulate(&self) -> MicroStep {
        self.training.begin_micro_step()
    }

    /// Computes the gradients of `loss` (a scalar) into this model's gradients only, scaled for
    /// the window; other models' parameters that `loss` reaches are left alone. On the
    /// micro-step that syncs, the window's gradients are averaged across ranks.
    ///
    /// A parameter that got no gradient in the window on any rank keeps none (the optimizer skips
    /// it); one that got a gradient on some ranks only is averaged with zeros for the others. Both
    /// are what one process training on the whole window's batch would have, at any world size.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        let sync = crate::training::lock(&self.sync);
        self.comm
            .with("backward", |comm| self.training.backward(loss, comm, &sync))
    }

    /// Switches this model's window about to begin to item-weighted accumulation: `local_items`
    /// is the number of items (e.g. non-padding tokens) in this rank's batches of the whole
    /// window, and the losses passed to [`backward`](Self::backward) in that window must be
    /// *sums* over items. The resulting gradient equals that of one batch holding the whole
    /// window on all ranks, averaged per item. Call before the window's first
    /// [`accumulate`](Self::accumulate); the count is summed over ranks (a collective).
    pub fn set_window_items(&self, local_items: usize) -> Result<()> {
        self.comm.with("set_window_items", |comm| {
            let global = crate::comm::reduce_scalar(comm, local_items as f64, ReduceOp::Sum)?;
            self.training.set_window_items(global, comm.world_size())
        })
    }

    /// Whether this model's current micro-step syncs gradients (and steps its optimizer).
    pub fn sync_gradients(&self) -> bool {
        self.training.sync_gradients()
    }

    /// This model's optimizer steps so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.training.optimizer_steps()
    }

    /// Whether this model's last sync micro-step skipped its optimizer step (fp16 overflow).
    pub fn step_was_skipped(&self) -> bool {
        self.training.step_was_skipped()
    }

    /// A copy of the gradient accumulated for parameter `name` in this model's current window
    /// (f32 under mixed precision, already divided by the fp16 loss scale; averaged across ranks
    /// once the sync micro-step's backward ran), or `None` if it has none (PyTorch's
    /// `grad is None`).
    pub fn gradient(&self, name: &str) -> Result<Option<Tensor>> {
        self.training.gradient(name)
    }

    /// Copies the master weights into the model's half-precision compute copies. Call it after
    /// writing the masters yourself (e.g. loading initial weights into the parameters that
    /// `prepare` returned); the optimizer step and `load_state` do it on their own. Does nothing
    /// without mixed precision.
    pub fn refresh_compute_parameters(&self) -> Result<()> {
        self.training.refresh_compute()
    }

    /// Scales this model's window gradients so that their global L2 norm is at most `max_norm`
    /// and returns the norm before clipping. Acts on the accumulated, averaged gradients, so it
    /// only does something on a micro-step that syncs; elsewhere it returns `None`.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<Option<f64>> {
        self.training.clip_grad_norm(max_norm)
    }

    /// Clamps every element of this model's window gradients to `[-limit, limit]` (PyTorch's
    /// `clip_grad_value_`). Like [`clip_grad_norm`](Self::clip_grad_norm) it acts on the
    /// accumulated, averaged gradients, so only on a micro-step that syncs (returning `true`);
    /// elsewhere it does nothing and returns `false`.
    pub fn clip_grad_value(&self, limit: f64) -> Result<bool> {
        self.training.clip_grad_value(limit)
    }

    /// A guard in whose scope this model's backward passes accumulate locally, without averaging
    /// across ranks (see [`NoSync`](crate::NoSync)).
    pub fn no_sync(&self) -> crate::NoSync {
        crate::NoSync::new(self.training.clone())
    }
}
