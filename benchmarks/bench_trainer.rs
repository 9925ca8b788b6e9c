//! The article's table, reproduced: the Trainer on the `gpt` workload at batch 4 and at batch 1 ×
//! gradient accumulation 4 (the same 4 windows per optimizer step), peak memory and samples/s
//! side by side, next to the article's figures for Hugging Face's Trainer on a GPU.
//!
//! Each configuration runs in a child process of this benchmark (re-executed with hidden flags),
//! which reports its `VmHWM` (peak resident set, from `/proc/self/status`) after training and
//! its samples per second as Hugging Face's `train_samples_per_second` counts them: the samples of
//! every optimizer step over the wall time of `Trainer::train`. Rounds interleave the two
//! configurations so machine noise hits both alike; medians are reported.
//!
//! `cargo run --release --bin bench_trainer` (see BENCHMARKS.md).

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accelerate_benchmarks::{median, peak_resident_kib, report_value, run_within};
use accelerate_core::data::Dataset;
use accelerate_examples::gpt::{self, CharVocab, Gpt, GptConfig, TextWindows, TokenBatch};
use accelerate_trainer::{
    ModelOutput, ReportTo, SaveStrategy, Trainer, TrainerModel, TrainingArguments,
};
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use clap::Parser;

/// The article's figures: Hugging Face's Trainer on one GPU, batch 4 against batch 1 ×
/// accumulation 4 (GPU memory in MB, samples/s).
const ARTICLE: [(&str, f64, f64); 2] =
    [("batch 4", 14_949.0, 8.86), ("batch 1 x 4", 8_681.0, 7.75)];

/// Benchmark the Trainer at batch 4 against batch 1 × gradient accumulation 4.
#[derive(Debug, Parser)]
struct Args {
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
    /// Optimizer steps per configuration per round (4 windows each).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Rounds (each runs both configurations once).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Seconds a child process may run before it is killed and the benchmark fails.
    #[arg(long, default_value_t = 3600)]
    child_timeout: u64,
    /// Internal: run one configuration with this per-device batch size (used by the parent).
    #[arg(long, hide = true)]
    child_batch: Option<usize>,
}

/// The windows per optimizer step of both configurations.
const SAMPLES_PER_STEP: usize = 4;

fn main() -> Result<()> {
    let args = Args::parse();
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
    if let Some(batch) = args.child_batch {
        return child(&args, batch);
    }
    println!(
        "Trainer on gpt: {} layers, width {}, {} heads, context {} (every window full), {} \
         optimizer steps of {SAMPLES_PER_STEP} windows, {} rounds (medians), {} threads",
        args.layers,
        args.width,
        args.heads,
        args.context,
        args.steps,
        args.rounds,
        candle_core::utils::get_num_threads()
    );
    let batches = [SAMPLES_PER_STEP, 1];
    let mut reports: Vec<Vec<(f64, f64)>> = vec![Vec::new(); batches.len()];
    for round in 0..args.rounds {
        for (i, &batch) in batches.iter().enumerate() {
            reports[i].push(run_child(&args, batch)?);
        }
        eprintln!("round {} of {} done", round + 1, args.rounds);
    }
    println!();
    println!(
        "{:<16} {:>14} {:>11}   {:>24} {:>11}",
        "configuration", "peak RSS MiB", "samples/s", "article: GPU memory MB", "samples/s"
    );
    let mut rows = Vec::new();
    for ((batch, r), (name, article_mb, article_rate)) in batches.iter().zip(&reports).zip(ARTICLE)
    {
        let peak = median(&r.iter().map(|x| x.0).collect::<Vec<_>>()) / 1024.0;
        let rate = median(&r.iter().map(|x| x.1).collect::<Vec<_>>());
        let k = SAMPLES_PER_STEP / batch;
        let ours = if k == 1 {
            format!("batch {batch}")
        } else {
            format!("batch {batch} x {k}")
        };
        assert_eq!(ours, name, "the article's rows are in this order");
        println!("{ours:<16} {peak:>14.0} {rate:>11.2}   {article_mb:>24.0} {article_rate:>11.2}");
        rows.push((peak, rate));
    }
    let (peak4, rate4) = rows[0];
    let (peak1, rate1) = rows[1];
    let (_, mb4, r4) = ARTICLE[0];
    let (_, mb1, r1) = ARTICLE[1];
    println!(
        "batch 1 x 4 against batch 4: memory {:.2}x (article {:.2}x), samples/s {:.2}x (article \
         {:.2}x)",
        peak1 / peak4,
        mb1 / mb4,
        rate1 / rate4,
        r1 / r4
    );
    Ok(())
}

/// Re-executes this benchmark for one configuration; returns (peak KiB, samples/s).
fn run_child(args: &Args, batch: usize) -> Result<(f64, f64)> {
    let exe = std::env::current_exe().context("locating the benchmark's own executable")?;
    let mut cmd = Command::new(exe);
    for (flag, value) in [
        ("--layers", args.layers),
        ("--width", args.width),
        ("--heads", args.heads),
        ("--context", args.context),
        ("--steps", args.steps),
        ("--child-batch", batch),
    ] {
        cmd.args([flag.to_string(), value.to_string()]);
    }
    let Some((status, out)) = run_within(&mut cmd, Duration::from_secs(args.child_timeout))? else {
        bail!(
            "batch {batch} ran longer than --child-timeout {} s; lower --steps or the model size",
            args.child_timeout
        );
    };
    if !status.success() {
        bail!("batch {batch} failed ({status}):\n{out}");
    }
    let what = format!("the batch {batch} child");
    Ok((
        report_value(&out, "peak_hwm_kib", &what)?,
        report_value(&out, "samples_per_second", &what)?,
    ))
}

/// The gpt model as the Trainer sees it: per-window summed token losses, weighted by tokens.
struct TokenModel(Gpt);

impl TrainerModel<TokenBatch> for TokenModel {
    fn forward(&self, batch: &TokenBatch) -> candle_core::Result<ModelOutput> {
        let logits = self.0.forward(&batch.inputs)?;
        let rows = (0..logits.dim(0)?)
            .map(|i| {
                gpt::summed_token_loss(
                    &logits.narrow(0, i, 1)?,
                    &batch.targets.narrow(0, i, 1)?,
                    &batch.mask.narrow(0, i, 1)?,
                )
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut out = ModelOutput::losses(Tensor::stack(&rows, 0)?);
        out.items = Some(batch.mask.sum(1)?);
        Ok(out)
    }

    fn num_items(&self, batch: &TokenBatch) -> candle_core::Result<Option<usize>> {
        Ok(Some(batch.tokens))
    }
}

/// One configuration: the Trainer with `batch` windows per micro-batch and 4 / `batch`
/// micro-batches per optimizer step; prints its report on stdout.
fn child(args: &Args, batch: usize) -> Result<()> {
    let vocab = CharVocab::from_text(gpt::DEFAULT_TEXT);
    let text = vocab
        .encode(gpt::DEFAULT_TEXT)
        .expect("the vocabulary holds every character");
    let windows = args.steps * SAMPLES_PER_STEP;
    let stride = (args.context / 2).max(1);
    let needed = (windows - 1) * stride + args.context + 1;
    let tokens: Vec<u32> = text.iter().copied().cycle().take(needed).collect();
    let dataset = TextWindows::new(tokens, args.context, args.context, stride, 0)?;
    assert_eq!(dataset.len(), windows);
    let output = tempfile_dir()?;
    let training = TrainingArguments {
        output_dir: output.clone(),
        per_device_train_batch_size: batch,
        gradient_accumulation_steps: SAMPLES_PER_STEP / batch,
        learning_rate: 3e-4,
        max_steps: Some(args.steps as u64),
        save_strategy: SaveStrategy::No,
        report_to: ReportTo(Vec::new()),
        logging_steps: args.steps as u64,
        disable_tqdm: true,
        ..TrainingArguments::default()
    };
    let mut trainer = Trainer::new(training)?;
    if !trainer.device().is_cpu() {
        bail!(
            "bench_trainer measures host memory (peak RSS), which says nothing of a GPU's; run \
             the CPU build (without --features cuda)"
        );
    }
    let config = GptConfig {
        vocab: vocab.len(),
        context: args.context,
        width: args.width,
        heads: args.heads,
        layers: args.layers,
    };
    let (varmap, model) = gpt::build_in(config, 0, trainer.device(), trainer.compute_dtype())?;
    let start = Instant::now();
    let out = trainer.train(&TokenModel(model), &varmap, Arc::new(dataset), None)?;
    let wall = start.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&output);
    if out.global_step != args.steps as u64 {
        bail!("trained {} steps, not {}", out.global_step, args.steps);
    }
    println!(
        "batch={batch} samples_per_second={} peak_hwm_kib={} train_loss={}",
        (args.steps * SAMPLES_PER_STEP) as f64 / wall,
        peak_resident_kib()?,
        out.training_loss
    );
    Ok(())
}

/// A fresh output directory for one child under the system's temporary directory.
fn tempfile_dir() -> Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("bench_trainer_{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
