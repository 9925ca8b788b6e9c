//! The emulator's tests, in one harness: every kernel of fused-kernels' `src/cuda/*.cu` against
//! fused-kernels' CPU ops (forward, and backward through candle's `backward()`), in both
//! scheduling orders, with fused-kernels' launch shapes and another one; and the emulator's own
//! semantics (barriers, warp collectives, errors, memory checks, conversions).

mod activations;
mod add_bias;
mod blocks;
mod causal_softmax;
mod common;
mod cross_entropy;
mod embedding;
mod emulator;
mod flash_attention;
mod linear_cross_entropy;
mod norms;
mod rotary;
