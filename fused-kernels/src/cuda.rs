//! The CUDA side of the kernels: the PTX that `build.rs` compiles from `src/cuda/*.cu`, reading
//! candle's CUDA storage, and launch shapes. Each op's `cuda_fwd` (in the op's own module) checks
//! its inputs, allocates its output and launches the kernels of its module on the device's stream.
//!
//! Every `.cu` is one PTX module, loaded once per device under the name `fused_kernels_<file>`;
//! its kernels are named `<kernel>_<suffix>` with the dtype's suffix (`f32`, `f64`, `bf16`, `f16`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

/// One compiled `.cu` file.
pub(crate) struct Module {
    /// The name candle's device caches the loaded module under.
    pub(crate) name: &'static str,
    /// Its PTX.
    pub(crate) ptx: &'static str,
}

macro_rules! module {
    ($const:ident, $file:literal) => {
        #[doc = concat!("The kernels of `src/cuda/", $file, ".cu`.")]
        pub(crate) const $const: Module = Module {
            name: concat!("fused_kernels_", $file),
            ptx: include_str!(concat!(env!("OUT_DIR"), "/", $file, ".ptx")),
        };
    };
}
module!(LAYER_NORM, "layer_norm");
module!(RMS_NORM, "rms_norm");
module!(CAUSAL_SOFTMAX, "causal_softmax");
module!(CROSS_ENTROPY, "cross_entropy");
module!(ACTIVATIONS, "activations");
module!(ROTARY, "rotary");
module!(ADD_BIAS, "add_bias");
module!(FLASH_ATTENTION, "flash_attention");

/// An element type the CUDA kernels take, with the type their arithmetic is done in (f32 for f32,
/// bf16 and f16; f64 for f64), which is also the type of their partial sums.
pub(crate) trait CudaElement: CudaDType + DeviceRepr + Copy + 'static {
    /// The kernels' name suffix for this type.
    const SUFFIX: &'static str;
    /// candle's name of the type.
    const DTYPE: DType;
    /// The arithmetic type.
    type Acc: CudaElement + ValidAsZeroBits;
}

impl CudaElement for f32 {
    const SUFFIX: &'static str = "f32";
    const DTYPE: DType = DType::F32;
    type Acc = f32;
}
impl CudaElement for f64 {
    const SUFFIX: &'static str = "f64";
    const DTYPE: DType = DType::F64;
    type Acc = f64;
}
impl CudaElement for bf16 {
    const SUFFIX: &'static str = "bf16";
    const DTYPE: DType = DType::BF16;
    type Acc = f32;
}
impl CudaElement for f16 {
    const SUFFIX: &'static str = "f16";
    const DTYPE: DType = DType::F16;
    type Acc = f32;
}

/// The contiguous elements of the input `what` of `op` (dtype `T`), or an error naming the dtype
/// or layout problem.
pub(crate) fn input<'a, T: CudaElement>(
    op: &str,
    what: &str,
    storage: &'a CudaStorage,
    layout: &Layout,
) -> Result<CudaView<'a, T>> {
    if storage.dtype() != T::DTYPE {
        candle_core::bail!(
            "{op}: {what} has dtype {:?}, expected {:?}",
            storage.dtype(),
            T::DTYPE
        );
    }
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(storage.as_cuda_slice::<T>()?.slice(start..end)),
        None => candle_core::bail!(
            "{op}: {what} is not contiguous (shape {:?}, strides {:?}); call the public function, \
             which makes its inputs contiguous",
            layout.dims(),
            layout.stride()
        ),
    }
}

/// A new, uninitialized device buffer of `len` elements, which the caller's kernels fill entirely.
pub(crate) fn output<T: DeviceRepr>(device: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every caller launches kernels that write all `len` elements before the buffer is
    // read (the public functions send empty tensors to the fallback, so `len > 0`).
    unsafe { device.alloc::<T>(len) }
}

/// Wraps a result buffer into candle's storage.
pub(crate) fn storage<T: CudaDType>(slice: CudaSlice<T>, device: &CudaDevice) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(slice, device.clone())
}

/// Most threads a row kernel's block has. Each thread strides over the row, so rows of any width
/// work; 256 keeps enough blocks resident per multiprocessor for the reductions to overlap.
const ROW_THREADS: usize = 256;

/// Most blocks of a row kernel: more rows than this are handled in a grid-stride loop.
const MAX_ROW_BLOCKS: usize = 65_535;

/// Most blocks of the first pass of a reduction over rows (each keeps one partial sum per
/// column): enough to fill an H100/H200 (132 multiprocessors) a few times over.
const PARTIAL_BLOCKS: usize = 512;

/// Most partial sums of a reduction over rows (64 MiB in f32), for wide rows.
const MAX_PARTIALS: usize = 1 << 24;

/// Blocks of the first pass of a reduction over `rows` rows into `len` sums per block. It depends
/// on the shape only, not on the GPU, so the sums round the same way on every device.
pub(crate) fn partial_blocks(rows: usize, len: usize) -> usize {
    rows.min(PARTIAL_BLOCKS)
        .min(MAX_PARTIALS / len.max(1))
        .max(1)
}

/// Threads of a block over rows of `width` elements: a whole number of warps, at most
/// [`ROW_THREADS`].
fn row_threads(width: usize) -> u32 {
    width.div_ceil(32).clamp(1, ROW_THREADS / 32) as u32 * 32
}

/// One block per row (up to [`MAX_ROW_BLOCKS`]) for `rows` rows of `width` elements.
pub(crate) fn rows_config(rows: usize, width: usize) -> LaunchConfig {
    blocks_over_rows(rows.clamp(1, MAX_ROW_BLOCKS), width)
}

/// `blocks` blocks (at least one) of row threads for rows of `width` elements.
pub(crate) fn blocks_over_rows(blocks: usize, width: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1) as u32, 1, 1),
        block_dim: (row_threads(width), 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads per block of the element-wise kernels.
const ELEMENT_THREADS: usize = 256;

/// Most blocks of an element-wise kernel (a grid-stride loop covers the rest).
const MAX_ELEMENT_BLOCKS: usize = 4096;

/// A grid-stride launch over `n` elements.
pub(crate) fn elements_config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            n.div_ceil(ELEMENT_THREADS).clamp(1, MAX_ELEMENT_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (ELEMENT_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The launch of the second pass of a reduction over rows: one thread per column.
pub(crate) fn columns_config(len: usize) -> LaunchConfig {
    elements_config(len)
}

/// The launch of a sum by one block (the cross-entropy total).
pub(crate) fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Calls the generic function `$f::<T>(args)` with `T` the element type of the CUDA storage
/// `$storage`, or returns the dtype error of `$op`.
macro_rules! cuda_dispatch {
    ($op:expr, $storage:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match candle_core::backend::BackendStorage::dtype($storage) {
            candle_core::DType::F32 => $f::<f32>($($arg),*),
            candle_core::DType::F64 => $f::<f64>($($arg),*),
            candle_core::DType::BF16 => $f::<half::bf16>($($arg),*),
            candle_core::DType::F16 => $f::<half::f16>($($arg),*),
            other => Err($crate::element::unsupported($op, other)),
        }
    };
}
pub(crate) use cuda_dispatch;

/// Launches the kernel `$kernel` of `$module` for element type `$t` (`<kernel>_<suffix>`) on
/// `$device`'s stream with `$cfg` and the arguments after it (each passed by reference), loading
/// the module on first use.
macro_rules! launch {
    ($device:expr, $module:expr, $kernel:literal, $t:ty, $cfg:expr; $($arg:expr),* $(,)?) => {{
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        use candle_core::cuda_backend::WrapErr;
        let module = &$module;
        let func = $device.get_or_load_custom_func(
            &format!("{}_{}", $kernel, <$t as $crate::cuda::CudaElement>::SUFFIX),
            module.name,
            module.ptx,
        )?;
        let mut builder = func.builder();
        $( builder.arg($arg); )*
        // SAFETY: each call site passes the arguments of its kernel's signature in the `.cu`
        // file, in order, with the device buffers sized for the launch's shape.
        unsafe { builder.launch($cfg) }.w()?;
    }};
}
pub(crate) use launch;
