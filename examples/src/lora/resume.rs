//! What a LoRA run's checkpoint must agree with to be resumed: the adapters' settings and the
//! frozen base they were trained over. Saved with the checkpoint (the accelerator's
//! `register_for_checkpointing`) and compared after `--resume` loads it, so that a resume with
//! another alpha, or over another base (another --seed or --init-weights), is refused instead of
//! training on silently.

use anyhow::{bail, Result};
use candle_core::{DType, Var};
use serde::{Deserialize, Serialize};

use super::config::LoraConfig;

/// One frozen base tensor, as the fingerprint records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaseTensor {
    /// The parameter's name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// CRC-32 of its values as little-endian f32 (exact for f32, bf16 and f16).
    pub crc32: u32,
}

/// The adapters' settings and the base's fingerprint (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraRunIdentity {
    /// The adapters' rank.
    pub r: usize,
    /// Their alpha.
    pub alpha: f64,
    /// Their target projections' names, in layer order.
    pub targets: Vec<String>,
    /// Every frozen base tensor, in name order.
    pub base: Vec<BaseTensor>,
}

impl LoraRunIdentity {
    /// The identity of a run of `lora` over the frozen parameters `base`.
    pub fn new(lora: &LoraConfig, base: &[(String, Var)]) -> Result<Self> {
        let mut tensors = base
            .iter()
            .map(|(name, var)| {
                let values = var
                    .as_tensor()
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let mut hasher = crc32fast::Hasher::new();
                for v in values {
                    hasher.update(&v.to_le_bytes());
                }
                Ok(BaseTensor {
                    name: name.clone(),
                    shape: var.dims().to_vec(),
                    crc32: hasher.finalize(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Self {
            r: lora.r,
            alpha: lora.alpha,
            targets: lora.targets.iter().map(|t| t.name().to_string()).collect(),
            base: tensors,
        })
    }

    /// Refuses `self`, this run's identity, when `checkpoint`'s differs, naming what differs.
    pub fn check_resumable_from(&self, checkpoint: &Self) -> Result<()> {
        let mut differences = Vec::new();
        if self.r != checkpoint.r {
            differences.push(format!(
                "--lora-r {} (the checkpoint's {})",
                self.r, checkpoint.r
            ));
        }
        if self.alpha != checkpoint.alpha {
            differences.push(format!(
                "--lora-alpha {} (the checkpoint's {})",
                self.alpha, checkpoint.alpha
            ));
        }
        if self.targets != checkpoint.targets {
            differences.push(format!(
                "--lora-targets {} (the checkpoint's {})",
                self.targets.join(","),
                checkpoint.targets.join(",")
            ));
        }
        let names = |i: &Self| i.base.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
        if names(self) != names(checkpoint) {
            differences
                .push("the base model's parameters (another model size or --config)".to_string());
        } else {
            let changed: Vec<&str> = self
                .base
                .iter()
                .zip(&checkpoint.base)
                .filter(|(a, b)| a != b)
                .map(|(a, _)| a.name.as_str())
                .collect();
            if !changed.is_empty() {
                let shown = changed
                    .iter()
                    .take(3)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ");
                differences.push(format!(
                    "the base model's weights ({} of {} tensors differ: {shown}{}; another \
                     --seed or --init-weights)",
                    changed.len(),
                    self.base.len(),
                    if changed.len() > 3 { ", ..." } else { "" }
                ));
            }
        }
        if !differences.is_empty() {
            bail!(
                "the checkpoint's LoRA run differs from this one in {}; resume with the \
                 checkpoint's settings and base, or start a fresh run in another \
                 --checkpoint-dir",
                differences.join("; ")
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::LoraTarget;
    use candle_core::Device;

    fn base(value: f32) -> Vec<(String, Var)> {
        let d = &Device::Cpu;
        vec![
            ("b".to_string(), Var::new(&[1f32, 2.], d).unwrap()),
            (
                "a".to_string(),
                Var::new(&[[value, 0.], [0., 1.]], d).unwrap(),
            ),
        ]
    }

    #[test]
    fn another_alpha_or_base_weight_is_named() {
        let lora = LoraConfig::default();
        let this = LoraRunIdentity::new(&lora, &base(1.0)).unwrap();
        this.check_resumable_from(&LoraRunIdentity::new(&lora, &base(1.0)).unwrap())
            .unwrap();
        let other = LoraConfig {
            alpha: 64.0,
            targets: vec![LoraTarget::QProj],
            ..lora.clone()
        };
        let e = this
            .check_resumable_from(&LoraRunIdentity::new(&other, &base(1.0)).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--lora-alpha 16 (the checkpoint's 64)")
                && e.contains("--lora-targets q_proj,v_proj (the checkpoint's q_proj)")
                && !e.contains("--lora-r"),
            "{e}"
        );
        let e = this
            .check_resumable_from(&LoraRunIdentity::new(&lora, &base(1.5)).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 of 2 tensors differ: a;"), "{e}");
    }
}
