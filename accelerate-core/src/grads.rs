//! Gradient buffers keyed by parameter name, laid out in flat buckets.
//!
//! candle's `GradStore` is keyed by `TensorId`, a process-local counter that means nothing to another
//! rank, and it is rebuilt by every backward pass. [`GradientBuffers`] instead owns one flat tensor per
//! bucket (parameters in sorted-name order, a bucket closed when it would exceed the size cap) and
//! hands out each parameter's gradient as a view into its bucket. Gradients of micro-steps are added
//! into those views in place; on the sync micro-step the buckets go to the communicator as they are,
//! and the optimizer reads the same views. The memory is allocated once and reused every step.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::cpu_slices::{with_f32, with_f32_mut, with_f32_transposed};
use crate::error::{Error, Result};
use crate::zero::{GradientShard, ShardPlan};

/// Default bucket cap, as in PyTorch DDP.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

/// One flat buffer holding the gradients of consecutive parameters (in sorted-name order).
#[derive(Debug)]
pub struct GradientBucket {
    flat: Tensor,
    params: std::ops::Range<usize>,
    /// Elements of `flat` when it is allocated (parameters, then the missing flag or the ZeRO
    /// padding).
    len: usize,
    /// Whether `flat` holds the bucket's storage. Under ZeRO stage 2 a bucket is allocated when a
    /// window first adds into it and released once it has been reduce-scattered; otherwise it is
    /// allocated once, at construction.
    allocated: bool,
    /// The storage's dtype and device (a released bucket's `flat` is an empty host tensor: no
    /// zero-size allocation on a GPU).
    dtype: DType,
    device: candle_core::Device,
}

impl GradientBucket {
    /// The flat 1-D tensor of this bucket, to be all-reduced in place.
    pub fn flat(&self) -> &Tensor {
        &self.flat
    }

    /// Indices (into [`GradientBuffers::names`]) of the parameters stored in this bucket.
    pub fn params(&self) -> std::ops::Range<usize> {
        self.params.clone()
    }

    /// Size of the bucket's data in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }
}

#[derive(Debug)]
struct Slot {
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
    pub fn new_for_ranks(params: &[(String, Var)], bucket_cap_bytes: usize) -> Result<Self> {
        Self::build(params, bucket_cap_bytes, true)
    }

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

    fn build(
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
        let index = slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        Ok(Self {
            slots,
            index,
            buckets,
            missing_flag,
            local_presence: Vec::new(),
            shard: None,
        })
    }

    /// Gives bucket `b` zeroed storage (if it has none) and its parameters views into it; they
    /// hold no gradient yet.
    fn allocate(&mut self, b: usize) -> Result<()> {
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
    fn release(&mut self, b: usize) -> Result<()> {
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
    fn allocate_all(&mut self) -> Result<()> {
        for b in 0..self.buckets.len() {
            self.allocate(b)?;
        }
        Ok(())
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

    /// The buckets, in order.
    pub fn buckets(&self) -> &[GradientBucket] {
        &self.buckets
    }

    /// The accumulated gradient of `name`, or `None` if it has not received one since the last
    /// [`zero`](Self::zero) (PyTorch's `grad is None`: optimizers skip such parameters).
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        let slot = &self.slots[*self.index.get(name)?];
        slot.written.then_some(&slot.view)
    }

    /// Whether parameter `name` has a gradient in the current window (false for an unknown name).
    pub fn has_gradient(&self, name: &str) -> bool {
        self.index.get(name).is_some_and(|&i| {
            self.slots[i].written || self.shard.as_ref().is_some_and(|s| s.is_present(i))
        })
    }

    /// Elements `piece` of the flattened gradient of `name` (a view, 1-D): what a ZeRO-sharded
    /// optimizer updates its piece of the parameter from. An error if `name` has no gradient.
    pub fn piece(&self, name: &str, piece: std::ops::Range<usize>) -> Result<Tensor> {
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

    /// Adds `scale * grad(p)` into the buffer of every parameter `p` that has a gradient in `grads`.
    /// `params` must be the same (sorted) list the buffers were built from.
    pub fn accumulate(
        &mut self,
        params: &[(String, Var)],
        grads: &GradStore,
        scale: f64,
    ) -> Result<()> {
        self.check_param_count(params)?;
        self.allocate_all()?;
        accumulate_slots(&mut self.slots, params, grads, scale)
    }

    /// Adds `scale * grad(p)` into the buffer of every parameter `p` of bucket `bucket` that has a
    /// gradient in `grads`, leaving the other buckets untouched. `params` is the whole sorted list
    /// the buffers were built from. Accumulating every bucket this way gives bitwise the same
    /// buffers as [`accumulate`](Self::accumulate): the same additions in the same order.
    pub fn accumulate_bucket(
        &mut self,
        bucket: usize,
        params: &[(String, Var)],
        grads: &GradStore,
        scale: f64,
    ) -> Result<()> {
        self.check_param_count(params)?;
        let range = self
            .buckets
            .get(bucket)
            .ok_or_else(|| {
                Error::Parameters(format!(
                    "bucket {bucket} does not exist; the buffers have {} buckets",
                    self.buckets.len()
                ))
            })?
            .params();
        self.allocate(bucket)?;
        accumulate_slots(&mut self.slots[range.clone()], &params[range], grads, scale)
    }

    /// The sync micro-step's work on the buffers: adds `scale * grad(p)` for every parameter (as
    /// [`accumulate`](Self::accumulate)), fills the buffers that received no gradient this window
    /// with zeros when `options.fill_missing` is set (see
    /// [`fill_missing_with_zeros`](Self::fill_missing_with_zeros)), and hands every bucket, in
    /// order, to `reduce` once its gradients are complete.
    ///
    /// With `options.overlap`, a scoped worker thread fills buckets 1, 2, ... while `reduce` runs
    /// on the calling thread for the buckets already filled, so the reduction of bucket i overlaps
    /// the preparation of the buckets after it. `reduce` stays on the calling thread because a
    /// communicator is neither `Send` nor `Sync` (NCCL's holds the thread's CUDA state). Each
    /// bucket is still filled by the same additions in the same order and reduced only once it
    /// is complete, so the result is bitwise the same with and without overlap.
    ///
    /// On an error (of `reduce` or of an accumulation) the first one is returned and the buffers
    /// hold a partial window, as after a failed [`accumulate`](Self::accumulate).
    pub fn accumulate_and_reduce(
        &mut self,
        params: &[(String, Var)],
        grads: &GradStore,
        scale: f64,
        options: SyncOptions,
        mut reduce: impl FnMut(&GradientBucket) -> Result<()>,
    ) -> Result<()> {
        self.check_param_count(params)?;
        self.allocate_all()?;
        let fill_missing = options.fill_missing;
        if fill_missing {
            self.record_local_presence(params, grads)?;
        }
        if !options.overlap || self.buckets.len() < 2 {
            // Every bucket prepared at once, then reduced: the same work as one bucket's share.
            prepare_bucket(&mut self.slots, params, grads, scale, fill_missing)?;
            return self.buckets.iter().try_for_each(reduce);
        }
        let ranges: Vec<_> = self.buckets.iter().map(|b| b.params()).collect();
        let (first_slots, later_slots) = self.slots.split_at_mut(ranges[0].end);
        prepare_bucket(
            first_slots,
            &params[ranges[0].clone()],
            grads,
            scale,
            fill_missing,
        )?;
        let buckets = &self.buckets;
        std::thread::scope(|scope| {
            // The worker announces each bucket it has filled (or the error that stopped it); the
            // calling thread reduces a bucket only after its announcement.
            let (filled_tx, filled_rx) = std::sync::mpsc::channel::<Result<usize>>();
            let worker = scope.spawn(move || {
                let mut rest = later_slots;
                for (b, range) in ranges.iter().enumerate().skip(1) {
                    let (slots, tail) = std::mem::take(&mut rest).split_at_mut(range.len());
                    rest = tail;
                    let filled =
                        prepare_bucket(slots, &params[range.clone()], grads, scale, fill_missing)
                            .map(|()| b);
                    let failed = filled.is_err();
                    // A closed channel means the calling thread stopped on an error of its own.
                    if filled_tx.send(filled).is_err() || failed {
                        break;
                    }
                }
            });
            let mut outcome = Ok(());
            for (b, bucket) in buckets.iter().enumerate() {
                if b > 0 {
                    match filled_rx.recv() {
                        Ok(Ok(filled)) => debug_assert_eq!(filled, b),
                        Ok(Err(e)) => {
                            outcome = Err(e);
                            break;
                        }
                        // The worker ended without a word: it panicked (re-raised below).
                        Err(_) => break,
                    }
                }
                if let Err(e) = reduce(bucket) {
                    outcome = Err(e);
                    break;
                }
            }
            // Lets a worker that is still filling stop at its next announcement.
            drop(filled_rx);
            if let Err(panic) = worker.join() {
                std::panic::resume_unwind(panic);
            }
            outcome
        })
    }

    fn check_param_count(&self, params: &[(String, Var)]) -> Result<()> {
        if params.len() != self.slots.len() {
            return Err(Error::Parameters(format!(
                "gradient buffers hold {} parameters but {} were given",
                self.slots.len(),
                params.len()
            )));
        }
        Ok(())
    }

    /// Adds `scale * grad` into the buffer of the parameter `name`.
    pub fn accumulate_one(&mut self, name: &str, grad: &Tensor, scale: f64) -> Result<()> {
        let i = *self.index.get(name).ok_or_else(|| {
            Error::Parameters(format!("no gradient buffer for parameter {name:?}"))
        })?;
        let b = self
            .buckets
            .iter()
            .position(|b| b.params.contains(&i))
            .expect("every parameter is in a bucket");
        self.allocate(b)?;
        add_scaled(&mut self.slots[i], grad, scale)
    }

    /// Before the missing gradients are filled with zeros: records which parameters have a
    /// gradient on this rank in this window, and sets the missing flag (if these buffers have one)
    /// to whether any has none.
    fn record_local_presence(&mut self, params: &[(String, Var)], grads: &GradStore) -> Result<()> {
        self.local_presence = self
            .slots
            .iter()
            .zip(params)
            .map(|(slot, (_, var))| slot.written || grads.get(var.as_tensor()).is_some())
            .collect();
        if let Some(flag) = &self.missing_flag {
            let missing = self.local_presence.iter().any(|present| !present);
            fill(flag, if missing { 1.0 } else { 0.0 })?;
        }
        Ok(())
    }

    /// After the sync step's reduction (a mean or sum of every bucket across ranks): whether some
    /// rank had no gradient for some parameter in the window. Always false for buffers without the
    /// flag ([`new`](Self::new)) and before any sync step.
    pub fn missing_on_some_rank(&self) -> Result<bool> {
        match &self.missing_flag {
            Some(flag) => Ok(flag.to_dtype(DType::F32)?.to_vec1::<f32>()?[0] > 0.0),
            None => Ok(false),
        }
    }

    /// One element per parameter (in bucket order), on the buckets' device: 1 where this rank had
    /// a gradient in the window just synced, 0 where it had none. Reduced with max across ranks,
    /// it says which parameters had a gradient anywhere; see
    /// [`keep_only_present`](Self::keep_only_present).
    pub fn local_presence_mask(&self) -> Result<Tensor> {
        let device = self
            .buckets
            .first()
            .map_or(candle_core::Device::Cpu, |b| b.flat.device().clone());
        let mask: Vec<f32> = self
            .local_presence
            .iter()
            .map(|&present| if present { 1.0 } else { 0.0 })
            .collect();
        if mask.len() != self.slots.len() {
            return Err(Error::Parameters(
                "no sync step has recorded which gradients are present yet".into(),
            ));
        }
        Ok(Tensor::from_vec(mask, self.slots.len(), &device)?)
    }

    /// Forgets the gradient of every parameter whose entry in `present_anywhere` (a reduced
    /// [`local_presence_mask`](Self::local_presence_mask)) is 0: no rank had one, so, as on a
    /// single process, it keeps none and the optimizer skips it (no weight decay, no momentum).
    pub fn keep_only_present(&mut self, present_anywhere: &Tensor) -> Result<()> {
        let present = present_anywhere.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if present.len() != self.slots.len() {
            return Err(Error::Parameters(format!(
                "a presence mask of {} entries for {} parameters",
                present.len(),
                self.slots.len()
            )));
        }
        if let Some(shard) = &mut self.shard {
            shard.keep_only(&present.iter().map(|&p| p != 0.0).collect::<Vec<_>>());
        }
        for (slot, p) in self.slots.iter_mut().zip(present) {
            if p == 0.0 {
                slot.written = false;
            }
        }
        Ok(())
    }

    /// Writes zeros into buffers that received no gradient this window and marks every buffer as
    /// holding a gradient, so whole buckets can be reduced across ranks (unused parameters get a
    /// zero gradient, as under DDP's `find_unused_parameters`).
    pub fn fill_missing_with_zeros(&mut self) -> Result<()> {
        fill_missing_slots(&mut self.slots)
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

    /// ZeRO stage 2's sync micro-step: adds `scale * grad(p)` for every parameter, fills the
    /// missing ones with zeros and hands each bucket, in order, to `reduce_scatter` with this
    /// rank's block as the output; each bucket is allocated only for that and released right
    /// after, so that at most one full bucket exists at a time beyond those a longer window
    /// already filled, and the gradients it took are removed from `grads`. Afterwards every parameter counts as having a gradient (see
    /// [`keep_only_present`](Self::keep_only_present)). Returns whether this rank missed some
    /// parameter's gradient in the window.
    pub(crate) fn accumulate_and_reduce_scatter(
        &mut self,
        params: &[(String, Var)],
        grads: &mut GradStore,
        scale: f64,
        mut reduce_scatter: impl FnMut(&Tensor, &Tensor) -> Result<()>,
    ) -> Result<bool> {
        self.check_param_count(params)?;
        if self.shard.is_none() {
            return Err(Error::Parameters(
                "a reduce-scatter sync on gradient buffers built without a ZeRO partition".into(),
            ));
        }
        self.record_local_presence(params, grads)?;
        let missing_here = self.local_presence.iter().any(|present| !present);
        for b in 0..self.buckets.len() {
            self.allocate(b)?;
            let range = self.buckets[b].params();
            prepare_bucket(
                &mut self.slots[range.clone()],
                &params[range.clone()],
                grads,
                scale,
                true,
            )?;
            // Each backward gradient is dropped once it is in its bucket, so that the next
            // bucket's storage takes the place of gradients already consumed rather than adding
            // to the whole backward pass's.
            for (_, var) in &params[range] {
                grads.remove(var.as_tensor());
            }
            let shard = self.shard.as_mut().expect("checked above");
            reduce_scatter(&self.buckets[b].flat, shard.block(b)?)?;
            self.release(b)?;
        }
        self.shard
            .as_mut()
            .expect("checked above")
            .mark_all_present();
        Ok(missing_here)
    }

    /// Records the agreed verdict of a stage-2 sync: whether some rank's block held an inf or NaN.
    pub(crate) fn set_shard_verdict(&mut self, nonfinite_somewhere: bool) {
        if let Some(shard) = &mut self.shard {
            shard.set_nonfinite_somewhere(nonfinite_somewhere);
        }
    }

    /// L2 norm of all accumulated gradients together.
    pub fn global_norm(&self) -> Result<f64> {
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
        Ok(sum_sq.sqrt())
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
            let fast = with_f32(&slot.view, |xs| xs.iter().all(|x| x.is_finite()))?;
            let finite = match fast {
                Some(f) => f,
                None => {
                    let s = slot
                        .view
                        .to_dtype(DType::F64)?
                        .sum_all()?
                        .to_scalar::<f64>()?;
                    s.is_finite()
                }
            };
            if !finite {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// How [`GradientBuffers::accumulate_and_reduce`] runs the sync micro-step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncOptions {
    /// Fill the buffers that received no gradient this window with zeros before their bucket is
    /// reduced (needed when whole buckets are reduced across ranks).
    pub fill_missing: bool,
    /// Fill later buckets on a worker thread while earlier ones are reduced.
    pub overlap: bool,
}

/// Accumulates into consecutive slots from the matching `params` (same names, same order).
fn accumulate_slots(
    slots: &mut [Slot],
    params: &[(String, Var)],
    grads: &GradStore,
    scale: f64,
) -> Result<()> {
    for (slot, (name, var)) in slots.iter_mut().zip(params) {
        debug_assert_eq!(&slot.name, name);
        if let Some(grad) = grads.get(var.as_tensor()) {
            add_scaled(slot, grad, scale)?;
        }
    }
    Ok(())
}

fn fill_missing_slots(slots: &mut [Slot]) -> Result<()> {
    for slot in slots.iter_mut().filter(|s| !s.written) {
        fill(&slot.view, 0.0)?;
        slot.written = true;
    }
    Ok(())
}

/// The sync micro-step's work on a run of slots (one bucket's, or all of them): their gradients
/// accumulated, then (optionally) the missing ones filled with zeros.
fn prepare_bucket(
    slots: &mut [Slot],
    params: &[(String, Var)],
    grads: &GradStore,
    scale: f64,
    fill_missing: bool,
) -> Result<()> {
    accumulate_slots(slots, params, grads, scale)?;
    if fill_missing {
        fill_missing_slots(slots)?;
    }
    Ok(())
}

/// `slot += scale * grad` (or `slot = scale * grad` when the slot is not yet written), in one pass
/// over the data on the CPU, and in one kernel on a GPU.
fn add_scaled(slot: &mut Slot, grad: &Tensor, scale: f64) -> Result<()> {
    if grad.shape() != slot.view.shape() {
        return Err(Error::Parameters(format!(
            "gradient of {:?} has shape {:?}, the parameter has {:?}",
            slot.name,
            grad.shape(),
            slot.view.shape()
        )));
    }
    let overwrite = !slot.written;
    let s = scale as f32;
    // On a GPU: one kernel reads the gradient in its own dtype and layout.
    #[cfg(feature = "cuda")]
    if crate::cuda_accumulate::add_scaled(&slot.view, grad, s, overwrite)? {
        slot.written = true;
        return Ok(());
    }
    let grad = if grad.dtype() != slot.view.dtype() {
        grad.to_dtype(slot.view.dtype())?
    } else {
        grad.clone()
    };
    let mut fused = with_f32(&grad, |g| {
        with_f32_mut(&slot.view, |dst| add_contiguous(dst, g, s, overwrite))
    })?;
    if fused.is_none() {
        // Gradients of transposed uses (every `Linear` weight) come back as transposed views:
        // read them in cache-sized tiles instead of copying them to a contiguous tensor first.
        let (rows, cols) = match slot.view.dims() {
            [r, c] => (*r, *c),
            _ => (0, 0),
        };
        fused = with_f32_transposed(&grad, |g| {
            with_f32_mut(&slot.view, |dst| {
                add_transposed(dst, g, rows, cols, s, overwrite)
            })
        })?;
    }
    match fused {
        Some(Ok(Some(()))) => {}
        Some(Err(e)) => return Err(e),
        _ => {
            let scaled = (grad.contiguous()? * scale)?;
            let new = if overwrite {
                scaled
            } else {
                (slot.view.clone() + scaled)?
            };
            overwrite_view(&slot.view, &new)?;
        }
    }
    slot.written = true;
    Ok(())
}

/// `dst[i][j] (+)= s * src[j][i]` for `dst` `[rows, cols]` and `src` `[cols, rows]`, both
/// row-major, in tiles so that both sides stay in cache.
///
/// Single-threaded on purpose: candle's kernels already keep every core busy, and a second thread
/// pool beside them would compete for the same cores.
fn add_transposed(dst: &mut [f32], src: &[f32], rows: usize, cols: usize, s: f32, overwrite: bool) {
    const TILE: usize = 64;
    for i0 in (0..rows).step_by(TILE) {
        for j0 in (0..cols).step_by(TILE) {
            let j1 = (j0 + TILE).min(cols);
            for i in i0..(i0 + TILE).min(rows) {
                let d = &mut dst[i * cols + j0..i * cols + j1];
                // src[j][i] for j in j0..j1: every `rows`-th element from src[j0][i].
                let column = src[j0 * rows + i..].iter().step_by(rows);
                if overwrite {
                    d.iter_mut().zip(column).for_each(|(d, &x)| *d = x * s);
                } else {
                    d.iter_mut().zip(column).for_each(|(d, &x)| *d += x * s);
                }
            }
        }
    }
}

/// `dst (+)= s * src` elementwise.
fn add_contiguous(dst: &mut [f32], src: &[f32], s: f32, overwrite: bool) {
    if overwrite {
        if s == 1.0 {
            dst.copy_from_slice(src);
        } else {
            dst.iter_mut().zip(src).for_each(|(d, &x)| *d = x * s);
        }
    } else {
        dst.iter_mut().zip(src).for_each(|(d, &x)| *d += x * s);
    }
}

/// Copies `src` into the storage behind `view` (device-generic path).
fn overwrite_view(view: &Tensor, src: &Tensor) -> Result<()> {
    // `slice_set` writes through to the storage shared with the bucket.
    let flat_view = view.flatten_all()?;
    flat_view.slice_set(&src.flatten_all()?.contiguous()?, 0, 0)?;
    Ok(())
}

fn fill(view: &Tensor, value: f32) -> Result<()> {
    if with_f32_mut(view, |xs| xs.fill(value))?.is_none() {
        let z = (Tensor::ones(view.shape(), view.dtype(), view.device())? * value as f64)?;
        overwrite_view(view, &z)?;
    }
    Ok(())
}

fn scale_in_place(view: &Tensor, factor: f64) -> Result<()> {
    let f = factor as f32;
    if with_f32_mut(view, |xs| xs.iter_mut().for_each(|x| *x *= f))?.is_none() {
        let scaled = (view.clone() * factor)?;
        overwrite_view(view, &scaled)?;
    }
    Ok(())
}

fn clamp_in_place(view: &Tensor, limit: f64) -> Result<()> {
    let l = limit as f32;
    // f32::clamp keeps NaN, as torch.clamp does.
    if with_f32_mut(view, |xs| xs.iter_mut().for_each(|x| *x = x.clamp(-l, l)))?.is_none() {
        // candle's clamp is a maximum then a minimum, which turn NaN into a bound (fmaxf/fminf
        // on CUDA, a comparison on the CPU): NaN is put back where it was.
        let clamped = view.clamp(-limit, limit)?;
        let nan = view.ne(view)?;
        overwrite_view(view, &nan.where_cond(view, &clamped)?)?;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// On a GPU a gradient of any float dtype and layout is added into its f32 buffer by one
    /// kernel, as the formula says: each element widened exactly to f32, times the scale in f32,
    /// written on the window's first micro-step and added after.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a GPU (scripts/gpu-build.sh build, then run on a GPU machine)"]
    fn a_gradient_of_any_dtype_and_layout_is_added_on_the_gpu_in_one_kernel() {
        let cuda = Device::new_cuda(0).expect("a GPU (this test is ignored without one)");
        let values = |n: usize, seed: u32| -> Vec<f32> {
            let mut x = seed.wrapping_mul(2654435761);
            (0..n)
                .map(|_| {
                    x = x.wrapping_mul(1664525).wrapping_add(1013904223);
                    ((x >> 8) as f32 / (1u32 << 23) as f32 - 1.0) * 3.0
                })
                .collect()
        };
        // A [4, 6] gradient in six layouts: contiguous, contiguous at an offset (rows 1..5 of a
        // [5, 6]: the linear kernel with a start offset), transposed, a narrowed view (an offset
        // and a row stride), a permuted 3-D tensor, and one row broadcast (stride 0); each made
        // from a flat base of `len` elements.
        let view = |what: &str, t: &Tensor| -> Tensor {
            match what {
                "contiguous" => t.reshape((4, 6)).unwrap(),
                "offset" => t.reshape((5, 6)).unwrap().narrow(0, 1, 4).unwrap(),
                "transposed" => t.reshape((6, 4)).unwrap().t().unwrap(),
                "narrowed" => t.reshape((4, 8)).unwrap().narrow(1, 2, 6).unwrap(),
                "broadcast" => t.reshape((1, 6)).unwrap().broadcast_as((4, 6)).unwrap(),
                _ => t.reshape((2, 3, 4)).unwrap().permute((2, 0, 1)).unwrap(),
            }
        };
        let layouts = [
            ("contiguous", 24),
            ("offset", 30),
            ("transposed", 24),
            ("narrowed", 32),
            ("permuted", 24),
            ("broadcast", 6),
        ];
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (what, len) in layouts {
                let make = |seed| {
                    let base = Tensor::from_vec(values(len, seed), len, &Device::Cpu)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap();
                    view(what, &base.to_device(&cuda).unwrap())
                };
                let (g1, g2) = (make(1), make(2));
                let shape = g1.shape().clone();
                let param = Var::zeros(&shape, DType::F32, &cuda).unwrap();
                let mut buffers = GradientBuffers::new(&[("w".into(), param)], 1 << 20).unwrap();
                let before = crate::cuda_accumulate::launches();
                let linear_before = crate::cuda_accumulate::linear_launches();
                buffers.accumulate_one("w", &g1, 0.5).unwrap();
                buffers.accumulate_one("w", &g2, 0.25).unwrap();
                assert_eq!(crate::cuda_accumulate::launches() - before, 2, "{what}");
                // Only the contiguous gradients are one linear run (the permuted one merges to
                // two dimensions, the others stay two).
                let linear = crate::cuda_accumulate::linear_launches() - linear_before;
                let contiguous = what == "contiguous" || what == "offset";
                assert_eq!(linear, if contiguous { 2 } else { 0 }, "{what}");
                // The formula, on the host: exact widening, then f32 arithmetic.
                let host = |g: &Tensor| -> Vec<f32> {
                    g.to_device(&Device::Cpu)
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                };
                let want: Vec<u32> = host(&g1)
                    .iter()
                    .zip(host(&g2))
                    .map(|(a, b)| (a * 0.5f32 + b * 0.25f32).to_bits())
                    .collect();
                let got: Vec<u32> = host(buffers.get("w").unwrap())
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                assert_eq!(got, want, "{dtype:?}, {what}");
            }
        }
    }

    fn vars() -> Vec<(String, Var)> {
        vec![
            (
                "a".into(),
                Var::zeros((2, 3), DType::F32, &Device::Cpu).unwrap(),
            ),
            ("b".into(), Var::zeros(4, DType::F32, &Device::Cpu).unwrap()),
            (
                "c".into(),
                Var::zeros((3, 2), DType::F32, &Device::Cpu).unwrap(),
            ),
        ]
    }

    /// The clamp of the tensor path (any dtype, any device), taken here by f64 tensors, on the
    /// CPU and, built with `cuda` on a machine with a GPU, on the GPU (where candle's clamp, made
    /// of fmaxf/fminf, would turn NaN into a bound): PyTorch's `clamp` written out, NaN kept,
    /// infinities clamped.
    #[test]
    fn clamp_in_place_keeps_nan_on_the_tensor_path() {
        #[allow(unused_mut)]
        let mut devices = vec![Device::Cpu];
        #[cfg(feature = "cuda")]
        if let Ok(gpu) = Device::new_cuda(0) {
            devices.push(gpu);
        }
        for device in devices {
            let values = [f64::NAN, 3.0, -3.0, 0.5, f64::INFINITY, f64::NEG_INFINITY];
            let t = Tensor::new(&values, &device).unwrap();
            clamp_in_place(&t, 1.0).unwrap();
            let got = t.to_vec1::<f64>().unwrap();
            assert!(got[0].is_nan(), "{device:?}: {got:?}");
            assert_eq!(got[1..], [1.0, -1.0, 0.5, 1.0, -1.0], "{device:?}");
        }
    }

    fn value(i: usize, seed: u64) -> f32 {
        ((i as u64 * 7919 + seed * 104_729) % 1000) as f32 / 500.0 - 1.0
    }

    /// Layer sizes of `model()`: large enough that filling a bucket takes the worker thread a
    /// while, so that a reduction not waiting for it would see an incomplete bucket.
    const LAYERS: [(usize, usize); 4] = [(384, 320), (320, 256), (256, 192), (192, 128)];

    /// Parameters of several shapes: four linear layers and one parameter no loss uses.
    fn model() -> Vec<(String, Var)> {
        let dev = &Device::Cpu;
        let mut params = Vec::new();
        for (i, (rows, cols)) in LAYERS.iter().enumerate() {
            let gain = 1.0 / (*cols as f32).sqrt();
            let w: Vec<f32> = (0..rows * cols).map(|k| value(k + i, 0) * gain).collect();
            let b: Vec<f32> = (0..*rows).map(|k| value(k * 3 + i, 0)).collect();
            let w = Tensor::from_vec(w, (*rows, *cols), dev).unwrap();
            let b = Tensor::from_vec(b, *rows, dev).unwrap();
            params.push((format!("l{i}.bias"), Var::from_tensor(&b).unwrap()));
            params.push((format!("l{i}.weight"), Var::from_tensor(&w).unwrap()));
        }
        params.push(("unused".into(), Var::zeros(5, DType::F32, dev).unwrap()));
        sorted_named_vars(params).unwrap()
    }

    /// The gradients of one backward pass of `model()` on a batch that `seed` picks. The weight
    /// gradients come back as transposed views, as from every `Linear`.
    fn grads(params: &[(String, Var)], seed: u64) -> GradStore {
        let var = |name: &str| params.iter().find(|(n, _)| n == name).unwrap().1.clone();
        let inputs = LAYERS[3].1;
        let x: Vec<f32> = (0..8 * inputs).map(|k| value(k * 5, seed)).collect();
        let mut h = Tensor::from_vec(x, (8, inputs), &Device::Cpu).unwrap();
        for i in (0..4).rev() {
            let w = var(&format!("l{i}.weight"));
            let b = var(&format!("l{i}.bias"));
            h = h.matmul(&w.as_tensor().t().unwrap()).unwrap();
            h = h.broadcast_add(b.as_tensor()).unwrap().tanh().unwrap();
        }
        h.sqr().unwrap().sum_all().unwrap().backward().unwrap()
    }

    /// A bucket's values as bits, to compare bitwise.
    type BucketBits = Vec<u32>;

    fn flats(g: &GradientBuffers) -> Vec<BucketBits> {
        g.buckets()
            .iter()
            .map(|b| {
                let v = b.flat().to_vec1::<f32>().unwrap();
                v.iter().map(|x| x.to_bits()).collect()
            })
            .collect()
    }

    /// A cap that splits `model()` into six buckets: [l0.bias], [l0.weight], [l1.bias],
    /// [l1.weight], [l2.bias, l2.weight, l3.bias], [l3.weight, unused].
    const SMALL_CAP: usize = 256 * 1024;

    #[test]
    fn accumulating_bucket_by_bucket_equals_accumulating_all_bitwise() {
        let params = model();
        let micro_steps = [(grads(&params, 1), 0.25), (grads(&params, 2), 0.75)];
        let mut whole = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        let mut by_bucket = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        let n = whole.buckets().len();
        assert_eq!(n, 6, "the cap splits the model into six buckets");
        // Overwrite, then add: two micro-steps with different gradients and scales.
        for (micro_step, scale) in &micro_steps {
            whole.accumulate(&params, micro_step, *scale).unwrap();
            for b in 0..n {
                by_bucket
                    .accumulate_bucket(b, &params, micro_step, *scale)
                    .unwrap();
            }
        }
        assert_eq!(flats(&whole), flats(&by_bucket));
        assert!(by_bucket.get("l0.weight").is_some());
        assert!(by_bucket.get("unused").is_none(), "no gradient stays None");

        // One bucket alone touches nothing else.
        let mut one = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        let first = &micro_steps[0].0;
        one.accumulate_bucket(1, &params, first, 1.0).unwrap();
        let names: Vec<String> = one.names().map(str::to_string).collect();
        for (b, bucket) in one.buckets().iter().enumerate() {
            for i in bucket.params() {
                assert_eq!(
                    one.get(&names[i]).is_some(),
                    b == 1,
                    "{} in bucket {b}",
                    names[i]
                );
            }
        }
        assert!(one.accumulate_bucket(n, &params, first, 1.0).is_err());
    }

    /// Runs a sync step after one non-sync micro-step; returns the buckets as `reduce` saw them
    /// (in call order) and the buffers afterwards.
    fn sync_step(overlap: bool) -> (Vec<(usize, BucketBits)>, Vec<BucketBits>) {
        let params = model();
        let mut g = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        g.accumulate(&params, &grads(&params, 3), 0.5).unwrap();
        let first_param: Vec<usize> = g.buckets().iter().map(|b| b.params().start).collect();
        let mut seen = Vec::new();
        let options = SyncOptions {
            fill_missing: true,
            overlap,
        };
        g.accumulate_and_reduce(&params, &grads(&params, 4), 0.5, options, |bucket| {
            let b = first_param
                .iter()
                .position(|&p| p == bucket.params().start)
                .unwrap();
            let v = bucket.flat().to_vec1::<f32>().unwrap();
            seen.push((b, v.iter().map(|x| x.to_bits()).collect()));
            // Stands in for the average over ranks: every element changes.
            scale_in_place(bucket.flat(), 1.0 / 3.0)
        })
        .unwrap();
        (seen, flats(&g))
    }

    #[test]
    fn an_overlapped_sync_step_reduces_complete_buckets_in_order_and_equals_the_plain_one() {
        let (seen_plain, after_plain) = sync_step(false);
        let (seen_overlap, after_overlap) = sync_step(true);
        let order: Vec<usize> = seen_overlap.iter().map(|(b, _)| *b).collect();
        assert_eq!(order, (0..after_plain.len()).collect::<Vec<_>>());
        // Each bucket was complete (both micro-steps added, missing ones zero) when reduced.
        assert_eq!(seen_plain, seen_overlap);
        assert_eq!(after_plain, after_overlap);
        // The reduction did act (the comparison could have failed).
        assert_ne!(
            seen_plain
                .iter()
                .map(|(_, v)| v.clone())
                .collect::<Vec<_>>(),
            after_plain
        );
    }

    #[test]
    fn errors_of_the_worker_and_of_the_reduction_are_returned() {
        let params = model();
        let grads = grads(&params, 5);
        let options = SyncOptions {
            fill_missing: true,
            overlap: true,
        };
        // A reduction failing at bucket 1: returned, and no bucket after it is reduced.
        let mut g = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        let mut calls = 0;
        let r = g.accumulate_and_reduce(&params, &grads, 1.0, options, |_| {
            calls += 1;
            if calls == 2 {
                Err(Error::Config("reduction failed".into()))
            } else {
                Ok(())
            }
        });
        assert!(matches!(r, Err(Error::Config(m)) if m == "reduction failed"));
        assert_eq!(calls, 2);

        // An accumulation failing on the worker (a gradient whose shape does not fit the last
        // bucket's parameter): returned, and that bucket is never reduced.
        let mut g = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        let last = g.buckets().len() - 1;
        let (last_name, last_var) = params[g.buckets()[last].params().start].clone();
        let mut wrong = params.clone();
        let stranger = Var::zeros(3, DType::F32, &Device::Cpu).unwrap();
        let stranger_grads = (stranger.as_tensor() * 2.0)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut merged = grads;
        merged.insert(
            stranger.as_tensor(),
            stranger_grads.get(&stranger).unwrap().clone(),
        );
        let i = params.iter().position(|(n, _)| *n == last_name).unwrap();
        wrong[i] = (last_name.clone(), stranger);
        assert_ne!(last_var.dims(), wrong[i].1.dims());
        let mut reduced = Vec::new();
        let r = g.accumulate_and_reduce(&wrong, &merged, 1.0, options, |bucket| {
            reduced.push(bucket.params().start);
            Ok(())
        });
        assert!(
            matches!(&r, Err(Error::Parameters(m)) if m.contains(&last_name)),
            "{r:?}"
        );
        assert_eq!(reduced.len(), last);
    }

    #[test]
    fn accumulation_of_large_matrices_matches_the_formula() {
        // 600 x 500: many tiles, with partial tiles at both edges (600 and 500 are not multiples
        // of 32).
        let (rows, cols) = (600usize, 500usize);
        let var = Var::zeros((rows, cols), DType::F32, &Device::Cpu).unwrap();
        let mut g = GradientBuffers::new(&[("w".into(), var)], usize::MAX).unwrap();
        let src: Vec<f32> = (0..rows * cols).map(|k| (k % 97) as f32 - 48.0).collect();
        // src is the [cols, rows] matrix; its transpose is the gradient [rows, cols].
        let grad_t = Tensor::from_vec(src.clone(), (cols, rows), &Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        let grad_c = grad_t.contiguous().unwrap();
        g.accumulate_one("w", &grad_t, 0.5).unwrap();
        g.accumulate_one("w", &grad_c, 0.25).unwrap();
        let got = g.get("w").unwrap().to_vec2::<f32>().unwrap();
        for i in (0..rows).step_by(37) {
            for j in (0..cols).step_by(29) {
                assert_eq!(got[i][j], 0.75 * src[j * rows + i], "({i}, {j})");
            }
        }
    }

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

    #[test]
    fn scaled_sums_of_plain_and_transposed_gradients() {
        let mut g = GradientBuffers::new(&vars(), 1 << 20).unwrap();
        let m = [[1f32, 2., 3.], [4., 5., 6.]];
        let plain = Tensor::new(&m, &Device::Cpu).unwrap();
        // The same values reached through a transposed view of a [3, 2] matrix.
        let transposed = Tensor::new(&[[1f32, 4.], [2., 5.], [3., 6.]], &Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        assert!(!transposed.is_contiguous());
        g.accumulate_one("a", &plain, 0.5).unwrap();
        g.accumulate_one("a", &transposed, 2.0).unwrap();
        let got = g.get("a").unwrap().to_vec2::<f32>().unwrap();
        let want: Vec<Vec<f32>> = m
            .iter()
            .map(|r| r.iter().map(|x| 2.5 * x).collect())
            .collect();
        assert_eq!(got, want);
        assert!(g.get("b").is_none(), "no gradient yet is PyTorch's None");
        g.fill_missing_with_zeros().unwrap();
        assert_eq!(g.get("b").unwrap().to_vec1::<f32>().unwrap(), vec![0.0; 4]);
        let norm = g.global_norm().unwrap();
        let want_norm = (2.5f64 * 2.5 * (1. + 4. + 9. + 16. + 25. + 36.)).sqrt();
        assert!((norm - want_norm).abs() < 1e-9, "{norm} vs {want_norm}");
        g.zero();
        assert!(!g.any_written());
        // After zero the next gradient overwrites instead of adding.
        g.accumulate_one("a", &plain, 1.0).unwrap();
        assert_eq!(
            g.get("a").unwrap().to_vec2::<f32>().unwrap()[1],
            vec![4., 5., 6.]
        );
    }
}
