//! Trains the `llama` workload, a Llama-architecture language model, with the accelerate-rs
//! runtime; reads and writes Hugging Face's config.json and parameter names, so transformers
//! loads what it saves.
//!
//! Alone: `cargo run --release --example llama`.
//! On two CPU processes: `accelerate-launch --cpu --num-processes 2 target/release/examples/llama`.
//!
//! The loss is transformers' causal-LM loss with `labels = input_ids`. Accumulation is
//! item-weighted: before each accumulation window the loop tells the accelerator how many tokens
//! this rank's part of the window predicts, and passes `backward` the *sum* of token
//! cross-entropies; the gradient is then that of one batch holding the whole window on all ranks,
//! averaged per predicted token.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use accelerate_core::data::{DataLoader, Dataset};
use accelerate_core::optim::{
    AdamW, AdamWConfig, LrScheduler, Optimizer, Schedule, Sgd, SgdConfig,
};
use accelerate_core::Accelerator;
use accelerate_examples::gpt::{self, CharVocab};
use accelerate_examples::llama::{self, Llama, LlamaConfig, TokenRows};
use accelerate_examples::run::{self, OptimizerKind, RunArgs, RunMonitor, StepCounts};
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use clap::Parser;

/// Train a Llama-architecture language model (built-in sonnets, one character per token, unless
/// --data).
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// A Hugging Face LlamaForCausalLM config.json (transformers 4.x or 5.x); replaces --layers,
    /// --width, --heads, --kv-heads, --intermediate and --context.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Decoder layers.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Hidden width; must be divisible by --heads.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Query heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Key/value heads (grouped-query attention); must divide --heads.
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// MLP width (default: Llama's rule, 2/3 of 4 x width rounded up to a multiple of 8).
    #[arg(long)]
    intermediate: Option<usize>,
    /// Tokens per row of the built-in text, and the longest sequence the model takes.
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Initial weights: safetensors with Hugging Face names (model.embed_tokens.weight, ...).
    #[arg(long, value_name = "FILE")]
    init_weights: Option<PathBuf>,
    /// Token rows: safetensors holding `input_ids` [N, T] int64.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Rows per micro-batch on each rank.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Passes over the rows (default: 1, or with --max-steps as many as its steps take).
    #[arg(long)]
    epochs: Option<usize>,
    /// Peak learning rate (default 3e-3 for AdamW, 0.1 for SGD).
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
    /// Seed of the shuffle and the initial weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep the rows in order (no per-epoch shuffle).
    #[arg(long)]
    no_shuffle: bool,
    /// Write the trained weights here (safetensors, Hugging Face names), and the model's
    /// config.json beside it, so `LlamaForCausalLM.from_pretrained(<its directory>)` loads them.
    #[arg(long)]
    save_model: Option<PathBuf>,
    /// Write one JSON line per optimizer step here: step, loss per predicted token of the global
    /// batch, lr, samples/s, tokens/s.
    #[arg(long)]
    metrics: Option<PathBuf>,
    #[command(flatten)]
    run: RunArgs,
}

fn main() {
    run::exit_on_error(run(&Args::parse()));
}

/// Checks the flags that need no data; every message names the flag and what would be valid.
fn check_flags(args: &Args) -> Result<()> {
    let mut positive = vec![("--batch-size", args.batch_size)];
    if args.config.is_none() {
        positive.extend([
            ("--layers", args.layers),
            ("--width", args.width),
            ("--heads", args.heads),
            ("--kv-heads", args.kv_heads),
            ("--context", args.context),
        ]);
        if let Some(i) = args.intermediate {
            positive.push(("--intermediate", i));
        }
    }
    for (flag, value) in positive {
        if value == 0 {
            bail!("{flag} must be at least 1");
        }
    }
    if args.config.is_none() && !args.heads.is_multiple_of(args.kv_heads) {
        bail!(
            "--kv-heads {} does not divide --heads {}: each key/value head serves a whole group \
             of query heads (e.g. --kv-heads {})",
            args.kv_heads,
            args.heads,
            args.heads
        );
    }
    args.run.check()?;
    if let Some(path) = &args.save_model {
        // config.json is written beside the weights: the weights cannot take its name.
        if path.file_name().and_then(|n| n.to_str()) == Some("config.json") {
            bail!(
                "--save-model {}: config.json is written beside the weights; name the weights \
                 model.safetensors (the name transformers' from_pretrained reads)",
                path.display()
            );
        }
    }
    if let Some(lr) = args.lr {
        if !(lr.is_finite() && lr > 0.0) {
            bail!("--lr must be a positive number, got {lr}");
        }
    }
    Ok(())
}

/// The training rows and the model's size, and a line saying where the rows came from.
fn data_and_config(args: &Args) -> Result<(TokenRows, LlamaConfig, String)> {
    let from_file = args
        .config
        .as_deref()
        .map(LlamaConfig::from_file)
        .transpose()?;
    let flags_config = |vocab: usize, context: usize| {
        LlamaConfig::from_flags(
            vocab,
            args.layers,
            args.width,
            args.heads,
            args.kv_heads,
            args.intermediate
                .unwrap_or_else(|| llama::default_intermediate(args.width)),
            context,
        )
    };
    if let Some(path) = &args.data {
        let rows = TokenRows::from_safetensors(path, from_file.map(|c| c.vocab_size))?;
        let config = match from_file {
            Some(c) => c,
            None => {
                if rows.row_len() > args.context {
                    bail!(
                        "--data {} holds rows of {} tokens, longer than --context {}; raise \
                         --context to at least {}",
                        path.display(),
                        rows.row_len(),
                        args.context,
                        rows.row_len()
                    );
                }
                flags_config(rows.max_token() as usize + 1, args.context)?
            }
        };
        if rows.row_len() > config.max_position_embeddings {
            bail!(
                "--data {} holds rows of {} tokens, longer than max_position_embeddings {} of \
                 --config; cut the rows shorter",
                path.display(),
                rows.row_len(),
                config.max_position_embeddings
            );
        }
        let source = format!(
            "{}, {} rows of {} tokens",
            path.display(),
            rows.len(),
            rows.row_len()
        );
        return Ok((rows, config, source));
    }
    let text = gpt::DEFAULT_TEXT;
    let vocab = CharVocab::from_text(text);
    let tokens = vocab
        .encode(text)
        .expect("the vocabulary holds every character");
    let config = match from_file {
        Some(c) => {
            if c.vocab_size < vocab.len() {
                bail!(
                    "the built-in text has {} distinct characters but --config's vocab_size is \
                     {}; give --data with token ids below vocab_size, or a larger vocab_size",
                    vocab.len(),
                    c.vocab_size
                );
            }
            c
        }
        None => flags_config(vocab.len(), args.context)?,
    };
    let row_len = args.context.min(config.max_position_embeddings);
    let rows = TokenRows::cut(&tokens, row_len)?;
    let source = format!(
        "built-in sonnets, {} characters, vocabulary {}, {} rows of {row_len} tokens",
        tokens.len(),
        vocab.len(),
        rows.len()
    );
    Ok((rows, config, source))
}

fn run(args: &Args) -> Result<()> {
    check_flags(args)?;
    let (dataset, config, source) = data_and_config(args)?;
    let row_len = dataset.row_len();

    let mut acc = args.run.accelerator(args.seed)?;
    let device = acc.device().clone();
    // In the compute dtype (bf16/f16 under mixed precision); `prepare` returns the f32 masters.
    let (varmap, model) = llama::build_in(config, args.seed, &device, acc.compute_dtype())?;
    let params = acc.prepare(&varmap)?;
    if let Some(path) = &args.init_weights {
        accelerate_core::load_into_vars(path, &params)
            .with_context(|| format!("--init-weights {}", path.display()))?;
        acc.refresh_compute_parameters()?;
    }
    let parameter_count: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
    acc.print(format!("data: {source}"));
    acc.print(format!(
        "model: {} layers, hidden {}, {} heads ({} key/value), head_dim {}, intermediate {}, \
         vocabulary {}, {parameter_count} parameters",
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size
    ));

    let loader = DataLoader::new(Arc::new(dataset), args.batch_size)
        .shuffle(!args.no_shuffle)
        .seed(args.seed);
    let loader = acc.prepare(loader)?;
    // --max-steps alone runs its steps whatever the size of the data (a benchmark's way to
    // call it), rather than stopping at the end of one epoch.
    let epochs = args.epochs.unwrap_or_else(|| {
        let per_epoch = acc.num_update_steps(loader.len()).max(1) as u64;
        args.run
            .max_steps
            .map_or(1, |m| m.div_ceil(per_epoch).max(1) as usize)
    });
    let total_steps = args.run.total_steps(&acc, loader.len(), epochs);
    let schedule = args.run.schedule(total_steps);
    let training = Training {
        args,
        acc,
        model,
        loader,
        schedule,
        total_steps,
        epochs,
        row_len,
    };
    match args.optimizer {
        OptimizerKind::Adamw => training.train_with(AdamW::new(
            params,
            AdamWConfig {
                lr: args.lr.unwrap_or(3e-3),
                weight_decay: args.weight_decay,
                ..AdamWConfig::default()
            },
        )?),
        OptimizerKind::Sgd => training.train_with(Sgd::new(
            params,
            SgdConfig {
                lr: args.lr.unwrap_or(0.1),
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
    model: Llama,
    loader: DataLoader<TokenRows>,
    schedule: Schedule,
    total_steps: u64,
    epochs: usize,
    row_len: usize,
}

impl Training<'_> {
    /// Prepares `opt` and trains with it, whatever its type.
    fn train_with<O: Optimizer + Send + 'static>(self, opt: O) -> Result<()> {
        let Training {
            args,
            mut acc,
            model,
            mut loader,
            schedule,
            total_steps,
            epochs,
            row_len,
        } = self;
        let mut opt = acc.prepare_optimizer(opt)?;
        let mut sched = acc.prepare(LrScheduler::new(opt.learning_rate_handle(), schedule)?)?;
        args.run.resume_if_asked(&acc, &loader)?;
        let mut monitor = RunMonitor::start(
            &acc,
            args.metrics.as_deref(),
            total_steps,
            args.run.log_every,
        )?;
        run::announce_training(&acc, "", args.batch_size, total_steps);

        let k = acc.gradient_accumulation_steps();
        'epochs: for _epoch in loader.next_epoch()..epochs as u64 {
            if args.run.reached_max_steps(acc.optimizer_steps()) {
                break;
            }
            for window in loader.windows(k) {
                let window = window?;
                // This rank's predicted tokens in the whole window, before its first backward.
                let window_items: usize = window.iter().map(|b| b.predicted).sum();
                acc.set_window_items(window_items)?;
                let mut window_samples = 0usize;
                for batch in window {
                    let step = acc.accumulate();
                    let loss = model.summed_causal_lm_loss(&batch.input_ids)?;
                    acc.backward(&loss)?;
                    monitor.micro_step(&loss)?;
                    window_samples += batch.input_ids.dims()[0];
                    args.run.clip_if_syncing(&acc)?;
                    let lr = run::step_optimizer(&mut opt, &mut sched)?;
                    if !step.sync {
                        continue;
                    }
                    // The loss per predicted token of the whole global batch; tokens/s counts
                    // every position of every row the model read, as language-model training
                    // counts them.
                    let n = acc.optimizer_steps();
                    let counts = StepCounts {
                        items: window_items as f64,
                        samples: window_samples as f64,
                        tokens: (window_samples * row_len) as f64,
                    };
                    monitor.end_step(&acc, n, lr, counts)?;
                    if args.run.end_of_step(&acc, n)? {
                        break 'epochs;
                    }
                }
            }
        }
        let totals = monitor.finish(&acc)?;
        let wall = totals.wall;
        save_model(&acc, model.config(), args.save_model.as_deref())?;
        let sync = acc.gradient_sync_stats();
        acc.print(format!(
            "samples/s={:.1} tokens/s={:.0} final_loss={:.6} wall={:.2}s steps={} \
             micro_steps={} grad_all_reduces={} mixed_precision={} skipped_steps={}",
            totals.samples / wall,
            totals.tokens / wall,
            totals.last_loss,
            wall,
            acc.optimizer_steps(),
            totals.micro_steps,
            sync.all_reduces,
            acc.mixed_precision(),
            totals.skipped_steps
        ));
        Ok(())
    }
}

/// `--save-model`: the prepared parameters (the f32 masters under mixed precision) under Hugging
/// Face's names at `path`, and `config.json` of `config` beside it, both written atomically by the
/// main process; every rank then agrees on the outcome, so none exits before the files are
/// complete, and a failure ends every rank with rank 0's cause.
fn save_model(acc: &Accelerator, config: &LlamaConfig, path: Option<&Path>) -> Result<()> {
    let Some(path) = path else {
        return Ok(());
    };
    if path.file_name().and_then(|n| n.to_str()) != Some("model.safetensors") {
        acc.print(format!(
            "note: transformers' from_pretrained loads a directory's weights only from \
             model.safetensors; {} will need renaming for it",
            path.display()
        ));
    }
    let written = if acc.is_main_process() {
        let tensors: Vec<(String, Tensor)> = acc
            .parameters()
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        accelerate_core::save_safetensors(path, &tensors).and_then(|()| {
            let json =
                serde_json::to_vec_pretty(&config.to_hf_json()).expect("a JSON value serializes");
            accelerate_core::write_atomic(path.with_file_name("config.json"), &json)
        })
    } else {
        Ok(())
    };
    acc.agree_across_ranks(path, "writing the model", written)
        .with_context(|| format!("--save-model {}", path.display()))
}
