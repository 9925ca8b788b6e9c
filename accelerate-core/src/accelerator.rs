//! The facade a training loop talks to. It owns nothing but the wiring: the process state, the
//! communicator, and the state it shares with the objects it prepared. Each concern lives in its
//! own module (`accumulate`, `grads`, `comm`, `data`, `optim`).

use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;

use crate::accumulate::{Accumulation, MicroStep};
use crate::comm::join::join;
use crate::comm::store::{Store, StoreServer};
use crate::comm::{CommStats, Communicator, ReduceOp};
use crate::data::LoaderProgress;
use crate::data::{DataLoader, Dataset};
use crate::env;
use crate::error::{Error, Result};
use crate::grads::{
    sorted_named_vars, GradientBucket, GradientBuffers, SyncOptions, DEFAULT_BUCKET_CAP_BYTES,
};
use crate::mixed_precision::{
    LossScalerConfig, MasterWeights, MixedPrecision, MixedPrecisionState,
};
use crate::optim::{LrScheduler, Optimizer};
use crate::prepared::{lock, PreparedOptimizer, PreparedScheduler, TrainingState};
use crate::state::ProcessState;

/// Whether gradient reduction overlaps bucket preparation when neither the builder nor
/// [`env::OVERLAP_GRADIENT_REDUCTION`] says. Off: with 2 ranks on 2 cores no core is idle while a
/// rank reduces, so overlapping only adds work (BENCHMARKS.md, "Overlap of reduction and
/// preparation").
pub const DEFAULT_OVERLAP_GRADIENT_REDUCTION: bool = false;

/// Configures an [`Accelerator`].
#[derive(Debug, Default, Clone)]
pub struct AcceleratorBuilder {
    gradient_accumulation_steps: Option<usize>,
    seed: Option<u64>,
    device: Option<Device>,
    bucket_cap_bytes: Option<usize>,
    state: Option<ProcessState>,
    mixed_precision: Option<MixedPrecision>,
    loss_scaler: LossScalerConfig,
    gradient_reduce_dtype: Option<candle_core::DType>,
    overlap_gradient_reduction: Option<bool>,
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

    /// The device this process computes on (default: GPU `LOCAL_RANK` in a `cuda` build on a
    /// machine with GPUs, else the CPU; see [`crate::device`]).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Size cap of a gradient bucket in bytes (default: `ACCELERATE_BUCKET_CAP_MB`, else 25 MiB
    /// as DDP).
    pub fn bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.bucket_cap_bytes = Some(bytes);
        self
    }

    /// Uses the given process identity instead of reading the environment.
    pub fn process_state(mut self, state: ProcessState) -> Self {
        self.state = Some(state);
        self
    }

    /// Precision of the forward and backward passes (default: `ACCELERATE_MIXED_PRECISION`, else
    /// [`MixedPrecision::No`]). See [`mixed_precision`](crate::mixed_precision).
    pub fn mixed_precision(mut self, mode: MixedPrecision) -> Self {
        self.mixed_precision = Some(mode);
        self
    }

    /// The fp16 loss scaler's hyper-parameters (default: PyTorch `GradScaler`'s).
    pub fn loss_scaler(mut self, config: LossScalerConfig) -> Self {
        self.loss_scaler = config;
        self
    }

    /// The dtype gradient buckets travel in when they are averaged across ranks: F32 (the
    /// default, exact) or BF16 / F16, which halve the traffic at the cost of rounding the
    /// average to 8 (or 11) significant bits, like PyTorch DDP's `bf16_compress_hook`. Gradients
    /// are still accumulated in f32, and a single process rounds nothing.
    pub fn gradient_reduce_dtype(mut self, dtype: candle_core::DType) -> Self {
        self.gradient_reduce_dtype = Some(dtype);
        self
    }

    /// Whether the sync micro-step overlaps communication with preparation: while gradient
    /// bucket i is all-reduced on the calling thread, a worker thread adds the backward pass's
    /// gradients into buckets i+1, i+2, ... (and fills the missing ones with zeros). The averaged
    /// gradients are bitwise the same either way; only the time differs, and it only can with
    /// several buckets (a model larger than the bucket cap, or a smaller
    /// [`bucket_cap_bytes`](Self::bucket_cap_bytes)) and more than one rank.
    ///
    /// It applies to CPU devices. On CUDA the accumulation is already queued asynchronously on the
    /// device's stream, and candle's work from another thread would go to that thread's stream,
    /// unordered with the NCCL reduction, so there the option changes nothing.
    ///
    /// Default: `ACCELERATE_OVERLAP_GRADIENT_REDUCTION`, else
    /// [`DEFAULT_OVERLAP_GRADIENT_REDUCTION`].
    pub fn overlap_gradient_reduction(mut self, overlap: bool) -> Self {
        self.overlap_gradient_reduction = Some(overlap);
        self
    }

    /// Reads the environment and builds the accelerator.
    pub fn build(self) -> Result<Accelerator> {
        use candle_core::DType;
        let reduce_dtype = self.gradient_reduce_dtype.unwrap_or(DType::F32);
        if !matches!(reduce_dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::Config(format!(
                "gradient_reduce_dtype({reduce_dtype:?}): gradients are averaged in F32, BF16 or \
                 F16"
            )));
        }
        let steps = match self.gradient_accumulation_steps {
            Some(k) => k,
            None => env::read(
                env::GRADIENT_ACCUMULATION_STEPS,
                "expected a positive integer (1 means no accumulation)",
                |v| v.parse::<usize>().ok().filter(|&k| k > 0),
            )?
            .unwrap_or(1),
        };
        let accumulation = Accumulation::new(steps)?;
        let mode = match self.mixed_precision {
            Some(m) => m,
            None => MixedPrecision::from_env()?.unwrap_or_default(),
        };
        let mixed = MixedPrecisionState::new(mode, self.loss_scaler)?;
        let state = match self.state {
            Some(s) => s,
            None => ProcessState::from_env()?,
        };
        let bucket_cap_bytes = match self.bucket_cap_bytes {
            Some(b) => b,
            None => env::read(
                env::BUCKET_CAP_MB,
                "expected a positive number of MiB (DDP's default is 25)",
                |v| {
                    v.parse::<f64>()
                        .ok()
                        .filter(|mb| *mb > 0.0 && mb.is_finite())
                },
            )?
            .map_or(DEFAULT_BUCKET_CAP_BYTES, |mb| {
                (mb * 1024.0 * 1024.0) as usize
            }),
        };
        let overlap_gradient_reduction = match self.overlap_gradient_reduction {
            Some(overlap) => overlap,
            None => env::read(
                env::OVERLAP_GRADIENT_REDUCTION,
                env::SWITCH_VALUES,
                env::switch,
            )?
            .unwrap_or(DEFAULT_OVERLAP_GRADIENT_REDUCTION),
        };
        let device = match self.device {
            Some(device) => device,
            None => crate::device::select_device(&state)?,
        };
        let membership = join(&state, &device)?;
        if device.is_cpu() {
            crate::malloc::keep_freed_memory();
        }
        let seed = self.seed.unwrap_or(0);
        if !device.is_cpu() {
            // The CPU generator cannot be seeded in candle; ours are explicit ChaCha generators.
            device.set_seed(seed)?;
        }
        let rng = crate::rng::RankRng::new(seed, state.rank);
        Ok(Accelerator {
            reduce_dtype,
            state,
            device,
            seed,
            rng,
            bucket_cap_bytes,
            overlap_gradient_reduction,
            comm: membership.comm,
            store: membership.store,
            _hosted_store: membership.hosted,
            params: Vec::new(),
            grad_sync: std::cell::Cell::new(GradientSyncStats::default()),
            shared: Arc::new(TrainingState {
                accumulation: Mutex::new(accumulation),
                grads: Mutex::new(None),
                loaders: Mutex::new(Vec::new()),
                optimizers: Mutex::new(Vec::new()),
                schedulers: Mutex::new(Vec::new()),
                mixed: Mutex::new(mixed),
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
    /// This rank's generator, saved in checkpoints.
    rng: crate::rng::RankRng,
    bucket_cap_bytes: usize,
    /// Whether the sync micro-step fills later buckets while earlier ones are reduced.
    overlap_gradient_reduction: bool,
    comm: Box<dyn Communicator>,
    store: Option<Arc<dyn Store>>,
    /// The store this process hosts (rank 0 under torchrun or SLURM); serves until dropped.
    _hosted_store: Option<StoreServer>,
    /// The prepared parameters, sorted by name.
    params: Vec<(String, Var)>,
    grad_sync: std::cell::Cell<GradientSyncStats>,
    /// The dtype buckets are averaged in across ranks.
    reduce_dtype: candle_core::DType,
    shared: Arc<TrainingState>,
}

/// Traffic of gradient synchronization alone (the communicator's counters also include metrics,
/// item counts and user collectives).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GradientSyncStats {
    /// Bucket all-reduces issued.
    pub all_reduces: u64,
    /// Bytes of gradient buckets reduced.
    pub bytes: u64,
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

    /// The mixed-precision mode.
    pub fn mixed_precision(&self) -> MixedPrecision {
        lock(&self.shared.mixed).mode
    }

    /// The dtype to build the model in and to cast float inputs to: F32, or BF16/F16 under mixed
    /// precision (`VarBuilder::from_varmap(&varmap, acc.compute_dtype(), acc.device())`).
    pub fn compute_dtype(&self) -> candle_core::DType {
        self.mixed_precision().compute_dtype()
    }

    /// The fp16 loss scale the next backward pass multiplies the loss by; `None` without fp16.
    pub fn loss_scale(&self) -> Option<f64> {
        lock(&self.shared.mixed).scaler.as_ref().map(|s| s.scale())
    }

    /// Whether the last sync micro-step skipped its optimizer step because the fp16 gradients
    /// overflowed (Accelerate's `optimizer.step_was_skipped`).
    pub fn step_was_skipped(&self) -> bool {
        lock(&self.shared.accumulation).step_was_skipped
    }

    /// The configured seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// This rank's own random generator, seeded from [`seed`](Self::seed) and the rank, saved by
    /// [`save_state`](Self::save_state) and restored by [`load_state`](Self::load_state): draw
    /// dropout masks and anything else random from it, so that a resumed run continues bitwise
    /// (see [`rng`](crate::rng)).
    pub fn rng(&self) -> &crate::rng::RankRng {
        &self.rng
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
    /// Returns the sorted `(name, Var)` pairs, to build the optimizer from. Under mixed precision
    /// `vars` are the model's half-precision compute copies and the returned pairs are their f32
    /// master weights (same names), which the gradient buffers, the optimizer and checkpoints use.
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
        if self.state.world_size > 1 {
            self.check_same_parameters_everywhere(&vars)?;
        }
        let mut mixed = lock(&self.shared.mixed);
        let (params, weights) = match mixed.mode {
            MixedPrecision::No => (vars, None),
            mode => {
                let w = MasterWeights::new(vars, mode)?;
                (w.masters().to_vec(), Some(w))
            }
        };
        if self.state.world_size > 1 {
            // Same start everywhere: rank 0's values (the masters), in sorted-name order.
            for (_, var) in &params {
                self.comm.broadcast(var.as_tensor(), 0)?;
            }
        }
        if let Some(w) = &weights {
            w.refresh_compute()?;
        }
        mixed.weights = weights;
        let buffers = if self.state.world_size > 1 {
            GradientBuffers::new_for_ranks(&params, self.bucket_cap_bytes)?
        } else {
            GradientBuffers::new(&params, self.bucket_cap_bytes)?
        };
        *lock(&self.shared.grads) = Some(buffers);
        self.params = params.clone();
        Ok(params)
    }

    /// Compares this rank's parameter names, shapes and dtypes with every other rank's, through
    /// the store; every rank reports the same first difference.
    fn check_same_parameters_everywhere(&self, vars: &[(String, Var)]) -> Result<()> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        // The gradient buckets are reduced without a per-call size check (their layout is
        // agreed here), so everything that shapes them or their wire dtype is compared too.
        let layout = format!(
            "gradient buckets: cap {} bytes, reduced in {:?}, mixed precision {}, overlap {}\n",
            self.bucket_cap_bytes,
            self.reduce_dtype,
            lock(&self.shared.mixed).mode,
            self.overlap_gradient_reduction
        );
        let signature: String = std::iter::once(layout)
            .chain(
                vars.iter()
                    .map(|(n, v)| format!("{n} {:?} {:?}\n", v.dims(), v.dtype())),
            )
            .collect();
        let key = |r: usize| format!("accelerate/parameters/{r}");
        store.set(&key(self.state.rank), signature.as_bytes())?;
        let timeout = crate::comm::cpu::CpuCommOptions::from_env()?.timeout;
        let reference = String::from_utf8_lossy(&store.get(&key(0), timeout)?).into_owned();
        for r in 1..self.state.world_size {
            let theirs = String::from_utf8_lossy(&store.get(&key(r), timeout)?).into_owned();
            if theirs != reference {
                let ours_lines: Vec<&str> = reference.lines().collect();
                let their_lines: Vec<&str> = theirs.lines().collect();
                let first = (0..ours_lines.len().max(their_lines.len()))
                    .find(|&i| ours_lines.get(i) != their_lines.get(i))
                    .unwrap_or(0);
                if first == 0 {
                    return Err(Error::Config(format!(
                        "rank {r} is configured differently from rank 0: rank 0 has {:?}, rank \
                         {r} has {:?}; give every rank the same ACCELERATE_BUCKET_CAP_MB, \
                         ACCELERATE_MIXED_PRECISION, ACCELERATE_OVERLAP_GRADIENT_REDUCTION and \
                         builder options",
                        ours_lines.first().unwrap_or(&"nothing"),
                        their_lines.first().unwrap_or(&"nothing")
                    )));
                }
                return Err(Error::Parameters(format!(
                    "rank {r} has different parameters than rank 0 (first difference: rank 0 has \
                     {:?}, rank {r} has {:?}; {} vs {} parameters); every rank must build the \
                     same model",
                    ours_lines.get(first).unwrap_or(&"nothing"),
                    their_lines.get(first).unwrap_or(&"nothing"),
                    ours_lines.len() - 1,
                    their_lines.len() - 1
                )));
            }
        }
        Ok(())
    }

    /// Number of gradient buckets (each is one all-reduce per optimizer step).
    pub fn gradient_buckets(&self) -> usize {
        lock(&self.shared.grads)
            .as_ref()
            .map_or(0, |g| g.buckets().len())
    }

    /// Whether the sync micro-step overlaps the reduction of a gradient bucket with the
    /// preparation of the next, as configured
    /// ([`AcceleratorBuilder::overlap_gradient_reduction`]). It takes effect only with more than
    /// one rank, on the CPU, and with more than one bucket.
    pub fn overlaps_gradient_reduction(&self) -> bool {
        self.overlap_gradient_reduction
    }

    /// The prepared parameters, sorted by name (under mixed precision, the f32 master weights).
    pub fn parameters(&self) -> &[(String, Var)] {
        &self.params
    }

    /// A copy of the gradient accumulated for parameter `name` in the current window (f32 under
    /// mixed precision, already divided by the fp16 loss scale; averaged across ranks once the
    /// sync micro-step's backward ran), or `None` if it has none (PyTorch's `grad is None`).
    pub fn gradient(&self, name: &str) -> Result<Option<Tensor>> {
        let grads = lock(&self.shared.grads);
        match grads.as_ref().and_then(|g| g.get(name)) {
            Some(t) => Ok(Some(t.copy()?)),
            None => Ok(None),
        }
    }

    /// Copies the master weights into the model's half-precision compute copies. Call it after
    /// writing the masters yourself (e.g. loading initial weights into the Vec that
    /// `prepare_parameters` returned); the optimizer step and `load_state` do it on their own.
    /// Does nothing without mixed precision.
    pub fn refresh_compute_parameters(&self) -> Result<()> {
        lock(&self.shared.mixed).refresh_compute()
    }

    /// Wraps an optimizer so that it steps only when gradients sync. Its parameters must be the
    /// prepared ones.
    pub fn prepare_optimizer<O: Optimizer + Send + 'static>(
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
        let mode = lock(&self.shared.mixed).mode;
        if mode != MixedPrecision::No {
            // Same names, other Vars: the half compute copies instead of the f32 masters.
            let stray = optimizer
                .params()
                .iter()
                .zip(&self.params)
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
        Ok(PreparedOptimizer::new(optimizer, self.shared.clone()))
    }

    /// Wraps a scheduler so that it advances once per optimizer step.
    pub fn prepare_scheduler(&mut self, scheduler: LrScheduler) -> PreparedScheduler {
        PreparedScheduler::new(scheduler, self.shared.clone())
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
        let index = lock(&self.shared.loaders).len();
        if self.state.world_size > 1 {
            let settings = crate::data::LoaderSettings::new(
                &loader.plan(),
                self.gradient_accumulation_steps(),
            );
            self.check_same_loader_everywhere(index, &settings)?;
        }
        lock(&self.shared.loaders).push(loader.progress());
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

    /// Begins a micro-step: decides whether it syncs and how its loss is scaled. Call it once per
    /// batch, after taking the batch from the prepared loader.
    pub fn accumulate(&self) -> MicroStep {
        let loader = self.active_loader();
        let mut acc = lock(&self.shared.accumulation);
        let step = acc.begin_explicit(loader.as_ref());
        if std::mem::take(&mut acc.abandoned_window) {
            if let Some(g) = lock(&self.shared.grads).as_mut() {
                g.zero();
            }
        }
        step
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
        let loader = self.active_loader();
        lock(&self.shared.accumulation).set_window_items(
            global,
            self.state.world_size,
            loader.as_ref(),
        )
    }

    /// Computes the gradients of `loss` (a scalar) and adds them, scaled for the window, into the
    /// gradient buffers. On the micro-step that syncs, the buffers are averaged across ranks.
    ///
    /// A parameter that got no gradient in the window on any rank keeps none (the optimizer skips
    /// it); one that got a gradient on some ranks only is averaged with zeros for the others. Both
    /// are what one process training on the whole window's batch would have, at any world size.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        if loss.elem_count() != 1 {
            return Err(Error::Config(format!(
                "backward needs a scalar loss, got shape {:?}; reduce it with mean() or sum()",
                loss.dims()
            )));
        }
        let loader = self.active_loader();
        let mut acc = lock(&self.shared.accumulation);
        let step = acc.current_for_backward(loader.as_ref())?;
        let abandoned = std::mem::take(&mut acc.abandoned_window);
        let loss_scale = lock(&self.shared.mixed).loss_scale();
        let grad_store = if loss_scale == 1.0 {
            loss.backward()?
        } else {
            // fp16: scaled so that small gradients survive in half precision; the scale is
            // divided out when they are added into the f32 buffers. Scaled in f32, so that the
            // loss itself cannot overflow.
            (loss.to_dtype(candle_core::DType::F32)? * loss_scale)?.backward()?
        };
        let mut grads = lock(&self.shared.grads);
        let buffers = grads.as_mut().ok_or_else(|| {
            Error::Parameters(
                "backward before prepare_parameters: the accelerator does not know the model's \
                 parameters"
                    .into(),
            )
        })?;
        if abandoned {
            buffers.zero();
        }
        let mut mixed = lock(&self.shared.mixed);
        let sources = mixed.grad_sources(&self.params);
        let scale = step.loss_scale / loss_scale;
        if step.sync {
            let options = SyncOptions {
                // Whole buckets are reduced, so a parameter without a gradient on this rank takes
                // part with zeros; `agree_on_missing_gradients` then takes the gradient away
                // again from those that no rank had.
                fill_missing: self.state.world_size > 1,
                // Alone, the reduction is the identity: there is nothing to overlap with.
                overlap: self.overlap_gradient_reduction
                    && self.state.world_size > 1
                    && self.device.is_cpu(),
            };
            let mut stats = self.grad_sync.get();
            buffers.accumulate_and_reduce(sources, &grad_store, scale, options, |bucket| {
                self.reduce_bucket(bucket, &mut stats)
            })?;
            self.agree_on_missing_gradients(buffers, &mut stats)?;
            self.grad_sync.set(stats);
            // After the reduction, so that every rank sees the same gradients and decides alike.
            mixed.after_sync(buffers)?;
        } else {
            buffers.accumulate(sources, &grad_store, scale)?;
        }
        acc.backward_finished();
        Ok(())
    }

    /// After the sync step's reduction on several ranks: a parameter that got no gradient on any
    /// rank in the window keeps none on every rank, so the optimizer skips it (no weight decay, no
    /// momentum), exactly as one process training on the whole batch would; one that got a
    /// gradient on some rank keeps the average in which the others count as zeros, which is the
    /// big batch's gradient too (DDP with `find_unused_parameters` does the same). The ranks learn
    /// whether anyone missed a gradient from the flag reduced with the last bucket, so only then
    /// does one more all-reduce, of a presence mask of one element per parameter, take place.
    fn agree_on_missing_gradients(
        &self,
        buffers: &mut GradientBuffers,
        stats: &mut GradientSyncStats,
    ) -> Result<()> {
        if self.state.world_size == 1 || !buffers.missing_on_some_rank()? {
            return Ok(());
        }
        let present = buffers.local_presence_mask()?;
        self.comm.all_reduce(&present, ReduceOp::Max)?;
        stats.all_reduces += 1;
        stats.bytes += (present.elem_count() * present.dtype().size_in_bytes()) as u64;
        buffers.keep_only_present(&present)
    }

    /// Averages one gradient bucket across ranks in place and counts it. At world size 1 the
    /// reduction is the identity, but it is still counted, so the traffic accounting reads the
    /// same at any size.
    fn reduce_bucket(&self, bucket: &GradientBucket, stats: &mut GradientSyncStats) -> Result<()> {
        let flat = bucket.flat();
        // Bucket sizes were agreed at prepare: no pre-flight agreement per bucket.
        if flat.dtype() == self.reduce_dtype || self.state.world_size == 1 {
            self.comm.all_reduce_agreed(flat, ReduceOp::Mean)?;
            stats.bytes += bucket.size_in_bytes() as u64;
        } else {
            // Compressed: the average travels in the smaller type and is widened back into the
            // bucket, as DDP's bf16_compress_hook does.
            let wire = flat.to_dtype(self.reduce_dtype)?;
            self.comm.all_reduce_agreed(&wire, ReduceOp::Mean)?;
            flat.slice_set(&wire.to_dtype(flat.dtype())?, 0, 0)?;
            stats.bytes += (wire.elem_count() * wire.dtype().size_in_bytes()) as u64;
        }
        stats.all_reduces += 1;
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

    /// Gradient all-reduces issued so far (one per bucket per optimizer step) and their bytes.
    pub fn gradient_sync_stats(&self) -> GradientSyncStats {
        self.grad_sync.get()
    }

    /// The prepared loader a loop is iterating: the one that handed out a batch last.
    fn active_loader(&self) -> Option<Arc<LoaderProgress>> {
        lock(&self.shared.loaders)
            .iter()
            .max_by_key(|p| p.last_activity())
            .cloned()
    }

    /// Reduces a tensor over all ranks (a copy; the argument is untouched). Like
    /// [`gather`](Self::gather), any dtype and layout works, on the host or on the accelerator's
    /// device (the result is on the tensor's device). Ranks passing different sizes or dtypes
    /// get an error naming each rank and its tensor, on every rank.
    pub fn reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (wire, original) = wire_dtype(tensor)?;
        let out = if original.is_none() && wire.is_contiguous() {
            wire.copy()?
        } else {
            wire
        };
        self.comm.all_reduce(&out, op)?;
        Ok(match original {
            Some(dtype) => out.to_dtype(dtype)?,
            None => out,
        })
    }

    /// Reduces a tensor over all ranks in place (every rank ends with the result). The tensor
    /// must be contiguous (a view with an offset is fine) and of a dtype the communicators carry
    /// (see [`Communicator`]); on the host or on the accelerator's device.
    pub fn reduce_in_place(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.comm.all_reduce(tensor, op)
    }

    /// Reduces one number over all ranks. The tensor is built on the host whatever the device:
    /// the communicator stages it (NCCL through its GPU), and the value is read back on the
    /// host anyway.
    fn reduce_scalar(&self, value: f64, op: ReduceOp) -> Result<f64> {
        if self.state.world_size == 1 {
            return Ok(value);
        }
        let t = Tensor::new(&[value], &Device::Cpu)?;
        self.comm.all_reduce(&t, op)?;
        Ok(t.to_vec1::<f64>()?[0])
    }

    /// Concatenates `tensor` of every rank along dimension 0, in rank order. Any dtype and layout
    /// works, on one process as on many, on the host or on the accelerator's device (the result
    /// is on the tensor's device; integer tensors such as `argmax` predictions travel as i64,
    /// half floats as f32, and come back in their own dtype). Ranks passing different shapes get
    /// an error naming each rank's; pad ragged tensors first with
    /// [`pad_across_processes`](Self::pad_across_processes).
    pub fn gather(&self, tensor: &Tensor) -> Result<Tensor> {
        let (wire, original) = wire_dtype(tensor)?;
        let gathered = self.comm.all_gather(&wire)?;
        Ok(match original {
            Some(dtype) => gathered.to_dtype(dtype)?,
            None => gathered,
        })
    }

    /// [`gather`](Self::gather) for evaluation metrics: inside the loop over a prepared loader, at
    /// its last batch, the rows of the wrap-around samples (which complete the last round so that
    /// every rank steps equally) are dropped, so an epoch gathers exactly the dataset's samples.
    /// Pass one row per sample of the current batch, iterating the loader with `iter()`, or with
    /// `windows()` and one [`accumulate`](Self::accumulate) per batch. Once the loop has ended (the
    /// iterator returned its end), nothing is dropped, as in Accelerate: a gather after the loop
    /// (per-rank totals, say) keeps every row.
    pub fn gather_for_metrics(&self, tensor: &Tensor) -> Result<Tensor> {
        let gathered = self.gather(tensor)?;
        let Some(loader) = self.active_loader() else {
            return Ok(gathered);
        };
        if !loader.in_last_batch_of_loop() {
            return Ok(gathered);
        }
        let Some(plan) = loader.plan() else {
            return Ok(gathered);
        };
        let remainder = plan.real_rows_of_last_round();
        let rows = gathered.dim(0)?;
        if remainder < rows {
            Ok(gathered.narrow(0, 0, remainder)?)
        } else {
            Ok(gathered)
        }
    }

    /// Pads `tensor` along `dim` with `value` up to the largest size any rank has there, so that
    /// ragged tensors can be gathered.
    pub fn pad_across_processes(&self, tensor: &Tensor, dim: usize, value: f64) -> Result<Tensor> {
        let size = tensor.dim(dim)?;
        let max = self.reduce_scalar(size as f64, ReduceOp::Max)? as usize;
        if max == size {
            return Ok(tensor.clone());
        }
        let mut pad_shape = tensor.dims().to_vec();
        pad_shape[dim] = max - size;
        let pad = (Tensor::ones(pad_shape, tensor.dtype(), tensor.device())? * value)?;
        Ok(Tensor::cat(&[tensor, &pad], dim)?)
    }

    /// This rank's contiguous share of `items`: the shares are as equal as possible, the first
    /// ranks getting one more when the length does not divide.
    pub fn split_between_processes<'a, T>(&self, items: &'a [T]) -> &'a [T] {
        let (n, r) = (self.state.world_size, self.state.rank);
        let (base, extra) = (items.len() / n, items.len() % n);
        let start = r * base + r.min(extra);
        let len = base + usize::from(r < extra);
        &items[start..start + len]
    }

    /// Runs `f` on the main process first, then on the others (e.g. to download or preprocess
    /// once and read from cache afterwards).
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        if !self.is_main_process() {
            self.wait_for_everyone()?;
        }
        let result = f();
        if self.is_main_process() {
            self.wait_for_everyone()?;
        }
        Ok(result)
    }

    /// For a step done on some ranks only (typically writing a file on the main process): every
    /// rank calls it with its outcome, and all return `Ok` only if every rank succeeded; otherwise
    /// each returns an error naming the rank that failed and why (the failed rank returns its own
    /// error). `path` is what the step wrote, `what` says what it was (`"writing the model"`). It
    /// is a collective: call it on every rank at the same point.
    pub fn agree_across_ranks(
        &self,
        path: &std::path::Path,
        what: &str,
        local: Result<()>,
    ) -> Result<()> {
        crate::checkpoint::agree_with(|t| self.gather(t), self.num_processes(), path, what, local)
    }

    /// Waits until every rank has reached this point.
    pub fn wait_for_everyone(&self) -> Result<()> {
        self.comm.barrier()
    }

    /// Saves the whole training state into `dir` (see [`checkpoint`](crate::checkpoint)):
    /// parameters, every prepared optimizer and scheduler, the accumulation counters and, per
    /// rank, the data loaders' positions, its generator ([`rng`](Self::rng)) and a partial
    /// window's gradients. Call it on every rank at the same point of the loop; it returns once the
    /// checkpoint is complete on disk, with the same outcome on every rank: if any rank fails, all
    /// return an error naming it. An existing checkpoint at `dir` is replaced atomically, and a
    /// replace that a crash interrupted is finished or rolled back first.
    pub fn save_state(&self, dir: impl AsRef<std::path::Path>) -> Result<()> {
        crate::checkpoint::save_state(&self.training_view(), dir.as_ref())
    }

    /// Saves the state as `<root>/checkpoint_<N>`, N being the optimizer steps taken, then deletes
    /// the oldest checkpoints beyond `keep` (main process), never the one just written. Refuses
    /// (on every rank, before writing anything) when `root` holds a checkpoint with a larger N:
    /// another run's, which would otherwise stay the latest (see
    /// [`check_no_newer_checkpoint`](crate::checkpoint::check_no_newer_checkpoint)). Returns the
    /// checkpoint's directory.
    pub fn save_checkpoint(
        &self,
        root: impl AsRef<std::path::Path>,
        keep: Option<usize>,
    ) -> Result<std::path::PathBuf> {
        let root = root.as_ref();
        if keep == Some(0) {
            // Refused before anything is written.
            crate::checkpoint::prune_checkpoints(root, 0)?;
        }
        let step = self.optimizer_steps();
        let dir = crate::checkpoint::checkpoint_dir(root, step);
        let view = self.training_view();
        let checked = if self.is_main_process() {
            crate::checkpoint::check_no_newer_checkpoint(root, step)
        } else {
            Ok(())
        };
        view.agree(root, "checking the checkpoint directory", checked)?;
        crate::checkpoint::save_state(&view, &dir)?;
        let pruned = match (keep, self.is_main_process()) {
            (Some(keep), true) => {
                crate::checkpoint::prune_checkpoints_keeping(root, keep, &dir).map(|_| ())
            }
            _ => Ok(()),
        };
        view.agree(root, "deleting the oldest checkpoints", pruned)?;
        Ok(dir)
    }

    /// Restores a state saved by [`save_state`](Self::save_state) from `dir`, or from the latest
    /// `checkpoint_<N>` under `dir` (under mixed precision: the f32 master weights, copied into
    /// the compute copies, and the fp16 loss scaler), with each rank's generator. Prepare the same
    /// parameters, optimizers, schedulers and loaders first, and call it on every rank. A save
    /// that a crash interrupted between its renames is finished or rolled back first (saying so on
    /// stderr). Every file is verified before anything changes: on an error on any rank nothing is
    /// loaded on any. Loaders continue from their saved position at their next `iter()`. Returns
    /// the directory loaded.
    pub fn load_state(&self, dir: impl AsRef<std::path::Path>) -> Result<std::path::PathBuf> {
        crate::checkpoint::load_state(&self.training_view(), dir.as_ref())
    }

    /// Writes the model alone into `dir` as safetensors with PyTorch names and layouts
    /// (`model.safetensors`, or shards with a Hugging Face index above 5 GB). Main process only
    /// writes; every rank returns after it finished, with its outcome (an error naming rank 0 if
    /// it failed).
    pub fn save_model(&self, dir: impl AsRef<std::path::Path>) -> Result<()> {
        self.save_model_sharded(dir, crate::checkpoint::DEFAULT_MAX_SHARD_BYTES)
    }

    /// [`save_model`](Self::save_model) with shards of at most `max_shard_bytes`.
    pub fn save_model_sharded(
        &self,
        dir: impl AsRef<std::path::Path>,
        max_shard_bytes: u64,
    ) -> Result<()> {
        let dir = dir.as_ref();
        let written = if self.is_main_process() {
            crate::checkpoint::save_model(&self.params, dir, max_shard_bytes).map(|_| ())
        } else {
            Ok(())
        };
        self.training_view()
            .agree(dir, "writing the model", written)
    }

    fn training_view(&self) -> crate::checkpoint::TrainingView<'_> {
        crate::checkpoint::TrainingView {
            rank: self.state.rank,
            world_size: self.state.world_size,
            comm: self.comm.as_ref(),
            params: &self.params,
            shared: &self.shared,
            rng: &self.rng,
            device: &self.device,
        }
    }

    /// Prints on the main process only.
    pub fn print(&self, message: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{message}");
        }
    }
}

/// A contiguous tensor of a dtype that reduces without loss or overflow (f32, f64, i64), and the dtype to
/// convert the result back to, if it differs.
fn wire_dtype(tensor: &Tensor) -> Result<(Tensor, Option<candle_core::DType>)> {
    use candle_core::DType;
    let wire = match tensor.dtype() {
        DType::F32 | DType::F64 | DType::I64 => None,
        // Every integer travels as i64: exact, and a sum over ranks does not overflow.
        DType::U8 | DType::U32 | DType::I16 | DType::I32 => Some(DType::I64),
        // Half and smaller floats as f32: a metric summed over ranks keeps its precision.
        _ => Some(DType::F32),
    };
    let t = match wire {
        Some(w) => tensor.to_dtype(w)?,
        None => tensor.contiguous()?,
    };
    Ok((t.contiguous()?, wire.map(|_| tensor.dtype())))
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

/// Every optimizer, the library's and a user's own: anything implementing [`Optimizer`].
impl<O: Optimizer + Send + 'static> Prepare for O {
    type Prepared = PreparedOptimizer<O>;
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
        accelerator.prepare_data_loader(self)
    }
}
