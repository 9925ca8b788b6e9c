//! The `llama` workload: a Llama-architecture language model (RMSNorm, rotary position
//! embeddings, SwiGLU MLP, grouped-query attention, untied head) that reads and writes Hugging
//! Face's `config.json` and parameter names, trained with transformers' causal-LM loss.
//!
//! - [`config`]: the model's size, from a `LlamaForCausalLM` config.json (transformers 4.x or
//!   5.x) or from flags, and written back as one.
//! - [`model`]: the model and its summed causal-LM loss, on rows of one sequence or on packed
//!   rows of several documents.
//! - [`segments`]: where the documents of packed rows are, and how the model batches them.
//! - [`model_dir`]: Hugging Face model directories, read (`--model`) and written
//!   (`--output-dir`).
//! - [`data`]: rows of token ids (`input_ids` `[N, T]` of a safetensors file, or a text cut into
//!   rows).
//! - [`text`]: a text corpus (`--train-file`): tokenized with a Hugging Face tokenizer and
//!   packed into rows, or a token file.
//! - [`cli`]: the flags of a training run ([`LlamaArgs`]), their checks, the data and model size
//!   they pick.
//! - [`train`]: the training loop ([`LlamaRun`]), shared by the `llama` and `lora` examples.

pub mod cli;
pub mod config;
pub mod data;
pub mod model;
pub mod model_dir;
pub mod segments;
pub mod text;
pub mod train;

pub use cli::LlamaArgs;
pub use config::{default_intermediate, LlamaConfig};
pub use data::{RowBatch, TokenRows, INPUT_IDS};
pub use model::{
    build_in, causal_lm_loss_sum, init_weights, unit_specs, Llama, DECODER_LAYER_CLASS,
};
pub use model_dir::{write_model_dir, ModelDir, ModelOutput, TokenIds};
pub use segments::Segments;
pub use text::{TextArgs, TextData};
pub use train::{row_losses, LlamaRun};
