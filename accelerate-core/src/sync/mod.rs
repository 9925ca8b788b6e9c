//! Gradient synchronization: on the micro-step that syncs, the window's gradients are averaged
//! across ranks, bucket by bucket, as DDP does.
//!
//! - Buckets are reduced in the order [`GradientBuffers`] fills them; with overlap, later buckets
//!   are filled on a worker thread while earlier ones are reduced.
//! - A bucket travels in the configured reduce dtype: f32 (exact), or bf16/f16 (compressed, DDP's
//!   `bf16_compress_hook`) and widened back into the f32 bucket.
//! - A parameter that no rank gave a gradient keeps none on every rank (one extra all-reduce of a
//!   presence mask, only in windows where some rank missed one).
//!
//! Bucket sizes are agreed when the parameters are prepared, so buckets are reduced without a
//! per-call pre-flight check.

mod overlap;

use std::cell::Cell;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::grads::{GradientBucket, GradientBuffers};
use crate::zero::ZeroState;
use overlap::SyncOptions;

/// Whether gradient reduction overlaps bucket preparation when neither the builder nor
/// [`crate::env::OVERLAP_GRADIENT_REDUCTION`] says. Off: with every core computing, no core is idle
/// while a rank reduces, so overlapping only adds work.
pub const DEFAULT_OVERLAP_GRADIENT_REDUCTION: bool = false;

/// Traffic of gradient synchronization alone (the communicator's counters also include metrics,
/// item counts and user collectives).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GradientSyncStats {
    /// Bucket all-reduces issued (and, under ZeRO stage 2, the one small all-reduce per
    /// optimizer step that agrees on missing gradients and overflows).
    pub all_reduces: u64,
    /// Bucket reduce-scatters issued (ZeRO stage 2).
    pub reduce_scatters: u64,
    /// Bytes of gradient buckets reduced (whole buckets, for all-reduces and reduce-scatters).
    pub bytes: u64,
    /// Parameter all-gathers issued (ZeRO stage 3: one per unit before its forward and one
    /// before its backward).
    pub all_gathers: u64,
    /// Bytes of parameters all-gathered (whole padded units, in the compute dtype).
    pub gather_bytes: u64,
    /// Of [`all_gathers`](Self::all_gathers), those issued ahead of the unit's run, on the
    /// prefetch thread, while another unit computed (ZeRO stage 3's prefetch).
    pub gathers_ahead: u64,
}

impl std::ops::AddAssign for GradientSyncStats {
    fn add_assign(&mut self, other: Self) {
        self.all_reduces += other.all_reduces;
        self.reduce_scatters += other.reduce_scatters;
        self.bytes += other.bytes;
        self.all_gathers += other.all_gathers;
        self.gather_bytes += other.gather_bytes;
        self.gathers_ahead += other.gathers_ahead;
    }
}

/// How this process averages gradients with the other ranks, and what it has sent so far.
#[derive(Debug)]
pub(crate) struct GradientSync {
    world_size: usize,
    /// The dtype buckets are averaged in across ranks.
    reduce_dtype: DType,
    /// The overlap asked for (builder or environment).
    overlap_configured: bool,
    /// Whether buckets are filled on a worker thread while earlier ones are reduced: asked for,
    /// with more than one rank (alone, the reduction is the identity), on the CPU (on CUDA the
    /// accumulation is already queued asynchronously on the device's stream, and candle's work
    /// from another thread would go to that thread's stream, unordered with the reduction).
    overlap: bool,
    /// Whether every micro-step's backward averages the gradients (Accelerate's
    /// `sync_each_batch`), not only the window's last.
    each_micro_step: bool,
    stats: Cell<GradientSyncStats>,
}

impl GradientSync {
    /// Checks the reduce dtype; `overlap` is what the configuration asks for.
    pub fn new(
        world_size: usize,
        reduce_dtype: DType,
        overlap: bool,
        device: &Device,
    ) -> Result<Self> {
        if !matches!(reduce_dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::Config(format!(
                "gradient_reduce_dtype({reduce_dtype:?}): gradients are averaged in F32, BF16 or \
                 F16"
            )));
        }
        Ok(Self {
            world_size,
            reduce_dtype,
            overlap_configured: overlap,
            overlap: overlap && world_size > 1 && device.is_cpu(),
            each_micro_step: false,
            stats: Cell::new(GradientSyncStats::default()),
        })
    }

    /// Averages the gradients on every micro-step (see
    /// [`AcceleratorBuilder::sync_each_batch`](crate::AcceleratorBuilder::sync_each_batch)).
    pub fn sync_each_batch(mut self, each: bool) -> Self {
        self.each_micro_step = each;
        self
    }

    /// Whether every micro-step averages the gradients, not only the window's last.
    pub fn syncs_each_batch(&self) -> bool {
        self.each_micro_step
    }

    /// The dtype buckets travel in.
    pub fn reduce_dtype(&self) -> DType {
        self.reduce_dtype
    }

    /// Whether overlap was asked for (it takes effect only where it can help; see the field).
    pub fn overlap_configured(&self) -> bool {
        self.overlap_configured
    }

    /// Gradient all-reduces issued so far and their bytes.
    pub fn stats(&self) -> GradientSyncStats {
        self.stats.get()
    }

    /// Counts traffic made outside this object (ZeRO stage 3's gathers and unit reductions).
    pub fn record(&self, traffic: GradientSyncStats) {
        let mut stats = self.stats.get();
        stats += traffic;
        self.stats.set(stats);
    }

    /// Adds the backward pass's gradients of `sources` (scaled by `scale`) into `buffers` and
    /// averages the window's sums across ranks: the sync micro-step's work.
    pub fn accumulate_and_average(
        &self,
        comm: &dyn Communicator,
        buffers: &mut GradientBuffers,
        sources: &[(String, Var)],
        grads: &GradStore,
        scale: f64,
    ) -> Result<()> {
        let options = SyncOptions {
            // Whole buckets are reduced, so a parameter without a gradient on this rank takes part
            // with zeros; `agree_on_missing_gradients` then takes the gradient away again from
            // those that no rank had.
            fill_missing: self.world_size > 1,
            overlap: self.overlap,
        };
        let mut stats = self.stats.get();
        buffers.accumulate_and_reduce(sources, grads, scale, options, |bucket| {
            self.reduce_bucket(comm, bucket, &mut stats)
        })?;
        self.agree_on_missing_gradients(comm, buffers, &mut stats)?;
        self.stats.set(stats);
        Ok(())
    }

    /// ZeRO stage 2's sync micro-step: adds the backward pass's gradients into `buffers` (taking
    /// them out of `grads` as it goes) and reduce-scatters each bucket (mean), so this rank keeps only its block of the window's
    /// average. Then one all-reduce of two flags agrees on what every rank must decide alike:
    /// whether a parameter missed its gradient on some rank (then the presence mask is reduced as
    /// at stage 0) and, when `check_finite` (fp16), whether some rank's block overflowed.
    pub fn accumulate_and_reduce_scatter(
        &self,
        comm: &dyn Communicator,
        buffers: &mut GradientBuffers,
        sources: &[(String, Var)],
        grads: &mut GradStore,
        scale: f64,
        check_finite: bool,
    ) -> Result<()> {
        let mut stats = self.stats.get();
        let missing_here =
            buffers.accumulate_and_reduce_scatter(sources, grads, scale, |flat, out| {
                self.reduce_scatter_bucket(comm, flat, out, &mut stats)
            })?;
        let nonfinite_here = match (check_finite, buffers.synced_shard()) {
            (true, Some(shard)) => !shard.local_finite()?,
            _ => false,
        };
        let (missing, nonfinite) = if self.world_size == 1 {
            (missing_here, nonfinite_here)
        } else {
            stats.all_reduces += 1;
            stats.bytes += 8;
            ZeroState::agree_on_verdict(comm, missing_here, nonfinite_here, &Device::Cpu)?
        };
        buffers.set_shard_verdict(nonfinite);
        if missing {
            self.keep_gradients_present_somewhere(comm, buffers, &mut stats)?;
        }
        self.stats.set(stats);
        Ok(())
    }

    /// Reduce-scatters one padded gradient bucket (mean) into this rank's block, in the
    /// configured reduce dtype, and counts it.
    fn reduce_scatter_bucket(
        &self,
        comm: &dyn Communicator,
        flat: &Tensor,
        block: &Tensor,
        stats: &mut GradientSyncStats,
    ) -> Result<()> {
        *stats += reduce_scatter_mean(comm, flat, block, self.reduce_dtype)?;
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
        comm: &dyn Communicator,
        buffers: &mut GradientBuffers,
        stats: &mut GradientSyncStats,
    ) -> Result<()> {
        if self.world_size == 1 || !buffers.missing_on_some_rank()? {
            return Ok(());
        }
        self.keep_gradients_present_somewhere(comm, buffers, stats)
    }

    /// Once the ranks know some rank missed a gradient: the presence masks are reduced (max) and
    /// every parameter that no rank gave a gradient loses the one it was filled with.
    fn keep_gradients_present_somewhere(
        &self,
        comm: &dyn Communicator,
        buffers: &mut GradientBuffers,
        stats: &mut GradientSyncStats,
    ) -> Result<()> {
        let present = buffers.local_presence_mask()?;
        if self.world_size > 1 {
            comm.all_reduce(&present, ReduceOp::Max)?;
            stats.all_reduces += 1;
            stats.bytes += (present.elem_count() * present.dtype().size_in_bytes()) as u64;
        }
        buffers.keep_only_present(&present)
    }

    /// Averages one gradient bucket across ranks in place and counts it. At world size 1 the
    /// reduction is the identity, but it is still counted, so the traffic accounting reads the
    /// same at any size.
    fn reduce_bucket(
        &self,
        comm: &dyn Communicator,
        bucket: &GradientBucket,
        stats: &mut GradientSyncStats,
    ) -> Result<()> {
        let flat = bucket.flat();
        if flat.dtype() == self.reduce_dtype || self.world_size == 1 {
            comm.all_reduce_agreed(flat, ReduceOp::Mean)?;
            stats.bytes += bucket.size_in_bytes() as u64;
        } else {
            // Compressed: the average travels in the smaller type and is widened back into the
            // bucket, as DDP's bf16_compress_hook does.
            let wire = flat.to_dtype(self.reduce_dtype)?;
            comm.all_reduce_agreed(&wire, ReduceOp::Mean)?;
            flat.slice_set(&wire.to_dtype(flat.dtype())?, 0, 0)?;
            stats.bytes += (wire.elem_count() * wire.dtype().size_in_bytes()) as u64;
        }
        stats.all_reduces += 1;
        Ok(())
    }
}

/// Reduce-scatters one padded gradient buffer (mean) into this rank's `block`, travelling in
/// `reduce_dtype` (widened back into `block`'s dtype); returns the traffic it made.
pub(crate) fn reduce_scatter_mean(
    comm: &dyn Communicator,
    flat: &Tensor,
    block: &Tensor,
    reduce_dtype: DType,
) -> Result<GradientSyncStats> {
    let bytes = if flat.dtype() == reduce_dtype || comm.world_size() == 1 {
        comm.reduce_scatter_agreed(flat, block, ReduceOp::Mean)?;
        flat.elem_count() * flat.dtype().size_in_bytes()
    } else {
        let wire = flat.to_dtype(reduce_dtype)?;
        let out = Tensor::zeros(block.elem_count(), reduce_dtype, block.device())?;
        comm.reduce_scatter_agreed(&wire, &out, ReduceOp::Mean)?;
        block.slice_set(&out.to_dtype(block.dtype())?, 0, 0)?;
        wire.elem_count() * wire.dtype().size_in_bytes()
    };
    Ok(GradientSyncStats {
        reduce_scatters: 1,
        bytes: bytes as u64,
        ..GradientSyncStats::default()
    })
}
