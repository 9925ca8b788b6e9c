//! Trains the MLP workload through the Trainer: the model, the data and the arguments; no loop.
//!
//! Alone: `cargo run --release --example trainer -- --output-dir out`.
//! On two CPU processes: `accelerate-launch --cpu --num-processes 2
//! target/release/examples/trainer --output-dir out`.

use std::path::PathBuf;
use std::sync::Arc;

use accelerate_core::data::TensorDataset;
use accelerate_examples::mlp::{self, Mlp};
use accelerate_trainer::{Metrics, ModelOutput, Trainer, TrainerModel, TrainingArguments};
use anyhow::Result;
use candle_core::{DType, Tensor};
use clap::Parser;

/// Train the MLP workload on seeded synthetic data, with a held-out evaluation split.
#[derive(Debug, Parser)]
struct Args {
    /// Width of the two hidden layers.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Samples in the synthetic dataset, both splits.
    #[arg(long, default_value_t = 4096)]
    samples: usize,
    /// Share of the samples held out for evaluation.
    #[arg(long, default_value_t = 0.1)]
    eval_fraction: f64,
    /// Training arguments from a JSON or YAML file instead of the flags.
    #[arg(long)]
    args_file: Option<PathBuf>,
    #[command(flatten)]
    training: TrainingArguments,
}

/// The model as the Trainer sees it: per-sample cross-entropy, logits and labels.
struct Classifier(Mlp);

impl TrainerModel<(Tensor, Tensor)> for Classifier {
    fn forward(&self, (x, y): &(Tensor, Tensor)) -> candle_core::Result<ModelOutput> {
        let logits = self.0.forward(x)?;
        let log_probs = candle_nn::ops::log_softmax(&logits, 1)?;
        let losses = log_probs.gather(&y.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?;
        Ok(ModelOutput::losses(losses).with_predictions(logits, y.clone()))
    }
}

/// The share of predictions that match the labels.
fn accuracy(p: &accelerate_trainer::EvalPrediction) -> candle_core::Result<Metrics> {
    let hits = p.predictions.argmax(1)?.eq(&p.label_ids)?;
    let accuracy = hits.to_dtype(DType::F64)?.mean_all()?.to_scalar::<f64>()?;
    Ok(Metrics::from([("accuracy".to_string(), accuracy)]))
}

fn main() -> Result<()> {
    let cli = Args::parse();
    let args = match &cli.args_file {
        Some(path) => TrainingArguments::from_file(path)?,
        None => cli.training,
    };
    if !(cli.eval_fraction > 0.0 && cli.eval_fraction < 1.0) {
        anyhow::bail!(
            "--eval-fraction {} must be in (0, 1): the share of the samples held out for \
             evaluation",
            cli.eval_fraction
        );
    }
    let (x, y) = mlp::synthetic_data(cli.samples, args.seed)?;
    let held_out = ((cli.samples as f64 * cli.eval_fraction).round() as usize).max(1);
    let kept = cli.samples.saturating_sub(held_out);
    if kept == 0 {
        anyhow::bail!(
            "--samples {} with --eval-fraction {} leaves nothing to train on; give more samples",
            cli.samples,
            cli.eval_fraction
        );
    }
    let train = TensorDataset::new(x.narrow(0, 0, kept)?, y.narrow(0, 0, kept)?)?;
    let eval = TensorDataset::new(x.narrow(0, kept, held_out)?, y.narrow(0, kept, held_out)?)?;

    let mut trainer = Trainer::new(args)?;
    let seed = trainer.args().seed;
    let (varmap, model) =
        mlp::build_in(cli.hidden, seed, trainer.device(), trainer.compute_dtype())?;
    trainer.compute_metrics(accuracy);
    let out = trainer.train(
        &Classifier(model),
        &varmap,
        Arc::new(train),
        Some(Arc::new(eval)),
    )?;
    trainer.accelerator().print(format!(
        "steps={} train_loss={:.6} eval_loss={:.6} eval_accuracy={:.4} zero_stage={}",
        out.global_step,
        out.training_loss,
        out.metrics["eval_loss"],
        out.metrics["eval_accuracy"],
        trainer.accelerator().zero_stage()
    ));
    Ok(())
}
