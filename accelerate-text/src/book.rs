//! The book's chapter on text (`docs/src/text.md`), included as a doc comment so that
//! `cargo test --doc` compiles and runs its Rust code: the book cannot drift from the API.
//! Compiled only by rustdoc's test runner (`cfg(doctest)`).

/// `docs/src/text.md`.
#[doc = include_str!("../../docs/src/text.md")]
pub struct Text;
