//! Loading text against training on it: how many tokens per second the loader delivers (the
//! tokenizer on the StreamingLoader's workers, packing at startup, the token file written by
//! `accelerate-tokenize` and read mapped) with 1, 2 and 4 workers, beside how many the `llama`
//! workload's step consumes and, with `--python`, what Hugging Face `datasets.map` does with the
//! same tokenizer on the same corpus (benchmarks/text_vs_datasets.py), all in one run.
//!
//! ```sh
//! cargo build --release --workspace --bins --examples
//! target/release/bench_text [--corpus-mb 16] [--workers 1,2,4] [--python python3] [--big-mb 512]
//! ```
//!
//! The corpus is generated (seeded words, Unicode and whitespace runs included) as JSON Lines.
//! `--big-mb` also tokenizes a corpus of that size into a token file in a child process and
//! reports the child's peak resident set beside the corpus' size: memory stays bounded.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accelerate_benchmarks::{median, peak_resident_kib, report_value, run_within};
use accelerate_core::data::{DataLoader, StreamingLoader};
use accelerate_text::{
    pretokenize, Corpus, PackedRows, PretokenizeOptions, TextBatch, TokenDtype, TokenFile,
    TokenizeFn, TokenizedCorpus, Tokenizer,
};
use anyhow::{bail, Context, Result};
use clap::Parser;

/// Loader tokens/s against the llama step's consumption (see the program's docs).
#[derive(Debug, Parser)]
struct Args {
    /// The tokenizer (a Hugging Face directory); default: the repository's fixture BPE.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Size of the generated corpus, in MiB.
    #[arg(long, default_value_t = 16)]
    corpus_mb: usize,
    /// Worker counts to measure.
    #[arg(long, default_value = "1,2,4", value_delimiter = ',')]
    workers: Vec<usize>,
    /// Tokens per packed row; rows per batch.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Run benchmarks/text_vs_datasets.py with this Python (needs transformers and datasets).
    #[arg(long)]
    python: Option<String>,
    /// The llama example whose step consumption is measured (default: beside this program).
    #[arg(long)]
    llama: Option<PathBuf>,
    /// Optimizer steps of the llama run.
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Also tokenize a generated corpus of this many MiB in a child and report its peak memory.
    #[arg(long)]
    big_mb: Option<usize>,
    /// (internal) Tokenize CORPUS into OUT with 2 workers and print the peak resident set.
    #[arg(long, num_args = 2, value_names = ["CORPUS", "OUT"], hide = true)]
    child_pretokenize: Option<Vec<PathBuf>>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let tokenizer_dir = args
        .tokenizer
        .clone()
        .unwrap_or_else(|| root.join("tests/fixtures/text/tokenizer"));
    let tokenizer = Arc::new(Tokenizer::from_dir(&tokenizer_dir)?);
    if let Some(paths) = &args.child_pretokenize {
        return child_pretokenize(&tokenizer, &paths[0], &paths[1]);
    }
    let dir = std::env::temp_dir().join(format!("bench_text.{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run(&args, &root, &tokenizer_dir, &tokenizer, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run(
    args: &Args,
    root: &Path,
    tokenizer_dir: &Path,
    tokenizer: &Arc<Tokenizer>,
    dir: &Path,
) -> Result<()> {
    let corpus_path = dir.join("corpus.jsonl");
    let bytes = write_corpus(&corpus_path, args.corpus_mb << 20, 7)?;
    let corpus = Corpus::new([&corpus_path])?;
    let tokenize = tokenize_fn(tokenizer);
    let pad = tokenizer.pad_id().or(tokenizer.eos_id()).unwrap_or(0);
    println!(
        "corpus: {} documents, {:.1} MiB of JSON Lines; tokenizer {} (vocabulary {}); block {} x \
         batch {}; {} cores",
        corpus.count_documents()?,
        bytes as f64 / (1 << 20) as f64,
        tokenizer_dir.display(),
        tokenizer.vocab_size(),
        args.block_size,
        args.batch_size,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("| path | workers | tokens | seconds | tokens/s |");
    println!("|---|---|---|---|---|");
    let mut token_file = None;
    for &workers in &args.workers {
        // The tokenizer on the StreamingLoader's workers: one document per row, padded per batch.
        let streamed = TokenizedCorpus::new(corpus.clone(), tokenize.clone(), 1 << 20, pad)?;
        let loader = StreamingLoader::new(Arc::new(streamed), args.batch_size).num_workers(workers);
        let start = Instant::now();
        let tokens = count_tokens(loader.iter_epoch(0, 0))?;
        row(
            "streamed (tokenized in the loader)",
            workers,
            tokens,
            start.elapsed(),
        );

        let start = Instant::now();
        let packed = PackedRows::tokenize(&corpus, tokenize.clone(), workers, args.block_size)?;
        row(
            "packed at startup (in memory)",
            workers,
            packed.tokens(),
            start.elapsed(),
        );

        let out = dir.join(format!("corpus.{workers}.tokens"));
        let options =
            PretokenizeOptions::new(TokenDtype::for_vocab(tokenizer.vocab_size()), "bench");
        let summary = pretokenize(&corpus, tokenize.clone(), workers, &out, options)?;
        row(
            "accelerate-tokenize (to a token file)",
            workers,
            summary.tokens,
            Duration::from_secs_f64(summary.seconds),
        );
        token_file = Some(out);
    }
    if let Some(path) = token_file {
        let rows = PackedRows::from_token_file(Arc::new(TokenFile::open(&path)?), args.block_size)?;
        let loader = DataLoader::new(Arc::new(rows), args.batch_size)
            .shuffle(true)
            .seed(1);
        let start = Instant::now();
        let tokens = count_tokens(loader.iter_epoch(0, 0))?;
        row(
            "token file, mapped, shuffled rows",
            1,
            tokens,
            start.elapsed(),
        );
    }
    consumption(args, root)?;
    if let Some(python) = &args.python {
        let script = root.join("benchmarks/text_vs_datasets.py");
        let workers: Vec<String> = args.workers.iter().map(usize::to_string).collect();
        let out = Command::new(python)
            .arg(&script)
            .arg("--tokenizer")
            .arg(tokenizer_dir)
            .arg("--corpus")
            .arg(&corpus_path)
            .args(["--block-size", &args.block_size.to_string()])
            .args(["--workers", &workers.join(",")])
            .output()
            .with_context(|| format!("running {python} {}", script.display()))?;
        if !out.status.success() {
            bail!(
                "{}: {}",
                script.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let v: serde_json::Value = serde_json::from_str(line)?;
            println!(
                "| datasets.map (tokenize + group_texts) | {} | {} | {:.3} | {:.0} |",
                v["workers"],
                v["tokens"],
                v["tokenize_s"].as_f64().unwrap_or(0.0) + v["group_s"].as_f64().unwrap_or(0.0),
                v["tokens_per_s"].as_f64().unwrap_or(0.0)
            );
        }
    }
    if let Some(mb) = args.big_mb {
        big_corpus(dir, mb)?;
    }
    Ok(())
}

/// The tokenizer as the corpus code calls it.
fn tokenize_fn(tokenizer: &Arc<Tokenizer>) -> TokenizeFn {
    let tokenizer = Arc::clone(tokenizer);
    Arc::new(move |content| tokenizer.encode_document(content))
}

/// Tokens (non-padding) of an epoch's batches.
fn count_tokens(batches: impl Iterator<Item = accelerate_core::Result<TextBatch>>) -> Result<u64> {
    let mut tokens = 0u64;
    for batch in batches {
        let segments = batch?.segment_ids;
        tokens += segments
            .ne(0u32)?
            .to_dtype(candle_core::DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()? as u64;
    }
    Ok(tokens)
}

fn row(path: &str, workers: usize, tokens: u64, took: Duration) {
    let s = took.as_secs_f64();
    println!(
        "| {path} | {workers} | {tokens} | {s:.3} | {:.0} |",
        tokens as f64 / s.max(1e-9)
    );
}

/// The llama workload's step consumption: tokens/s of its optimizer steps (median after the
/// first), at its default size, one process.
fn consumption(args: &Args, root: &Path) -> Result<()> {
    let llama = args
        .llama
        .clone()
        .unwrap_or_else(|| root.join("target/release/examples/llama"));
    if !llama.exists() {
        println!(
            "(no {}: build it with cargo build --release --examples to compare with the step)",
            llama.display()
        );
        return Ok(());
    }
    let metrics = std::env::temp_dir().join(format!("bench_text.{}.jsonl", std::process::id()));
    let mut cmd = Command::new(&llama);
    cmd.args(["--max-steps", &args.steps.to_string()])
        .arg("--metrics")
        .arg(&metrics);
    let (status, out) = run_within(&mut cmd, Duration::from_secs(600))?
        .context("the llama run did not finish in 10 minutes")?;
    if !status.success() {
        bail!("{} failed:\n{out}", llama.display());
    }
    let rates: Vec<f64> = std::fs::read_to_string(&metrics)?
        .lines()
        .skip(1)
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["tokens_per_s"].as_f64())
        .collect();
    let _ = std::fs::remove_file(&metrics);
    if rates.is_empty() {
        bail!("the llama run wrote no tokens_per_s lines:\n{out}");
    }
    println!(
        "| the llama step consumes (default size, 1 process) | – | – | – | {:.0} |",
        median(&rates)
    );
    Ok(())
}

/// Tokenizes a generated corpus of `mb` MiB in a child process, reporting its peak memory.
fn big_corpus(dir: &Path, mb: usize) -> Result<()> {
    let corpus = dir.join("big.jsonl");
    let bytes = write_corpus(&corpus, mb << 20, 11)?;
    let out = dir.join("big.tokens");
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--child-pretokenize").arg(&corpus).arg(&out);
    let (status, report) = run_within(&mut cmd, Duration::from_secs(3600))?
        .context("the big corpus did not tokenize within an hour")?;
    if !status.success() {
        bail!("tokenizing the big corpus failed:\n{report}");
    }
    let peak = report_value(&report, "peak_kib", "the child")?;
    let tokens = report_value(&report, "tokens", "the child")?;
    println!(
        "big corpus: {:.0} MiB of JSON Lines, {tokens:.0} tokens, token file {:.0} MiB; peak resident \
         set of the tokenizing process {:.1} MiB",
        bytes as f64 / (1 << 20) as f64,
        std::fs::metadata(&out)?.len() as f64 / (1 << 20) as f64,
        peak / 1024.0
    );
    Ok(())
}

fn child_pretokenize(tokenizer: &Arc<Tokenizer>, corpus: &Path, out: &Path) -> Result<()> {
    let options = PretokenizeOptions::new(TokenDtype::for_vocab(tokenizer.vocab_size()), "bench");
    let summary = pretokenize(
        &Corpus::new([corpus])?,
        tokenize_fn(tokenizer),
        2,
        out,
        options,
    )?;
    println!(
        "tokens={} peak_kib={}",
        summary.tokens,
        peak_resident_kib()?
    );
    Ok(())
}

/// Writes about `target` bytes of JSON Lines documents of seeded words (ASCII, accented, CJK,
/// emoji, whitespace runs); returns the bytes written.
fn write_corpus(path: &Path, target: usize, seed: u64) -> Result<usize> {
    const WORDS: &[&str] = &[
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
        "training",
        "gradient",
        "accumulate",
        "rank",
        "tokens",
        "naïve",
        "café",
        "résumé",
        "straße",
        "日本語",
        "数据",
        "🙂",
        "🚀",
        "  ",
        "\t",
        "model",
        "layer",
        "attention",
        "Hello,",
        "world!",
        "42",
        "3.14",
    ];
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let mut next = |n: usize| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((state >> 33) as usize) % n
    };
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut written = 0;
    while written < target {
        let words = 20 + next(380);
        let text: Vec<&str> = (0..words).map(|_| WORDS[next(WORDS.len())]).collect();
        let line = serde_json::json!({ "text": text.join(" ") }).to_string();
        writeln!(file, "{line}")?;
        written += line.len() + 1;
    }
    file.flush()?;
    Ok(written)
}
