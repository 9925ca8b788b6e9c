//! Adding one backward pass's gradient into its f32 gradient buffer on the GPU in one kernel
//! launch (`cuda/accumulate.cu`), whatever the gradient's float dtype and layout: under mixed
//! precision the gradients are bf16 or f16, and a `Linear` weight's comes back transposed. The
//! tensor-op formulation runs three kernels per parameter: a cast to f32 (which also makes the
//! layout contiguous), a scaling, and a copy into the bucket.
//!
//! The result is the CPU path's (`grads::add_contiguous`, `add_transposed`) bit for bit: each
//! element is widened exactly to f32, multiplied by the scale, and written or added, with
//! floating-point contraction off. (The three-kernel path turned a product of -0 into +0: candle's
//! scaling adds 0.) Where NVRTC cannot compile the kernel, the tensor-op path runs instead, with
//! one warning ([`runtime_kernels`](crate::runtime_kernels)).

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Tensor};
use half::{bf16, f16};

use crate::cuda_slices::{with_dst_and_strided_src, StridedAddress};
use crate::error::Result;
use crate::merged_layout::{is_linear, merged_layout};
use crate::runtime_kernels::RuntimeKernels;

/// The kernel's source.
const SOURCE: &str = include_str!("cuda/accumulate.cu");

/// The name candle's device caches the compiled module under.
const MODULE: &str = "accelerate_core_accumulate";

/// The compiled kernel, or the tensor-op path when NVRTC cannot compile it.
static KERNELS: RuntimeKernels =
    RuntimeKernels::new("the gradient accumulation kernel", MODULE, SOURCE);

/// Dimensions the kernel's layout holds (`MAX_DIMS` in the source), after merging.
const MAX_DIMS: usize = 6;

/// The gradient's element type, as the kernel's `src_kind` (`SRC_*` in the source).
const SRC_F32: u32 = 0;
/// bf16, widened exactly.
const SRC_BF16: u32 = 1;
/// IEEE f16, widened exactly.
const SRC_F16: u32 = 2;

/// Threads per block; each thread strides over the gradient.
const BLOCK: u32 = 256;

/// At most this many blocks: enough to fill an H100/H200 several times over.
const MAX_BLOCKS: u32 = 4096;

/// The gradient's layout, by value (`Layout` in the source).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct KernelLayout {
    dims: [u64; MAX_DIMS],
    strides: [i64; MAX_DIMS],
    rank: u64,
}

// SAFETY: plain integers, laid out as the kernel's `struct Layout`.
unsafe impl DeviceRepr for KernelLayout {}

/// `dst = scale * grad` (`overwrite`) or `dst += scale * grad`, in one launch, if `dst` is a
/// contiguous f32 CUDA tensor and `grad` an f32, bf16 or f16 tensor of the same shape on the same
/// GPU whose layout merges to at most 6 dimensions, and the kernel could be compiled and loaded;
/// `Ok(false)`, with nothing done, otherwise.
pub(crate) fn add_scaled(dst: &Tensor, grad: &Tensor, scale: f32, overwrite: bool) -> Result<bool> {
    if !dst.device().is_cuda()
        || !grad.device().same_device(dst.device())
        || grad.shape() != dst.shape()
    {
        return Ok(false);
    }
    let kind = match grad.dtype() {
        DType::F32 => SRC_F32,
        DType::BF16 => SRC_BF16,
        DType::F16 => SRC_F16,
        _ => return Ok(false),
    };
    let n = grad.elem_count();
    let launch = |device: &CudaDevice, dst: u64, src: &StridedAddress| -> Result<bool> {
        if n == 0 {
            return Ok(true);
        }
        // A contiguous gradient (most are: all but the transposed weights') merges to one run,
        // indexed linearly; others keep as few dimensions as their layout allows.
        let (dims, strides) = merged_layout(&src.dims, &src.strides);
        let linear = is_linear(&dims, &strides);
        if dims.len() > MAX_DIMS {
            return Ok(false);
        }
        let name = if linear {
            "add_scaled_linear_into_f32"
        } else {
            "add_scaled_into_f32"
        };
        let Some(func) = KERNELS.function(device, name)? else {
            return Ok(false);
        };
        let mut layout = KernelLayout {
            dims: [1; MAX_DIMS],
            strides: [0; MAX_DIMS],
            rank: dims.len() as u64,
        };
        for (d, (&dim, &stride)) in dims.iter().zip(&strides).enumerate() {
            layout.dims[d] = dim as u64;
            layout.strides[d] = stride as i64;
        }
        let (n64, overwrite) = (n as u64, i32::from(overwrite));
        let stream = device.cuda_stream();
        let mut args = stream.launch_builder(&func);
        args.arg(&dst).arg(&src.address).arg(&kind).arg(&n64);
        if !linear {
            args.arg(&layout);
        }
        args.arg(&scale).arg(&overwrite);
        let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS as usize) as u32;
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the signature in SOURCE of the kernel `name` (the layout
        // only for the general one); `dst` holds `n` contiguous f32 elements and `src` the `n`
        // elements its layout (the tensor's own, merged without changing an offset) reaches,
        // both of tensors whose storages stay locked, with cudarc's access guards held, until
        // this launch is queued (see cuda_slices).
        unsafe { args.launch(config) }.w()?;
        #[cfg(test)]
        LAUNCHES.with(|n| n.set(n.get() + 1));
        #[cfg(test)]
        if linear {
            LINEAR_LAUNCHES.with(|n| n.set(n.get() + 1));
        }
        Ok(true)
    };
    let done = match kind {
        SRC_F32 => with_dst_and_strided_src::<f32, _>(dst, grad, DType::F32, launch)?,
        SRC_BF16 => with_dst_and_strided_src::<bf16, _>(dst, grad, DType::BF16, launch)?,
        _ => with_dst_and_strided_src::<f16, _>(dst, grad, DType::F16, launch)?,
    };
    Ok(done.unwrap_or(false))
}

#[cfg(test)]
thread_local! {
    /// Launches of the kernel so far on this thread (tests, each on a thread of its own, check
    /// that the kernel ran, not the tensor-op path).
    static LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
thread_local! {
    /// Launches of the linear kernel (a contiguous gradient) so far on this thread.
    static LINEAR_LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Launches of the kernel so far on this thread.
#[cfg(test)]
pub(crate) fn launches() -> u64 {
    LAUNCHES.with(|n| n.get())
}

/// Launches of the linear kernel so far on this thread.
#[cfg(test)]
pub(crate) fn linear_launches() -> u64 {
    LINEAR_LAUNCHES.with(|n| n.get())
}
