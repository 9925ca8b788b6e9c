//! All-reduce bandwidth of the communicator, run under the launcher:
//!
//! `accelerate-launch --cpu --num-processes 2 target/release/bench_allreduce`
//!
//! For each message size (f32, 1 MiB to 256 MiB by default) every rank all-reduces (sum) a buffer
//! repeatedly; rank 0 prints the median time, the algorithm bandwidth (size / time) and the bus
//! bandwidth (algbw · 2(N−1)/N, the traffic each link carries in a ring), next to what one core's
//! memcpy of the same size achieves on this machine, and one core's copy with streaming
//! (non-temporal) stores: rank 0 copies between the all-reduces while the other ranks wait, so
//! the figures are taken under the same conditions.

use std::time::Instant;

use accelerate_benchmarks::median;
use accelerate_core::{Accelerator, ReduceOp};
use anyhow::Result;
use candle_core::{Device, Tensor};
use clap::Parser;

/// Measure all-reduce time and bandwidth.
#[derive(Debug, Parser)]
struct Args {
    /// Smallest message in KiB.
    #[arg(long, default_value_t = 1024)]
    min_kib: usize,
    /// Largest message in KiB.
    #[arg(long, default_value_t = 256 * 1024)]
    max_kib: usize,
    /// Repetitions per size (after one warm-up).
    #[arg(long, default_value_t = 5)]
    iters: usize,
}

/// Copies `src` into `dst` with non-temporal (streaming) stores, which skip the read of each
/// destination line that an ordinary store makes. glibc's memcpy switches to them only above a
/// threshold derived from the last-level cache size, which a VM may misreport; this is the
/// fastest single-core copy of large buffers, the stricter reference.
#[cfg(target_arch = "x86_64")]
fn stream_copy(dst: &mut [f32], src: &[f32]) {
    use std::arch::x86_64::{_mm_loadu_ps, _mm_sfence, _mm_stream_ps};
    assert_eq!(dst.len(), src.len());
    // Streaming stores need 16-byte aligned destinations; f32 buffers from the allocator are
    // at least 16-byte aligned for these sizes, but the head is handled anyway.
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let body = (dst.len() - head) / 4 * 4;
    // SAFETY: SSE is part of x86_64; every access is within the slices (`head + body` elements
    // at most), and the destination addresses are 16-byte aligned from `head` on.
    unsafe {
        let (d, s) = (dst.as_mut_ptr().add(head), src.as_ptr().add(head));
        for i in (0..body).step_by(4) {
            _mm_stream_ps(d.add(i), _mm_loadu_ps(s.add(i)));
        }
        _mm_sfence();
    }
    dst[head + body..].copy_from_slice(&src[head + body..]);
}

#[cfg(not(target_arch = "x86_64"))]
fn stream_copy(dst: &mut [f32], src: &[f32]) {
    dst.copy_from_slice(src);
}

/// Seconds one call of `copy` takes on `dst`/`src`.
fn time_copy(dst: &mut [f32], src: &[f32], copy: fn(&mut [f32], &[f32])) -> f64 {
    let start = Instant::now();
    copy(dst, std::hint::black_box(src));
    std::hint::black_box(dst);
    start.elapsed().as_secs_f64()
}

fn memcpy(dst: &mut [f32], src: &[f32]) {
    dst.copy_from_slice(src);
}

fn main() -> Result<()> {
    let args = Args::parse();
    let acc = Accelerator::new()?;
    let n = acc.num_processes();
    acc.print(format!(
        "all-reduce (sum, f32) over {n} process(es); median of {} runs; memcpy and stream copy: \
         one core (rank 0 alone), between the all-reduces",
        args.iters
    ));
    acc.print(format!(
        "{:>10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>11} {:>11}",
        "size",
        "time ms",
        "algbw GB/s",
        "busbw GB/s",
        "memcpy GB/s",
        "stream GB/s",
        "vs memcpy",
        "vs stream"
    ));
    let mut kib = args.min_kib.max(1);
    while kib <= args.max_kib {
        let elems = kib * 1024 / 4;
        let t = Tensor::ones(elems, candle_core::DType::F32, &Device::Cpu)?;
        // Rank 0 copies between the all-reduces while the other ranks wait at a barrier, so
        // each figure is taken under the same machine state (this VM's memory bandwidth drifts
        // by 2x within minutes) and the copy has the machine to itself.
        let mut buffers =
            (acc.process_index() == 0).then(|| (vec![1f32; elems], vec![0f32; elems]));
        let (mut times, mut memcpy_times, mut stream_times) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..=args.iters {
            acc.wait_for_everyone()?;
            let start = Instant::now();
            acc.reduce_in_place(&t, ReduceOp::Sum)?;
            let dt = start.elapsed().as_secs_f64();
            acc.wait_for_everyone()?;
            if let Some((src, dst)) = buffers.as_mut() {
                let m = time_copy(dst, src, memcpy);
                let s = time_copy(dst, src, stream_copy);
                if i > 0 {
                    memcpy_times.push(m);
                    stream_times.push(s);
                }
            }
            if i > 0 {
                times.push(dt);
            }
        }
        let bytes = (elems * 4) as f64;
        let time = median(&times);
        let algbw = bytes / time / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        let gbps = |times: Vec<f64>| bytes / median(&times) / 1e9;
        let (memcpy, stream) = (gbps(memcpy_times), gbps(stream_times));
        let size = if kib >= 1024 {
            format!("{} MiB", kib / 1024)
        } else {
            format!("{kib} KiB")
        };
        acc.print(format!(
            "{size:>10} {:>10.3} {algbw:>10.2} {busbw:>10.2} {memcpy:>12.2} {stream:>12.2} {:>10.0}% {:>10.0}%",
            time * 1e3,
            100.0 * algbw / memcpy,
            100.0 * algbw / stream,
        ));
        kib *= 2;
    }
    Ok(())
}
