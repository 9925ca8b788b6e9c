//! The facade a training loop talks to. It owns nothing but the wiring: the process state, the
//! communicator, and the state it shares with the objects it prepared. Each concern lives in its
//! own module (`accumulate`, `grads`, `comm`, `data`, `optim`).

use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;

use crate::accumulate::{Accumulation, MicroStep};
use crate::comm::{CommStats, Communicator, LocalCommunicator, ReduceOp};
use crate::data::{DataLoader, Dataset};
use crate::error::{Error, Result};
use crate::grads::{sorted_named_vars, GradientBuffers, DEFAULT_BUCKET_CAP_BYTES};
use crate::optim::{LrScheduler, Optimizer};
use crate::prepared::{lock, PreparedOptimizer, PreparedScheduler, TrainingState};
use crate::state::ProcessState;

/// Environment variable read for the default number of gradient accumulation steps
/// (`accelerate-launch --gradient-accumulation-steps K` sets it).
pub const GRADIENT_ACCUMULATION_STEPS_ENV: &str = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS";

/// Configures an [`Accelerator`].
#[derive(Debug, Default, Clone)]
pub struct AcceleratorBuilder {
    gradient_accumulation_steps: Option<usize>,
    seed: Option<u64>,
    device: Option<Device>,
    bucket_cap_bytes: Option<usize>,
    state: Option<ProcessState>,
}

impl AcceleratorBuilder {
    /// Micro-steps per optimizer step (K). Default: `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`, else 1.
    pub fn gradient_accumulation_steps(mut self, steps: usize) -> Self {
        self.gradient_accumulation_steps = Some(steps);
        self
    }

    /// Seed for everything the runtime randomizes (default 0). Data loaders are seeded by their own
    /// `seed`, identical on every rank.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// The device this process computes on (default: the CPU).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Size cap of a gradient bucket in bytes (default 25 MiB, as DDP).
    pub fn bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.bucket_cap_bytes = Some(bytes);
        self
    }

    /// Uses the given process identity instead of reading the environment.
    pub fn process_state(mut self, state: ProcessState) -> Self {
        self.state = Some(state);
        self
    }

    /// Reads the environment and builds the accelerator.
    pub fn build(self) -> Result<Accelerator> {
        let steps = match self.gradient_accumulation_steps {
            Some(k) => k,
            None => match std::env::var(GRADIENT_ACCUMULATION_STEPS_ENV) {
                Ok(v) if !v.trim().is_empty() => {
                    v.trim().parse::<usize>().map_err(|_| Error::Env {
                        name: GRADIENT_ACCUMULATION_STEPS_ENV.into(),
                        value: v.clone(),
                        problem: "expected a positive integer".into(),
                    })?
                }
                _ => 1,
            },
        };
        let accumulation = Accumulation::new(steps)?;
        let state = match self.state {
            Some(s) => s,
            None => ProcessState::from_env()?,
        };
        let comm: Box<dyn Communicator> = if state.world_size == 1 {
            Box::new(LocalCommunicator::new())
        } else {
            return Err(Error::Config(format!(
                "this process is rank {} of {} ({:?} launcher), but this build has no \
                 multi-process communicator yet; run a single process",
                state.rank, state.world_size, state.launcher
            )));
        };
        let device = self.device.unwrap_or(Device::Cpu);
        let seed = self.seed.unwrap_or(0);
        if !device.is_cpu() {
            // The CPU generator cannot be seeded in candle; ours are explicit ChaCha generators.
            device.set_seed(seed)?;
        }
        Ok(Accelerator {
            state,
            device,
            seed,
            bucket_cap_bytes: self.bucket_cap_bytes.unwrap_or(DEFAULT_BUCKET_CAP_BYTES),
            comm,
            params: Vec::new(),
            shared: Arc::new(TrainingState {
                accumulation: Mutex::new(accumulation),
                grads: Mutex::new(None),
                loader: Mutex::new(None),
            }),
        })
    }
}

/// Runs a custom training loop on one process, or as one rank of many, with gradient accumulation.
///
/// See the crate documentation for the canonical loop.
pub struct Accelerator {
    state: ProcessState,
    device: Device,
    seed: u64,
    bucket_cap_bytes: usize,
    comm: Box<dyn Communicator>,
    /// The prepared parameters, sorted by name.
    params: Vec<(String, Var)>,
    shared: Arc<TrainingState>,
}

impl std::fmt::Debug for Accelerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accelerator")
            .field("state", &self.state)
            .field("device", &self.device)
            .field("parameters", &self.params.len())
            .finish_non_exhaustive()
    }
}

/// Something [`Accelerator::prepare`] can wrap.
pub trait Prepare {
    /// What `prepare` returns for it.
    type Prepared;
    /// Wraps `self` for `accelerator`.
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared>;
}

impl Accelerator {
    /// A builder with defaults read from the environment.
    pub fn builder() -> AcceleratorBuilder {
        AcceleratorBuilder::default()
    }

    /// An accelerator with all defaults.
    pub fn new() -> Result<Self> {
        Self::builder().build()
    }

    /// The device this process computes on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The configured seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The process identity read from the environment.
    pub fn process_state(&self) -> &ProcessState {
        &self.state
    }

    /// This process's global rank.
    pub fn process_index(&self) -> usize {
        self.state.rank
    }

    /// This process's rank on its machine.
    pub fn local_process_index(&self) -> usize {
        self.state.local_rank
    }

    /// Number of processes in the job.
    pub fn num_processes(&self) -> usize {
        self.state.world_size
    }

    /// Whether this is global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.state.is_main_process()
    }

    /// Whether this is rank 0 of its machine.
    pub fn is_local_main_process(&self) -> bool {
        self.state.is_local_main_process()
    }

    /// K: micro-steps per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        lock(&self.shared.accumulation).steps()
    }

    /// Optimizer updates per epoch for a loader of `batches_per_rank` batches per rank (the length
    /// of a prepared loader): size LR schedules with this, since schedulers count optimizer steps.
    pub fn num_update_steps(&self, batches_per_rank: usize) -> usize {
        batches_per_rank.div_ceil(self.gradient_accumulation_steps())
    }

    /// Prepares a model's parameters, an optimizer, a data loader or a scheduler.
    pub fn prepare<T: Prepare>(&mut self, item: T) -> Result<T::Prepared> {
        item.prepare_with(self)
    }

    /// Registers the model's parameters (sorted by name) and allocates their gradient buffers.
    /// Returns the sorted `(name, Var)` pairs, to build the optimizer from.
    pub fn prepare_parameters(&mut self, vars: Vec<(String, Var)>) -> Result<Vec<(String, Var)>> {
        if !self.params.is_empty() {
            return Err(Error::Parameters(
                "parameters were already prepared; prepare all of the model's parameters at once \
                 (one VarMap or one list of named Vars)"
                    .into(),
            ));
        }
        let vars = sorted_named_vars(vars)?;
        if vars.is_empty() {
            return Err(Error::Parameters(
                "the model has no parameters to train (an empty VarMap?)".into(),
            ));
        }
        for (name, var) in &vars {
            if !var.device().same_device(&self.device) {
                return Err(Error::Parameters(format!(
                    "parameter {name:?} is on {:?} but the accelerator computes on {:?}; build the \
                     model with `accelerator.device()`",
                    var.device().location(),
                    self.device.location()
                )));
            }
        }
        let buffers = GradientBuffers::new(&vars, self.bucket_cap_bytes)?;
        *lock(&self.shared.grads) = Some(buffers);
        self.params = vars.clone();
        Ok(vars)
    }

    /// The prepared parameters, sorted by name.
    pub fn parameters(&self) -> &[(String, Var)] {
        &self.params
    }

    /// Wraps an optimizer so that it steps only when gradients sync. Its parameters must be the
    /// prepared ones.
    pub fn prepare_optimizer<O: Optimizer>(
        &mut self,
        optimizer: O,
    ) -> Result<PreparedOptimizer<O>> {
        if self.params.is_empty() {
            return Err(Error::Optimizer(
                "prepare the model's parameters before the optimizer (prepare_parameters)".into(),
            ));
        }
        let theirs: Vec<&str> = optimizer.params().iter().map(|(n, _)| n.as_str()).collect();
        let ours: Vec<&str> = self.params.iter().map(|(n, _)| n.as_str()).collect();
        if theirs != ours {
            let missing: Vec<_> = ours.iter().filter(|n| !theirs.contains(n)).collect();
            let extra: Vec<_> = theirs.iter().filter(|n| !ours.contains(n)).collect();
            return Err(Error::Optimizer(format!(
                "the optimizer's parameters differ from the prepared model's (missing from the \
                 optimizer: {missing:?}, unknown to the model: {extra:?}); build the optimizer \
                 from the Vec returned by prepare_parameters"
            )));
        }
        Ok(PreparedOptimizer::new(optimizer, self.shared.clone()))
    }

    /// Wraps a scheduler so that it advances once per optimizer step.
    pub fn prepare_scheduler(&mut self, scheduler: LrScheduler) -> PreparedScheduler {
        PreparedScheduler::new(scheduler, self.shared.clone())
    }

    /// Shards a data loader for this rank, places its batches on this process's device, and makes
    /// it the loader whose end closes the last accumulation window of an epoch.
    pub fn prepare_data_loader<D: Dataset>(&mut self, loader: DataLoader<D>) -> DataLoader<D> {
        let loader = loader
            .shard(self.state.rank, self.state.world_size)
            .device(self.device.clone());
        *lock(&self.shared.loader) = Some(loader.progress());
        loader
    }

    /// Begins a micro-step: decides whether it syncs and how its loss is scaled. Call it once per
    /// batch, after taking the batch from the prepared loader.
    pub fn accumulate(&self) -> MicroStep {
        let loader = lock(&self.shared.loader).clone();
        lock(&self.shared.accumulation).begin_explicit(loader.as_ref())
    }

    /// Whether the current micro-step syncs gradients (and steps the optimizer). Use it to guard
    /// clipping and per-step logging.
    pub fn sync_gradients(&self) -> bool {
        lock(&self.shared.accumulation).sync_gradients()
    }

    /// Switches the window about to begin to item-weighted accumulation: `local_items` is the
    /// number of items (e.g. non-padding tokens) in this rank's batches of the whole window, and the
    /// losses passed to [`backward`](Self::backward) in that window must be *sums* over items. The
    /// resulting gradient equals that of one batch holding the whole window on all ranks, averaged
    /// per item. Call before the window's first [`accumulate`](Self::accumulate); the count is
    /// summed over ranks.
    pub fn set_window_items(&self, local_items: usize) -> Result<()> {
        let global = self.reduce_scalar(local_items as f64, ReduceOp::Sum)?;
        let loader = lock(&self.shared.loader).clone();
        lock(&self.shared.accumulation).set_window_items(
            global,
            self.state.world_size,
            loader.as_ref(),
        )
    }

    /// Computes the gradients of `loss` (a scalar) and adds them, scaled for the window, into the
    /// gradient buffers. On the micro-step that syncs, the buffers are averaged across ranks.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        if loss.elem_count() != 1 {
            return Err(Error::Config(format!(
                "backward needs a scalar loss, got shape {:?}; reduce it with mean() or sum()",
                loss.dims()
            )));
        }
        let loader = lock(&self.shared.loader).clone();
        let mut acc = lock(&self.shared.accumulation);
        let step = acc.current_for_backward(loader.as_ref())?;
        let grad_store = loss.backward()?;
        let mut grads = lock(&self.shared.grads);
        let buffers = grads.as_mut().ok_or_else(|| {
            Error::Parameters(
                "backward before prepare_parameters: the accelerator does not know the model's \
                 parameters"
                    .into(),
            )
        })?;
        buffers.accumulate(&self.params, &grad_store, step.loss_scale)?;
        if step.sync {
            buffers.fill_missing_with_zeros()?;
            // At world size 1 the reduction is the identity, but it is still counted, so the
            // traffic accounting reads the same at any size.
            for bucket in buffers.buckets() {
                self.comm.all_reduce(bucket.flat(), ReduceOp::Mean)?;
            }
        }
        acc.backward_finished();
        Ok(())
    }

    /// Scales the window's gradients so that their global L2 norm is at most `max_norm`, and
    /// returns the norm before clipping. Acts on the accumulated, averaged gradients, so it only
    /// does something on a micro-step that syncs; elsewhere it returns `None`.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<Option<f64>> {
        if !self.sync_gradients() {
            return Ok(None);
        }
        let mut grads = lock(&self.shared.grads);
        let Some(buffers) = grads.as_mut() else {
            return Ok(None);
        };
        let norm = buffers.global_norm()?;
        // PyTorch's clip_grad_norm_: coefficient max_norm / (norm + 1e-6), applied when below 1.
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            buffers.scale(coef)?;
        }
        Ok(Some(norm))
    }

    /// Optimizer steps taken so far.
    pub fn optimizer_steps(&self) -> u64 {
        lock(&self.shared.accumulation).optimizer_steps
    }

    /// Traffic counters of the communicator (all-reduces issued, bytes sent).
    pub fn comm_stats(&self) -> CommStats {
        self.comm.stats()
    }

    /// Reduces a tensor over all ranks (a copy; the argument is untouched).
    pub fn reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let out = tensor.contiguous()?.copy()?;
        self.comm.all_reduce(&out, op)?;
        Ok(out)
    }

    fn reduce_scalar(&self, value: f64, op: ReduceOp) -> Result<f64> {
        if self.state.world_size == 1 {
            return Ok(value);
        }
        let t = Tensor::new(&[value], &Device::Cpu)?;
        self.comm.all_reduce(&t, op)?;
        Ok(t.to_vec1::<f64>()?[0])
    }

    /// Concatenates `tensor` of every rank along dimension 0, in rank order.
    pub fn gather(&self, tensor: &Tensor) -> Result<Tensor> {
        self.comm.all_gather(tensor)
    }

    /// Waits until every rank has reached this point.
    pub fn wait_for_everyone(&self) -> Result<()> {
        self.comm.barrier()
    }

    /// Prints on the main process only.
    pub fn print(&self, message: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{message}");
        }
    }
}

impl Prepare for &VarMap {
    type Prepared = Vec<(String, Var)>;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        let vars = lock(self.data())
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

impl Prepare for crate::optim::Sgd {
    type Prepared = PreparedOptimizer<Self>;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        accelerator.prepare_optimizer(self)
    }
}

impl Prepare for crate::optim::AdamW {
    type Prepared = PreparedOptimizer<Self>;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        accelerator.prepare_optimizer(self)
    }
}

impl Prepare for LrScheduler {
    type Prepared = PreparedScheduler;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        Ok(accelerator.prepare_scheduler(self))
    }
}

impl<D: Dataset> Prepare for DataLoader<D> {
    type Prepared = DataLoader<D>;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Prepared> {
        Ok(accelerator.prepare_data_loader(self))
    }
}
