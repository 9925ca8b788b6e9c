//! Device addresses of CUDA tensors, for our own kernels (the multi-tensor optimizer kernels read
//! tables of pointers; the gradient kernel reads a strided gradient): the GPU counterpart of
//! [`cpu_slices`](crate::cpu_slices).
//!
//! The helpers return `Ok(None)` when a tensor is not a CUDA tensor of the asked dtype (laid out
//! contiguously, where they say so; views with an offset are fine), so callers fall back to
//! tensor ops.
//!
//! **Ordering.** candle's `CudaDevice::new` (what `Device::new_cuda` calls) queues its work on
//! `CU_STREAM_PER_THREAD`, the per-thread default stream *of the host thread that queues it*:
//! work queued from one host thread runs in queue order, and work queued from two host threads
//! lands on two streams that do not wait for each other. Our kernels are queued the same way, so
//! they are ordered after every earlier candle op and before every later one on a tensor
//! **provided every one of them (the ops that wrote the tensor, our launch, later uses, and the
//! drop that frees it: cudarc frees in stream order on the dropping thread's stream) is queued
//! from the same host thread**, or the other thread synchronized its work first. The runtime
//! keeps to that on a GPU: backward, the accumulation into the gradient buffers and the
//! optimizer step run on the training thread (the worker thread that overlaps accumulation with
//! the reduction runs on the CPU only, `GradientSync`), and an NCCL communicator is bound to the
//! stream of the thread that created it.
//!
//! **cudarc's access records.** A `device_ptr` guard makes its stream wait for the slice's
//! recorded writes and, when dropped, records the access on that stream, for a later user on
//! another stream to wait for. cudarc does this only for a context in its multi-stream mode
//! (after `CudaContext::new_stream`, which candle's `CudaDevice::new` never calls). The gradient
//! kernel holds both guards until its launch is queued ([`with_dst_and_strided_src`]). The
//! multi-tensor kernel cannot: it gathers the addresses of every parameter of a step, each written
//! under its storage's write lock, which candle holds only inside one in-place op, and launches
//! once at the end. So [`cuda_address`] and [`cuda_address_mut`] return `Ok(None)` for a context
//! in multi-stream mode (the tensor-op path takes the guards properly there); elsewhere a guard's
//! drop records nothing, and dropping it before the launch changes nothing. The caller keeps the
//! tensors alive until the launch is queued.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::CudaDType;
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, DType, InplaceOp1, InplaceOp2, Layout, Storage, Tensor,
};

use crate::error::Result;

/// Whether cudarc tracks accesses to `device`'s memory across streams (see the module's doc).
fn tracks_streams(device: &CudaDevice) -> bool {
    device
        .cuda_stream()
        .context()
        .is_managing_stream_synchronization()
}

/// The device and the address of the first element of `tensor`, taken with write access (under
/// the storage's write lock, as candle's in-place ops take it), if `tensor` is a contiguous CUDA
/// tensor of element type `T` (`dtype`) of a context that does not track streams.
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
/// contiguous CUDA tensor of element type `T` (`dtype`) of a context that does not track streams.
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
    if tracks_streams(&device) {
        return Ok(None);
    }
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

/// Runs `launch` with the device, the address of `dst` (a contiguous f32 CUDA tensor, written)
/// and the address and layout of `src` (a CUDA tensor of element type `S`, `src_dtype`, on the
/// same device, laid out in any way, read), while candle holds both storages' locks (its
/// `inplace_op2`) and cudarc's access guards of both are held, so that the accesses cudarc
/// records come after the kernel `launch` queues. `Ok(None)`, with nothing run, when the tensors
/// are not such, or share an allocation (candle refuses an in-place op whose source aliases its
/// destination; the tensor-op path copies instead).
pub(crate) fn with_dst_and_strided_src<S: CudaDType, R>(
    dst: &Tensor,
    src: &Tensor,
    src_dtype: DType,
    launch: impl FnOnce(&CudaDevice, u64, &StridedAddress) -> Result<R>,
) -> Result<Option<R>> {
    if !dst.device().is_cuda()
        || !src.device().same_device(dst.device())
        || dst.dtype() != DType::F32
        || src.dtype() != src_dtype
        || dst.layout().contiguous_offsets().is_none()
        || base_address::<f32>(dst)? == base_address::<S>(src)?
    {
        return Ok(None);
    }
    let op = DstSrcOp::<S, _, R> {
        launch: Mutex::new(Some(launch)),
        result: Mutex::new(None),
        element: std::marker::PhantomData,
    };
    dst.inplace_op2(src, &op)?;
    op.result
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .transpose()
}

/// The base address of `tensor`'s allocation (not of its first element), to tell whether two
/// tensors share one; `None` for a tensor that is not on a GPU or not of element type `T`.
fn base_address<T: CudaDType>(tensor: &Tensor) -> Result<Option<u64>> {
    let (storage, _) = tensor.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Ok(None);
    };
    let stream = cuda.device().cuda_stream();
    let Ok(slice) = cuda.as_cuda_slice::<T>() else {
        return Ok(None);
    };
    let (address, _recorded) = slice.device_ptr(&stream);
    Ok(Some(address))
}

/// `with_dst_and_strided_src`'s in-place op: `launch` runs inside candle's locks.
struct DstSrcOp<S, F, R> {
    launch: Mutex<Option<F>>,
    result: Mutex<Option<Result<R>>>,
    element: std::marker::PhantomData<fn() -> S>,
}

impl<S, F, R> InplaceOp2 for DstSrcOp<S, F, R>
where
    S: CudaDType,
    F: FnOnce(&CudaDevice, u64, &StridedAddress) -> Result<R>,
{
    fn name(&self) -> &'static str {
        "accelerate-cuda-dst-src"
    }

    /// Never reached: `with_dst_and_strided_src` runs the op on CUDA tensors only.
    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        Ok(())
    }

    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dst_l: &Layout,
        src: &CudaStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let Some((start, _)) = dst_l.contiguous_offsets() else {
            return Ok(());
        };
        let Some(launch) = self.launch.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(());
        };
        let device = dst.device().clone();
        let stream = device.cuda_stream();
        // Both guards live until the end of this function, after `launch` queued the kernel.
        let (src_base, _src_recorded) = src.as_cuda_slice::<S>()?.device_ptr(&stream);
        let (dst_base, _dst_recorded) = dst.as_cuda_slice_mut::<f32>()?.device_ptr_mut(&stream);
        let element = |bytes: usize, index: usize| (bytes * index) as u64;
        let strided = StridedAddress {
            address: src_base + element(std::mem::size_of::<S>(), src_l.start_offset()),
            dims: src_l.dims().to_vec(),
            strides: src_l.stride().to_vec(),
        };
        let dst_address = dst_base + element(std::mem::size_of::<f32>(), start);
        let outcome = launch(&device, dst_address, &strided);
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
        Ok(())
    }
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
        if tracks_streams(&device) {
            return Ok(());
        }
        let stream = device.cuda_stream();
        let mut view = storage.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
        let (address, _recorded) = view.device_ptr_mut(&stream);
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some((device, address));
        Ok(())
    }
}
