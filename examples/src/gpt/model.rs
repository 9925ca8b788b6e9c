//! The transformer of the `gpt` workload: token and learned position embeddings, `layers` blocks of
//! pre-LayerNorm causal multi-head self-attention and a GELU MLP, a final LayerNorm and a linear
//! head — GPT-2's architecture at toy size.
//!
//! Parameter names are GPT-2's / nanoGPT's (`wte.weight`, `wpe.weight`, `h.0.ln_1.weight`,
//! `h.0.attn.c_attn.weight`, `h.0.attn.c_proj.weight`, `h.0.mlp.c_fc.weight`,
//! `h.0.mlp.c_proj.weight`, `ln_f.weight`, `lm_head.weight`), with PyTorch `nn.Linear` layouts
//! (`[out, in]`, as nanoGPT; Hugging Face's GPT-2 stores the transposes in `Conv1D`s). The head is
//! not tied to the token embedding.
//!
//! Under mixed precision the model is built in the compute dtype; the attention softmax and the
//! logits are computed in f32, as autocast does.
//!
//! Each block is two trainable nodes of the `fused-kernels` crate: [`fused_kernels::attention_block`]
//! (LayerNorm, `c_attn`, causal flash attention, `c_proj`, the residual add) and
//! [`fused_kernels::mlp_block`] (LayerNorm, `c_fc`, GELU, `c_proj`, the residual add), whose own
//! backward passes compute every gradient, instead of ~60 candle nodes whose gradients candle
//! creates as zeros and adds into. With dropout the blocks run unfused (flash attention has no
//! dropout of the attention probabilities): the same layers out of the single fused kernels
//! (LayerNorm, GELU, the causal softmax, the bias adds).
//!
//! Dropout is GPT-2's, at one probability: on the sum of the embeddings, on the attention
//! probabilities, and on each residual branch (after the attention's and the MLP's output
//! projections). Its masks come from the accelerator's per-rank generator
//! ([`accelerate_core::RankRng`]), which checkpoints save, so a run with dropout resumes bitwise.
//!
//! With [gradient checkpointing](Gpt::set_gradient_checkpointing) each block runs under
//! [`fused_kernels::checkpoint`]: its activations are dropped after the forward pass and
//! recomputed in the backward pass, the generator rewound so that dropout draws the same masks.
//! Gradients are bitwise those without it on the CPU.

use std::sync::Arc;

use accelerate_core::RankRng;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder, VarMap};

use crate::layers::RankRngState;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// LayerNorm's epsilon (PyTorch's default).
const LN_EPS: f32 = 1e-5;

/// The size of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// Longest sequence (positions of the position embedding).
    pub context: usize,
    /// Embedding width.
    pub width: usize,
    /// Attention heads; must divide `width`.
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
}

/// Training-mode dropout: probability `p` (0 is off), masks drawn from `rng`.
#[derive(Debug, Clone)]
pub struct Dropout {
    /// The generator the masks come from (a handle on `Accelerator::rng`).
    pub rng: RankRng,
    /// The probability of zeroing an element, in `[0, 1)`.
    pub p: f64,
}

/// `x` through `dropout`, or unchanged without it (evaluation).
pub(super) fn drop(x: Tensor, dropout: Option<&Dropout>) -> Result<Tensor> {
    match dropout {
        Some(d) if d.p > 0.0 => d
            .rng
            .dropout(&x, d.p)
            .map_err(|e| candle_core::Error::Msg(e.to_string())),
        _ => Ok(x),
    }
}

/// The model (see the module docs).
#[derive(Debug, Clone)]
pub struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: Norm,
    lm_head: Linear,
    config: GptConfig,
    gradient_checkpointing: bool,
}

/// LayerNorm through a differentiable path: candle-nn's `LayerNorm::forward` takes a fused kernel
/// for contiguous inputs that records no backward pass, so no gradient would reach the layer or
/// anything before it; [`fused_kernels::layer_norm`] has one. The parameters are still
/// candle-nn's (`layer_norm` creates them).
#[derive(Debug, Clone)]
pub(super) struct Norm(LayerNorm);

impl Norm {
    pub(super) fn new(width: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self(candle_nn::layer_norm(width, LN_EPS as f64, vb)?))
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let bias = self.0.bias().expect("layer_norm creates a bias");
        fused_kernels::layer_norm(x, self.0.weight(), bias, LN_EPS as f64)
    }

    /// The same norm as a fused layer's.
    fn fused(&self) -> fused_kernels::Norm {
        fused_kernels::Norm::Layer {
            weight: self.0.weight().clone(),
            bias: self.0.bias().expect("layer_norm creates a bias").clone(),
            eps: LN_EPS as f64,
        }
    }
}

/// candle-nn's `Linear` as a fused layer's projection (the same tensors).
fn projection(layer: &Linear) -> fused_kernels::Projection {
    fused_kernels::Projection::new(layer.weight().clone(), layer.bias().cloned())
}

#[derive(Debug, Clone)]
pub(super) struct Block {
    ln_1: Norm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: Norm,
    c_fc: Linear,
    mlp_proj: Linear,
    heads: usize,
}

impl Block {
    pub(super) fn new(c: &GptConfig, vb: VarBuilder) -> Result<Self> {
        let w = c.width;
        Ok(Self {
            ln_1: Norm::new(w, vb.pp("ln_1"))?,
            c_attn: candle_nn::linear(w, 3 * w, vb.pp("attn.c_attn"))?,
            attn_proj: candle_nn::linear(w, w, vb.pp("attn.c_proj"))?,
            ln_2: Norm::new(w, vb.pp("ln_2"))?,
            c_fc: candle_nn::linear(w, 4 * w, vb.pp("mlp.c_fc"))?,
            mlp_proj: candle_nn::linear(4 * w, w, vb.pp("mlp.c_proj"))?,
            heads: c.heads,
        })
    }

    pub(super) fn forward(&self, x: &Tensor, dropout: Option<&Dropout>) -> Result<Tensor> {
        match dropout {
            Some(d) if d.p > 0.0 => self.forward_unfused(x, dropout),
            _ => {
                let x = fused_kernels::attention_block(x, &self.fused_attention())?;
                fused_kernels::mlp_block(&x, &self.fused_mlp())
            }
        }
    }

    /// The attention half as [`fused_kernels::attention_block`] sees it (the same tensors).
    fn fused_attention(&self) -> fused_kernels::Attention {
        fused_kernels::Attention {
            norm: self.ln_1.fused(),
            qkv: fused_kernels::Qkv::Packed(projection(&self.c_attn)),
            out: projection(&self.attn_proj),
            heads: self.heads,
            kv_heads: self.heads,
            rotary: None,
        }
    }

    /// The MLP half as [`fused_kernels::mlp_block`] sees it.
    fn fused_mlp(&self) -> fused_kernels::Mlp {
        fused_kernels::Mlp {
            norm: self.ln_2.fused(),
            kind: fused_kernels::MlpKind::Gelu {
                fc: projection(&self.c_fc),
                proj: projection(&self.mlp_proj),
            },
        }
    }

    /// The block out of single ops, with dropout in GPT-2's places.
    fn forward_unfused(&self, x: &Tensor, dropout: Option<&Dropout>) -> Result<Tensor> {
        let x = (x + drop(self.attention(&self.ln_1.forward(x)?, dropout)?, dropout)?)?;
        let h = fused_kernels::gelu(&linear(&self.c_fc, &self.ln_2.forward(&x)?)?)?;
        x + drop(linear(&self.mlp_proj, &h)?, dropout)?
    }

    /// [`forward`](Self::forward) under [`fused_kernels::checkpoint`]: the same output and
    /// gradients, the activations recomputed in the backward pass (with the same dropout masks).
    pub(super) fn forward_checkpointed(
        &self,
        x: &Tensor,
        dropout: Option<&Dropout>,
    ) -> Result<Tensor> {
        let block = self.clone();
        match dropout.filter(|d| d.p > 0.0).cloned() {
            None => fused_kernels::checkpoint::checkpoint(x, move |x| block.forward(x, None)),
            Some(d) => {
                let state = Arc::new(RankRngState(d.rng.clone()));
                fused_kernels::checkpoint::checkpoint_with_random_state(
                    x,
                    move |x| block.forward(x, Some(&d)),
                    state,
                )
            }
        }
    }

    /// Causal multi-head self-attention of `x` `[b, t, width]`. Padding lies after the real
    /// tokens, so the causal mask alone keeps it out of every real token's attention.
    fn attention(&self, x: &Tensor, dropout: Option<&Dropout>) -> Result<Tensor> {
        let (b, t, w) = x.dims3()?;
        let hd = w / self.heads;
        // [b, t, 3w] -> [3, b, heads, t, hd]
        let qkv = linear(&self.c_attn, x)?
            .reshape((b, t, 3, self.heads, hd))?
            .permute((2, 0, 3, 1, 4))?;
        let q = qkv.get(0)?.contiguous()?;
        let k = qkv.get(1)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        // Scaled, masked and normalized in one op, in f32 for bf16 scores.
        let att = fused_kernels::causal_softmax(&q.matmul(&k.t()?)?, 1.0 / (hd as f64).sqrt())?;
        let att = drop(att, dropout)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, w))?;
        linear(&self.attn_proj, &y)
    }
}

impl Gpt {
    /// Creates the parameters under `vb`, in `vb`'s dtype (candle-nn's default initial values;
    /// [`init_weights`] replaces them with GPT-2's). `width` must be divisible by `heads`.
    pub fn new(vb: VarBuilder, config: GptConfig) -> Result<Self> {
        let c = config;
        if c.heads == 0 || !c.width.is_multiple_of(c.heads) {
            candle_core::bail!(
                "width {} is not divisible by heads {}: every head takes width / heads dimensions",
                c.width,
                c.heads
            );
        }
        let blocks = (0..c.layers)
            .map(|i| Block::new(&c, vb.pp(format!("h.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            wte: candle_nn::embedding(c.vocab, c.width, vb.pp("wte"))?,
            wpe: candle_nn::embedding(c.context, c.width, vb.pp("wpe"))?,
            blocks,
            ln_f: Norm::new(c.width, vb.pp("ln_f"))?,
            lm_head: candle_nn::linear_no_bias(c.width, c.vocab, vb.pp("lm_head"))?,
            config,
            gradient_checkpointing: false,
        })
    }

    /// Runs each block under activation checkpointing (Hugging Face's `gradient_checkpointing`)
    /// when `on`: less memory for one more forward pass of the blocks per step.
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.gradient_checkpointing = on;
    }

    /// Whether the blocks run under activation checkpointing.
    pub fn gradient_checkpointing(&self) -> bool {
        self.gradient_checkpointing
    }

    /// The model's size.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// Logits `[b, t, vocab]` in f32 of the next token at every position of `tokens` `[b, t]`
    /// (u32, `t <= context`). Position `i` sees positions `0..=i` only. No dropout (evaluation).
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        self.forward_with(tokens, None)
    }

    /// [`forward`](Self::forward) in training mode with `dropout` (none when `None`).
    pub fn forward_with(&self, tokens: &Tensor, dropout: Option<&Dropout>) -> Result<Tensor> {
        logits(&self.hidden(tokens, dropout)?, self.lm_head.weight())
    }

    /// The training loss: [`summed_token_loss`] of [`forward_with`](Self::forward_with)'s logits,
    /// computed by the fused head and cross-entropy ([`fused_kernels::linear_cross_entropy`]),
    /// which never holds the batch's logits in f32. `targets` `[b, t]` (u32), `mask` `[b, t]` (1
    /// for a real token, 0 for padding).
    pub fn summed_loss(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        mask: &Tensor,
        dropout: Option<&Dropout>,
    ) -> Result<Tensor> {
        head_loss(
            &self.hidden(tokens, dropout)?,
            self.lm_head.weight(),
            targets,
            mask,
        )
    }

    /// The final LayerNorm's output `[b, t, width]`: what the head reads.
    fn hidden(&self, tokens: &Tensor, dropout: Option<&Dropout>) -> Result<Tensor> {
        let x = embed(
            tokens,
            self.wte.embeddings(),
            self.wpe.embeddings(),
            &self.config,
        )?;
        let mut x = drop(x, dropout)?;
        for block in &self.blocks {
            x = if self.gradient_checkpointing {
                block.forward_checkpointed(&x, dropout)?
            } else {
                block.forward(&x, dropout)?
            };
        }
        self.ln_f.forward(&x)
    }
}

/// The sum of the token and position embeddings of `tokens` `[b, t]` (u32, `t <= context`):
/// `[b, t, width]`, before dropout.
pub(super) fn embed(tokens: &Tensor, wte: &Tensor, wpe: &Tensor, c: &GptConfig) -> Result<Tensor> {
    let (b, t) = tokens.dims2()?;
    if t > c.context {
        candle_core::bail!(
            "a sequence of {t} tokens is longer than the model's context of {}",
            c.context
        );
    }
    let w = c.width;
    // The position embedding of positions 0..t, `[t, w]`, is the same "bias" for every
    // sequence `[t · w]` (its first rows: a view, whose gradient candle passes through).
    let positions = wpe.narrow(0, 0, t)?;
    fused_kernels::add_bias(
        &fused_kernels::embedding(tokens, wte)?.reshape((b, t * w))?,
        &positions.reshape(t * w)?,
    )?
    .reshape((b, t, w))
}

/// The training loss of the final LayerNorm's output `h` `[b, t, width]` through the head
/// `lm_head` `[vocab, width]`: [`summed_token_loss`] by the fused head and cross-entropy
/// ([`fused_kernels::linear_cross_entropy`]).
pub(super) fn head_loss(
    h: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    mask: &Tensor,
) -> Result<Tensor> {
    let (b, t, w) = h.dims3()?;
    fused_kernels::linear_cross_entropy(
        &h.reshape((b * t, w))?,
        lm_head,
        &targets.reshape(b * t)?,
        &mask.reshape(b * t)?.to_dtype(DType::F32)?,
    )
}

/// `x · Wᵀ + b` of the head's weight, in f32: the logits.
pub(super) fn logits(h: &Tensor, lm_head: &Tensor) -> Result<Tensor> {
    fused_kernels::linear(h, lm_head, None)?.to_dtype(DType::F32)
}

/// The sum over real tokens of the cross-entropy of `logits` `[b, t, vocab]` against `targets`
/// `[b, t]` (u32), weighted by `mask` `[b, t]` (1 for a real token, 0 for padding): the summed
/// loss of item-weighted accumulation. A scalar (f32 for f32 logits), by the fused
/// [`fused_kernels::cross_entropy`].
pub fn summed_token_loss(logits: &Tensor, targets: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    fused_kernels::cross_entropy(
        &logits.reshape((b * t, v))?,
        &targets.reshape(b * t)?,
        &mask.reshape(b * t)?,
    )
}

/// `layer`'s `x · Wᵀ + b` through [`fused_kernels::linear`]: candle-nn's products, and a bias add
/// whose gradient is one contiguous sum over rows.
fn linear(layer: &Linear, x: &Tensor) -> Result<Tensor> {
    fused_kernels::linear(x, layer.weight(), layer.bias())
}

/// Builds the model in `dtype` (the accelerator's compute dtype) in a fresh `VarMap`, with
/// seeded GPT-2 initial weights (see [`init_weights`]).
pub fn build_in(
    config: GptConfig,
    seed: u64,
    device: &Device,
    dtype: DType,
) -> Result<(VarMap, Gpt)> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, device);
    let model = Gpt::new(vb, config)?;
    init_weights(&varmap, config.layers, seed)?;
    Ok((varmap, model))
}

/// Overwrites every parameter with GPT-2's initialization, seeded: weights and embeddings
/// `N(0, 0.02)`, the residual projections (`*.c_proj.weight`) `N(0, 0.02 / sqrt(2 · layers))`,
/// biases 0, LayerNorm weights 1. Parameters are visited in sorted-name order, and values drawn
/// in f32, then rounded to each parameter's dtype.
pub fn init_weights(varmap: &VarMap, layers: usize, seed: u64) -> Result<()> {
    let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6E7);
    for name in names {
        let var = &data[name];
        let n = var.elem_count();
        let is_norm = name.starts_with("ln_") || name.contains(".ln_");
        let values: Vec<f32> = if name.ends_with(".bias") {
            vec![0.0; n]
        } else if is_norm {
            vec![1.0; n]
        } else {
            let std = if name.ends_with(".c_proj.weight") {
                0.02 / (2.0 * layers.max(1) as f32).sqrt()
            } else {
                0.02
            };
            (0..n).map(|_| std * standard_normal(&mut rng)).collect()
        };
        let values = Tensor::from_vec(values, var.dims(), var.device())?;
        var.set(&values.to_dtype(var.dtype())?)?;
    }
    Ok(())
}

/// One draw from `N(0, 1)` (Box–Muller).
fn standard_normal(rng: &mut ChaCha8Rng) -> f32 {
    let u1: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
    let u2: f64 = rng.random_range(0.0..1.0);
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> GptConfig {
        GptConfig {
            vocab: 11,
            context: 8,
            width: 16,
            heads: 4,
            layers: 2,
        }
    }

    fn tokens(rows: &[&[u32]]) -> Tensor {
        Tensor::new(
            rows.iter().map(|r| r.to_vec()).collect::<Vec<_>>(),
            &Device::Cpu,
        )
        .unwrap()
    }

    fn row(logits: &Tensor, r: usize, upto: usize) -> Vec<Vec<f32>> {
        logits
            .get(r)
            .unwrap()
            .narrow(0, 0, upto)
            .unwrap()
            .to_vec2()
            .unwrap()
    }

    #[test]
    fn parameters_have_gpt2_names_and_linear_layouts() {
        let (varmap, _) = build_in(config(), 1, &Device::Cpu, DType::F32).unwrap();
        let data = varmap.data().lock().unwrap();
        let shape = |n: &str| data[n].dims().to_vec();
        assert_eq!(shape("wte.weight"), [11, 16]);
        assert_eq!(shape("wpe.weight"), [8, 16]);
        assert_eq!(shape("h.0.attn.c_attn.weight"), [48, 16]);
        assert_eq!(shape("h.1.attn.c_proj.bias"), [16]);
        assert_eq!(shape("h.1.mlp.c_fc.weight"), [64, 16]);
        assert_eq!(shape("h.1.mlp.c_proj.weight"), [16, 64]);
        assert_eq!(shape("h.0.ln_2.weight"), [16]);
        assert_eq!(shape("ln_f.bias"), [16]);
        assert_eq!(shape("lm_head.weight"), [11, 16]);
        // 4 (embeddings, ln_f, head: wte, wpe, ln_f.w, ln_f.b, lm_head) + 12 per block.
        assert_eq!(data.len(), 5 + 2 * 12);
        let v = |n: &str| data[n].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(v("h.0.ln_1.weight").iter().all(|&x| x == 1.0));
        assert!(v("h.0.mlp.c_fc.bias").iter().all(|&x| x == 0.0));
        // Standard deviations near 0.02 and 0.02 / sqrt(4) = 0.01.
        let std = |x: Vec<f32>| {
            (x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
        };
        let s = std(v("h.0.mlp.c_fc.weight"));
        assert!((s - 0.02).abs() < 0.002, "{s}");
        let s = std(v("h.0.mlp.c_proj.weight"));
        assert!((s - 0.01).abs() < 0.001, "{s}");
    }

    #[test]
    fn a_position_does_not_see_later_tokens_or_padding() {
        let (_, model) = build_in(config(), 2, &Device::Cpu, DType::F32).unwrap();
        let a = model.forward(&tokens(&[&[1, 2, 3, 4, 5, 6]])).unwrap();
        let b = model.forward(&tokens(&[&[1, 2, 3, 9, 9, 0]])).unwrap();
        assert_eq!(a.dims(), &[1, 6, 11]);
        // Positions 0..3 see only tokens 1, 2, 3 in both.
        let (ra, rb) = (row(&a, 0, 3), row(&b, 0, 3));
        for (x, y) in ra.iter().flatten().zip(rb.iter().flatten()) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
        // Position 3 does see token 4 vs 9.
        assert_ne!(row(&a, 0, 4)[3], row(&b, 0, 4)[3]);
        // The same sequence alone (length 3) gives the same logits as padded.
        let c = model.forward(&tokens(&[&[1, 2, 3]])).unwrap();
        for (x, y) in row(&c, 0, 3).iter().flatten().zip(ra.iter().flatten()) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }

    #[test]
    fn the_summed_loss_is_the_masked_sum_of_token_cross_entropies() {
        // Logits [1, 2, 3]: position 0 picks class 2, position 1 class 0 (masked out).
        let logits = Tensor::new(&[[[1f32, 2.0, 3.0], [0.5, 0.0, -1.0]]], &Device::Cpu).unwrap();
        let targets = Tensor::new(&[[2u32, 0]], &Device::Cpu).unwrap();
        let lse0 = (1f32.exp() + 2f32.exp() + 3f32.exp()).ln();
        let lse1 = (0.5f32.exp() + 1.0 + (-1f32).exp()).ln();
        let mask = Tensor::new(&[[1f32, 0.0]], &Device::Cpu).unwrap();
        let l = summed_token_loss(&logits, &targets, &mask).unwrap();
        assert!((l.to_scalar::<f32>().unwrap() - (lse0 - 3.0)).abs() < 1e-6);
        let mask = Tensor::new(&[[1f32, 1.0]], &Device::Cpu).unwrap();
        let l = summed_token_loss(&logits, &targets, &mask).unwrap();
        let want = (lse0 - 3.0) + (lse1 - 0.5);
        assert!((l.to_scalar::<f32>().unwrap() - want).abs() < 1e-6);
    }

    #[test]
    fn every_parameter_gets_a_gradient() {
        let (varmap, model) = build_in(config(), 3, &Device::Cpu, DType::F32).unwrap();
        let x = tokens(&[&[1, 2, 3, 4], &[5, 6, 7, 8]]);
        let y = tokens(&[&[2, 3, 4, 5], &[6, 7, 8, 9]]);
        let mask = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
        let loss = summed_token_loss(&model.forward(&x).unwrap(), &y, &mask).unwrap();
        let grads = loss.backward().unwrap();
        for (name, var) in varmap.data().lock().unwrap().iter() {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name} has no gradient"));
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            // wpe rows 4..8 are unused, but the rows 0..4 are not: the sum is positive.
            assert!(norm > 0.0, "{name}: zero gradient");
        }
    }

    #[test]
    fn dropout_changes_the_logits_and_its_generator_repeats_them() {
        let (_, model) = build_in(config(), 5, &Device::Cpu, DType::F32).unwrap();
        let x = tokens(&[&[1, 2, 3, 4, 5]]);
        let plain = model.forward(&x).unwrap();
        let logits = |rng: &RankRng, p| {
            let rng = rng.clone();
            model
                .forward_with(&x, Some(&Dropout { rng, p }))
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let (a, b) = (RankRng::new(9, 0), RankRng::new(9, 0));
        let plain = plain.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(logits(&a, 0.0), plain, "p = 0 is off");
        let first = logits(&a, 0.2);
        assert_ne!(first, plain);
        assert_eq!(logits(&b, 0.2), first, "same generator state, same masks");
        assert_ne!(logits(&b, 0.2), first, "the generator moved on");
    }

    #[test]
    fn the_fused_blocks_equal_the_unfused_ones_in_values_and_gradients() {
        let (varmap, model) = build_in(config(), 6, &Device::Cpu, DType::F32).unwrap();
        let values: Vec<f32> = (0..2 * 5 * 16)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let x = candle_core::Var::from_vec(values, (2, 5, 16), &Device::Cpu).unwrap();
        let block = &model.blocks[1];
        let fused = block.forward(x.as_tensor(), None).unwrap();
        let unfused = block.forward_unfused(x.as_tensor(), None).unwrap();
        let diff = |a: &Tensor, b: &Tensor| {
            (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert!(diff(&fused, &unfused) < 1e-5, "{}", diff(&fused, &unfused));
        let w = Tensor::arange(0f32, 160., &Device::Cpu)
            .unwrap()
            .reshape((2, 5, 16))
            .unwrap();
        let w = (w / 160.0).unwrap();
        let gf = (&fused * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gu = (&unfused * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let d = diff(
            gf.get(x.as_tensor()).unwrap(),
            gu.get(x.as_tensor()).unwrap(),
        );
        assert!(d < 1e-5, "x: {d}");
        let data = varmap.data().lock().unwrap();
        let mut seen = 0;
        for (name, var) in data.iter().filter(|(n, _)| n.starts_with("h.1.")) {
            let (a, b) = (gf.get(var.as_tensor()), gu.get(var.as_tensor()));
            let (a, b) = (
                a.unwrap_or_else(|| panic!("{name}: no fused gradient")),
                b.unwrap(),
            );
            assert!(diff(a, b) < 1e-5, "{name}: {}", diff(a, b));
            seen += 1;
        }
        assert_eq!(seen, 12);
    }

    #[test]
    fn the_fused_loss_equals_the_loss_of_the_logits_with_the_same_gradients() {
        let (varmap, model) = build_in(config(), 8, &Device::Cpu, DType::F32).unwrap();
        let x = tokens(&[&[1, 2, 3, 4, 5], &[6, 7, 8, 9, 10]]);
        let y = tokens(&[&[2, 3, 4, 5, 6], &[7, 8, 9, 10, 0]]);
        let mask = Tensor::new(
            &[[1f32, 1., 1., 1., 1.], [1., 1., 1., 0., 0.]],
            &Device::Cpu,
        )
        .unwrap();
        let fused = model.summed_loss(&x, &y, &mask, None).unwrap();
        let plain = summed_token_loss(&model.forward(&x).unwrap(), &y, &mask).unwrap();
        let (a, b) = (
            fused.to_scalar::<f32>().unwrap(),
            plain.to_scalar::<f32>().unwrap(),
        );
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{a} vs {b}");
        let (ga, gb) = (fused.backward().unwrap(), plain.backward().unwrap());
        for (name, var) in varmap.data().lock().unwrap().iter() {
            let (p, q) = (
                ga.get(var.as_tensor()).unwrap(),
                gb.get(var.as_tensor()).unwrap(),
            );
            let d = (p - q)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let m = q
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(d <= 1e-5 * m.max(1e-3), "{name}: {d} (largest {m})");
        }
    }

    #[test]
    fn width_not_divisible_by_heads_is_refused() {
        let c = GptConfig {
            heads: 3,
            ..config()
        };
        let Err(e) = build_in(c, 0, &Device::Cpu, DType::F32) else {
            panic!("width 16 with 3 heads was accepted");
        };
        assert!(e.to_string().contains("not divisible"), "{e}");
    }

    #[test]
    fn a_bf16_model_returns_f32_logits_close_to_the_f32_model() {
        let (_, m32) = build_in(config(), 4, &Device::Cpu, DType::F32).unwrap();
        let (_, m16) = build_in(config(), 4, &Device::Cpu, DType::BF16).unwrap();
        let x = tokens(&[&[1, 2, 3, 4, 5]]);
        let a = m32.forward(&x).unwrap();
        let b = m16.forward(&x).unwrap();
        assert_eq!(b.dtype(), DType::F32);
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let diff = diff.to_scalar::<f32>().unwrap();
        assert!(diff > 0.0 && diff < 0.05, "{diff}");
    }
}
