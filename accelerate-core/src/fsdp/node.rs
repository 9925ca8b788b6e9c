//! The graph node a sharded unit's output is: candle has no module hooks, so the unit's backward
//! pass is the backward of a custom op.
//!
//! [`UnitNode`] is a binary op over the unit's input `x` and the unit's anchor (a one-element
//! variable that keeps the node in the graph when `x` needs no gradient, as token ids do). Its
//! forward returns a copy of the output the unit computed outside the graph; nothing of the
//! unit's computation, and none of its gathered parameters, stays in the graph. Its backward hands
//! `x` and the incoming gradient to the unit's backward (the sharded state's, which gathers the
//! parameters again, recomputes the unit and differentiates it) and returns `x`'s gradient.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

/// A unit's backward: from the unit's input and its output's gradient, the input's gradient
/// (`None` when the input needs none).
pub(crate) type UnitBackward =
    Arc<dyn Fn(&Tensor, &Tensor) -> crate::error::Result<Option<Tensor>> + Send + Sync>;

/// A unit's output in the graph (see the module documentation).
pub(crate) struct UnitNode {
    /// The output computed by the forward pass, taken (copied) by the op's forward.
    pub output: Mutex<Option<Tensor>>,
    pub backward: UnitBackward,
    /// Called when the node is dropped without its backward having run (an evaluation's
    /// forward): the unit no longer waits for that backward.
    pub abandoned: Box<dyn Fn() + Send + Sync>,
    pub backward_ran: AtomicBool,
}

impl Drop for UnitNode {
    fn drop(&mut self) {
        if !self.backward_ran.load(Ordering::Relaxed) {
            (self.abandoned)();
        }
    }
}

impl UnitNode {
    fn take_output(&self) -> Result<Tensor> {
        self.output
            .lock()
            .map_err(|_| candle_core::Error::Msg("unit node: a lock was poisoned".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("unit node: the forward ran twice".into()))
    }
}

/// A contiguous copy of `t`'s data in its own storage.
fn copy<S: BackendStorage<Device = D>, D: BackendDevice<Storage = S>>(
    s: &S,
    layout: &Layout,
) -> Result<S> {
    // SAFETY: every element of the allocation is written by `copy_strided_src` right after.
    let mut dst = unsafe { s.device().alloc_uninit(layout.shape(), s.dtype())? };
    s.copy_strided_src(&mut dst, 0, layout)?;
    Ok(dst)
}

impl CustomOp2 for UnitNode {
    fn name(&self) -> &'static str {
        "fsdp-unit"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = self.take_output()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cpu(s) => Ok((copy(s, layout)?, y.shape().clone())),
            _ => candle_core::bail!("unit node: the output is not on the device of the input"),
        }
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let y = self.take_output()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cuda(s) => Ok((copy(s, layout)?, y.shape().clone())),
            _ => candle_core::bail!("unit node: the output is not on the device of the input"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.backward_ran.store(true, Ordering::Relaxed);
        let grad_x =
            (self.backward)(x, grad_res).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok((grad_x, None))
    }
}

/// Seeds the nested backward pass over a recomputed unit: a 0-d result whose backward hands
/// `gradient` to its argument, so the recomputed output's gradient is `0 + gradient`, as the
/// outer pass has it.
pub(crate) struct SeedGradient {
    pub gradient: Tensor,
}

fn scalar_zero<S: BackendStorage<Device = D>, D: BackendDevice<Storage = S>>(
    s: &S,
) -> Result<(S, Shape)> {
    let shape = Shape::from(());
    Ok((s.device().zeros_impl(&shape, s.dtype())?, shape))
}

impl CustomOp1 for SeedGradient {
    fn name(&self) -> &'static str {
        "fsdp-seed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        scalar_zero(s)
    }

    fn cuda_fwd(&self, s: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        scalar_zero(s)
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, _grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.gradient.clone()))
    }
}
