//! Adding one backward pass's gradient into its f32 gradient buffer on the GPU in one kernel
//! launch (`cuda/accumulate.cu`), whatever the gradient's float dtype and layout: under mixed
//! precision the gradients are bf16 or f16, and a `Linear` weight's comes back transposed. The
//! tensor-op formulation runs three kernels per parameter: a cast to f32 (which also makes the
//! layout contiguous), a scaling, and a copy into the bucket.
//!
//! The result is the CPU path's (`grads::add_contiguous`, `add_transposed`) bit for bit: each
//! element is widened exactly to f32, multiplied by the scale, and written or added, with
//! floating-point contraction off. (The three-kernel path turned a product of -0 into +0: candle's
//! scaling adds 0.)

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};
use half::{bf16, f16};

use crate::cuda_slices::{cuda_address_mut, cuda_strided_address, StridedAddress};
use crate::error::{Error, Result};

/// The kernel's source.
const SOURCE: &str = include_str!("cuda/accumulate.cu");

/// The name candle's device caches the compiled module under.
const MODULE: &str = "accelerate_core_accumulate";

/// Dimensions the kernel's layout holds (`MAX_DIMS` in the source).
const MAX_DIMS: usize = 6;

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

fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    let compiled = PTX.get_or_init(|| {
        let options = CompileOptions {
            fmad: Some(false),
            ..Default::default()
        };
        compile_ptx_with_opts(SOURCE, options)
            .map(|ptx| ptx.to_src())
            .map_err(|e| e.to_string())
    });
    compiled.as_deref().map_err(|e| {
        Error::Parameters(format!(
            "NVRTC could not compile the gradient accumulation kernel: {e} (NVRTC comes with the \
             CUDA toolkit; put its libnvrtc on LD_LIBRARY_PATH)"
        ))
    })
}

/// `dst = scale * grad` (`overwrite`) or `dst += scale * grad`, in one launch, if `dst` is a
/// contiguous f32 CUDA tensor and `grad` an f32, bf16 or f16 tensor of the same shape on the same
/// GPU, of rank at most 6; `Ok(false)`, with nothing done, otherwise.
pub(crate) fn add_scaled(dst: &Tensor, grad: &Tensor, scale: f32, overwrite: bool) -> Result<bool> {
    if !dst.device().is_cuda()
        || !grad.device().same_device(dst.device())
        || grad.shape() != dst.shape()
        || grad.rank() > MAX_DIMS
    {
        return Ok(false);
    }
    let (kind, src) = match grad.dtype() {
        DType::F32 => (0u32, cuda_strided_address::<f32>(grad, DType::F32)?),
        DType::BF16 => (1, cuda_strided_address::<bf16>(grad, DType::BF16)?),
        DType::F16 => (2, cuda_strided_address::<f16>(grad, DType::F16)?),
        _ => return Ok(false),
    };
    let Some(StridedAddress {
        address: src,
        dims,
        strides,
    }) = src
    else {
        return Ok(false);
    };
    let Some((device, dst)) = cuda_address_mut::<f32>(dst, DType::F32)? else {
        return Ok(false);
    };
    let n = grad.elem_count();
    if n == 0 {
        return Ok(true);
    }
    let mut layout = KernelLayout {
        dims: [1; MAX_DIMS],
        strides: [0; MAX_DIMS],
        rank: dims.len() as u64,
    };
    for (d, (&dim, &stride)) in dims.iter().zip(&strides).enumerate() {
        layout.dims[d] = dim as u64;
        layout.strides[d] = stride as i64;
    }
    let func = device.get_or_load_custom_func("add_scaled_into_f32", MODULE, ptx()?)?;
    let (n64, overwrite) = (n as u64, i32::from(overwrite));
    let mut args = func.builder();
    args.arg(&dst)
        .arg(&src)
        .arg(&kind)
        .arg(&n64)
        .arg(&layout)
        .arg(&scale)
        .arg(&overwrite);
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS as usize) as u32;
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature in SOURCE; `dst` holds `n` contiguous
    // f32 elements and `src` the `n` elements its layout (from the tensor's own) reaches, both
    // taken from live tensors that the caller holds until the launch is queued (see cuda_slices).
    unsafe { args.launch(config) }.w()?;
    #[cfg(test)]
    LAUNCHES.with(|n| n.set(n.get() + 1));
    Ok(true)
}

#[cfg(test)]
thread_local! {
    /// Launches of the kernel so far on this thread (tests, each on a thread of its own, check
    /// that the kernel ran, not the tensor-op path).
    static LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Launches of the kernel so far on this thread.
#[cfg(test)]
pub(crate) fn launches() -> u64 {
    LAUNCHES.with(|n| n.get())
}
