//! Device addresses of CUDA tensors, for our own kernels (the multi-tensor optimizer kernels read
//! tables of pointers): the GPU counterpart of [`cpu_slices`](crate::cpu_slices).
//!
//! The helpers return `Ok(None)` when the tensor is not a CUDA tensor of the asked dtype (laid out
//! contiguously, for the first two; views with an offset are fine), so callers fall back to
//! tensor ops.
//!
//! An address outlives the lock under which it was read: the kernel that uses it runs later, on
//! the device's stream. That is sound for the same reason every candle kernel is: candle runs all
//! work of a device on that one stream (and the NCCL communicator is bound to it too), so the
//! kernel runs after every earlier write of the tensor and before every later use, and a tensor
//! dropped after the launch is freed in stream order, after the kernel. The caller keeps the
//! tensors alive until the launch is queued.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::CudaDType;
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, DType, InplaceOp1, Layout, Storage, Tensor,
};

use crate::error::Result;

/// The device and the address of the first element of `tensor`, taken with write access (under
/// the storage's write lock, as candle's in-place ops take it), if `tensor` is a contiguous CUDA
/// tensor of element type `T` (`dtype`).
pub(crate) fn cuda_address_mut<T: CudaDType>(
    tensor: &Tensor,
    dtype: DType,
) -> Result<Option<(CudaDevice, u64)>> {
    if !tensor.device().is_cuda() || tensor.dtype() != dtype {
        return Ok(None);
    }
    let op = AddressOp::<T> {
        result: Mutex::new(None),
        element: std::marker::PhantomData,
    };
    tensor.inplace_op1(&op)?;
    Ok(op.result.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// The device and the address of the first element of `tensor`, read-only, if `tensor` is a
/// contiguous CUDA tensor of element type `T` (`dtype`).
pub(crate) fn cuda_address<T: CudaDType>(
    tensor: &Tensor,
    dtype: DType,
) -> Result<Option<(CudaDevice, u64)>> {
    if !tensor.device().is_cuda() || tensor.dtype() != dtype {
        return Ok(None);
    }
    let (storage, layout) = tensor.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Ok(None);
    };
    let Storage::Cuda(cuda) = &*storage else {
        return Ok(None);
    };
    let device = cuda.device().clone();
    let stream = device.cuda_stream();
    let view = cuda.as_cuda_slice::<T>()?.slice(start..end);
    let (address, _recorded) = view.device_ptr(&stream);
    Ok(Some((device, address)))
}

/// A CUDA tensor's first element and layout, for kernels that read strided views.
#[derive(Debug)]
pub(crate) struct StridedAddress {
    /// The device address of the element at the layout's start offset.
    pub address: u64,
    /// The dims, outermost first.
    pub dims: Vec<usize>,
    /// The strides, in elements.
    pub strides: Vec<usize>,
}

/// The address of the first element of `tensor`, read-only, with its dims and strides, if
/// `tensor` is a CUDA tensor of element type `T` (`dtype`), laid out in any way.
pub(crate) fn cuda_strided_address<T: CudaDType>(
    tensor: &Tensor,
    dtype: DType,
) -> Result<Option<StridedAddress>> {
    if !tensor.device().is_cuda() || tensor.dtype() != dtype {
        return Ok(None);
    }
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Ok(None);
    };
    let stream = cuda.device().cuda_stream();
    let view = cuda.as_cuda_slice::<T>()?.slice(layout.start_offset()..);
    let (address, _recorded) = view.device_ptr(&stream);
    Ok(Some(StridedAddress {
        address,
        dims: layout.dims().to_vec(),
        strides: layout.stride().to_vec(),
    }))
}

struct AddressOp<T> {
    result: Mutex<Option<(CudaDevice, u64)>>,
    element: std::marker::PhantomData<fn() -> T>,
}

impl<T: CudaDType> InplaceOp1 for AddressOp<T> {
    fn name(&self) -> &'static str {
        "accelerate-cuda-address"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        // Not reached: the wrapper above only runs this op on CUDA tensors.
        Ok(())
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Ok(());
        };
        let device = storage.device().clone();
        let stream = device.cuda_stream();
        let mut view = storage.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
        let (address, _recorded) = view.device_ptr_mut(&stream);
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some((device, address));
        Ok(())
    }
}
