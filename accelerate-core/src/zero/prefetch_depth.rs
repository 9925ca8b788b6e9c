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

    /// Refuses a depth beyond [`MAX_DEPTH`].
    pub fn check(self) -> Result<Self> {
        if self.forward.max(self.backward) > MAX_DEPTH {
            return Err(Error::Config(format!(
                "fsdp_prefetch({}, {}): at most {MAX_DEPTH} units can be gathered ahead (each \
                 holds one more unit's parameters; one or two hide a gather behind a unit's \
                 compute)",
                self.forward, self.backward
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
            forward_units,
        )?;
        let backward = env::read(
            env::FSDP_BACKWARD_PREFETCH,
            "expected the number of units to gather ahead (0 for none, at most 64), or \
             Accelerate's fsdp_backward_prefetch: BACKWARD_PRE or BACKWARD_POST (1), \
             NO_PREFETCH (0)",
            backward_units,
        )?;
        Ok(Self {
            forward: forward.unwrap_or(Self::DEFAULT.forward),
            backward: backward.unwrap_or(Self::DEFAULT.backward),
        })
    }
}

/// A number of units ahead, at most this many (more only holds more memory to no use).
pub(crate) const MAX_DEPTH: usize = 64;

fn units(value: &str) -> Option<usize> {
    value.parse::<usize>().ok().filter(|&n| n <= MAX_DEPTH)
}

/// `ACCELERATE_FSDP_FORWARD_PREFETCH`: a number of units, or an on/off switch (one unit or none).
fn forward_units(value: &str) -> Option<usize> {
    units(value).or_else(|| env::switch(value).map(usize::from))
}

/// `ACCELERATE_FSDP_BACKWARD_PREFETCH`: a number of units, or one of PyTorch's `BackwardPrefetch`
/// names. Both of FSDP's timings gather the next unit while the current one's backward runs, which
/// is what one unit ahead does here.
fn backward_units(value: &str) -> Option<usize> {
    units(value).or_else(|| match value.to_ascii_uppercase().as_str() {
        "BACKWARD_PRE" | "BACKWARD_POST" => Some(1),
        "NO_PREFETCH" | "NONE" => Some(0),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_depths_read_numbers_and_accelerates_names() {
        assert_eq!(forward_units("2"), Some(2));
        assert_eq!(forward_units("true"), Some(1));
        assert_eq!(forward_units("false"), Some(0));
        assert_eq!(forward_units("65"), None);
        assert_eq!(backward_units("BACKWARD_PRE"), Some(1));
        assert_eq!(backward_units("backward_post"), Some(1));
        assert_eq!(backward_units("NO_PREFETCH"), Some(0));
        assert_eq!(backward_units("3"), Some(3));
        assert_eq!(backward_units("sometimes"), None);
    }
}
