//! The [`Prepare`] trait: which object `prepare` turns into which handle. Each `prepare_*`
//! hands the accelerator's wiring to the code beside the state it builds (`training/prepare.rs`
//! for models, optimizers and schedulers, `data/fingerprint.rs` for the loaders' check).

use std::sync::Arc;

use candle_core::Var;
use candle_nn::VarMap;

use super::Accelerator;
use crate::data::{DataLoader, Dataset, IterableDataset, LoaderSettings, StreamingLoader};
use crate::error::{Error, Result};
use crate::mixed_precision::MixedPrecisionState;
use crate::model::{Model, PreparedModel};
use crate::optim::{LrScheduler, Optimizer};
use crate::prepared::{PreparedOptimizer, PreparedScheduler};
use crate::training::{
    lock, model_of_optimizer, model_of_scheduler, prepare_model, Preparation, PreparedParts,
    TrainingState,
};
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

    /// Registers the first model's parameters (sorted by name) and allocates their gradient
    /// buffers; returns the sorted `(name, Var)` pairs to build the optimizer from. Under mixed
    /// precision `vars` are the model's half-precision compute copies and the returned pairs are
    /// their f32 master weights (same names).
    fn prepare_parameters(&mut self, vars: Vec<(String, Var)>) -> Result<Vec<(String, Var)>> {
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

    /// Prepares a model (Accelerate's `prepare_model`): the first one the accelerator sees
    /// becomes its first model (the one the methods without a model argument act on), each
    /// further one gets a training state of its own. Its frozen parameters are broadcast from
    /// rank 0 once and left alone after.
    pub fn prepare_model(&mut self, model: Model) -> Result<PreparedModel> {
        let sync = lock(&self.sync);
        let bucket_config = format!(
            "gradient buckets: cap {} bytes, reduced in {:?}, mixed precision {}, overlap {}, \
             ZeRO stage {} (units gathered ahead {:?}, kept in the window {})",
            self.bucket_cap_bytes,
            sync.reduce_dtype(),
            self.training().mixed_precision(),
            sync.overlap_configured(),
            self.zero.stage,
            self.zero.prefetch,
            self.zero.keep_gathered
        );
        drop(sync);
        let preparation = Preparation {
            device: &self.device,
            rank: self.state.rank,
            world_size: self.state.world_size,
            comm: self.comm.as_ref(),
            store: self.store.as_deref(),
            bucket_cap_bytes: self.bucket_cap_bytes,
            bucket_config,
            models: &self.models,
        };
        let first = self.training();
        let PreparedParts {
            index,
            training,
            is_new,
        } = prepare_model(&preparation, model.into_parts(), || {
            let k = first.accumulation_steps();
            let mixed = MixedPrecisionState::new(first.mixed_precision(), self.loss_scaler)?;
            Ok(TrainingState::new(
                Accumulation::new(k)?,
                mixed,
                self.loaders.clone(),
                self.zero.clone(),
            ))
        })?;
        if is_new {
            self.models.push(training.clone());
        }
        self.frozen.extend(training.frozen().iter().cloned());
        Ok(self.handle(index, training))
    }

    /// The handle of model `index`.
    fn handle(&self, index: usize, training: Arc<TrainingState>) -> PreparedModel {
        PreparedModel::new(index, training, self.zero.link.clone(), self.sync.clone())
    }

    /// Wraps an optimizer so that it steps only when gradients sync (Accelerate's
    /// `prepare_optimizer`). Its parameters must be one prepared model's.
    pub fn prepare_optimizer<O: Optimizer + Send + 'static>(
        &mut self,
        optimizer: O,
    ) -> Result<PreparedOptimizer<O>> {
        let training = model_of_optimizer(&self.models, &self.frozen, &optimizer)?;
        let mut optimizer = optimizer;
        training.adopt_optimizer(&mut optimizer)?;
        Ok(PreparedOptimizer::new(optimizer, training))
    }

    /// Wraps a scheduler so that it advances once per optimizer step of the model whose
    /// optimizer it drives (Accelerate's `prepare_scheduler`). With one model prepared, a
    /// scheduler prepared before its optimizer follows that model; with several, it must be
    /// prepared after the optimizer it drives (an error otherwise, since which model's steps it
    /// should follow is unknown).
    pub fn prepare_scheduler(&mut self, scheduler: LrScheduler) -> Result<PreparedScheduler> {
        let training = model_of_scheduler(&self.models, &scheduler)?;
        Ok(PreparedScheduler::new(scheduler, training))
    }

    /// Shards a data loader for this rank (Accelerate's `prepare_data_loader`), places its
    /// batches on this process's device, and makes it the loader whose end closes the last
    /// accumulation window of an epoch. On several ranks the settings that decide the batches
    /// and windows ([`LoaderSettings`]: dataset length, batch size, shuffle, seed, drop_last, K)
    /// are compared with every other rank's; a difference is an error on every rank, naming it.
    ///
    /// [`LoaderSettings`]: crate::data::LoaderSettings
    pub fn prepare_data_loader<D: Dataset>(
        &mut self,
        loader: DataLoader<D>,
    ) -> Result<DataLoader<D>> {
        let loader = loader
            .shard(self.state.rank, self.state.world_size)
            .device(self.device.clone());
        self.register_loader(&loader.plan(), loader.progress())?;
        Ok(loader)
    }

    /// [`prepare_data_loader`](Self::prepare_data_loader) for a stream: shards it for this rank,
    /// places its batches on this process's device and registers it; from then on it looks ahead
    /// the largest K − 1 of the models prepared, before or after it (so each accumulation
    /// window's length is known at its first micro-step). On several ranks its batch size,
    /// drop_last and K are compared with every other rank's.
    fn prepare_streaming_loader<S: IterableDataset>(
        &mut self,
        loader: StreamingLoader<S>,
    ) -> Result<StreamingLoader<S>> {
        let loader = loader
            .shard(self.state.rank, self.state.world_size)
            .device(self.device.clone());
        self.register_loader(&loader.plan(), loader.progress())?;
        Ok(loader)
    }

    /// Registers a sharded loader following `plan`, after comparing its settings with every
    /// other rank's.
    fn register_loader(
        &mut self,
        plan: &crate::data::BatchPlan,
        progress: Arc<crate::data::LoaderProgress>,
    ) -> Result<()> {
        if let (Some(store), true) = (&self.store, self.state.world_size > 1) {
            let settings = LoaderSettings::new(plan, self.gradient_accumulation_steps());
            settings.check_same_everywhere(
                store.as_ref(),
                self.loaders.len(),
                (self.state.rank, self.state.world_size),
            )?;
        }
        self.loaders.register(progress)?;
        Ok(())
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
