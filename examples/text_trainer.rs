//! Fine-tunes a Hugging Face Llama model directory on a text corpus through the Trainer: the
//! same packed rows as `llama --train-file`, Hugging Face's TrainingArguments for the rest. The
//! trained model is written into --output-dir as a model directory (config.json, weights,
//! tokenizer), beside the Trainer's checkpoints.
//!
//! `cargo run --release --example text_trainer -- --model tests/fixtures/llama-dir
//! --train-file tests/fixtures/text/corpus.jsonl --block-size 32 --output-dir out`; on two CPU
//! processes under `accelerate-launch --cpu --num-processes 2`.

use std::path::PathBuf;
use std::sync::Arc;

use accelerate_examples::llama::model_dir::{parse_size, DEFAULT_MAX_SHARD_SIZE};
use accelerate_examples::llama::{self, write_model_dir, ModelDir, ModelOutput, TextArgs};
use accelerate_examples::run;
use accelerate_trainer::{Trainer, TrainingArguments};
use anyhow::{bail, Context, Result};
use clap::Parser;

/// Fine-tune a Llama model directory on a text corpus with the Trainer.
#[derive(Debug, Parser)]
struct Args {
    /// The Hugging Face model directory to start from (config.json, weights, tokenizer).
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    #[command(flatten)]
    text: TextArgs,
    #[command(flatten)]
    training: TrainingArguments,
}

fn main() {
    run::exit_on_error(train(&Args::parse()));
}

fn train(args: &Args) -> Result<()> {
    args.text.check()?;
    if !args.text.given() {
        bail!("--train-file is required: the corpus to fine-tune on");
    }
    let model_dir =
        ModelDir::open(&args.model).with_context(|| format!("--model {}", args.model.display()))?;
    let config = model_dir.config();
    let tokenizer = Arc::new(args.text.tokenizer(Some(&args.model))?);
    let data = args
        .text
        .load_for(&tokenizer, &config, "--model's config.json")?;
    let mut trainer = Trainer::new(args.training.clone())?;
    let (varmap, model) = llama::build_in(
        config,
        trainer.args().seed,
        trainer.device(),
        trainer.compute_dtype(),
    )?;
    let params = accelerate_examples::layers::named_vars(&varmap);
    model_dir
        .load_into(&params)
        .with_context(|| format!("--model {}", args.model.display()))?;
    trainer
        .accelerator()
        .print(format!("data: {}", data.source));
    let out = trainer.train(
        &model,
        &varmap,
        Arc::new(data.train),
        data.validation.map(Arc::new),
    )?;
    // The trained model into --output-dir as Trainer.save_model writes it (its checkpoints stay
    // beside it), with the tokenizer it was trained with.
    let acc = trainer.accelerator();
    let out_dir = &trainer.args().output_dir;
    // Every rank: a collective under ZeRO stage 3.
    let tensors = run::parameter_tensors(acc);
    let max_shard_size = parse_size(DEFAULT_MAX_SHARD_SIZE).map_err(anyhow::Error::msg)?;
    let written = if acc.is_main_process() {
        tensors.and_then(|tensors| {
            write_model_dir(
                out_dir,
                true,
                &ModelOutput {
                    config: &config,
                    token_ids: model_dir.token_ids(),
                    tensors: &tensors,
                    max_shard_size,
                    carry_from: Some(&args.model),
                    tokenizer_from: args.text.tokenizer.as_deref(),
                },
            )
            .map_err(|e| accelerate_core::Error::Config(format!("{e:#}")))
        })
    } else {
        tensors.map(|_| ())
    };
    acc.agree_across_ranks(out_dir, "writing the model directory", written)
        .with_context(|| format!("--output-dir {}", out_dir.display()))?;
    trainer.accelerator().print(format!(
        "steps={} train_loss={:.6} eval_loss={}",
        out.global_step,
        out.training_loss,
        out.metrics
            .get("eval_loss")
            .map_or("none".to_string(), |l| format!("{l:.6}"))
    ));
    Ok(())
}
