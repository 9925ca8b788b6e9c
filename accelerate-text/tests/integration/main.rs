//! accelerate-text's integration tests, in one harness: the tokenizer against ids from Hugging
//! Face's Python `tokenizers` and `transformers` (tests/fixtures/text/, written by
//! tests/python/make_text_fixtures.py), corpora against the fixtures' sidecar (written by pyarrow
//! and `datasets`, tests/fixtures/corpus/), packing against a naive reference, token files against
//! their byte layout, and the datasets through accelerate-core's loaders.

mod command;
mod common;
mod corpus;
mod packed;
mod pretokenize;
mod split;
mod streamed;
mod token_file;
mod tokenizer_conformance;
mod tokenizer_files;

use std::path::PathBuf;

use serde_json::Value;

/// tests/fixtures/text/ at the repository root.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/text")
}

/// The tokenizer directory saved by transformers.
pub fn tokenizer_dir() -> PathBuf {
    fixtures().join("tokenizer")
}

/// expected.json: what transformers gives for the fixtures.
pub fn expected() -> Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A JSON list of ids.
pub fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not a list of ids: {value}"))
        .iter()
        .map(|id| id.as_u64().unwrap() as u32)
        .collect()
}

/// A JSON id or null.
pub fn id(value: &Value) -> Option<u32> {
    value.as_u64().map(|id| id as u32)
}
