//! Trainable fused CPU and CUDA kernels for [candle](https://github.com/huggingface/candle)
//! transformers, and fused layers made of them.
//!
//! Each function here is one candle node with a forward pass and a backward pass, so
//! `Tensor::backward` reaches through it (candle-nn's fused `layer_norm`, `rms_norm` and
//! `softmax_last_dim` record no backward, and its differentiable versions are chains of small
//! ops). A backward pass computes every gradient with a few kernels.
//!
//! | function | computes |
//! |---|---|
//! | [`attention_block`] | `x + out(attention(rotary(qkv(norm(x)))))`: a pre-norm attention layer (GPT-2's, Llama's) as one node |
//! | [`mlp_block`] | `x + down(act(up(norm(x))))`: a pre-norm MLP layer (GELU, SwiGLU) as one node |
//! | [`linear`] | `x · weightᵀ + bias` as one node |
//! | [`layer_norm`] | LayerNorm over the last dimension |
//! | [`rms_norm`] | RMSNorm over the last dimension (Llama's) |
//! | [`causal_softmax`] | softmax of scaled attention scores under a causal mask |
//! | [`flash_attention`] | causal attention without the `T × T` scores (FlashAttention-2), grouped-query heads |
//! | [`cross_entropy`] | weighted, summed cross-entropy from logits |
//! | [`linear_cross_entropy`] | the cross-entropy of `x · weightᵀ` without the batch's logits in f32 |
//! | [`embedding`] | an embedding lookup whose gradient is a deterministic f32 scatter-add |
//! | [`gelu`], [`silu`], [`swiglu`] | activations (GELU's tanh approximation) |
//! | [`rotary`] | rotary position embeddings (Hugging Face's `rotate_half` convention) |
//! | [`add_bias`] | a bias add whose gradient is one row sum |
//!
//! The layers take their parameters as [`Norm`], [`Projection`] (with an optional [`Lora`]
//! adapter), [`Qkv`], [`Rotary`] and [`MlpKind`]; a parameter candle does not track (a frozen
//! weight) gets no gradient and costs no product for one.
//!
//! [`checkpoint`] is activation checkpointing for any candle block: its intermediate tensors are
//! recomputed during the backward pass instead of kept.
//!
//! Every op takes f32 and f64, and bf16/f16 computed in f32. Inputs may have any layout (the
//! functions make them contiguous where they need to). Large tensors are split over rayon's
//! threads by rows. The kernels run on the CPU, and with the `cuda` feature on CUDA devices too
//! (compiled from `src/cuda/*.cu` at build time into machine code for sm_80 and sm_90 plus PTX
//! for newer GPUs; flash attention's tensor-core kernels take bf16/f16 at head dims 64 and 128,
//! other cases compute attention with cuBLAS products). On another device (Metal, or CUDA without
//! the feature) each function computes the same formula with candle's differentiable ops instead
//! (slower, still trainable).

#![deny(missing_docs)]

mod activation;
mod add_bias;
mod attention_block;
mod attention_reference;
mod block_kernels;
#[cfg(doctest)]
mod book;
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
mod row_norm;
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
