//! `distributed_type: FSDP`: Accelerate's `fsdp_config` read as our ZeRO, as Accelerate 1.x's
//! launcher and `FullyShardedDataParallelPlugin` read it.
//!
//! - The stage. `fsdp_version` 1 (Accelerate's default) takes a sharding strategy: `FULL_SHARD`
//!   is ZeRO stage 3, `SHARD_GRAD_OP` stage 2, `NO_SHARD` stage 0 (or the integers 1, 2, 3 older
//!   files hold). `HYBRID_SHARD` and `HYBRID_SHARD_ZERO2` (4, 5) shard within a machine and
//!   replicate across machines, which we do not implement, and are refused. `fsdp_version` 2 takes
//!   `fsdp_reshard_after_forward`: `true` frees each unit's gathered parameters after its forward
//!   (`FULL_SHARD`, stage 3), `false` keeps them to the backward (`SHARD_GRAD_OP`, stage 2).
//! - The units (stage 3 only): `fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP` with
//!   `fsdp_transformer_layer_cls_to_wrap` (class names separated by commas) becomes
//!   `ACCELERATE_FSDP_LAYER_CLASSES`. Without classes, `SIZE_BASED_WRAP` and `NO_WRAP` (also
//!   Accelerate's default when the key is absent) are refused: stage 3 shards the model by the
//!   units a program declares by class.
//! - `fsdp_state_dict_type`: `FULL_STATE_DICT` or `SHARDED_STATE_DICT` becomes
//!   `ACCELERATE_FSDP_STATE_DICT_TYPE` (absent: Accelerate's default, `FULL_STATE_DICT` under
//!   version 1 and `SHARDED_STATE_DICT` under version 2); `LOCAL_STATE_DICT` is refused.
//! - The prefetch (stage 3 reads it; at other stages it is exported all the same and changes
//!   nothing, as the state dict type): `fsdp_forward_prefetch` (a bool) becomes
//!   `ACCELERATE_FSDP_FORWARD_PREFETCH` (true: the next unit gathered during the current one's
//!   forward, 1; false 0), and `fsdp_backward_prefetch` becomes `ACCELERATE_FSDP_BACKWARD_PREFETCH`
//!   (`BACKWARD_PRE` or `BACKWARD_POST`, or PyTorch's numbers 1 and 2 of older files: 1;
//!   `NO_PREFETCH`: 0). Absent or null, nothing is exported and the workers' defaults apply (see
//!   `prefetch.rs`). Read under both FSDP versions: Accelerate's FSDP2 ignores them, but a file
//!   that gives one asks for it.
//! - `fsdp_offload_params: true` is refused (no CPU offload of parameters).
//!
//! Keys without the `fsdp_` prefix (the oldest files: `sharding_strategy: 1`) are read with it,
//! as Accelerate's launcher does.

use serde_json::{Map, Value};

use super::prefetch::accelerate_bool;
use super::{is_neutral, Reader};

/// What checkpoints and `save_model` write of the parameters under ZeRO stage 3 (Accelerate's
/// `fsdp_state_dict_type`, exported as `ACCELERATE_FSDP_STATE_DICT_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateDictType {
    /// `FULL_STATE_DICT`: the whole model, gathered to the main process.
    Full,
    /// `SHARDED_STATE_DICT`: each rank its own pieces.
    Sharded,
}

impl StateDictType {
    /// What the values accept, for messages.
    pub const VALID: &'static str = "give FULL_STATE_DICT (the whole model, gathered to the main \
                                     process) or SHARDED_STATE_DICT (each rank its own pieces)";

    /// The value as Accelerate spells it (and the worker reads it).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Full => "FULL_STATE_DICT",
            Self::Sharded => "SHARDED_STATE_DICT",
        }
    }

    /// Accelerate's spelling in any case, or the number of PyTorch's `StateDictType` (1 full,
    /// 3 sharded), which Accelerate also takes; the error says what is accepted.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value.trim().to_ascii_uppercase().as_str() {
            "FULL_STATE_DICT" | "1" => Ok(Self::Full),
            "SHARDED_STATE_DICT" | "3" => Ok(Self::Sharded),
            "LOCAL_STATE_DICT" | "2" => Err(format!(
                "LOCAL_STATE_DICT (each rank's flattened shards, readable only by the same \
                 layout) is not implemented; {}",
                Self::VALID
            )),
            _ => Err(Self::VALID.to_string()),
        }
    }
}

impl std::str::FromStr for StateDictType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s)
    }
}

/// Class names separated by commas (Accelerate's `fsdp_transformer_layer_cls_to_wrap`), trimmed
/// and joined by commas alone: Accelerate splits on the commas without trimming, so a space after
/// one would name no class there. `Ok(None)` for an empty list; an empty name between commas is
/// refused.
pub fn layer_classes(text: &str) -> Result<Option<String>, String> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let names: Vec<&str> = text.split(',').map(str::trim).collect();
    if names.iter().any(|n| n.is_empty()) {
        return Err(format!("an empty class name between commas; {CLASSES}"));
    }
    Ok(Some(names.join(",")))
}

/// What `fsdp_transformer_layer_cls_to_wrap` accepts, for messages.
const CLASSES: &str =
    "give class names separated by commas (e.g. LlamaDecoderLayer, or GPT2Block,GPT2MLP)";

/// What an `fsdp_config` asks of our ZeRO.
#[derive(Debug)]
pub(super) struct Fsdp {
    pub zero_stage: u8,
    pub layer_classes: Option<String>,
    pub state_dict_type: StateDictType,
    /// Units gathered ahead in the forward pass; `None`: not given.
    pub forward_prefetch: Option<usize>,
    /// Units gathered ahead in the backward pass; `None`: not given.
    pub backward_prefetch: Option<usize>,
}

/// `fsdp_auto_wrap_policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WrapPolicy {
    Transformer,
    Size,
    No,
}

/// Keys read into the result.
const READ: &[&str] = &[
    "fsdp_version",
    "fsdp_sharding_strategy",
    "fsdp_reshard_after_forward",
    "fsdp_offload_params",
    "fsdp_auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_state_dict_type",
    "fsdp_forward_prefetch",
    "fsdp_backward_prefetch",
];

/// Keys accepted quietly whatever they hold, as none changes what training computes here:
/// - `fsdp_cpu_ram_efficient_loading`: a transformers loading hint (rank 0 reads the weights);
///   our programs build their models themselves;
/// - `fsdp_sync_module_states`: we always broadcast rank 0's weights when the model is prepared;
/// - `fsdp_use_orig_params`: our units always keep the original parameters (FSDP2 always does);
/// - `fsdp_activation_checkpointing`: stage 3 recomputes each unit's forward in its backward
///   anyway;
/// - `fsdp_min_num_params`: read only by `SIZE_BASED_WRAP`, refused at stage 3 by its own key,
///   and meaningless below it (Accelerate's launcher exports a default whatever the policy).
const QUIET: &[&str] = &[
    "fsdp_cpu_ram_efficient_loading",
    "fsdp_sync_module_states",
    "fsdp_use_orig_params",
    "fsdp_activation_checkpointing",
    "fsdp_min_num_params",
];

/// The way out named in the refusals of a wrap policy.
const USE_TRANSFORMER_WRAP: &str = "ZeRO stage 3 shards the model by the units a program \
     declares by class; set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP and \
     fsdp_transformer_layer_cls_to_wrap to the model's layer class (e.g. LlamaDecoderLayer)";

impl Reader<'_> {
    /// Reads `fsdp_config` (`None`: absent, every key at Accelerate's default).
    pub(super) fn fsdp(&mut self, config: Option<&Value>) -> Result<Fsdp, String> {
        let empty = Map::new();
        let config = match config {
            None => &empty,
            Some(Value::Object(map)) => map,
            Some(other) if is_neutral("fsdp_config", other) => &empty,
            Some(other) => {
                return Err(self.bad(
                    "fsdp_config",
                    other,
                    "expected a mapping (fsdp_version: 2, fsdp_auto_wrap_policy: \
                     TRANSFORMER_BASED_WRAP, ...)",
                ))
            }
        };
        // Accelerate's launcher reads `x` as `fsdp_x`; a null holds Accelerate's default.
        let mut keys: Vec<(String, &String, &Value)> = Vec::new();
        for (key, value) in config {
            let name = if key.starts_with("fsdp") {
                key.clone()
            } else {
                format!("fsdp_{key}")
            };
            if let Some((_, other, _)) = keys.iter().find(|(n, _, _)| *n == name) {
                return Err(format!(
                    "config file {}: fsdp_config: both {other} and {key} give {name}; keep one",
                    self.path.display()
                ));
            }
            keys.push((name, key, value));
        }
        let get = |name: &str| {
            keys.iter()
                .find(|(n, _, v)| n == name && !v.is_null())
                .map(|(_, key, value)| (format!("fsdp_config.{key}"), *value))
        };

        let version = match get("fsdp_version") {
            None => 1,
            Some((key, value)) => match value {
                Value::Number(n) => n.as_u64(),
                Value::String(s) => s.trim().parse::<u64>().ok(),
                _ => None,
            }
            .filter(|v| (1..=2).contains(v))
            .ok_or_else(|| {
                self.bad(
                    &key,
                    value,
                    "give 1 (FSDP's sharding strategies) or 2 (fully_shard, \
                     fsdp_reshard_after_forward)",
                )
            })?,
        };

        // The stage. Version 1: the sharding strategy; Accelerate's `accelerate config` has
        // written it as `fsdp_sharding_strategy` (before 1.6) and as `fsdp_reshard_after_forward`
        // (since), and its plugin prefers `sharding_strategy` when both are set, falling back to
        // `reshard_after_forward` (FULL_SHARD when neither is). Version 2: its plugin reads only
        // `reshard_after_forward`, a bool (true when absent), and ignores the sharding strategy.
        // The key that does not decide is quiet where it agrees and named where it does not.
        let strategy = get("fsdp_sharding_strategy");
        let reshard = get("fsdp_reshard_after_forward");
        let (zero_stage, unread) = if version == 1 {
            match (strategy, reshard) {
                (Some((key, value)), other) => (self.sharding_strategy(&key, value)?, other),
                (None, Some((key, value))) => (self.sharding_strategy(&key, value)?, None),
                (None, None) => (3, None),
            }
        } else {
            let stage = match reshard {
                Some((key, value)) => {
                    if self.reshard_after_forward(&key, value)? {
                        3
                    } else {
                        2
                    }
                }
                None => 3,
            };
            (stage, strategy)
        };
        if let Some((key, value)) = unread {
            let agrees = match value {
                Value::Bool(b) => (if *b { 3 } else { 2 }) == zero_stage,
                _ => self.sharding_strategy(&key, value).ok() == Some(zero_stage),
            };
            if !agrees {
                self.ignored.push(key);
            }
        }

        if let Some((key, value)) = get("fsdp_offload_params") {
            if self.switch(&key, value)? {
                return Err(self.bad(
                    &key,
                    value,
                    "offloading parameters and gradients to the CPU is not implemented; set it \
                     to false",
                ));
            }
        }

        let policy = match get("fsdp_auto_wrap_policy") {
            None => None,
            Some((key, value)) => Some((
                match value
                    .as_str()
                    .map(|s| s.trim().to_ascii_uppercase())
                    .as_deref()
                {
                    Some("TRANSFORMER_BASED_WRAP") => WrapPolicy::Transformer,
                    Some("SIZE_BASED_WRAP") => WrapPolicy::Size,
                    Some("NO_WRAP") => WrapPolicy::No,
                    _ => return Err(self.bad(
                        &key,
                        value,
                        "give TRANSFORMER_BASED_WRAP (with fsdp_transformer_layer_cls_to_wrap), \
                             SIZE_BASED_WRAP or NO_WRAP",
                    )),
                },
                key,
                value,
            )),
        };
        let classes = match get("fsdp_transformer_layer_cls_to_wrap") {
            None => None,
            Some((key, value)) => {
                let text = match value {
                    Value::String(s) => s.clone(),
                    // A YAML list of names, which Accelerate's plugin also takes.
                    Value::Array(items) if items.iter().all(Value::is_string) => items
                        .iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(","),
                    _ => return Err(self.bad(&key, value, CLASSES)),
                };
                let classes = layer_classes(&text).map_err(|why| self.bad(&key, value, &why))?;
                classes.map(|c| (c, key))
            }
        };
        // The units matter only where the parameters are sharded; below stage 3 any policy runs
        // the same.
        let layer_classes = match (policy, classes) {
            (Some((WrapPolicy::Transformer, _, _)), Some((classes, _))) => Some(classes),
            (Some((WrapPolicy::Transformer, _, _)), None) if zero_stage == 3 => {
                return Err(format!(
                    "config file {}: fsdp_config.fsdp_transformer_layer_cls_to_wrap: no class \
                     given, with fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP: give the model's \
                     layer class \
                     (e.g. LlamaDecoderLayer; class names separated by commas): ZeRO stage 3 \
                     shards the model by the units a program declares by class (Accelerate's \
                     fallback, the model's `_no_split_modules`, is a transformers attribute)",
                    self.path.display()
                ))
            }
            (Some((WrapPolicy::Size | WrapPolicy::No, key, value)), _) if zero_stage == 3 => {
                return Err(self.bad(
                    &key,
                    value,
                    &format!("not implemented; {USE_TRANSFORMER_WRAP}"),
                ))
            }
            (None, _) if zero_stage == 3 => {
                return Err(format!(
                    "config file {}: fsdp_config.fsdp_auto_wrap_policy: absent (Accelerate's \
                     default, NO_WRAP: the whole model one unit) is not implemented; \
                     {USE_TRANSFORMER_WRAP}",
                    self.path.display()
                ))
            }
            (_, Some((_, key))) => {
                // Accelerate reads the classes only under TRANSFORMER_BASED_WRAP.
                self.ignored.push(key);
                None
            }
            (_, None) => None,
        };

        let state_dict_type = match get("fsdp_state_dict_type") {
            // Accelerate's defaults (FullyShardedDataParallelPlugin.set_state_dict_type).
            None if version == 1 => StateDictType::Full,
            None => StateDictType::Sharded,
            Some((key, value)) => {
                let text = match value {
                    Value::String(s) => s.clone(),
                    Value::Number(n) => n.to_string(),
                    _ => String::new(),
                };
                StateDictType::parse(&text).map_err(|why| self.bad(&key, value, &why))?
            }
        };

        let forward_prefetch = get("fsdp_forward_prefetch")
            .map(|(key, value)| self.forward_prefetch(&key, value))
            .transpose()?;
        let backward_prefetch = get("fsdp_backward_prefetch")
            .map(|(key, value)| self.backward_prefetch(&key, value))
            .transpose()?;

        for (name, key, value) in &keys {
            let quiet = READ.contains(&name.as_str())
                || QUIET.contains(&name.as_str())
                || is_neutral(key, value);
            if !quiet {
                self.ignored.push(format!("fsdp_config.{key}"));
            }
        }
        Ok(Fsdp {
            zero_stage,
            layer_classes,
            state_dict_type,
            forward_prefetch,
            backward_prefetch,
        })
    }

    /// A version 1 sharding strategy as our ZeRO stage: Accelerate's names in any case, or the
    /// numbers of PyTorch's `ShardingStrategy` (1 to 5) that older files hold.
    fn sharding_strategy(&self, key: &str, value: &Value) -> Result<u8, String> {
        const VALID: &str = "give FULL_SHARD (ZeRO stage 3), SHARD_GRAD_OP (stage 2) or NO_SHARD \
                             (stage 0), or their numbers 1, 2, 3 (true or false is \
                             fsdp_reshard_after_forward under fsdp_version 2)";
        let name = match value {
            Value::Number(n) => n.to_string(),
            Value::String(s) => s.trim().to_ascii_uppercase(),
            _ => return Err(self.bad(key, value, VALID)),
        };
        match name.as_str() {
            "FULL_SHARD" | "1" => Ok(3),
            "SHARD_GRAD_OP" | "2" => Ok(2),
            "NO_SHARD" | "3" => Ok(0),
            "HYBRID_SHARD" | "4" | "HYBRID_SHARD_ZERO2" | "5" => Err(self.bad(
                key,
                value,
                &format!(
                    "HYBRID_SHARD and HYBRID_SHARD_ZERO2 (sharding within a machine, replicas \
                     across machines) are not implemented; {VALID}"
                ),
            )),
            _ => Err(self.bad(key, value, VALID)),
        }
    }

    /// A version 2 `reshard_after_forward`: a bool, or a string Accelerate's `str_to_bool` takes.
    fn reshard_after_forward(&self, key: &str, value: &Value) -> Result<bool, String> {
        accelerate_bool(value).ok_or_else(|| {
            self.bad(
                key,
                value,
                "fsdp_version 2 takes true (parameters freed after each unit's forward: ZeRO \
                 stage 3) or false (kept to the backward: stage 2); sharding strategies such as \
                 FULL_SHARD are fsdp_version 1's spelling",
            )
        })
    }
}
