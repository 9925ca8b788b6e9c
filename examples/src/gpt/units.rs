//! The GPT computed unit by unit through a prepared model's units ([`GptUnits`]), which is how it
//! trains at every ZeRO stage: at stage 3 each unit's parameters are gathered for its passes
//! only, at the other stages a unit is a plain call on the prepared parameters.
//!
//! The units are FSDP's wrapping of GPT-2 (`TRANSFORMER_BASED_WRAP` with `GPT2Block`): `embed`
//! (`wte`, `wpe`), one unit per block (`h.0`, `h.1`, ...), and `head` (`ln_f`, `lm_head`), which
//! computes the loss. Each runs the same layers as [`Gpt`](super::Gpt), so the two give the same
//! bits.

use accelerate_core::{PreparedModel, UnitParams, UnitSpec};
use candle_core::{Result, Tensor};

use super::model::{drop, embed, head_loss, logits, Block, Norm};
use super::{Dropout, GptConfig};

/// The layer class of GPT-2's blocks, as Accelerate's `fsdp_transformer_layer_cls_to_wrap` names
/// it.
pub const BLOCK_CLASS: &str = "GPT2Block";

/// The units of a GPT of `config`: `embed`, `h.0` .. `h.{layers-1}`, `head`.
pub fn unit_specs(config: &GptConfig) -> Vec<UnitSpec> {
    let mut units = vec![UnitSpec::new("embed", ["wte.", "wpe."])];
    units.extend((0..config.layers).map(|i| UnitSpec::new(format!("h.{i}"), [format!("h.{i}.")])));
    units.push(UnitSpec::new("head", ["ln_f.", "lm_head."]));
    units
}

/// The GPT of a prepared model (prepared with [`unit_specs`]), computed unit by unit.
#[derive(Debug, Clone)]
pub struct GptUnits {
    config: GptConfig,
    model: PreparedModel,
    /// Whether each block runs under activation checkpointing (stages 0 to 2; at stage 3 every
    /// unit is recomputed in the backward pass anyway).
    gradient_checkpointing: bool,
}

fn err(e: accelerate_core::Error) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

impl GptUnits {
    /// The GPT of `model`, of size `config`.
    pub fn new(config: GptConfig, model: PreparedModel, gradient_checkpointing: bool) -> Self {
        Self {
            config,
            model,
            gradient_checkpointing,
        }
    }

    /// The final blocks' output `[b, t, width]` (before `ln_f`), with `dropout` in training.
    fn blocks(&self, tokens: &Tensor, dropout: Option<&Dropout>) -> Result<Tensor> {
        let c = self.config;
        let d = dropout.cloned();
        let mut x = self
            .model
            .unit("embed")
            .and_then(|u| {
                u.forward(tokens, move |tokens, p| {
                    let x = embed(tokens, &p.get("wte.weight")?, &p.get("wpe.weight")?, &c)?;
                    drop(x, d.as_ref())
                })
            })
            .map_err(err)?;
        for i in 0..c.layers {
            let d = dropout.cloned();
            let checkpointing = self.gradient_checkpointing;
            let unit = self.model.unit(&format!("h.{i}")).map_err(err)?;
            x = unit
                .forward(&x, move |x, p: &UnitParams| {
                    let block = Block::new(&c, p.var_builder().pp(format!("h.{i}")))?;
                    if checkpointing {
                        block.forward_checkpointed(x, d.as_ref())
                    } else {
                        block.forward(x, d.as_ref())
                    }
                })
                .map_err(err)?;
        }
        Ok(x)
    }

    /// The summed token cross-entropy of the next token (what [`Gpt::summed_loss`](super::Gpt::summed_loss)
    /// computes), the head unit computing the loss.
    pub fn summed_loss(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        mask: &Tensor,
        dropout: Option<&Dropout>,
    ) -> Result<Tensor> {
        let x = self.blocks(tokens, dropout)?;
        let (width, targets, mask) = (self.config.width, targets.clone(), mask.clone());
        self.model
            .unit("head")
            .and_then(|u| {
                u.forward(&x, move |x, p| {
                    let ln_f = Norm::new(width, p.var_builder().pp("ln_f"))?;
                    head_loss(
                        &ln_f.forward(x)?,
                        &p.get("lm_head.weight")?,
                        &targets,
                        &mask,
                    )
                })
            })
            .map_err(err)
    }

    /// Logits `[b, t, vocab]` in f32 (no dropout: evaluation), as [`Gpt::forward`](super::Gpt::forward).
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let x = self.blocks(tokens, None)?;
        let width = self.config.width;
        self.model
            .unit("head")
            .and_then(|u| {
                u.forward(&x, move |x, p| {
                    let ln_f = Norm::new(width, p.var_builder().pp("ln_f"))?;
                    logits(&ln_f.forward(x)?, &p.get("lm_head.weight")?)
                })
            })
            .map_err(err)
    }
}
