//! The book's chapters (`docs/src/`) whose Rust code blocks use these kernels, included as doc comments
//! so that `cargo test --doc` compiles and runs those blocks: the book cannot drift from the API.
//! Compiled only by rustdoc's test runner (`cfg(doctest)`).

/// `docs/src/fused-kernels.md`.
#[doc = include_str!("../../docs/src/fused-kernels.md")]
pub struct FusedKernels;
