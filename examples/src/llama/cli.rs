//! The flags of the llama workload's training runs ([`LlamaArgs`]), their checks, and the data
//! and model size they pick.

use std::path::PathBuf;
use std::sync::Arc;

use accelerate_core::data::Dataset;
use anyhow::{bail, Result};

use super::config::{default_intermediate, LlamaConfig};
use super::data::TokenRows;
use super::model_dir::{parse_size, DEFAULT_MAX_SHARD_SIZE};
use super::text::TextArgs;
use crate::gpt::{self, CharVocab};
use crate::run::{OptimizerArgs, RunArgs};

/// AdamW's and SGD's peak learning rates without --lr.
pub(crate) const LR_DEFAULTS: (f64, f64) = (3e-3, 0.1);

/// The flags of a run of the llama workload, shared by the `llama` and `lora` examples; use with
/// `#[command(flatten)]`.
#[derive(Debug, Clone, clap::Args)]
pub struct LlamaArgs {
    /// A Hugging Face model directory, as save_pretrained writes it: config.json and the weights
    /// (model.safetensors, or model.safetensors.index.json and its shards); the model's size and
    /// initial weights, replacing --config and --init-weights. Its tokenizer files go along to
    /// --output-dir.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Write the trained model into this directory as save_pretrained does (config.json, the
    /// weights, sharded above --max-shard-size, and --model's tokenizer files and
    /// generation_config.json), for LlamaForCausalLM.from_pretrained and
    /// AutoTokenizer.from_pretrained; the `lora` example writes its PEFT adapter there instead
    /// (adapter_config.json, adapter_model.safetensors) with the tokenizer files. Written
    /// atomically; an existing directory must be empty unless --overwrite-output-dir.
    #[arg(long, value_name = "DIR")]
    pub output_dir: Option<PathBuf>,
    /// Write into an --output-dir that holds files: the model's own files there (and weights of
    /// an earlier save) are replaced, every other file is kept.
    #[arg(long)]
    pub overwrite_output_dir: bool,
    /// The largest weight file of --output-dir: bigger weights are split into shards
    /// model-00001-of-0000N.safetensors named by model.safetensors.index.json. Bytes, or a
    /// number with KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, as transformers'
    /// max_shard_size.
    #[arg(long, value_name = "SIZE", default_value = DEFAULT_MAX_SHARD_SIZE, value_parser = parse_size)]
    pub max_shard_size: u64,
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
    #[command(flatten)]
    pub text: TextArgs,
    /// Rows per micro-batch on each rank.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Passes over the rows (--max-steps overrides it: as many as its steps take).
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    #[command(flatten)]
    pub optimizer: OptimizerArgs,
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
    if let Some(dir) = &args.model {
        for (flag, given) in [
            ("--config", args.config.is_some()),
            ("--init-weights", args.init_weights.is_some()),
        ] {
            if given {
                bail!(
                    "--model {} and {flag} both give the model: --model reads config.json and                      the weights from its directory; pass --model alone, or --config and                      --init-weights without it",
                    dir.display()
                );
            }
        }
    }
    args.text.check()?;
    if args.text.given() && args.data.is_some() {
        bail!("--data and --train-file both name the training data; keep one");
    }
    if args.overwrite_output_dir && args.output_dir.is_none() {
        bail!("--overwrite-output-dir is given without --output-dir; name the directory to write");
    }
    let mut positive = vec![("--batch-size", args.batch_size)];
    if args.config.is_none() && args.model.is_none() {
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
    if args.config.is_none() && args.model.is_none() && !args.heads.is_multiple_of(args.kv_heads) {
        bail!(
            "--kv-heads {} does not divide --heads {}: each key/value head serves a whole group \
             of query heads (e.g. --kv-heads {})",
            args.kv_heads,
            args.heads,
            args.heads
        );
    }
    args.run.check()?;
    args.optimizer.lr(LR_DEFAULTS)?;
    Ok(())
}

/// The rows of a run and the model's size they were picked with.
#[derive(Debug)]
pub struct RunData {
    /// The training rows.
    pub train: TokenRows,
    /// Rows held out for evaluation by the data flags (--validation-file,
    /// --validation-split-percentage), if any.
    pub validation: Option<TokenRows>,
    /// The model's size.
    pub config: LlamaConfig,
    /// Where the rows came from, for the run's first lines.
    pub source: String,
}

/// The training rows and the model's size (`model_config`: --model's, else --config's, else
/// from the size flags and the data), and a line saying where the rows came from.
pub fn data_and_config(args: &LlamaArgs, model_config: Option<LlamaConfig>) -> Result<RunData> {
    if args.text.given() {
        return text_and_config(args, model_config);
    }
    let (train, config, source) = rows_and_config(args, model_config)?;
    Ok(RunData {
        train,
        validation: None,
        config,
        source,
    })
}

/// [`data_and_config`] for --train-file (see [`TextArgs::load_for`]).
fn text_and_config(args: &LlamaArgs, model_config: Option<LlamaConfig>) -> Result<RunData> {
    let tokenizer = Arc::new(args.text.tokenizer(args.model.as_deref())?);
    let config_flag = if args.model.is_some() {
        "--model's config.json"
    } else {
        "--config"
    };
    let from_file = match model_config {
        Some(c) => Some(c),
        None => args
            .config
            .as_deref()
            .map(LlamaConfig::from_file)
            .transpose()?,
    };
    let config = match from_file {
        Some(c) => c,
        None => LlamaConfig::from_flags(
            tokenizer.vocab_size(),
            args.layers,
            args.width,
            args.heads,
            args.kv_heads,
            args.intermediate
                .unwrap_or_else(|| default_intermediate(args.width)),
            args.text.block_size.unwrap_or(args.context),
        )?,
    };
    let data = args.text.load_for(&tokenizer, &config, config_flag)?;
    Ok(RunData {
        train: data.train,
        validation: data.validation,
        config,
        source: data.source,
    })
}

fn rows_and_config(
    args: &LlamaArgs,
    model_config: Option<LlamaConfig>,
) -> Result<(TokenRows, LlamaConfig, String)> {
    let from_file = match model_config {
        Some(c) => Some(c),
        None => args
            .config
            .as_deref()
            .map(LlamaConfig::from_file)
            .transpose()?,
    };
    let config_flag = if args.model.is_some() {
        "--model's config.json"
    } else {
        "--config"
    };
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
                flags_config(rows.max_token().unwrap_or(0) as usize + 1, args.context)?
            }
        };
        if rows.row_len() > config.max_position_embeddings {
            bail!(
                "--data {} holds rows of {} tokens, longer than max_position_embeddings {} of \
                 {config_flag}; cut the rows shorter",
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
                    "the built-in text has {} distinct characters but the vocab_size of \
                     {config_flag} is {}; give --data with token ids below vocab_size, or a \
                     larger vocab_size",
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
