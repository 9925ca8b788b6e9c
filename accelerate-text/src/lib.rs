//! Training on text: Hugging Face tokenizers, corpora of JSONL, Parquet and plain-text files,
//! packing into fixed-length rows, and token files for corpora read many times, as datasets for
//! accelerate-core's loaders.

mod batch;
#[cfg(doctest)]
mod book;
mod chat;
mod core_error;
mod corpus;
mod document;
mod error;
mod format;
mod jsonl_source;
mod packed;
mod packing;
mod parquet_source;
mod pipeline;
mod pretokenize;
mod row;
mod split;
mod streamed;
mod text_source;
mod token_file;
mod token_writer;
mod tokenize_fn;
mod tokenizer;

pub use batch::TextBatch;
pub use corpus::Corpus;
pub use document::{Content, Document};
pub use error::{Error, Result};
pub use format::{Format, SampleBy};
pub use packed::PackedRows;
pub use packing::{packed_rows, Packer};
pub use pretokenize::{pretokenize, PretokenizeOptions, Summary, PROGRESS_EVERY};
pub use row::TokenRow;
pub use split::validation_split;
pub use streamed::TokenizedCorpus;
pub use token_file::{TokenDtype, TokenFile};
pub use token_writer::{TokenFileSummary, TokenFileWriter};
pub use tokenize_fn::TokenizeFn;
pub use tokenizer::Tokenizer;
