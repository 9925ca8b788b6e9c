//! Bandwidth of the communicator's all-reduce, reduce-scatter and all-gather, run under the
//! launcher:
//!
//! `accelerate-launch --cpu --num-processes 2 target/release/bench_allreduce [--op all]`
//!
//! For each message size (f32, 1 MiB to 256 MiB by default) every rank runs each chosen
//! collective repeatedly on a buffer of that size: the all-reduce (sum) on it, the reduce-scatter
//! (sum) from it into a block of size/N, the all-gather (`all_gather_into`) from a block of size/N
//! into it, so the three rows compare. Rank 0 prints the median time, the algorithm bandwidth
//! (size / time), the bus bandwidth (the traffic each link carries in a ring: algbw · 2(N−1)/N
//! for the all-reduce, algbw · (N−1)/N for the other two, as nccl-tests count it) and the bytes
//! each rank sent, from the communicator's `bytes_sent` counter; next to what one core's memcpy
//! of the same size achieves on this machine, and one core's copy with streaming (non-temporal)
//! stores: rank 0 copies between the collectives while the other ranks wait, so the figures are
//! taken under the same conditions. The collectives are the forms without the pre-flight
//! agreement (as gradient buckets use them), so the bytes are the collective's own.

use std::time::Instant;

use accelerate_benchmarks::median;
use accelerate_core::{comm::Communicator, ProcessState, ReduceOp};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use clap::{Parser, ValueEnum};

/// Measure the time, bandwidth and traffic of the all-reduce, reduce-scatter and all-gather.
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
    /// Which collective to measure.
    #[arg(long, value_enum, default_value_t = OpChoice::All)]
    op: OpChoice,
}

/// The `--op` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OpChoice {
    /// `all_reduce` (sum) of the whole buffer.
    AllReduce,
    /// `reduce_scatter` (sum) of the whole buffer into this rank's block.
    ReduceScatter,
    /// `all_gather_into` of this rank's block into the whole buffer.
    AllGather,
    /// The three, one row each.
    All,
}

/// One measured collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Collective {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Collective {
    fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::AllGather => "all-gather",
        }
    }

    /// The share of algbw each link carries in a ring of `n` ranks.
    fn bus_factor(self, n: usize) -> f64 {
        let ring = (n as f64 - 1.0) / n as f64;
        match self {
            Collective::AllReduce => 2.0 * ring,
            Collective::ReduceScatter | Collective::AllGather => ring,
        }
    }
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

/// The buffers of one collective on `elems` f32 elements over `n` ranks: the whole buffer, and
/// this rank's block of it (unused by the all-reduce).
struct Buffers {
    whole: Tensor,
    block: Tensor,
}

impl Buffers {
    fn new(elems: usize, n: usize) -> Result<Self> {
        Ok(Self {
            whole: Tensor::ones(elems, DType::F32, &Device::Cpu)?,
            block: Tensor::ones(elems / n, DType::F32, &Device::Cpu)?,
        })
    }

    fn run(&self, comm: &dyn Communicator, collective: Collective) -> Result<()> {
        match collective {
            Collective::AllReduce => comm.all_reduce_agreed(&self.whole, ReduceOp::Sum)?,
            Collective::ReduceScatter => {
                comm.reduce_scatter_agreed(&self.whole, &self.block, ReduceOp::Sum)?
            }
            Collective::AllGather => comm.all_gather_into_agreed(&self.block, &self.whole)?,
        }
        Ok(())
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // The communicator itself (the `Accelerator` has no reduce-scatter of its own).
    let state = ProcessState::from_env()?;
    let device = accelerate_core::select_device(&state)?;
    let membership = accelerate_core::comm::join(&state, &device)?;
    let comm = membership.comm.as_ref();
    let n = comm.world_size();
    let main = comm.rank() == 0;
    let print = |line: String| {
        if main {
            println!("{line}");
        }
    };
    let collectives: Vec<Collective> = match args.op {
        OpChoice::AllReduce => vec![Collective::AllReduce],
        OpChoice::ReduceScatter => vec![Collective::ReduceScatter],
        OpChoice::AllGather => vec![Collective::AllGather],
        OpChoice::All => vec![
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
        ],
    };
    print(format!(
        "sum, f32, over {n} process(es); median of {} runs; sent: bytes per rank per call; \
         memcpy and stream copy: one core (rank 0 alone), between the collectives",
        args.iters
    ));
    print(format!(
        "{:>10} {:>15} {:>10} {:>10} {:>10} {:>12} {:>12} {:>12} {:>11} {:>11}",
        "size",
        "op",
        "time ms",
        "algbw GB/s",
        "busbw GB/s",
        "sent MiB",
        "memcpy GB/s",
        "stream GB/s",
        "vs memcpy",
        "vs stream"
    ));
    let mut kib = args.min_kib.max(1);
    while kib <= args.max_kib {
        // A whole number of blocks, one per rank.
        let elems = kib * 1024 / 4 / n * n;
        let bytes = (elems * 4) as f64;
        let size = if kib >= 1024 {
            format!("{} MiB", kib / 1024)
        } else {
            format!("{kib} KiB")
        };
        for &collective in &collectives {
            let buffers = Buffers::new(elems, n)?;
            // Rank 0 copies between the collectives while the other ranks wait at a barrier, so
            // each figure is taken under the same machine state (this VM's memory bandwidth
            // drifts by 2x within minutes) and the copy has the machine to itself.
            let mut copies = main.then(|| (vec![1f32; elems], vec![0f32; elems]));
            let (mut times, mut memcpy_times, mut stream_times) =
                (Vec::new(), Vec::new(), Vec::new());
            let mut sent = 0;
            for i in 0..=args.iters {
                comm.barrier()?;
                let before = comm.stats().bytes_sent;
                let start = Instant::now();
                buffers.run(comm, collective)?;
                let dt = start.elapsed().as_secs_f64();
                sent = comm.stats().bytes_sent - before;
                comm.barrier()?;
                if let Some((src, dst)) = copies.as_mut() {
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
            let time = median(&times);
            let algbw = bytes / time / 1e9;
            let busbw = algbw * collective.bus_factor(n);
            let gbps = |times: Vec<f64>| bytes / median(&times) / 1e9;
            let (memcpy, stream) = (gbps(memcpy_times), gbps(stream_times));
            print(format!(
                "{size:>10} {:>15} {:>10.3} {algbw:>10.2} {busbw:>10.2} {:>12.3} {memcpy:>12.2} \
                 {stream:>12.2} {:>10.0}% {:>10.0}%",
                collective.name(),
                time * 1e3,
                sent as f64 / (1024.0 * 1024.0),
                100.0 * algbw / memcpy,
                100.0 * algbw / stream,
            ));
        }
        kib *= 2;
    }
    drop(membership);
    Ok(())
}
