//! Training on a text corpus (`--train-file`), as transformers' `run_clm.py` does: the files
//! tokenized with a Hugging Face tokenizer (`--tokenizer`, or `--model`'s) and packed into rows of
//! `--block-size` tokens with their document boundaries kept; or a token file written ahead of
//! time by `accelerate-tokenize`, mapped rather than read. A held-out split comes from
//! `--validation-file` or `--validation-split-percentage`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use accelerate_core::data::Dataset;
use accelerate_text::{Corpus, Format, PackedRows, SampleBy, TokenFile, TokenizeFn, Tokenizer};
use anyhow::{bail, Context, Result};

use super::config::LlamaConfig;
use super::data::TokenRows;

/// The extension of token files (`accelerate-tokenize --output corpus.tokens`).
const TOKEN_FILE_EXTENSION: &str = "tokens";

/// The flags of a run on a text corpus; use with `#[command(flatten)]`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TextArgs {
    /// The training corpus: JSON Lines, Parquet or text files, or directories of them, read in
    /// order; or one token file written by `accelerate-tokenize` (.tokens). Replaces --data.
    #[arg(long, value_name = "FILE", num_args = 1..)]
    pub train_file: Vec<PathBuf>,
    /// A held-out corpus for evaluation (as --train-file).
    #[arg(long, value_name = "FILE", num_args = 1..)]
    pub validation_file: Vec<PathBuf>,
    /// Hold out the first N percent of --train-file's documents for evaluation, as run_clm.py's
    /// `train[:N%]`, when there is no --validation-file.
    #[arg(long, value_name = "N")]
    pub validation_split_percentage: Option<u32>,
    /// Tokens per packed row (default: the model's max_position_embeddings, at most 1024, as
    /// run_clm.py).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// The tokenizer: a Hugging Face directory holding tokenizer.json (default: --model's).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// The JSON field or Parquet column holding each document (default `text`; JSON Lines
    /// records without it use `messages` through the tokenizer's chat template).
    #[arg(long, value_name = "NAME")]
    pub text_column: Option<String>,
    /// The files' format when their extensions do not say it: jsonl, parquet or text.
    #[arg(long)]
    pub format: Option<Format>,
    /// How plain-text files are cut into documents: line (as datasets' text loader),
    /// paragraph or document.
    #[arg(long, default_value = "line")]
    pub sample_by: SampleBy,
    /// Threads that tokenize the corpus at startup (default: the available cores shared by the
    /// processes of this machine, LOCAL_WORLD_SIZE). Every process tokenizes the whole corpus
    /// into memory (4 bytes per token): tokenize corpora of more than a few GB once with
    /// accelerate-tokenize and train on the token file.
    #[arg(long, value_name = "N")]
    pub preprocessing_num_workers: Option<usize>,
}

/// The rows of a text run and a line saying where they came from.
#[derive(Debug)]
pub struct TextData {
    /// The training rows.
    pub train: TokenRows,
    /// The evaluation rows, from --validation-file or --validation-split-percentage.
    pub validation: Option<TokenRows>,
    /// Where the rows came from, for the run's first lines.
    pub source: String,
}

impl TextArgs {
    /// Whether a text corpus was given.
    pub fn given(&self) -> bool {
        !self.train_file.is_empty()
    }

    /// Checks the flags that need no file; messages name the flag and the fix.
    pub fn check(&self) -> Result<()> {
        if !self.given() {
            for (set, flag) in [
                (!self.validation_file.is_empty(), "--validation-file"),
                (
                    self.validation_split_percentage.is_some(),
                    "--validation-split-percentage",
                ),
                (self.block_size.is_some(), "--block-size"),
                (self.tokenizer.is_some(), "--tokenizer"),
                (self.text_column.is_some(), "--text-column"),
            ] {
                if set {
                    bail!("{flag} needs --train-file: name the training corpus");
                }
            }
            return Ok(());
        }
        if !self.validation_file.is_empty() && self.validation_split_percentage.is_some() {
            bail!(
                "--validation-file and --validation-split-percentage both name the evaluation \
                 split; keep one"
            );
        }
        if let Some(p) = self.validation_split_percentage {
            if !(1..100).contains(&p) {
                bail!("--validation-split-percentage {p} must be between 1 and 99");
            }
        }
        if self.block_size == Some(0) {
            bail!(
                "--block-size must be at least 2 tokens (a row predicts each from the one before)"
            );
        }
        if self.preprocessing_num_workers == Some(0) {
            bail!("--preprocessing-num-workers must be at least 1");
        }
        Ok(())
    }

    /// The tokenizer: --tokenizer's directory, else --model's.
    pub fn tokenizer(&self, model: Option<&Path>) -> Result<Tokenizer> {
        let dir = match (&self.tokenizer, model) {
            (Some(dir), _) => dir.as_path(),
            (None, Some(model)) => model,
            (None, None) => bail!(
                "--train-file needs a tokenizer: pass --model (a Hugging Face model directory \
                 with its tokenizer.json) or --tokenizer DIR"
            ),
        };
        Tokenizer::from_dir(dir).with_context(|| format!("the tokenizer of {}", dir.display()))
    }

    /// The rows for a model of `config` (whose origin `config_flag` names in messages): the
    /// tokenizer's ids must fit its vocabulary and --block-size its positions; by default the
    /// block is the model's context, at most 1024 tokens, as run_clm.py picks it.
    pub fn load_for(
        &self,
        tokenizer: &Arc<Tokenizer>,
        config: &LlamaConfig,
        config_flag: &str,
    ) -> Result<TextData> {
        if tokenizer.vocab_size() > config.vocab_size {
            bail!(
                "the tokenizer has {} ids but the vocab_size of {config_flag} is {}: its embedding \
                 has no row for the ids above; use the model's own tokenizer, or a config whose \
                 vocab_size covers the tokenizer",
                tokenizer.vocab_size(),
                config.vocab_size
            );
        }
        let block_size = self
            .block_size
            .unwrap_or(config.max_position_embeddings.min(1024));
        if block_size > config.max_position_embeddings {
            bail!(
                "--block-size {block_size} is longer than max_position_embeddings {} of \
                 {config_flag}; pass --block-size {} or less",
                config.max_position_embeddings,
                config.max_position_embeddings
            );
        }
        if block_size < 2 {
            bail!(
                "--block-size must be at least 2 tokens (a row predicts each from the one before)"
            );
        }
        self.load(tokenizer, block_size)
    }

    /// Tokenizes and packs the corpora into rows of `block_size` tokens.
    pub fn load(&self, tokenizer: &Arc<Tokenizer>, block_size: usize) -> Result<TextData> {
        let workers = self.preprocessing_num_workers.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
            let local_processes = std::env::var("LOCAL_WORLD_SIZE")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(1)
                .max(1);
            (cores / local_processes).max(1)
        });
        let token_files =
            token_file(&self.train_file)?.is_some() || token_file(&self.validation_file)?.is_some();
        if token_files {
            for (set, flag) in [
                (self.text_column.is_some(), "--text-column"),
                (self.format.is_some(), "--format"),
                (self.sample_by != SampleBy::default(), "--sample-by"),
            ] {
                if set {
                    bail!(
                        "{flag} has no effect on a token file, whose documents were cut and \
                         tokenized when it was written; give it to accelerate-tokenize instead"
                    );
                }
            }
        }
        let tokenize: TokenizeFn = {
            let tokenizer = Arc::clone(tokenizer);
            Arc::new(move |content| tokenizer.encode_document(content))
        };
        let (train, validation) = match token_file(&self.train_file)? {
            Some(path) => {
                let file = Arc::new(open_token_file(path, tokenizer)?);
                let documents = file.documents();
                match self.validation_split_percentage {
                    Some(p) => {
                        let (held, kept) = accelerate_text::validation_split(documents, p)?;
                        (
                            PackedRows::from_token_file_documents(file.clone(), kept, block_size)?,
                            Some(PackedRows::from_token_file_documents(
                                file, held, block_size,
                            )?),
                        )
                    }
                    None => (PackedRows::from_token_file(file, block_size)?, None),
                }
            }
            None => {
                let corpus = self.corpus(&self.train_file)?;
                match self.validation_split_percentage {
                    Some(p) => {
                        let (kept, held) = corpus.split_validation(p)?;
                        (
                            PackedRows::tokenize(&kept, tokenize.clone(), workers, block_size)?,
                            Some(PackedRows::tokenize(
                                &held,
                                tokenize.clone(),
                                workers,
                                block_size,
                            )?),
                        )
                    }
                    None => (
                        PackedRows::tokenize(&corpus, tokenize.clone(), workers, block_size)?,
                        None,
                    ),
                }
            }
        };
        let validation = match (validation, self.validation_file.is_empty()) {
            (Some(v), _) => Some(v),
            (None, false) => Some(match token_file(&self.validation_file)? {
                Some(path) => PackedRows::from_token_file(
                    Arc::new(open_token_file(path, tokenizer)?),
                    block_size,
                )?,
                None => PackedRows::tokenize(
                    &self.corpus(&self.validation_file)?,
                    tokenize,
                    workers,
                    block_size,
                )?,
            }),
            (None, true) => None,
        };
        let mut source = format!(
            "{}: {} documents, {} tokens, {} rows of {block_size} ({} tokens of an incomplete last \
             row dropped)",
            names(&self.train_file),
            train.documents(),
            train.tokens(),
            Dataset::len(&train),
            train.dropped_tokens()
        );
        if let Some(v) = &validation {
            source.push_str(&format!(
                "; evaluation: {} documents, {} rows",
                v.documents(),
                Dataset::len(v)
            ));
        }
        Ok(TextData {
            train: TokenRows::packed(train),
            validation: validation.map(TokenRows::packed),
            source,
        })
    }

    /// The corpus of `files` with the flags' field and text cutting.
    fn corpus(&self, files: &[PathBuf]) -> Result<Corpus> {
        let corpus = match self.format {
            Some(format) => Corpus::with_format(files, format)?,
            None => Corpus::new(files)?,
        }
        .sample_by(self.sample_by);
        Ok(match &self.text_column {
            Some(name) => corpus.field(name.clone()),
            None => corpus,
        })
    }
}

/// The token file among `files`, if they name one (then it must be the only one).
fn token_file(files: &[PathBuf]) -> Result<Option<&Path>> {
    let is_token_file =
        |p: &PathBuf| p.extension().and_then(|e| e.to_str()) == Some(TOKEN_FILE_EXTENSION);
    match files.iter().filter(|p| is_token_file(p)).count() {
        0 => Ok(None),
        1 if files.len() == 1 => Ok(Some(&files[0])),
        _ => bail!(
            "{} mixes a token file with other files; pass one token file (written by \
             accelerate-tokenize from all the files), or only corpus files",
            names(files)
        ),
    }
}

/// A token file, refused unless it was written with `tokenizer`.
fn open_token_file(path: &Path, tokenizer: &Tokenizer) -> Result<TokenFile> {
    let file = TokenFile::open(path)?;
    file.check_tokenizer(&tokenizer.fingerprint())?;
    Ok(file)
}

fn names(files: &[PathBuf]) -> String {
    files
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
