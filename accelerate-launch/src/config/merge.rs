//! A config file applied to the launcher's flags: a flag given on the command line wins, then the
//! file, then the flag's default.

use crate::cli::Args;
use crate::config::file::{ConfigFile, DistributedType};

/// Applies `file` to `args`, skipping every flag for which `given(id)` says it was on the command
/// line (`id` is the field's name, as clap's `ArgMatches::value_source` knows it).
///
/// `distributed_type` decides the processes: `NO` one, `MULTI_CPU` `num_processes` on the CPU,
/// `MULTI_GPU` (and `DEEPSPEED`, `FSDP`) `num_processes` (one per GPU when absent); `use_cpu: true`
/// is `--cpu`. The ZeRO stage of `deepspeed_config` or `fsdp_config` is `--zero-stage`, and
/// `fsdp_config`'s layer classes, state dict type and prefetch are
/// `--fsdp-transformer-layer-cls-to-wrap`, `--fsdp-state-dict-type`, `--fsdp-forward-prefetch` and
/// `--fsdp-backward-prefetch`. `mpirun_config.mpirun_hostfile` is `--mpirun-hostfile`.
/// `gpu_ids` is not a flag: the caller exports it as `CUDA_VISIBLE_DEVICES`.
pub fn apply(file: &ConfigFile, args: &mut Args, given: &dyn Fn(&str) -> bool) {
    if !given("cpu") && (file.use_cpu || file.distributed_type == DistributedType::MultiCpu) {
        args.cpu = true;
    }
    if !given("num_processes") && !given("num_gpus") {
        match file.distributed_type {
            DistributedType::No => args.num_processes = Some(1),
            _ => {
                if let Some(n) = file.num_processes {
                    args.num_processes = Some(n);
                }
            }
        }
    }
    if let (false, Some(n)) = (given("num_machines"), file.num_machines) {
        args.num_machines = n;
    }
    if let (false, Some(r)) = (given("machine_rank"), file.machine_rank) {
        args.machine_rank = r;
    }
    if let (false, Some(ip)) = (given("main_process_ip"), &file.main_process_ip) {
        args.main_process_ip = Some(ip.clone());
    }
    if let (false, Some(port)) = (given("main_process_port"), file.main_process_port) {
        args.main_process_port = port;
    }
    if let (false, Some(mode)) = (given("mixed_precision"), file.mixed_precision) {
        args.mixed_precision = Some(mode);
    }
    if let (false, Some(k)) = (
        given("gradient_accumulation_steps"),
        file.gradient_accumulation_steps,
    ) {
        args.gradient_accumulation_steps = Some(k);
    }
    if let (false, Some(stage)) = (given("zero_stage"), file.zero_stage) {
        args.zero_stage = Some(stage);
    }
    if let (false, Some(classes)) = (
        given("fsdp_transformer_layer_cls_to_wrap"),
        &file.fsdp_layer_classes,
    ) {
        args.fsdp_transformer_layer_cls_to_wrap = Some(classes.clone());
    }
    if let (false, Some(kind)) = (given("fsdp_state_dict_type"), file.fsdp_state_dict_type) {
        args.fsdp_state_dict_type = Some(kind);
    }
    if let (false, Some(units)) = (given("fsdp_forward_prefetch"), file.fsdp_forward_prefetch) {
        args.fsdp_forward_prefetch = Some(units);
    }
    if let (false, Some(units)) = (given("fsdp_backward_prefetch"), file.fsdp_backward_prefetch) {
        args.fsdp_backward_prefetch = Some(units);
    }
    if let (false, Some(n)) = (given("max_restarts"), file.max_restarts) {
        args.max_restarts = n;
    }
    if let (false, Some(hostfile)) = (given("mpirun_hostfile"), &file.mpirun_hostfile) {
        args.mpirun_hostfile = Some(hostfile.clone());
    }
}
