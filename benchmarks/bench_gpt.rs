//! Benchmarks of the `gpt` workload, one process, CPU:
//!
//! - **memory**: what gradient accumulation trades. Batch B with K = 1 against batch B/4 with
//!   K = 4 (the same windows per optimizer step): peak resident memory and samples/s. Each
//!   configuration runs in a child process of this benchmark (re-executed with a hidden flag),
//!   which reports its `VmHWM` (peak resident set) from `/proc/self/status` after its last step,
//!   and after its setup (model, gradient buffers, data) for comparison.
//! - **checkpointing**: what activation checkpointing trades. Batch B, K = 1, with every block
//!   under `fused_kernels::checkpoint` against without: peak resident memory and ms/step, each
//!   configuration in a child process as for `memory`, rounds interleaved, medians reported.
//! - **overhead**: the cost of the runtime itself. The Accelerator loop at world size 1 against a
//!   plain candle loop doing the same arithmetic: the same model, the same summed token loss
//!   divided by the batch's tokens, the gradients added into the same gradient buffers, the same
//!   AdamW. The two run in interleaved rounds so that machine noise hits both alike; the median
//!   round is reported.
//!
//! Windows all have the full context length here, so the configurations compute on the same
//! tokens (with varying lengths, smaller batches would pad less and do less work).
//!
//! `cargo run --release --bin bench_gpt -- --part memory` (see BENCHMARKS.md; `--part
//! checkpointing --batch-size 16` for the checkpointing figures).

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accelerate_benchmarks::{median, peak_resident_kib, report_value, run_within, Overhead};
use accelerate_core::data::{DataLoader, Dataset};
use accelerate_core::optim::{AdamW, AdamWConfig, Optimizer};
use accelerate_core::GradientBuffers;
use accelerate_core::{Accelerator, ProcessState};
use accelerate_examples::gpt::{self, CharVocab, GptConfig, TextWindows};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Var};
use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Part {
    Memory,
    Overhead,
    Checkpointing,
    All,
}

/// Benchmark the gpt training step: accumulation's and activation checkpointing's
/// memory/throughput trade-offs, and the runtime's overhead over a plain candle loop.
#[derive(Debug, Parser)]
struct Args {
    /// Which benchmark to run.
    #[arg(long, value_enum, default_value_t = Part::All)]
    part: Part,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Embedding width.
    #[arg(long, default_value_t = 256)]
    width: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Window length (every window has it).
    #[arg(long, default_value_t = 256)]
    context: usize,
    /// Windows per optimizer step (B; the K = 4 configuration takes B/4 per micro-batch).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Optimizer steps measured per configuration per round, after 2 warm-up steps.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Rounds (each runs every configuration once).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Prefetch depth of the Accelerator loop's data loader.
    #[arg(long, default_value_t = 2)]
    prefetch: usize,
    /// Seconds a child process may run before it is killed and the benchmark fails.
    #[arg(long, default_value_t = 3600)]
    child_timeout: u64,
    /// Internal: run one memory configuration with this K and report (used by the parent).
    #[arg(long, hide = true)]
    child_k: Option<usize>,
    /// Internal: the child runs its blocks under activation checkpointing.
    #[arg(long, hide = true)]
    child_checkpointing: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !args.batch_size.is_multiple_of(4) || args.batch_size == 0 {
        bail!(
            "--batch-size {} must be a positive multiple of 4 (the K = 4 configuration takes \
             batch / 4 per micro-batch)",
            args.batch_size
        );
    }
    if args.steps == 0 || args.rounds == 0 {
        bail!("--steps and --rounds must be at least 1");
    }
    if args.heads == 0 || !args.width.is_multiple_of(args.heads) {
        bail!(
            "--width {} is not divisible by --heads {}",
            args.width,
            args.heads
        );
    }
    // Every configuration runs with the same allocator settings (the Accelerator applies them
    // when it is built; the plain loop must not be measured with glibc's defaults instead).
    accelerate_core::keep_freed_memory();
    if let Some(k) = args.child_k {
        return child(&args, k, args.child_checkpointing);
    }
    let (dataset, vocab) = fixed_windows(&args)?;
    let config = model_config(&args, vocab);
    println!(
        "gpt: {} layers, width {}, {} heads, context {} (every window full), vocabulary {}, {} \
         windows per optimizer step, {} steps x {} rounds, {} threads",
        args.layers,
        args.width,
        args.heads,
        args.context,
        config.vocab,
        args.batch_size,
        args.steps,
        args.rounds,
        candle_core::utils::get_num_threads()
    );
    if matches!(args.part, Part::Memory | Part::All) {
        memory(&args)?;
    }
    if matches!(args.part, Part::Checkpointing | Part::All) {
        checkpointing(&args)?;
    }
    if matches!(args.part, Part::Overhead | Part::All) {
        overhead(&args, &dataset, config)?;
    }
    Ok(())
}

fn model_config(args: &Args, vocab: usize) -> GptConfig {
    GptConfig {
        vocab,
        context: args.context,
        width: args.width,
        heads: args.heads,
        layers: args.layers,
    }
}

/// Full-length windows of the built-in text for `steps + 2` optimizer steps (the text is
/// repeated when it is too short), and the vocabulary size.
fn fixed_windows(args: &Args) -> Result<(Arc<TextWindows>, usize)> {
    let vocab = CharVocab::from_text(gpt::DEFAULT_TEXT);
    let text = vocab
        .encode(gpt::DEFAULT_TEXT)
        .expect("the vocabulary holds every character");
    let windows = (args.steps + 2) * args.batch_size;
    let stride = (args.context / 2).max(1);
    let needed = (windows - 1) * stride + args.context + 1;
    let tokens: Vec<u32> = text.iter().copied().cycle().take(needed).collect();
    let dataset = TextWindows::new(tokens, args.context, args.context, stride, 0)?;
    assert_eq!(dataset.len(), windows);
    Ok((Arc::new(dataset), vocab.len()))
}

/// One child's report.
#[derive(Debug, Clone, Copy)]
struct ChildReport {
    ms_per_step: f64,
    setup_kib: f64,
    peak_kib: f64,
}

/// The memory part: each configuration in a child process, rounds interleaved.
fn memory(args: &Args) -> Result<()> {
    let ks = [1usize, 4];
    let mut reports: Vec<Vec<ChildReport>> = vec![Vec::new(); ks.len()];
    for round in 0..args.rounds {
        for (i, &k) in ks.iter().enumerate() {
            reports[i].push(run_child(args, k, false)?);
        }
        eprintln!("memory: round {} of {} done", round + 1, args.rounds);
    }
    println!();
    println!(
        "{:<34} {:>10} {:>10} {:>13} {:>14}",
        "configuration", "ms/step", "samples/s", "peak RSS MiB", "after setup MiB"
    );
    let mib = |kib: f64| kib / 1024.0;
    let mut rows = Vec::new();
    for (&k, r) in ks.iter().zip(&reports) {
        let ms = median(&r.iter().map(|x| x.ms_per_step).collect::<Vec<_>>());
        let peak = median(&r.iter().map(|x| x.peak_kib).collect::<Vec<_>>());
        let setup = median(&r.iter().map(|x| x.setup_kib).collect::<Vec<_>>());
        println!(
            "{:<34} {ms:>10.1} {:>10.2} {:>13.0} {:>14.0}",
            format!("batch {} x K={k}", args.batch_size / k),
            args.batch_size as f64 / ms * 1e3,
            mib(peak),
            mib(setup)
        );
        rows.push((ms, peak, setup));
    }
    let (ms1, peak1, setup1) = rows[0];
    let (ms4, peak4, _) = rows[1];
    println!(
        "K=4 vs K=1: peak memory {:+.1} % ({:.0} of the {:.0} MiB above setup saved), throughput \
         {:+.1} %",
        (peak4 / peak1 - 1.0) * 100.0,
        mib(peak1 - peak4),
        mib(peak1 - setup1),
        (ms1 / ms4 - 1.0) * 100.0
    );
    Ok(())
}

/// The checkpointing part: batch B at K = 1 without and with activation checkpointing, each in a
/// child process, rounds interleaved (the order alternates), medians reported.
fn checkpointing(args: &Args) -> Result<()> {
    let mut reports: [Vec<ChildReport>; 2] = [Vec::new(), Vec::new()];
    for round in 0..args.rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            reports[i].push(run_child(args, 1, i == 1)?);
        }
        let (without, with) = (reports[0][round], reports[1][round]);
        eprintln!(
            "checkpointing: round {} of {}: without {:.0} ms/step, {:.0} MiB; with {:.0} ms/step, \
             {:.0} MiB",
            round + 1,
            args.rounds,
            without.ms_per_step,
            without.peak_kib / 1024.0,
            with.ms_per_step,
            with.peak_kib / 1024.0
        );
    }
    println!();
    println!(
        "{:<34} {:>10} {:>10} {:>13} {:>14}",
        "configuration", "ms/step", "samples/s", "peak RSS MiB", "after setup MiB"
    );
    let mib = |kib: f64| kib / 1024.0;
    let mut rows = Vec::new();
    for (name, r) in ["without checkpointing", "with checkpointing"]
        .iter()
        .zip(&reports)
    {
        let ms = median(&r.iter().map(|x| x.ms_per_step).collect::<Vec<_>>());
        let peak = median(&r.iter().map(|x| x.peak_kib).collect::<Vec<_>>());
        let setup = median(&r.iter().map(|x| x.setup_kib).collect::<Vec<_>>());
        println!(
            "{:<34} {ms:>10.1} {:>10.2} {:>13.0} {:>14.0}",
            format!("batch {}, {name}", args.batch_size),
            args.batch_size as f64 / ms * 1e3,
            mib(peak),
            mib(setup)
        );
        rows.push((ms, peak));
    }
    let ratios = |f: fn(&ChildReport) -> f64| {
        let v: Vec<f64> = reports[1]
            .iter()
            .zip(&reports[0])
            .map(|(with, without)| f(with) / f(without) - 1.0)
            .collect();
        median(&v) * 100.0
    };
    let ((ms0, peak0), (ms1, peak1)) = (rows[0], rows[1]);
    println!(
        "with vs without: peak memory {:+.1} % ({:.0} MiB saved), time per step {:+.1} % \
         (per-round ratios, median: memory {:+.1} %, time {:+.1} %)",
        (peak1 / peak0 - 1.0) * 100.0,
        mib(peak0 - peak1),
        (ms1 / ms0 - 1.0) * 100.0,
        ratios(|r| r.peak_kib),
        ratios(|r| r.ms_per_step)
    );
    Ok(())
}

/// Re-executes this benchmark with `--child-k k` (and `--child-checkpointing`) and reads its
/// report.
fn run_child(args: &Args, k: usize, checkpointing: bool) -> Result<ChildReport> {
    let exe = std::env::current_exe().context("locating the benchmark's own executable")?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "--layers",
        &args.layers.to_string(),
        "--width",
        &args.width.to_string(),
        "--heads",
        &args.heads.to_string(),
        "--context",
        &args.context.to_string(),
        "--batch-size",
        &args.batch_size.to_string(),
        "--steps",
        &args.steps.to_string(),
        "--prefetch",
        &args.prefetch.to_string(),
        "--child-k",
        &k.to_string(),
    ]);
    if checkpointing {
        cmd.arg("--child-checkpointing");
    }
    let Some((status, out)) = run_within(&mut cmd, Duration::from_secs(args.child_timeout))? else {
        bail!(
            "the K={k} configuration ran longer than --child-timeout {} s; lower --steps or \
             the model size",
            args.child_timeout
        );
    };
    if !status.success() {
        bail!("the K={k} configuration failed ({status}):\n{out}");
    }
    let what = format!("the K={k} child");
    let value = |key: &str| report_value(&out, key, &what);
    Ok(ChildReport {
        ms_per_step: value("ms_per_step")?,
        setup_kib: value("setup_hwm_kib")?,
        peak_kib: value("peak_hwm_kib")?,
    })
}

/// A child: the Accelerator loop with K micro-batches of B/K, the blocks under activation
/// checkpointing if asked; prints its report on stdout.
fn child(args: &Args, k: usize, checkpointing: bool) -> Result<()> {
    let (dataset, vocab) = fixed_windows(args)?;
    let config = model_config(args, vocab);
    let ms = accelerated(args, &dataset, config, k, checkpointing, |_| {
        println!("setup_hwm_kib={}", peak_resident_kib()?);
        Ok(())
    })?;
    println!(
        "k={k} ms_per_step={ms} peak_hwm_kib={}",
        peak_resident_kib()?
    );
    Ok(())
}

/// Milliseconds per optimizer step of the Accelerator loop, K micro-batches of B/K, item-weighted
/// (the example's loop), the blocks under activation checkpointing if `checkpointing`;
/// `after_setup` runs once everything is built, before the first step.
fn accelerated(
    args: &Args,
    dataset: &Arc<TextWindows>,
    config: GptConfig,
    k: usize,
    checkpointing: bool,
    after_setup: impl FnOnce(&Accelerator) -> Result<()>,
) -> Result<f64> {
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(k)
        .process_state(ProcessState::single())
        .build()?;
    let (varmap, mut model) = gpt::build_in(config, 0, acc.device(), DType::F32)?;
    model.set_gradient_checkpointing(checkpointing);
    let params = acc.prepare(&varmap)?;
    let mut opt = acc.prepare(AdamW::new(params, adamw())?)?;
    let loader = DataLoader::new(dataset.clone(), args.batch_size / k).prefetch(args.prefetch);
    let mut loader = acc.prepare(loader)?;
    after_setup(&acc)?;
    let mut start = Instant::now();
    for window in loader.windows(k) {
        let window = window?;
        acc.set_window_items(window.iter().map(|b| b.tokens).sum())?;
        for batch in window {
            let _step = acc.accumulate();
            let logits = model.forward(&batch.inputs)?;
            let loss = gpt::summed_token_loss(&logits, &batch.targets, &batch.mask)?;
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
        }
        if acc.optimizer_steps() == 2 {
            // Two warm-up steps, as for the plain loop.
            start = Instant::now();
        }
    }
    let measured = acc.optimizer_steps() - 2;
    Ok(start.elapsed().as_secs_f64() * 1e3 / measured as f64)
}

fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-3,
        ..AdamWConfig::default()
    }
}

/// Milliseconds per optimizer step of a plain candle loop doing the Accelerator loop's arithmetic
/// at K = 1 without the runtime: batches built inline from the same dataset, the summed loss's
/// gradients added into gradient buffers scaled by 1/tokens, our AdamW.
fn plain(args: &Args, dataset: &TextWindows, config: GptConfig) -> Result<f64> {
    let (varmap, model) = gpt::build_in(config, 0, &Device::Cpu, DType::F32)?;
    let mut params: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    let mut opt = AdamW::new(params.clone(), adamw())?;
    // Allocated once, like the Accelerator's buckets.
    let mut buffers = GradientBuffers::new(&params, usize::MAX)?;
    let b = args.batch_size;
    let mut step = |i: usize| -> Result<()> {
        let batch = dataset.get_batch(&(i * b..(i + 1) * b).collect::<Vec<_>>())?;
        let logits = model.forward(&batch.inputs)?;
        let loss = gpt::summed_token_loss(&logits, &batch.targets, &batch.mask)?;
        let grads = loss.backward()?;
        buffers.zero();
        for (name, var) in &params {
            let g = grads
                .get(var.as_tensor())
                .expect("every parameter has a gradient");
            buffers.accumulate_one(name, g, 1.0 / batch.tokens as f64)?;
        }
        opt.step(buffers.gradients())?;
        Ok(())
    };
    step(0)?;
    step(1)?;
    let start = Instant::now();
    for i in 2..args.steps + 2 {
        step(i)?;
    }
    Ok(start.elapsed().as_secs_f64() * 1e3 / args.steps as f64)
}

/// The overhead part: plain loop vs Accelerator loop at K = 1, rounds interleaved, in this process.
fn overhead(args: &Args, dataset: &Arc<TextWindows>, config: GptConfig) -> Result<()> {
    let mut plain_ms = Vec::new();
    let mut acc_ms = Vec::new();
    for round in 0..args.rounds {
        // Every other round the other one goes first, so that neither always follows the other.
        if round % 2 == 0 {
            plain_ms.push(plain(args, dataset, config)?);
            acc_ms.push(accelerated(args, dataset, config, 1, false, |_| Ok(()))?);
        } else {
            acc_ms.push(accelerated(args, dataset, config, 1, false, |_| Ok(()))?);
            plain_ms.push(plain(args, dataset, config)?);
        }
        eprintln!("overhead: round {} of {} done", round + 1, args.rounds);
    }
    let (p, a) = (median(&plain_ms), median(&acc_ms));
    println!();
    println!(
        "{:<52} {:>10} {:>10} {:>10}",
        "configuration (K=1)", "ms/step", "samples/s", "tokens/s"
    );
    let tokens = (args.batch_size * args.context) as f64;
    for (name, ms) in [
        ("plain candle loop, our AdamW, same arithmetic", p),
        ("Accelerator loop, world size 1", a),
    ] {
        println!(
            "{name:<52} {ms:>10.2} {:>10.1} {:>10.0}",
            args.batch_size as f64 / ms * 1e3,
            tokens / ms * 1e3
        );
    }
    println!(
        "Accelerator vs plain, time per step: {}",
        Overhead::new(&acc_ms, &plain_ms)
    );
    Ok(())
}
