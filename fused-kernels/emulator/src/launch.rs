//! Launches and the kernel registry.

use crate::arg::{Arg, Value};
use crate::ffi;
use crate::Error;
use std::ffi::{c_void, CStr, CString};

/// The order in which a block's threads run between two barriers (or warp collectives): each
/// runs until it waits or exits, in increasing or decreasing thread index. A kernel whose result
/// depends on the order has a race between its threads (a missing `__syncthreads`, most often);
/// run every test in both orders and compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Order {
    /// Thread 0 first.
    Increasing,
    /// The last thread first.
    Decreasing,
}

impl Order {
    /// Both orders.
    pub const BOTH: [Order; 2] = [Order::Increasing, Order::Decreasing];
}

/// A grid or block shape, CUDA's `dim3`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dim3 {
    /// Threads (blocks) along x.
    pub x: u32,
    /// Along y.
    pub y: u32,
    /// Along z.
    pub z: u32,
}

impl From<u32> for Dim3 {
    fn from(x: u32) -> Self {
        Dim3 { x, y: 1, z: 1 }
    }
}

impl From<(u32, u32, u32)> for Dim3 {
    fn from((x, y, z): (u32, u32, u32)) -> Self {
        Dim3 { x, y, z }
    }
}

/// Runs `kernel` (an `extern "C" __global__` function of a `.cu` file) on a `grid` of blocks of
/// `block` threads with `shared_mem_bytes` of dynamic shared memory, threads scheduled in
/// `order`, and returns when every block has finished.
///
/// Refused before anything runs: an unknown kernel name, a launch shape beyond CUDA's limits
/// (more than 1024 threads per block, more than 48 KiB of dynamic shared memory), or arguments
/// that do not match the kernel's parameters in number, kind, element type or constness. An
/// error while it runs (a divergent `__syncthreads`, a deadlock, a warp collective with a partial
/// mask or an exited lane, `__trap`) names the kernel, block and thread and ends the launch; so
/// does a write just outside a buffer, found after the launch. A memory fault (an access well
/// outside a buffer) aborts the process after printing the kernel, block and thread.
pub fn launch(
    kernel: &str,
    grid: impl Into<Dim3>,
    block: impl Into<Dim3>,
    shared_mem_bytes: usize,
    args: &[Arg<'_>],
    order: Order,
) -> Result<(), Error> {
    let name = CString::new(kernel)
        .map_err(|_| Error::new(format!("kernel name {kernel:?} contains a NUL byte")))?;
    let (grid, block) = (grid.into(), block.into());
    // Each argument's bits, in storage that lives through the launch; the kernel reads
    // *args[i] as its parameter i.
    let mut values: Vec<[u64; 1]> = args
        .iter()
        .map(|a| {
            [match a.value {
                Value::Pointer(p) => p as u64,
                Value::U64(v) => v,
                Value::I64(v) => v as u64,
                Value::U32(v) => u64::from(v),
                Value::I32(v) => u64::from(v as u32),
                Value::F32(v) => u64::from(v.to_bits()),
                Value::F64(v) => v.to_bits(),
            }]
        })
        .collect();
    // Little-endian: the low bytes of each u64 are the value of a 4-byte parameter.
    let pointers: Vec<*mut c_void> = values
        .iter_mut()
        .map(|v| v.as_mut_ptr().cast::<c_void>())
        .collect();
    let codes: Vec<u32> = args.iter().map(|a| a.code).collect();
    let order = match order {
        Order::Increasing => 0,
        Order::Decreasing => 1,
    };
    // SAFETY: every pointer argument points into a live Buffer borrowed for 'a (mutably where
    // the kernel may write), the values outlive the call, and the runtime checks the count and
    // kinds against the kernel's signature before calling it.
    let status = unsafe {
        ffi::emu_launch(
            name.as_ptr(),
            [grid.x, grid.y, grid.z].as_ptr(),
            [block.x, block.y, block.z].as_ptr(),
            shared_mem_bytes,
            pointers.as_ptr(),
            codes.as_ptr(),
            args.len(),
            order,
        )
    };
    if status == 0 {
        return Ok(());
    }
    // SAFETY: emu_last_error returns the calling thread's NUL-terminated message.
    let message = unsafe { CStr::from_ptr(ffi::emu_last_error()) };
    Err(Error::new(message.to_string_lossy().into_owned()))
}

/// The names of every kernel the emulator compiled, sorted: the `extern "C" __global__`
/// functions of fused-kernels' `src/cuda/*.cu` and of the emulator's own test kernels.
pub fn kernels() -> Vec<String> {
    // SAFETY: plain queries of the static registry; names are NUL-terminated static strings.
    let count = unsafe { ffi::emu_kernel_count() };
    (0..count)
        .filter_map(|i| {
            let p = unsafe { ffi::emu_kernel_name(i) };
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        })
        .collect()
}

/// The C++ signature of `kernel`, e.g. `gelu_f32(const float*, float*, unsigned long long)`, or
/// `None` for an unknown kernel.
pub fn signature(kernel: &str) -> Option<String> {
    let name = CString::new(kernel).ok()?;
    let mut buf = vec![0u8; 1024];
    // SAFETY: buf has the capacity passed; the runtime NUL-terminates within it.
    let n = unsafe { ffi::emu_kernel_signature(name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return None;
    }
    let text = CStr::from_bytes_until_nul(&buf).ok()?;
    Some(text.to_string_lossy().into_owned())
}
