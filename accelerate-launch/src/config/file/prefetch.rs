//! Stage 3's prefetch: Accelerate's `fsdp_forward_prefetch` and `fsdp_backward_prefetch`, read as
//! the number of units all-gathered ahead of the one that runs (0 for none), which the launcher
//! exports as `ACCELERATE_FSDP_FORWARD_PREFETCH` and `ACCELERATE_FSDP_BACKWARD_PREFETCH`.
//!
//! Two readings, one per source, because a number means different things in each:
//! - **Flags** (`--fsdp-forward-prefetch`, `--fsdp-backward-prefetch`) take what the workers'
//!   variables take (`accelerate_core::env::fsdp_forward_prefetch_units` and its backward twin,
//!   the very parsers the workers use), so that a typo fails before any worker
//!   starts: a number of units 0 to 64; or, forward, an on/off switch (1 unit or none); backward,
//!   one of PyTorch's `BackwardPrefetch` names (`BACKWARD_PRE` and `BACKWARD_POST`: 1 unit;
//!   `NO_PREFETCH`: none).
//! - **A config file** holds what Accelerate's `FullyShardedDataParallelPlugin` accepts: forward,
//!   a bool (or a string its `str_to_bool` takes); backward, a name, or the number of PyTorch's
//!   enum that older files hold (1 `BACKWARD_PRE`, 2 `BACKWARD_POST`), never a count of units.
//!   Anything else Accelerate refuses is refused, with the flag that sets a depth named.

use serde_json::Value;

use super::Reader;

/// What `--fsdp-forward-prefetch` accepts, for messages.
const FORWARD_UNITS: &str = "give the number of units all-gathered ahead in the forward pass, 0 \
                             to 64, or true/false (1/0; also on/off, yes/no)";

/// What `--fsdp-backward-prefetch` accepts, for messages.
const BACKWARD_UNITS: &str = "give the number of units all-gathered ahead in the backward pass, \
                              0 to 64, or BACKWARD_PRE or BACKWARD_POST (1 unit), NO_PREFETCH \
                              (none)";

/// Parses `--fsdp-forward-prefetch`: the units gathered ahead in the forward pass, as the workers
/// read `ACCELERATE_FSDP_FORWARD_PREFETCH` (a number 0 to 64, or true/false for 1/0).
pub fn forward_prefetch_units(value: &str) -> Result<usize, String> {
    accelerate_core::env::fsdp_forward_prefetch_units(value).ok_or_else(|| FORWARD_UNITS.into())
}

/// Parses `--fsdp-backward-prefetch`: the units gathered ahead in the backward pass, as the
/// workers read `ACCELERATE_FSDP_BACKWARD_PREFETCH` (a number 0 to 64, or a `BackwardPrefetch`
/// name: both of FSDP's timings gather the next unit while the current one's backward runs, which
/// is one unit ahead).
pub fn backward_prefetch_units(value: &str) -> Result<usize, String> {
    accelerate_core::env::fsdp_backward_prefetch_units(value).ok_or_else(|| BACKWARD_UNITS.into())
}

impl Reader<'_> {
    /// `fsdp_forward_prefetch` of a config file: a bool, or a string or number Accelerate's
    /// `str_to_bool` takes; true is one unit ahead.
    pub(super) fn forward_prefetch(&self, key: &str, value: &Value) -> Result<usize, String> {
        accelerate_bool(value).map(usize::from).ok_or_else(|| {
            self.bad(
                key,
                value,
                "give true (the next unit all-gathered while the current one's forward runs) or \
                 false (none); for more units ahead use --fsdp-forward-prefetch N",
            )
        })
    }

    /// `fsdp_backward_prefetch` of a config file: Accelerate's names in any case, or the number
    /// of PyTorch's `BackwardPrefetch` (1 `BACKWARD_PRE`, 2 `BACKWARD_POST`), as its plugin reads
    /// it.
    pub(super) fn backward_prefetch(&self, key: &str, value: &Value) -> Result<usize, String> {
        let name = match value {
            Value::Number(n) => n.to_string(),
            Value::String(s) => s.trim().to_ascii_uppercase(),
            _ => String::new(),
        };
        match name.as_str() {
            "BACKWARD_PRE" | "BACKWARD_POST" | "1" | "2" => Ok(1),
            "NO_PREFETCH" => Ok(0),
            _ => Err(self.bad(
                key,
                value,
                "give BACKWARD_PRE or BACKWARD_POST (the next unit all-gathered while the current \
                 one's backward runs), NO_PREFETCH (none), or PyTorch's numbers for the first \
                 two, 1 or 2; a number here is not a count of units: for more units ahead use \
                 --fsdp-backward-prefetch N",
            )),
        }
    }
}

/// A bool as Accelerate's `str_to_bool` reads a string (`y`, `yes`, `t`, `true`, `on`, `1` and
/// their opposites, in any case); a YAML bool as itself.
pub(super) fn accelerate_bool(value: &Value) -> Option<bool> {
    let text = match value {
        Value::Bool(b) => return Some(*b),
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.trim().to_ascii_lowercase(),
        _ => return None,
    };
    match text.as_str() {
        "y" | "yes" | "t" | "true" | "on" | "1" => Some(true),
        "n" | "no" | "f" | "false" | "off" | "0" => Some(false),
        _ => None,
    }
}
