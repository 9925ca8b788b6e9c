//! A document of a corpus: its content (text, or a conversation for the chat template) and
//! where it came from, so errors and logs can point at the line or row.

use std::path::PathBuf;
use std::sync::Arc;

/// What a document holds: plain text, or a conversation that the tokenizer's chat template
/// turns into text.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    /// Plain text, tokenized as it is.
    Text(String),
    /// A conversation: the JSON list of `{role, content, ...}` objects as found in the file,
    /// handed to the chat template as is.
    Messages(serde_json::Value),
}

/// One document of a corpus with its origin.
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    /// The file it was read from (shared by all documents of that file).
    pub source: Arc<PathBuf>,
    /// Its line (from 1) in a JSONL or text file, or its row in a Parquet file.
    pub position: usize,
    /// What it holds.
    pub content: Content,
}
