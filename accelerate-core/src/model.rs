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

use crate::error::Result;
use crate::training::TrainingState;

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
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("parameters", &self.params.len())
            .field("freezes", &self.frozen.is_some())
            .field("accumulation_steps", &self.accumulation_steps)
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

    /// The parameters split into `(trained, frozen)`, in the order given, and the model's own K.
    pub(crate) fn into_parts(self) -> (NamedVars, NamedVars, Option<usize>) {
        let (frozen, trained) = match &self.frozen {
            Some(is_frozen) => self.params.into_iter().partition(|(n, _)| is_frozen(n)),
            None => (Vec::new(), self.params),
        };
        (trained, frozen, self.accumulation_steps)
    }
}

/// A prepared model: which of the accelerator's models it is, its trained and frozen
/// parameters, and its own accumulation state. Begin its micro-steps with
/// [`Accelerator::accumulate_model`](crate::Accelerator::accumulate_model) and run its backward
/// pass with [`Accelerator::backward_model`](crate::Accelerator::backward_model); the optimizer
/// prepared over its parameters steps with its gradients only.
#[derive(Debug, Clone)]
pub struct PreparedModel {
    index: usize,
    training: Arc<TrainingState>,
}

impl PreparedModel {
    pub(crate) fn new(index: usize, training: Arc<TrainingState>) -> Self {
        Self { index, training }
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

    /// The frozen parameters, sorted by name.
    pub fn frozen_parameters(&self) -> &[(String, Var)] {
        self.training.frozen()
    }

    /// K: this model's micro-steps per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.training.accumulation_steps()
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
    /// (see [`Accelerator::gradient`](crate::Accelerator::gradient)).
    pub fn gradient(&self, name: &str) -> Result<Option<Tensor>> {
        self.training.gradient(name)
    }

    /// Scales this model's window gradients so that their global L2 norm is at most `max_norm`
    /// and returns the norm before clipping; `None` on a micro-step that does not sync.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<Option<f64>> {
        self.training.clip_grad_norm(max_norm)
    }

    /// Clamps every element of this model's window gradients to `[-limit, limit]` (see
    /// [`Accelerator::clip_grad_value`](crate::Accelerator::clip_grad_value)); returns whether it
    /// acted.
    pub fn clip_grad_value(&self, limit: f64) -> Result<bool> {
        self.training.clip_grad_value(limit)
    }

    /// A guard in whose scope this model's backward passes accumulate locally, without averaging
    /// across ranks (see [`NoSync`](crate::NoSync)).
    pub fn no_sync(&self) -> crate::NoSync {
        crate::NoSync::new(self.training.clone())
    }
}
