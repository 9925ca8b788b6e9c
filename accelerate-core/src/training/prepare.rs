//! Building a model's training state at `prepare`: its parameters checked (on this device, in no
//! other model, the same on every rank), broadcast from rank 0, their gradient buckets laid out;
//! and the checks that an optimizer or scheduler prepared over it holds that model's parameters.

use std::sync::Arc;

use candle_core::{Device, Var};

use super::{lock, SharedOptimizer, SharedScheduler, TrainingState};
use crate::comm::store::Store;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::fsdp::{FsdpState, ModelUnits, Prefetcher, UnitLayout, UnitSpec};
use crate::grads::{sorted_named_vars, GradientBuffers};
use crate::mixed_precision::{MasterWeights, MixedPrecision};
use crate::optim::{LrScheduler, Optimizer};
use crate::window::Accumulation;
use crate::zero::{PrefetchDepth, ShardPlan, ZeroState};

/// What preparing a model needs of the accelerator: where it computes, who this rank is, how it
/// reaches the other ranks, and the models prepared before.
pub(crate) struct Preparation<'a> {
    pub device: &'a Device,
    pub rank: usize,
    pub world_size: usize,
    pub comm: &'a dyn Communicator,
    /// The rendezvous store the parameter check goes through (`None` on one process).
    pub store: Option<&'a dyn Store>,
    pub bucket_cap_bytes: usize,
    /// The configuration that shapes the gradient buckets and their wire dtype, which every rank
    /// must share (the first line of the parameter check's signature).
    pub bucket_config: String,
    /// Every model's training state, the first first (it exists before any model is prepared).
    pub models: &'a [Arc<TrainingState>],
}

/// A [`Model`](crate::Model) taken apart for `prepare`.
pub(crate) struct ModelParts {
    /// The trained parameters, in the order given.
    pub trained: Vec<(String, Var)>,
    /// The frozen parameters, in the order given.
    pub frozen: Vec<(String, Var)>,
    /// The model's own K.
    pub accumulation_steps: Option<usize>,
    /// The model's units, if it declared them.
    pub units: Option<Vec<UnitSpec>>,
}

/// A model prepared by [`prepare_model`].
pub(crate) struct PreparedParts {
    /// Which of the accelerator's models it is.
    pub index: usize,
    pub training: Arc<TrainingState>,
    /// Whether `training` is a new state, to add to the accelerator's models.
    pub is_new: bool,
}

/// The prefetch thread of a fully sharded model of `units` units, over a sibling of the
/// accelerator's communicator (a collective of every rank); `None` when `depth` gathers nothing
/// ahead or the backend has no sibling (NCCL).
fn prefetcher(
    p: &Preparation<'_>,
    units: usize,
    depth: PrefetchDepth,
) -> Result<Option<Prefetcher>> {
    if !depth.any() {
        return Ok(None);
    }
    match p.comm.connect_sibling(p.store)? {
        Some(sibling) => Ok(Some(Prefetcher::start(sibling, units, depth)?)),
        None => {
            if p.rank == 0 {
                eprintln!(
                    "accelerate: ZeRO stage 3 prefetch ({depth:?}) is not built for the {} \
                     communicator; each unit is gathered when it runs",
                    p.comm.transport_name()
                );
            }
            Ok(None)
        }
    }
}

/// Prepares a model of `trained` and `frozen` parameters, with its own K if
/// `accumulation_steps` says so: the first model the accelerator sees takes the first training
/// state, each further one a new state from `new_state`. Its trained parameters are checked,
/// broadcast from rank 0 and given gradient buffers; its frozen ones are broadcast from rank 0
/// once and left alone after.
pub(crate) fn prepare_model(
    p: &Preparation<'_>,
    parts: ModelParts,
    new_state: impl FnOnce() -> Result<TrainingState>,
) -> Result<PreparedParts> {
    let ModelParts {
        trained,
        frozen,
        accumulation_steps,
        units,
    } = parts;
    let trained = sorted_named_vars(trained)?;
    let frozen = sorted_named_vars(frozen)?;
    let sharded = p.models[0].zero_stage() == 3;
    if sharded && !frozen.is_empty() {
        return Err(Error::Config(format!(
            "ZeRO stage 3 does not shard frozen parameters ({} here, e.g. {:?}); train with \
             every parameter unfrozen, or use zero_stage(2) for a model with frozen parts \
             (LoRA)",
            frozen.len(),
            frozen[0].0
        )));
    }
    if trained.is_empty() {
        return Err(Error::Parameters(if frozen.is_empty() {
            "the model has no parameters to train (an empty VarMap?)".into()
        } else {
            format!(
                "every one of the model's {} parameters is frozen; freeze fewer (the \
                 predicate given to Model::freeze returns true for each name it freezes)",
                frozen.len()
            )
        }));
    }
    // At stage 3 a model may be built on the host: `prepare` moves only this rank's pieces to
    // the device, so a model larger than one device trains if it fits the host.
    for (name, var) in trained.iter().chain(&frozen) {
        let placed = var.device().same_device(p.device) || (sharded && var.device().is_cpu());
        if !placed {
            return Err(Error::Parameters(format!(
                "parameter {name:?} is on {:?} but the accelerator computes on {:?}; build the \
                 model with `accelerator.device()` (at ZeRO stage 3, or on the host)",
                var.device().location(),
                p.device.location()
            )));
        }
    }
    for (name, var) in &trained {
        if p.models.iter().any(|m| m.trains(var)) {
            return Err(Error::Parameters(format!(
                "parameter {name:?} belongs to a model prepared before; prepare each model \
                 once, and each parameter in one model"
            )));
        }
    }
    let first = p.models[0].parameters().is_empty();
    let index = if first { 0 } else { p.models.len() };
    let several_ranks = p.world_size > 1;
    if several_ranks {
        if let Some(store) = p.store {
            super::parameter_check::check_same_parameters_everywhere(
                store,
                (p.rank, p.world_size),
                index,
                &p.bucket_config,
                &trained,
                &frozen,
            )?;
        }
    }
    let training = if first {
        p.models[0].clone()
    } else {
        Arc::new(new_state()?)
    };
    if let Some(k) = accumulation_steps {
        training.set_accumulation_steps(k)?;
    }
    if several_ranks {
        // Same start everywhere, once: frozen weights are never written after this.
        for (_, var) in &frozen {
            p.comm.broadcast(var.as_tensor(), 0)?;
        }
    }
    let prefetch = match &units {
        Some(specs) if several_ranks && sharded => {
            prefetcher(p, specs.len(), p.models[0].fsdp_prefetch())?
        }
        _ => None,
    };
    training.prepare_parameters(
        trained,
        (units.as_deref(), prefetch, p.device),
        p.bucket_cap_bytes,
        (p.rank, p.world_size),
        |var| {
            if several_ranks {
                p.comm.broadcast(var.as_tensor(), 0)?;
            }
            Ok(())
        },
    )?;
    training.set_frozen(frozen);
    Ok(PreparedParts {
        index,
        training,
        is_new: !first,
    })
}

/// The model whose parameters `optimizer` holds (the first model if it holds none of any
/// model's, so that the coverage check names what differs); refuses frozen parameters.
pub(crate) fn model_of_optimizer<O: Optimizer>(
    models: &[Arc<TrainingState>],
    frozen: &[(String, Var)],
    optimizer: &O,
) -> Result<Arc<TrainingState>> {
    let ids: Vec<_> = optimizer
        .params()
        .iter()
        .map(|(_, v)| v.as_tensor().id())
        .collect();
    let frozen: Vec<&str> = frozen
        .iter()
        .filter(|(_, v)| ids.contains(&v.as_tensor().id()))
        .map(|(n, _)| n.as_str())
        .collect();
    if !frozen.is_empty() {
        return Err(Error::Optimizer(format!(
            "the optimizer holds frozen parameters {frozen:?}; build it from \
             PreparedModel::parameters(), which holds the trained ones only"
        )));
    }
    let holds = |params: &[(String, Var)]| {
        params
            .iter()
            .any(|(_, v)| ids.contains(&v.as_tensor().id()))
    };
    let owners: Vec<&Arc<TrainingState>> =
        models.iter().filter(|m| holds(m.parameters())).collect();
    match owners.as_slice() {
        [] => Ok(models[0].clone()),
        [one] => Ok((*one).clone()),
        _ => Err(Error::Optimizer(
            "the optimizer holds parameters of several prepared models; give each model an \
             optimizer of its own, built from its PreparedModel::parameters()"
                .into(),
        )),
    }
}

/// The training state of the model whose optimizer `scheduler` drives; with one model
/// prepared, that model's even before its optimizer is prepared.
pub(crate) fn model_of_scheduler(
    models: &[Arc<TrainingState>],
    scheduler: &LrScheduler,
) -> Result<Arc<TrainingState>> {
    match models.iter().find(|m| m.drives_learning_rate(scheduler)) {
        Some(model) => Ok(model.clone()),
        None if models.len() <= 1 => Ok(models[0].clone()),
        None => Err(Error::Config(format!(
            "the learning-rate scheduler drives no prepared optimizer, and {} models are \
             prepared, so which model's optimizer steps it should follow is unknown; \
             prepare the scheduler after the optimizer whose learning rate it drives \
             (built with LrScheduler::new(optimizer.learning_rate(), ...))",
            models.len()
        ))),
    }
}

impl TrainingState {
    /// Checks that `optimizer` holds exactly this model's parameters, each once (under mixed
    /// precision the f32 masters, not the compute copies), then cuts it to this rank's shards
    /// under ZeRO and hands it the compute copies under mixed precision.
    pub fn adopt_optimizer(&self, optimizer: &mut dyn Optimizer) -> Result<()> {
        let params = self.parameters();
        if params.is_empty() {
            return Err(Error::Optimizer(
                "prepare the model's parameters before the optimizer (accelerator.prepare(&varmap))".into(),
            ));
        }
        let theirs: Vec<&str> = optimizer.params().iter().map(|(n, _)| n.as_str()).collect();
        let ours: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
        // A parameter listed twice (in two parameter groups of a user's optimizer) would be
        // updated twice per step.
        let mut sorted = theirs.clone();
        sorted.sort_unstable();
        if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(Error::Optimizer(format!(
                "the optimizer lists parameter {:?} more than once (in two parameter groups?); \
                 every prepared parameter must be in exactly one group",
                pair[0]
            )));
        }
        if theirs != ours {
            let missing: Vec<_> = ours.iter().filter(|n| !theirs.contains(n)).collect();
            let extra: Vec<_> = theirs.iter().filter(|n| !ours.contains(n)).collect();
            return Err(Error::Optimizer(format!(
                "the optimizer's parameters differ from the prepared model's (missing from the \
                 optimizer: {missing:?}, unknown to the model: {extra:?}); build the optimizer \
                 from the Vec that prepare returned for the model's parameters"
            )));
        }
        let mode = self.mixed_precision();
        if mode != MixedPrecision::No {
            // Same names, other Vars: the half compute copies instead of the f32 masters.
            let stray = optimizer
                .params()
                .iter()
                .zip(params)
                .find(|((_, theirs), (_, ours))| theirs.as_tensor().id() != ours.as_tensor().id());
            if let Some(((name, var), _)) = stray {
                return Err(Error::Optimizer(format!(
                    "the optimizer's parameter {name:?} ({:?}) is not the f32 master weight that \
                     prepare returned; under mixed precision {mode} build the \
                     optimizer from that Vec, not from the model's VarMap",
                    var.dtype()
                )));
            }
        }
        self.shard_optimizer(optimizer)?;
        self.give_compute_copies(optimizer)
    }

    /// Takes the model's parameters (sorted and checked by the caller, once) and allocates their gradient
    /// buffers. Under mixed precision `vars` are the compute copies and the f32 master weights are
    /// made here. `broadcast` gives every parameter rank 0's value before the buffers exist.
    /// Returns the parameters the optimizer steps (the masters under mixed precision).
    pub fn prepare_parameters(
        &self,
        vars: Vec<(String, Var)>,
        (units, prefetch, device): (Option<&[UnitSpec]>, Option<Prefetcher>, &Device),
        bucket_cap_bytes: usize,
        (rank, world_size): (usize, usize),
        mut broadcast: impl FnMut(&Var) -> Result<()>,
    ) -> Result<Vec<(String, Var)>> {
        let layout = match units {
            Some(specs) => {
                let shapes: Vec<(String, candle_core::Shape)> = vars
                    .iter()
                    .map(|(n, v)| (n.clone(), v.shape().clone()))
                    .collect();
                Some(UnitLayout::new(&shapes, specs, world_size)?)
            }
            None => None,
        };
        if self.zero_config.stage == 3 {
            let layout = layout.ok_or_else(|| {
                Error::Config(
                    "ZeRO stage 3 shards the model unit by unit, and this model declares no \
                     units; prepare Model::new(params).units(..) (one unit per transformer \
                     block, one for the embeddings, one for the head) and compute each unit \
                     through PreparedModel::unit(name).forward(..)"
                        .into(),
                )
            })?;
            return self.prepare_sharded(
                vars,
                (layout, prefetch),
                bucket_cap_bytes,
                (rank, device),
                broadcast,
            );
        }
        let several_ranks = world_size > 1;
        let mut steps = self.steps();
        let (params, weights) = match steps.mixed.mode {
            MixedPrecision::No => (vars, None),
            mode => {
                let w = MasterWeights::new(vars, mode)?;
                (w.masters().to_vec(), Some(w))
            }
        };
        // Same start everywhere: rank 0's values (the masters), in sorted-name order.
        for (_, var) in &params {
            broadcast(var)?;
        }
        if let Some(w) = &weights {
            w.refresh_compute()?;
        }
        steps.mixed.weights = weights;
        let mut grads = if several_ranks {
            GradientBuffers::new_for_ranks(&params, bucket_cap_bytes)?
        } else {
            GradientBuffers::new(&params, bucket_cap_bytes)?
        };
        if self.zero_config.stage > 0 {
            let plan = ShardPlan::new(&grads.layout(), world_size);
            let zero = ZeroState::new(
                self.zero_config.stage,
                rank,
                plan,
                self.zero_config.link.clone(),
            );
            if zero.stage() == 2 {
                // Replaced before any use: the stage-2 buffers hold only one bucket at a time.
                drop(grads);
                grads = GradientBuffers::new_sharded(
                    &params,
                    bucket_cap_bytes,
                    zero.plan().clone(),
                    rank,
                )?;
            }
            steps.zero = Some(zero);
        }
        steps.grads = Some(grads);
        if let Some(layout) = layout {
            let compute = steps.mixed.grad_sources(&params).to_vec();
            self.set_units(ModelUnits::Whole { layout, compute })?;
        }
        self.params
            .set(params.clone())
            .map_err(|_| Error::Parameters("parameters were already prepared".into()))?;
        Ok(params)
    }

    /// [`prepare_parameters`](Self::prepare_parameters) under ZeRO stage 3: `vars` (rank 0's
    /// values once broadcast) are cut by `layout`, and this rank keeps its pieces (f32 masters
    /// under mixed precision), which are the parameters the optimizer steps. The whole `vars`
    /// are no longer used: the model drops them, and the units compute from gathered pieces.
    fn prepare_sharded(
        &self,
        vars: Vec<(String, Var)>,
        (layout, prefetch): (UnitLayout, Option<Prefetcher>),
        bucket_cap_bytes: usize,
        (rank, device): (usize, &Device),
        mut broadcast: impl FnMut(&Var) -> Result<()>,
    ) -> Result<Vec<(String, Var)>> {
        for (_, var) in &vars {
            broadcast(var)?;
        }
        let mut steps = self.steps();
        let dtypes = match steps.mixed.mode {
            MixedPrecision::No => (vars[0].1.dtype(), None),
            mode => (candle_core::DType::F32, Some(mode.compute_dtype())),
        };
        let state = FsdpState::new(
            layout,
            (rank, device),
            &vars,
            dtypes,
            self.zero_config.link.clone(),
            (self.zero_config.keep_gathered, prefetch),
        )?;
        let pieces = state.pieces().to_vec();
        steps.grads = Some(GradientBuffers::new(&pieces, bucket_cap_bytes)?);
        let state = std::sync::Arc::new(state);
        steps.fsdp = Some(state.clone());
        self.set_units(ModelUnits::Sharded(state))?;
        self.params
            .set(pieces.clone())
            .map_err(|_| Error::Parameters("parameters were already prepared".into()))?;
        Ok(pieces)
    }

    /// Replaces K before anything of this state was used (a [`Model`](crate::Model) with its
    /// own accumulation steps prepared as the accelerator's first model).
    pub fn set_accumulation_steps(&self, k: usize) -> Result<()> {
        let mut steps = self.steps();
        if steps.grads.is_some() || steps.accumulation.counters().taken > 0 {
            return Err(Error::Config(
                "the accumulation steps of a model are set when it is prepared".into(),
            ));
        }
        steps.accumulation = Accumulation::new(k)?;
        self.loaders.require_window_lookahead(k - 1);
        Ok(())
    }

    /// Whether `lr` is the learning-rate handle of an optimizer prepared over this state (a
    /// scheduler driving it belongs here).
    pub fn drives_learning_rate(&self, scheduler: &LrScheduler) -> bool {
        self.steps()
            .optimizers
            .iter()
            .any(|o| scheduler.drives(lock(o).learning_rate()))
    }

    /// Registers a prepared optimizer (saved and restored with the state).
    pub fn register_optimizer(&self, optimizer: SharedOptimizer) {
        self.steps().optimizers.push(optimizer);
    }

    /// Under ZeRO, cuts `optimizer` to this rank's pieces of the parameters (before it is
    /// registered); nothing otherwise.
    pub fn shard_optimizer(&self, optimizer: &mut dyn Optimizer) -> Result<()> {
        let steps = self.steps();
        let Some(zero) = &steps.zero else {
            return Ok(());
        };
        let plan = zero.plan();
        let pieces = self
            .parameters()
            .iter()
            .enumerate()
            .filter_map(|(i, (name, _))| Some((name.clone(), plan.piece(i, zero.rank())?)))
            .collect();
        optimizer.shard(&pieces).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("zero_stage({}): {m}", zero.stage())),
            e => e,
        })
    }

    /// Under mixed precision: hands `optimizer` the compute copies of the model's parameters, so
    /// that its steps write them in the update's own pass (see
    /// [`Optimizer::set_compute_copies`]).
    pub fn give_compute_copies(&self, optimizer: &mut dyn Optimizer) -> Result<()> {
        self.steps().mixed.give_compute_copies(optimizer)
    }

    /// Under ZeRO once the parameters are prepared, the stage and the partition (what
    /// checkpoints record and re-cut the optimizer state to).
    pub fn zero_plan(&self) -> Option<(u8, Arc<ShardPlan>)> {
        let steps = self.steps();
        let zero = steps.zero.as_ref()?;
        Some((zero.stage(), zero.plan().clone()))
    }

    /// Registers a prepared scheduler (saved and restored with the state).
    pub fn register_scheduler(&self, scheduler: SharedScheduler) {
        self.steps().schedulers.push(scheduler);
    }
}
