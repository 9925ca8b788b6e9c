//! The command line of `accelerate-launch`, Accelerate's flag names in kebab case with the
//! underscore spellings as aliases.

use std::path::PathBuf;

use accelerate_core::MixedPrecision;
use clap::Parser;

use crate::config::file::{
    backward_prefetch_units, forward_prefetch_units, layer_classes, StateDictType,
};

/// Launch a training program as one process per GPU, or per `--num-processes` on the CPU.
#[derive(Debug, Clone, Parser)]
#[command(name = "accelerate-launch", version, trailing_var_arg = true)]
pub struct Args {
    /// Total number of processes (over all machines).
    #[arg(long, alias = "num_processes", value_name = "N")]
    pub num_processes: Option<usize>,

    /// One process per GPU, N GPUs.
    #[arg(long, alias = "num_gpus", value_name = "N")]
    pub num_gpus: Option<usize>,

    /// Testing switch: start N ranks on each of the --num-gpus GPUs (rank r on GPU r / N), each
    /// with its own NCCL_HOSTID so that NCCL treats it as a host of its own and connects the ranks
    /// over sockets. Slow, but it runs multi-rank NCCL code on a one-GPU machine; not for training.
    #[arg(
        long,
        alias = "ranks_per_gpu",
        default_value_t = 1,
        value_name = "N",
        requires = "num_gpus"
    )]
    pub ranks_per_gpu: usize,

    /// Train on the CPU even if GPUs are present.
    #[arg(long)]
    pub cpu: bool,

    /// Number of machines taking part.
    #[arg(long, alias = "num_machines", default_value_t = 1, value_name = "N")]
    pub num_machines: usize,

    /// This machine's rank among the machines (0 hosts the rendezvous store).
    #[arg(long, alias = "machine_rank", default_value_t = 0, value_name = "R")]
    pub machine_rank: usize,

    /// Address of machine rank 0 (several machines).
    #[arg(long, alias = "main_process_ip", value_name = "IP")]
    pub main_process_ip: Option<String>,

    /// Port of the rendezvous store on machine rank 0; 0 picks a free port.
    #[arg(
        long,
        alias = "main_process_port",
        default_value_t = 29500,
        value_name = "PORT",
        value_parser = parse_port
    )]
    pub main_process_port: u16,

    /// Gradient accumulation steps, exported as ACCELERATE_GRADIENT_ACCUMULATION_STEPS.
    #[arg(long, alias = "gradient_accumulation_steps", value_name = "K")]
    pub gradient_accumulation_steps: Option<usize>,

    /// Precision of the forward and backward passes: no, bf16 or fp16 (f32 master weights and
    /// gradients either way); exported as ACCELERATE_MIXED_PRECISION.
    #[arg(long, alias = "mixed_precision", value_name = "MODE")]
    pub mixed_precision: Option<MixedPrecision>,

    /// ZeRO stage: 0 (plain data parallel, the default), 1 (optimizer state sharded), 2
    /// (optimizer state and gradients sharded) or 3 (optimizer state, gradients and parameters
    /// sharded); exported as ACCELERATE_ZERO_STAGE.
    #[arg(long, alias = "zero_stage", value_name = "N", value_parser = parse_zero_stage)]
    pub zero_stage: Option<u8>,

    /// Under ZeRO stage 3, the model classes whose every instance is one sharded unit, separated
    /// by commas (e.g. LlamaDecoderLayer); exported as ACCELERATE_FSDP_LAYER_CLASSES.
    #[arg(
        long,
        alias = "fsdp_transformer_layer_cls_to_wrap",
        value_name = "CLASSES",
        value_parser = parse_layer_classes
    )]
    pub fsdp_transformer_layer_cls_to_wrap: Option<String>,

    /// Under ZeRO stage 3, what checkpoints and save_model write of the parameters:
    /// FULL_STATE_DICT (the whole model, gathered to the main process) or SHARDED_STATE_DICT
    /// (each rank its own pieces); exported as ACCELERATE_FSDP_STATE_DICT_TYPE.
    #[arg(long, alias = "fsdp_state_dict_type", value_name = "TYPE")]
    pub fsdp_state_dict_type: Option<StateDictType>,

    /// Under ZeRO stage 3, how many units are all-gathered ahead of the one whose forward runs:
    /// 0 to 64, or true/false (1/0, Accelerate's fsdp_forward_prefetch); exported as
    /// ACCELERATE_FSDP_FORWARD_PREFETCH (the workers' default: 0).
    #[arg(
        long,
        alias = "fsdp_forward_prefetch",
        value_name = "N|true|false",
        value_parser = forward_prefetch_units
    )]
    pub fsdp_forward_prefetch: Option<usize>,

    /// Under ZeRO stage 3, how many units are all-gathered ahead of the one whose backward runs:
    /// 0 to 64, or Accelerate's fsdp_backward_prefetch, BACKWARD_PRE or BACKWARD_POST (1) or
    /// NO_PREFETCH (0); a number is a count of units, not PyTorch's enum; exported as
    /// ACCELERATE_FSDP_BACKWARD_PREFETCH (the workers' default: 0).
    #[arg(
        long,
        alias = "fsdp_backward_prefetch",
        value_name = "N|BACKWARD_PRE|BACKWARD_POST|NO_PREFETCH",
        value_parser = backward_prefetch_units
    )]
    pub fsdp_backward_prefetch: Option<usize>,

    /// Under ZeRO stage 3, keep each unit gathered from its first gather in an accumulation window
    /// until the window's sync: one all-gather per unit per window instead of two per micro-step,
    /// for the whole model held during the window; exported as ACCELERATE_FSDP_KEEP_GATHERED=1.
    #[arg(long, alias = "fsdp_keep_gathered")]
    pub fsdp_keep_gathered: bool,

    /// Restart the whole group up to N times when a rank fails (workers see
    /// ACCELERATE_RESTART_COUNT and resume from their latest checkpoint). On several machines,
    /// machine 0's value decides, and every machine's launcher restarts its workers.
    #[arg(long, alias = "max_restarts", default_value_t = 0, value_name = "N")]
    pub max_restarts: u32,

    /// Seconds between SIGTERM and SIGKILL when stopping the workers.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    pub grace_period: f64,

    /// Print only the main process's output.
    #[arg(long)]
    pub quiet: bool,

    /// Also write each rank's output to DIR/rank_R.log.
    #[arg(long, alias = "log_dir", value_name = "DIR")]
    pub tee: Option<PathBuf>,

    /// Read the flags' defaults from this Accelerate config file (YAML or JSON, as `accelerate
    /// config` writes it); flags given here override it. `accelerate launch` also reads
    /// `$HF_HOME/accelerate/default_config.yaml` without it; `accelerate-launch` does not.
    #[arg(long, alias = "config_file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,

    /// Start CPU workers with Open MPI's `mpirun` on the hosts of this hostfile (`node1 slots=4`
    /// lines) instead of spawning them here; rank 0's store is on the first host (or
    /// --main-process-ip) at --main-process-port. With --num-machines M, each of M hosts runs
    /// N/M ranks (as Accelerate); without, the ranks fill the hosts' slots in order.
    #[arg(long, alias = "mpirun_hostfile", value_name = "FILE")]
    pub mpirun_hostfile: Option<PathBuf>,

    /// The training program.
    #[arg(required = true, value_name = "PROGRAM")]
    pub program: PathBuf,

    /// Arguments passed to the program.
    #[arg(allow_hyphen_values = true, value_name = "ARGS")]
    pub program_args: Vec<String>,
}

/// Parses `--main-process-port`; clap shows the message after the flag and the value.
fn parse_port(value: &str) -> Result<u16, String> {
    value.trim().parse::<u16>().map_err(|_| {
        "not a port number: give a TCP port from 1 to 65535, or 0 to pick a free one".to_string()
    })
}

/// The highest ZeRO stage the runtime implements (3: the parameters sharded too).
pub const MAX_ZERO_STAGE: u8 = 3;

/// What a ZeRO stage accepts, for messages.
pub const ZERO_STAGES: &str = "give 0 (plain data parallel), 1 (optimizer state sharded), 2 \
                               (optimizer state and gradients sharded) or 3 (optimizer state, \
                               gradients and parameters sharded)";

/// Parses `--zero-stage`, refusing stages the runtime lacks before any worker starts (the
/// workers' builder would refuse them too, but only after the whole group had started).
pub(crate) fn parse_zero_stage(value: &str) -> Result<u8, String> {
    match value.trim().parse::<u8>() {
        Ok(stage) if stage <= MAX_ZERO_STAGE => Ok(stage),
        _ => Err(format!("not a ZeRO stage; {ZERO_STAGES}")),
    }
}

/// Parses `--fsdp-transformer-layer-cls-to-wrap`: class names separated by commas, trimmed.
fn parse_layer_classes(value: &str) -> Result<String, String> {
    layer_classes(value)?.ok_or_else(|| {
        "no class named; give class names separated by commas (e.g. LlamaDecoderLayer)".into()
    })
}

impl Args {
    /// Checks the flags against each other; the message names the flag and the fix.
    pub fn validate(&self) -> Result<(), String> {
        if self.num_processes == Some(0) {
            return Err("--num-processes 0: a job needs at least one process".into());
        }
        if self.num_gpus == Some(0) {
            return Err("--num-gpus 0: pass --cpu --num-processes N to train on the CPU".into());
        }
        if self.ranks_per_gpu == 0 {
            return Err(
                "--ranks-per-gpu 0: give at least 1 (1 is the normal one rank per GPU)".into(),
            );
        }
        if self.num_machines == 0 {
            return Err("--num-machines 0: a job runs on at least one machine".into());
        }
        if self.machine_rank >= self.num_machines {
            return Err(format!(
                "--machine-rank {} with --num-machines {}: machine ranks run from 0 to {}",
                self.machine_rank,
                self.num_machines,
                self.num_machines - 1
            ));
        }
        // Under --mpirun-hostfile, rank 0 (and the store) is on the hostfile's first host.
        let own_machines = self.num_machines > 1 && self.mpirun_hostfile.is_none();
        if own_machines && self.main_process_ip.is_none() {
            return Err(
                "--num-machines > 1 needs --main-process-ip (the address of machine rank 0)".into(),
            );
        }
        if own_machines && self.main_process_port == 0 {
            return Err(
                "--main-process-port 0 with --num-machines > 1: the other machines must \
                        know the store's port; give the same fixed port on every machine"
                    .into(),
            );
        }
        if !(self.grace_period.is_finite() && self.grace_period >= 0.0) {
            return Err(format!(
                "--grace-period {}: give a non-negative number of seconds",
                self.grace_period
            ));
        }
        if self.gradient_accumulation_steps == Some(0) {
            return Err("--gradient-accumulation-steps 0: use 1 for no accumulation".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn underscore_aliases_and_trailing_program_args() {
        let a = Args::try_parse_from([
            "accelerate-launch",
            "--num_processes",
            "2",
            "--cpu",
            "prog",
            "--grad-accum",
            "4",
        ])
        .unwrap();
        assert_eq!(a.num_processes, Some(2));
        assert!(a.cpu);
        assert_eq!(a.program, PathBuf::from("prog"));
        assert_eq!(a.program_args, ["--grad-accum", "4"]);
        assert!(a.validate().is_ok());
        assert_eq!(a.mixed_precision, None);
        assert_eq!(a.zero_stage, None);
    }

    #[test]
    fn zero_stage_takes_both_spellings_and_refuses_stages_that_do_not_exist() {
        for (flag, stage) in [
            ("--zero-stage", "0"),
            ("--zero_stage", "2"),
            ("--zero-stage", "1"),
            ("--zero-stage", "3"),
            ("--zero_stage", " 3"),
        ] {
            let a = Args::try_parse_from(["l", flag, stage, "p"]).unwrap();
            assert_eq!(
                a.zero_stage,
                Some(stage.trim().parse().unwrap()),
                "{flag} {stage}"
            );
        }
        for bad in ["4", "x", "1.5", "", "256"] {
            let e = Args::try_parse_from(["l", "--zero-stage", bad, "p"])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("--zero-stage") && e.contains(&format!("'{bad}'")),
                "{e}"
            );
            assert!(
                e.contains("not a ZeRO stage; give 0 (plain data parallel), 1 (optimizer")
                    && e.contains("or 3 (optimizer state, gradients and parameters sharded)"),
                "{e}"
            );
        }
    }

    #[test]
    fn fsdp_flags_take_both_spellings_and_are_absent_unless_given() {
        let a = Args::try_parse_from([
            "l",
            "--fsdp_transformer_layer_cls_to_wrap",
            "LlamaDecoderLayer",
            "--fsdp-state-dict-type",
            "SHARDED_STATE_DICT",
            "p",
        ])
        .unwrap();
        assert_eq!(
            a.fsdp_transformer_layer_cls_to_wrap.as_deref(),
            Some("LlamaDecoderLayer")
        );
        assert_eq!(a.fsdp_state_dict_type, Some(StateDictType::Sharded));
        let a = Args::try_parse_from([
            "l",
            "--fsdp-transformer-layer-cls-to-wrap",
            "GPT2Block,  GPT2MLP ",
            "--fsdp_state_dict_type",
            "full_state_dict",
            "p",
        ])
        .unwrap();
        assert_eq!(
            a.fsdp_transformer_layer_cls_to_wrap.as_deref(),
            Some("GPT2Block,GPT2MLP")
        );
        assert_eq!(a.fsdp_state_dict_type, Some(StateDictType::Full));
        let a = Args::try_parse_from(["l", "p"]).unwrap();
        assert_eq!(
            (a.fsdp_transformer_layer_cls_to_wrap, a.fsdp_state_dict_type),
            (None, None)
        );
        for (flag, bad, want) in [
            (
                "--fsdp-state-dict-type",
                "LOCAL_STATE_DICT",
                "not implemented",
            ),
            ("--fsdp-state-dict-type", "FULL", "give FULL_STATE_DICT"),
            (
                "--fsdp-transformer-layer-cls-to-wrap",
                " ",
                "no class named",
            ),
            (
                "--fsdp-transformer-layer-cls-to-wrap",
                "A,",
                "empty class name",
            ),
        ] {
            let e = Args::try_parse_from(["l", flag, bad, "p"])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(flag) && e.contains(&format!("'{bad}'")) && e.contains(want),
                "{e}"
            );
        }
    }

    #[test]
    fn prefetch_flags_read_units_as_the_workers_do_and_refuse_typos() {
        // A number is units ahead (0 to 64); forward also takes an on/off switch (1/0 units),
        // backward PyTorch's BackwardPrefetch names (both timings: 1 unit; NO_PREFETCH: 0).
        for (flag, value, units) in [
            ("--fsdp-forward-prefetch", "true", 1),
            ("--fsdp_forward_prefetch", "False", 0),
            ("--fsdp-forward-prefetch", "on", 1),
            ("--fsdp-forward-prefetch", "no", 0),
            ("--fsdp-forward-prefetch", "0", 0),
            ("--fsdp-forward-prefetch", "3", 3),
            ("--fsdp-forward-prefetch", " 64", 64),
            ("--fsdp-backward-prefetch", "BACKWARD_PRE", 1),
            ("--fsdp_backward_prefetch", "backward_post", 1),
            ("--fsdp-backward-prefetch", "NO_PREFETCH", 0),
            ("--fsdp-backward-prefetch", "0", 0),
            ("--fsdp-backward-prefetch", "2", 2),
            ("--fsdp-backward-prefetch", "64", 64),
        ] {
            let a = Args::try_parse_from(["l", flag, value, "p"]).unwrap();
            let got = if flag.contains("forward") {
                (a.fsdp_forward_prefetch, a.fsdp_backward_prefetch)
            } else {
                (a.fsdp_backward_prefetch, a.fsdp_forward_prefetch)
            };
            assert_eq!(got, (Some(units), None), "{flag} {value}");
        }
        let a = Args::try_parse_from(["l", "p"]).unwrap();
        assert_eq!(
            (a.fsdp_forward_prefetch, a.fsdp_backward_prefetch),
            (None, None)
        );
        assert!(!a.fsdp_keep_gathered);
        for spelling in ["--fsdp-keep-gathered", "--fsdp_keep_gathered"] {
            assert!(
                Args::try_parse_from(["l", spelling, "p"])
                    .unwrap()
                    .fsdp_keep_gathered
            );
        }
        for (flag, bad, want) in [
            ("--fsdp-forward-prefetch", "65", "0 to 64, or true/false"),
            (
                "--fsdp-forward-prefetch",
                "99999999999999999999999",
                "0 to 64",
            ),
            ("--fsdp-forward-prefetch", "BACKWARD_PRE", "true/false"),
            ("--fsdp-forward-prefetch", "maybe", "in the forward pass"),
            ("--fsdp-backward-prefetch", "65", "0 to 64"),
            (
                "--fsdp-backward-prefetch",
                "BACKWARD_PREE",
                "BACKWARD_PRE or BACKWARD_POST",
            ),
            ("--fsdp-backward-prefetch", "true", "NO_PREFETCH"),
            ("--fsdp-backward-prefetch", "1.5", "in the backward pass"),
        ] {
            let e = Args::try_parse_from(["l", flag, bad, "p"])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(flag) && e.contains(&format!("'{bad}'")) && e.contains(want),
                "{e}"
            );
        }
        // A boolean flag takes no value: the next word is the program.
        let a = Args::try_parse_from(["l", "--fsdp-keep-gathered", "prog", "1"]).unwrap();
        assert_eq!(
            (a.program, a.program_args),
            (PathBuf::from("prog"), vec!["1".to_string()])
        );
    }

    #[test]
    fn mixed_precision_takes_both_spellings_and_names_the_valid_values() {
        let a = Args::try_parse_from(["l", "--mixed_precision", "bf16", "p"]).unwrap();
        assert_eq!(a.mixed_precision, Some(MixedPrecision::Bf16));
        let a = Args::try_parse_from(["l", "--mixed-precision", "fp16", "p"]).unwrap();
        assert_eq!(a.mixed_precision, Some(MixedPrecision::Fp16));
        let e = Args::try_parse_from(["l", "--mixed-precision", "fp8", "p"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("fp8") && e.contains("no, bf16 or fp16"), "{e}");
    }

    #[test]
    fn bad_combinations_name_the_flag() {
        let parse = |v: &[&str]| Args::try_parse_from(v).unwrap().validate().unwrap_err();
        assert!(parse(&["l", "--num-processes", "0", "p"]).contains("--num-processes 0"));
        assert!(parse(&["l", "--num-machines", "2", "p"]).contains("--main-process-ip"));
        assert!(parse(&["l", "--machine-rank", "1", "p"]).contains("--machine-rank 1"));
        for bad in ["70000", "80x", "http"] {
            let e = Args::try_parse_from(["l", "--main-process-port", bad, "p"])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("'{bad}'")), "{e}");
            assert!(e.contains("from 1 to 65535, or 0"), "{e}");
        }
    }
}
