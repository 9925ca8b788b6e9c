//! What `save_state` writes of a fully sharded model's parameters (ZeRO stage 3): Accelerate's
//! `fsdp_state_dict_type`, which the launcher exports as `ACCELERATE_FSDP_STATE_DICT_TYPE`.

use crate::env;
use crate::error::Result;

/// How a checkpoint holds the parameters of a model trained under ZeRO stage 3 (Accelerate's
/// `fsdp_state_dict_type`). Both load at any stage and world size; below stage 3 the parameters
/// are whole on every rank and always saved whole. `save_model` always writes the whole model.
///
/// Without `ACCELERATE_FSDP_STATE_DICT_TYPE` it is [`Sharded`](Self::Sharded): Accelerate's
/// default under FSDP version 2 (the launcher exports FSDP version 1's default, `FULL_STATE_DICT`,
/// itself), and what DeepSpeed's stage-3 checkpoints hold; it gathers nothing and no rank holds
/// more than its own pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateDictType {
    /// `FULL_STATE_DICT`: gathered unit by unit to the main process's host and written whole in
    /// `model.safetensors`, as a stage-0 checkpoint holds them (manifest format version 2).
    Full,
    /// `SHARDED_STATE_DICT`: every rank writes its own pieces (`model.rank_<r>.safetensors`),
    /// nothing is gathered; a load re-cuts them for its own stage and world size.
    Sharded,
}

impl StateDictType {
    /// What `ACCELERATE_FSDP_STATE_DICT_TYPE` accepts, for messages.
    const VALID: &'static str = "FULL_STATE_DICT (the whole model, gathered to the main \
        process) or SHARDED_STATE_DICT (each rank its own pieces), as Accelerate spells them (or \
        1 and 3, PyTorch's numbers); LOCAL_STATE_DICT is not implemented";

    /// The value as Accelerate spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Full => "FULL_STATE_DICT",
            Self::Sharded => "SHARDED_STATE_DICT",
        }
    }

    /// Accelerate's spelling in any case, or PyTorch's number for it (1 full, 3 sharded), as
    /// Accelerate takes them; `None` for anything else (`LOCAL_STATE_DICT` included).
    pub fn parse(value: &str) -> Option<Self> {
        match value.trim().to_ascii_uppercase().as_str() {
            "FULL_STATE_DICT" | "1" => Some(Self::Full),
            "SHARDED_STATE_DICT" | "3" => Some(Self::Sharded),
            _ => None,
        }
    }

    /// `ACCELERATE_FSDP_STATE_DICT_TYPE`, or [`Sharded`](Self::Sharded) without it; an error
    /// naming the variable and what it accepts for any other value.
    pub fn from_env() -> Result<Self> {
        Ok(
            env::read(env::FSDP_STATE_DICT_TYPE, Self::VALID, Self::parse)?
                .unwrap_or(Self::Sharded),
        )
    }

    /// PyTorch's number for it, which ranks exchange to agree.
    pub(crate) fn code(self) -> i64 {
        match self {
            Self::Full => 1,
            Self::Sharded => 3,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accelerates_spellings_and_pytorchs_numbers_parse_and_local_does_not() {
        for (value, kind) in [
            ("FULL_STATE_DICT", StateDictType::Full),
            (" full_state_dict ", StateDictType::Full),
            ("1", StateDictType::Full),
            ("SHARDED_STATE_DICT", StateDictType::Sharded),
            ("Sharded_State_Dict", StateDictType::Sharded),
            ("3", StateDictType::Sharded),
        ] {
            assert_eq!(StateDictType::parse(value), Some(kind), "{value:?}");
            assert_eq!(StateDictType::parse(kind.as_str()), Some(kind));
        }
        for value in ["LOCAL_STATE_DICT", "2", "full", ""] {
            assert_eq!(StateDictType::parse(value), None, "{value:?}");
        }
    }
}
