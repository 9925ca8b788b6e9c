//! The training state machine: everything a training step of one prepared model changes, owned
//! in one place.
//!
//! [`TrainingState`] holds the model's parameters, accumulation counters, gradient buffers,
//! mixed-precision state and the registries of its prepared optimizers and schedulers; it reads
//! the accelerator's prepared loaders, which every model shares. The `Accelerator` and the
//! objects it prepared share it (`Arc`) and change it only through its methods, which are the
//! steps of the loop: begin a micro-step, backward, step the optimizer, step the scheduler,
//! snapshot and restore.
//!
//! ## Locks
//!
//! One lock guards the state, taken once per call. The one call into user code made under it is
//! `Optimizer::step` (a custom optimizer's too), which must therefore not call back into the
//! accelerator or a prepared handle. A prepared optimizer or scheduler sits behind its own lock,
//! which its handle takes only for the length of one of its calls (`PreparedOptimizer::with_inner`
//! lends the optimizer to a closure that cannot step it; saving or restoring the state inside
//! that closure is refused with an error, [`lent`], rather than left to wait). The order is always the accelerator's gradient sync
//! ([`SharedSync`], taken by `backward` only) first, then the state's lock, then an optimizer's
//! or a scheduler's; nothing takes an earlier lock while holding a later one. The prepared
//! loaders ([`PreparedLoaders`]) are a leaf: nothing else is locked while they are.
//!
//! The files: preparing a model's state and the checks at `prepare` in `prepare.rs` and
//! `parameter_check.rs`; the optimizer's step, the scheduler's and `zero_grad` in `step.rs`;
//! the micro-step, backward, clipping, snapshot and restore here.
//!
//! One training process is one thread of control: the locks exist so that the prepared objects
//! are `Send` and can be dropped or saved from anywhere, not for contention.

mod parameter_check;
mod prepare;
mod step;

pub(crate) use prepare::{
    model_of_optimizer, model_of_scheduler, prepare_model, ModelParts, Preparation, PreparedParts,
};

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use candle_core::{DType, Tensor, Var};

use crate::comm::Communicator;
use crate::data::PreparedLoaders;
use crate::error::{Error, Result};
use crate::fsdp::{FsdpState, ModelUnits};
use crate::grads::GradientBuffers;
use crate::mixed_precision::{
    DynamicLossScaler, LossScalerState, MixedPrecision, MixedPrecisionState,
};
use crate::optim::{LrScheduler, Optimizer, OptimizerState, SchedulerState};
use crate::sync::GradientSync;
use crate::window::{Accumulation, AccumulationCounters, MicroStep};
use crate::zero::{ZeroConfig, ZeroState};

/// A prepared optimizer as the training state keeps it, to save and restore its state.
pub(crate) type SharedOptimizer = Arc<Mutex<dyn Optimizer + Send>>;

/// A prepared scheduler as the training state keeps it.
pub(crate) type SharedScheduler = Arc<Mutex<LrScheduler>>;

/// The accelerator's gradient sync, shared by every prepared model (each one's `backward`
/// averages through it). Its lock is taken before a training state's, never while holding one.
pub(crate) type SharedSync = Arc<Mutex<GradientSync>>;

/// Locks `m`, ignoring poison: a panic elsewhere in the loop leaves nothing we cannot keep using.
pub(crate) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A registered optimizer, locked to save or restore it; an error naming the cause instead of a
/// wait when the loop has it lent to a `PreparedOptimizer::with_inner` closure (the only way it
/// can be held while the accelerator runs: one training process is one thread of control).
pub(crate) fn lent(
    optimizer: &SharedOptimizer,
) -> Result<MutexGuard<'_, dyn Optimizer + Send + 'static>> {
    match optimizer.try_lock() {
        Ok(guard) => Ok(guard),
        Err(std::sync::TryLockError::Poisoned(poisoned)) => Ok(poisoned.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => Err(Error::Optimizer(
            "the accelerator's state was saved or loaded inside PreparedOptimizer::with_inner, \
             which holds the optimizer: call save_state/load_state after the closure returns"
                .into(),
        )),
    }
}

/// What a checkpoint keeps of the training state (the parameters are saved beside it), taken at
/// one instant under the state's lock.
#[derive(Debug)]
pub(crate) struct TrainingSnapshot {
    /// The accumulation counters and the optimizer step count.
    pub counters: AccumulationCounters,
    /// Inside a window, this rank's partial gradient sums by parameter name.
    pub window_gradients: Option<BTreeMap<String, Tensor>>,
    /// Every prepared optimizer's state, in order of preparation.
    pub optimizers: Vec<OptimizerState>,
    /// Every prepared scheduler's state, in order of preparation.
    pub schedulers: Vec<SchedulerState>,
    /// The fp16 loss scaler's state (`None` without fp16, or not saved).
    pub loss_scaler: Option<LossScalerState>,
}

/// Everything a training step changes; one lock guards it (see the module documentation).
#[derive(Debug)]
pub(crate) struct TrainingState {
    /// The prepared parameters, sorted by name (under mixed precision, the f32 master weights).
    /// Set once, read without the lock.
    params: OnceLock<Vec<(String, Var)>>,
    /// The model's frozen parameters, sorted by name (set once, at prepare).
    frozen: OnceLock<Vec<(String, Var)>>,
    /// The accelerator's prepared loaders, shared by every prepared model.
    loaders: Arc<PreparedLoaders>,
    /// The configured ZeRO stage.
    zero_config: ZeroConfig,
    /// The model's units, if it declared them (set once, at prepare).
    units: OnceLock<ModelUnits>,
    steps: Mutex<Steps>,
}

/// The part of the state that the steps change.
struct Steps {
    accumulation: Accumulation,
    /// Present once the parameters were prepared.
    grads: Option<GradientBuffers>,
    /// Under ZeRO stage 1 or 2, once the parameters were prepared.
    zero: Option<ZeroState>,
    /// Under ZeRO stage 3, once the parameters were prepared.
    fsdp: Option<Arc<FsdpState>>,
    mixed: MixedPrecisionState,
    /// Every prepared optimizer, in order of preparation (what checkpoints save as `optimizer_<i>`).
    optimizers: Vec<SharedOptimizer>,
    /// Every prepared scheduler, in order of preparation.
    schedulers: Vec<SharedScheduler>,
    /// Live [`NoSync`](crate::NoSync) guards: while any lives, no backward pass averages.
    no_sync_guards: usize,
    /// Whether the buffers hold gradients that a backward under a `NoSync` guard added on a
    /// micro-step that would have synced: they outlive their window, so a checkpoint keeps them.
    unsynced_across_windows: bool,
}

impl std::fmt::Debug for Steps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Steps")
            .field("accumulation", &self.accumulation)
            .field("optimizers", &self.optimizers.len())
            .field("schedulers", &self.schedulers.len())
            .finish_non_exhaustive()
    }
}

impl Steps {
    fn zero_if_abandoned(&mut self) {
        if self.accumulation.take_abandoned_window() {
            self.zero_gradients();
        }
    }

    fn zero_gradients(&mut self) {
        if let Some(g) = self.grads.as_mut() {
            g.zero();
        }
        if let Some(fsdp) = &self.fsdp {
            // Releasing storage cannot fail in a way that leaves gradients behind.
            let _ = fsdp.discard_window();
        }
        self.unsynced_across_windows = false;
    }

    /// Whether the current micro-step syncs: the window's last, no `NoSync` guard lives, and the
    /// buffers were averaged since (a backward under a guard that ended the window leaves them
    /// unaveraged after the guard is dropped: stepping on them would step each rank with its own
    /// gradients, and the replicas would drift apart).
    fn sync_now(&self) -> bool {
        self.accumulation.sync_gradients()
            && self.no_sync_guards == 0
            && !self.unsynced_across_windows
    }
}

impl TrainingState {
    /// A state with no parameters, loaders, optimizers or schedulers prepared yet.
    pub fn new(
        accumulation: Accumulation,
        mixed: MixedPrecisionState,
        loaders: Arc<PreparedLoaders>,
        zero_config: ZeroConfig,
    ) -> Self {
        loaders.require_window_lookahead(accumulation.steps() - 1);
        Self {
            params: OnceLock::new(),
            frozen: OnceLock::new(),
            loaders,
            zero_config,
            units: OnceLock::new(),
            steps: Mutex::new(Steps {
                accumulation,
                grads: None,
                zero: None,
                fsdp: None,
                mixed,
                optimizers: Vec::new(),
                schedulers: Vec::new(),
                no_sync_guards: 0,
                unsynced_across_windows: false,
            }),
        }
    }

    fn steps(&self) -> MutexGuard<'_, Steps> {
        lock(&self.steps)
    }

    // ---- What the configuration and the loop read ----

    /// K: micro-steps per optimizer step.
    pub fn accumulation_steps(&self) -> usize {
        self.steps().accumulation.steps()
    }

    /// The mixed-precision mode.
    pub fn mixed_precision(&self) -> MixedPrecision {
        self.steps().mixed.mode
    }

    /// The fp16 loss scale; `None` without fp16.
    pub fn loss_scale(&self) -> Option<f64> {
        self.steps().mixed.scaler.as_ref().map(|s| s.scale())
    }

    /// Whether the last sync micro-step skipped its optimizer step (fp16 overflow).
    pub fn step_was_skipped(&self) -> bool {
        self.steps().accumulation.step_was_skipped()
    }

    /// Optimizer steps taken so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.steps().accumulation.optimizer_steps()
    }

    /// Whether the current micro-step syncs gradients (never while a `NoSync` guard lives).
    pub fn sync_gradients(&self) -> bool {
        self.steps().sync_now()
    }

    /// A `NoSync` guard begins: backward passes accumulate locally until it ends.
    pub fn begin_no_sync(&self) {
        self.steps().no_sync_guards += 1;
    }

    /// A `NoSync` guard ends.
    pub fn end_no_sync(&self) {
        let mut steps = self.steps();
        steps.no_sync_guards = steps.no_sync_guards.saturating_sub(1);
    }

    /// The configured ZeRO stage.
    pub fn zero_stage(&self) -> u8 {
        self.zero_config.stage
    }

    /// Under ZeRO stage 3: how many units are gathered ahead.
    pub fn fsdp_prefetch(&self) -> crate::zero::PrefetchDepth {
        self.zero_config.prefetch
    }

    /// Records the model's units (once, at prepare).
    fn set_units(&self, units: ModelUnits) -> Result<()> {
        self.units
            .set(units)
            .map_err(|_| Error::Parameters("the model's units were already prepared".into()))
    }

    /// The handle of the unit called `name`.
    pub fn unit(&self, name: &str) -> Result<crate::fsdp::ShardedUnit> {
        match self.units.get() {
            Some(units) => units.unit(name),
            None => Err(Error::Config(format!(
                "unit({name:?}): the model declares no units; prepare it as \
                 Model::new(params).units(vec![UnitSpec::new(..), ..])"
            ))),
        }
    }

    /// Every trained parameter whole, by name (sorted), on the host (gathered under ZeRO
    /// stage 3, a collective then, and held only where `keep`).
    pub fn whole_parameters(
        &self,
        comm: &dyn Communicator,
        keep: bool,
    ) -> Result<Vec<(String, Tensor)>> {
        if let Some(ModelUnits::Sharded(state)) = self.units.get() {
            return state.whole_parameters(comm, keep);
        }
        if !keep {
            return Ok(Vec::new());
        }
        self.parameters()
            .iter()
            .map(|(n, v)| {
                Ok((
                    n.clone(),
                    v.as_tensor().to_device(&candle_core::Device::Cpu)?.copy()?,
                ))
            })
            .collect()
    }

    /// Under ZeRO stage 3 once the parameters are prepared, the sharded model's state (its
    /// layout, what checkpoints record and re-cut the pieces by).
    pub fn fsdp(&self) -> Option<Arc<FsdpState>> {
        match self.units.get() {
            Some(ModelUnits::Sharded(state)) => Some(state.clone()),
            _ => None,
        }
    }

    /// The prepared parameters, sorted by name (empty before they are prepared).
    pub fn parameters(&self) -> &[(String, Var)] {
        self.params.get().map_or(&[], Vec::as_slice)
    }

    /// Whether `var` is one of this state's trained parameters, or under mixed precision the
    /// compute copy of one (what the user's model holds, and passed to `prepare`).
    pub fn trains(&self, var: &Var) -> bool {
        let id = var.as_tensor().id();
        let is = |(_, v): &(String, Var)| v.as_tensor().id() == id;
        self.parameters().iter().any(is)
            || matches!(self.units.get(), Some(ModelUnits::Sharded(s)) if s.was_prepared_from(var))
            || self
                .steps()
                .mixed
                .weights
                .as_ref()
                .is_some_and(|w| w.compute().iter().any(is))
    }

    /// The model's frozen parameters, sorted by name.
    pub fn frozen(&self) -> &[(String, Var)] {
        self.frozen.get().map_or(&[], Vec::as_slice)
    }

    /// Records the model's frozen parameters (once, when it is prepared).
    pub fn set_frozen(&self, frozen: Vec<(String, Var)>) {
        let _ = self.frozen.set(frozen);
    }

    /// Every parameter of the model, trained and frozen, sorted by name: what a saved model holds.
    pub fn all_parameters(&self) -> Vec<(String, Var)> {
        let mut all: Vec<(String, Var)> = self
            .parameters()
            .iter()
            .chain(self.frozen())
            .cloned()
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Number of gradient buckets.
    pub fn gradient_buckets(&self) -> usize {
        self.steps().grads.as_ref().map_or(0, |g| g.buckets().len())
    }

    /// A copy of the window's gradient of parameter `name`, if it has one.
    pub fn gradient(&self, name: &str) -> Result<Option<Tensor>> {
        let steps = self.steps();
        let Some(grads) = steps.grads.as_ref() else {
            return Ok(None);
        };
        if steps.fsdp.is_some() {
            return Err(Error::Config(format!(
                "under ZeRO stage 3 each rank keeps only its piece of each parameter and of its \
                 gradient, so the gradient of {name:?} exists whole on no rank; use \
                 zero_stage(1) to read whole gradients"
            )));
        }
        match grads.get(name) {
            Some(t) => Ok(Some(t.copy()?)),
            None if grads.has_gradient(name) => Err(Error::Config(format!(
                "under ZeRO stage 2 each rank keeps only its 1/N of the averaged gradient, so the \
                 gradient of {name:?} exists whole on no rank after the sync micro-step; use \
                 zero_stage(1) to read whole gradients"
            ))),
            None => Ok(None),
        }
    }

    /// Copies the master weights into the compute copies (nothing without mixed precision).
    pub fn refresh_compute(&self) -> Result<()> {
        self.steps().mixed.refresh_compute()
    }

    // ---- The steps of the loop ----

    /// Begins a micro-step on the loop's request (`accumulate()`).
    pub fn begin_micro_step(&self) -> MicroStep {
        let mut steps = self.steps();
        let loader = self.loaders.innermost();
        let step = steps.accumulation.begin_explicit(loader.as_ref());
        steps.zero_if_abandoned();
        step
    }

    /// Switches the window about to begin to item-weighted accumulation over `global_items`.
    pub fn set_window_items(&self, global_items: f64, world_size: usize) -> Result<()> {
        let mut steps = self.steps();
        let loader = self.loaders.innermost();
        steps
            .accumulation
            .set_window_items(global_items, world_size, loader.as_ref())
    }

    /// The backward pass of `loss` (a scalar), its gradients added into the window's sums, which
    /// `sync` averages across ranks on the micro-step that syncs.
    pub fn backward(
        &self,
        loss: &Tensor,
        comm: &dyn Communicator,
        sync: &GradientSync,
    ) -> Result<()> {
        if loss.elem_count() != 1 {
            return Err(Error::Config(format!(
                "backward needs a scalar loss, got shape {:?}; reduce it with mean() or sum()",
                loss.dims()
            )));
        }
        let mut guard = self.steps();
        let steps = &mut *guard;
        let loader = self.loaders.innermost();
        let step = steps.accumulation.current_for_backward(loader.as_ref())?;
        // Before the backward pass, which may fail: the flag is consumed here, and a retried
        // micro-step must not add into the abandoned window's sums.
        steps.zero_if_abandoned();
        let loss_scale = steps.mixed.loss_scale();
        if let Some(fsdp) = steps.fsdp.clone() {
            let sync_now = steps.no_sync_guards == 0 && step.sync;
            let check_finite = steps.mixed.scaler.is_some();
            let outcome = (|| -> Result<Option<bool>> {
                fsdp.begin_backward(step.loss_scale / loss_scale, sync_now, sync.reduce_dtype())?;
                let grads = if loss_scale == 1.0 {
                    loss.backward()
                } else {
                    (loss.to_dtype(DType::F32)? * loss_scale).and_then(|scaled| scaled.backward())
                };
                fsdp.end_backward();
                fsdp.check_outer_gradients(&grads?)?;
                if !sync_now {
                    return Ok(None);
                }
                let buffers = steps.grads.as_mut().ok_or_else(|| {
                    Error::Parameters("backward before the model's parameters were prepared".into())
                })?;
                Ok(Some(fsdp.finish_sync(
                    comm,
                    sync.reduce_dtype(),
                    check_finite,
                    buffers,
                )?))
            })();
            sync.record(fsdp.take_traffic());
            match outcome {
                // A failed pass may have added part of its gradients, or reduced some units:
                // the window is dropped whole, never half kept.
                Err(e) => {
                    let _ = fsdp.discard_window();
                    return Err(e);
                }
                Ok(Some(nonfinite)) => {
                    steps.mixed.after_sync_verdict(nonfinite)?;
                    steps.unsynced_across_windows = false;
                }
                Ok(None) if step.sync => steps.unsynced_across_windows = true,
                Ok(None) => {}
            }
            steps.accumulation.backward_finished();
            return Ok(());
        }
        let mut grad_store = if loss_scale == 1.0 {
            loss.backward()?
        } else {
            // fp16: scaled so that small gradients survive in half precision; the scale is
            // divided out when they are added into the f32 buffers. Scaled in f32, so that the
            // loss itself cannot overflow.
            (loss.to_dtype(DType::F32)? * loss_scale)?.backward()?
        };
        let buffers = steps.grads.as_mut().ok_or_else(|| {
            Error::Parameters(
                "backward before the model's parameters were prepared: prepare them first \
                 (accelerator.prepare(&varmap))"
                    .into(),
            )
        })?;
        let sources = steps.mixed.grad_sources(self.parameters());
        let scale = step.loss_scale / loss_scale;
        let guarded = steps.no_sync_guards > 0;
        if !guarded && (step.sync || sync.syncs_each_batch()) {
            if steps.zero.as_ref().is_some_and(|z| z.stage() == 2) {
                let fp16 = steps.mixed.scaler.is_some();
                sync.accumulate_and_reduce_scatter(
                    comm,
                    buffers,
                    sources,
                    &mut grad_store,
                    scale,
                    fp16,
                )?;
            } else {
                // With sync_each_batch the window's sum so far is already equal on every rank,
                // so averaging it again with this micro-step's gradient adds this micro-step's
                // average.
                sync.accumulate_and_average(comm, buffers, sources, &grad_store, scale)?;
            }
            steps.unsynced_across_windows = false;
            if step.sync {
                // After the reduction, so that every rank sees the same gradients and decides
                // alike.
                steps.mixed.after_sync(buffers)?;
            }
        } else {
            buffers.accumulate(sources, &grad_store, scale)?;
            if step.sync {
                // Under a NoSync guard the window ends without syncing; its sums stay for the
                // next micro-step that syncs.
                steps.unsynced_across_windows = true;
            }
        }
        steps.accumulation.backward_finished();
        Ok(())
    }

    /// Scales the window's gradients so that their global L2 norm is at most `max_norm`; returns
    /// the norm before clipping, or `None` on a micro-step that does not sync.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<Option<f64>> {
        let mut steps = self.steps();
        if !steps.sync_now() {
            return Ok(None);
        }
        let steps = &mut *steps;
        let Some(buffers) = steps.grads.as_mut() else {
            return Ok(None);
        };
        let norm = match (buffers.synced_shard(), &steps.zero) {
            _ if steps.fsdp.is_some() => {
                // Each rank holds its pieces, which tile every parameter once.
                let local = buffers.sum_of_squares()?;
                self.zero_config.link.with("clip_grad_norm", |comm| {
                    let total = Tensor::new(&[local], &candle_core::Device::Cpu)?;
                    comm.all_reduce_agreed(&total, crate::comm::ReduceOp::Sum)?;
                    Ok(total.to_vec1::<f64>()?[0].sqrt())
                })?
            }
            (Some(shard), Some(zero)) => {
                // Each rank holds 1/N of the gradient: the squares are summed across ranks.
                let local = shard.sum_of_squares()?;
                zero.with_comm("clip_grad_norm", |comm| {
                    let total = Tensor::new(&[local], &candle_core::Device::Cpu)?;
                    comm.all_reduce_agreed(&total, crate::comm::ReduceOp::Sum)?;
                    Ok(total.to_vec1::<f64>()?[0].sqrt())
                })?
            }
            _ => buffers.global_norm()?,
        };
        // PyTorch's clip_grad_norm_: coefficient max_norm / (norm + 1e-6), applied when below 1.
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            buffers.scale(coef)?;
        }
        Ok(Some(norm))
    }

    /// Clamps every element of the window's gradients to `[-limit, limit]`; returns whether it
    /// acted (only on a micro-step that syncs, where the gradients are the window's average).
    pub fn clip_grad_value(&self, limit: f64) -> Result<bool> {
        if !limit.is_finite() || limit < 0.0 {
            return Err(Error::Config(format!(
                "clip_grad_value({limit}): the limit is the largest magnitude a gradient element \
                 keeps, a finite number >= 0"
            )));
        }
        let mut steps = self.steps();
        if !steps.sync_now() {
            return Ok(false);
        }
        let Some(buffers) = steps.grads.as_mut() else {
            return Ok(false);
        };
        buffers.clamp(limit)?;
        Ok(true)
    }
    // ---- Snapshot and restore ----

    /// What a checkpoint saves of this rank's state, at this instant. The optimizers',
    /// schedulers' and loss scaler's states, which only the main process writes, are taken only
    /// `with_shared` state: each is a full copy of the moments on the host. Under ZeRO (stage 3
    /// included) the optimizers' states (this rank's pieces) are taken on every rank, each of
    /// which saves its own.
    pub fn snapshot(&self, with_shared: bool) -> Result<TrainingSnapshot> {
        let steps = self.steps();
        let counters = steps.accumulation.counters();
        // Copies: the buffers are summed into in place after the snapshot is taken.
        let inside_window = counters.taken > 0 || steps.unsynced_across_windows;
        let window_gradients = match (&steps.fsdp, &steps.grads, inside_window) {
            // Stage 3: the window's sums live whole in the units' buffers until the sync.
            (Some(fsdp), _, true) => Some(fsdp.window_gradients()?),
            (None, Some(grads), true) => Some(
                grads
                    .names()
                    .filter_map(|n| grads.get(n).map(|t| Ok((n.to_string(), t.copy()?))))
                    .collect::<Result<_>>()?,
            ),
            _ => None,
        };
        // Under ZeRO each rank holds, and saves, its own pieces of the optimizer state.
        if !with_shared && steps.zero.is_none() && steps.fsdp.is_none() {
            return Ok(TrainingSnapshot {
                counters,
                window_gradients,
                optimizers: Vec::new(),
                schedulers: Vec::new(),
                loss_scaler: None,
            });
        }
        let optimizers = steps
            .optimizers
            .iter()
            .map(|o| lent(o)?.state())
            .collect::<Result<_>>()?;
        if !with_shared {
            return Ok(TrainingSnapshot {
                counters,
                window_gradients,
                optimizers,
                schedulers: Vec::new(),
                loss_scaler: None,
            });
        }
        let schedulers = steps.schedulers.iter().map(|s| lock(s).state()).collect();
        Ok(TrainingSnapshot {
            counters,
            window_gradients,
            optimizers,
            schedulers,
            loss_scaler: steps.mixed.scaler.as_ref().map(|s| s.state()),
        })
    }

    /// A copy of every parameter's value, by name (what [`restore`](Self::restore) takes; under
    /// ZeRO stage 3 this rank's pieces).
    pub fn parameter_values(&self) -> Result<BTreeMap<String, Tensor>> {
        self.parameters()
            .iter()
            .map(|(n, v)| Ok((n.clone(), v.as_tensor().force_contiguous()?)))
            .collect()
    }

    /// Number of prepared optimizers and schedulers.
    pub fn registered(&self) -> (usize, usize) {
        let steps = self.steps();
        (steps.optimizers.len(), steps.schedulers.len())
    }

    /// Checks that saved counters can continue in this run.
    pub fn check_counters(&self, saved: &AccumulationCounters) -> std::result::Result<(), String> {
        self.steps().accumulation.check_restorable(saved)
    }

    /// A copy of the fp16 loss scaler, to check a saved state against (`None` without fp16).
    pub fn loss_scaler(&self) -> Option<DynamicLossScaler> {
        self.steps().mixed.scaler.clone()
    }

    /// Continues from a verified checkpoint: `params` by name (as [`parameters`](Self::parameters)
    /// holds them: under ZeRO stage 3 this rank's pieces), then `snapshot`. If a parameter,
    /// an optimizer or a scheduler still refuses its value, what was already changed is put back
    /// and that error returned. Loaders continue from their saved position at their next `iter()`.
    pub fn restore(
        &self,
        params: &BTreeMap<String, Tensor>,
        snapshot: TrainingSnapshot,
    ) -> Result<()> {
        let mut guard = self.steps();
        let steps = &mut *guard;
        if let Some(fsdp) = &steps.fsdp {
            // Kept gathered units hold the values about to be replaced.
            fsdp.release_gathered();
        }
        let ours = self.parameters();
        let old_params: Vec<Tensor> = ours
            .iter()
            .map(|(_, v)| v.as_tensor().force_contiguous())
            .collect::<candle_core::Result<_>>()?;
        let old_opt: Vec<OptimizerState> = steps
            .optimizers
            .iter()
            .map(|o| lent(o)?.state())
            .collect::<Result<_>>()?;
        let old_sched: Vec<SchedulerState> =
            steps.schedulers.iter().map(|s| lock(s).state()).collect();

        let result = (|| -> Result<()> {
            for (name, var) in ours {
                let value = params.get(name).ok_or_else(|| {
                    Error::Parameters(format!("the checkpoint holds no parameter {name:?}"))
                })?;
                var.set(&value.to_device(var.device())?)?;
            }
            for (o, state) in steps.optimizers.iter().zip(&snapshot.optimizers) {
                lent(o)?.load_state(state)?;
            }
            for (s, state) in steps.schedulers.iter().zip(&snapshot.schedulers) {
                lock(s).load_state(state)?;
            }
            if let (Some(fsdp), Some(saved)) = (&steps.fsdp, &snapshot.window_gradients) {
                // Stage 3: the sums go whole into the units' buffers (`params` are the pieces).
                if let Some(buffers) = steps.grads.as_mut() {
                    buffers.zero();
                }
                fsdp.restore_window(saved)?;
            } else if let (Some(buffers), Some(saved)) =
                (steps.grads.as_mut(), &snapshot.window_gradients)
            {
                buffers.zero();
                for (name, t) in saved {
                    let (_, var) = ours.iter().find(|(n, _)| n == name).ok_or_else(|| {
                        Error::Parameters(format!("a saved gradient names no parameter: {name:?}"))
                    })?;
                    buffers.accumulate_one(name, &t.to_device(var.device())?, 1.0)?;
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            for ((_, var), old) in ours.iter().zip(&old_params) {
                let _ = var.set(old);
            }
            for (o, state) in steps.optimizers.iter().zip(&old_opt) {
                let _ = lock(o).load_state(state);
            }
            for (s, state) in steps.schedulers.iter().zip(&old_sched) {
                let _ = lock(s).load_state(state);
            }
            return Err(e);
        }
        if snapshot.window_gradients.is_none() {
            if let Some(buffers) = steps.grads.as_mut() {
                buffers.zero();
            }
            if let Some(fsdp) = &steps.fsdp {
                fsdp.discard_window()?;
            }
        }
        steps.unsynced_across_windows =
            snapshot.counters.taken == 0 && snapshot.window_gradients.is_some();
        if let Some(scaler) = steps.mixed.scaler.as_mut() {
            match &snapshot.loss_scaler {
                Some(state) => scaler.load_state(state)?,
                None => scaler.reset(),
            }
        }
        steps.mixed.window_overflowed = false;
        // The compute copies take the loaded master weights.
        steps.mixed.refresh_compute()?;
        steps.accumulation.restore(&snapshot.counters);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::LoaderProgress;
    use crate::mixed_precision::LossScalerConfig;

    fn state(k: usize) -> (TrainingState, Arc<PreparedLoaders>) {
        let mixed = MixedPrecisionState::new(MixedPrecision::No, LossScalerConfig::default());
        let loaders = Arc::new(PreparedLoaders::default());
        let comm: Arc<dyn crate::comm::Communicator> =
            Arc::from(Box::new(crate::comm::LocalCommunicator::new())
                as Box<dyn crate::comm::Communicator>);
        let state = TrainingState::new(
            Accumulation::new(k).unwrap(),
            mixed.unwrap(),
            loaders.clone(),
            ZeroConfig::new(0, &comm),
        );
        (state, loaders)
    }

    /// Training batches 1-3 with K=2: windows [1, 2] and [3], the last cut short by the training
    /// loader's end. An evaluation loop between batches 2 and 3, left with a `break` (its iterator
    /// never ends), must not decide the window of batch 3, nor must the window follow whichever
    /// loader was prepared last.
    #[test]
    fn windows_follow_the_loader_the_current_batch_came_from() {
        let (t, loaders) = state(2);
        let train = Arc::new(LoaderProgress::new(3));
        let eval = Arc::new(LoaderProgress::new(10));
        loaders.register(train.clone()).unwrap();
        loaders.register(eval.clone()).unwrap();

        train.start_epoch(0, 0, 3);
        train.record_yielded(1);
        let s1 = t.begin_micro_step();
        train.record_yielded(2);
        let s2 = t.begin_micro_step();
        assert_eq!((s1.sync, s2.sync), (false, true));

        eval.start_epoch(0, 0, 10);
        eval.record_yielded(1); // `break` after the first evaluation batch
        assert!(Arc::ptr_eq(&loaders.innermost().unwrap(), &eval));

        train.record_yielded(3);
        let s3 = t.begin_micro_step();
        assert_eq!(
            (s3.sync, s3.window_len, s3.loss_scale),
            (true, 1, 1.0),
            "batch 3 is the training epoch's last: a window of one that syncs"
        );
        train.end_iteration();
        assert!(
            Arc::ptr_eq(&loaders.innermost().unwrap(), &eval),
            "the evaluation loader never ended"
        );
    }
}
