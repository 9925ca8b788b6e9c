//! Trains the MLP workload (784 → H → H → 10) with the accelerate-rs runtime.
//!
//! Alone: `cargo run --release --example mlp -- --epochs 1`.
//! On two CPU processes: `accelerate-launch --cpu --num-processes 2 target/release/examples/mlp`.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use accelerate_core::data::{DataLoader, TensorDataset};
use accelerate_core::optim::{
    AdamW, AdamWConfig, LrScheduler, Optimizer, Schedule, Sgd, SgdConfig,
};
use accelerate_core::{Accelerator, MixedPrecision, PreparedOptimizer, ReduceOp};
use accelerate_examples::mlp;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum OptimizerKind {
    Sgd,
    Adamw,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ScheduleKind {
    Constant,
    Linear,
    Cosine,
}

/// Train an MLP on a seeded synthetic classification task (or a safetensors dataset).
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Samples per micro-batch on each rank.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Micro-batches per optimizer step (default: $ACCELERATE_GRADIENT_ACCUMULATION_STEPS, else 1).
    #[arg(long)]
    grad_accum: Option<usize>,
    /// Width of the two hidden layers.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Samples in the synthetic dataset (ignored with --data).
    #[arg(long, default_value_t = 16384)]
    samples: usize,
    /// Passes over the data.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Stop after this many optimizer steps (default: run all epochs).
    #[arg(long)]
    max_steps: Option<u64>,
    /// Peak learning rate (default 1e-3 for AdamW, 0.05 for SGD).
    #[arg(long)]
    lr: Option<f64>,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw)]
    optimizer: OptimizerKind,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// Weight decay (decoupled for AdamW).
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
    /// Seed of the data, the shuffle and the initial weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep the dataset order (no per-epoch shuffle).
    #[arg(long)]
    no_shuffle: bool,
    /// Initial weights (safetensors with PyTorch names: l1.weight [H, 784], l1.bias, ...).
    #[arg(long)]
    init_weights: Option<PathBuf>,
    /// Dataset (safetensors with `x` [N, 784] float and `y` [N] integer labels).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Write the trained weights here (safetensors, PyTorch names and layouts).
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
    /// Write one JSON line per optimizer step here: step, loss of the global batch, lr, samples/s.
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

fn run(args: &Args) -> Result<()> {
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    if args.checkpoint_every == Some(0) {
        bail!("--checkpoint-every must be at least 1 (optimizer steps between checkpoints)");
    }
    if args.checkpoints_keep == Some(0) {
        bail!("--checkpoints-keep must be at least 1 (0 would delete the newest checkpoint)");
    }
    let mut builder = Accelerator::builder().seed(args.seed);
    if let Some(k) = args.grad_accum {
        builder = builder.gradient_accumulation_steps(k);
    }
    if let Some(mode) = args.mixed_precision {
        builder = builder.mixed_precision(mode);
    }
    let mut acc = builder.build()?;
    let device = acc.device().clone();

    let dataset = match &args.data {
        Some(path) => {
            let ds = TensorDataset::from_safetensors(path)
                .with_context(|| format!("--data {}", path.display()))?;
            let x = ds.x();
            if x.rank() != 2 || x.dims()[1] != mlp::INPUTS {
                bail!(
                    "--data {}: `x` has shape {:?}; this model takes [N, {}] (flattened 28x28 \
                     images): save x with {} features per sample",
                    path.display(),
                    x.dims(),
                    mlp::INPUTS,
                    mlp::INPUTS
                );
            }
            if !ds.x().dtype().is_float() {
                bail!(
                    "--data {}: `x` holds {:?}; expected floating-point features (save x as \
                     float32)",
                    path.display(),
                    ds.x().dtype()
                );
            }
            if ds.y().dtype().is_float() {
                bail!(
                    "--data {}: `y` holds {:?}; expected integer class labels (int64 from \
                     PyTorch works)",
                    path.display(),
                    ds.y().dtype()
                );
            }
            if ds.y().rank() != 1 {
                bail!(
                    "--data {}: `y` has shape {:?}; expected one integer label per sample, [N]",
                    path.display(),
                    ds.y().dims()
                );
            }
            if ds.x().dtype() != candle_core::DType::F32 {
                let x = ds.x().to_dtype(candle_core::DType::F32)?;
                TensorDataset::new(x, ds.y().clone())?
            } else {
                ds
            }
        }
        None => {
            let (x, y) = mlp::synthetic_data(args.samples, args.seed)?;
            TensorDataset::new(x, y)?
        }
    };
    let samples = dataset.x().dims()[0];

    // In the compute dtype (bf16/f16 under mixed precision); `prepare` returns the f32 masters.
    let (varmap, model) = mlp::build_in(args.hidden, args.seed, &device, acc.compute_dtype())?;
    let params = acc.prepare(&varmap)?;
    if let Some(path) = &args.init_weights {
        accelerate_core::files::load_into_vars(path, &params).with_context(|| {
            format!(
                "--init-weights {} (this model: --hidden {})",
                path.display(),
                args.hidden
            )
        })?;
        acc.refresh_compute_parameters()?;
    }

    let loader = DataLoader::new(Arc::new(dataset), args.batch_size)
        .shuffle(!args.no_shuffle)
        .seed(args.seed);
    let mut loader = acc.prepare(loader)?;

    let total_steps = {
        let per_epoch = acc.num_update_steps(loader.len()) as u64 * args.epochs as u64;
        args.max_steps.map_or(per_epoch, |m| m.min(per_epoch)) as usize
    };
    let schedule = match args.schedule {
        ScheduleKind::Constant if args.warmup_steps == 0 => Schedule::Constant,
        ScheduleKind::Constant => Schedule::ConstantWithWarmup {
            warmup_steps: args.warmup_steps,
        },
        ScheduleKind::Linear => Schedule::LinearWarmupDecay {
            warmup_steps: args.warmup_steps,
            total_steps,
        },
        ScheduleKind::Cosine => Schedule::CosineWithWarmup {
            warmup_steps: args.warmup_steps,
            total_steps,
        },
    };

    match args.optimizer {
        OptimizerKind::Adamw => {
            let opt = AdamW::new(
                params,
                AdamWConfig {
                    lr: args.lr.unwrap_or(1e-3),
                    weight_decay: args.weight_decay,
                    ..AdamWConfig::default()
                },
            )?;
            let opt = acc.prepare(opt)?;
            train(args, &mut acc, &model, &mut loader, opt, schedule, samples)
        }
        OptimizerKind::Sgd => {
            let opt = Sgd::new(
                params,
                SgdConfig {
                    lr: args.lr.unwrap_or(0.05),
                    momentum: args.momentum,
                    weight_decay: args.weight_decay,
                    ..SgdConfig::default()
                },
            )?;
            let opt = acc.prepare(opt)?;
            train(args, &mut acc, &model, &mut loader, opt, schedule, samples)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn train<O: Optimizer>(
    args: &Args,
    acc: &mut Accelerator,
    model: &mlp::Mlp,
    loader: &mut DataLoader<TensorDataset>,
    mut opt: PreparedOptimizer<O>,
    schedule: Schedule,
    samples: usize,
) -> Result<()> {
    let mut sched = acc.prepare(LrScheduler::new(opt.learning_rate_handle(), schedule)?)?;
    if args.resume {
        let root = &args.checkpoint_dir;
        let latest = accelerate_core::checkpoint::latest_checkpoint(root)
            .with_context(|| format!("--resume: --checkpoint-dir {}", root.display()))?;
        if let Some(latest) = latest {
            // The cause names the file and the problem; the way out depends on what the user
            // wants, so both are offered.
            let dir = acc.load_state(root).map_err(|e| {
                anyhow::anyhow!(
                    "--resume from {}: {e}; nothing was loaded or changed. If the checkpoint is \
                     damaged, delete {} to resume from the one before it, or run without \
                     --resume to start over",
                    root.display(),
                    latest.display()
                )
            })?;
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
    let total_steps = acc.num_update_steps(loader.len()) as u64 * args.epochs as u64;
    let total_steps = args.max_steps.map_or(total_steps, |m| m.min(total_steps));
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
        "training: {samples} samples, {} process(es), batch {} x {k} micro-steps per rank, \
         {total_steps} optimizer steps, on {:?}",
        acc.num_processes(),
        args.batch_size,
        acc.device().location()
    ));

    let start = Instant::now();
    let mut window_start = Instant::now();
    let mut window_loss = 0f64;
    let mut window_samples = 0usize;
    let mut total_samples = 0usize;
    let mut last_loss = f64::NAN;
    let mut micro_steps = 0u64;
    let mut skipped_steps = 0u64;
    'epochs: for _epoch in loader.next_epoch()..args.epochs as u64 {
        if args.max_steps.is_some_and(|m| acc.optimizer_steps() >= m) {
            break;
        }
        for batch in loader.iter() {
            let (x, y) = batch?;
            let step = acc.accumulate();
            micro_steps += 1;
            let logits = model.forward(&x)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            acc.backward(&loss)?;
            window_loss += loss.to_scalar::<f32>()? as f64 * step.loss_scale;
            window_samples += x.dims()[0];
            if acc.sync_gradients() {
                if let Some(max) = args.max_grad_norm {
                    acc.clip_grad_norm(max)?;
                }
            }
            let lr = opt.learning_rate();
            opt.step()?;
            sched.step();
            opt.zero_grad();
            if step.sync && acc.step_was_skipped() {
                // fp16 overflow: no update, the loss scale backed off.
                skipped_steps += 1;
            }
            if step.sync {
                // The loss of the whole global batch: every rank's window, averaged.
                let global = acc
                    .reduce(&Tensor::new(&[window_loss], &Device::Cpu)?, ReduceOp::Mean)?
                    .to_vec1::<f64>()?[0];
                let global_samples = window_samples * acc.num_processes();
                let rate = global_samples as f64 / window_start.elapsed().as_secs_f64();
                total_samples += global_samples;
                last_loss = global;
                let n = acc.optimizer_steps();
                if let Some(m) = metrics.as_mut() {
                    writeln!(
                        m,
                        "{}",
                        serde_json::json!({"step": n, "loss": global, "lr": lr, "samples_per_s": rate})
                    )?;
                }
                if let Some(bar) = &progress {
                    bar.set_position(n);
                    bar.set_message(format!("loss {global:.4}  {rate:.0} samples/s"));
                }
                window_loss = 0.0;
                window_samples = 0;
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
        "samples/s={:.1} final_loss={:.6} wall={:.2}s steps={} micro_steps={} buckets={} \
         grad_all_reduces={} grad_bytes={} mixed_precision={} skipped_steps={}",
        total_samples as f64 / wall,
        last_loss,
        wall,
        acc.optimizer_steps(),
        micro_steps,
        acc.gradient_buckets(),
        sync.all_reduces,
        sync.bytes,
        acc.mixed_precision(),
        skipped_steps
    ));
    Ok(())
}
