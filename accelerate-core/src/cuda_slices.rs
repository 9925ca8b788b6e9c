//! Direct access to the f32 data of CUDA tensors, for the fused optimizer kernels: the GPU
//! counterpart of [`cpu_slices`](crate::cpu_slices).
//!
//! candle hands out mutable device storage only inside an in-place custom op, so mutable access
//! takes a closure, as on the CPU. Both helpers return `Ok(None)` when the tensor is not an f32
//! CUDA tensor laid out contiguously (views with an offset are fine), so callers fall back to
//! tensor ops.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, CudaViewMut};
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, DType, InplaceOp1, Layout, Storage, Tensor,
};

use crate::error::Result;

/// Runs `f` on the device elements of `tensor` in place, if it is a contiguous f32 CUDA tensor.
/// `f` also receives the tensor's device, to launch kernels on its stream.
pub(crate) fn with_cuda_f32_mut<R>(
    tensor: &Tensor,
    f: impl FnOnce(&CudaDevice, CudaViewMut<'_, f32>) -> R,
) -> Result<Option<R>> {
    if !tensor.device().is_cuda() || tensor.dtype() != DType::F32 {
        return Ok(None);
    }
    let op = ClosureOp {
        f: Mutex::new(Some(f)),
        result: Mutex::new(None),
    };
    tensor.inplace_op1(&op)?;
    Ok(op.result.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// Runs `f` on the device elements of `tensor`, read-only, if it is a contiguous f32 CUDA tensor.
pub(crate) fn with_cuda_f32<R>(
    tensor: &Tensor,
    f: impl FnOnce(CudaView<'_, f32>) -> R,
) -> Result<Option<R>> {
    if !tensor.device().is_cuda() || tensor.dtype() != DType::F32 {
        return Ok(None);
    }
    let (storage, layout) = tensor.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Ok(None);
    };
    match &*storage {
        Storage::Cuda(cuda) => Ok(Some(f(cuda.as_cuda_slice::<f32>()?.slice(start..end)))),
        _ => Ok(None),
    }
}

struct ClosureOp<F, R> {
    f: Mutex<Option<F>>,
    result: Mutex<Option<R>>,
}

impl<F: FnOnce(&CudaDevice, CudaViewMut<'_, f32>) -> R, R> InplaceOp1 for ClosureOp<F, R> {
    fn name(&self) -> &'static str {
        "accelerate-cuda-slice"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        // Not reached: the wrappers above only run this op on CUDA tensors.
        Ok(())
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Ok(());
        };
        let device = storage.device().clone();
        let slice = storage.as_cuda_slice_mut::<f32>()?;
        let f = self
            .f
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("closure op runs once");
        let r = f(&device, slice.slice_mut(start..end));
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        Ok(())
    }
}
