//! The size of a Llama model, read from a Hugging Face `config.json` of `LlamaForCausalLM` (as
//! transformers 4.x and 5.x write it) or built from flags, and written back as such a file.
//!
//! transformers 4.x writes `rope_theta` at the top level (and `rope_scaling`, usually null);
//! 5.x writes `rope_parameters: {"rope_type": "default", "rope_theta": ...}`. Both are read.
//! What this model does not implement is refused by name rather than silently ignored: tied
//! embeddings, biases, an activation other than SiLU, and rotary scaling other than the default.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// transformers' default `rope_theta` for Llama.
pub const DEFAULT_ROPE_THETA: f64 = 10_000.0;
/// transformers' default `rms_norm_eps` for Llama.
pub const DEFAULT_RMS_NORM_EPS: f64 = 1e-6;
/// The `rms_norm_eps` of models built from flags: Llama 2's.
pub const FLAGS_RMS_NORM_EPS: f64 = 1e-5;

/// The size of the model, in Hugging Face's terms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary (rows of the embedding and of the head).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP (rows of `gate_proj` and `up_proj`).
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads; divides `num_attention_heads` (grouped-query attention).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Longest sequence the rotary tables cover.
    pub max_position_embeddings: usize,
    /// RMSNorm's epsilon.
    pub rms_norm_eps: f64,
    /// The rotary embedding's base.
    pub rope_theta: f64,
}

/// The fields of a Hugging Face `LlamaConfig` this program reads; the rest of the file is ignored.
#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<RopeParameters>,
    rope_scaling: Option<RopeParameters>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    attention_dropout: Option<f64>,
}

/// transformers 5.x's `rope_parameters`, or 4.x's `rope_scaling` (which named the type `type` in
/// older files).
#[derive(Debug, Deserialize)]
struct RopeParameters {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    old_type: Option<String>,
    rope_theta: Option<f64>,
}

impl RopeParameters {
    fn kind(&self) -> &str {
        self.rope_type
            .as_deref()
            .or(self.old_type.as_deref())
            .unwrap_or("default")
    }
}

impl LlamaConfig {
    /// The model of a Hugging Face `config.json`'s text; errors name the field and the fix.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let hf: HfConfig = serde_json::from_str(text)
            .context("not a LlamaForCausalLM config.json (as transformers writes it)")?;
        if let Some(kind) = hf.model_type.as_deref() {
            if kind != "llama" {
                bail!(
                    "model_type is {kind:?}; this program trains \"llama\" models \
                     (LlamaForCausalLM) only"
                );
            }
        }
        if hf.tie_word_embeddings == Some(true) {
            bail!(
                "tie_word_embeddings is true; this model has an untied lm_head: set \
                 \"tie_word_embeddings\": false (and give lm_head.weight its own weights)"
            );
        }
        for (field, value) in [
            ("attention_bias", hf.attention_bias),
            ("mlp_bias", hf.mlp_bias),
        ] {
            if value == Some(true) {
                bail!("{field} is true; this model has no biases: set \"{field}\": false");
            }
        }
        if let Some(act) = hf.hidden_act.as_deref() {
            // transformers' ACT2FN maps both names to SiLU.
            if act != "silu" && act != "swish" {
                bail!(
                    "hidden_act is {act:?}; this model's MLP is SwiGLU: set \"hidden_act\": \
                     \"silu\""
                );
            }
        }
        if let Some(p) = hf.attention_dropout.filter(|&p| p != 0.0) {
            bail!(
                "attention_dropout is {p}; this model has no attention dropout: set \
                 \"attention_dropout\": 0.0"
            );
        }
        for (field, rope) in [
            ("rope_parameters", &hf.rope_parameters),
            ("rope_scaling", &hf.rope_scaling),
        ] {
            if let Some(rope) = rope {
                if rope.kind() != "default" {
                    bail!(
                        "{field} asks for rotary scaling {:?}; only the default rotary \
                         embedding is implemented: remove the scaling (rope_type \"default\")",
                        rope.kind()
                    );
                }
            }
        }
        let rope_theta = hf
            .rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(hf.rope_theta)
            .unwrap_or(DEFAULT_ROPE_THETA);
        let heads = hf.num_attention_heads;
        let config = Self {
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size.checked_div(heads).unwrap_or(0)),
            max_position_embeddings: hf.max_position_embeddings,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(DEFAULT_RMS_NORM_EPS),
            rope_theta,
        };
        config.check()?;
        Ok(config)
    }

    /// The model of the `config.json` at `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--config {}", path.display()))?;
        Self::from_hf_json(&text).with_context(|| format!("--config {}", path.display()))
    }

    /// The size `width / heads` heads and `intermediate` MLP width give, with rotary tables of
    /// `context` positions, theta 10000 and eps 1e-5 (Llama 2's).
    pub fn from_flags(
        vocab_size: usize,
        layers: usize,
        width: usize,
        heads: usize,
        kv_heads: usize,
        intermediate: usize,
        context: usize,
    ) -> Result<Self> {
        let config = Self {
            vocab_size,
            hidden_size: width,
            intermediate_size: intermediate,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim: width.checked_div(heads).unwrap_or(0),
            max_position_embeddings: context,
            rms_norm_eps: FLAGS_RMS_NORM_EPS,
            rope_theta: DEFAULT_ROPE_THETA,
        };
        if heads > 0 && !width.is_multiple_of(heads) {
            bail!(
                "--width {width} is not divisible by --heads {heads}: every head takes width / \
                 heads dimensions (e.g. --width {})",
                width.div_ceil(heads) * heads
            );
        }
        config.check()?;
        Ok(config)
    }

    /// Refuses sizes the model cannot be built with.
    pub fn check(&self) -> Result<()> {
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if value == 0 {
                bail!("{field} must be at least 1");
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            bail!(
                "num_key_value_heads {} does not divide num_attention_heads {}: each key/value \
                 head serves a whole group of query heads",
                self.num_key_value_heads,
                self.num_attention_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!(
                "head_dim {} is odd; the rotary embedding rotates pairs of dimensions",
                self.head_dim
            );
        }
        if !(self.rms_norm_eps > 0.0 && self.rope_theta > 0.0) {
            bail!(
                "rms_norm_eps ({}) and rope_theta ({}) must be positive",
                self.rms_norm_eps,
                self.rope_theta
            );
        }
        Ok(())
    }

    /// This model as transformers 5.x writes a `LlamaForCausalLM` config.json (f32 weights).
    pub fn to_hf_json(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "dtype": "float32",
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mlp_bias": false,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": false,
            "vocab_size": self.vocab_size,
        })
    }
}

/// The MLP width of a model built from flags without --intermediate: Llama's rule (Meta's
/// reference code) of two thirds of 4 · width, rounded up to a multiple of 8 (Meta rounds to 256,
/// too coarse for small models): width 64 gives 176, width 256 gives 688.
pub fn default_intermediate(width: usize) -> usize {
    (2 * 4 * width / 3).div_ceil(8) * 8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config as transformers 5.x writes it, with `extra` fields merged in.
    fn v5(extra: serde_json::Value) -> String {
        let mut base = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
            "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false,
            "hidden_act": "silu", "transformers_version": "5.23.0"
        });
        for (k, v) in extra.as_object().unwrap() {
            base[k] = v.clone();
        }
        base.to_string()
    }

    fn v4(extra: serde_json::Value) -> String {
        let mut base: serde_json::Value = serde_json::from_str(&v5(serde_json::json!({}))).unwrap();
        let obj = base.as_object_mut().unwrap();
        obj.remove("rope_parameters");
        obj.insert("rope_theta".into(), 250.0.into());
        obj.insert("rope_scaling".into(), serde_json::Value::Null);
        for (k, v) in extra.as_object().unwrap() {
            obj.insert(k.clone(), v.clone());
        }
        base.to_string()
    }

    #[test]
    fn reads_the_5x_layout_with_rope_theta_under_rope_parameters() {
        let c = LlamaConfig::from_hf_json(&v5(serde_json::json!({}))).unwrap();
        assert_eq!(c.rope_theta, 500.0);
        assert_eq!(c.num_key_value_heads, 2);
        assert_eq!(c.head_dim, 8, "hidden / heads when head_dim is absent");
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert_eq!(c.vocab_size, 50);
        let c = LlamaConfig::from_hf_json(&v5(serde_json::json!({"head_dim": 16}))).unwrap();
        assert_eq!(c.head_dim, 16);
    }

    #[test]
    fn reads_the_4x_layout_with_rope_theta_at_the_top_level() {
        let c = LlamaConfig::from_hf_json(&v4(serde_json::json!({}))).unwrap();
        assert_eq!(c.rope_theta, 250.0);
        assert_eq!(c.intermediate_size, 64);
        // 4.x files with a default scaling block, in either spelling of its type.
        for scaling in [
            serde_json::json!({"rope_type": "default"}),
            serde_json::json!({"type": "default"}),
        ] {
            let c = LlamaConfig::from_hf_json(&v4(serde_json::json!({ "rope_scaling": scaling })))
                .unwrap();
            assert_eq!(c.rope_theta, 250.0);
        }
    }

    #[test]
    fn absent_optional_fields_take_transformers_defaults() {
        let text = serde_json::json!({
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 10, "max_position_embeddings": 16
        })
        .to_string();
        let c = LlamaConfig::from_hf_json(&text).unwrap();
        assert_eq!(c.num_key_value_heads, 4);
        assert_eq!(c.head_dim, 8);
        assert_eq!(c.rope_theta, 10_000.0);
        assert_eq!(c.rms_norm_eps, 1e-6);
    }

    fn refusal(text: String) -> String {
        format!("{:#}", LlamaConfig::from_hf_json(&text).unwrap_err())
    }

    #[test]
    fn what_is_not_implemented_is_refused_naming_the_field() {
        let e = refusal(v5(serde_json::json!({"tie_word_embeddings": true})));
        assert!(
            e.contains("tie_word_embeddings") && e.contains("false"),
            "{e}"
        );
        let e = refusal(v5(serde_json::json!({"attention_bias": true})));
        assert!(
            e.contains("attention_bias") && e.contains("no biases"),
            "{e}"
        );
        let e = refusal(v5(serde_json::json!({"mlp_bias": true})));
        assert!(e.contains("mlp_bias"), "{e}");
        let e = refusal(v5(serde_json::json!({"hidden_act": "gelu"})));
        assert!(e.contains("hidden_act") && e.contains("silu"), "{e}");
        assert!(
            LlamaConfig::from_hf_json(&v5(serde_json::json!({"hidden_act": "swish"}))).is_ok(),
            "transformers' ACT2FN maps \"swish\" to SiLU too"
        );
        let e = refusal(v5(serde_json::json!({"attention_dropout": 0.1})));
        assert!(e.contains("attention_dropout") && e.contains("0.0"), "{e}");
        let e = refusal(v5(serde_json::json!({"rope_parameters":
            {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}})));
        assert!(e.contains("rope_parameters") && e.contains("llama3"), "{e}");
        let e = refusal(v4(
            serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}}),
        ));
        assert!(e.contains("rope_scaling") && e.contains("linear"), "{e}");
        let e = refusal(v5(serde_json::json!({"num_key_value_heads": 3})));
        assert!(
            e.contains("num_key_value_heads 3") && e.contains("4"),
            "{e}"
        );
        let e = refusal(v5(serde_json::json!({"model_type": "mistral"})));
        assert!(e.contains("model_type"), "{e}");
        let e = refusal("{\"hidden_size\": 32}".to_string());
        assert!(e.contains("intermediate_size"), "{e}");
    }

    #[test]
    fn the_written_config_reads_back_as_the_same_model() {
        let c = LlamaConfig::from_flags(65, 2, 64, 4, 2, 176, 64).unwrap();
        let back = LlamaConfig::from_hf_json(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn flags_are_checked() {
        let e = LlamaConfig::from_flags(65, 2, 30, 4, 2, 176, 64).unwrap_err();
        assert!(e.to_string().contains("--width 30"), "{e}");
        let e = LlamaConfig::from_flags(65, 2, 64, 4, 3, 176, 64).unwrap_err();
        assert!(e.to_string().contains("num_key_value_heads 3"), "{e}");
    }

    #[test]
    fn the_default_intermediate_width_is_llamas_rule() {
        assert_eq!(default_intermediate(64), 176);
        assert_eq!(default_intermediate(256), 688);
        assert_eq!(default_intermediate(24), 64);
    }
}
