//! Trainable fused CPU kernels for [candle](https://github.com/huggingface/candle) transformers.
//!
//! Each function here is one candle `CustomOp` with a forward pass and a backward pass, so
//! `Tensor::backward` reaches through it (candle-nn's fused `layer_norm`, `rms_norm` and
//! `softmax_last_dim` record no backward, and its differentiable versions are chains of small
//! ops). A backward pass is itself one op that computes every gradient in one pass over the rows.
//!
//! | function | computes |
//! |---|---|
//! | [`layer_norm`] | LayerNorm over the last dimension |
//! | [`rms_norm`] | RMSNorm over the last dimension (Llama's) |
//! | [`causal_softmax`] | softmax of scaled attention scores under a causal mask |
//! | [`flash_attention`] | causal attention without the `T × T` scores (FlashAttention-2), grouped-query heads |
//! | [`cross_entropy`] | weighted, summed cross-entropy from logits |
//! | [`gelu`], [`silu`], [`swiglu`] | activations (GELU's tanh approximation) |
//! | [`rotary`] | rotary position embeddings (Hugging Face's `rotate_half` convention) |
//! | [`add_bias`], [`linear`] | a bias add whose gradient is a contiguous row sum |
//! | [`embedding`] | an embedding lookup whose gradient is a deterministic f32 scatter-add |
//! | [`linear_cross_entropy`] | the cross-entropy of `x · weightᵀ` without the batch's logits in f32 |
//!
//! [`checkpoint`] is activation checkpointing for any candle block: its intermediate tensors are
//! recomputed during the backward pass instead of kept.
//!
//! Every op takes f32 and f64, and bf16/f16 computed in f32. Inputs may have any layout (the
//! functions make them contiguous). Large tensors are split over rayon's threads by rows.
//! The kernels run on the CPU, and with the `cuda` feature on CUDA devices too (every forward and
//! backward op has a CUDA kernel, compiled from `src/cuda/*.cu` to PTX at build time; f32, f64, and
//! bf16/f16 computed in f32). On another device (Metal, or CUDA without the feature) each function
//! computes the same formula with candle's differentiable ops instead (slower, still trainable).

#![deny(missing_docs)]

mod add_bias;
mod attention_block;
mod attention_reference;
mod block_kernels;
mod causal_softmax;
pub mod checkpoint;
mod cross_entropy;
#[cfg(feature = "cuda")]
mod cuda;
mod element;
mod elementwise;
mod embedding;
mod fallback;
mod flash_attention;
mod gelu;
mod layer_norm;
mod linear;
mod linear_cross_entropy;
mod mlp_block;
mod node;
mod norm;
mod projection;
mod raw;
mod residual;
mod rms_norm;
mod rotary;
mod rows;
mod silu;
mod swiglu;
#[cfg(test)]
mod test_reference;

pub use add_bias::add_bias;
pub use attention_block::{attention_block, Attention, Qkv, Rotary};
pub use causal_softmax::causal_softmax;
pub use cross_entropy::cross_entropy;
pub use embedding::embedding;
pub use flash_attention::flash_attention;
pub use gelu::gelu;
pub use layer_norm::layer_norm;
pub use linear::linear;
pub use linear_cross_entropy::{linear_cross_entropy, linear_cross_entropy_in_chunks};
pub use mlp_block::{mlp_block, Mlp, MlpKind};
pub use norm::Norm;
pub use projection::{Lora, Projection};
pub use rms_norm::rms_norm;
pub use rotary::rotary;
pub use silu::silu;
pub use swiglu::swiglu;
