//! The bucket layout: parameters, in sorted-name order, flattened into consecutive flat buffers of
//! at most a size cap each (PyTorch DDP's buckets), which the sync micro-step reduces one by one.

use candle_core::{DType, Tensor, Var};

use super::{GradientBuffers, Slot};
use crate::error::{Error, Result};
use crate::zero::{GradientShard, ShardPlan};

/// Default bucket cap, as in PyTorch DDP.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

/// One flat buffer holding the gradients of consecutive parameters (in sorted-name order).
#[derive(Debug)]
pub(crate) struct GradientBucket {
    pub(super) flat: Tensor,
    pub(super) params: std::ops::Range<usize>,
    /// Elements of `flat` when it is allocated (parameters, then the missing flag or the ZeRO
    /// padding).
    pub(super) len: usize,
    /// Whether `flat` holds the bucket's storage. Under ZeRO stage 2 a bucket is allocated when a
    /// window first adds into it and released once it has been reduce-scattered; otherwise it is
    /// allocated once, at construction.
    pub(super) allocated: bool,
    /// The storage's dtype and device (a released bucket's `flat` is an empty host tensor: no
    /// zero-size allocation on a GPU).
    pub(super) dtype: DType,
    pub(super) device: candle_core::Device,
}

impl GradientBucket {
    /// The flat 1-D tensor of this bucket, to be all-reduced in place.
    pub(crate) fn flat(&self) -> &Tensor {
        &self.flat
    }

    /// Indices (into [`GradientBuffers::names`]) of the parameters stored in this bucket.
    pub(crate) fn params(&self) -> std::ops::Range<usize> {
        self.params.clone()
    }

    /// Size of the bucket's data in bytes.
    pub(crate) fn size_in_bytes(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }
}

impl GradientBuffers {
    /// For ZeRO stage 2: the buckets of [`new`](Self::new), each padded to `plan`'s length (a
    /// multiple of the world size) and allocated only while a window adds into it, plus this
    /// rank's block of each, which the sync micro-step's reduce-scatter fills. `plan` must have
    /// been cut from [`layout`](Self::layout) of these buckets.
    pub(crate) fn new_sharded(
        params: &[(String, Var)],
        bucket_cap_bytes: usize,
        plan: std::sync::Arc<ShardPlan>,
        rank: usize,
    ) -> Result<Self> {
        let mut buffers = Self::build(params, bucket_cap_bytes, false)?;
        if buffers.layout() != plan.layout() {
            return Err(Error::Parameters(
                "the ZeRO partition was cut from other gradient buckets".into(),
            ));
        }
        let kinds: Vec<_> = buffers
            .buckets
            .iter()
            .map(|b| (b.dtype, b.device.clone()))
            .collect();
        for (b, bucket) in buffers.buckets.iter_mut().enumerate() {
            bucket.len = plan.padded_len(b);
        }
        for b in 0..buffers.buckets.len() {
            buffers.release(b)?;
        }
        buffers.shard = Some(GradientShard::new(plan, rank, &kinds)?);
        Ok(buffers)
    }

    /// One fully sharded unit's window gradients (ZeRO stage 3): `params` (name and shape, in
    /// the unit's order) in one bucket of `padded_len` elements, allocated when a micro-step
    /// first adds into it and released once it has been reduce-scattered.
    pub(crate) fn for_unit(
        params: &[(String, candle_core::Shape)],
        dtype: DType,
        device: &candle_core::Device,
        padded_len: usize,
    ) -> Result<Self> {
        let empty = Tensor::zeros(0, dtype, &candle_core::Device::Cpu)?;
        let slots: Vec<Slot> = params
            .iter()
            .map(|(name, shape)| Slot {
                name: name.clone(),
                view: empty.clone(),
                shape: shape.clone(),
                written: false,
            })
            .collect();
        let bucket = GradientBucket {
            flat: empty,
            params: 0..params.len(),
            len: padded_len,
            allocated: false,
            dtype,
            device: device.clone(),
        };
        Ok(Self::from_parts(slots, vec![bucket], None))
    }

    /// [`for_unit`](Self::for_unit)'s bucket, allocated (zeroed) if no micro-step added into it.
    pub(crate) fn allocate_unit(&mut self) -> Result<&Tensor> {
        self.allocate(0)?;
        Ok(&self.buckets[0].flat)
    }

    /// Drops every bucket's storage: the window's gradients are forgotten.
    pub(crate) fn release_all(&mut self) -> Result<()> {
        for b in 0..self.buckets.len() {
            self.release(b)?;
        }
        Ok(())
    }

    pub(super) fn build(
        params: &[(String, Var)],
        bucket_cap_bytes: usize,
        with_missing_flag: bool,
    ) -> Result<Self> {
        for pair in params.windows(2) {
            if pair[0].0 >= pair[1].0 {
                return Err(Error::Parameters(format!(
                    "parameters must be sorted by name and unique, found {:?} before {:?}",
                    pair[0].0, pair[1].0
                )));
            }
        }
        let mut slots = Vec::with_capacity(params.len());
        let mut buckets = Vec::new();
        let mut missing_flag = None;
        let mut start = 0;
        while start < params.len() {
            let (dtype, device) = (params[start].1.dtype(), params[start].1.device().clone());
            let mut end = start;
            let mut elems = 0usize;
            while end < params.len() {
                let v = &params[end].1;
                let n = v.elem_count();
                let same_kind = v.dtype() == dtype && v.device().same_device(&device);
                let fits = (elems + n) * dtype.size_in_bytes() <= bucket_cap_bytes;
                if end > start && (!same_kind || !fits) {
                    break;
                }
                elems += n;
                end += 1;
            }
            let is_last = end == params.len();
            let flag_elems = usize::from(with_missing_flag && is_last);
            let flat = Tensor::zeros(elems + flag_elems, dtype, &device)?;
            if flag_elems == 1 {
                missing_flag = Some(flat.narrow(0, elems, 1)?);
            }
            let mut offset = 0;
            for (name, var) in &params[start..end] {
                let n = var.elem_count();
                let view = flat.narrow(0, offset, n)?.reshape(var.shape())?;
                offset += n;
                slots.push(Slot {
                    name: name.clone(),
                    view,
                    shape: var.shape().clone(),
                    written: false,
                });
            }
            buckets.push(GradientBucket {
                dtype,
                device: device.clone(),
                len: flat.elem_count(),
                flat,
                params: start..end,
                allocated: true,
            });
            start = end;
        }
        Ok(Self::from_parts(slots, buckets, missing_flag))
    }

    /// Buffers of `slots` in `buckets`, indexed by name, not sharded.
    fn from_parts(
        slots: Vec<Slot>,
        buckets: Vec<GradientBucket>,
        missing_flag: Option<Tensor>,
    ) -> Self {
        let index = slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        Self {
            slots,
            index,
            buckets,
            missing_flag,
            local_presence: Vec::new(),
            shard: None,
        }
    }

    /// Gives bucket `b` zeroed storage (if it has none) and its parameters views into it; they
    /// hold no gradient yet.
    pub(super) fn allocate(&mut self, b: usize) -> Result<()> {
        let bucket = &mut self.buckets[b];
        if bucket.allocated {
            return Ok(());
        }
        let flat = Tensor::zeros(bucket.len, bucket.dtype, &bucket.device)?;
        let mut offset = 0;
        for slot in &mut self.slots[bucket.params.clone()] {
            let n = slot.shape.elem_count();
            slot.view = flat.narrow(0, offset, n)?.reshape(&slot.shape)?;
            slot.written = false;
            offset += n;
        }
        bucket.flat = flat;
        bucket.allocated = true;
        Ok(())
    }

    /// Drops bucket `b`'s storage (its parameters' gradients are forgotten).
    pub(super) fn release(&mut self, b: usize) -> Result<()> {
        let bucket = &mut self.buckets[b];
        let empty = Tensor::zeros(0, bucket.dtype, &candle_core::Device::Cpu)?;
        for slot in &mut self.slots[bucket.params.clone()] {
            slot.view = empty.clone();
            slot.written = false;
        }
        bucket.flat = empty;
        bucket.allocated = false;
        Ok(())
    }

    /// Allocates every bucket that has no storage (stage 2, before a window adds into them).
    pub(super) fn allocate_all(&mut self) -> Result<()> {
        for b in 0..self.buckets.len() {
            self.allocate(b)?;
        }
        Ok(())
    }

    /// The buckets, in order.
    pub(crate) fn buckets(&self) -> &[GradientBucket] {
        &self.buckets
    }

    /// Each bucket's parameters (indices into [`names`](Self::names)) and their element counts:
    /// what the ZeRO partition is cut from.
    pub(crate) fn layout(&self) -> Vec<(std::ops::Range<usize>, Vec<usize>)> {
        self.buckets
            .iter()
            .map(|b| {
                let r = b.params();
                let lens = self.slots[r.clone()]
                    .iter()
                    .map(|s| s.shape.elem_count())
                    .collect();
                (r, lens)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grads::test_fixtures::vars;

    #[test]
    fn buckets_follow_the_cap_in_sorted_order() {
        // a: 24 B, b: 16 B, c: 24 B; a 40-byte cap holds a+b, then c alone.
        let g = GradientBuffers::new(&vars(), 40).unwrap();
        let ranges: Vec<_> = g.buckets().iter().map(|b| b.params()).collect();
        assert_eq!(ranges, vec![0..2, 2..3]);
        assert_eq!(g.buckets()[0].size_in_bytes(), 40);
        let unsorted = vec![vars()[1].clone(), vars()[0].clone()];
        assert!(GradientBuffers::new(&unsorted, 40).is_err());
    }
}
