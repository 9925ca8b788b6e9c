//! Stage 3's prefetch: Accelerate's `fsdp_forward_prefetch` and `fsdp_backward_prefetch`, read as
//! the number of units all-gathered ahead of the one that runs (0 for none), which the launcher
//! exports as `ACCELERATE_FSDP_FORWARD_PREFETCH` and `ACCELERATE_FSDP_BACKWARD_PREFETCH`.
//!
//! Two readings, one per source, because a number means different things in each:
//! - **Flags** (`--fsdp-forward-prefetch`, `--fsdp-backward-prefetch`) take what the workers'
//!   variables take (accelerate-core's `fsdp/prefetch.rs`), so that a typo fails before any worker
//!   starts: a number of units 0 to 64; or, forward, an on/off switch (1 unit or none); backward,
//!   one of PyTorch's `BackwardPrefetch` names (`BACKWARD_PRE` and `BACKWARD_POST`: 1 unit;
//!   `NO_PREFETCH`: none).
//! - **A config file** holds what Accelerate's `FullyShardedDataParallelPlugin` accepts: forward,
//!   a bool (or a string its `str_to_bool` takes); backward, a name, or the number of PyTorch's
//!   enum that older files hold (1 `BACKWARD_PRE`, 2 `BACKWARD_POST`), never a count of units.
//!   Anything else Accelerate refuses is refused, with the flag that sets a depth named.

use serde_json::Value;

use super::Reader;

/// The most units gathered ahead: accelerate-core's bound (more only holds memory to no use).
const MAX_PREFETCH_UNITS: usize = 64;

/// What `--fsdp-forward-prefetch` accepts, for messages.
const FORWARD_UNITS: &str = "give the number of units all-gathered ahead in the forward pass, 0 \
                             to 64, or true/false (1/0; also on/off, yes/no)";

/// What `--fsdp-backward-prefetch` accepts, for messages.
const BACKWARD_UNITS: &str = "give the number of units all-gathered ahead in the backward pass, \
                              0 to 64, or BACKWARD_PRE or BACKWARD_POST (1 unit), NO_PREFETCH \
                              (none)";

/// A number of units, 0 to [`MAX_PREFETCH_UNITS`].
fn units(value: &str) -> Option<usize> {
    value
        .parse::<usize>()
        .ok()
        .filter(|&n| n <= MAX_PREFETCH_UNITS)
}

/// An on/off switch as accelerate-core reads one: `1`/`0`, `true`/`false`, `on`/`off`,
/// `yes`/`no`, in any case.
fn switch(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

/// Parses `--fsdp-forward-prefetch`: the units gathered ahead in the forward pass, as the workers
/// read `ACCELERATE_FSDP_FORWARD_PREFETCH` (a number 0 to 64, or true/false for 1/0).
pub fn forward_prefetch_units(value: &str) -> Result<usize, String> {
    let value = value.trim();
    units(value)
        .or_else(|| switch(value).map(usize::from))
        .ok_or_else(|| FORWARD_UNITS.to_string())
}

/// Parses `--fsdp-backward-prefetch`: the units gathered ahead in the backward pass, as the
/// workers read `ACCELERATE_FSDP_BACKWARD_PREFETCH` (a number 0 to 64, or a `BackwardPrefetch`
/// name: both of FSDP's timings gather the next unit while the current one's backward runs, which
/// is one unit ahead).
pub fn backward_prefetch_units(value: &str) -> Result<usize, String> {
    let value = value.trim();
    units(value)
        .or_else(|| match value.to_ascii_uppercase().as_str() {
            "BACKWARD_PRE" | "BACKWARD_POST" => Some(1),
            "NO_PREFETCH" | "NONE" => Some(0),
            _ => None,
        })
        .ok_or_else(|| BACKWARD_UNITS.to_string())
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
