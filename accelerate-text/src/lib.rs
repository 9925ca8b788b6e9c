//! Training on text: Hugging Face tokenizers, corpora of JSONL, Parquet and plain-text files,
//! packing into fixed-length rows, and token files for corpora read many times, as datasets for
//! accelerate-core's loaders.

mod chat;
mod document;
mod error;
mod tokenizer;

pub use document::{Content, Document};
pub use error::{Error, Result};
pub use tokenizer::Tokenizer;
