//! Adapters in Hugging Face PEFT's files: `adapter_model.safetensors` (the `lora_A` `[r, in]` and
//! `lora_B` `[out, r]` of every adapted projection, named
//! `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, no adapter name) and
//! `adapter_config.json` beside it, so that `PeftModel.from_pretrained(base, dir)` loads them.

use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{Tensor, Var};

use super::config::LoraConfig;

/// The weights file of an adapter directory.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The settings file of an adapter directory.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// What PEFT's saved names put before the base model's module path.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// Writes the adapter `params` (named as [`super::adapter_parameter_name`]) and `lora`'s settings
/// into `dir` (created if missing), each file atomically.
pub fn save_adapter(
    dir: &Path,
    lora: &LoraConfig,
    base_model: Option<&str>,
    params: &[(String, Var)],
) -> accelerate_core::Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| accelerate_core::Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let tensors: Vec<(String, Tensor)> = params
        .iter()
        .map(|(n, v)| (format!("{PEFT_PREFIX}{n}"), v.as_tensor().clone()))
        .collect();
    accelerate_core::save_safetensors(dir.join(ADAPTER_WEIGHTS), &tensors)?;
    let json =
        serde_json::to_vec_pretty(&lora.to_peft_json(base_model)).expect("a JSON value serializes");
    accelerate_core::write_atomic(dir.join(ADAPTER_CONFIG), &json)
}

/// The settings of the adapter in `dir` (its `adapter_config.json`).
pub fn read_adapter_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join(ADAPTER_CONFIG);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    LoraConfig::from_peft_json(&value).with_context(|| path.display().to_string())
}

/// Sets the adapter `params` to the weights in `dir`'s `adapter_model.safetensors`; a missing,
/// unexpected or wrongly shaped tensor is an error listing each.
pub fn load_adapter(dir: &Path, params: &[(String, Var)]) -> Result<()> {
    let peft_named: Vec<(String, Var)> = params
        .iter()
        .map(|(n, v)| (format!("{PEFT_PREFIX}{n}"), v.clone()))
        .collect();
    accelerate_core::load_into_vars(dir.join(ADAPTER_WEIGHTS), &peft_named)?;
    Ok(())
}
