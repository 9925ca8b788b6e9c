//! Configuration of an [`Accelerator`], from code and from the environment.

use std::sync::Arc;

use candle_core::{DType, Device};

use super::Accelerator;
use crate::comm::join::join;
use crate::data::PreparedLoaders;
use crate::env;
use crate::error::Result;
use crate::grads::DEFAULT_BUCKET_CAP_BYTES;
use crate::mixed_precision::{LossScalerConfig, MixedPrecision, MixedPrecisionState};
use crate::model::PreparedModel;
use crate::process::ProcessState;
use crate::rng::RankRng;
use crate::sync::{GradientSync, DEFAULT_OVERLAP_GRADIENT_REDUCTION};
use crate::tracking::{TrackerErrors, TrackerKind, Trackers};
use crate::training::TrainingState;
use crate::window::Accumulation;
use crate::zero::ZeroConfig;

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
    gradient_reduce_dtype: Option<DType>,
    overlap_gradient_reduction: Option<bool>,
    sync_each_batch: bool,
    keep_gathered_in_window: Option<bool>,
    fsdp_prefetch: Option<crate::zero::PrefetchDepth>,
    zero_stage: Option<u8>,
    report_to: Vec<TrackerKind>,
    logging_dir: Option<std::path::PathBuf>,
    tracker_errors: TrackerErrors,
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
    /// machine with GPUs, else the CPU; see [`select_device`](crate::select_device)).
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
    /// [`MixedPrecision::No`]). See [`MixedPrecision`].
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
    pub fn gradient_reduce_dtype(mut self, dtype: DType) -> Self {
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

    /// Averages the gradients across ranks on every micro-step, not only on the last of each
    /// accumulation window (Accelerate's `GradientAccumulationPlugin(sync_each_batch=True)`).
    /// The window's average, and so every update, is the same as without it (up to float
    /// rounding): each micro-step adds its local gradient to the window's sum, already equal on
    /// every rank, and averages again. It costs K times the gradient traffic. Under DDP it saves
    /// the memory of the unsynced gradients; here the window's sums live in the same buffers
    /// either way, so it saves nothing: use it to match an Accelerate configuration, or to spread
    /// the traffic over the window. With a reduced [`gradient_reduce_dtype`](Self::gradient_reduce_dtype)
    /// the window's running sum is rounded to that dtype at every micro-step rather than once, so
    /// the rounding grows with K. Default: off.
    pub fn sync_each_batch(mut self, each: bool) -> Self {
        self.sync_each_batch = each;
        self
    }

    /// Under ZeRO stage 3, keeps each unit's gathered parameters from its first gather in an
    /// accumulation window until the window's sync (Accelerate's choice for the micro-steps that
    /// do not sync): one all-gather per unit per window instead of two per micro-step, for the
    /// whole model held in the compute dtype during the window. The results are the same.
    /// Default: `ACCELERATE_FSDP_KEEP_GATHERED`, else off (re-gather; each rank holds 1/N of the
    /// model between uses).
    pub fn keep_gathered_in_window(mut self, keep: bool) -> Self {
        self.keep_gathered_in_window = Some(keep);
        self
    }

    /// Under ZeRO stage 3, how many units are all-gathered ahead of the one that runs, in the
    /// forward and in the backward pass (FSDP's forward and backward prefetch): a thread with a
    /// communicator of its own gathers them while this thread computes, in the order the units
    /// ran before. Each unit ahead holds one more unit's gathered parameters; the results are
    /// the same with any depth. 0 gathers each unit when it runs, on this thread.
    ///
    /// On the CPU communicators only: on NCCL the gathers run on the compute stream, in order,
    /// whatever this says.
    ///
    /// At most 64 units ahead in either pass. Default: `ACCELERATE_FSDP_FORWARD_PREFETCH` and
    /// `ACCELERATE_FSDP_BACKWARD_PREFETCH`, else Accelerate's: none.
    pub fn fsdp_prefetch(mut self, forward: usize, backward: usize) -> Self {
        self.fsdp_prefetch = Some(crate::zero::PrefetchDepth { forward, backward });
        self
    }

    /// The ZeRO stage (DeepSpeed's `zero_stage`; default: `ACCELERATE_ZERO_STAGE`, else 0):
    ///
    /// - 0: plain data parallel; every rank keeps the whole optimizer state and gradients.
    /// - 1: each rank keeps the optimizer state (AdamW's two moments, SGD's momentum) of its own
    ///   1/N of the parameters, updates only that part, and the updated parameters are
    ///   all-gathered by `optimizer.step()`.
    /// - 2: as 1, and the sync micro-step reduce-scatters the gradients instead of all-reducing
    ///   them, so each rank keeps only its 1/N of the averaged gradient.
    ///
    /// The results equal stage 0's within float rounding (stage 1 bitwise on the CPU). Under
    /// stages 1 and 2, `optimizer.step()` and (at stage 2) `clip_grad_norm` are collectives: every
    /// rank calls them, on the thread that built the accelerator. They need an optimizer of
    /// [`optim`](crate::optim) (its state can be cut into pieces); candle-nn's keep theirs private.
    ///
    /// - 3: fully sharded (PyTorch FSDP's `FULL_SHARD`): each rank keeps only its 1/N of the
    ///   parameters too. The model declares its units ([`Model::units`](crate::Model::units)) and
    ///   computes each through [`PreparedModel::unit`](crate::PreparedModel::unit); `prepare`
    ///   returns this rank's pieces, which any optimizer steps as it would whole parameters.
    pub fn zero_stage(mut self, stage: u8) -> Self {
        self.zero_stage = Some(stage);
        self
    }

    /// The trackers [`Accelerator::log`] writes to on the main process (Hugging Face's
    /// `report_to`; default none). [`parse_report_to`](crate::parse_report_to) reads a
    /// `--report-to tensorboard,csv,jsonl` flag.
    pub fn report_to(mut self, kinds: impl IntoIterator<Item = TrackerKind>) -> Self {
        self.report_to = kinds.into_iter().collect();
        self
    }

    /// The directory the trackers write to, created if missing. A directory that holds a
    /// previous run's files is continued (what a resumed run wants); one that another live run
    /// is writing to is refused. Default: a directory of this run's own,
    /// `runs/<YYYYmmdd-HHMMSS>_<host>` under [`DEFAULT_LOGGING_DIR`](crate::DEFAULT_LOGGING_DIR)
    /// (Hugging Face's Trainer uses `<output_dir>/runs/<time>_<host>`), so separate runs never
    /// mix their files.
    pub fn logging_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.logging_dir = Some(dir.into());
        self
    }

    /// What `log` and `end_training` do when a tracker cannot write its file (default
    /// [`TrackerErrors::Warn`]: print once per file and go on). The other trackers get every
    /// call either way.
    pub fn tracker_errors(mut self, policy: TrackerErrors) -> Self {
        self.tracker_errors = policy;
        self
    }

    /// Reads the environment and builds the accelerator.
    pub fn build(self) -> Result<Accelerator> {
        let state = match self.state.clone() {
            Some(s) => s,
            None => ProcessState::from_env()?,
        };
        // First, before any tensor op starts one of candle's pools.
        crate::threads::size_cpu_pools(&state);
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
        let loaders = Arc::new(PreparedLoaders::default());
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
        let zero_stage = crate::zero::check_stage(match self.zero_stage {
            Some(stage) => stage,
            None => env::read(
                env::ZERO_STAGE,
                "expected 0 (plain data parallel), 1, 2 or 3",
                |v| v.trim().parse::<u8>().ok(),
            )?
            .unwrap_or(0),
        })
        .map_err(|e| match (e, self.zero_stage) {
            (crate::Error::Config(m), None) => {
                crate::Error::Config(format!("{}: {m}", env::ZERO_STAGE))
            }
            (e, _) => e,
        })?;
        let keep_gathered = match self.keep_gathered_in_window {
            Some(keep) => keep,
            None => env::read(env::FSDP_KEEP_GATHERED, env::SWITCH_VALUES, env::switch)?
                .unwrap_or(false),
        };
        let prefetch = match self.fsdp_prefetch {
            Some(depth) => depth.check()?,
            None => crate::zero::PrefetchDepth::from_env()?,
        };
        if zero_stage >= 2 && self.sync_each_batch {
            return Err(crate::Error::Config(format!(
                "sync_each_batch(true) with ZeRO stage {zero_stage} is not supported: stage \
                 {zero_stage} keeps only this rank's 1/N of the gradients after each \
                 reduce-scatter, so a window's running sum cannot be averaged again; use \
                 zero_stage(1) or sync_each_batch(false)"
            )));
        }
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
        let sync = GradientSync::new(
            state.world_size,
            self.gradient_reduce_dtype.unwrap_or(DType::F32),
            overlap_gradient_reduction,
            &device,
        )?
        .sync_each_batch(self.sync_each_batch);
        let membership = join(&state, &device)?;
        if device.is_cpu() {
            crate::malloc::keep_freed_memory();
        }
        let seed = self.seed.unwrap_or(0);
        if !device.is_cpu() {
            // The CPU generator cannot be seeded in candle; ours are explicit ChaCha generators.
            device.set_seed(seed)?;
        }
        let rng = RankRng::new(seed, state.rank);
        let comm: Arc<dyn crate::comm::Communicator> = Arc::from(membership.comm);
        let mut zero = ZeroConfig::new(zero_stage, &comm);
        zero.keep_gathered = keep_gathered;
        zero.prefetch = prefetch;
        let sync = Arc::new(std::sync::Mutex::new(sync));
        let first = Arc::new(TrainingState::new(
            accumulation,
            mixed,
            loaders.clone(),
            zero.clone(),
        ));
        // Last, so that a build failing on anything else leaves no stray tracker files.
        let trackers = Trackers::open(
            &self.report_to,
            self.logging_dir.as_deref(),
            &state,
            self.tracker_errors,
        )?;
        Ok(Accelerator {
            state,
            device,
            seed,
            rng,
            bucket_cap_bytes,
            comm,
            store: membership.store,
            _hosted_store: membership.hosted,
            first: PreparedModel::new(0, first.clone(), zero.link.clone(), sync.clone()),
            sync,
            models: vec![first],
            zero,
            loaders,
            frozen: Vec::new(),
            loss_scaler: self.loss_scaler,
            custom: Vec::new(),
            trackers: std::sync::Mutex::new(trackers),
        })
    }
}
