//! Trains the MLP workload (784 → H → H → 10) with the accelerate-rs runtime.
//!
//! Alone: `cargo run --release --example mlp -- --epochs 1`.
//! On two CPU processes: `accelerate-launch --cpu --num-processes 2 target/release/examples/mlp`.

use std::path::PathBuf;
use std::sync::Arc;

use accelerate_core::data::{DataLoader, Dataset, TensorDataset};
use accelerate_core::optim::{
    AdamW, AdamWConfig, LrScheduler, Optimizer, Schedule, Sgd, SgdConfig,
};
use accelerate_core::Accelerator;
use accelerate_examples::mlp;
use accelerate_examples::run::{
    self, correct_predictions, per_row_cross_entropy, sample_rows, Evaluator, OptimizerKind,
    RunArgs, RunMonitor, StepCounts, Subset,
};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use clap::Parser;

/// Train an MLP on a seeded synthetic classification task (or a safetensors dataset).
///
/// The evaluation split (--eval-fraction, --eval-steps) holds out samples of the dataset; its
/// loss is the mean cross-entropy per sample and its accuracy the share of samples classified
/// right.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Samples per micro-batch on each rank.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Width of the two hidden layers.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Samples in the synthetic dataset (ignored with --data).
    #[arg(long, default_value_t = 16384)]
    samples: usize,
    /// Passes over the data.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
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
    /// Write one JSON line per optimizer step here: step, loss of the global batch, lr, samples/s.
    #[arg(long)]
    metrics: Option<PathBuf>,
    #[command(flatten)]
    run: RunArgs,
}

fn main() {
    run::exit_on_error(run(&Args::parse()));
}

/// Loads the --data file, checked against what the model takes, or builds the synthetic set.
fn load_dataset(args: &Args) -> Result<TensorDataset> {
    let Some(path) = &args.data else {
        let (x, y) = mlp::synthetic_data(args.samples, args.seed)?;
        return Ok(TensorDataset::new(x, y)?);
    };
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
        Ok(TensorDataset::new(x, ds.y().clone())?)
    } else {
        Ok(ds)
    }
}

fn run(args: &Args) -> Result<()> {
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    args.run.check()?;
    let mut acc = args.run.accelerator(args.seed)?;
    let device = acc.device().clone();

    let (dataset, eval_split) = run::hold_out(
        load_dataset(args)?,
        args.run.eval_fraction(),
        args.seed,
        "samples",
    )?;
    let samples = dataset.len();

    // In the compute dtype (bf16/f16 under mixed precision); `prepare` returns the f32 masters.
    let (varmap, model) = mlp::build_in(args.hidden, args.seed, &device, acc.compute_dtype())?;
    let params = acc.prepare(&varmap)?;
    if let Some(path) = &args.init_weights {
        accelerate_core::load_into_vars(path, &params).with_context(|| {
            format!(
                "--init-weights {} (this model: --hidden {})",
                path.display(),
                args.hidden
            )
        })?;
        acc.model().refresh_compute_parameters()?;
    }

    let loader = DataLoader::new(Arc::new(dataset), args.batch_size)
        .shuffle(!args.no_shuffle)
        .seed(args.seed);
    let loader = acc.prepare(loader)?;
    let evaluator = Evaluator::prepare(&mut acc, eval_split, args.batch_size, "samples", None)?;
    let total_steps = args.run.total_steps(&acc, loader.len(), args.epochs);
    let schedule = args.run.schedule(total_steps);
    let training = Training {
        args,
        acc,
        model,
        loader,
        evaluator,
        schedule,
        total_steps,
        samples,
    };

    match args.optimizer {
        OptimizerKind::Adamw => training.train_with(AdamW::new(
            params,
            AdamWConfig {
                lr: args.lr.unwrap_or(1e-3),
                weight_decay: args.weight_decay,
                ..AdamWConfig::default()
            },
        )?),
        OptimizerKind::Sgd => training.train_with(Sgd::new(
            params,
            SgdConfig {
                lr: args.lr.unwrap_or(0.05),
                momentum: args.momentum,
                weight_decay: args.weight_decay,
                ..SgdConfig::default()
            },
        )?),
    }
}

/// Everything a run needs but the optimizer, which --optimizer picks.
struct Training<'a> {
    args: &'a Args,
    acc: Accelerator,
    model: mlp::Mlp,
    loader: DataLoader<Subset<TensorDataset>>,
    evaluator: Evaluator<TensorDataset>,
    schedule: Schedule,
    total_steps: u64,
    samples: usize,
}

impl Training<'_> {
    /// Prepares `opt` and trains with it, whatever its type.
    fn train_with<O: Optimizer + Send + 'static>(self, opt: O) -> Result<()> {
        let Training {
            args,
            mut acc,
            model,
            mut loader,
            mut evaluator,
            schedule,
            total_steps,
            samples,
        } = self;
        let mut opt = acc.prepare_optimizer(opt)?;
        let mut sched = acc.prepare(LrScheduler::new(opt.learning_rate_handle(), schedule)?)?;
        args.run.resume_if_asked(&acc, &loader)?;
        let mut monitor = RunMonitor::start(
            &acc,
            args.metrics.as_deref(),
            total_steps,
            args.run.logging_steps(),
        )?;
        run::announce_training(
            &acc,
            &format!("{samples} samples, "),
            args.batch_size,
            total_steps,
        );

        let mut window_samples = 0usize;
        'epochs: for _epoch in loader.next_epoch()..args.epochs as u64 {
            if args.run.reached_max_steps(acc.optimizer_steps()) {
                break;
            }
            for batch in loader.iter() {
                let (x, y) = batch?;
                let step = acc.accumulate();
                let logits = model.forward(&x)?;
                let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
                acc.backward(&loss)?;
                monitor.micro_step(&(loss.to_dtype(DType::F64)? * step.loss_scale)?)?;
                window_samples += x.dims()[0];
                monitor.grad_norm(args.run.clip_if_syncing(&acc)?);
                let lr = run::step_optimizer(&mut opt, &mut sched)?;
                if !step.sync {
                    continue;
                }
                // The loss of the whole global batch: every rank's window loss, averaged (one
                // item per rank and step).
                let n = acc.optimizer_steps();
                let counts = StepCounts {
                    items: 1.0,
                    samples: window_samples as f64,
                    tokens: 0.0,
                };
                monitor.end_step(&acc, n, lr, counts)?;
                window_samples = 0;
                if args.run.eval_due(n) {
                    evaluator.evaluate(&acc, n, |batch| eval_rows(&model, batch))?;
                }
                if args.run.end_of_step(&acc, n)? {
                    break 'epochs;
                }
            }
        }
        let totals = monitor.finish(&acc)?;
        evaluator.at_end(&acc, acc.optimizer_steps(), |batch| {
            eval_rows(&model, batch)
        })?;
        acc.end_training()?;
        // Before save_model, which only some ranks may be asked for: every rank takes part.
        let peak_rss_mib = run::peak_resident_mib(&acc)?;
        run::save_model(&acc, args.save_model.as_deref())?;
        let sync = acc.gradient_sync_stats();
        acc.print(format!(
            "samples/s={:.1} final_loss={:.6} wall={:.2}s steps={} micro_steps={} buckets={} \
             grad_all_reduces={} grad_bytes={} mixed_precision={} skipped_steps={} overlap={} \
             zero_stage={} transport={} peak_rss_mib={peak_rss_mib:.0}{}",
            totals.samples / totals.wall,
            totals.last_loss,
            totals.wall,
            acc.optimizer_steps(),
            totals.micro_steps,
            acc.model().gradient_buckets(),
            sync.all_reduces,
            sync.bytes,
            acc.mixed_precision(),
            totals.skipped_steps,
            u8::from(acc.overlaps_gradient_reduction()),
            acc.zero_stage(),
            acc.transport_name(),
            evaluator.summary_fields()
        ));
        Ok(())
    }
}

/// One evaluation row per sample of `batch`: its cross-entropy, 1 item, and whether it was
/// classified right.
fn eval_rows(model: &mlp::Mlp, (x, y): (Tensor, Tensor)) -> Result<Tensor> {
    let logits = model.forward(&x)?;
    let ones = Tensor::ones(x.dim(0)?, DType::F32, x.device())?;
    sample_rows(&[
        &per_row_cross_entropy(&logits, &y)?,
        &ones,
        &correct_predictions(&logits, &y)?,
    ])
}
