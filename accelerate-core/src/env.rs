//! Every `ACCELERATE_*` environment variable, and the one reader that turns a variable's value
//! into a typed setting or an [`Error::Env`] naming the variable, its value and what it should
//! hold.
//!
//! The launcher sets most of these for its workers (`accelerate-launch` uses the same constants);
//! a user may set any of them by hand. torchrun's, SLURM's and MPI's own variables (`RANK`,
//! `SLURM_PROCID`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK`, ...) are read where the process state is
//! detected, under their own names.

use crate::error::{Error, Result};

/// Global rank of this process, set by `accelerate-launch` (torchrun's is `RANK`).
pub const RANK: &str = "ACCELERATE_RANK";
/// Processes in the job, set by `accelerate-launch` (torchrun's is `WORLD_SIZE`).
pub const WORLD_SIZE: &str = "ACCELERATE_WORLD_SIZE";
/// Rank of this process on its machine, set by `accelerate-launch` (torchrun's is `LOCAL_RANK`).
pub const LOCAL_RANK: &str = "ACCELERATE_LOCAL_RANK";
/// Processes on this machine, set by `accelerate-launch` (torchrun's is `LOCAL_WORLD_SIZE`).
pub const LOCAL_WORLD_SIZE: &str = "ACCELERATE_LOCAL_WORLD_SIZE";
/// Secret every client of the rendezvous store proves it holds; set by `accelerate-launch`, and
/// by hand for every rank under torchrun, SLURM or MPI on several machines (a job on one machine
/// makes one itself).
pub const JOB_TOKEN: &str = "ACCELERATE_JOB_TOKEN";
/// `1` lets rank 0 host the store of a job on several machines without a job token, for closed
/// networks where everyone who reaches the machines may join the job.
pub const ALLOW_OPEN_STORE: &str = "ACCELERATE_ALLOW_OPEN_STORE";
/// How many times the launcher has restarted the group (`--max-restarts`).
pub const RESTART_COUNT: &str = "ACCELERATE_RESTART_COUNT";
/// The default number of gradient accumulation steps
/// (`accelerate-launch --gradient-accumulation-steps K`).
pub const GRADIENT_ACCUMULATION_STEPS: &str = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS";
/// The default mixed-precision mode, `no`, `bf16` or `fp16`
/// (`accelerate-launch --mixed-precision MODE`).
pub const MIXED_PRECISION: &str = "ACCELERATE_MIXED_PRECISION";
/// The ZeRO stage, `0` (plain data parallel), `1` (optimizer state sharded), `2` (optimizer
/// state and gradients sharded) or `3` (parameters sharded too: fully sharded data parallel)
/// (`accelerate-launch --zero-stage N`).
pub const ZERO_STAGE: &str = "ACCELERATE_ZERO_STAGE";
/// Under ZeRO stage 3 (fully sharded), the model classes whose every instance is one sharded
/// unit, comma-separated (Accelerate's `fsdp_transformer_layer_cls_to_wrap`, e.g. `GPT2Block` or
/// `LlamaDecoderLayer`): a program that declares its units by class reads it.
pub const FSDP_LAYER_CLASSES: &str = "ACCELERATE_FSDP_LAYER_CLASSES";
/// Under ZeRO stage 3, what `save_model` and checkpoints write of the parameters:
/// `FULL_STATE_DICT` (the whole model, gathered unit by unit to the main process) or
/// `SHARDED_STATE_DICT` (each rank its own pieces) (Accelerate's `fsdp_state_dict_type`).
pub const FSDP_STATE_DICT_TYPE: &str = "ACCELERATE_FSDP_STATE_DICT_TYPE";
/// Under ZeRO stage 3, how many units are all-gathered ahead of the one whose forward runs: a
/// number (0 for none, the default), or `true`/`false` (Accelerate's `fsdp_forward_prefetch`).
pub const FSDP_FORWARD_PREFETCH: &str = "ACCELERATE_FSDP_FORWARD_PREFETCH";
/// Under ZeRO stage 3, how many units are all-gathered ahead of the one whose backward runs: a
/// number (0 for none, the default), or Accelerate's `fsdp_backward_prefetch` (`BACKWARD_PRE`
/// or `BACKWARD_POST`: one; `NO_PREFETCH`: none).
pub const FSDP_BACKWARD_PREFETCH: &str = "ACCELERATE_FSDP_BACKWARD_PREFETCH";
/// Under ZeRO stage 3, an on/off switch: keep each unit gathered from its first gather in an
/// accumulation window until the window's sync, instead of gathering it for every pass
/// (`AcceleratorBuilder::keep_gathered_in_window`; default off).
pub const FSDP_KEEP_GATHERED: &str = "ACCELERATE_FSDP_KEEP_GATHERED";
/// The gradient bucket cap in MiB (DDP's `bucket_cap_mb`).
pub const BUCKET_CAP_MB: &str = "ACCELERATE_BUCKET_CAP_MB";
/// Whether the sync micro-step overlaps the reduction of one gradient bucket with the
/// preparation of the next (an on/off switch).
pub const OVERLAP_GRADIENT_REDUCTION: &str = "ACCELERATE_OVERLAP_GRADIENT_REDUCTION";
/// `1` computes on the CPU even where GPUs exist (`accelerate-launch --cpu`).
pub const USE_CPU: &str = "ACCELERATE_USE_CPU";
/// `cuda` requires a GPU, `cpu` the CPU, `auto` takes a GPU if there is one
/// (`accelerate-launch --num-gpus N` sets `cuda`).
pub const DEVICE: &str = "ACCELERATE_DEVICE";
/// The index of this rank's GPU among those visible to it (set by `accelerate-launch`; several
/// ranks share a GPU under its `--ranks-per-gpu` testing switch).
pub const GPU_INDEX: &str = "ACCELERATE_GPU_INDEX";
/// The address the CPU communicator listens on, when the default (the one that reaches the
/// store) is not the right one.
pub const BIND_IP: &str = "ACCELERATE_BIND_IP";
/// Seconds a peer may give no sign of life at all before a collective fails; also how long
/// `accelerate-launch` waits for another machine's launcher that gives none (no heartbeat).
pub const COLLECTIVE_TIMEOUT: &str = "ACCELERATE_COLLECTIVE_TIMEOUT";
/// Seconds a live but busy peer is waited for before a collective fails.
pub const BUSY_PEER_TIMEOUT: &str = "ACCELERATE_BUSY_PEER_TIMEOUT";
/// The CPU communicator's transport: `auto`, `tcp` or `shm`.
pub const CPU_TRANSPORT: &str = "ACCELERATE_CPU_TRANSPORT";
/// `0` leaves the allocator's default of returning freed memory to the system.
pub const KEEP_FREED_MEMORY: &str = "ACCELERATE_KEEP_FREED_MEMORY";

/// The value of `name` in the process environment; `None` when unset, blank or not Unicode.
pub(crate) fn value(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `value` (of variable `name`) parsed by `parse`, which sees it trimmed: `None` when the value
/// is absent or blank, an [`Error::Env`] saying `expected` when `parse` refuses it.
pub(crate) fn parse<T>(
    name: &str,
    value: Option<&str>,
    expected: &str,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Result<Option<T>> {
    match value {
        Some(v) if !v.trim().is_empty() => parse(v.trim()).map(Some).ok_or_else(|| Error::Env {
            name: name.into(),
            value: v.into(),
            problem: expected.into(),
        }),
        _ => Ok(None),
    }
}

/// Variable `name` of the process environment, [`parse`]d.
pub(crate) fn read<T>(
    name: &str,
    expected: &str,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Result<Option<T>> {
    self::parse(name, value(name).as_deref(), expected, parse)
}

/// An on/off value: `1`/`0`, `true`/`false`, `on`/`off`, `yes`/`no`, in any case.
pub(crate) fn switch(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

/// The most units ZeRO stage 3 gathers ahead in a pass (more only holds memory to no use).
pub const MAX_PREFETCH_UNITS: usize = 64;

/// A number of units gathered ahead, 0 to [`MAX_PREFETCH_UNITS`].
fn prefetch_units(value: &str) -> Option<usize> {
    value
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n <= MAX_PREFETCH_UNITS)
}

/// A value of [`FSDP_FORWARD_PREFETCH`] as the units gathered ahead in the forward pass: a number
/// 0 to [`MAX_PREFETCH_UNITS`], or an on/off switch (1 or 0, as Accelerate's
/// `fsdp_forward_prefetch`); `None` for anything else. The launcher checks its flag with it.
pub fn fsdp_forward_prefetch_units(value: &str) -> Option<usize> {
    prefetch_units(value).or_else(|| switch(value).map(usize::from))
}

/// A value of [`FSDP_BACKWARD_PREFETCH`] as the units gathered ahead in the backward pass: a
/// number 0 to [`MAX_PREFETCH_UNITS`], or PyTorch's `BackwardPrefetch` name in any case
/// (`BACKWARD_PRE` and `BACKWARD_POST` both gather the next unit while the current one's
/// backward runs: 1; `NO_PREFETCH` or `NONE`: 0); `None` for anything else.
pub fn fsdp_backward_prefetch_units(value: &str) -> Option<usize> {
    prefetch_units(value).or_else(|| match value.trim().to_ascii_uppercase().as_str() {
        "BACKWARD_PRE" | "BACKWARD_POST" => Some(1),
        "NO_PREFETCH" | "NONE" => Some(0),
        _ => None,
    })
}

/// What [`switch`] accepts, for error messages.
pub(crate) const SWITCH_VALUES: &str = "expected 1 or 0 (also true/false, on/off, yes/no)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_depths_read_numbers_and_accelerates_names() {
        assert_eq!(fsdp_forward_prefetch_units("2"), Some(2));
        assert_eq!(fsdp_forward_prefetch_units("true"), Some(1));
        assert_eq!(fsdp_forward_prefetch_units("false"), Some(0));
        assert_eq!(fsdp_forward_prefetch_units("65"), None);
        assert_eq!(fsdp_backward_prefetch_units("BACKWARD_PRE"), Some(1));
        assert_eq!(fsdp_backward_prefetch_units("backward_post"), Some(1));
        assert_eq!(fsdp_backward_prefetch_units("NO_PREFETCH"), Some(0));
        assert_eq!(fsdp_backward_prefetch_units("3"), Some(3));
        assert_eq!(fsdp_backward_prefetch_units("sometimes"), None);
    }

    #[test]
    fn on_off_switches_read_the_usual_spellings_and_refuse_others() {
        for on in ["1", "true", "ON", " yes "] {
            assert_eq!(switch(on), Some(true), "{on:?}");
        }
        for off in ["0", "False", "off", "no"] {
            assert_eq!(switch(off), Some(false), "{off:?}");
        }
        for bad in ["2", "overlap", "y"] {
            assert_eq!(switch(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_blank_value_is_unset_and_a_bad_one_is_named_with_what_it_should_hold() {
        let positive = |v: &str| v.parse::<usize>().ok().filter(|&k| k > 0);
        assert_eq!(parse("X", None, "a count", positive).unwrap(), None);
        assert_eq!(parse("X", Some("  "), "a count", positive).unwrap(), None);
        assert_eq!(
            parse("X", Some(" 4 "), "a count", positive).unwrap(),
            Some(4)
        );
        let e = parse("ACCELERATE_X", Some("0"), "expected a count", positive).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("ACCELERATE_X") && text.contains("\"0\"") && text.contains("a count"),
            "{text}"
        );
    }

    #[test]
    fn every_name_is_an_accelerate_variable_and_none_is_repeated() {
        let names = [
            RANK,
            WORLD_SIZE,
            LOCAL_RANK,
            LOCAL_WORLD_SIZE,
            JOB_TOKEN,
            ALLOW_OPEN_STORE,
            RESTART_COUNT,
            GRADIENT_ACCUMULATION_STEPS,
            MIXED_PRECISION,
            BUCKET_CAP_MB,
            OVERLAP_GRADIENT_REDUCTION,
            USE_CPU,
            DEVICE,
            GPU_INDEX,
            BIND_IP,
            COLLECTIVE_TIMEOUT,
            BUSY_PEER_TIMEOUT,
            CPU_TRANSPORT,
            KEEP_FREED_MEMORY,
        ];
        let mut sorted = names.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
        assert!(names.iter().all(|n| n.starts_with("ACCELERATE_")));
    }
}
