//! The CUDA side of the kernels: the machine code that `build.rs` compiles from `src/cuda/*.cu`,
//! reading candle's CUDA storage, and launch shapes. Each op's `cuda_fwd` (in the op's own module)
//! checks its inputs, allocates its output and launches the kernels of its module on the device's
//! stream.
//!
//! Every `.cu` is one fat binary holding machine code for the architectures `build.rs` names (sm_80
//! and sm_90 at least) and PTX for the oldest, which the driver compiles for any newer GPU. Loading
//! machine code costs nothing at run time, where PTX is compiled by the driver on a machine's first
//! launch. A module is loaded once per device and its kernels are looked up once each (see
//! [`function`]); kernels are named `<kernel>_<suffix>` with the dtype's suffix (`f32`, `f64`,
//! `bf16`, `f16`).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaView, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, DeviceId};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

/// One compiled `.cu` file.
pub(crate) struct Module {
    /// The file's name without `.cu`, for error messages and the cache.
    pub(crate) name: &'static str,
    /// Its fat binary (machine code and PTX), as `nvcc --fatbin` wrote it.
    pub(crate) image: &'static [u8],
}

macro_rules! module {
    ($const:ident, $file:literal) => {
        #[doc = concat!("The kernels of `src/cuda/", $file, ".cu`.")]
        pub(crate) const $const: Module = Module {
            name: $file,
            image: include_bytes!(concat!(env!("OUT_DIR"), "/", $file, ".fatbin")),
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
module!(RESIDUAL, "residual");
module!(BLOCK_KERNELS, "block_kernels");
module!(EMBEDDING, "embedding");
module!(LINEAR_CROSS_ENTROPY, "linear_cross_entropy");
module!(FLASH_ATTENTION, "flash_attention");

/// Modules loaded per device, and kernels looked up per device (candle's own loader takes PTX text
/// only, and looks a kernel up again at every launch).
#[derive(Default)]
struct Loaded {
    modules: HashMap<(DeviceId, &'static str), Arc<CudaModule>>,
    functions: HashMap<(DeviceId, String), CudaFunction>,
}

fn loaded() -> &'static RwLock<Loaded> {
    static LOADED: OnceLock<RwLock<Loaded>> = OnceLock::new();
    LOADED.get_or_init(Default::default)
}

/// The kernel `kernel` of `module` on `device`, loading the module on first use.
pub(crate) fn function(device: &CudaDevice, module: &Module, kernel: &str) -> Result<CudaFunction> {
    let id = device.id();
    // A poisoned lock only means another thread panicked while inserting: the maps stay valid.
    if let Some(f) = loaded()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .functions
        .get(&(id, kernel.to_string()))
    {
        return Ok(f.clone());
    }
    let mut cache = loaded().write().unwrap_or_else(|e| e.into_inner());
    let module_handle = match cache.modules.get(&(id, module.name)) {
        Some(m) => m.clone(),
        None => {
            let context = device.cuda_stream().context().clone();
            let m = context
                .load_module(Ptx::from_binary(module.image.to_vec()))
                .map_err(|e| {
                    candle_core::Error::Msg(format!(
                        "fused-kernels: the CUDA module {} could not be loaded on this GPU ({e}); \
                         it holds machine code for sm_80 and sm_90 and PTX for newer GPUs, which \
                         needs a driver at least as new as the CUDA toolkit that built it",
                        module.name
                    ))
                })?;
            cache.modules.insert((id, module.name), m.clone());
            m
        }
    };
    let f = module_handle.load_function(kernel).map_err(|e| {
        candle_core::Error::Msg(format!(
            "fused-kernels: no kernel {kernel} in the CUDA module {} ({e})",
            module.name
        ))
    })?;
    cache.functions.insert((id, kernel.to_string()), f.clone());
    Ok(f)
}

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
    ($device:expr, $module:expr, $kernel:expr, $t:ty, $cfg:expr; $($arg:expr),* $(,)?) => {{
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        use candle_core::cuda_backend::WrapErr;
        // `$device` may be a device or a reference to one.
        let device_ref = &$device;
        let device: &candle_core::CudaDevice = std::borrow::Borrow::borrow(device_ref);
        let func = $crate::cuda::function(
            device,
            &$module,
            &format!("{}_{}", $kernel, <$t as $crate::cuda::CudaElement>::SUFFIX),
        )?;
        let stream = device.cuda_stream();
        let mut builder = stream.launch_builder(&func);
        $( builder.arg($arg); )*
        // SAFETY: each call site passes the arguments of its kernel's signature in the `.cu`
        // file, in order, with the device buffers sized for the launch's shape.
        unsafe { builder.launch($cfg) }.w()?;
    }};
}
pub(crate) use launch;
