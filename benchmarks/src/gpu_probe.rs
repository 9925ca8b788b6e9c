//! What the step benchmark reads from the GPU besides its own timings: the GPU's name, the
//! device memory in use while it trains, and the range of steps a profiler records.
//!
//! Memory is read as the driver reports it (`cuMemGetInfo`: total − free), polled on a thread
//! of its own, so that the figure means the same for any program on the GPU whatever its
//! allocator (the PyTorch counterpart polls `torch.cuda.mem_get_info` the same way). In a build
//! without CUDA, or on the CPU, every probe reports nothing.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Result;
use candle_core::Device;

/// How often the memory watcher reads the memory in use: often enough to see the peak of a
/// step that lasts tens of milliseconds, rarely enough to cost nothing measurable.
const POLL_EVERY: Duration = Duration::from_millis(2);

/// Reads the device memory in use, in bytes.
type MemReader = Arc<dyn Fn() -> Result<u64> + Send + Sync>;

/// A reader of the memory in use on `device`'s GPU (the driver's total − free), when it is one.
#[cfg(feature = "cuda")]
fn mem_info(device: &Device) -> Option<MemReader> {
    let Device::Cuda(cuda) = device else {
        return None;
    };
    let context = cuda.cuda_stream().context().clone();
    Some(Arc::new(move || {
        let (free, total) = context.mem_get_info()?;
        Ok((total - free) as u64)
    }))
}

#[cfg(not(feature = "cuda"))]
fn mem_info(_device: &Device) -> Option<MemReader> {
    None
}

/// The name of `device`'s GPU (`None` on the CPU).
#[cfg(feature = "cuda")]
pub fn gpu_name(device: &Device) -> Option<String> {
    let Device::Cuda(cuda) = device else {
        return None;
    };
    cuda.cuda_stream().context().name().ok()
}

/// The name of `device`'s GPU (`None` on the CPU).
#[cfg(not(feature = "cuda"))]
pub fn gpu_name(_device: &Device) -> Option<String> {
    None
}

/// Starts or stops the collection of the profiler attached to this process (`ncu
/// --profile-from-start off`, `nsys --capture-range=cudaProfilerApi`), so that it records
/// exactly the steps between the two calls. Does nothing on the CPU.
#[cfg(feature = "cuda")]
pub fn profiler_range(device: &Device, start: bool) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::{profiler_start, profiler_stop};
    if let Device::Cuda(cuda) = device {
        // The calls act on the current context; bind it to this thread first.
        cuda.cuda_stream().context().bind_to_thread()?;
        if start {
            profiler_start()?;
        } else {
            profiler_stop()?;
        }
    }
    Ok(())
}

/// Starts or stops the collection of the profiler attached to this process. Does nothing in a
/// build without CUDA.
#[cfg(not(feature = "cuda"))]
pub fn profiler_range(_device: &Device, _start: bool) -> Result<()> {
    Ok(())
}

/// The largest device memory in use seen since the last [`reset`](Self::reset), polled every
/// 2 ms on a thread of its own.
pub struct MemoryWatch {
    read: MemReader,
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MemoryWatch {
    /// Starts watching `device`'s memory; `None` on the CPU or in a build without CUDA.
    pub fn start(device: &Device) -> Result<Option<Self>> {
        let Some(read) = mem_info(device) else {
            return Ok(None);
        };
        let peak = Arc::new(AtomicU64::new(read()?));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (read, peak, stop) = (read.clone(), peak.clone(), stop.clone());
            std::thread::Builder::new()
                .name("memory-watch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if let Ok(used) = read() {
                            peak.fetch_max(used, Ordering::Relaxed);
                        }
                        std::thread::sleep(POLL_EVERY);
                    }
                })?
        };
        Ok(Some(Self {
            read,
            peak,
            stop,
            thread: Some(thread),
        }))
    }

    /// The memory in use now, in bytes.
    pub fn used_now(&self) -> Result<u64> {
        (self.read)()
    }

    /// Forgets the peak seen so far: the next [`peak`](Self::peak) is the largest use from now.
    pub fn reset(&self) -> Result<()> {
        self.peak.store(self.used_now()?, Ordering::Relaxed);
        Ok(())
    }

    /// The largest memory in use seen since the last reset, in bytes (read now too, so that a
    /// peak at the very end is not missed).
    pub fn peak(&self) -> Result<u64> {
        let now = self.used_now()?;
        Ok(self.peak.fetch_max(now, Ordering::Relaxed).max(now))
    }
}

impl Drop for MemoryWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
