//! The book's chapters (`docs/src/`) whose Rust code blocks use the Trainer, included as doc comments
//! so that `cargo test --doc` compiles and runs those blocks: the book cannot drift from the API.
//! Compiled only by rustdoc's test runner (`cfg(doctest)`).

/// `docs/src/accumulation.md`.
#[doc = include_str!("../../docs/src/accumulation.md")]
pub struct Accumulation;

/// `docs/src/trainer.md`.
#[doc = include_str!("../../docs/src/trainer.md")]
pub struct Trainer;
