//! Trains the `gpt` workload, a small decoder-only transformer, as a character-level language model
//! with the accelerate-rs runtime.
//!
//! Alone: `cargo run --release --example gpt`.
//! On two CPU processes: `accelerate-launch --cpu --num-processes 2 target/release/examples/gpt`.
//!
//! Windows of the text have varying lengths, so accumulation is item-weighted: before each
//! accumulation window the loop tells the accelerator how many real tokens this rank's part of the
//! window holds, and passes `backward` the *sum* of token cross-entropies; the gradient is then
//! that of one batch holding the whole window on all ranks, averaged per token.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use accelerate_core::data::{DataLoader, Dataset};
use accelerate_core::optim::{AdamW, AdamWConfig, LrScheduler, Schedule};
use accelerate_core::{Accelerator, MixedPrecision, ReduceOp};
use accelerate_examples::gpt::{self, CharVocab, GptConfig, TextWindows};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ScheduleKind {
    Constant,
    Linear,
    Cosine,
}

/// Train a small GPT on a text, one character per token (Shakespeare's sonnets unless --text).
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// UTF-8 text file to train on (default: the built-in sonnets).
    #[arg(long, value_name = "FILE")]
    text: Option<PathBuf>,
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Embedding width; must be divisible by --heads.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Longest window, in characters; windows are drawn between context/2 and context long.
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Windows per micro-batch on each rank.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Micro-batches per optimizer step (default: $ACCELERATE_GRADIENT_ACCUMULATION_STEPS, else 1).
    #[arg(long)]
    grad_accum: Option<usize>,
    /// Passes over the windows (each pass covers the text about twice).
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// Stop after this many optimizer steps (default: run all epochs).
    #[arg(long)]
    max_steps: Option<u64>,
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Learning-rate schedule, counted in optimizer steps.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Constant)]
    schedule: ScheduleKind,
    /// Warmup steps of the schedule.
    #[arg(long, default_value_t = 0)]
    warmup_steps: usize,
    /// Clip the gradient's global L2 norm to this value.
    #[arg(long)]
    max_grad_norm: Option<f64>,
    /// Seed of the window lengths, the shuffle and the initial weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep the windows in text order (no per-epoch shuffle).
    #[arg(long)]
    no_shuffle: bool,
    /// Write the trained weights here (safetensors, GPT-2 names, nn.Linear layouts).
    #[arg(long)]
    save_model: Option<PathBuf>,
    /// Save the training state every N optimizer steps, as CHECKPOINT_DIR/checkpoint_<step>.
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Where checkpoints go (and where --resume looks).
    #[arg(long, default_value = "checkpoints")]
    checkpoint_dir: PathBuf,
    /// Keep only the newest N checkpoints.
    #[arg(long)]
    checkpoints_keep: Option<usize>,
    /// Continue from the latest checkpoint in --checkpoint-dir (from the start if there is none
    /// yet, so a restarted job can always pass it).
    #[arg(long)]
    resume: bool,
    /// Write one JSON line per optimizer step here: step, loss per token of the global batch, lr,
    /// samples/s, tokens/s.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Forward and backward in no|bf16|fp16 with f32 master weights (default:
    /// $ACCELERATE_MIXED_PRECISION, which `accelerate-launch --mixed-precision` sets, else no).
    #[arg(long, value_name = "MODE")]
    mixed_precision: Option<MixedPrecision>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
    Ok(())
}

/// The training text: the --text file, read as UTF-8, or the built-in one.
fn load_text(path: Option<&Path>) -> Result<String> {
    let Some(path) = path else {
        return Ok(gpt::DEFAULT_TEXT.to_string());
    };
    let bytes = std::fs::read(path).with_context(|| format!("--text {}", path.display()))?;
    if bytes.is_empty() {
        bail!(
            "--text {}: the file is empty; give a UTF-8 text of at least --context + 1 characters",
            path.display()
        );
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "--text {} is not UTF-8 text (invalid byte at offset {}); convert it first, e.g. \
             with `iconv -t UTF-8`",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// Checks the flags that need no data; every message names the flag and what would be valid.
fn check_flags(args: &Args) -> Result<()> {
    let positive = [
        ("--batch-size", args.batch_size),
        ("--layers", args.layers),
        ("--width", args.width),
        ("--heads", args.heads),
        ("--context", args.context),
    ];
    for (flag, value) in positive {
        if value == 0 {
            bail!("{flag} must be at least 1");
        }
    }
    if !args.width.is_multiple_of(args.heads) {
        bail!(
            "--width {} is not divisible by --heads {}: every head takes width / heads dimensions \
             (e.g. --width {} --heads {})",
            args.width,
            args.heads,
            args.width.div_ceil(args.heads) * args.heads,
            args.heads
        );
    }
    if args.checkpoint_every == Some(0) {
        bail!("--checkpoint-every must be at least 1 (optimizer steps between checkpoints)");
    }
    if args.checkpoints_keep == Some(0) {
        bail!("--checkpoints-keep must be at least 1 (0 would delete the newest checkpoint)");
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        bail!("--lr must be a positive number, got {}", args.lr);
    }
    Ok(())
}

fn run(args: &Args) -> Result<()> {
    check_flags(args)?;
    let text = load_text(args.text.as_deref())?;
    let source = args
        .text
        .as_ref()
        .map_or("built-in sonnets".to_string(), |p| p.display().to_string());
    let chars = text.chars().count();
    if chars < args.context + 1 {
        bail!(
            "--context {} is larger than the text: {source} holds {chars} characters and a \
             training window needs --context + 1 = {}; lower --context or give a longer --text",
            args.context,
            args.context + 1
        );
    }
    let vocab = CharVocab::from_text(&text);
    let tokens = vocab
        .encode(&text)
        .expect("the vocabulary holds every character");
    let entropy = gpt::unigram_entropy(&tokens);
    let dataset = TextWindows::tiled(tokens, args.context, args.seed)?;

    let mut builder = Accelerator::builder().seed(args.seed);
    if let Some(k) = args.grad_accum {
        builder = builder.gradient_accumulation_steps(k);
    }
    if let Some(mode) = args.mixed_precision {
        builder = builder.mixed_precision(mode);
    }
    let mut acc = builder.build()?;
    let device = acc.device().clone();

    let config = GptConfig {
        vocab: vocab.len(),
        context: args.context,
        width: args.width,
        heads: args.heads,
        layers: args.layers,
    };
    // In the compute dtype (bf16/f16 under mixed precision); `prepare` returns the f32 masters.
    let (varmap, model) = gpt::build_in(config, args.seed, &device, acc.compute_dtype())?;
    let params = acc.prepare(&varmap)?;
    let parameter_count: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
    acc.print(format!(
        "data: {source}, {chars} characters, vocabulary {}, unigram entropy {entropy:.4} nats per \
         character (the loss of a model that ignores context); {} windows of {}..={} characters",
        vocab.len(),
        dataset.len(),
        args.context.div_ceil(2),
        args.context
    ));
    acc.print(format!(
        "model: {} layers, width {}, {} heads, context {}, {parameter_count} parameters",
        args.layers, args.width, args.heads, args.context
    ));

    let loader = DataLoader::new(Arc::new(dataset), args.batch_size)
        .shuffle(!args.no_shuffle)
        .seed(args.seed);
    let mut loader = acc.prepare(loader)?;

    let total_steps = {
        let per_run = acc.num_update_steps(loader.len()) as u64 * args.epochs as u64;
        args.max_steps.map_or(per_run, |m| m.min(per_run))
    };
    let schedule = match args.schedule {
        ScheduleKind::Constant if args.warmup_steps == 0 => Schedule::Constant,
        ScheduleKind::Constant => Schedule::ConstantWithWarmup {
            warmup_steps: args.warmup_steps,
        },
        ScheduleKind::Linear => Schedule::LinearWarmupDecay {
            warmup_steps: args.warmup_steps,
            total_steps: total_steps as usize,
        },
        ScheduleKind::Cosine => Schedule::CosineWithWarmup {
            warmup_steps: args.warmup_steps,
            total_steps: total_steps as usize,
        },
    };
    let opt = AdamW::new(
        params,
        AdamWConfig {
            lr: args.lr,
            weight_decay: args.weight_decay,
            ..AdamWConfig::default()
        },
    )?;
    let mut opt = acc.prepare(opt)?;
    let mut sched = acc.prepare(LrScheduler::new(opt.learning_rate_handle(), schedule)?)?;
    if args.resume {
        let root = &args.checkpoint_dir;
        if accelerate_core::checkpoint::latest_checkpoint(root)?.is_some() {
            let dir = acc
                .load_state(root)
                .with_context(|| format!("--resume from {}", root.display()))?;
            acc.print(format!(
                "resumed from {} at optimizer step {} (epoch {})",
                dir.display(),
                acc.optimizer_steps(),
                loader.next_epoch()
            ));
        } else {
            acc.print(format!(
                "--resume: no checkpoint in {} yet; starting from the beginning",
                root.display()
            ));
        }
    }
    let mut metrics = match &args.metrics {
        Some(p) if acc.is_main_process() => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("--metrics {}", p.display()))?,
        )),
        _ => None,
    };
    let k = acc.gradient_accumulation_steps();
    let progress = (acc.is_main_process() && std::io::stderr().is_terminal()).then(|| {
        let bar = indicatif::ProgressBar::new(total_steps);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise}<{eta_precise}]",
            )
            .expect("static template"),
        );
        bar
    });
    acc.print(format!(
        "training: {} process(es), batch {} x {k} micro-steps per rank, {total_steps} optimizer \
         steps, on {:?}",
        acc.num_processes(),
        args.batch_size,
        acc.device().location()
    ));

    let start = Instant::now();
    let mut window_start = Instant::now();
    let mut totals = Totals::default();
    let mut last_loss = f64::NAN;
    let mut micro_steps = 0u64;
    let mut skipped_steps = 0u64;
    'epochs: for _epoch in loader.next_epoch()..args.epochs as u64 {
        if args.max_steps.is_some_and(|m| acc.optimizer_steps() >= m) {
            break;
        }
        for window in loader.windows(k) {
            let window = window?;
            // This rank's real tokens in the whole window, before its first backward pass.
            let window_tokens: usize = window.iter().map(|b| b.tokens).sum();
            acc.set_window_items(window_tokens)?;
            let mut loss_sum = 0f64;
            let mut window_samples = 0usize;
            for batch in window {
                let step = acc.accumulate();
                micro_steps += 1;
                let logits = model.forward(&batch.inputs)?;
                let loss = gpt::summed_token_loss(&logits, &batch.targets, &batch.mask)?;
                acc.backward(&loss)?;
                loss_sum += loss.to_scalar::<f32>()? as f64;
                window_samples += batch.inputs.dims()[0];
                if acc.sync_gradients() {
                    if let Some(max) = args.max_grad_norm {
                        acc.clip_grad_norm(max)?;
                    }
                }
                let lr = opt.learning_rate();
                opt.step()?;
                sched.step();
                opt.zero_grad();
                if !step.sync {
                    continue;
                }
                if acc.step_was_skipped() {
                    // fp16 overflow: no update, the loss scale backed off.
                    skipped_steps += 1;
                }
                // The loss per token of the whole global batch: every rank's window.
                let global = acc
                    .reduce(
                        &Tensor::new(
                            &[loss_sum, window_tokens as f64, window_samples as f64],
                            &Device::Cpu,
                        )?,
                        ReduceOp::Sum,
                    )?
                    .to_vec1::<f64>()?;
                let (loss, tokens, samples) = (global[0] / global[1], global[1], global[2]);
                let seconds = window_start.elapsed().as_secs_f64();
                totals.samples += samples;
                totals.tokens += tokens;
                last_loss = loss;
                let n = acc.optimizer_steps();
                if let Some(m) = metrics.as_mut() {
                    writeln!(
                        m,
                        "{}",
                        serde_json::json!({"step": n, "loss": loss, "lr": lr,
                            "samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds})
                    )?;
                }
                if let Some(bar) = &progress {
                    bar.set_position(n);
                    bar.set_message(format!("loss {loss:.4}  {:.0} tokens/s", tokens / seconds));
                }
                window_start = Instant::now();
                if args
                    .checkpoint_every
                    .is_some_and(|every| n.is_multiple_of(every))
                {
                    acc.save_checkpoint(&args.checkpoint_dir, args.checkpoints_keep)
                        .with_context(|| {
                            format!("--checkpoint-dir {}", args.checkpoint_dir.display())
                        })?;
                }
                if args.max_steps.is_some_and(|m| n >= m) {
                    break 'epochs;
                }
            }
        }
    }
    if let Some(bar) = progress {
        bar.finish_and_clear();
    }
    if let Some(mut m) = metrics {
        m.flush()?;
    }
    let wall = start.elapsed().as_secs_f64();
    if let Some(path) = &args.save_model {
        if acc.is_main_process() {
            // The prepared parameters: sorted by name, and the f32 masters under mixed precision.
            let tensors: Vec<(String, Tensor)> = acc
                .parameters()
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                .collect();
            accelerate_core::files::save_safetensors(path, &tensors)
                .with_context(|| format!("--save-model {}", path.display()))?;
        }
        acc.wait_for_everyone()?;
    }
    let sync = acc.gradient_sync_stats();
    acc.print(format!(
        "samples/s={:.1} tokens/s={:.0} final_loss={:.6} unigram_entropy={entropy:.6} wall={:.2}s \
         steps={} micro_steps={} grad_all_reduces={} mixed_precision={} skipped_steps={}",
        totals.samples / wall,
        totals.tokens / wall,
        last_loss,
        wall,
        acc.optimizer_steps(),
        micro_steps,
        sync.all_reduces,
        acc.mixed_precision(),
        skipped_steps
    ));
    Ok(())
}

/// Samples and real tokens trained on over all ranks.
#[derive(Debug, Default)]
struct Totals {
    samples: f64,
    tokens: f64,
}
