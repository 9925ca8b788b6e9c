//! [`TokenizedCorpus`]: a corpus as a stream for accelerate-core's
//! [`StreamingLoader`](accelerate_core::data::StreamingLoader), tokenized on the loader's workers,
//! one document per row, padded per batch.

use accelerate_core::data::{IterableDataset, Records};

use crate::batch::TextBatch;
use crate::core_error::to_core;
use crate::corpus::{location, Corpus};
use crate::document::Document;
use crate::error::{Error, Result};
use crate::row::TokenRow;
use crate::tokenize_fn::TokenizeFn;

/// A corpus read as a stream: each record is a [`Document`], read in corpus order by every rank
/// (the [`StreamingLoader`](accelerate_core::data::StreamingLoader) shards it by position); it is
/// tokenized on the loader's workers (so tokenization overlaps training) into one row, cut to
/// `max_length` tokens. A batch pads its rows at the end to the longest with `pad_id` (segment
/// 0), as run_clm.py without packing; batches differ in width.
///
/// Memory stays bounded whatever the corpus' size: the loader holds only the records of the
/// batches it looks ahead.
pub struct TokenizedCorpus {
    corpus: Corpus,
    tokenize: TokenizeFn,
    max_length: usize,
    pad_id: u32,
}

impl TokenizedCorpus {
    /// The stream of `corpus`, tokenized by `tokenize`, rows of at most `max_length` tokens (at
    /// least 1), padded with `pad_id`.
    pub fn new(
        corpus: Corpus,
        tokenize: TokenizeFn,
        max_length: usize,
        pad_id: u32,
    ) -> Result<Self> {
        if max_length == 0 {
            return Err(Error::Text(
                "the maximum row length is 0; pass the context length (at least 1 token)".into(),
            ));
        }
        Ok(Self {
            corpus,
            tokenize,
            max_length,
            pad_id,
        })
    }

    /// The corpus read.
    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    /// Longest row, in tokens.
    pub fn max_length(&self) -> usize {
        self.max_length
    }
}

impl std::fmt::Debug for TokenizedCorpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizedCorpus")
            .field("corpus", &self.corpus)
            .field("max_length", &self.max_length)
            .field("pad_id", &self.pad_id)
            .finish_non_exhaustive()
    }
}

impl IterableDataset for TokenizedCorpus {
    type Record = Document;
    type Item = TokenRow;
    type Batch = TextBatch;

    /// The same stream every epoch: the corpus in order.
    fn records(&self, _epoch: u64) -> accelerate_core::Result<Records<'_, Document>> {
        Ok(Box::new(
            self.corpus.documents().map(|d| d.map_err(to_core)),
        ))
    }

    fn transform(&self, record: Document) -> accelerate_core::Result<TokenRow> {
        let mut ids = (self.tokenize)(&record.content).map_err(|e| {
            accelerate_core::Error::Data(format!(
                "{}: cannot tokenize the document: {e}",
                location(&record)
            ))
        })?;
        ids.truncate(self.max_length);
        Ok(TokenRow::single(ids))
    }

    fn collate(&self, items: Vec<TokenRow>) -> accelerate_core::Result<TextBatch> {
        TextBatch::from_rows(&items, self.pad_id).map_err(to_core)
    }
}
