//! Which projections of the Llama decoder layers get adapters (`--lora-targets`, PEFT's
//! `target_modules`).

use anyhow::{bail, Result};

/// A linear projection of a Llama decoder layer, by its Hugging Face module name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LoraTarget {
    /// `self_attn.q_proj`.
    QProj,
    /// `self_attn.k_proj`.
    KProj,
    /// `self_attn.v_proj`.
    VProj,
    /// `self_attn.o_proj`.
    OProj,
    /// `mlp.gate_proj`.
    GateProj,
    /// `mlp.up_proj`.
    UpProj,
    /// `mlp.down_proj`.
    DownProj,
}

impl LoraTarget {
    /// Every projection, in the order of a decoder layer.
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::QProj,
        LoraTarget::KProj,
        LoraTarget::VProj,
        LoraTarget::OProj,
        LoraTarget::GateProj,
        LoraTarget::UpProj,
        LoraTarget::DownProj,
    ];

    /// The module's name (`q_proj`, ...), as PEFT's `target_modules` lists it.
    pub fn name(self) -> &'static str {
        match self {
            LoraTarget::QProj => "q_proj",
            LoraTarget::KProj => "k_proj",
            LoraTarget::VProj => "v_proj",
            LoraTarget::OProj => "o_proj",
            LoraTarget::GateProj => "gate_proj",
            LoraTarget::UpProj => "up_proj",
            LoraTarget::DownProj => "down_proj",
        }
    }

    /// The block holding it: `self_attn` or `mlp`.
    pub fn block(self) -> &'static str {
        match self {
            LoraTarget::QProj | LoraTarget::KProj | LoraTarget::VProj | LoraTarget::OProj => {
                "self_attn"
            }
            LoraTarget::GateProj | LoraTarget::UpProj | LoraTarget::DownProj => "mlp",
        }
    }

    /// The projection of this name, or an error naming the valid ones.
    pub fn from_name(name: &str) -> Result<Self> {
        match Self::ALL.into_iter().find(|t| t.name() == name) {
            Some(t) => Ok(t),
            None => bail!(
                "unknown projection {name:?}; the valid ones are {}",
                Self::ALL.map(Self::name).join(", ")
            ),
        }
    }

    /// The projections of a comma-separated list (`q_proj,v_proj`), in decoder-layer order, each
    /// once.
    pub fn parse_list(list: &str) -> Result<Vec<Self>> {
        let mut targets = list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(Self::from_name)
            .collect::<Result<Vec<_>>>()?;
        if targets.is_empty() {
            bail!(
                "no projection named; give one or more of {}, separated by commas",
                Self::ALL.map(Self::name).join(", ")
            );
        }
        targets.sort();
        targets.dedup();
        Ok(targets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_in_layer_order_once_each() {
        let t = LoraTarget::parse_list("v_proj, q_proj,v_proj,down_proj").unwrap();
        assert_eq!(
            t,
            [LoraTarget::QProj, LoraTarget::VProj, LoraTarget::DownProj]
        );
    }

    #[test]
    fn unknown_and_empty_lists_name_the_valid_projections() {
        let e = LoraTarget::parse_list("q_proj,qkv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"qkv\""), "{e}");
        assert!(e.contains("q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"));
        let e = LoraTarget::parse_list(" , ").unwrap_err().to_string();
        assert!(e.contains("no projection named"), "{e}");
    }
}
