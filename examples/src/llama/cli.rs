//! The flags of the llama workload's training runs ([`LlamaArgs`]), their checks, and the data
//! and model size they pick.

use std::path::PathBuf;

use accelerate_core::data::Dataset;
use anyhow::{bail, Result};

use super::config::{default_intermediate, LlamaConfig};
use super::data::TokenRows;
use crate::gpt::{self, CharVocab};
use crate::run::{OptimizerKind, RunArgs};

/// The flags of a run of the llama workload, shared by the `llama` and `lora` examples; use with
/// `#[command(flatten)]`.
#[derive(Debug, Clone, clap::Args)]
pub struct LlamaArgs {
    /// A Hugging Face LlamaForCausalLM config.json (transformers 4.x or 5.x); replaces --layers,
    /// --width, --heads, --kv-heads, --intermediate and --context.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Decoder layers.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// Hidden width; must be divisible by --heads.
    #[arg(long, default_value_t = 64)]
    pub width: usize,
    /// Query heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Key/value heads (grouped-query attention); must divide --heads.
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    /// MLP width (default: Llama's rule, 2/3 of 4 x width rounded up to a multiple of 8).
    #[arg(long)]
    pub intermediate: Option<usize>,
    /// Tokens per row of the built-in text, and the longest sequence the model takes.
    #[arg(long, default_value_t = 64)]
    pub context: usize,
    /// Initial weights: safetensors with Hugging Face names (model.embed_tokens.weight, ...).
    #[arg(long, value_name = "FILE")]
    pub init_weights: Option<PathBuf>,
    /// Token rows: safetensors holding `input_ids` [N, T] int64.
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Rows per micro-batch on each rank.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Passes over the rows (--max-steps overrides it: as many as its steps take).
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Peak learning rate (default 3e-3 for AdamW, 0.1 for SGD).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw)]
    pub optimizer: OptimizerKind,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Weight decay (decoupled for AdamW).
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Seed of the shuffle and the initial weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep the rows in order (no per-epoch shuffle).
    #[arg(long)]
    pub no_shuffle: bool,
    /// Activation checkpointing: keep only each decoder layer's input during the forward pass
    /// and run the layer again in the backward pass (less memory, one more forward pass per
    /// step; the same gradients).
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Write one JSON line per optimizer step here: step, loss per predicted token of the global
    /// batch, lr, samples/s, tokens/s.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    #[command(flatten)]
    pub run: RunArgs,
}

/// Checks the flags that need no data; every message names the flag and what would be valid.
pub fn check_flags(args: &LlamaArgs) -> Result<()> {
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
    if let Some(lr) = args.lr {
        if !(lr.is_finite() && lr > 0.0) {
            bail!("--lr must be a positive number, got {lr}");
        }
    }
    Ok(())
}

/// The training rows and the model's size, and a line saying where the rows came from.
pub fn data_and_config(args: &LlamaArgs) -> Result<(TokenRows, LlamaConfig, String)> {
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
                .unwrap_or_else(|| default_intermediate(args.width)),
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
