//! The book's chapters (`docs/src/`) whose Rust code blocks use this crate, included as doc comments
//! so that `cargo test --doc` compiles and runs those blocks: the book cannot drift from the API.
//! Compiled only by rustdoc's test runner (`cfg(doctest)`).

/// `docs/src/loop.md`.
#[doc = include_str!("../../docs/src/loop.md")]
pub struct Loop;

/// `docs/src/mixed-precision.md`.
#[doc = include_str!("../../docs/src/mixed-precision.md")]
pub struct MixedPrecision;

/// `docs/src/memory.md`.
#[doc = include_str!("../../docs/src/memory.md")]
pub struct Memory;

/// `docs/src/fully-sharded.md`.
#[doc = include_str!("../../docs/src/fully-sharded.md")]
pub struct FullySharded;

/// `docs/src/data.md`.
#[doc = include_str!("../../docs/src/data.md")]
pub struct Data;

/// `docs/src/distributed.md`.
#[doc = include_str!("../../docs/src/distributed.md")]
pub struct Distributed;

/// `docs/src/checkpoints.md`.
#[doc = include_str!("../../docs/src/checkpoints.md")]
pub struct Checkpoints;

/// `docs/src/logging.md`.
#[doc = include_str!("../../docs/src/logging.md")]
pub struct Logging;
