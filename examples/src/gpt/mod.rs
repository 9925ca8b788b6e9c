//! The `gpt` workload: a small decoder-only transformer trained as a character-level language
//! model on windows of a text.
//!
//! - [`text`]: the built-in text, the character vocabulary and the unigram entropy (the loss a
//!   model that ignores context cannot beat).
//! - [`windows`]: the dataset of text windows of seeded, varying lengths, padded per batch with a
//!   mask (the items of item-weighted accumulation are the non-padding tokens).
//! - [`model`]: the transformer (GPT-2 / nanoGPT names and PyTorch `nn.Linear` layouts) and the
//!   summed token cross-entropy.
//! - [`units`]: the same transformer computed through a prepared model's units, which is how it
//!   trains at every ZeRO stage (stage 3 shards it unit by unit).

pub mod model;
pub mod text;
pub mod units;
pub mod windows;

pub use model::{build_in, init_weights, summed_token_loss, Dropout, Gpt, GptConfig};
pub use text::{unigram_entropy, CharVocab, DEFAULT_TEXT};
pub use units::{unit_specs, GptUnits, BLOCK_CLASS};
pub use windows::{TextWindows, TokenBatch};
