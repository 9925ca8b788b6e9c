//! `prepare`: what a loop hands the accelerator (parameters, optimizers, schedulers, data
//! loaders) and the checks that every rank prepared the same.

use std::sync::Arc;

use candle_core::Var;
use candle_nn::VarMap;

use super::Accelerator;
use crate::data::{DataLoader, Dataset, IterableDataset, StreamingLoader};
use crate::error::{Error, Result};
use crate::grads::sorted_named_vars;
use crate::mixed_precision::{MixedPrecision, MixedPrecisionState};
use crate::model::{Model, PreparedModel};
use crate::optim::{LrScheduler, Optimizer};
use crate::prepared::{PreparedOptimizer, PreparedScheduler};
use crate::training::TrainingState;
use crate::window::Accumulation;

/// Something [`Accelerator::prepare`] can wrap.
pub trait Prepare {
    /// What `prepare` returns for it.
    type Prepared;
    /// Wraps `self` for `accelerator`.
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared>;
}

impl Accelerator {
    /// Prepares a model's parameters, an optimizer, a data loader or a scheduler.
    pub fn prepare<T: Prepare>(&mut self, item: T) -> Result<T::Prepared> {
        item.prepare_with(self)
    }

    /// Registers the model's parameters (sorted by name) and allocates their gradient buffers.
    /// Returns the sorted `(name, Var)` pairs, to build the optimizer from. Under mixed precision
    /// `vars` are the model's half-precision compute copies and the returned pairs are their f32
    /// master weights (same names), which the gradient buffers, the optimizer and checkpoints use.
    /// This is the accelerator's first model; prepare further ones with [`Model`].
    pub fn prepare_parameters(&mut self, vars: Vec<(String, Var)>) -> Result<Vec<(String, Var)>> {
        if !self.training().parameters().is_empty() {
            return Err(Error::Parameters(
                "parameters were already prepared; prepare all of the model's parameters at once \
                 (one VarMap or one list of named Vars), or prepare a second model with \
                 accelerator.prepare(Model::new(vars))"
                    .into(),
            ));
        }
        Ok(self.prepare_model(Model::new(vars))?.parameters().to_vec())
    }

    /// Prepares a model: the first one the accelerator sees becomes its first model (the one the
    /// methods without a model argument act on), each further one gets a training state of its
    /// own. Its trained parameters are registered as
    /// [`prepare_parameters`](Self::prepare_parameters) does; its frozen ones are broadcast from
    /// rank 0 once and left alone after.
    pub fn prepare_model(&mut self, model: Model) -> Result<PreparedModel> {
        let (trained, frozen, accumulation_steps) = model.into_parts();
        let trained = sorted_named_vars(trained)?;
        let frozen = sorted_named_vars(frozen)?;
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
        for (name, var) in trained.iter().chain(&frozen) {
            if !var.device().same_device(&self.device) {
                return Err(Error::Parameters(format!(
                    "parameter {name:?} is on {:?} but the accelerator computes on {:?}; build the \
                     model with `accelerator.device()`",
                    var.device().location(),
                    self.device.location()
                )));
            }
        }
        for (name, var) in &trained {
            if self.models.iter().any(|m| m.trains(var)) {
                return Err(Error::Parameters(format!(
                    "parameter {name:?} belongs to a model prepared before; prepare each model \
                     once, and each parameter in one model"
                )));
            }
        }
        let first = self.training().parameters().is_empty();
        let index = if first { 0 } else { self.models.len() };
        let several_ranks = self.state.world_size > 1;
        if several_ranks {
            self.check_same_parameters_everywhere(index, &trained, &frozen)?;
        }
        let training = if first {
            self.training().clone()
        } else {
            let k = self.training().accumulation_steps();
            let mixed =
                MixedPrecisionState::new(self.training().mixed_precision(), self.loss_scaler)?;
            Arc::new(TrainingState::new(
                Accumulation::new(k)?,
                mixed,
                self.loaders.clone(),
                self.zero.clone(),
            ))
        };
        if let Some(k) = accumulation_steps {
            training.set_accumulation_steps(k)?;
        }
        let comm = &self.comm;
        if several_ranks {
            // Same start everywhere, once: frozen weights are never written after this.
            for (_, var) in &frozen {
                comm.broadcast(var.as_tensor(), 0)?;
            }
        }
        let process = (self.state.rank, self.state.world_size);
        training.prepare_parameters(trained, self.bucket_cap_bytes, process, |var| {
            if several_ranks {
                comm.broadcast(var.as_tensor(), 0)?;
            }
            Ok(())
        })?;
        if !first {
            self.models.push(training.clone());
        }
        self.frozen.extend(frozen.iter().cloned());
        training.set_frozen(frozen);
        Ok(PreparedModel::new(index, training))
    }

    /// Compares this rank's parameter names, shapes and dtypes with every other rank's, through
    /// the store; every rank reports the same first difference.
    fn check_same_parameters_everywhere(
        &self,
        model: usize,
        vars: &[(String, Var)],
        frozen: &[(String, Var)],
    ) -> Result<()> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        // The gradient buckets are reduced without a per-call size check (their layout is
        // agreed here), so everything that shapes them or their wire dtype is compared too.
        let layout = format!(
            "gradient buckets: cap {} bytes, reduced in {:?}, mixed precision {}, overlap {}, \
             ZeRO stage {}\n",
            self.bucket_cap_bytes,
            self.sync.reduce_dtype(),
            self.training().mixed_precision(),
            self.sync.overlap_configured(),
            self.zero.stage
        );
        let signature: String = std::iter::once(layout)
            .chain(
                vars.iter()
                    .map(|(n, v)| format!("{n} {:?} {:?}\n", v.dims(), v.dtype()))
                    .chain(
                        frozen
                            .iter()
                            .map(|(n, v)| format!("{n} {:?} {:?} frozen\n", v.dims(), v.dtype())),
                    ),
            )
            .collect();
        let base = match model {
            0 => "accelerate/parameters".to_string(),
            m => format!("accelerate/parameters/model_{m}"),
        };
        let timeout = crate::comm::cpu::CpuCommOptions::from_env()?.timeout;
        super::parameter_check::check_same_signature_everywhere(
            store.as_ref(),
            &base,
            self.state.rank,
            self.state.world_size,
            &signature,
            timeout,
        )
    }

    /// Wraps an optimizer so that it steps only when gradients sync. Its parameters must be the
    /// prepared ones.
    pub fn prepare_optimizer<O: Optimizer + Send + 'static>(
        &mut self,
        optimizer: O,
    ) -> Result<PreparedOptimizer<O>> {
        let training = self.model_of_optimizer(&optimizer)?;
        let params = training.parameters();
        if params.is_empty() {
            return Err(Error::Optimizer(
                "prepare the model's parameters before the optimizer (prepare_parameters)".into(),
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
                 from the Vec returned by prepare_parameters"
            )));
        }
        let mode = training.mixed_precision();
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
                     prepare_parameters returned; under mixed precision {mode} build the \
                     optimizer from that Vec, not from the model's VarMap",
                    var.dtype()
                )));
            }
        }
        let mut optimizer = optimizer;
        training.shard_optimizer(&mut optimizer)?;
        training.give_compute_copies(&mut optimizer)?;
        Ok(PreparedOptimizer::new(optimizer, training))
    }

    /// The model whose parameters `optimizer` holds (the first model if it holds none of any
    /// model's, so that the coverage check names what differs); refuses frozen parameters.
    fn model_of_optimizer<O: Optimizer>(&self, optimizer: &O) -> Result<Arc<TrainingState>> {
        let ids: Vec<_> = optimizer
            .params()
            .iter()
            .map(|(_, v)| v.as_tensor().id())
            .collect();
        let frozen: Vec<&str> = self
            .frozen
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
        let owners: Vec<&Arc<TrainingState>> = self
            .models
            .iter()
            .filter(|m| holds(m.parameters()))
            .collect();
        match owners.as_slice() {
            [] => Ok(self.training().clone()),
            [one] => Ok((*one).clone()),
            _ => Err(Error::Optimizer(
                "the optimizer holds parameters of several prepared models; give each model an \
                 optimizer of its own, built from its PreparedModel::parameters()"
                    .into(),
            )),
        }
    }

    /// Wraps a scheduler so that it advances once per optimizer step of the model whose
    /// optimizer it drives. With one model prepared, a scheduler prepared before its optimizer
    /// follows that model; with several, it must be prepared after the optimizer it drives (an
    /// error otherwise, since which model's steps it should follow is unknown).
    pub fn prepare_scheduler(&mut self, scheduler: LrScheduler) -> Result<PreparedScheduler> {
        let training = match self
            .models
            .iter()
            .find(|m| m.drives_learning_rate(&scheduler))
        {
            Some(model) => model.clone(),
            None if self.models.len() <= 1 => self.training().clone(),
            None => {
                return Err(Error::Config(format!(
                    "the learning-rate scheduler drives no prepared optimizer, and {} models are \
                     prepared, so which model's optimizer steps it should follow is unknown; \
                     prepare the scheduler after the optimizer whose learning rate it drives \
                     (built with LrScheduler::new(optimizer.learning_rate(), ...))",
                    self.models.len()
                )))
            }
        };
        Ok(PreparedScheduler::new(scheduler, training))
    }

    /// Shards a data loader for this rank, places its batches on this process's device, and makes
    /// it the loader whose end closes the last accumulation window of an epoch. On several ranks
    /// the settings that decide the batches and windows ([`LoaderSettings`]: dataset length, batch
    /// size, shuffle, seed, drop_last, K) are compared with every other rank's; a difference is an
    /// error on every rank, naming it.
    ///
    /// [`LoaderSettings`]: crate::data::LoaderSettings
    pub fn prepare_data_loader<D: Dataset>(
        &mut self,
        loader: DataLoader<D>,
    ) -> Result<DataLoader<D>> {
        let loader = loader
            .shard(self.state.rank, self.state.world_size)
            .device(self.device.clone());
        let index = self.loaders.len();
        if self.state.world_size > 1 {
            let settings = crate::data::LoaderSettings::new(
                &loader.plan(),
                self.gradient_accumulation_steps(),
            );
            self.check_same_loader_everywhere(index, &settings)?;
        }
        self.loaders.register(loader.progress())?;
        Ok(loader)
    }

    /// [`prepare_data_loader`](Self::prepare_data_loader) for a stream: shards it for this rank,
    /// places its batches on this process's device and registers it; from then on it looks ahead
    /// the largest K − 1 of the models prepared, before or after it (so each accumulation
    /// window's length is known at its first micro-step). On
    /// several ranks its batch size, drop_last and K are compared with every other rank's.
    pub fn prepare_streaming_loader<S: IterableDataset>(
        &mut self,
        loader: StreamingLoader<S>,
    ) -> Result<StreamingLoader<S>> {
        let k = self.gradient_accumulation_steps();
        let loader = loader
            .shard(self.state.rank, self.state.world_size)
            .device(self.device.clone());
        let index = self.loaders.len();
        if self.state.world_size > 1 {
            let settings = crate::data::LoaderSettings::new(&loader.plan(), k);
            self.check_same_loader_everywhere(index, &settings)?;
        }
        self.loaders.register(loader.progress())?;
        Ok(loader)
    }

    /// Compares the settings of this rank's `index`-th prepared loader with every other rank's,
    /// through the store; every rank reports the same differences.
    fn check_same_loader_everywhere(
        &self,
        index: usize,
        settings: &crate::data::LoaderSettings,
    ) -> Result<()> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        let key = |r: usize| format!("accelerate/loaders/{index}/{r}");
        let encoded = serde_json::to_vec(settings)
            .map_err(|e| Error::Data(format!("cannot encode the data loader's settings: {e}")))?;
        store.set(&key(self.state.rank), &encoded)?;
        let timeout = crate::comm::cpu::CpuCommOptions::from_env()?.timeout;
        let per_rank = (0..self.state.world_size)
            .map(|r| {
                let bytes = store.get(&key(r), timeout)?;
                serde_json::from_slice(&bytes).map_err(|e| {
                    Error::Data(format!(
                        "rank {r} published unreadable data loader settings ({e}); every rank \
                         must run the same build of the program"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let which = format!("data loader #{} (in order of preparation)", index + 1);
        match crate::data::LoaderSettings::differences(&which, &per_rank) {
            Some(message) => Err(Error::Config(message)),
            None => Ok(()),
        }
    }
}

impl Prepare for &VarMap {
    type Prepared = Vec<(String, Var)>;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        let vars = crate::training::lock(self.data())
            .iter()
            .map(|(name, var)| (name.clone(), var.clone()))
            .collect();
        accelerator.prepare_parameters(vars)
    }
}

impl Prepare for Vec<(String, Var)> {
    type Prepared = Vec<(String, Var)>;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        accelerator.prepare_parameters(self)
    }
}

/// Every optimizer, the library's and a user's own: anything implementing [`Optimizer`].
impl<O: Optimizer + Send + 'static> Prepare for O {
    type Prepared = PreparedOptimizer<O>;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        accelerator.prepare_optimizer(self)
    }
}

impl Prepare for Model {
    type Prepared = PreparedModel;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        accelerator.prepare_model(self)
    }
}

impl Prepare for LrScheduler {
    type Prepared = PreparedScheduler;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        accelerator.prepare_scheduler(self)
    }
}

impl<D: Dataset> Prepare for DataLoader<D> {
    type Prepared = DataLoader<D>;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        accelerator.prepare_data_loader(self)
    }
}

impl<S: IterableDataset> Prepare for StreamingLoader<S> {
    type Prepared = StreamingLoader<S>;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        accelerator.prepare_streaming_loader(self)
    }
}
