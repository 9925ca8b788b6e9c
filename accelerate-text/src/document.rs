//! [`Document`]: one sample of a corpus, what the tokenizer turns into token ids, and where it came
//! from (for error messages).

use std::path::PathBuf;
use std::sync::Arc;

/// What a document holds: plain text, or a conversation for the tokenizer's chat template.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    /// Text, tokenized as it is.
    Text(String),
    /// The JSON list of messages (`{role, content, ...}` objects) as found in the file, handed to
    /// the chat template as is.
    Messages(serde_json::Value),
}

/// One document of a corpus: its content and where it was read.
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    /// The file it was read from (shared by the file's documents).
    pub source: Arc<PathBuf>,
    /// Its line in the file (from 1) for JSON Lines and text files; its row (from 0, as pyarrow
    /// counts) for Parquet files.
    pub position: usize,
    /// The text or the conversation.
    pub content: Content,
}
