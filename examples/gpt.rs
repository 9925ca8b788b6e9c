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

use std::path::{Path, PathBuf};
use std::sync::Arc;

use accelerate_core::data::{DataLoader, Dataset};
use accelerate_core::Model;
use accelerate_examples::gpt::{self, CharVocab, GptConfig, GptUnits, TextWindows, TokenBatch};
use accelerate_examples::run::{
    self, per_row_cross_entropy, sample_rows, BatchCounts, Evaluator, OptimizerArgs, RunArgs,
    SummaryFields, TrainLoop,
};
use anyhow::{bail, Context, Result};
use clap::Parser;

/// Train a small GPT on a text, one character per token (Shakespeare's sonnets unless --text).
///
/// The evaluation split (--eval-fraction, --eval-steps) holds out windows of the text; windows
/// overlap by half, so the training windows that share text with a held-out one are left out
/// too. Its loss is the mean cross-entropy over all target tokens of the held-out windows.
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
    /// Passes over the windows (each pass covers the text about twice).
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    #[command(flatten)]
    optimizer: OptimizerArgs,
    /// Dropout probability (GPT-2's places: embeddings, attention probabilities, residual
    /// branches); 0 is off. Masks come from each rank's checkpointed generator.
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Seed of the window lengths, the shuffle, the initial weights and the dropout masks.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep the windows in text order (no per-epoch shuffle).
    #[arg(long)]
    no_shuffle: bool,
    /// Activation checkpointing: keep only each block's input during the forward pass and run
    /// the block again in the backward pass (less memory, one more forward pass per step; the
    /// same gradients).
    #[arg(long)]
    gradient_checkpointing: bool,
    /// Write the trained weights here (safetensors, GPT-2 names, nn.Linear layouts).
    #[arg(long)]
    save_model: Option<PathBuf>,
    /// Write one JSON line per optimizer step here: step, loss per token of the global batch, lr,
    /// samples/s, tokens/s.
    #[arg(long)]
    metrics: Option<PathBuf>,
    #[command(flatten)]
    run: RunArgs,
}

/// AdamW's and SGD's peak learning rates without --lr.
const LR_DEFAULTS: (f64, f64) = (3e-3, 0.1);

fn main() {
    run::exit_on_error(run(&Args::parse()));
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
    args.run.check()?;
    if !(0.0..1.0).contains(&args.dropout) {
        bail!(
            "--dropout must be in [0, 1) (0 is off; GPT-2 used 0.1), got {}",
            args.dropout
        );
    }
    args.optimizer.lr(LR_DEFAULTS)?;
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
    let (mut dataset, eval_split) = run::hold_out(
        TextWindows::tiled(tokens, args.context, args.seed)?,
        args.run.eval_fraction(),
        args.seed,
        "windows",
    )?;
    // Windows overlap by half: a training window that shares text with a held-out one would
    // let the evaluation score text the model was trained on.
    let mut left_out = 0;
    if let Some(eval) = &eval_split {
        let windows = dataset.dataset().clone();
        let overlapping = windows.overlapping(dataset.indices(), eval.indices());
        left_out = overlapping.len();
        dataset.retain(|i| overlapping.binary_search(i).is_err());
        if dataset.len() == 0 {
            bail!(
                "--eval-fraction {} holds out windows that overlap every other window, leaving \
                 none to train on: lower --eval-fraction, or give a longer --text",
                args.run.eval_fraction()
            );
        }
    }

    let mut acc = args.run.accelerator(args.seed)?;
    let device = acc.device().clone();

    let config = GptConfig {
        vocab: vocab.len(),
        context: args.context,
        width: args.width,
        heads: args.heads,
        layers: args.layers,
    };
    run::check_wrap_classes(gpt::BLOCK_CLASS)?;
    if acc.zero_stage() == 3 && args.dropout > 0.0 {
        bail!(
            "--dropout {} under ZeRO stage 3: each unit runs again in the backward pass, and \
             its dropout masks would be drawn anew; train with --dropout 0 or a lower stage",
            args.dropout
        );
    }
    // In the compute dtype (bf16/f16 under mixed precision); `prepare` returns the f32 masters
    // (at ZeRO stage 3, this rank's pieces of them). The model computes through its units, so
    // the whole parameters built here are dropped at stage 3 once cut into pieces.
    let (varmap, _) = gpt::build_in(config, args.seed, &device, acc.compute_dtype())?;
    let parameter_count: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
    let prepared =
        acc.prepare_model(Model::from_varmap(&varmap).units(gpt::unit_specs(&config)))?;
    drop(varmap);
    let params = prepared.parameters().to_vec();
    // At stage 3 every unit is recomputed in the backward pass anyway: checkpointing inside it
    // would run its forward a third time.
    let checkpointing = args.gradient_checkpointing && acc.zero_stage() < 3;
    let model = GptUnits::new(config, prepared, checkpointing);
    acc.print(format!(
        "data: {source}, {chars} characters, vocabulary {}, unigram entropy {entropy:.4} nats per \
         character (the loss of a model that ignores context); {} windows of {}..={} characters{}",
        vocab.len(),
        dataset.len(),
        args.context.div_ceil(2),
        args.context,
        eval_split.as_ref().map_or(String::new(), |e| format!(
            " to train on, {} held out, {left_out} left out for sharing text with held-out ones",
            e.len()
        ))
    ));
    acc.print(format!(
        "model: {} layers, width {}, {} heads, context {}, {parameter_count} parameters, \
         gradient checkpointing {}",
        args.layers,
        args.width,
        args.heads,
        args.context,
        if args.gradient_checkpointing {
            "on"
        } else {
            "off"
        }
    ));

    let loader = DataLoader::new(Arc::new(dataset), args.batch_size)
        .shuffle(!args.no_shuffle)
        .seed(args.seed);
    let loader = acc.prepare(loader)?;
    let evaluator = Evaluator::prepare(
        &mut acc,
        eval_split,
        args.batch_size,
        "windows",
        Some("tokens"),
    )?;
    let opt = args.optimizer.build(params, LR_DEFAULTS)?;
    let mut train = TrainLoop::new(
        &args.run,
        args.epochs,
        args.batch_size,
        |acc, batch: &TokenBatch| {
            let dropout = gpt::Dropout {
                rng: acc.rng().clone(),
                p: args.dropout,
            };
            let loss =
                model.summed_loss(&batch.inputs, &batch.targets, &batch.mask, Some(&dropout))?;
            Ok(loss)
        },
        |batch: &TokenBatch| BatchCounts {
            samples: batch.inputs.dims()[0],
            items: Some(batch.tokens),
            tokens: batch.tokens,
        },
        |batch| eval_rows(&model, batch),
    );
    train.metrics = args.metrics.as_deref();
    train.save_model = args.save_model.as_deref();
    train.summary = SummaryFields {
        tokens_per_s: true,
        after_loss: format!(" unigram_entropy={entropy:.6}"),
        memory: true,
        ..SummaryFields::default()
    };
    train.run(&mut acc, loader, evaluator, opt)
}

/// One evaluation row per window of `batch`: the summed cross-entropy of its real target tokens
/// (no dropout) and their number.
fn eval_rows(model: &GptUnits, batch: TokenBatch) -> Result<candle_core::Tensor> {
    let logits = model.forward(&batch.inputs)?;
    let (b, t, v) = logits.dims3()?;
    let per_token =
        per_row_cross_entropy(&logits.reshape((b * t, v))?, &batch.targets.flatten_all()?)?
            .reshape((b, t))?;
    let summed = (per_token * &batch.mask)?.sum(1)?;
    sample_rows(&[&summed, &batch.mask.sum(1)?])
}
