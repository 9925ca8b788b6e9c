//! How many units ZeRO stage 3 gathers ahead of the one that runs (see `fsdp::prefetch`), as the
//! builder or the environment sets it.

use crate::env;
use crate::error::{Error, Result};

/// How many units ahead are gathered: in the forward pass (Accelerate's `fsdp_forward_prefetch`)
/// and in the backward pass (`fsdp_backward_prefetch`). 0 gathers each unit when it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrefetchDepth {
    /// Units gathered ahead of the one whose forward runs.
    pub forward: usize,
    /// Units gathered ahead of the one whose backward runs.
    pub backward: usize,
}

impl PrefetchDepth {
    /// Accelerate's defaults: no prefetch (`fsdp_forward_prefetch: false`, and
    /// `fsdp_backward_prefetch` unset, which Accelerate passes to FSDP as `None`).
    pub const DEFAULT: Self = Self {
        forward: 0,
        backward: 0,
    };

    /// Refuses a depth beyond [`env::MAX_PREFETCH_UNITS`].
    pub fn check(self) -> Result<Self> {
        if self.forward.max(self.backward) > env::MAX_PREFETCH_UNITS {
            return Err(Error::Config(format!(
                "fsdp_prefetch({}, {}): at most {} units can be gathered ahead (each \
                 holds one more unit's parameters; one or two hide a gather behind a unit's \
                 compute)",
                self.forward,
                self.backward,
                env::MAX_PREFETCH_UNITS
            )));
        }
        Ok(self)
    }

    /// Whether any unit is gathered ahead.
    pub fn any(self) -> bool {
        self.forward > 0 || self.backward > 0
    }

    /// `ACCELERATE_FSDP_FORWARD_PREFETCH` and `ACCELERATE_FSDP_BACKWARD_PREFETCH`, each where
    /// set, over [`DEFAULT`](Self::DEFAULT).
    pub fn from_env() -> Result<Self> {
        let forward = env::read(
            env::FSDP_FORWARD_PREFETCH,
            "expected the number of units to gather ahead (0 for none, at most 64), or \
             true/false as Accelerate's fsdp_forward_prefetch (1/0)",
            env::fsdp_forward_prefetch_units,
        )?;
        let backward = env::read(
            env::FSDP_BACKWARD_PREFETCH,
            "expected the number of units to gather ahead (0 for none, at most 64), or \
             Accelerate's fsdp_backward_prefetch: BACKWARD_PRE or BACKWARD_POST (1), \
             NO_PREFETCH (0)",
            env::fsdp_backward_prefetch_units,
        )?;
        Ok(Self {
            forward: forward.unwrap_or(Self::DEFAULT.forward),
            backward: backward.unwrap_or(Self::DEFAULT.backward),
        })
    }
}
