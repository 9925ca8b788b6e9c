//! The config files Accelerate writes, read into the launcher's flags.

use std::path::Path;

use accelerate_core::MixedPrecision;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};

use super::file::{ConfigFile, DistributedType, StateDictType};
use super::merge;
use super::write::ConfigAnswers;
use crate::cli::Args;

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn parse(text: &str) -> Result<ConfigFile, String> {
    ConfigFile::parse(Path::new("/cfg/default_config.yaml"), text)
}

/// The launcher's flags for `argv` with `file` applied under them.
fn launch_args(file: &ConfigFile, argv: &[&str]) -> Args {
    let matches = Args::command().try_get_matches_from(argv).unwrap();
    let mut args = Args::from_arg_matches(&matches).unwrap();
    merge::apply(file, &mut args, &|id| {
        matches.value_source(id) == Some(ValueSource::CommandLine)
    });
    args
}

#[test]
fn accelerate_config_default_of_a_two_gpu_machine_is_two_gpu_processes_quietly() {
    // Verbatim what Accelerate 1.x's `accelerate config default` writes (JSON in a .yaml file).
    let file = ConfigFile::read(&fixture("accelerate_config_default.yaml")).unwrap();
    assert_eq!(file.distributed_type, DistributedType::MultiGpu);
    assert_eq!(file.num_processes, Some(2));
    assert_eq!(file.num_machines, Some(1));
    assert_eq!(file.machine_rank, Some(0));
    assert_eq!(file.mixed_precision, Some(MixedPrecision::No));
    assert!(!file.use_cpu);
    assert_eq!(file.gpu_ids, None);
    // debug: false, tpu_use_cluster: false, ...: all neutral, nothing to warn about.
    assert!(file.ignored.is_empty(), "{:?}", file.ignored);
    let args = launch_args(&file, &["l", "prog"]);
    assert_eq!(args.num_processes, Some(2));
    assert!(!args.cpu);
    assert_eq!(args.num_machines, 1);
    assert_eq!(args.main_process_port, 29500);
}

#[test]
fn an_interactive_multi_cpu_file_maps_every_key() {
    let file = ConfigFile::read(&fixture("accelerate_config_interactive.yaml")).unwrap();
    assert!(file.ignored.is_empty(), "{:?}", file.ignored);
    let args = launch_args(&file, &["l", "prog", "--lr", "1"]);
    assert!(args.cpu);
    assert_eq!(args.num_processes, Some(4));
    assert_eq!(args.num_machines, 2);
    assert_eq!(args.machine_rank, 0);
    assert_eq!(args.main_process_ip.as_deref(), Some("10.0.0.1"));
    assert_eq!(args.main_process_port, 29600);
    assert_eq!(args.mixed_precision, Some(MixedPrecision::Bf16));
    assert_eq!(args.program_args, ["--lr", "1"]);
    assert!(args.validate().is_ok());
}

#[test]
fn flags_on_the_command_line_override_the_file_even_at_their_default_values() {
    let file = ConfigFile::read(&fixture("accelerate_config_interactive.yaml")).unwrap();
    let args = launch_args(
        &file,
        &[
            "l",
            "--num-processes",
            "2",
            "--num-machines",
            "1",
            "--main-process-port",
            "29500",
            "--mixed-precision",
            "no",
            "prog",
        ],
    );
    assert_eq!(args.num_processes, Some(2));
    // 1 and 29500 are clap's defaults too: given on the command line, they still win.
    assert_eq!(args.num_machines, 1);
    assert_eq!(args.main_process_port, 29500);
    assert_eq!(args.mixed_precision, Some(MixedPrecision::No));
    // Not given: from the file.
    assert!(args.cpu);
    assert_eq!(args.main_process_ip.as_deref(), Some("10.0.0.1"));
    // --num-gpus on the command line replaces the file's process count as well.
    let args = launch_args(&file, &["l", "--num-gpus", "1", "prog"]);
    assert_eq!((args.num_gpus, args.num_processes), (Some(1), None));
}

#[test]
fn distributed_type_no_is_one_process_and_use_cpu_is_the_cpu_flag() {
    let file = parse("distributed_type: 'NO'\nuse_cpu: true\nnum_processes: 1\n").unwrap();
    let args = launch_args(&file, &["l", "p"]);
    assert_eq!((args.num_processes, args.cpu), (Some(1), true));
    let e = parse("distributed_type: 'NO'\nnum_processes: 2\n").unwrap_err();
    assert!(
        e.contains("num_processes") && e.contains("MULTI_CPU"),
        "{e}"
    );
    // PyYAML reads an unquoted NO as false; so do hand-edited files.
    let file = parse("distributed_type: false\n").unwrap();
    assert_eq!(file.distributed_type, DistributedType::No);
}

#[test]
fn keys_we_do_not_support_are_named_when_they_ask_for_something() {
    let file = parse(
        "distributed_type: MULTI_GPU\nnum_processes: 2\ndebug: true\ndowncast_bf16: 'no'\n\
         tpu_env: []\nfsdp_config:\n  fsdp_version: 2\n  fsdp_offload_params: false\n\
         dynamo_config:\n  dynamo_backend: INDUCTOR\nmy_own_key: 1\ntpu_use_cluster: false\n",
    )
    .unwrap();
    assert_eq!(
        file.ignored,
        ["debug", "dynamo_config", "fsdp_config", "my_own_key"]
    );
    // A deepspeed_config Accelerate would not read (not DEEPSPEED) is named too.
    let file = parse("distributed_type: MULTI_GPU\ndeepspeed_config:\n  zero_stage: 2\n").unwrap();
    assert_eq!(file.ignored, ["deepspeed_config"]);
    assert_eq!(file.zero_stage, None);
}

#[test]
fn bad_values_name_the_file_the_key_the_value_and_what_is_valid() {
    for (text, wants) in [
        (
            "distributed_type: XLA\n",
            &[
                "/cfg/default_config.yaml",
                "distributed_type",
                "\"XLA\"",
                "MULTI_CPU",
            ][..],
        ),
        (
            "distributed_type: MULTI_GPU\nmixed_precision: fp8\n",
            &["mixed_precision", "\"fp8\"", "no, bf16 or fp16"],
        ),
        (
            "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: NO\n",
            &["compute_environment", "LOCAL_MACHINE"],
        ),
        (
            "distributed_type: MULTI_CPU\nnum_processes: two\n",
            &["num_processes", "\"two\"", "whole number"],
        ),
        (
            "distributed_type: MULTI_GPU\nmain_process_port: 70000\n",
            &["main_process_port", "70000", "65535"],
        ),
        (
            "distributed_type: MULTI_GPU\ngpu_ids: first\n",
            &["gpu_ids", "\"first\"", "all, or GPU indices"],
        ),
        (
            "distributed_type: MULTI_GPU\nrdzv_backend: etcd\n",
            &["rdzv_backend", "\"etcd\"", "static"],
        ),
        (
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 4\n",
            &[
                "deepspeed_config.zero_stage",
                ": 4:",
                "or 3 (optimizer state, gradients and",
            ],
        ),
        ("- a list\n", &["expected a mapping"]),
        ("a: [unclosed\n", &["not valid YAML"]),
    ] {
        let e = parse(text).unwrap_err();
        for want in wants {
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}

#[test]
fn deepspeed_zero_stages_0_to_2_run_as_our_zero() {
    let file = parse(
        "distributed_type: DEEPSPEED\nnum_processes: 4\ndeepspeed_config:\n  zero_stage: 2\n  \
         gradient_accumulation_steps: 8\n  offload_optimizer_device: none\n  \
         zero3_init_flag: false\n  gradient_clipping: 1.0\n",
    )
    .unwrap();
    assert_eq!(file.ignored, ["deepspeed_config.gradient_clipping"]);
    let args = launch_args(&file, &["l", "p"]);
    assert_eq!(args.zero_stage, Some(2));
    assert_eq!(args.gradient_accumulation_steps, Some(8));
    assert_eq!(args.num_processes, Some(4));
    // The flag still wins.
    let args = launch_args(&file, &["l", "--zero-stage", "1", "p"]);
    assert_eq!(args.zero_stage, Some(1));
}

#[test]
fn gpu_ids_become_a_cuda_visible_devices_list_and_all_is_every_gpu() {
    let file = parse("distributed_type: MULTI_GPU\ngpu_ids: 0, 2\n").unwrap();
    assert_eq!(file.gpu_ids.as_deref(), Some("0,2"));
    let file = parse("distributed_type: MULTI_GPU\ngpu_ids: 1\n").unwrap();
    assert_eq!(file.gpu_ids.as_deref(), Some("1"));
    let file = parse("distributed_type: MULTI_GPU\ngpu_ids: all\n").unwrap();
    assert_eq!(file.gpu_ids, None);
}

#[test]
fn json_files_are_read_as_json() {
    let file = ConfigFile::parse(
        Path::new("c.json"),
        r#"{"distributed_type": "MULTI_CPU", "num_processes": 3, "max_restarts": 2}"#,
    )
    .unwrap();
    let args = launch_args(&file, &["l", "p"]);
    assert_eq!(
        (args.num_processes, args.cpu, args.max_restarts),
        (Some(3), true, 2)
    );
    let e = ConfigFile::parse(Path::new("c.json"), "distributed_type: NO").unwrap_err();
    assert!(e.contains("not valid JSON"), "{e}");
}

#[test]
fn what_accelerate_config_writes_is_accelerates_own_format_and_reads_back() {
    // Accelerate's write_basic_config on a CPU-only machine, keys as its ClusterConfig.to_dict
    // leaves them (None and empty mappings dropped), json.dumps(indent=2, sort_keys=True).
    let want = "{\n  \"compute_environment\": \"LOCAL_MACHINE\",\n  \"debug\": false,\n  \
                \"distributed_type\": \"NO\",\n  \"downcast_bf16\": false,\n  \
                \"enable_cpu_affinity\": false,\n  \"machine_rank\": 0,\n  \
                \"main_training_function\": \"main\",\n  \"mixed_precision\": \"bf16\",\n  \
                \"num_machines\": 1,\n  \"num_processes\": 1,\n  \"rdzv_backend\": \"static\",\n  \
                \"same_network\": false,\n  \"tpu_use_cluster\": false,\n  \
                \"tpu_use_sudo\": false,\n  \"use_cpu\": true\n}\n";
    assert_eq!(
        ConfigAnswers::default_for(0, MixedPrecision::Bf16).to_text(),
        want
    );
    // The two-GPU default is the fixture, byte for byte.
    let fixture_text = std::fs::read_to_string(fixture("accelerate_config_default.yaml")).unwrap();
    assert_eq!(
        ConfigAnswers::default_for(2, MixedPrecision::No).to_text(),
        fixture_text
    );
    let answers = ConfigAnswers {
        distributed_type: DistributedType::MultiGpu,
        num_processes: 8,
        num_machines: 2,
        machine_rank: 1,
        main_process_ip: Some("10.0.0.1".into()),
        main_process_port: Some(29501),
        mixed_precision: MixedPrecision::Fp16,
        gpu_ids: Some("0,1,2,3".into()),
        use_cpu: false,
        rdzv_backend: "c10d".into(),
        same_network: true,
        deepspeed: None,
    };
    let file = parse(&answers.to_text()).unwrap();
    assert!(file.ignored.is_empty(), "{:?}", file.ignored);
    let args = launch_args(&file, &["l", "p"]);
    assert_eq!(args.num_processes, Some(8));
    assert_eq!((args.num_machines, args.machine_rank), (2, 1));
    assert_eq!(args.main_process_ip.as_deref(), Some("10.0.0.1"));
    assert_eq!(args.main_process_port, 29501);
    assert_eq!(args.mixed_precision, Some(MixedPrecision::Fp16));
    assert_eq!(file.gpu_ids.as_deref(), Some("0,1,2,3"));
}

#[test]
fn an_mpirun_config_hostfile_is_the_mpirun_hostfile_flag() {
    // Verbatim the multi-node MULTI_CPU file of Accelerate's docs
    // (docs/source/usage_guides/intel_cpu.md): 16 processes on 4 machines through mpirun.
    let file = ConfigFile::read(&fixture("accelerate_config_mpirun.yaml")).unwrap();
    assert!(file.ignored.is_empty(), "{:?}", file.ignored);
    let args = launch_args(&file, &["l", "prog"]);
    assert_eq!(
        args.mpirun_hostfile.as_deref(),
        Some(Path::new("/home/user/hostfile"))
    );
    assert!(args.cpu);
    assert_eq!((args.num_processes, args.num_machines), (Some(16), 4));
    assert!(args.validate().is_ok());
    // Those docs: "16DDP will be enabled in node0,node1,node2,node3", 4 ranks on each host.
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hostfile");
    std::fs::write(&hosts, "10.0.0.1\n10.0.0.2\n10.0.0.3\n10.0.0.4\n").unwrap();
    let job = crate::mpirun::plan(&args, &hosts, 0, None).unwrap();
    assert_eq!((job.num_processes, job.ranks_per_host), (16, Some(4)));
    assert_eq!(job.master_addr, "36.112.23.24", "main_process_ip");
    // The flag wins over the file.
    let args = launch_args(&file, &["l", "--mpirun-hostfile", "/etc/hosts.mpi", "prog"]);
    assert_eq!(
        args.mpirun_hostfile.as_deref(),
        Some(Path::new("/etc/hosts.mpi"))
    );
}

#[test]
fn mpirun_ccl_and_a_hostfile_outside_a_cpu_job_are_named() {
    // Older Accelerate asked "Enter the number of oneCCL worker threads [1]" and wrote it here.
    let file = parse(
        "distributed_type: MULTI_CPU\nnum_processes: 4\nmpirun_config:\n  mpirun_ccl: 1\n  \
         mpirun_hostfile: /h\n",
    )
    .unwrap();
    assert_eq!(file.ignored, ["mpirun_config.mpirun_ccl"]);
    assert_eq!(file.mpirun_hostfile.as_deref(), Some(Path::new("/h")));
    // A GPU job does not start mpirun, in Accelerate either.
    let file =
        parse("distributed_type: MULTI_GPU\nmpirun_config:\n  mpirun_hostfile: /h\n").unwrap();
    assert_eq!(file.ignored, ["mpirun_config.mpirun_hostfile"]);
    assert_eq!(file.mpirun_hostfile, None);
    // An empty mpirun_config (what `accelerate config` writes without mpirun) asks for nothing.
    let file = parse("distributed_type: MULTI_CPU\nmpirun_config: {}\n").unwrap();
    assert!(file.ignored.is_empty() && file.mpirun_hostfile.is_none());
    let e =
        parse("distributed_type: MULTI_CPU\nmpirun_config:\n  mpirun_hostfile: 3\n").unwrap_err();
    assert!(e.contains("mpirun_config.mpirun_hostfile"), "{e}");
}

/// The variables every worker of `args` gets (local rank 0 of one machine).
fn worker_env(args: &Args) -> std::collections::BTreeMap<String, String> {
    crate::worker_env::JobLayout {
        world_size: 2,
        local_world_size: 2,
        machine_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: args.main_process_port,
        job_token: "t".into(),
        restart_count: 0,
        gradient_accumulation_steps: args.gradient_accumulation_steps,
        mixed_precision: args.mixed_precision,
        zero_stage: args.zero_stage,
        fsdp_layer_classes: args.fsdp_transformer_layer_cls_to_wrap.clone(),
        fsdp_state_dict_type: args.fsdp_state_dict_type,
        fsdp_forward_prefetch: args.fsdp_forward_prefetch,
        fsdp_backward_prefetch: args.fsdp_backward_prefetch,
        fsdp_keep_gathered: args.fsdp_keep_gathered,
        cpu: false,
        threads_per_worker: 1,
        ranks_per_gpu: 1,
        host_name: "h".into(),
    }
    .worker_env(0, &|_| false)
}

/// What Accelerate 1.x's `accelerate config` writes for FSDP2 on two GPUs (commands/config/
/// cluster.py's questions: FSDP version 2, reshard after forward yes, no offload,
/// TRANSFORMER_BASED_WRAP with LlamaDecoderLayer, SHARDED_STATE_DICT, CPU-RAM-efficient loading
/// yes, activation checkpointing no; then bf16), as `yaml.safe_dump` sorts and spells it.
const FSDP2_FILE: &str = "compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
";

#[test]
fn accelerates_fsdp2_file_is_zero_stage_3_with_its_units_and_state_dict_type() {
    let file = parse(FSDP2_FILE).unwrap();
    assert_eq!(file.distributed_type, DistributedType::Fsdp);
    assert!(file.ignored.is_empty(), "{:?}", file.ignored);
    assert_eq!(file.zero_stage, Some(3));
    assert_eq!(
        file.fsdp_layer_classes.as_deref(),
        Some("LlamaDecoderLayer")
    );
    assert_eq!(file.fsdp_state_dict_type, Some(StateDictType::Sharded));
    let args = launch_args(&file, &["l", "p"]);
    assert_eq!(args.num_processes, Some(2));
    assert!(!args.cpu);
    let env = worker_env(&args);
    let get = |k: &str| env.get(k).map(String::as_str);
    assert_eq!(get("ACCELERATE_ZERO_STAGE"), Some("3"));
    assert_eq!(
        get("ACCELERATE_FSDP_LAYER_CLASSES"),
        Some("LlamaDecoderLayer")
    );
    assert_eq!(
        get("ACCELERATE_FSDP_STATE_DICT_TYPE"),
        Some("SHARDED_STATE_DICT")
    );
    assert_eq!(get("ACCELERATE_MIXED_PRECISION"), Some("bf16"));
    // reshard_after_forward false keeps the gathered parameters to the backward: SHARD_GRAD_OP.
    let file = parse(&FSDP2_FILE.replace(
        "fsdp_reshard_after_forward: true",
        "fsdp_reshard_after_forward: false",
    ))
    .unwrap();
    assert_eq!(file.zero_stage, Some(2));
    // Absent, it is Accelerate's default for FSDP2, true; so is SHARDED_STATE_DICT.
    let file = parse(
        &FSDP2_FILE
            .replace("  fsdp_reshard_after_forward: true\n", "")
            .replace("  fsdp_state_dict_type: SHARDED_STATE_DICT\n", ""),
    )
    .unwrap();
    assert_eq!(file.zero_stage, Some(3));
    assert_eq!(file.fsdp_state_dict_type, Some(StateDictType::Sharded));
}

/// An FSDP1 file with `strategy` as its sharding strategy, as Accelerate before 1.6 wrote it.
fn fsdp1(strategy: &str) -> String {
    format!(
        "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 1\n  \
         fsdp_sharding_strategy: {strategy}\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
         fsdp_transformer_layer_cls_to_wrap: GPT2Block\n  fsdp_backward_prefetch: BACKWARD_PRE\n  \
         fsdp_forward_prefetch: false\n  fsdp_use_orig_params: true\n  \
         fsdp_sync_module_states: true\n  fsdp_offload_params: false\n"
    )
}

#[test]
fn fsdp1_sharding_strategies_are_zero_stages() {
    // FULL_SHARD shards parameters, gradients and optimizer state (ZeRO-3), SHARD_GRAD_OP
    // gradients and optimizer state (ZeRO-2), NO_SHARD nothing (DDP); older files hold the
    // numbers of PyTorch's ShardingStrategy (FULL_SHARD = 1, SHARD_GRAD_OP = 2, NO_SHARD = 3).
    for (strategy, stage) in [
        ("FULL_SHARD", 3),
        ("SHARD_GRAD_OP", 2),
        ("NO_SHARD", 0),
        ("1", 3),
        ("2", 2),
        ("'3'", 0),
        ("shard_grad_op", 2),
    ] {
        let file = parse(&fsdp1(strategy)).unwrap();
        assert_eq!(file.zero_stage, Some(stage), "{strategy}");
        assert!(file.ignored.is_empty(), "{strategy}: {:?}", file.ignored);
        assert_eq!(file.fsdp_layer_classes.as_deref(), Some("GPT2Block"));
        // FSDP1's default state dict type in Accelerate.
        assert_eq!(file.fsdp_state_dict_type, Some(StateDictType::Full));
        assert_eq!(launch_args(&file, &["l", "p"]).zero_stage, Some(stage));
    }
}

#[test]
fn fsdp1_reads_the_strategy_where_each_accelerate_wrote_it() {
    // Accelerate 1.6 and later write FSDP1's strategy as fsdp_reshard_after_forward.
    let file = parse(
        &fsdp1("SHARD_GRAD_OP").replace("fsdp_sharding_strategy", "fsdp_reshard_after_forward"),
    )
    .unwrap();
    assert_eq!(file.zero_stage, Some(2));
    assert!(file.ignored.is_empty(), "{:?}", file.ignored);
    // Accelerate's plugin prefers fsdp_sharding_strategy; the other, disagreeing, is named.
    let both = fsdp1("SHARD_GRAD_OP") + "  fsdp_reshard_after_forward: FULL_SHARD\n";
    let file = parse(&both).unwrap();
    assert_eq!(file.zero_stage, Some(2));
    assert_eq!(file.ignored, ["fsdp_config.fsdp_reshard_after_forward"]);
    let agreeing = fsdp1("SHARD_GRAD_OP") + "  fsdp_reshard_after_forward: SHARD_GRAD_OP\n";
    assert!(parse(&agreeing).unwrap().ignored.is_empty());
    // FSDP2 reads only fsdp_reshard_after_forward: a sharding strategy beside it is named unless
    // it says the same.
    let file = parse(&FSDP2_FILE.replace(
        "  fsdp_version: 2\n",
        "  fsdp_version: 2\n  fsdp_sharding_strategy: NO_SHARD\n",
    ))
    .unwrap();
    assert_eq!(file.zero_stage, Some(3));
    assert_eq!(file.ignored, ["fsdp_config.fsdp_sharding_strategy"]);
    let file = parse(&FSDP2_FILE.replace(
        "  fsdp_version: 2\n",
        "  fsdp_version: 2\n  fsdp_sharding_strategy: FULL_SHARD\n",
    ))
    .unwrap();
    assert!(file.ignored.is_empty(), "{:?}", file.ignored);
    // The oldest files (2022) have no fsdp_ prefix; Accelerate's launcher adds it.
    let file = parse(
        "distributed_type: FSDP\nfsdp_config:\n  sharding_strategy: 2\n  offload_params: false\n  \
         min_num_params: 0\n",
    )
    .unwrap();
    assert_eq!(file.zero_stage, Some(2));
    assert!(file.ignored.is_empty(), "{:?}", file.ignored);
}

#[test]
fn fsdp_units_matter_only_at_stage_3() {
    // Below stage 3 the parameters are whole on every rank: any wrap policy runs the same.
    let file = parse(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n  \
         fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 100000000\n",
    )
    .unwrap();
    assert_eq!((file.zero_stage, file.fsdp_layer_classes), (Some(2), None));
    assert!(file.ignored.is_empty(), "{:?}", file.ignored);
    // Classes Accelerate would not read (not TRANSFORMER_BASED_WRAP) are named.
    let file = parse(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n  \
         fsdp_auto_wrap_policy: NO_WRAP\n  fsdp_transformer_layer_cls_to_wrap: GPT2Block\n",
    )
    .unwrap();
    assert_eq!((file.zero_stage, file.fsdp_layer_classes), (Some(0), None));
    assert_eq!(
        file.ignored,
        ["fsdp_config.fsdp_transformer_layer_cls_to_wrap"]
    );
    // Class lists are trimmed and joined by commas; a YAML list reads the same.
    let with = |classes: &str| {
        parse(&FSDP2_FILE.replace(
            "fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer",
            &format!("fsdp_transformer_layer_cls_to_wrap: {classes}"),
        ))
        .unwrap()
        .fsdp_layer_classes
    };
    assert_eq!(
        with("'GPT2Block, GPT2MLP '").as_deref(),
        Some("GPT2Block,GPT2MLP")
    );
    assert_eq!(
        with("[GPT2Block, GPT2MLP]").as_deref(),
        Some("GPT2Block,GPT2MLP")
    );
}

#[test]
fn other_fsdp_keys_are_quiet_when_neutral_and_named_otherwise() {
    let file = parse(
        &(FSDP2_FILE.replace(
            "  fsdp_version: 2\n",
            "  fsdp_version: 2\n  fsdp_ignored_modules: null\n  fsdp_sync_module_states: false\n  \
             fsdp_activation_checkpointing: true\n  fsdp_forward_prefetch: true\n  \
             fsdp_backward_prefetch: BACKWARD_POST\n  fsdp_use_orig_params: false\n  \
             fsdp_new_thing: 1\n",
        ) + "fp8_config: {}\n"),
    )
    .unwrap();
    assert_eq!(file.ignored, ["fsdp_config.fsdp_new_thing"]);
    assert_eq!(file.zero_stage, Some(3));
    // The prefetch keys are read, not merely quiet.
    assert_eq!(
        (file.fsdp_forward_prefetch, file.fsdp_backward_prefetch),
        (Some(1), Some(1))
    );
    // Under another distributed type Accelerate does not read fsdp_config at all.
    let file = parse("distributed_type: MULTI_GPU\nfsdp_config:\n  fsdp_version: 2\n").unwrap();
    assert_eq!(
        (file.ignored.as_slice(), file.zero_stage),
        (&["fsdp_config".to_string()][..], None)
    );
}

#[test]
fn fsdp_refusals_name_the_key_and_the_value() {
    let fsdp2 = |from: &str, to: &str| {
        assert!(FSDP2_FILE.contains(from), "{from}");
        FSDP2_FILE.replace(from, to)
    };
    for (text, wants) in [
        (
            fsdp1("HYBRID_SHARD"),
            &[
                "fsdp_config.fsdp_sharding_strategy",
                "\"HYBRID_SHARD\"",
                "not implemented",
                "FULL_SHARD",
            ][..],
        ),
        (
            fsdp1("HYBRID_SHARD_ZERO2"),
            &[
                "fsdp_sharding_strategy",
                "\"HYBRID_SHARD_ZERO2\"",
                "replicas",
            ],
        ),
        (
            fsdp1("4"),
            &[
                "fsdp_sharding_strategy: 4:",
                "HYBRID_SHARD",
                "not implemented",
            ],
        ),
        (
            fsdp1("ZERO3"),
            &["fsdp_sharding_strategy", "\"ZERO3\"", "give FULL_SHARD"],
        ),
        (
            fsdp2("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"),
            &[
                "fsdp_config.fsdp_auto_wrap_policy",
                "\"SIZE_BASED_WRAP\"",
                "not implemented",
                "TRANSFORMER_BASED_WRAP",
                "layer class",
            ],
        ),
        (
            fsdp2("TRANSFORMER_BASED_WRAP", "NO_WRAP"),
            &[
                "fsdp_config.fsdp_auto_wrap_policy",
                "\"NO_WRAP\"",
                "TRANSFORMER_BASED_WRAP",
            ],
        ),
        (
            fsdp2("  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n", ""),
            &["fsdp_config.fsdp_auto_wrap_policy", "absent", "NO_WRAP"],
        ),
        (
            "distributed_type: FSDP\n".to_string(),
            &["fsdp_config.fsdp_auto_wrap_policy", "absent", "NO_WRAP"],
        ),
        (
            fsdp2(
                "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n",
                "",
            ),
            &[
                "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                "no class given",
                "TRANSFORMER_BASED_WRAP",
                "LlamaDecoderLayer",
            ],
        ),
        (
            fsdp2("LlamaDecoderLayer", "A,,B"),
            &[
                "fsdp_transformer_layer_cls_to_wrap",
                "\"A,,B\"",
                "empty class name",
            ],
        ),
        (
            fsdp2("SHARDED_STATE_DICT", "LOCAL_STATE_DICT"),
            &[
                "fsdp_config.fsdp_state_dict_type",
                "\"LOCAL_STATE_DICT\"",
                "not implemented",
                "SHARDED_STATE_DICT",
            ],
        ),
        (
            fsdp2("fsdp_offload_params: false", "fsdp_offload_params: true"),
            &[
                "fsdp_config.fsdp_offload_params: true",
                "not implemented",
                "false",
            ],
        ),
        (
            fsdp2("fsdp_version: 2", "fsdp_version: 3"),
            &["fsdp_config.fsdp_version: 3", "give 1", "or 2"],
        ),
        (
            fsdp2(
                "fsdp_reshard_after_forward: true",
                "fsdp_reshard_after_forward: FULL_SHARD",
            ),
            &[
                "fsdp_reshard_after_forward",
                "\"FULL_SHARD\"",
                "true",
                "fsdp_version 1",
            ],
        ),
        (
            fsdp1("FULL_SHARD").replace(
                "fsdp_sharding_strategy: FULL_SHARD",
                "fsdp_reshard_after_forward: true",
            ),
            &[
                "fsdp_config.fsdp_reshard_after_forward: true",
                "fsdp_version 2",
            ],
        ),
        (
            "distributed_type: FSDP\nfsdp_config:\n  sharding_strategy: 1\n  \
             fsdp_sharding_strategy: 1\n"
                .to_string(),
            &[
                "both fsdp_sharding_strategy and sharding_strategy",
                "keep one",
            ],
        ),
        (
            "distributed_type: FSDP\nfsdp_config: FULL_SHARD\n".to_string(),
            &["fsdp_config: \"FULL_SHARD\"", "expected a mapping"],
        ),
        (
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  \
             offload_optimizer_device: cpu\n"
                .to_string(),
            &[
                "deepspeed_config.offload_optimizer_device",
                "\"cpu\"",
                "not implemented",
                "none",
            ],
        ),
        (
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  \
             offload_param_device: nvme\n  offload_param_nvme_path: /nvme\n"
                .to_string(),
            &["deepspeed_config.offload_param_device", "\"nvme\"", "none"],
        ),
    ] {
        let e = parse(&text).unwrap_err();
        assert!(
            e.starts_with("config file /cfg/default_config.yaml: "),
            "{e}"
        );
        for want in wants {
            assert!(e.contains(want), "{text:?}:\n{e}\nlacks {want:?}");
        }
    }
}

#[test]
fn deepspeed_zero_stage_3_runs_as_our_stage_3() {
    // cluster.py's DeepSpeed answers at stage 3: no offload, zero.Init on, 16-bit save off.
    let file = parse(
        "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  \
         gradient_accumulation_steps: 1\n  offload_optimizer_device: none\n  \
         offload_param_device: none\n  zero3_init_flag: true\n  zero3_save_16bit_model: false\n  \
         zero_stage: 3\n",
    )
    .unwrap();
    assert_eq!(file.zero_stage, Some(3));
    // zero.Init (building the model already partitioned) is a feature we lack: named.
    assert_eq!(file.ignored, ["deepspeed_config.zero3_init_flag"]);
    assert_eq!(
        (
            file.fsdp_layer_classes.as_deref(),
            file.fsdp_state_dict_type
        ),
        (None, None)
    );
    let env = worker_env(&launch_args(&file, &["l", "p"]));
    assert_eq!(env["ACCELERATE_ZERO_STAGE"], "3");
    assert!(!env.contains_key("ACCELERATE_FSDP_LAYER_CLASSES"));
    assert!(!env.contains_key("ACCELERATE_FSDP_STATE_DICT_TYPE"));
}

#[test]
fn fsdp_flags_on_the_command_line_override_the_file() {
    let file = parse(FSDP2_FILE).unwrap();
    let args = launch_args(
        &file,
        &[
            "l",
            "--fsdp-transformer-layer-cls-to-wrap",
            " GPT2Block , GPT2MLP",
            "--fsdp_state_dict_type",
            "full_state_dict",
            "--zero-stage",
            "2",
            "p",
        ],
    );
    assert_eq!(
        args.fsdp_transformer_layer_cls_to_wrap.as_deref(),
        Some("GPT2Block,GPT2MLP")
    );
    assert_eq!(args.fsdp_state_dict_type, Some(StateDictType::Full));
    assert_eq!(args.zero_stage, Some(2));
    let env = worker_env(&args);
    assert_eq!(env["ACCELERATE_FSDP_LAYER_CLASSES"], "GPT2Block,GPT2MLP");
    assert_eq!(env["ACCELERATE_FSDP_STATE_DICT_TYPE"], "FULL_STATE_DICT");
    assert_eq!(env["ACCELERATE_ZERO_STAGE"], "2");
}

/// `FSDP2_FILE` with `keys` (lines of `fsdp_config`) added.
fn fsdp2_with(keys: &str) -> String {
    FSDP2_FILE.replace("  fsdp_version: 2\n", &format!("  fsdp_version: 2\n{keys}"))
}

#[test]
fn fsdp_prefetch_keys_are_units_ahead_in_every_spelling_accelerate_reads() {
    // Accelerate's plugin: forward_prefetch through str_to_bool; backward_prefetch by name in any
    // case, or the number of PyTorch's BackwardPrefetch (BACKWARD_PRE = 1, BACKWARD_POST = 2).
    // Both of FSDP's backward timings gather the next unit during the current backward: 1 unit.
    for (value, units) in [
        ("true", 1),
        ("false", 0),
        ("'true'", 1),
        ("\"False\"", 0),
        ("yes", 1), // a YAML 1.2 string, which str_to_bool takes
        ("'t'", 1),
        ("off", 0),
        ("1", 1),
        ("0", 0),
    ] {
        let file = parse(&fsdp2_with(&format!("  fsdp_forward_prefetch: {value}\n"))).unwrap();
        assert_eq!(
            (file.fsdp_forward_prefetch, file.fsdp_backward_prefetch),
            (Some(units), None),
            "{value}"
        );
        assert!(file.ignored.is_empty(), "{value}: {:?}", file.ignored);
    }
    for (value, units) in [
        ("BACKWARD_PRE", 1),
        ("BACKWARD_POST", 1),
        ("NO_PREFETCH", 0),
        ("backward_post", 1),
        ("' No_Prefetch '", 0),
        ("1", 1),
        ("2", 1),
        ("'2'", 1),
    ] {
        let file = parse(&fsdp2_with(&format!("  fsdp_backward_prefetch: {value}\n"))).unwrap();
        assert_eq!(
            (file.fsdp_backward_prefetch, file.fsdp_forward_prefetch),
            (Some(units), None),
            "{value}"
        );
        assert!(file.ignored.is_empty(), "{value}: {:?}", file.ignored);
    }
    // Absent or null (Accelerate 1.x writes null for FSDP2): nothing, the workers' defaults.
    for text in [
        FSDP2_FILE.to_string(),
        fsdp2_with("  fsdp_backward_prefetch: null\n  fsdp_forward_prefetch: null\n"),
    ] {
        let file = parse(&text).unwrap();
        assert_eq!(
            (file.fsdp_forward_prefetch, file.fsdp_backward_prefetch),
            (None, None)
        );
        assert!(file.ignored.is_empty(), "{:?}", file.ignored);
        let env = worker_env(&launch_args(&file, &["l", "p"]));
        assert!(!env.contains_key("ACCELERATE_FSDP_FORWARD_PREFETCH"));
        assert!(!env.contains_key("ACCELERATE_FSDP_BACKWARD_PREFETCH"));
    }
    // The FSDP1 file Accelerate's `accelerate config` writes asks both questions.
    let file = parse(&fsdp1("FULL_SHARD")).unwrap();
    assert_eq!(
        (file.fsdp_forward_prefetch, file.fsdp_backward_prefetch),
        (Some(0), Some(1))
    );
    let env = worker_env(&launch_args(&file, &["l", "p"]));
    assert_eq!(env["ACCELERATE_FSDP_FORWARD_PREFETCH"], "0");
    assert_eq!(env["ACCELERATE_FSDP_BACKWARD_PREFETCH"], "1");
    assert!(!env.contains_key("ACCELERATE_FSDP_KEEP_GATHERED"));
    // The oldest files' keys without the prefix read the same.
    let file = parse(
        "distributed_type: FSDP\nfsdp_config:\n  sharding_strategy: 2\n  \
         backward_prefetch: NO_PREFETCH\n  forward_prefetch: true\n",
    )
    .unwrap();
    assert_eq!(
        (file.fsdp_forward_prefetch, file.fsdp_backward_prefetch),
        (Some(1), Some(0))
    );
    // Accelerate before 0.26's spelling, which Accelerate 1.x no longer reads: named.
    let file = parse(&fsdp2_with(
        "  fsdp_backward_prefetch_policy: BACKWARD_PRE\n",
    ))
    .unwrap();
    assert_eq!(file.fsdp_backward_prefetch, None);
    assert_eq!(file.ignored, ["fsdp_config.fsdp_backward_prefetch_policy"]);
    // Outside distributed_type FSDP, fsdp_config is not read (and named when not neutral).
    let file = parse(
        "distributed_type: MULTI_GPU\nfsdp_config:\n  fsdp_backward_prefetch: BACKWARD_PRE\n",
    )
    .unwrap();
    assert_eq!(file.fsdp_backward_prefetch, None);
    assert_eq!(file.ignored, ["fsdp_config"]);
}

#[test]
fn fsdp_prefetch_below_stage_3_is_exported_and_changes_nothing_there() {
    // As the state dict type: only stage 3 reads it, so the value is harmless elsewhere.
    let file = parse(&FSDP2_FILE.replace(
        "  fsdp_reshard_after_forward: true\n",
        "  fsdp_reshard_after_forward: false\n  fsdp_forward_prefetch: true\n  \
         fsdp_backward_prefetch: NO_PREFETCH\n",
    ))
    .unwrap();
    assert_eq!(file.zero_stage, Some(2));
    let env = worker_env(&launch_args(&file, &["l", "p"]));
    assert_eq!(env["ACCELERATE_ZERO_STAGE"], "2");
    assert_eq!(env["ACCELERATE_FSDP_FORWARD_PREFETCH"], "1");
    assert_eq!(env["ACCELERATE_FSDP_BACKWARD_PREFETCH"], "0");
}

#[test]
fn fsdp_prefetch_refusals_name_the_key_the_value_and_what_it_takes() {
    for (keys, wants) in [
        (
            "  fsdp_forward_prefetch: 2\n",
            &[
                "fsdp_config.fsdp_forward_prefetch: 2:",
                "give true",
                "or false",
                "--fsdp-forward-prefetch N",
            ][..],
        ),
        (
            "  fsdp_forward_prefetch: maybe\n",
            &["fsdp_config.fsdp_forward_prefetch: \"maybe\"", "give true"],
        ),
        (
            "  fsdp_forward_prefetch: [true]\n",
            &["fsdp_config.fsdp_forward_prefetch: a list", "give true"],
        ),
        (
            "  fsdp_backward_prefetch: BACKWARD_PREE\n",
            &[
                "fsdp_config.fsdp_backward_prefetch: \"BACKWARD_PREE\"",
                "give BACKWARD_PRE or BACKWARD_POST",
                "NO_PREFETCH",
                "1 or 2",
            ],
        ),
        (
            // BackwardPrefetch(0) and (3) do not exist; a number is never a count of units here.
            "  fsdp_backward_prefetch: 0\n",
            &[
                "fsdp_config.fsdp_backward_prefetch: 0:",
                "not a count of units",
                "--fsdp-backward-prefetch N",
            ],
        ),
        (
            "  fsdp_backward_prefetch: 3\n",
            &["fsdp_config.fsdp_backward_prefetch: 3:", "NO_PREFETCH"],
        ),
        (
            "  fsdp_backward_prefetch: true\n",
            &["fsdp_config.fsdp_backward_prefetch: true:", "BACKWARD_PRE"],
        ),
        (
            "  backward_prefetch: PRE\n",
            &["fsdp_config.backward_prefetch: \"PRE\"", "BACKWARD_PRE"],
        ),
    ] {
        let e = parse(&fsdp2_with(keys)).unwrap_err();
        assert!(
            e.starts_with("config file /cfg/default_config.yaml: "),
            "{e}"
        );
        for want in wants {
            assert!(e.contains(want), "{keys:?}:\n{e}\nlacks {want:?}");
        }
    }
}

#[test]
fn prefetch_flags_on_the_command_line_override_the_file() {
    let file = parse(&fsdp2_with(
        "  fsdp_forward_prefetch: true\n  fsdp_backward_prefetch: BACKWARD_POST\n",
    ))
    .unwrap();
    // The file alone.
    let env = worker_env(&launch_args(&file, &["l", "p"]));
    assert_eq!(env["ACCELERATE_FSDP_FORWARD_PREFETCH"], "1");
    assert_eq!(env["ACCELERATE_FSDP_BACKWARD_PREFETCH"], "1");
    // Each flag wins over its key, the other key still applies.
    let args = launch_args(&file, &["l", "--fsdp-backward-prefetch", "3", "p"]);
    assert_eq!(
        (args.fsdp_forward_prefetch, args.fsdp_backward_prefetch),
        (Some(1), Some(3))
    );
    let args = launch_args(
        &file,
        &[
            "l",
            "--fsdp_forward_prefetch",
            "false",
            "--fsdp-backward-prefetch",
            "NO_PREFETCH",
            "--fsdp-keep-gathered",
            "p",
        ],
    );
    let env = worker_env(&args);
    assert_eq!(env["ACCELERATE_FSDP_FORWARD_PREFETCH"], "0");
    assert_eq!(env["ACCELERATE_FSDP_BACKWARD_PREFETCH"], "0");
    assert_eq!(env["ACCELERATE_FSDP_KEEP_GATHERED"], "1");
    // Flags without a file key fill in what the file leaves out.
    let args = launch_args(
        &parse(FSDP2_FILE).unwrap(),
        &["l", "--fsdp-forward-prefetch", "4", "p"],
    );
    assert_eq!(
        (args.fsdp_forward_prefetch, args.fsdp_backward_prefetch),
        (Some(4), None)
    );
}
