//! A LoRA fine-tune's settings ([`LoraConfig`]) and their `adapter_config.json`, the file Hugging
//! Face PEFT's `LoraConfig` reads.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::target::LoraTarget;

/// Rank, scale and target projections of the adapters. Dropout on the adapters' input is not
/// implemented (PEFT's `lora_dropout` is written as 0).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The adapters' rank r.
    pub r: usize,
    /// alpha: the update is scaled by `alpha / r`.
    pub alpha: f64,
    /// The projections of every decoder layer that get an adapter, in layer order.
    pub targets: Vec<LoraTarget>,
}

impl LoraConfig {
    /// `adapter_config.json` as PEFT writes it for a causal language model: its `base_model`
    /// (a Hugging Face model id or path, or none) carrying these adapters.
    pub fn to_peft_json(&self, base_model: Option<&str>) -> Value {
        json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.r,
            // A whole alpha as an integer, as PEFT's own files have it.
            "lora_alpha": if self.alpha.fract() == 0.0 && self.alpha.abs() < 1e15 {
                json!(self.alpha as i64)
            } else {
                json!(self.alpha)
            },
            "lora_dropout": 0.0,
            "target_modules": self.targets.iter().map(|t| t.name()).collect::<Vec<_>>(),
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "use_rslora": false,
            "use_dora": false,
            "modules_to_save": null,
            "layers_to_transform": null,
            "revision": null,
        })
    }

    /// The settings of a PEFT `adapter_config.json`; what this model cannot compute (another
    /// `peft_type`, rsLoRA, DoRA, a bias, dropout, `fan_in_fan_out`, per-layer ranks, some layers
    /// only) is refused naming the key.
    pub fn from_peft_json(value: &Value) -> Result<Self> {
        let field = |key: &str| value.get(key).filter(|v| !v.is_null());
        let peft_type = field("peft_type").and_then(Value::as_str);
        if peft_type != Some("LORA") {
            bail!("peft_type is {peft_type:?}; only \"LORA\" adapters are read");
        }
        let r = field("r")
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .context("r must be a whole number of at least 1")? as usize;
        let alpha = field("lora_alpha")
            .and_then(Value::as_f64)
            .context("lora_alpha must be a number")?;
        let targets = match field("target_modules") {
            Some(Value::Array(names)) => {
                let names: Vec<&str> = names.iter().filter_map(Value::as_str).collect();
                LoraTarget::parse_list(&names.join(",")).context("target_modules")?
            }
            Some(Value::String(s)) => bail!(
                "target_modules is the pattern {s:?}; give the list of projection names instead"
            ),
            _ => bail!("target_modules must list the projections (e.g. [\"q_proj\", \"v_proj\"])"),
        };
        for (key, unsupported) in [
            (
                "use_rslora",
                field("use_rslora") == Some(&Value::Bool(true)),
            ),
            ("use_dora", field("use_dora") == Some(&Value::Bool(true))),
            (
                "fan_in_fan_out",
                field("fan_in_fan_out") == Some(&Value::Bool(true)),
            ),
            (
                "bias",
                field("bias").is_some_and(|b| b.as_str() != Some("none")),
            ),
            (
                "lora_dropout",
                field("lora_dropout").is_some_and(|d| d.as_f64() != Some(0.0)),
            ),
            ("rank_pattern", is_non_empty(field("rank_pattern"))),
            ("alpha_pattern", is_non_empty(field("alpha_pattern"))),
            (
                "layers_to_transform",
                field("layers_to_transform").is_some(),
            ),
            ("modules_to_save", is_non_empty(field("modules_to_save"))),
        ] {
            if unsupported {
                bail!(
                    "{key} is {}; this example reads plain LoRA adapters only (no rsLoRA, DoRA, \
                     bias, dropout, per-module ranks or layer subsets)",
                    value[key]
                );
            }
        }
        Ok(Self { r, alpha, targets })
    }
}

/// Whether a JSON value is present and not an empty object or list.
fn is_non_empty(v: Option<&Value>) -> bool {
    match v {
        None => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_json_reads_back_as_the_same_settings() {
        let c = LoraConfig {
            r: 4,
            alpha: 8.0,
            targets: vec![LoraTarget::QProj, LoraTarget::DownProj],
        };
        let j = c.to_peft_json(Some("org/base"));
        assert_eq!(j["peft_type"], "LORA");
        assert_eq!(j["target_modules"], json!(["q_proj", "down_proj"]));
        assert_eq!(j["base_model_name_or_path"], "org/base");
        assert_eq!(LoraConfig::from_peft_json(&j).unwrap(), c);
        assert!(c.to_peft_json(None)["base_model_name_or_path"].is_null());
    }

    #[test]
    fn what_the_model_cannot_compute_is_refused_by_key() {
        let c = LoraConfig {
            r: 4,
            alpha: 8.0,
            targets: vec![LoraTarget::VProj],
        };
        for (key, value) in [
            ("use_dora", json!(true)),
            ("lora_dropout", json!(0.1)),
            ("bias", json!("all")),
            ("peft_type", json!("IA3")),
        ] {
            let mut j = c.to_peft_json(None);
            j[key] = value;
            let e = format!("{:#}", LoraConfig::from_peft_json(&j).unwrap_err());
            assert!(e.contains(key), "{key}: {e}");
        }
    }
}
