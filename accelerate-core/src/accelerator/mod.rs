//! The facade a training loop talks to. It owns the wiring (the process identity, the
//! communicator, the gradient sync and the training state) and delegates each call in a few
//! lines: configuration in `builder`, `prepare` in `prepare`, collectives in `collectives`,
//! checkpoints in `checkpointing`; the steps of the loop in [`crate::training`].

mod builder;
mod checkpointing;
mod collectives;
mod logging;
mod prepare;

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::checkpoint::SharedCustomState;
use crate::comm::store::{Store, StoreServer};
use crate::comm::{CommStats, Communicator};
use crate::data::PreparedLoaders;
use crate::error::Result;
use crate::mixed_precision::{LossScalerConfig, MixedPrecision};
use crate::model::PreparedModel;
use crate::process::ProcessState;
use crate::rng::RankRng;
use crate::sync::GradientSyncStats;
use crate::tracking::Trackers;
use crate::training::{lock, SharedSync, TrainingState};
use crate::window::MicroStep;

pub use crate::sync::DEFAULT_OVERLAP_GRADIENT_REDUCTION;
pub use builder::AcceleratorBuilder;
pub use prepare::Prepare;

/// Runs a custom training loop on one process, or as one rank of many, with gradient accumulation.
///
/// See the crate documentation for the canonical loop.
pub struct Accelerator {
    state: ProcessState,
    device: Device,
    seed: u64,
    /// This rank's generator, saved in checkpoints.
    rng: RankRng,
    bucket_cap_bytes: usize,
    comm: Arc<dyn Communicator>,
    /// The ZeRO stage and the link the training states reach the communicator through.
    zero: crate::zero::ZeroConfig,
    store: Option<Arc<dyn Store>>,
    /// The store this process hosts (rank 0 under torchrun, SLURM or MPI); serves until dropped.
    _hosted_store: Option<StoreServer>,
    /// How gradients are averaged across ranks, and the traffic so far (shared with every
    /// prepared model).
    sync: SharedSync,
    /// The prepared loaders, shared by every model.
    loaders: Arc<PreparedLoaders>,
    /// Each prepared model's training state (everything a training step changes, shared with
    /// the prepared objects), in order of preparation. The first exists from the start: it is
    /// the one the methods without a model argument act on.
    models: Vec<Arc<TrainingState>>,
    /// The handle of the first model (over `models[0]`), which the loop calls act on.
    first: PreparedModel,
    /// Every prepared model's frozen parameters, which no optimizer may hold.
    frozen: Vec<(String, candle_core::Var)>,
    /// The loss scaler's configuration, for the training state of each further model.
    loss_scaler: LossScalerConfig,
    /// The user's objects registered for checkpointing, in order of registration.
    custom: Vec<SharedCustomState>,
    /// The trackers `log` writes to (none off the main process).
    trackers: std::sync::Mutex<Trackers>,
}

impl std::fmt::Debug for Accelerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accelerator")
            .field("state", &self.state)
            .field("device", &self.device)
            .field("models", &self.models.len())
            .field("parameters", &self.training().parameters().len())
            .finish_non_exhaustive()
    }
}

impl Accelerator {
    /// The first model's training state (what the methods without a model argument act on).
    fn training(&self) -> &Arc<TrainingState> {
        self.first.training()
    }

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
        self.training().mixed_precision()
    }

    /// The dtype to build the model in and to cast float inputs to: F32, or BF16/F16 under mixed
    /// precision (`VarBuilder::from_varmap(&varmap, acc.compute_dtype(), acc.device())`).
    pub fn compute_dtype(&self) -> candle_core::DType {
        self.mixed_precision().compute_dtype()
    }

    /// The fp16 loss scale the next backward pass multiplies the loss by; `None` without fp16.
    pub fn loss_scale(&self) -> Option<f64> {
        self.training().loss_scale()
    }

    /// Whether the last sync micro-step skipped its optimizer step because the fp16 gradients
    /// overflowed (Accelerate's `optimizer.step_was_skipped`).
    pub fn step_was_skipped(&self) -> bool {
        self.first.step_was_skipped()
    }

    /// The configured seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// This rank's own random generator, seeded from [`seed`](Self::seed) and the rank, saved by
    /// [`save_state`](Self::save_state) and restored by [`load_state`](Self::load_state): draw
    /// dropout masks and anything else random from it, so that a resumed run continues bitwise
    /// (see [`RankRng`]).
    pub fn rng(&self) -> &RankRng {
        &self.rng
    }

    /// Seeds every generator the runtime and candle use that can be seeded (Accelerate's
    /// `set_seed`): this rank's [`rng`](Self::rng) restarts as it does in a run built with
    /// `seed` (keyed by the seed and the rank, so ranks still draw different dropout masks), and
    /// on a GPU the device's generator is seeded with `seed` on every rank, so that `randn` on the
    /// device initializes every rank's model alike, as Accelerate's default
    /// (`device_specific=False`) does. [`seed`](Self::seed) reports it afterwards.
    ///
    /// The device's generator stays alike on every rank only until the first `save_state` or
    /// `load_state`, which reseed it from each rank's own generator so that a resumed run draws
    /// what the uninterrupted one would: build the model before then. candle's own dropout on
    /// the GPU draws from that generator; per-rank dropout masks that resume bitwise come from
    /// [`RankRng::dropout`].
    ///
    /// Not seeded: candle's CPU `rand`/`randn`, which draw from a thread generator that candle
    /// offers no way to seed (build CPU weights from a generator of your own, e.g.
    /// [`rank_rng`](Self::rank_rng), or broadcast them, as `prepare` does); and a data loader's
    /// shuffle, which follows its own `DataLoader::seed`.
    pub fn set_seed(&mut self, seed: u64) -> Result<()> {
        if !self.device.is_cpu() {
            self.device.set_seed(seed)?;
        }
        self.rng.reseed(seed);
        self.seed = seed;
        Ok(())
    }

    /// A ChaCha8 generator of your own for this rank, a pure function of the accelerator's
    /// [`seed`](Self::seed), the rank and `stream` (pick one stream per purpose: data
    /// augmentation, noise): the same in every run with the same seed, different on each rank
    /// and for each stream, and never the stream [`rng`](Self::rng) draws. Checkpoints do not
    /// save it: to continue bitwise after a resume, draw from [`rng`](Self::rng), which every
    /// rank saves for itself. (An object registered with
    /// [`register_for_checkpointing`](Self::register_for_checkpointing) does not do: only the
    /// main process's value is saved and every rank loads it, so per-rank generators kept there
    /// would all become rank 0's.)
    pub fn rank_rng(&self, stream: u64) -> rand_chacha::ChaCha8Rng {
        crate::rng::user_chacha(self.seed, self.state.rank, stream)
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
        self.first.gradient_accumulation_steps()
    }

    /// Optimizer updates per epoch for a loader of `batches_per_rank` batches per rank (the length
    /// of a prepared loader): size LR schedules with this, since schedulers count optimizer steps.
    pub fn num_update_steps(&self, batches_per_rank: usize) -> usize {
        batches_per_rank.div_ceil(self.gradient_accumulation_steps())
    }

    /// The ZeRO stage: 0 (plain data parallel), 1 or 2 (see
    /// [`AcceleratorBuilder::zero_stage`]).
    pub fn zero_stage(&self) -> u8 {
        self.zero.stage
    }

    /// Whether the sync micro-step overlaps the reduction of a gradient bucket with the
    /// preparation of the next, as configured
    /// ([`AcceleratorBuilder::overlap_gradient_reduction`]). It takes effect only with more than
    /// one rank, on the CPU, and with more than one bucket.
    pub fn overlaps_gradient_reduction(&self) -> bool {
        lock(&self.sync).overlap_configured()
    }

    /// The first prepared model: the one a plain `Vec<(String, Var)>` or `&VarMap` prepares, and
    /// the one this accelerator's loop calls ([`accumulate`](Self::accumulate),
    /// [`backward`](Self::backward), [`clip_grad_norm`](Self::clip_grad_norm), ...) act on.
    /// Read its gradients, parameters and bucket count through it.
    pub fn model(&self) -> &PreparedModel {
        &self.first
    }

    /// Begins a micro-step of the first model: decides whether it syncs and how its loss is
    /// scaled. Call it once per batch, after taking the batch from the prepared loader (per model:
    /// [`PreparedModel::accumulate`]).
    pub fn accumulate(&self) -> MicroStep {
        self.first.accumulate()
    }

    /// A guard in whose scope backward passes of the first model accumulate gradients locally,
    /// without the all-reduce, whatever K says (Accelerate's `accelerator.no_sync(model)`; per
    /// model: [`PreparedModel::no_sync`]). See [`NoSync`](crate::NoSync).
    pub fn no_sync(&self) -> crate::NoSync {
        self.first.no_sync()
    }

    /// Whether the current micro-step syncs gradients (and steps the optimizer). Use it to guard
    /// clipping and per-step logging.
    pub fn sync_gradients(&self) -> bool {
        self.first.sync_gradients()
    }

    /// Switches the first model's window about to begin to item-weighted accumulation (per
    /// model: [`PreparedModel::set_window_items`]): `local_items` is the number of items (e.g.
    /// non-padding tokens) in this rank's batches of the whole window, and the losses passed to
    /// [`backward`](Self::backward) in that window must be *sums* over items. The resulting
    /// gradient equals that of one batch holding the whole window on all ranks, averaged per
    /// item. Call before the window's first [`accumulate`](Self::accumulate); the count is summed
    /// over ranks.
    pub fn set_window_items(&self, local_items: usize) -> Result<()> {
        self.first.set_window_items(local_items)
    }

    /// Computes the gradients of `loss` (a scalar) and adds them, scaled for the window, into the
    /// gradient buffers. On the micro-step that syncs, the buffers are averaged across ranks.
    ///
    /// A parameter that got no gradient in the window on any rank keeps none (the optimizer skips
    /// it); one that got a gradient on some ranks only is averaged with zeros for the others. Both
    /// are what one process training on the whole window's batch would have, at any world size.
    /// Per model: [`PreparedModel::backward`].
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        self.first.backward(loss)
    }

    /// Scales the window's gradients so that their global L2 norm is at most `max_norm`, and
    /// returns the norm before clipping. Acts on the accumulated, averaged gradients, so it only
    /// does something on a micro-step that syncs; elsewhere it returns `None`.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<Option<f64>> {
        self.first.clip_grad_norm(max_norm)
    }

    /// Clamps every element of the window's gradients to `[-clip_value, clip_value]` (PyTorch's
    /// `clip_grad_value_`, Accelerate's `clip_grad_value_`). Like
    /// [`clip_grad_norm`](Self::clip_grad_norm) it acts on the accumulated, averaged gradients,
    /// so only on a micro-step that syncs (returning `true`); elsewhere it does nothing and
    /// returns `false`. Per model: [`PreparedModel::clip_grad_value`].
    pub fn clip_grad_value(&self, clip_value: f64) -> Result<bool> {
        self.first.clip_grad_value(clip_value)
    }

    /// Optimizer steps taken so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.first.optimizer_steps()
    }

    /// Traffic counters of the communicator (all-reduces issued, bytes sent). ZeRO stage 3's
    /// prefetched gathers run on a communicator of their own and are not in them;
    /// [`gradient_sync_stats`](Self::gradient_sync_stats) counts every gather.
    pub fn comm_stats(&self) -> CommStats {
        self.comm.stats()
    }

    /// How the collectives move data: `local` (one process), `tcp`, `shm` (shared memory inside
    /// one machine) or `nccl`; the CPU transport is chosen when the ranks connect
    /// (`ACCELERATE_CPU_TRANSPORT`, `auto` by default).
    pub fn transport_name(&self) -> &'static str {
        self.comm.transport_name()
    }

    /// Gradient all-reduces issued so far (one per bucket per optimizer step) and their bytes.
    pub fn gradient_sync_stats(&self) -> GradientSyncStats {
        lock(&self.sync).stats()
    }

    /// Prints on the main process only.
    pub fn print(&self, message: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{message}");
        }
    }
}
