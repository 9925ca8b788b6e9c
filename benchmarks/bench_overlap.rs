//! Overlap of gradient reduction with bucket preparation, measured: the same training loop on N
//! CPU ranks through the real launcher, with `ACCELERATE_OVERLAP_GRADIENT_REDUCTION` off and on,
//! in interleaved rounds (off-on, then on-off, ...) so that machine noise hits both alike.
//!
//! Each run is one job of `accelerate-launch` re-executing this benchmark with a hidden flag; its
//! rank 0 times every optimizer step after two warm-up steps and reports medians:
//!
//! - **step**: the whole optimizer step, from the window's first micro-step to after
//!   `optimizer.step()` (K forward and backward passes, the reduction, the update);
//! - **sync backward**: `accelerator.backward` on the sync micro-step (candle's backward pass,
//!   the accumulation of every bucket and the all-reduce of every bucket: what overlap changes);
//! - **other backward**: `accelerator.backward` on the other micro-steps (backward pass and
//!   accumulation, no communication), for scale.
//!
//! `cargo build --release --workspace --bins && target/release/bench_overlap`
//! (see BENCHMARKS.md, "Overlap of reduction and preparation"). The workers inherit the
//! environment, so `ACCELERATE_CPU_TRANSPORT=tcp` measures the TCP ring instead of shared memory.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accelerate_benchmarks::{median, report_value, run_within};
use accelerate_core::data::{DataLoader, TensorDataset};
use accelerate_core::optim::{AdamW, AdamWConfig};
use accelerate_core::Accelerator;
use accelerate_examples::gpt::{self, CharVocab, GptConfig, TextWindows};
use accelerate_examples::mlp;
use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// The MLP of `examples/mlp.rs` (784 → H → H → 10), synthetic data.
    Mlp,
    /// The small GPT of `examples/gpt.rs`, full-length windows of the built-in text.
    Gpt,
}

/// Benchmark overlapping the reduction of a gradient bucket with the preparation of the next.
#[derive(Debug, Parser)]
struct Args {
    /// Training workload.
    #[arg(long, value_enum, default_value_t = Workload::Mlp)]
    workload: Workload,
    /// Ranks (CPU processes).
    #[arg(long, default_value_t = 2)]
    num_processes: usize,
    /// Micro-steps per optimizer step (K).
    #[arg(long, default_value_t = 2)]
    grad_accum: usize,
    /// Gradient bucket cap in MiB (1 splits the H=1024 MLP into 5 buckets; the 25 MiB default
    /// keeps it in one, where there is nothing to overlap).
    #[arg(long, default_value_t = 1.0)]
    bucket_cap_mb: f64,
    /// Samples (MLP) or windows (GPT) per micro-batch on each rank.
    #[arg(long)]
    batch_size: Option<usize>,
    /// MLP hidden width.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// GPT blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// GPT embedding width.
    #[arg(long, default_value_t = 256)]
    width: usize,
    /// GPT window length.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Optimizer steps timed per run, after 2 warm-up steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Rounds (each runs overlap off and on once).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// RAYON_NUM_THREADS for the workers (default: the launcher's cores / processes).
    #[arg(long)]
    rayon_threads: Option<usize>,
    /// The launcher (default: `accelerate-launch` of the same build).
    #[arg(long)]
    launcher: Option<std::path::PathBuf>,
    /// Seconds a run may take before it is killed and the benchmark fails.
    #[arg(long, default_value_t = 600)]
    run_timeout: u64,
    /// Internal: be one rank of a run (used through the launcher).
    #[arg(long, hide = true)]
    worker: bool,
}

impl Args {
    fn batch_size(&self) -> usize {
        self.batch_size.unwrap_or(match self.workload {
            Workload::Mlp => 64,
            Workload::Gpt => 8,
        })
    }
}

/// Medians of one run's rank 0, in milliseconds.
#[derive(Debug, Clone, Copy)]
struct RunReport {
    step_ms: f64,
    sync_backward_ms: f64,
    other_backward_ms: f64,
    buckets: f64,
    overlap: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.worker {
        return worker(&args);
    }
    let mut runs: [Vec<RunReport>; 2] = [Vec::new(), Vec::new()];
    for round in 0..args.rounds {
        // Off first in even rounds, on first in odd ones: neither always runs on a warmer machine.
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for overlap in order {
            let report = run_job(&args, overlap)?;
            if report.overlap != f64::from(u8::from(overlap)) {
                bail!("the workers did not take ACCELERATE_OVERLAP_GRADIENT_REDUCTION={overlap}");
            }
            runs[usize::from(overlap)].push(report);
        }
        eprintln!("round {} of {} done", round + 1, args.rounds);
    }
    let threads = args
        .rayon_threads
        .map_or("launcher default".to_string(), |t| t.to_string());
    let transport = std::env::var(accelerate_core::env::CPU_TRANSPORT).unwrap_or("auto".into());
    println!(
        "{:?}, {} ranks, K={}, batch {} per micro-step, bucket cap {} MiB ({} buckets), \
         RAYON_NUM_THREADS {threads}, transport {transport}, {} steps x {} rounds (medians)",
        args.workload,
        args.num_processes,
        args.grad_accum,
        args.batch_size(),
        args.bucket_cap_mb,
        runs[0][0].buckets,
        args.steps,
        args.rounds
    );
    println!(
        "{:<12} {:>14} {:>20} {:>20}",
        "overlap", "step ms", "sync backward ms", "other backward ms"
    );
    let medians: Vec<(f64, f64, f64)> = runs
        .iter()
        .map(|r| {
            (
                median(&r.iter().map(|x| x.step_ms).collect::<Vec<_>>()),
                median(&r.iter().map(|x| x.sync_backward_ms).collect::<Vec<_>>()),
                median(&r.iter().map(|x| x.other_backward_ms).collect::<Vec<_>>()),
            )
        })
        .collect();
    for (name, (step, sync, other)) in ["off", "on"].iter().zip(&medians) {
        println!("{name:<12} {step:>14.2} {sync:>20.2} {other:>20.2}");
    }
    let (off, on) = (medians[0], medians[1]);
    println!(
        "on vs off: step {:+.1} %, sync backward {:+.1} % (negative is faster)",
        (on.0 / off.0 - 1.0) * 100.0,
        (on.1 / off.1 - 1.0) * 100.0
    );
    let rounds = |i: usize| -> Vec<f64> {
        runs[i]
            .iter()
            .map(|r| (r.step_ms * 10.0).round() / 10.0)
            .collect()
    };
    println!("step ms by round: off {:?}, on {:?}", rounds(0), rounds(1));
    Ok(())
}

/// Runs one job through the launcher and reads rank 0's report.
fn run_job(args: &Args, overlap: bool) -> Result<RunReport> {
    let exe = std::env::current_exe().context("locating the benchmark's own executable")?;
    let launcher = match &args.launcher {
        Some(l) => l.clone(),
        // target/<profile>/bench_overlap -> target/<profile>/accelerate-launch
        None => exe
            .parent()
            .context("the benchmark is not inside a target directory; pass --launcher")?
            .join("accelerate-launch"),
    };
    let mut cmd = Command::new(&launcher);
    cmd.args([
        "--cpu",
        "--quiet",
        "--num-processes",
        &args.num_processes.to_string(),
        "--main-process-port",
        "0",
    ])
    .arg(&exe)
    .args(std::env::args().skip(1))
    .arg("--worker")
    .env(
        accelerate_core::env::BUCKET_CAP_MB,
        args.bucket_cap_mb.to_string(),
    )
    .env(
        accelerate_core::env::OVERLAP_GRADIENT_REDUCTION,
        if overlap { "1" } else { "0" },
    )
    .env_remove("RANK")
    .env_remove("WORLD_SIZE");
    if let Some(t) = args.rayon_threads {
        cmd.env("RAYON_NUM_THREADS", t.to_string());
    }
    let Some((status, out)) = run_within(&mut cmd, Duration::from_secs(args.run_timeout))? else {
        bail!(
            "a run took longer than --run-timeout {} s; lower --steps",
            args.run_timeout
        );
    };
    if !status.success() {
        bail!("a run (overlap {overlap}) failed ({status}):\n{out}");
    }
    let value = |key: &str| report_value(&out, key, "the run");
    Ok(RunReport {
        step_ms: value("step_ms")?,
        sync_backward_ms: value("sync_backward_ms")?,
        other_backward_ms: value("other_backward_ms")?,
        buckets: value("buckets")?,
        overlap: value("overlap")?,
    })
}

/// Per-step timings of one rank.
#[derive(Debug, Default)]
struct StepTimes {
    step_ms: Vec<f64>,
    sync_backward_ms: Vec<f64>,
    other_backward_ms: Vec<f64>,
}

impl StepTimes {
    /// Times one optimizer step's micro-steps: `micro_step(i)` runs everything of micro-step i
    /// before `backward` and returns the loss; the step's times are kept after the warm-up.
    fn record(
        &mut self,
        acc: &Accelerator,
        opt: &mut accelerate_core::PreparedOptimizer<AdamW>,
        k: usize,
        mut micro_step: impl FnMut(usize) -> Result<candle_core::Tensor>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut sync_ms = f64::NAN;
        let mut others = Vec::new();
        for i in 0..k {
            let loss = micro_step(i)?;
            let before = Instant::now();
            acc.backward(&loss)?;
            let ms = before.elapsed().as_secs_f64() * 1e3;
            if acc.sync_gradients() {
                sync_ms = ms;
            } else {
                others.push(ms);
            }
            opt.step()?;
            opt.zero_grad();
        }
        if !acc.sync_gradients() {
            bail!("the window of {k} micro-steps did not end on a sync micro-step");
        }
        if acc.optimizer_steps() > 2 {
            self.step_ms.push(start.elapsed().as_secs_f64() * 1e3);
            self.sync_backward_ms.push(sync_ms);
            self.other_backward_ms
                .push(others.iter().sum::<f64>() / others.len().max(1) as f64);
        }
        Ok(())
    }

    fn report(&self, acc: &Accelerator) {
        acc.print(format!(
            "step_ms={:.3} sync_backward_ms={:.3} other_backward_ms={:.3} buckets={} overlap={}",
            median(&self.step_ms),
            median(&self.sync_backward_ms),
            median(&self.other_backward_ms),
            acc.model().gradient_buckets(),
            u8::from(acc.overlaps_gradient_reduction())
        ));
    }
}

/// One rank: `steps + 2` optimizer steps of K micro-steps; rank 0 prints the medians.
fn worker(args: &Args) -> Result<()> {
    let k = args.grad_accum;
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(k)
        .build()?;
    let world = acc.num_processes();
    let b = args.batch_size();
    let windows = (args.steps + 2) * k * b * world;
    let mut times = StepTimes::default();
    match args.workload {
        Workload::Mlp => {
            let (x, y) = mlp::synthetic_data(windows, 0)?;
            let dataset = Arc::new(TensorDataset::new(x, y)?);
            let (varmap, model) = mlp::build(args.hidden, 0, acc.device())?;
            let params = acc.prepare(&varmap)?;
            let mut opt = acc.prepare(AdamW::new(params, AdamWConfig::default())?)?;
            let mut loader = acc.prepare(DataLoader::new(dataset, b).prefetch(2))?;
            let mut batches = loader.iter();
            for _ in 0..args.steps + 2 {
                times.record(&acc, &mut opt, k, |_| {
                    let (x, y) = batches.next().context("the loader ran out")??;
                    let _step = acc.accumulate();
                    Ok(candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?)
                })?;
            }
        }
        Workload::Gpt => {
            let vocab = CharVocab::from_text(gpt::DEFAULT_TEXT);
            let text = vocab
                .encode(gpt::DEFAULT_TEXT)
                .expect("the vocabulary holds every character");
            let stride = (args.context / 2).max(1);
            let needed = (windows - 1) * stride + args.context + 1;
            let tokens: Vec<u32> = text.iter().copied().cycle().take(needed).collect();
            let dataset = Arc::new(TextWindows::new(
                tokens,
                args.context,
                args.context,
                stride,
                0,
            )?);
            let config = GptConfig {
                vocab: vocab.len(),
                context: args.context,
                width: args.width,
                heads: 4,
                layers: args.layers,
            };
            let (varmap, model) = gpt::build_in(config, 0, acc.device(), DType::F32)?;
            let params = acc.prepare(&varmap)?;
            let mut opt = acc.prepare(AdamW::new(params, AdamWConfig::default())?)?;
            let mut loader = acc.prepare(DataLoader::new(dataset, b).prefetch(2))?;
            let mut batches = loader.iter();
            for _ in 0..args.steps + 2 {
                times.record(&acc, &mut opt, k, |_| {
                    let batch = batches.next().context("the loader ran out")??;
                    let _step = acc.accumulate();
                    // Full-length windows: the mean token loss, as K equal micro-batches.
                    let loss =
                        model.summed_loss(&batch.inputs, &batch.targets, &batch.mask, None)?;
                    Ok((loss / batch.tokens as f64)?)
                })?;
            }
        }
    }
    times.report(&acc);
    Ok(())
}
