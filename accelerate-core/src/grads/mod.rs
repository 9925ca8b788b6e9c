//! Gradient buffers keyed by parameter name, laid out in flat buckets.
//!
//! candle's `GradStore` is keyed by `TensorId`, a process-local counter that means nothing to another
//! rank, and it is rebuilt by every backward pass. [`GradientBuffers`] instead owns one flat tensor per
//! bucket (parameters in sorted-name order, a bucket closed when it would exceed the size cap) and
//! hands out each parameter's gradient as a view into its bucket. Gradients of micro-steps are added
//! into those views in place; on the sync micro-step the buckets go to the communicator as they are,
//! and the optimizer reads the same views, through the read-only [`Gradients`]. The memory is
//! allocated once and reused every step.

mod accumulate;
mod buckets;
mod presence;
#[cfg(test)]
pub(crate) mod test_fixtures;
mod view;

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::cpu_slices::with_f32;
use crate::error::{Error, Result};
use crate::zero::GradientShard;

pub(crate) use accumulate::prepare_bucket;
#[cfg(test)]
pub(crate) use accumulate::scale_in_place as scale_in_place_for_tests;
use accumulate::{clamp_in_place, scale_in_place};
pub(crate) use buckets::GradientBucket;
pub use buckets::DEFAULT_BUCKET_CAP_BYTES;
pub use view::Gradients;

/// One parameter's gradient: a view into its bucket, and whether it holds this window's data.
#[derive(Debug)]
pub(crate) struct Slot {
    name: String,
    view: Tensor,
    /// The parameter's shape (the view's, while its bucket is allocated).
    shape: candle_core::Shape,
    /// Whether the view holds data of the current accumulation window; lazily zeroed otherwise.
    written: bool,
}

/// Accumulated gradients of a set of named parameters.
#[derive(Debug)]
pub struct GradientBuffers {
    slots: Vec<Slot>,
    index: HashMap<String, usize>,
    buckets: Vec<GradientBucket>,
    /// Buffers reduced across ranks only: one extra element at the end of the last bucket, set on
    /// the sync micro-step to 1 where some parameter has no gradient on this rank, else 0. It
    /// travels with that bucket's reduction, so after it every rank knows, at no extra collective,
    /// whether any rank missed a gradient.
    missing_flag: Option<Tensor>,
    /// Which parameters had a gradient on this rank in the window being synced, recorded before
    /// the missing ones were filled with zeros (set by a sync step with `fill_missing`).
    local_presence: Vec<bool>,
    /// Under ZeRO stage 2: this rank's block of the averaged gradients, after the sync.
    shard: Option<GradientShard>,
}

impl GradientBuffers {
    /// Allocates buffers for `params`, which must be sorted by name and unique. Consecutive
    /// parameters of the same dtype and device share a bucket of at most `bucket_cap_bytes`
    /// (a larger parameter gets a bucket of its own).
    pub fn new(params: &[(String, Var)], bucket_cap_bytes: usize) -> Result<Self> {
        Self::build(params, bucket_cap_bytes, false)
    }

    /// [`new`](Self::new), for buffers that are reduced across ranks: the last bucket carries one
    /// more element, the flag that tells every rank, after the reduction, whether any rank missed
    /// a parameter's gradient ([`missing_on_some_rank`](Self::missing_on_some_rank)).
    pub(crate) fn new_for_ranks(params: &[(String, Var)], bucket_cap_bytes: usize) -> Result<Self> {
        Self::build(params, bucket_cap_bytes, true)
    }

    /// Buffers filled once from a candle `GradStore` (for a plain loop without an `Accelerator`).
    pub fn from_grad_store(params: &[(String, Var)], grads: &GradStore) -> Result<Self> {
        let mut buffers = Self::new(params, DEFAULT_BUCKET_CAP_BYTES)?;
        buffers.accumulate(params, grads, 1.0)?;
        Ok(buffers)
    }

    /// Parameter names in bucket order (sorted).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.slots.iter().map(|s| s.name.as_str())
    }

    /// The accumulated gradient of `name`, or `None` if it has not received one since the last
    /// [`zero`](Self::zero) (PyTorch's `grad is None`: optimizers skip such parameters).
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        let slot = &self.slots[*self.index.get(name)?];
        slot.written.then_some(&slot.view)
    }

    /// Whether parameter `name` has a gradient in the current window (false for an unknown name).
    pub(crate) fn has_gradient(&self, name: &str) -> bool {
        self.index.get(name).is_some_and(|&i| {
            self.slots[i].written || self.shard.as_ref().is_some_and(|s| s.is_present(i))
        })
    }

    /// Elements `piece` of the flattened gradient of `name` (a view, 1-D): what a ZeRO-sharded
    /// optimizer updates its piece of the parameter from. An error if `name` has no gradient.
    pub(crate) fn piece(&self, name: &str, piece: std::ops::Range<usize>) -> Result<Tensor> {
        if let (Some(&i), Some(shard)) = (self.index.get(name), &self.shard) {
            if shard.is_present(i) {
                return shard.piece(i, piece);
            }
        }
        let Some(full) = self.get(name) else {
            return Err(Error::Optimizer(format!(
                "no gradient of {name:?} to read elements {piece:?} of"
            )));
        };
        if piece.end > full.elem_count() {
            return Err(Error::Optimizer(format!(
                "elements {piece:?} of the gradient of {name:?}, which has {}",
                full.elem_count()
            )));
        }
        Ok(full.flatten_all()?.narrow(0, piece.start, piece.len())?)
    }

    /// Whether any parameter has received a gradient since the last [`zero`](Self::zero).
    pub fn any_written(&self) -> bool {
        self.slots.iter().any(|s| s.written)
    }

    /// Forgets the accumulated gradients. The memory is kept and overwritten (not added to) by the
    /// next accumulation, so zeroing costs nothing.
    pub fn zero(&mut self) {
        for slot in &mut self.slots {
            slot.written = false;
        }
        if let Some(shard) = &mut self.shard {
            shard.clear();
        }
    }

    /// Under ZeRO stage 2, after the sync: this rank's block of the averaged gradients, when it
    /// holds them (the full buckets are released then).
    pub(crate) fn synced_shard(&self) -> Option<&GradientShard> {
        self.shard.as_ref().filter(|s| s.any_present())
    }

    /// [`synced_shard`](Self::synced_shard), to scale or clamp.
    pub(crate) fn synced_shard_mut(&mut self) -> Option<&mut GradientShard> {
        self.shard.as_mut().filter(|s| s.any_present())
    }

    /// Records the agreed verdict of a stage-2 sync: whether some rank's block held an inf or NaN.
    pub(crate) fn set_shard_verdict(&mut self, nonfinite_somewhere: bool) {
        if let Some(shard) = &mut self.shard {
            shard.set_nonfinite_somewhere(nonfinite_somewhere);
        }
    }

    /// L2 norm of all accumulated gradients together.
    pub fn global_norm(&self) -> Result<f64> {
        Ok(self.sum_of_squares()?.sqrt())
    }

    /// Σ x² over all accumulated gradients, in f64 (the square of
    /// [`global_norm`](Self::global_norm), which ranks holding disjoint pieces add up).
    pub(crate) fn sum_of_squares(&self) -> Result<f64> {
        if self.synced_shard().is_some() {
            return Err(Error::Parameters(
                "under ZeRO stage 2 each rank holds 1/N of the gradients: their norm is a \
                 collective (TrainingState::clip_grad_norm)"
                    .into(),
            ));
        }
        let mut sum_sq = 0f64;
        for slot in self.slots.iter().filter(|s| s.written) {
            let fast = with_f32(&slot.view, |xs| {
                xs.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>()
            })?;
            sum_sq += match fast {
                Some(s) => s,
                None => slot
                    .view
                    .to_dtype(DType::F64)?
                    .sqr()?
                    .sum_all()?
                    .to_scalar::<f64>()?,
            };
        }
        Ok(sum_sq)
    }

    /// Multiplies every accumulated gradient by `factor`, in place.
    pub fn scale(&mut self, factor: f64) -> Result<()> {
        if let Some(shard) = self.synced_shard_mut() {
            return shard.scale(factor);
        }
        for slot in self.slots.iter().filter(|s| s.written) {
            scale_in_place(&slot.view, factor)?;
        }
        Ok(())
    }

    /// Clamps every element of every accumulated gradient to `[-limit, limit]`, in place
    /// (PyTorch's `clip_grad_value_`). A NaN stays NaN, as `torch.clamp` leaves it.
    pub fn clamp(&mut self, limit: f64) -> Result<()> {
        if let Some(shard) = self.synced_shard_mut() {
            return shard.clamp(limit);
        }
        for slot in self.slots.iter().filter(|s| s.written) {
            clamp_in_place(&slot.view, limit)?;
        }
        Ok(())
    }

    /// Whether every accumulated gradient is finite (no inf or NaN): the fp16 overflow check.
    pub fn all_finite(&self) -> Result<bool> {
        if let Some(shard) = self.synced_shard() {
            // Agreed across ranks by the sync.
            return Ok(shard.finite_everywhere());
        }
        for slot in self.slots.iter().filter(|s| s.written) {
            if !crate::cpu_slices::all_finite(&slot.view)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// Sorted, uniqueness-checked `(name, Var)` pairs.
pub(crate) fn sorted_named_vars(mut vars: Vec<(String, Var)>) -> Result<Vec<(String, Var)>> {
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for pair in vars.windows(2) {
        if pair[0].0 == pair[1].0 {
            return Err(Error::Parameters(format!(
                "parameter name {:?} appears twice; every parameter needs a unique name",
                pair[0].0
            )));
        }
    }
    Ok(vars)
}
