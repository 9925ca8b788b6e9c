//! Trains the MLP workload (784 → H → H → 10) with the accelerate-rs runtime.
//!
//! Alone: `cargo run --release --example mlp -- --epochs 1`.
//! On two CPU processes: `accelerate-launch --cpu --num-processes 2 target/release/examples/mlp`.
//! Fully sharded (each rank keeps 1/N of the weights): add `--zero-stage 3`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use accelerate_core::data::{DataLoader, Dataset, TensorDataset};
use accelerate_core::{MixedPrecision, Model, PreparedModel};
use accelerate_examples::run::{
    self, correct_predictions, per_row_cross_entropy, sample_rows, BatchCounts, Evaluator,
    OptimizerArgs, RunArgs, SummaryFields, TrainLoop,
};
use accelerate_examples::{layers, mlp};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
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
    #[command(flatten)]
    optimizer: OptimizerArgs,
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
    let (varmap, _) = mlp::build_in(args.hidden, args.seed, &device, acc.compute_dtype())?;
    let sharded = acc.zero_stage() == 3;
    if let (Some(path), true) = (&args.init_weights, sharded) {
        // Under ZeRO stage 3 `prepare` cuts the whole model into this rank's pieces, so the file
        // goes into the whole model first; under mixed precision that model is in the compute
        // dtype, and the f32 masters would start from the file's values rounded.
        if acc.mixed_precision() != MixedPrecision::No {
            bail!(
                "--init-weights {} with --zero-stage 3 and mixed precision {}: the sharded f32 \
                 masters are cut from the model in the compute dtype, which would round the \
                 file's weights; use --zero-stage 2, or train without mixed precision",
                path.display(),
                acc.mixed_precision()
            );
        }
        load_init_weights(path, &layers::named_vars(&varmap), args.hidden)?;
    }
    // One unit per layer: the same model code trains at every ZeRO stage.
    let model = acc.prepare_model(Model::from_varmap(&varmap).units(mlp::units()))?;
    // Under ZeRO stage 3 this frees the whole weights: the prepared model holds only its pieces.
    drop(varmap);
    let params = model.parameters().to_vec();
    if let (Some(path), false) = (&args.init_weights, sharded) {
        load_init_weights(path, &params, args.hidden)?;
        model.refresh_compute_parameters()?;
    }

    let loader = DataLoader::new(Arc::new(dataset), args.batch_size)
        .shuffle(!args.no_shuffle)
        .seed(args.seed);
    let loader = acc.prepare(loader)?;
    let evaluator = Evaluator::prepare(&mut acc, eval_split, args.batch_size, "samples", None)?;
    let mut train = TrainLoop::new(
        &args.run,
        args.epochs,
        args.batch_size,
        |_, (x, y): &(Tensor, Tensor)| {
            let logits = mlp::forward(&model, x)?;
            Ok(candle_nn::loss::cross_entropy(&logits, y)?)
        },
        |(x, _): &(Tensor, Tensor)| BatchCounts {
            samples: x.dims()[0],
            ..BatchCounts::default()
        },
        |batch| eval_rows(&model, batch),
    );
    train.metrics = args.metrics.as_deref();
    train.data = format!("{samples} samples, ");
    train.summary = SummaryFields {
        gradient_sync: true,
        memory: true,
        ..SummaryFields::default()
    };
    // AdamW's and SGD's peak learning rates without --lr.
    let opt = args.optimizer.build(params, (1e-3, 0.05))?;
    train.run(&mut acc, loader, evaluator, opt)?;
    run::save_model(&acc, args.save_model.as_deref())
}

/// `--init-weights`: the file's weights into `params` (whole parameters), named in the error
/// with the model's width.
fn load_init_weights(path: &Path, params: &[(String, Var)], hidden: usize) -> Result<()> {
    accelerate_core::load_into_vars(path, params).with_context(|| {
        format!(
            "--init-weights {} (this model: --hidden {hidden})",
            path.display()
        )
    })
}

/// One evaluation row per sample of `batch`: its cross-entropy, 1 item, and whether it was
/// classified right.
fn eval_rows(model: &PreparedModel, (x, y): (Tensor, Tensor)) -> Result<Tensor> {
    let logits = mlp::forward(model, &x)?;
    let ones = Tensor::ones(x.dim(0)?, DType::F32, x.device())?;
    sample_rows(&[
        &per_row_cross_entropy(&logits, &y)?,
        &ones,
        &correct_predictions(&logits, &y)?,
    ])
}
