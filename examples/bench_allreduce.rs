//! All-reduce bandwidth of the communicator, run under the launcher:
//!
//! `accelerate-launch --cpu --num-processes 2 target/release/examples/bench_allreduce`
//!
//! For each message size (f32, 1 MiB to 256 MiB by default) every rank all-reduces (sum) a buffer
//! repeatedly; rank 0 prints the median time, the algorithm bandwidth (size / time) and the bus
//! bandwidth (algbw · 2(N−1)/N, the traffic each link carries in a ring), next to what one core's
//! memcpy of the same size achieves on this machine, measured in the same run.

use std::time::Instant;

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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let acc = Accelerator::new()?;
    let n = acc.num_processes();
    acc.print(format!(
        "all-reduce (sum, f32) over {n} process(es); median of {} runs",
        args.iters
    ));
    acc.print(format!(
        "{:>10} {:>12} {:>12} {:>12} {:>14}",
        "size", "time ms", "algbw GB/s", "busbw GB/s", "memcpy GB/s"
    ));
    let mut kib = args.min_kib.max(1);
    while kib <= args.max_kib {
        let elems = kib * 1024 / 4;
        let t = Tensor::ones(elems, candle_core::DType::F32, &Device::Cpu)?;
        let mut times = Vec::new();
        for i in 0..=args.iters {
            acc.wait_for_everyone()?;
            let start = Instant::now();
            acc.reduce_in_place(&t, ReduceOp::Sum)?;
            let dt = start.elapsed().as_secs_f64();
            if i > 0 {
                times.push(dt);
            }
        }
        let bytes = (elems * 4) as f64;
        let time = median(times);
        let algbw = bytes / time / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        let memcpy = memcpy_gbps(elems, args.iters);
        let size = if kib >= 1024 {
            format!("{} MiB", kib / 1024)
        } else {
            format!("{kib} KiB")
        };
        acc.print(format!(
            "{size:>10} {:>12.3} {algbw:>12.2} {busbw:>12.2} {memcpy:>14.2}",
            time * 1e3
        ));
        kib *= 2;
    }
    Ok(())
}

/// One core copying `elems` f32 between two buffers, GB/s (bytes copied per second).
fn memcpy_gbps(elems: usize, iters: usize) -> f64 {
    let src = vec![1f32; elems];
    let mut dst = vec![0f32; elems];
    dst.copy_from_slice(&src);
    let mut times = Vec::new();
    for _ in 0..iters.max(1) {
        let start = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        times.push(start.elapsed().as_secs_f64());
    }
    (elems * 4) as f64 / median(times) / 1e9
}
