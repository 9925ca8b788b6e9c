//! `accelerate-tokenize`: tokenizes a corpus ahead of time into a token file, for corpora read
//! many times or larger than memory. Training then maps the file (`--train-file corpus.tokens`)
//! instead of tokenizing at every start.
//!
//! ```sh
//! accelerate-tokenize --tokenizer MODEL_DIR --output corpus.tokens data/*.jsonl
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use accelerate_text::{
    pretokenize, Corpus, Format, PretokenizeOptions, SampleBy, TokenDtype, TokenFile, TokenizeFn,
    Tokenizer,
};
use clap::Parser;

/// Tokenize JSON Lines, Parquet or text files into one token file (token ids and document
/// boundaries), written atomically.
#[derive(Debug, Parser)]
#[command(name = "accelerate-tokenize", version)]
struct Args {
    /// A Hugging Face model or tokenizer directory (tokenizer.json, tokenizer_config.json, ...).
    #[arg(long, value_name = "DIR")]
    tokenizer: PathBuf,
    /// The token file to write (replaced only once complete).
    #[arg(long, short, value_name = "FILE")]
    output: PathBuf,
    /// The JSON field or Parquet column holding each document (default `text`; JSON Lines
    /// records without it use `messages` through the chat template).
    #[arg(long, value_name = "NAME")]
    field: Option<String>,
    /// The files' format, when their extensions do not say it (jsonl, parquet, text).
    #[arg(long)]
    format: Option<Format>,
    /// How plain-text files are cut into documents: line, paragraph or document.
    #[arg(long, default_value = "line")]
    sample_by: SampleBy,
    /// Tokenizing threads (default: the available cores).
    #[arg(long)]
    workers: Option<usize>,
    /// The corpus: files, or directories of files, read in the order given.
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("accelerate-tokenize: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> accelerate_text::Result<()> {
    let tokenizer = Arc::new(Tokenizer::from_dir(&args.tokenizer)?);
    let corpus = match args.format {
        Some(format) => Corpus::with_format(&args.files, format)?,
        None => Corpus::new(&args.files)?,
    };
    let corpus = match args.field {
        Some(field) => corpus.field(field),
        None => corpus,
    }
    .sample_by(args.sample_by);
    let workers = args.workers.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    if workers == 0 {
        return Err(accelerate_text::Error::Text(
            "--workers 0 cannot tokenize anything; pass at least 1".into(),
        ));
    }
    let dtype = TokenDtype::for_vocab(tokenizer.vocab_size());
    let options = PretokenizeOptions::new(dtype, tokenizer.fingerprint()).on_progress(|s| {
        eprintln!(
            "accelerate-tokenize: {} documents, {} tokens, {:.0} tokens/s",
            s.documents,
            s.tokens,
            s.tokens as f64 / s.seconds.max(1e-9)
        )
    });
    let encode = Arc::clone(&tokenizer);
    let tokenize: TokenizeFn = Arc::new(move |content| encode.encode_document(content));
    let summary = pretokenize(&corpus, tokenize, workers, &args.output, options)?;
    TokenFile::open(&args.output)?.verify()?;
    println!(
        "wrote {}: documents={} tokens={} dtype={:?} bytes={} seconds={:.2} tokens_per_s={:.0} \
         workers={workers}",
        args.output.display(),
        summary.documents,
        summary.tokens,
        summary.dtype,
        summary.bytes,
        summary.seconds,
        summary.tokens as f64 / summary.seconds.max(1e-9)
    );
    Ok(())
}
