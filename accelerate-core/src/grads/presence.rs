//! Presence agreement: which parameters some rank gave a gradient in the window being synced.
//! Whole buckets are reduced, so a parameter without a gradient on this rank takes part with
//! zeros; a flag travelling with the last bucket says whether any rank missed one, and a presence
//! mask reduced across ranks then takes the gradient away again from those that no rank had.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::accumulate::fill;
#[cfg(test)]
use super::accumulate::fill_missing_slots;
use super::GradientBuffers;
use crate::error::{Error, Result};

impl GradientBuffers {
    /// Before the missing gradients are filled with zeros: records which parameters have a
    /// gradient on this rank in this window, and sets the missing flag (if these buffers have one)
    /// to whether any has none.
    pub(super) fn record_local_presence(
        &mut self,
        params: &[(String, Var)],
        grads: &GradStore,
    ) -> Result<()> {
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
    pub(crate) fn missing_on_some_rank(&self) -> Result<bool> {
        match &self.missing_flag {
            Some(flag) => Ok(flag.to_dtype(DType::F32)?.to_vec1::<f32>()?[0] > 0.0),
            None => Ok(false),
        }
    }

    /// One element per parameter (in bucket order), on the buckets' device: 1 where this rank had
    /// a gradient in the window just synced, 0 where it had none. Reduced with max across ranks,
    /// it says which parameters had a gradient anywhere; see
    /// [`keep_only_present`](Self::keep_only_present).
    pub(crate) fn local_presence_mask(&self) -> Result<Tensor> {
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
    pub(crate) fn keep_only_present(&mut self, present_anywhere: &Tensor) -> Result<()> {
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
    // The sync step fills bucket by bucket (`prepare_bucket`); this whole-buffer form is what
    // the tests check the filling with.
    #[cfg(test)]
    pub(crate) fn fill_missing_with_zeros(&mut self) -> Result<()> {
        fill_missing_slots(&mut self.slots)
    }
}
