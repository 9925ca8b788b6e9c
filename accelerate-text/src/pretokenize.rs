//! [`pretokenize`]: a corpus tokenized ahead of time into a [`TokenFile`](crate::TokenFile), for
//! corpora read many times; what the tokenize command runs.

use std::path::Path;
use std::time::Instant;

use crate::corpus::Corpus;
use crate::error::Result;
use crate::pipeline::tokenize_in_order;
use crate::token_file::TokenDtype;
use crate::token_writer::TokenFileWriter;
use crate::tokenize_fn::TokenizeFn;

/// How often (in documents) [`PretokenizeOptions::on_progress`] is called.
pub const PROGRESS_EVERY: u64 = 1000;

/// What [`pretokenize`] did (also the progress reported while it runs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Documents tokenized.
    pub documents: u64,
    /// Token ids written.
    pub tokens: u64,
    /// Size of the token file in bytes (while running: the ids written so far).
    pub bytes: u64,
    /// Seconds since the start.
    pub seconds: f64,
    /// How the ids are stored.
    pub dtype: TokenDtype,
}

/// The caller's progress report, called on the writing thread.
type ProgressFn = Box<dyn FnMut(&Summary) + Send>;

/// The settings of [`pretokenize`] besides the corpus and the tokenizer.
pub struct PretokenizeOptions {
    dtype: TokenDtype,
    tokenizer: String,
    progress: Option<ProgressFn>,
}

impl PretokenizeOptions {
    /// Ids stored as `dtype` (choose it with [`TokenDtype::for_vocab`] from the tokenizer's
    /// vocabulary size, added tokens included), and `tokenizer`, the tokenizer's name or
    /// fingerprint, recorded in the file so that readers can refuse it with another tokenizer.
    pub fn new(dtype: TokenDtype, tokenizer: impl Into<String>) -> Self {
        Self {
            dtype,
            tokenizer: tokenizer.into(),
            progress: None,
        }
    }

    /// Calls `report` every [`PROGRESS_EVERY`] documents with the counts so far (on the thread
    /// that writes the file).
    pub fn on_progress(mut self, report: impl FnMut(&Summary) + Send + 'static) -> Self {
        self.progress = Some(Box::new(report));
        self
    }
}

impl std::fmt::Debug for PretokenizeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PretokenizeOptions")
            .field("dtype", &self.dtype)
            .field("tokenizer", &self.tokenizer)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

/// Tokenizes every document of `corpus` with `tokenize` on `workers` threads and writes the ids,
/// in corpus order, to the token file `out`, streaming: memory stays bounded whatever the
/// corpus' size (a few documents per worker in flight, and the writer's buffers). The file
/// appears at `out` only once complete; on an error it is left as it was.
pub fn pretokenize(
    corpus: &Corpus,
    tokenize: TokenizeFn,
    workers: usize,
    out: &Path,
    mut options: PretokenizeOptions,
) -> Result<Summary> {
    let start = Instant::now();
    let dtype = options.dtype;
    let mut writer = TokenFileWriter::create(out, dtype, &options.tokenizer)?;
    tokenize_in_order(corpus.documents(), &tokenize, workers, |ids| {
        writer.push_document(&ids)?;
        if writer.documents() % PROGRESS_EVERY == 0 {
            if let Some(report) = options.progress.as_mut() {
                report(&Summary {
                    documents: writer.documents(),
                    tokens: writer.tokens(),
                    bytes: writer.tokens() * dtype.width() as u64,
                    seconds: start.elapsed().as_secs_f64(),
                    dtype,
                });
            }
        }
        Ok(())
    })?;
    let written = writer.finish()?;
    Ok(Summary {
        documents: written.documents,
        tokens: written.tokens,
        bytes: written.bytes,
        seconds: start.elapsed().as_secs_f64(),
        dtype,
    })
}
