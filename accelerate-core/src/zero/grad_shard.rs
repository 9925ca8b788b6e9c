//! Stage 2's gradient: this rank's block of every averaged gradient bucket.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::ShardPlan;
use crate::cpu_slices::{all_finite, with_f32, with_f32_mut};
use crate::error::{Error, Result};

/// After a stage-2 sync micro-step: this rank's block of each gradient bucket, averaged across
/// ranks by a reduce-scatter, and which parameters have a gradient.
#[derive(Debug)]
pub(crate) struct GradientShard {
    plan: Arc<ShardPlan>,
    rank: usize,
    /// One block per bucket (`plan.block(b)` elements; the tail of the last rank's is padding,
    /// which the reduce-scatter keeps at zero), allocated by the sync and dropped by `clear`, so
    /// that between an optimizer step and the next sync (a whole accumulation window, whose full
    /// buckets exist meanwhile) the blocks take no memory.
    blocks: Vec<Option<Tensor>>,
    /// Each bucket's dtype and device.
    kinds: Vec<(DType, Device)>,
    /// Per parameter: whether it has an averaged gradient (set by the sync, cleared by `zero`).
    present: Vec<bool>,
    /// Whether some rank's shard held an inf or NaN at the last sync (agreed by every rank).
    nonfinite_somewhere: bool,
}

impl GradientShard {
    /// Zeroed blocks for `rank` of `plan`, bucket `b` in `kinds[b]`'s dtype and on its device.
    pub fn new(plan: Arc<ShardPlan>, rank: usize, kinds: &[(DType, Device)]) -> Result<Self> {
        let blocks = vec![None; kinds.len()];
        let params = (0..plan.buckets())
            .map(|b| plan.bucket_params(b).len())
            .sum();
        Ok(Self {
            plan,
            rank,
            blocks,
            kinds: kinds.to_vec(),
            present: vec![false; params],
            nonfinite_somewhere: false,
        })
    }

    /// The block of bucket `b` (the reduce-scatter's output), allocated if it is not.
    pub fn block(&mut self, b: usize) -> Result<&Tensor> {
        if self.blocks[b].is_none() {
            let (dtype, device) = &self.kinds[b];
            self.blocks[b] = Some(Tensor::zeros(self.plan.block(b), *dtype, device)?);
        }
        Ok(self.blocks[b].as_ref().expect("allocated above"))
    }

    /// The allocated blocks.
    fn allocated(&self) -> impl Iterator<Item = &Tensor> {
        self.blocks.iter().flatten()
    }

    /// Whether any parameter has a gradient here.
    pub fn any_present(&self) -> bool {
        self.present.iter().any(|&p| p)
    }

    /// Whether parameter `param` has a gradient.
    pub fn is_present(&self, param: usize) -> bool {
        self.present[param]
    }

    /// After a reduce-scatter: every parameter has a gradient (the missing ones took part as
    /// zeros), until [`keep_only`](Self::keep_only) says otherwise; no verdict on non-finite
    /// values yet.
    pub fn mark_all_present(&mut self) {
        self.present.fill(true);
        self.nonfinite_somewhere = false;
    }

    /// Records the verdict every rank agreed on: whether some rank's block was not finite.
    pub fn set_nonfinite_somewhere(&mut self, nonfinite: bool) {
        self.nonfinite_somewhere = nonfinite;
    }

    /// Forgets the gradients (the blocks are overwritten by the next sync).
    pub fn clear(&mut self) {
        self.blocks.iter_mut().for_each(|b| *b = None);
        self.present.fill(false);
        self.nonfinite_somewhere = false;
    }

    /// Takes away the gradient of every parameter whose `keep` entry is false.
    pub fn keep_only(&mut self, keep: &[bool]) {
        for (p, &k) in self.present.iter_mut().zip(keep) {
            *p &= k;
        }
    }

    /// Elements `piece` of parameter `param`'s averaged gradient (a view into its block); `piece`
    /// must be this rank's piece of it.
    pub fn piece(&self, param: usize, piece: std::ops::Range<usize>) -> Result<Tensor> {
        let (b, offset) = self.plan.position(param);
        let owned = self.plan.owned(b, self.rank);
        let (start, end) = (offset + piece.start, offset + piece.end);
        if start < owned.start || end > owned.end {
            return Err(Error::Optimizer(format!(
                "elements {piece:?} of parameter {param} are not this rank's (rank {}) under ZeRO \
                 stage 2: its block of bucket {b} is {owned:?}, the parameter starts at {offset}",
                self.rank
            )));
        }
        let block_start = self.rank * self.plan.block(b);
        let block = self.blocks[b].as_ref().ok_or_else(|| {
            Error::Optimizer(format!(
                "no averaged gradient of parameter {param} on this rank"
            ))
        })?;
        Ok(block.narrow(0, start - block_start, piece.len())?)
    }

    /// Σ x² over this rank's blocks (padding is zero), in f64.
    pub fn sum_of_squares(&self) -> Result<f64> {
        let mut sum = 0f64;
        for block in self.allocated() {
            sum += match with_f32(block, |xs| {
                xs.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
            })? {
                Some(s) => s,
                None => block
                    .to_dtype(DType::F64)?
                    .sqr()?
                    .sum_all()?
                    .to_scalar::<f64>()?,
            };
        }
        Ok(sum)
    }

    /// Whether this rank's blocks are all finite.
    pub fn local_finite(&self) -> Result<bool> {
        for block in self.allocated() {
            if !all_finite(block)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Whether every rank's shard was finite at the last sync.
    pub fn finite_everywhere(&self) -> bool {
        !self.nonfinite_somewhere
    }

    /// Multiplies the blocks by `factor`.
    pub fn scale(&mut self, factor: f64) -> Result<()> {
        let f = factor as f32;
        for block in self.allocated() {
            if with_f32_mut(block, |xs| xs.iter_mut().for_each(|x| *x *= f))?.is_none() {
                block.slice_set(&(block.clone() * factor)?, 0, 0)?;
            }
        }
        Ok(())
    }

    /// Clamps the blocks to `[-limit, limit]`, NaN kept (PyTorch's `clip_grad_value_`).
    pub fn clamp(&mut self, limit: f64) -> Result<()> {
        let l = limit as f32;
        for block in self.allocated() {
            if with_f32_mut(block, |xs| xs.iter_mut().for_each(|x| *x = x.clamp(-l, l)))?.is_none()
            {
                let clamped = block.clamp(-limit, limit)?;
                let nan = block.ne(block)?;
                block.slice_set(&nan.where_cond(block, &clamped)?, 0, 0)?;
            }
        }
        Ok(())
    }
}
