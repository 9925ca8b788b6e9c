//! A LoRA fine-tune's settings ([`LoraConfig`]) and their `adapter_config.json`, the file Hugging
//! Face PEFT's `LoraConfig` reads.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::target::LoraTarget;

/// Rank, scale and target projections of the adapters, and the dropout an adapter was trained with
/// (kept to be written back; dropout on the adapters' input is not applied while training here).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The adapters' rank r.
    pub r: usize,
    /// alpha: the update is scaled by `alpha / r`.
    pub alpha: f64,
    /// The projections of every decoder layer that get an adapter, in layer order.
    pub targets: Vec<LoraTarget>,
    /// PEFT's `lora_dropout`: read and written back, not applied (it does not change what a
    /// trained adapter computes).
    pub dropout: f64,
    /// The layers each target is adapted in where `target_modules` names them by module path
    /// (`model.layers.0.mlp.down_proj`, as PEFT saves `"all-linear"`); a target absent here is
    /// adapted in every layer. See [`check_layers`](Self::check_layers).
    pub layers: BTreeMap<LoraTarget, BTreeSet<usize>>,
}

impl Default for LoraConfig {
    /// The example's defaults: r 8, alpha 16, `q_proj` and `v_proj`, no dropout.
    fn default() -> Self {
        Self {
            r: 8,
            alpha: 16.0,
            targets: vec![LoraTarget::QProj, LoraTarget::VProj],
            dropout: 0.0,
            layers: BTreeMap::new(),
        }
    }
}

/// A key of `adapter_config.json` whose setting changes what the adapter computes and is not
/// implemented here: whether `value` (the key's value, `None` when absent or null) sets it, and
/// what to do instead.
struct Refused {
    key: &'static str,
    sets: fn(Option<&Value>) -> bool,
    fix: &'static str,
}

/// The keys refused by [`LoraConfig::from_peft_json`].
const REFUSED: &[Refused] = &[
    Refused {
        key: "use_rslora",
        sets: is_true,
        fix: "rsLoRA scales by alpha / sqrt(r); train with use_rslora=False",
    },
    Refused {
        key: "use_dora",
        sets: is_true,
        fix: "DoRA is not implemented; train with use_dora=False",
    },
    Refused {
        key: "fan_in_fan_out",
        sets: is_true,
        fix: "Llama's projections are not Conv1D; train with fan_in_fan_out=False",
    },
    Refused {
        key: "bias",
        sets: |v| v.is_some_and(|b| b.as_str() != Some("none")),
        fix: "trained biases are not implemented; train with bias=\"none\"",
    },
    Refused {
        key: "lora_bias",
        sets: is_true,
        fix: "lora_B's bias is not implemented; train with lora_bias=False",
    },
    Refused {
        key: "init_lora_weights",
        // PiSSA, OLoRA and CorDA adapters change the base weights they were trained over.
        sets: |v| {
            v.and_then(Value::as_str)
                .is_some_and(|s| s.starts_with("pissa") || matches!(s, "olora" | "corda"))
        },
        fix: "PiSSA, OLoRA and CorDA rewrite the base weights; convert the adapter to plain LoRA \
              (PEFT's path_initial_model_for_weight_conversion) or merge it into the base",
    },
    Refused {
        key: "alora_invocation_tokens",
        sets: |v| v.is_some(),
        fix: "activated LoRA is not implemented; train a plain LoRA adapter",
    },
    Refused {
        key: "rank_pattern",
        sets: is_non_empty,
        fix: "per-module ranks are not implemented; train with one r",
    },
    Refused {
        key: "alpha_pattern",
        sets: is_non_empty,
        fix: "per-module alphas are not implemented; train with one lora_alpha",
    },
    Refused {
        key: "layers_to_transform",
        sets: |v| v.is_some(),
        fix: "adapters on some layers only are not implemented; adapt every layer",
    },
    Refused {
        key: "layer_replication",
        sets: |v| v.is_some(),
        fix: "layer replication changes the model's depth; train without it",
    },
    Refused {
        key: "exclude_modules",
        sets: is_non_empty,
        fix: "list the adapted projections in target_modules instead",
    },
    Refused {
        key: "modules_to_save",
        sets: is_non_empty,
        fix: "fully trained modules beside the adapters are not implemented; train without them",
    },
    Refused {
        key: "trainable_token_indices",
        sets: is_non_empty,
        fix: "trained token embeddings are not implemented; train without them",
    },
    Refused {
        key: "target_parameters",
        sets: is_non_empty,
        fix: "LoRA on parameters (not modules) is not implemented; target the projections",
    },
];

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
            "lora_dropout": self.dropout,
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
    /// `peft_type`, and the keys of the refused table: rsLoRA, DoRA, biases, PiSSA-like
    /// initializations, per-module ranks, some layers only, ...) is refused naming the key and
    /// the way out. `target_modules` may give module names (`q_proj`) or paths
    /// (`model.layers.0.self_attn.q_proj`), matched on their last component as PEFT does.
    pub fn from_peft_json(value: &Value) -> Result<Self> {
        let field = |key: &str| value.get(key).filter(|v| !v.is_null());
        let peft_type = field("peft_type").and_then(Value::as_str);
        if peft_type != Some("LORA") {
            bail!("peft_type is {peft_type:?}; only \"LORA\" adapters are read");
        }
        for refused in REFUSED {
            if (refused.sets)(field(refused.key)) {
                bail!(
                    "{} is {}, which this example does not implement: {}",
                    refused.key,
                    value[refused.key],
                    refused.fix
                );
            }
        }
        let r = field("r")
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .context("r must be a whole number of at least 1")? as usize;
        let alpha = field("lora_alpha")
            .and_then(Value::as_f64)
            .context("lora_alpha must be a number")?;
        let dropout = match field("lora_dropout") {
            None => 0.0,
            Some(d) => d
                .as_f64()
                .filter(|d| (0.0..1.0).contains(d))
                .context("lora_dropout must be a number in [0, 1)")?,
        };
        let (targets, layers) = match field("target_modules") {
            Some(Value::Array(names)) => {
                let names = names
                    .iter()
                    .map(|n| n.as_str().context("target_modules must hold strings"))
                    .collect::<Result<Vec<_>>>()?;
                targets_of_module_paths(&names).context("target_modules")?
            }
            Some(Value::String(s)) => bail!(
                "target_modules is the pattern {s:?}; give the list of projection names instead"
            ),
            _ => bail!("target_modules must list the projections (e.g. [\"q_proj\", \"v_proj\"])"),
        };
        Ok(Self {
            r,
            alpha,
            targets,
            dropout,
            layers,
        })
    }

    /// Refuses an adapter whose `target_modules` paths cover a target in some of the model's
    /// `num_layers` decoder layers only (or in layers it does not have), naming them: the model
    /// adapts every layer of a target.
    pub fn check_layers(&self, num_layers: usize) -> Result<()> {
        for (target, layers) in &self.layers {
            let missing: Vec<usize> = (0..num_layers).filter(|l| !layers.contains(l)).collect();
            let extra: Vec<&usize> = layers.iter().filter(|&&l| l >= num_layers).collect();
            if !missing.is_empty() || !extra.is_empty() {
                bail!(
                    "target_modules adapts {} in layers {layers:?} only: missing {missing:?}{} of \
                     the model's {num_layers}; this example adapts a projection in every layer, \
                     so train the adapter on all of them (or pass the module name {:?} alone)",
                    target.name(),
                    if extra.is_empty() {
                        String::new()
                    } else {
                        format!(", and layers {extra:?} are beyond")
                    },
                    target.name()
                );
            }
        }
        Ok(())
    }
}

/// The targets of PEFT `target_modules` entries, each a projection name or a module path ending
/// with one, and the layers named by paths (`model.layers.N.block.proj`) per target never named
/// alone. A path's block must be the projection's (`self_attn.q_proj`, not `mlp.q_proj`).
fn targets_of_module_paths(names: &[&str]) -> Result<(Vec<LoraTarget>, LayersPerTarget)> {
    let mut every_layer = BTreeSet::new();
    let mut layers: BTreeMap<LoraTarget, BTreeSet<usize>> = BTreeMap::new();
    for name in names {
        let parts: Vec<&str> = name.split('.').collect();
        let (projection, path) = parts.split_last().expect("split yields one part at least");
        let target = LoraTarget::from_name(projection).with_context(|| format!("{name:?}"))?;
        if let Some(block) = path.last() {
            if *block != target.block() {
                bail!(
                    "{name:?}: {projection} is in {}, not {block}",
                    target.block()
                );
            }
        }
        let layer = path
            .windows(2)
            .find(|w| w[0] == "layers")
            .map(|w| {
                w[1].parse::<usize>()
                    .with_context(|| format!("{name:?}: layer {:?} is not a number", w[1]))
            })
            .transpose()?;
        match layer {
            Some(layer) => {
                layers.entry(target).or_default().insert(layer);
            }
            None => {
                every_layer.insert(target);
            }
        }
    }
    if names.is_empty() {
        LoraTarget::parse_list("")?;
    }
    layers.retain(|t, _| !every_layer.contains(t));
    let mut targets: Vec<LoraTarget> = every_layer
        .into_iter()
        .chain(layers.keys().copied())
        .collect();
    targets.sort();
    targets.dedup();
    Ok((targets, layers))
}

/// The layers named per target (see [`LoraConfig::layers`]).
type LayersPerTarget = BTreeMap<LoraTarget, BTreeSet<usize>>;

/// Whether a JSON value is `true`.
fn is_true(v: Option<&Value>) -> bool {
    v == Some(&Value::Bool(true))
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

    fn config() -> LoraConfig {
        LoraConfig {
            r: 4,
            alpha: 8.0,
            targets: vec![LoraTarget::QProj, LoraTarget::DownProj],
            ..LoraConfig::default()
        }
    }

    #[test]
    fn peft_json_reads_back_as_the_same_settings() {
        let c = config();
        let j = c.to_peft_json(Some("org/base"));
        assert_eq!(j["peft_type"], "LORA");
        assert_eq!(j["target_modules"], json!(["q_proj", "down_proj"]));
        assert_eq!(j["base_model_name_or_path"], "org/base");
        assert_eq!(LoraConfig::from_peft_json(&j).unwrap(), c);
        assert!(c.to_peft_json(None)["base_model_name_or_path"].is_null());
    }

    #[test]
    fn dropout_is_accepted_and_written_back() {
        let mut j = config().to_peft_json(None);
        j["lora_dropout"] = json!(0.05);
        let c = LoraConfig::from_peft_json(&j).unwrap();
        assert_eq!(c.dropout, 0.05);
        assert_eq!(c.to_peft_json(None)["lora_dropout"], json!(0.05));
        j["lora_dropout"] = json!(1.5);
        let e = format!("{:#}", LoraConfig::from_peft_json(&j).unwrap_err());
        assert!(e.contains("lora_dropout must be a number in [0, 1)"), "{e}");
    }

    #[test]
    fn what_the_model_cannot_compute_is_refused_by_key() {
        let c = LoraConfig {
            targets: vec![LoraTarget::VProj],
            ..config()
        };
        for (key, value) in [
            ("use_dora", json!(true)),
            ("bias", json!("all")),
            ("peft_type", json!("IA3")),
            ("init_lora_weights", json!("pissa")),
            ("init_lora_weights", json!("pissa_niter_16")),
            ("init_lora_weights", json!("olora")),
            ("init_lora_weights", json!("corda")),
            ("alora_invocation_tokens", json!([1, 2])),
            ("lora_bias", json!(true)),
            ("exclude_modules", json!(["q_proj"])),
            ("layer_replication", json!([[0, 1]])),
            ("trainable_token_indices", json!([5])),
            ("target_parameters", json!(["mlp.experts.gate_up_proj"])),
        ] {
            let mut j = c.to_peft_json(None);
            j[key] = value.clone();
            let e = format!("{:#}", LoraConfig::from_peft_json(&j).unwrap_err());
            assert!(e.contains(key), "{key}: {e}");
            if key != "peft_type" {
                assert!(e.contains("does not implement"), "{key} {value}: {e}");
            }
        }
        // What PEFT writes by default for them is accepted.
        let mut j = c.to_peft_json(None);
        for (key, value) in [
            ("init_lora_weights", json!("gaussian")),
            ("alora_invocation_tokens", json!(null)),
            ("lora_bias", json!(false)),
            ("exclude_modules", json!(null)),
            ("layer_replication", json!(null)),
            ("trainable_token_indices", json!(null)),
            ("target_parameters", json!(null)),
        ] {
            j[key] = value;
        }
        assert_eq!(LoraConfig::from_peft_json(&j).unwrap(), c);
    }

    /// `target_modules` of `names`, read.
    fn with_modules(names: &[&str]) -> Result<LoraConfig> {
        let mut j = config().to_peft_json(None);
        j["target_modules"] = json!(names);
        LoraConfig::from_peft_json(&j)
    }

    #[test]
    fn module_paths_match_on_their_last_component() {
        let c = with_modules(&[
            "self_attn.q_proj",
            "model.layers.0.mlp.down_proj",
            "model.layers.1.mlp.down_proj",
        ])
        .unwrap();
        assert_eq!(c.targets, [LoraTarget::QProj, LoraTarget::DownProj]);
        assert_eq!(
            c.layers,
            BTreeMap::from([(LoraTarget::DownProj, BTreeSet::from([0, 1]))])
        );
        c.check_layers(2).unwrap();
        // A projection also named alone is in every layer.
        let c = with_modules(&["down_proj", "model.layers.0.mlp.down_proj"]).unwrap();
        assert!(c.layers.is_empty());
        c.check_layers(5).unwrap();

        let e = format!(
            "{:#}",
            with_modules(&["model.layers.0.mlp.q_proj"]).unwrap_err()
        );
        assert!(e.contains("q_proj is in self_attn, not mlp"), "{e}");
        let e = format!(
            "{:#}",
            with_modules(&["model.layers.0.self_attn.qkv"]).unwrap_err()
        );
        assert!(e.contains("\"qkv\""), "{e}");
    }

    #[test]
    fn an_adapter_on_some_layers_only_is_refused_naming_them() {
        let c = with_modules(&[
            "model.layers.0.self_attn.q_proj",
            "model.layers.2.self_attn.q_proj",
        ])
        .unwrap();
        let e = c.check_layers(4).unwrap_err().to_string();
        assert!(
            e.contains("q_proj in layers {0, 2} only: missing [1, 3]"),
            "{e}"
        );
        let e = c.check_layers(2).unwrap_err().to_string();
        assert!(
            e.contains("missing [1]") && e.contains("layers [2] are beyond"),
            "{e}"
        );
    }
}
