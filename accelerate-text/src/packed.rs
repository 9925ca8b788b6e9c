//! [`PackedRows`]: a map-style dataset of packed rows (see [`packing`](crate::packing)) over a
//! token file or over tokens tokenized into memory at startup.

use std::ops::Range;
use std::sync::Arc;

use accelerate_core::data::Dataset;

use crate::batch::TextBatch;
use crate::core_error::to_core;
use crate::corpus::Corpus;
use crate::error::{Error, Result};
use crate::packing::{packed_row, packed_rows, MemoryTokens, StoredTokens};
use crate::pipeline::tokenize_in_order;
use crate::row::TokenRow;
use crate::token_file::TokenFile;
use crate::tokenize_fn::TokenizeFn;

/// Where the rows' tokens are.
#[derive(Debug)]
enum Source {
    File(Arc<TokenFile>),
    Memory(MemoryTokens),
}

/// The documents `docs` of a store, seen as a store of their own (a split's side).
struct View<'a, S> {
    stored: &'a S,
    docs: Range<usize>,
    base: u64,
    end: u64,
}

impl<'a, S: StoredTokens> View<'a, S> {
    fn new(stored: &'a S, docs: Range<usize>) -> Result<Self> {
        Ok(Self {
            base: stored.document_start(docs.start)?,
            end: stored.document_start(docs.end)?,
            stored,
            docs,
        })
    }
}

impl<S: StoredTokens> StoredTokens for View<'_, S> {
    fn token_count(&self) -> u64 {
        self.end.saturating_sub(self.base)
    }

    fn document_count(&self) -> usize {
        self.docs.len()
    }

    fn document_start(&self, doc: usize) -> Result<u64> {
        Ok(self
            .stored
            .document_start(self.docs.start + doc)?
            .saturating_sub(self.base))
    }

    fn read_tokens(&self, start: u64, len: usize, out: &mut Vec<u32>) -> Result<()> {
        self.stored.read_tokens(self.base + start, len, out)
    }
}

/// Rows of exactly `block_size` tokens, documents packed into them in corpus order with their
/// boundaries kept (run_clm.py's `group_texts`, plus segment ids), as a map-style
/// [`Dataset`]: the [`DataLoader`](accelerate_core::data::DataLoader) gives it sharding between
/// ranks, seeded shuffling, exact resume and `gather_for_metrics` as for any dataset. Every batch
/// has the same shape. An item is one [`TokenRow`]; a batch a [`TextBatch`].
///
/// The tokens come from a [`TokenFile`] (mapped, never loaded: for corpora larger than memory or
/// read many times) or are tokenized into memory at startup ([`PackedRows::tokenize`]).
#[derive(Debug)]
pub struct PackedRows {
    source: Source,
    docs: Range<usize>,
    block_size: usize,
    rows: usize,
    tokens: u64,
}

impl PackedRows {
    /// The rows of every document of a token file.
    pub fn from_token_file(file: Arc<TokenFile>, block_size: usize) -> Result<Self> {
        let docs = 0..file.documents();
        Self::from_token_file_documents(file, docs, block_size)
    }

    /// The rows of documents `docs` of a token file (for a held-out split, see
    /// [`validation_split`](crate::validation_split)).
    pub fn from_token_file_documents(
        file: Arc<TokenFile>,
        docs: Range<usize>,
        block_size: usize,
    ) -> Result<Self> {
        if docs.start > docs.end || docs.end > file.documents() {
            return Err(Error::Text(format!(
                "documents {docs:?} requested from {}, which holds {}",
                file.path().display(),
                file.documents()
            )));
        }
        let what = file.path().display().to_string();
        Self::new(Source::File(file), docs, block_size, &what)
    }

    /// Tokenizes every document of `corpus` with `tokenize` on `workers` threads, into memory
    /// (4 bytes per token), and packs them: run_clm.py's `datasets.map` over the corpus followed
    /// by `group_texts`. For corpora that fit in memory; larger ones go through a token file.
    pub fn tokenize(
        corpus: &Corpus,
        tokenize: TokenizeFn,
        workers: usize,
        block_size: usize,
    ) -> Result<Self> {
        let mut stored = MemoryTokens::new();
        tokenize_in_order(corpus.documents(), &tokenize, workers, |ids| {
            stored.push(&ids);
            Ok(())
        })?;
        stored.tokens.shrink_to_fit();
        let docs = 0..stored.document_count();
        let what = format!(
            "the corpus {:?}",
            corpus.files().map(|(p, _)| p).collect::<Vec<_>>()
        );
        Self::new(Source::Memory(stored), docs, block_size, &what)
    }

    fn new(source: Source, docs: Range<usize>, block_size: usize, what: &str) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::Text(
                "the block size (tokens per packed row) is 0; pass the context length".into(),
            ));
        }
        let mut packed = Self {
            source,
            docs,
            block_size,
            rows: 0,
            tokens: 0,
        };
        packed.tokens = packed.with_view(|v| Ok(v.token_count()))?;
        packed.rows = packed_rows(packed.tokens, block_size);
        if packed.rows == 0 {
            return Err(Error::Text(format!(
                "{what} holds {} tokens in {} documents, less than one row of {block_size}; \
                 lower the block size or use more text",
                packed.tokens,
                packed.docs.len()
            )));
        }
        Ok(packed)
    }

    fn with_view<T>(&self, f: impl FnOnce(&dyn ErasedView) -> Result<T>) -> Result<T> {
        match &self.source {
            Source::File(file) => f(&View::new(file.as_ref(), self.docs.clone())?),
            Source::Memory(memory) => f(&View::new(memory, self.docs.clone())?),
        }
    }

    /// Tokens per row.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Documents packed.
    pub fn documents(&self) -> usize {
        self.docs.len()
    }

    /// Tokens of the documents, the dropped remainder included.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Tokens of the incomplete last row, which no row holds.
    pub fn dropped_tokens(&self) -> u64 {
        self.tokens - self.rows as u64 * self.block_size as u64
    }

    /// Row `index`.
    pub fn row(&self, index: usize) -> Result<TokenRow> {
        self.with_view(|v| v.row(self.block_size, index))
    }
}

/// A [`View`] of either source, behind one type.
trait ErasedView {
    fn token_count(&self) -> u64;
    fn row(&self, block_size: usize, index: usize) -> Result<TokenRow>;
}

impl<S: StoredTokens> ErasedView for View<'_, S> {
    fn token_count(&self) -> u64 {
        StoredTokens::token_count(self)
    }

    fn row(&self, block_size: usize, index: usize) -> Result<TokenRow> {
        packed_row(self, block_size, index)
    }
}

impl Dataset for PackedRows {
    type Item = TokenRow;
    type Batch = TextBatch;

    fn len(&self) -> usize {
        self.rows
    }

    fn get(&self, index: usize) -> accelerate_core::Result<TokenRow> {
        self.row(index).map_err(to_core)
    }

    /// The rows as they are (all of `block_size` tokens: no padding).
    fn collate(&self, items: Vec<TokenRow>) -> accelerate_core::Result<TextBatch> {
        TextBatch::from_rows(&items, 0).map_err(to_core)
    }
}
