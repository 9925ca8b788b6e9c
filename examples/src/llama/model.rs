//! The Llama architecture, as Hugging Face transformers' `LlamaForCausalLM` computes it: token
//! embedding, `num_hidden_layers` pre-norm decoder layers (RMSNorm, grouped-query causal
//! self-attention with rotary position embeddings, RMSNorm, SwiGLU MLP), a final RMSNorm and an
//! untied linear head. No biases anywhere.
//!
//! Parameter names are Hugging Face's (`model.embed_tokens.weight`,
//! `model.layers.0.self_attn.q_proj.weight`, `model.layers.0.mlp.gate_proj.weight`,
//! `model.layers.0.input_layernorm.weight`, `model.norm.weight`, `lm_head.weight`, ...) with
//! `nn.Linear` layouts (`[out, in]`), so weights move between this model and transformers
//! unchanged.
//!
//! Each decoder layer is two trainable nodes of the `fused-kernels` crate,
//! [`fused_kernels::attention_block`] (RMSNorm, q/k/v as one packed product, rotary embeddings,
//! causal flash attention over grouped-query heads, `o_proj`, the residual add) and
//! [`fused_kernels::mlp_block`] (RMSNorm, gate/up as one packed product, SwiGLU, `down_proj`, the
//! residual add), each with its own backward pass; the final RMSNorm and the cross-entropy are
//! fused kernels too. candle-nn's fused `rms_norm`, `softmax_last_dim`, `rotary_emb::rope` and
//! `sdpa` record no backward pass, so training through them would silently leave the weights
//! before them untouched.
//!
//! Under mixed precision the model is built in the compute dtype; as transformers does, RMSNorm
//! normalizes in f32, the attention softmax runs in f32, and the logits are returned in f32.
//!
//! Packed rows of several documents ([`Llama::forward_segments`], [`Llama::summed_segment_loss`])
//! run each document piece as a sequence of its own through the same layers (see
//! [`Segments`]), so a document sees none of the one before it and its rotary positions start at
//! 0, as with transformers' position ids reset at each document and a block-diagonal mask.
//!
//! With [gradient checkpointing](Llama::set_gradient_checkpointing) each decoder layer runs under
//! [`fused_kernels::checkpoint`]: its activations are recomputed in the backward pass instead of
//! kept. Gradients are bitwise those without it on the CPU.

use std::sync::Arc;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, Init, Linear, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use accelerate_core::{PreparedModel, UnitSpec};

use super::config::LlamaConfig;
use super::segments::Segments;
use crate::frozen_linear::frozen_linear;
use crate::lora::{LoraAdapter, LoraTarget};

/// The standard deviation of the seeded initial weights: transformers' `initializer_range`.
pub const INITIALIZER_RANGE: f32 = 0.02;

/// The model (see the module docs).
#[derive(Debug, Clone)]
pub struct Llama {
    weights: Weights,
    /// `[max_position_embeddings, head_dim / 2]`: cos and sin of position × inverse frequency.
    cos: Tensor,
    sin: Tensor,
    config: LlamaConfig,
    gradient_checkpointing: bool,
}

/// Where the model's weights are.
#[derive(Debug, Clone)]
enum Weights {
    /// In the model.
    Whole(Box<Whole>),
    /// In a prepared model, which the model computes through unit by unit (see
    /// [`Llama::through_units`]).
    Units(PreparedModel),
}

/// The weights of a model that holds them.
#[derive(Debug, Clone)]
struct Whole {
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    lm_head: Projection,
}

/// What the head computes from the final norm's output `h` `[b, t, hidden]`.
enum Head {
    /// Logits `[b, t, vocab]` in f32.
    Logits,
    /// The summed cross-entropy of `targets` `[b · t]` (u32) weighted by `weights` `[b · t]`
    /// (f32), by the fused head and cross-entropy.
    Loss { targets: Tensor, weights: Tensor },
}

impl Head {
    /// The head on `h` with the head's weight `lm_head` (`logits` computes the plain logits).
    fn apply(
        &self,
        h: &Tensor,
        lm_head: &Tensor,
        logits: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        match self {
            Head::Logits => logits(h)?.to_dtype(DType::F32),
            Head::Loss { targets, weights } => {
                let (b, t, width) = h.dims3()?;
                fused_kernels::linear_cross_entropy(
                    &h.reshape((b * t, width))?,
                    lm_head,
                    targets,
                    weights,
                )
            }
        }
    }
}

/// What [`Llama::output`] makes of its groups.
enum Combined {
    /// Each group's logits `[count · len, vocab]` (f32), concatenated.
    Logits,
    /// The sum, in order, of each group's summed cross-entropy of `targets[g]` weighted by
    /// `weights[g]` (both `[count · len]`).
    Losses {
        targets: Vec<Tensor>,
        weights: Vec<Tensor>,
    },
}

impl Combined {
    /// The head of each of `groups` groups.
    fn heads(self, groups: usize) -> Result<Vec<Head>> {
        let heads: Vec<Head> = match self {
            Combined::Logits => (0..groups).map(|_| Head::Logits).collect(),
            Combined::Losses { targets, weights } => targets
                .into_iter()
                .zip(weights)
                .map(|(targets, weights)| Head::Loss { targets, weights })
                .collect(),
        };
        if heads.len() != groups {
            candle_core::bail!("{} targets for {groups} groups", heads.len());
        }
        Ok(heads)
    }

    fn is_logits(&self) -> bool {
        matches!(self, Combined::Logits)
    }
}

/// `f` on each group of `x` (the groups' rows `[count · len, hidden]` end to end), as
/// `[count, len, hidden]`, with its `(count, len, index)`.
fn per_group(
    x: &Tensor,
    shapes: &[(usize, usize)],
    mut f: impl FnMut((usize, usize, usize), &Tensor) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let hidden = x.dim(1)?;
    let mut start = 0;
    let mut outs = Vec::with_capacity(shapes.len());
    for (g, &(count, len)) in shapes.iter().enumerate() {
        let rows = x
            .narrow(0, start, count * len)?
            .reshape((count, len, hidden))?;
        outs.push(f((count, len, g), &rows)?);
        start += count * len;
    }
    Ok(outs)
}

/// The groups' outputs combined: logits concatenated, losses summed in order.
fn combine(outs: Vec<Tensor>) -> Result<Tensor> {
    if outs.iter().all(|o| o.rank() == 0) {
        let mut outs = outs.into_iter();
        let first = outs
            .next()
            .ok_or_else(|| candle_core::Error::Msg("no group".into()))?;
        outs.try_fold(first, |sum, loss| sum + loss)
    } else {
        Tensor::cat(&outs, 0)
    }
}

/// The layer class of Llama's decoder layers, as Accelerate's
/// `fsdp_transformer_layer_cls_to_wrap` names it.
pub const DECODER_LAYER_CLASS: &str = "LlamaDecoderLayer";

/// The units of a Llama of `config` (FSDP's `TRANSFORMER_BASED_WRAP` of `LlamaDecoderLayer`):
/// `embed` (`model.embed_tokens`), one per decoder layer (`model.layers.0`, ...), and `head`
/// (`model.norm`, `lm_head`).
pub fn unit_specs(config: &LlamaConfig) -> Vec<UnitSpec> {
    let mut units = vec![UnitSpec::new("embed", ["model.embed_tokens."])];
    units.extend((0..config.num_hidden_layers).map(|i| {
        let name = format!("model.layers.{i}");
        UnitSpec::new(name.clone(), [format!("{name}.")])
    }));
    units.push(UnitSpec::new("head", ["model.norm.", "lm_head."]));
    units
}

fn unit_error(e: accelerate_core::Error) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_layernorm: Tensor,
    q_proj: Projection,
    k_proj: Projection,
    v_proj: Projection,
    o_proj: Projection,
    post_attention_layernorm: Tensor,
    gate_proj: Projection,
    up_proj: Projection,
    down_proj: Projection,
}

/// A linear projection `x · Wᵀ` (no bias), plus a LoRA adapter's update when one is attached.
#[derive(Debug, Clone)]
struct Projection {
    linear: Linear,
    /// `W` is not trained: no gradient is computed for it ([`frozen_linear`]).
    frozen: bool,
    adapter: Option<LoraAdapter>,
}

impl Projection {
    fn new(linear: Linear) -> Self {
        Self {
            linear,
            frozen: false,
            adapter: None,
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = if self.frozen {
            frozen_linear(x, self.linear.weight())?
        } else {
            self.linear.forward(x)?
        };
        match &self.adapter {
            None => Ok(y),
            Some(adapter) => y + adapter.update(x)?,
        }
    }

    /// The same projection as a fused layer's (the same tensors; a frozen `W` is a plain tensor,
    /// which gets no gradient there either).
    fn fused(&self) -> fused_kernels::Projection {
        fused_kernels::Projection {
            weight: self.linear.weight().clone(),
            bias: self.linear.bias().cloned(),
            lora: self.adapter.as_ref().map(|a| fused_kernels::Lora {
                a: a.a().clone(),
                b: a.b().clone(),
                scale: a.scale(),
            }),
        }
    }

    /// The same projection over a plain tensor sharing `W`'s storage (see [`Llama::detached`]).
    fn detached(&self) -> Self {
        Self {
            linear: Linear::new(self.linear.weight().detach(), None),
            frozen: true,
            adapter: self.adapter.clone(),
        }
    }
}

/// The RMSNorm weight `[size]` under `vb` (initially ones).
fn norm_weight(size: usize, vb: VarBuilder) -> Result<Tensor> {
    vb.get_with_hints(size, "weight", Init::Const(1.0))
}

impl DecoderLayer {
    fn new(c: &LlamaConfig, vb: VarBuilder) -> Result<Self> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let attn = vb.pp("self_attn");
        let mlp = vb.pp("mlp");
        let lin = |i, o, vb| {
            Ok::<_, candle_core::Error>(Projection::new(candle_nn::linear_no_bias(i, o, vb)?))
        };
        Ok(Self {
            input_layernorm: norm_weight(h, vb.pp("input_layernorm"))?,
            q_proj: lin(h, c.num_attention_heads * hd, attn.pp("q_proj"))?,
            k_proj: lin(h, c.num_key_value_heads * hd, attn.pp("k_proj"))?,
            v_proj: lin(h, c.num_key_value_heads * hd, attn.pp("v_proj"))?,
            o_proj: lin(c.num_attention_heads * hd, h, attn.pp("o_proj"))?,
            post_attention_layernorm: norm_weight(h, vb.pp("post_attention_layernorm"))?,
            gate_proj: lin(h, c.intermediate_size, mlp.pp("gate_proj"))?,
            up_proj: lin(h, c.intermediate_size, mlp.pp("up_proj"))?,
            down_proj: lin(c.intermediate_size, h, mlp.pp("down_proj"))?,
        })
    }

    /// The layer: two fused nodes, [`fused_kernels::attention_block`] and
    /// [`fused_kernels::mlp_block`]; `cos`, `sin` the rotary tables of the sequence's positions.
    fn forward(&self, x: &Tensor, c: &LlamaConfig, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let attention = fused_kernels::Attention {
            norm: fused_kernels::Norm::Rms {
                weight: self.input_layernorm.clone(),
                eps: c.rms_norm_eps,
            },
            qkv: fused_kernels::Qkv::Separate {
                q: self.q_proj.fused(),
                k: self.k_proj.fused(),
                v: self.v_proj.fused(),
            },
            out: self.o_proj.fused(),
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            rotary: Some(fused_kernels::Rotary {
                cos: cos.clone(),
                sin: sin.clone(),
            }),
        };
        let mlp = fused_kernels::Mlp {
            norm: fused_kernels::Norm::Rms {
                weight: self.post_attention_layernorm.clone(),
                eps: c.rms_norm_eps,
            },
            kind: fused_kernels::MlpKind::SwiGlu {
                gate: self.gate_proj.fused(),
                up: self.up_proj.fused(),
                down: self.down_proj.fused(),
            },
        };
        let x = fused_kernels::attention_block(x, &attention)?;
        fused_kernels::mlp_block(&x, &mlp)
    }

    /// [`forward`](Self::forward) under [`fused_kernels::checkpoint`]: the same output and
    /// gradients, the activations recomputed in the backward pass.
    fn forward_checkpointed(
        &self,
        x: &Tensor,
        c: &LlamaConfig,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Tensor> {
        let (layer, c, cos, sin) = (self.clone(), *c, cos.clone(), sin.clone());
        fused_kernels::checkpoint::checkpoint(x, move |x| layer.forward(x, &c, &cos, &sin))
    }

    fn projection_mut(&mut self, target: LoraTarget) -> &mut Projection {
        match target {
            LoraTarget::QProj => &mut self.q_proj,
            LoraTarget::KProj => &mut self.k_proj,
            LoraTarget::VProj => &mut self.v_proj,
            LoraTarget::OProj => &mut self.o_proj,
            LoraTarget::GateProj => &mut self.gate_proj,
            LoraTarget::UpProj => &mut self.up_proj,
            LoraTarget::DownProj => &mut self.down_proj,
        }
    }

    fn detached(&self) -> Self {
        Self {
            input_layernorm: self.input_layernorm.detach(),
            q_proj: self.q_proj.detached(),
            k_proj: self.k_proj.detached(),
            v_proj: self.v_proj.detached(),
            o_proj: self.o_proj.detached(),
            post_attention_layernorm: self.post_attention_layernorm.detach(),
            gate_proj: self.gate_proj.detached(),
            up_proj: self.up_proj.detached(),
            down_proj: self.down_proj.detached(),
        }
    }
}

impl Llama {
    /// Creates the parameters under `vb`, in `vb`'s dtype (candle-nn's default initial values;
    /// [`init_weights`] replaces them with transformers').
    pub fn new(vb: VarBuilder, config: LlamaConfig) -> Result<Self> {
        let c = config;
        c.check()
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        let model = vb.pp("model");
        let layers = (0..c.num_hidden_layers)
            .map(|i| DecoderLayer::new(&c, model.pp(format!("layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let (cos, sin) = rotary_tables(&c, vb.device(), vb.dtype())?;
        Ok(Self {
            weights: Weights::Whole(Box::new(Whole {
                embed_tokens: candle_nn::embedding(
                    c.vocab_size,
                    c.hidden_size,
                    model.pp("embed_tokens"),
                )?,
                layers,
                norm: norm_weight(c.hidden_size, model.pp("norm"))?,
                lm_head: Projection::new(candle_nn::linear_no_bias(
                    c.hidden_size,
                    c.vocab_size,
                    vb.pp("lm_head"),
                )?),
            })),
            cos,
            sin,
            config,
            gradient_checkpointing: false,
        })
    }

    /// Runs each decoder layer under activation checkpointing (Hugging Face's
    /// `gradient_checkpointing`) when `on`: less memory for one more forward pass of the layers
    /// per step. [`detached`](Self::detached) keeps the setting.
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.gradient_checkpointing = on;
    }

    /// Whether the decoder layers run under activation checkpointing.
    pub fn gradient_checkpointing(&self) -> bool {
        self.gradient_checkpointing
    }

    /// The model's size.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The same model over plain tensors that share the parameters' storage: what the parameters
    /// hold (a later `Var::set` or broadcast included) is what it computes with, but no gradient
    /// is computed for them (the projections are [`frozen_linear`]s), and nothing before the
    /// first parameter the forward pass reads is differentiated. The frozen base of a LoRA
    /// fine-tune.
    pub fn detached(&self) -> Self {
        let weights = match &self.weights {
            Weights::Whole(w) => Weights::Whole(Box::new(Whole {
                embed_tokens: Embedding::new(
                    w.embed_tokens.embeddings().detach(),
                    self.config.hidden_size,
                ),
                layers: w.layers.iter().map(DecoderLayer::detached).collect(),
                norm: w.norm.detach(),
                lm_head: w.lm_head.detached(),
            })),
            Weights::Units(model) => Weights::Units(model.clone()),
        };
        Self {
            weights,
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            config: self.config,
            gradient_checkpointing: self.gradient_checkpointing,
        }
    }

    /// `(out, in)`: the shape of the weight of projection `target` in every decoder layer.
    pub fn projection_shape(&self, target: LoraTarget) -> (usize, usize) {
        let c = &self.config;
        let (h, q, kv) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        match target {
            LoraTarget::QProj => (q, h),
            LoraTarget::KProj | LoraTarget::VProj => (kv, h),
            LoraTarget::OProj => (h, q),
            LoraTarget::GateProj | LoraTarget::UpProj => (c.intermediate_size, h),
            LoraTarget::DownProj => (h, c.intermediate_size),
        }
    }

    /// Adds `adapter`'s update to projection `target` of decoder layer `layer` (replacing any
    /// adapter attached there before).
    pub fn attach_adapter(
        &mut self,
        layer: usize,
        target: LoraTarget,
        adapter: LoraAdapter,
    ) -> Result<()> {
        self.projection(layer, target)?.adapter = Some(adapter);
        Ok(())
    }

    /// The same model computed through `model`'s units (prepared from this model's parameters
    /// with [`unit_specs`]), which is how it trains at every ZeRO stage; the model's own tensors
    /// are dropped (at stage 3 the accelerator keeps only this rank's pieces of them).
    pub fn through_units(self, model: PreparedModel) -> Self {
        Self {
            weights: Weights::Units(model),
            ..self
        }
    }

    fn projection(&mut self, layer: usize, target: LoraTarget) -> Result<&mut Projection> {
        let Weights::Whole(whole) = &mut self.weights else {
            candle_core::bail!("LoRA adapters attach to a model that holds its weights");
        };
        let layers = whole.layers.len();
        match whole.layers.get_mut(layer) {
            Some(l) => Ok(l.projection_mut(target)),
            None => candle_core::bail!("layer {layer} of a model of {layers} layers"),
        }
    }

    /// Logits `[b, t, vocab]` in f32 of the next token at every position of `input_ids` `[b, t]`
    /// (u32, `t <= max_position_embeddings`); position `i` sees positions `0..=i` only.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        self.output(std::slice::from_ref(input_ids), Combined::Logits)?
            .reshape((b, t, self.config.vocab_size))
    }

    /// Runs each of `groups` (`[count, len]` u32 sequences) through the model and the head on
    /// each one's final RMSNorm output, combined as `combined` says: their logits
    /// `[count · len, vocab]` (f32) concatenated, or their losses summed in order.
    ///
    /// Through units every unit runs once for all the groups, so that under ZeRO stage 3 each
    /// rank gathers and reduces every unit the same number of times whatever its data (packed
    /// rows give each rank its own number of groups); a rank without a group runs one token of
    /// weight 0.
    fn output(&self, groups: &[Tensor], combined: Combined) -> Result<Tensor> {
        let c = self.config;
        let mut shapes = Vec::with_capacity(groups.len());
        for ids in groups {
            let (count, t) = ids.dims2()?;
            if t > c.max_position_embeddings {
                candle_core::bail!(
                    "a sequence of {t} tokens is longer than the model's \
                     max_position_embeddings of {}",
                    c.max_position_embeddings
                );
            }
            shapes.push((count, t));
        }
        let model = match &self.weights {
            Weights::Whole(w) => return self.output_whole(w, groups, combined),
            Weights::Units(model) => model,
        };
        let logits = combined.is_logits();
        let (groups, mut heads, empty) = match (groups.is_empty(), combined) {
            (false, combined) => (groups.to_vec(), combined.heads(groups.len())?, false),
            // Nothing to run, but every unit runs once on every rank: one token, weight 0.
            (true, _) => {
                let dev = self.cos.device();
                let ids = Tensor::zeros((1, 1), DType::U32, dev)?;
                shapes.push((1, 1));
                let weights = Tensor::zeros(1, DType::F32, dev)?;
                let head = Head::Loss {
                    targets: Tensor::zeros(1, DType::U32, dev)?,
                    weights,
                };
                (vec![ids], vec![head], true)
            }
        };
        let unit = |name: &str| model.unit(name).map_err(unit_error);
        let ids = Tensor::cat(
            &groups
                .iter()
                .map(|g| g.flatten_all())
                .collect::<Result<Vec<_>>>()?,
            0,
        )?;
        let mut x = unit("embed")?
            .forward(&ids, |ids, p| {
                let n = ids.dim(0)?;
                let x = fused_kernels::embedding(
                    &ids.reshape((1, n))?,
                    &p.get("model.embed_tokens.weight")?,
                )?;
                x.reshape((n, x.dim(2)?))
            })
            .map_err(unit_error)?;
        let shapes = Arc::new(shapes);
        for i in 0..c.num_hidden_layers {
            let name = format!("model.layers.{i}");
            let (cos, sin, shapes) = (self.cos.clone(), self.sin.clone(), shapes.clone());
            let checkpointing = self.gradient_checkpointing;
            x = unit(&name)?
                .forward(&x, move |x, p| {
                    let layer = DecoderLayer::new(&c, p.var_builder().pp(&name))?;
                    per_group(x, &shapes, |g, x| {
                        let (cos, sin) = (cos.narrow(0, 0, g.1)?, sin.narrow(0, 0, g.1)?);
                        let y = if checkpointing {
                            layer.forward_checkpointed(x, &c, &cos, &sin)?
                        } else {
                            layer.forward(x, &c, &cos, &sin)?
                        };
                        y.reshape((g.0 * g.1, c.hidden_size))
                    })
                    .and_then(|ys| Tensor::cat(&ys, 0))
                })
                .map_err(unit_error)?;
        }
        let eps = c.rms_norm_eps;
        let heads = Arc::new(std::mem::take(&mut heads));
        let out = unit("head")?
            .forward(&x, move |x, p| {
                let norm = p.get("model.norm.weight")?;
                let lm_head = p.get("lm_head.weight")?;
                let outs = per_group(x, &shapes, |g, x| {
                    let h = fused_kernels::rms_norm(x, &norm, eps)?;
                    let head = &heads[g.2];
                    let out = head.apply(&h, &lm_head, |h| {
                        Linear::new(lm_head.clone(), None).forward(h)
                    })?;
                    match head {
                        Head::Logits => out.reshape((g.0 * g.1, ())),
                        Head::Loss { .. } => Ok(out),
                    }
                })?;
                combine(outs)
            })
            .map_err(unit_error)?;
        match (empty, logits) {
            (true, true) => Tensor::zeros((0, c.vocab_size), DType::F32, out.device()),
            _ => Ok(out),
        }
    }

    /// [`output`](Self::output) over the model's own weights, group by group.
    fn output_whole(&self, w: &Whole, groups: &[Tensor], combined: Combined) -> Result<Tensor> {
        let c = &self.config;
        let logits = combined.is_logits();
        let heads = combined.heads(groups.len())?;
        let mut outs = Vec::with_capacity(groups.len());
        for (ids, head) in groups.iter().zip(&heads) {
            let (count, t) = ids.dims2()?;
            let cos = self.cos.narrow(0, 0, t)?;
            let sin = self.sin.narrow(0, 0, t)?;
            let mut x = fused_kernels::embedding(ids, w.embed_tokens.embeddings())?;
            for layer in &w.layers {
                x = if self.gradient_checkpointing {
                    layer.forward_checkpointed(&x, c, &cos, &sin)?
                } else {
                    layer.forward(&x, c, &cos, &sin)?
                };
            }
            let h = fused_kernels::rms_norm(&x, &w.norm, c.rms_norm_eps)?;
            let out = head.apply(&h, w.lm_head.linear.weight(), |h| w.lm_head.forward(h))?;
            outs.push(match head {
                Head::Logits => out.reshape((count * t, c.vocab_size))?,
                Head::Loss { .. } => out,
            });
        }
        if outs.is_empty() {
            let dev = self.cos.device();
            return match logits {
                true => Tensor::zeros((0, c.vocab_size), DType::F32, dev),
                false => Tensor::zeros((), DType::F32, dev),
            };
        }
        combine(outs)
    }

    /// The *sum* over the predicted tokens of transformers' causal-LM loss with
    /// `labels = input_ids` `[b, t]`: the logits at positions `0..t-1` against the tokens at
    /// `1..t`. Divided by `b · (t - 1)` it is the loss transformers reports; summed, it is what
    /// item-weighted accumulation needs. The head and the cross-entropy are one fused op
    /// ([`fused_kernels::linear_cross_entropy`]), which never holds the batch's logits in f32;
    /// every position is fed to it, the last of each row with weight 0.
    pub fn summed_causal_lm_loss(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        if t < 2 {
            candle_core::bail!("a sequence of {t} token(s) predicts nothing; rows need 2 or more");
        }
        let dev = input_ids.device();
        let targets = Tensor::cat(
            &[
                &input_ids.narrow(1, 1, t - 1)?,
                &Tensor::zeros((b, 1), input_ids.dtype(), dev)?,
            ],
            1,
        )?;
        let weights = Tensor::cat(
            &[
                &Tensor::ones((b, t - 1), DType::F32, dev)?,
                &Tensor::zeros((b, 1), DType::F32, dev)?,
            ],
            1,
        )?;
        self.output(
            std::slice::from_ref(input_ids),
            Combined::Losses {
                targets: vec![targets.reshape(b * t)?],
                weights: vec![weights.reshape(b * t)?],
            },
        )
    }

    /// Logits `[b, t, vocab]` in f32 of packed rows `input_ids` `[b, t]` (u32) whose documents
    /// `segments` locates: at each token of a document, what [`forward`](Self::forward) gives
    /// running that document alone (each token sees the earlier tokens of its own document only,
    /// its rotary position counting from the document's start). Padding positions (segment 0)
    /// are not computed; their logits are 0. See [`Segments`] for how the documents are batched.
    pub fn forward_segments(&self, input_ids: &Tensor, segments: &Segments) -> Result<Tensor> {
        let (b, t) = check_segments(input_ids, segments)?;
        let dev = input_ids.device();
        let flat = input_ids.flatten_all()?;
        let vocab = self.config.vocab_size;
        let groups = segments
            .layouts()
            .into_iter()
            .map(|g| {
                flat.index_select(&index(g.tokens, dev)?, 0)?
                    .reshape((g.count, g.len))
            })
            .collect::<Result<Vec<_>>>()?;
        let logits = self.output(&groups, Combined::Logits)?;
        // The row the padding positions read.
        let padding = Tensor::zeros((1, vocab), DType::F32, dev)?;
        Tensor::cat(&[&logits, &padding], 0)?
            .index_select(&index(segments.scatter_index(), dev)?, 0)?
            .reshape((b, t, vocab))
    }

    /// The *sum* of the cross-entropies of predicting token `t + 1` from token `t` wherever both
    /// are in the same document of the packed rows `input_ids` `[b, t]` (see
    /// [`forward_segments`](Self::forward_segments)), and how many such tokens there are
    /// ([`Segments::predicted`]): the loss and the items of item-weighted accumulation. Each
    /// document's terms are those of [`summed_causal_lm_loss`](Self::summed_causal_lm_loss) on
    /// the document alone; padding contributes nothing. A batch of padding only gives 0 and 0.
    pub fn summed_segment_loss(
        &self,
        input_ids: &Tensor,
        segments: &Segments,
    ) -> Result<(Tensor, usize)> {
        check_segments(input_ids, segments)?;
        let dev = input_ids.device();
        let flat = input_ids.flatten_all()?;
        let (mut groups, mut targets, mut weights) = (Vec::new(), Vec::new(), Vec::new());
        for g in segments.layouts() {
            let n = g.count * g.len;
            groups.push(
                flat.index_select(&index(g.tokens, dev)?, 0)?
                    .reshape((g.count, g.len))?,
            );
            targets.push(flat.index_select(&index(g.targets, dev)?, 0)?);
            weights.push(Tensor::from_vec(g.weights, n, dev)?);
        }
        let total = self.output(&groups, Combined::Losses { targets, weights })?;
        Ok((total, segments.predicted()))
    }

    /// The summed cross-entropy of each packed row's predicted tokens `[b]` in f32 (evaluation:
    /// with [`Segments::predicted_per_row`], the loss per token of each row). Computed from
    /// [`forward_segments`](Self::forward_segments)' logits.
    pub fn segment_loss_per_row(&self, input_ids: &Tensor, segments: &Segments) -> Result<Tensor> {
        let (b, t) = check_segments(input_ids, segments)?;
        let logits = self.forward_segments(input_ids, segments)?;
        if t < 2 {
            return Tensor::zeros(b, DType::F32, input_ids.device());
        }
        let v = logits.dim(2)?;
        let log_probs = candle_nn::ops::log_softmax(
            &logits.narrow(1, 0, t - 1)?.reshape((b * (t - 1), v))?,
            candle_core::D::Minus1,
        )?;
        let targets = input_ids
            .narrow(1, 1, t - 1)?
            .contiguous()?
            .reshape((b * (t - 1), 1))?;
        let nll = log_probs.gather(&targets, 1)?.neg()?.reshape((b, t - 1))?;
        let weights = segments
            .next_token_weights(input_ids.device())?
            .narrow(1, 0, t - 1)?;
        (nll * weights)?.sum(1)
    }
}

/// `(b, t)` of `input_ids`, which must be the shape `segments` was built for.
fn check_segments(input_ids: &Tensor, segments: &Segments) -> Result<(usize, usize)> {
    let dims = input_ids.dims2()?;
    if dims != segments.dims() {
        candle_core::bail!(
            "input_ids {:?} and segment_ids {:?} differ in shape; give one segment id per token",
            input_ids.dims(),
            segments.dims()
        );
    }
    Ok(dims)
}

/// A u32 index tensor on `device`.
fn index(values: Vec<u32>, device: &Device) -> Result<Tensor> {
    let n = values.len();
    Tensor::from_vec(values, n, device)
}

/// The summed causal-LM loss of `logits` `[b, t, vocab]` (f32) for `input_ids` `[b, t]` (see
/// [`Llama::summed_causal_lm_loss`]).
pub fn causal_lm_loss_sum(logits: &Tensor, input_ids: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    if t < 2 {
        candle_core::bail!("a sequence of {t} token(s) predicts nothing; rows need 2 or more");
    }
    let n = b * (t - 1);
    let predicting = logits.narrow(1, 0, t - 1)?.reshape((n, v))?;
    let targets = input_ids.narrow(1, 1, t - 1)?.contiguous()?.reshape(n)?;
    let weights = Tensor::ones(n, DType::F32, logits.device())?;
    fused_kernels::cross_entropy(&predicting, &targets, &weights)
}

/// cos and sin of `position · θ^(-2i / head_dim)` for every position and `i < head_dim / 2`
/// (computed in f64, stored in `dtype`).
fn rotary_tables(c: &LlamaConfig, device: &Device, dtype: DType) -> Result<(Tensor, Tensor)> {
    let half = c.head_dim / 2;
    let angles: Vec<f64> = (0..c.max_position_embeddings)
        .flat_map(|p| {
            (0..half).map(move |i| {
                // transformers computes the inverse frequency in f32, then the angle in f32.
                let inv_freq = (1.0 / c.rope_theta.powf((2 * i) as f64 / c.head_dim as f64)) as f32;
                (p as f32 * inv_freq) as f64
            })
        })
        .collect();
    let table = |f: fn(f64) -> f64| {
        Tensor::from_vec(
            angles.iter().map(|&a| f(a) as f32).collect::<Vec<f32>>(),
            (c.max_position_embeddings, half),
            device,
        )?
        .to_dtype(dtype)
    };
    Ok((table(f64::cos)?, table(f64::sin)?))
}

/// Builds the model in `dtype` (the accelerator's compute dtype) in a fresh `VarMap`, with seeded
/// initial weights (see [`init_weights`]).
pub fn build_in(
    config: LlamaConfig,
    seed: u64,
    device: &Device,
    dtype: DType,
) -> Result<(VarMap, Llama)> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, device);
    let model = Llama::new(vb, config)?;
    init_weights(&varmap, seed)?;
    Ok((varmap, model))
}

/// Overwrites every parameter with transformers' Llama initialization, seeded: weights and the
/// embedding `N(0, 0.02)` (`initializer_range`), RMSNorm weights 1. Parameters are visited in
/// sorted-name order, values drawn in f32, then rounded to each parameter's dtype.
pub fn init_weights(varmap: &VarMap, seed: u64) -> Result<()> {
    let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x11A3A);
    for name in names {
        let var = &data[name];
        let n = var.elem_count();
        let values: Vec<f32> = if name.ends_with("norm.weight") {
            vec![1.0; n]
        } else {
            (0..n)
                .map(|_| INITIALIZER_RANGE * standard_normal(&mut rng))
                .collect()
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

    fn config() -> LlamaConfig {
        LlamaConfig::from_flags(11, 2, 16, 4, 2, 24, 8).unwrap()
    }

    fn tokens(rows: &[&[u32]]) -> Tensor {
        Tensor::new(
            rows.iter().map(|r| r.to_vec()).collect::<Vec<_>>(),
            &Device::Cpu,
        )
        .unwrap()
    }

    #[test]
    fn parameters_have_hugging_face_names_and_linear_layouts() {
        let (varmap, _) = build_in(config(), 1, &Device::Cpu, DType::F32).unwrap();
        let data = varmap.data().lock().unwrap();
        let shape = |n: &str| data[n].dims().to_vec();
        assert_eq!(shape("model.embed_tokens.weight"), [11, 16]);
        assert_eq!(shape("model.layers.0.self_attn.q_proj.weight"), [16, 16]);
        assert_eq!(shape("model.layers.0.self_attn.k_proj.weight"), [8, 16]);
        assert_eq!(shape("model.layers.1.self_attn.v_proj.weight"), [8, 16]);
        assert_eq!(shape("model.layers.1.self_attn.o_proj.weight"), [16, 16]);
        assert_eq!(shape("model.layers.0.mlp.gate_proj.weight"), [24, 16]);
        assert_eq!(shape("model.layers.0.mlp.up_proj.weight"), [24, 16]);
        assert_eq!(shape("model.layers.0.mlp.down_proj.weight"), [16, 24]);
        assert_eq!(shape("model.layers.1.input_layernorm.weight"), [16]);
        assert_eq!(
            shape("model.layers.1.post_attention_layernorm.weight"),
            [16]
        );
        assert_eq!(shape("model.norm.weight"), [16]);
        assert_eq!(shape("lm_head.weight"), [11, 16]);
        assert_eq!(data.len(), 3 + 2 * 9);
        let v = |n: &str| data[n].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(v("model.norm.weight").iter().all(|&x| x == 1.0));
        let w = v("model.layers.0.mlp.up_proj.weight");
        let std = (w.iter().map(|a| (*a as f64).powi(2)).sum::<f64>() / w.len() as f64).sqrt();
        assert!((std - 0.02).abs() < 0.004, "{std}");
    }

    #[test]
    fn a_position_does_not_see_later_tokens() {
        let (_, model) = build_in(config(), 2, &Device::Cpu, DType::F32).unwrap();
        let a = model.forward(&tokens(&[&[1, 2, 3, 4, 5, 6]])).unwrap();
        let b = model.forward(&tokens(&[&[1, 2, 3, 9, 9, 0]])).unwrap();
        let first = |x: &Tensor, n| x.get(0).unwrap().narrow(0, 0, n).unwrap();
        let d = (first(&a, 3) - first(&b, 3)).unwrap().abs().unwrap();
        assert!(d.max_all().unwrap().to_scalar::<f32>().unwrap() < 1e-6);
        let d = (first(&a, 4) - first(&b, 4)).unwrap().abs().unwrap();
        assert!(d.max_all().unwrap().to_scalar::<f32>().unwrap() > 1e-6);
    }

    #[test]
    fn rotary_rotates_each_pair_of_halves_by_position_times_frequency() {
        // head_dim 4: pairs (0, 2) and (1, 3), inverse frequencies 1 and theta^(-1/2).
        let c = LlamaConfig {
            head_dim: 4,
            rope_theta: 100.0,
            max_position_embeddings: 3,
            ..config()
        };
        let (cos, sin) = rotary_tables(&c, &Device::Cpu, DType::F32).unwrap();
        let x = Tensor::new(&[[[[1f32, 2., 3., 4.]; 3]]], &Device::Cpu).unwrap();
        // [1, 1, 3, 4] -> [1, 3, 4] -> one head's 3 positions.
        let y: Vec<Vec<Vec<f32>>> = fused_kernels::rotary(&x, &cos, &sin)
            .unwrap()
            .get(0)
            .unwrap()
            .to_vec3()
            .unwrap();
        let y = &y[0];
        for (p, row) in y.iter().enumerate() {
            for (i, (a, b)) in [(1.0f64, 3.0f64), (2.0, 4.0)].iter().enumerate() {
                let angle = p as f64 * 100f64.powf(-(i as f64) / 2.0);
                let (s, co) = angle.sin_cos();
                assert!((row[i] as f64 - (a * co - b * s)).abs() < 1e-5, "{row:?}");
                assert!(
                    (row[i + 2] as f64 - (b * co + a * s)).abs() < 1e-5,
                    "{row:?}"
                );
            }
        }
    }

    /// A model whose weights are large enough that attention is far from uniform (the seeded
    /// 0.02 makes every token attend almost evenly, which would hide a leak between documents),
    /// with rotary tables of `context` positions, and its parameters by name.
    fn sharp_model(context: usize) -> (Llama, Vec<(String, candle_core::Var)>) {
        let c = LlamaConfig::from_flags(11, 2, 16, 4, 2, 24, context).unwrap();
        let (varmap, model) = build_in(c, 7, &Device::Cpu, DType::F32).unwrap();
        let params = crate::layers::named_vars(&varmap);
        for (name, var) in &params {
            let scale = if name.ends_with("norm.weight") {
                1.0
            } else if name.contains("embed_tokens") {
                50.0
            } else {
                15.0
            };
            var.set(&(var.as_tensor() * scale).unwrap()).unwrap();
        }
        (model, params)
    }

    /// Token ids `0..n` scrambled with `seed`, below the vocabulary of 11.
    fn doc(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i * 7 + seed * 3 + i * i) % 11)
            .collect()
    }

    /// Rows packed from documents, padded with token 0 in segment 0 to `t` tokens.
    fn pack(rows: &[Vec<Vec<u32>>], t: usize) -> (Tensor, Segments) {
        let mut ids = Vec::new();
        let mut segs = Vec::new();
        for docs in rows {
            let mut r: Vec<u32> = docs.iter().flatten().copied().collect();
            let mut s: Vec<u32> = docs
                .iter()
                .enumerate()
                .flat_map(|(i, d)| std::iter::repeat_n(i as u32 + 1, d.len()))
                .collect();
            assert!(r.len() <= t);
            r.resize(t, 0);
            s.resize(t, 0);
            ids.push(r);
            segs.push(s);
        }
        let segments = Segments::new(&Tensor::new(segs, &Device::Cpu).unwrap()).unwrap();
        (Tensor::new(ids, &Device::Cpu).unwrap(), segments)
    }

    fn max_abs(t: &Tensor) -> f32 {
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Three documents in one row (100, 40 and 20 tokens: two length groups), one in a second
    /// row followed by padding, and a row of padding only.
    fn packed_batch() -> (Vec<Vec<Vec<u32>>>, Tensor, Segments) {
        let rows = vec![
            vec![doc(100, 1), doc(40, 2), doc(20, 3)],
            vec![doc(70, 4)],
            vec![],
        ];
        let (ids, segments) = pack(&rows, 160);
        (rows, ids, segments)
    }

    #[test]
    fn each_packed_document_gets_the_logits_and_losses_of_running_it_alone() {
        let (model, _) = sharp_model(160);
        let (rows, ids, segments) = packed_batch();
        assert_eq!(segments.passes(), 2, "the length groups are exercised");
        let logits = model.forward_segments(&ids, &segments).unwrap();
        let mut expected_rows = Vec::new();
        for (r, docs) in rows.iter().enumerate() {
            let mut start = 0;
            let mut row_loss = 0f64;
            for d in docs {
                let alone = Tensor::new(d.as_slice(), &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                let want = model.forward(&alone).unwrap().squeeze(0).unwrap();
                let got = logits.get(r).unwrap().narrow(0, start, d.len()).unwrap();
                let d_max = max_abs(&(&got - &want).unwrap());
                assert!(d_max < 1e-5, "row {r} at {start}: |Δlogits| {d_max}");
                row_loss += model
                    .summed_causal_lm_loss(&alone)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap() as f64;
                // The comparison could fail: with the row's earlier documents in view, a later
                // document's logits differ far beyond the tolerance.
                if start > 0 {
                    let prefix = ids.get(r).unwrap().narrow(0, 0, start + d.len()).unwrap();
                    let seen = model.forward(&prefix.unsqueeze(0).unwrap()).unwrap();
                    let leaked = seen.squeeze(0).unwrap().narrow(0, start, d.len()).unwrap();
                    assert!(max_abs(&(&leaked - &want).unwrap()) > 1e-2);
                }
                start += d.len();
            }
            // Padding is not computed: zero logits, finite.
            if start < 160 {
                let pad = logits.get(r).unwrap().narrow(0, start, 160 - start);
                assert_eq!(max_abs(&pad.unwrap()), 0.0);
            }
            expected_rows.push(row_loss);
        }
        let per_row = model
            .segment_loss_per_row(&ids, &segments)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for (got, want) in per_row.iter().zip(&expected_rows) {
            assert!(
                (*got as f64 - want).abs() < 1e-4 * want.max(1.0),
                "{per_row:?} vs {expected_rows:?}"
            );
        }
        let (sum, count) = model.summed_segment_loss(&ids, &segments).unwrap();
        let total: f64 = expected_rows.iter().sum();
        let sum = sum.to_scalar::<f32>().unwrap() as f64;
        assert!((sum - total).abs() < 1e-4 * total, "{sum} vs {total}");
        assert_eq!(count, 99 + 39 + 19 + 69);
        assert_eq!(segments.predicted_per_row(), [99 + 39 + 19, 69, 0]);
    }

    /// The gradient of every parameter of `loss`.
    fn gradients(params: &[(String, candle_core::Var)], loss: &Tensor) -> Vec<(String, Tensor)> {
        let grads = loss.backward().unwrap();
        params
            .iter()
            .map(|(n, v)| {
                let g = grads
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("no gradient reached {n}"));
                (n.clone(), g.clone())
            })
            .collect()
    }

    #[test]
    fn the_packed_gradient_is_the_sum_of_the_documents_gradients() {
        let (model, params) = sharp_model(160);
        let (rows, ids, segments) = packed_batch();
        let (loss, _) = model.summed_segment_loss(&ids, &segments).unwrap();
        let packed = gradients(&params, &loss);
        let mut separate: Option<Vec<(String, Tensor)>> = None;
        for d in rows.iter().flatten() {
            let alone = Tensor::new(d.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let g = gradients(&params, &model.summed_causal_lm_loss(&alone).unwrap());
            separate = Some(match separate {
                None => g,
                Some(sum) => sum
                    .into_iter()
                    .zip(g)
                    .map(|((n, a), (_, b))| (n, (a + b).unwrap()))
                    .collect(),
            });
        }
        for ((name, got), (_, want)) in packed.iter().zip(&separate.unwrap()) {
            let rel = max_abs(&(got - want).unwrap()) / max_abs(want);
            assert!(rel < 2e-5, "{name}: relative difference {rel}");
        }
    }

    #[test]
    fn padding_rows_and_tails_contribute_nothing() {
        let (model, params) = sharp_model(160);
        let (_, ids, segments) = packed_batch();
        let (with_padding, n) = model.summed_segment_loss(&ids, &segments).unwrap();
        let g_with = gradients(&params, &with_padding);
        // The same two documents' rows without the padding-only row.
        let (ids2, segments2) = pack(
            &[vec![doc(100, 1), doc(40, 2), doc(20, 3)], vec![doc(70, 4)]],
            160,
        );
        let (without, n2) = model.summed_segment_loss(&ids2, &segments2).unwrap();
        let g_without = gradients(&params, &without);
        assert_eq!(n, n2);
        assert_eq!(
            with_padding.to_scalar::<f32>().unwrap(),
            without.to_scalar::<f32>().unwrap()
        );
        for ((name, a), (_, b)) in g_with.iter().zip(&g_without) {
            assert_eq!(max_abs(&(a - b).unwrap()), 0.0, "{name}");
        }
        // A batch of padding only: nothing to predict, a loss of 0.
        let (ids3, segments3) = pack(&[vec![], vec![]], 8);
        let (loss, count) = model.summed_segment_loss(&ids3, &segments3).unwrap();
        assert_eq!((loss.to_scalar::<f32>().unwrap(), count), (0.0, 0));
        let logits = model.forward_segments(&ids3, &segments3).unwrap();
        assert_eq!(logits.dims(), [2, 8, 11]);
        assert_eq!(max_abs(&logits), 0.0);
    }

    #[test]
    fn gradient_checkpointing_gives_the_same_packed_loss_and_gradients() {
        let (mut model, params) = sharp_model(160);
        let (_, ids, segments) = packed_batch();
        let (plain, _) = model.summed_segment_loss(&ids, &segments).unwrap();
        let g_plain = gradients(&params, &plain);
        model.set_gradient_checkpointing(true);
        let (checkpointed, _) = model.summed_segment_loss(&ids, &segments).unwrap();
        let g_checkpointed = gradients(&params, &checkpointed);
        assert_eq!(
            plain.to_scalar::<f32>().unwrap(),
            checkpointed.to_scalar::<f32>().unwrap()
        );
        for ((name, a), (_, b)) in g_plain.iter().zip(&g_checkpointed) {
            assert_eq!(max_abs(&(a - b).unwrap()), 0.0, "{name}");
        }
    }

    #[test]
    fn packed_rows_run_in_bf16_within_its_rounding_of_f32() {
        let c = LlamaConfig::from_flags(11, 2, 16, 4, 2, 24, 160).unwrap();
        let (_, ids, segments) = packed_batch();
        let loss = |dtype| {
            let (_, model) = build_in(c, 7, &Device::Cpu, dtype).unwrap();
            let (sum, n) = model.summed_segment_loss(&ids, &segments).unwrap();
            let logits = model.forward_segments(&ids, &segments).unwrap();
            assert_eq!(logits.dtype(), DType::F32);
            let sum = sum
                .to_dtype(DType::F32)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            (sum / n as f32, logits)
        };
        let ((l32, g32), (l16, g16)) = (loss(DType::F32), loss(DType::BF16));
        // bf16 keeps 8 bits of mantissa: a relative error of a few 1e-3 per op.
        assert!((l32 - l16).abs() < 2e-2 * l32, "{l32} vs {l16}");
        assert!(max_abs(&(g32 - g16).unwrap()) < 5e-2);
    }

    #[test]
    fn segment_ids_of_another_shape_are_refused() {
        let (model, _) = sharp_model(16);
        let (ids, _) = pack(&[vec![doc(4, 1)]], 8);
        let (_, segments) = pack(&[vec![doc(4, 1)], vec![]], 8);
        let e = model
            .summed_segment_loss(&ids, &segments)
            .unwrap_err()
            .to_string();
        assert!(e.contains("differ in shape"), "{e}");
    }
}
