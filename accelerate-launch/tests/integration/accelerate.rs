//! The `accelerate` command from the real binary: `launch` with Accelerate's config files, `config`,
//! `env` and `test`.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use accelerate_test_support::run_bounded;

/// What a finished command left: exit code, stdout, stderr.
struct Output {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs `accelerate args` with `HF_HOME` set to `hf_home` (so a developer's own default config
/// plays no part), without the job variables a surrounding job may have set, and with `env`
/// added. Killed after five minutes, so that a hang fails the test instead of stalling it.
fn accelerate(hf_home: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = crate::common::accelerate();
    cmd.args(args)
        .env("HF_HOME", hf_home)
        .envs(env.iter().copied())
        .stdin(Stdio::null());
    let o = run_bounded(&mut cmd, Duration::from_secs(300));
    Output {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// The `(RANK, WORLD_SIZE)` pairs the workers printed as `worker R W`, sorted.
fn workers(stdout: &str) -> Vec<(usize, usize)> {
    let mut seen: Vec<(usize, usize)> = stdout
        .lines()
        .filter_map(|l| l.split_once("worker ").map(|(_, rest)| rest))
        .map(|rest| {
            let mut f = rest.split_whitespace().map(|v| v.parse().unwrap());
            (f.next().unwrap(), f.next().unwrap())
        })
        .collect();
    seen.sort();
    seen
}

const PRINT_RANK: &str = "echo \"worker $RANK $WORLD_SIZE $ACCELERATE_USE_CPU\"";

#[test]
fn launch_with_a_multi_cpu_config_file_starts_its_processes_and_flags_override_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("two_cpus.yaml");
    std::fs::write(
        &config,
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n\
         main_process_port: 0\nmixed_precision: 'no'\ndebug: false\ntpu_name: null\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let o = accelerate(
        dir.path(),
        &["launch", "--config-file", config, "sh", "-c", PRINT_RANK],
        &[],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(workers(&o.stdout), [(0, 2), (1, 2)], "{}", o.stdout);
    assert!(
        o.stdout.contains("worker 0 2 1"),
        "CPU workers: {}",
        o.stdout
    );
    assert!(
        o.stderr.contains(&format!("using config file {config}")),
        "{}",
        o.stderr
    );
    // Neutral keys (debug: false, tpu_name: null) are accepted without a warning.
    assert!(!o.stderr.contains("warning"), "{}", o.stderr);

    // A flag beats the file; the underscore spelling works too.
    let o = accelerate(
        dir.path(),
        &[
            "launch",
            "--config_file",
            config,
            "--num-processes",
            "3",
            "sh",
            "-c",
            PRINT_RANK,
        ],
        &[],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(workers(&o.stdout), [(0, 3), (1, 3), (2, 3)], "{}", o.stdout);
}

#[test]
fn accelerate_launch_takes_the_config_file_flag_too_and_names_keys_it_ignores() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.yaml");
    std::fs::write(
        &config,
        "distributed_type: MULTI_CPU\nnum_processes: 2\nmain_process_port: 0\ndebug: true\n\
         fsdp_config:\n  fsdp_version: 2\nwandb_project: x\n",
    )
    .unwrap();
    let o = crate::common::launcher()
        .args([
            "--config-file",
            config.to_str().unwrap(),
            "sh",
            "-c",
            PRINT_RANK,
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(0), "{stderr}");
    assert_eq!(workers(&stdout), [(0, 2), (1, 2)], "{stdout}");
    let warning: Vec<&str> = stderr.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(
        warning,
        [format!(
            "accelerate-launch: warning: config file {}: ignoring keys we do not support: \
             debug, fsdp_config, wandb_project",
            config.display()
        )],
        "{stderr}"
    );
}

#[test]
fn config_default_then_launch_reads_it_from_hf_home() {
    let hf_home = tempfile::tempdir().unwrap();
    // No GPU visible: the default is one CPU process, as Accelerate writes it.
    let no_gpu = [("CUDA_VISIBLE_DEVICES", "")];
    let o = accelerate(hf_home.path(), &["config", "default"], &no_gpu);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let file = hf_home.path().join("accelerate/default_config.yaml");
    assert!(
        o.stdout.contains(&file.display().to_string()),
        "{}",
        o.stdout
    );
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("\"distributed_type\": \"NO\"") && text.contains("\"use_cpu\": true"));

    let o = accelerate(
        hf_home.path(),
        &["launch", "--main-process-port", "0", "sh", "-c", PRINT_RANK],
        &no_gpu,
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(workers(&o.stdout), [(0, 1)], "{}", o.stdout);
    assert!(
        o.stderr
            .contains(&format!("using config file {}", file.display())),
        "{}",
        o.stderr
    );

    // A second `config default` keeps the file, as Accelerate does; flags rewrite it.
    let o = accelerate(hf_home.path(), &["config", "default"], &no_gpu);
    assert_eq!(o.code, 0);
    assert!(o.stderr.contains("already exists"), "{}", o.stderr);
    let o = accelerate(
        hf_home.path(),
        &[
            "config",
            "--distributed-type",
            "MULTI_CPU",
            "--num-processes",
            "2",
        ],
        &no_gpu,
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    let o = accelerate(
        hf_home.path(),
        &["launch", "--main-process-port", "0", "sh", "-c", PRINT_RANK],
        &no_gpu,
    );
    assert_eq!(workers(&o.stdout), [(0, 2), (1, 2)], "{}", o.stdout);
}

#[test]
fn config_without_a_terminal_or_flags_asks_for_flags() {
    let hf_home = tempfile::tempdir().unwrap();
    let o = accelerate(hf_home.path(), &["config"], &[]);
    assert_eq!(o.code, 2);
    assert!(
        o.stderr.contains("give the answers as flags"),
        "{}",
        o.stderr
    );
    assert!(!hf_home.path().join("accelerate").exists());
}

#[test]
fn a_missing_or_bad_config_file_is_named_and_nothing_starts() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("started");
    let touch = format!("touch {}", marker.display());
    let missing = dir.path().join("nope.yaml");
    let o = accelerate(
        dir.path(),
        &[
            "launch",
            "--config-file",
            missing.to_str().unwrap(),
            "sh",
            "-c",
            &touch,
        ],
        &[],
    );
    assert_eq!(o.code, 2);
    assert!(
        o.stderr.contains(&missing.display().to_string()) && o.stderr.contains("no such file"),
        "{}",
        o.stderr
    );
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "distributed_type: XLA\nnum_processes: 2\n").unwrap();
    let o = accelerate(
        dir.path(),
        &[
            "launch",
            "--config-file",
            bad.to_str().unwrap(),
            "sh",
            "-c",
            &touch,
        ],
        &[],
    );
    assert_eq!(o.code, 2);
    assert!(
        o.stderr.contains("distributed_type") && o.stderr.contains("\"XLA\""),
        "{}",
        o.stderr
    );
    assert!(!marker.exists(), "a worker started despite the bad config");
}

#[test]
fn an_fsdp_config_file_reaches_every_worker_as_zero_stage_3() {
    // Accelerate's FSDP2 answers (TRANSFORMER_BASED_WRAP, SHARDED_STATE_DICT) for two processes,
    // run here on the CPU.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fsdp.yaml");
    std::fs::write(
        &config,
        "distributed_type: FSDP\nnum_processes: 2\nmain_process_port: 0\nmixed_precision: bf16\n\
         use_cpu: true\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n  \
         fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
         fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n  \
         fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_offload_params: false\n  \
         fsdp_forward_prefetch: true\n  fsdp_backward_prefetch: NO_PREFETCH\n",
    )
    .unwrap();
    let print = "echo \"worker $RANK $WORLD_SIZE stage=$ACCELERATE_ZERO_STAGE \
                 classes=$ACCELERATE_FSDP_LAYER_CLASSES sd=$ACCELERATE_FSDP_STATE_DICT_TYPE \
                 mp=$ACCELERATE_MIXED_PRECISION fwd=$ACCELERATE_FSDP_FORWARD_PREFETCH \
                 bwd=$ACCELERATE_FSDP_BACKWARD_PREFETCH keep=$ACCELERATE_FSDP_KEEP_GATHERED\"";
    let o = accelerate(
        dir.path(),
        &[
            "launch",
            "--config-file",
            config.to_str().unwrap(),
            "--fsdp-keep-gathered",
            "sh",
            "-c",
            print,
        ],
        &[],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(!o.stderr.contains("warning"), "{}", o.stderr);
    let lines: Vec<&str> = o.stdout.lines().filter(|l| l.contains("worker ")).collect();
    assert_eq!(lines.len(), 2, "{}", o.stdout);
    for line in lines {
        assert!(
            line.ends_with(
                "2 stage=3 classes=LlamaDecoderLayer sd=SHARDED_STATE_DICT mp=bf16 fwd=1 bwd=0 \
                 keep=1"
            ),
            "{line}"
        );
    }
}

#[test]
fn a_python_fsdp_default_config_names_the_ways_around_it() {
    // What Python Accelerate's `accelerate config` leaves for an FSDP setup that wraps by
    // parameter count, which our ZeRO stage 3 does not do.
    let hf_home = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(hf_home.path().join("accelerate")).unwrap();
    std::fs::write(
        hf_home.path().join("accelerate/default_config.yaml"),
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n  \
         fsdp_sharding_strategy: FULL_SHARD\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  \
         fsdp_min_num_params: 100000000\nmixed_precision: bf16\nnum_machines: 1\n\
         num_processes: 2\nuse_cpu: false\n",
    )
    .unwrap();
    let run = ["--cpu", "--num-processes", "2", "sh", "-c", PRINT_RANK];
    let mut argv = vec!["launch"];
    argv.extend(run);
    let o = accelerate(hf_home.path(), &argv, &[]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr
            .contains("fsdp_config.fsdp_auto_wrap_policy: \"SIZE_BASED_WRAP\"")
            && o.stderr.contains("--config-file /dev/null"),
        "{}",
        o.stderr
    );
    assert!(o.stdout.is_empty(), "a worker started: {}", o.stdout);
    // The escapes it names: an empty config, and accelerate-launch (no default file).
    let mut argv = vec!["launch", "--config-file", "/dev/null"];
    argv.extend(run);
    let o = accelerate(hf_home.path(), &argv, &[]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(workers(&o.stdout), [(0, 2), (1, 2)], "{}", o.stdout);
    let o = crate::common::launcher()
        .args(run)
        .env("HF_HOME", hf_home.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        workers(&String::from_utf8_lossy(&o.stdout)),
        [(0, 2), (1, 2)]
    );
}

#[test]
fn env_reports_the_setup_and_hides_the_job_token() {
    let hf_home = tempfile::tempdir().unwrap();
    let token = "s3cr3t-t0ken-7f2a";
    let o = accelerate(
        hf_home.path(),
        &["env"],
        &[
            ("ACCELERATE_JOB_TOKEN", token),
            ("ACCELERATE_MIXED_PRECISION", "bf16"),
            ("NCCL_DEBUG", "INFO"),
            // A copy of the token under a name that does not say so.
            ("SLURM_JOB_COMMENT", token),
            ("MPI_LOCALRANKID", "1"),
        ],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(!o.stdout.contains(token) && !o.stderr.contains(token));
    assert!(
        o.stdout.contains("SLURM_JOB_COMMENT=<set, hidden>"),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("MPI_LOCALRANKID=1"), "{}", o.stdout);
    assert!(
        o.stdout.contains("ACCELERATE_JOB_TOKEN=<set, hidden>"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.contains("ACCELERATE_MIXED_PRECISION=bf16"),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("NCCL_DEBUG=INFO"), "{}", o.stdout);
    assert!(o.stdout.contains("accelerate-rs version"), "{}", o.stdout);
    assert!(o.stdout.contains("- config file: none"), "{}", o.stdout);

    // The config file in effect is named and shown.
    let o = accelerate(
        hf_home.path(),
        &[
            "config",
            "--distributed-type",
            "MULTI_CPU",
            "--num-processes",
            "3",
        ],
        &[],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    let o = accelerate(hf_home.path(), &["env"], &[("ACCELERATE_JOB_TOKEN", token)]);
    let file = hf_home.path().join("accelerate/default_config.yaml");
    assert!(
        o.stdout
            .contains(&format!("- config file: {}", file.display())),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("\"num_processes\": 3"), "{}", o.stdout);
    assert!(!o.stdout.contains(token) && !o.stderr.contains(token));
}

#[test]
fn test_runs_two_processes_and_matches_one_process() {
    let hf_home = tempfile::tempdir().unwrap();
    let o = accelerate(hf_home.path(), &["test"], &[("CUDA_VISIBLE_DEVICES", "")]);
    assert_eq!(o.code, 0, "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stdout
            .contains("accelerate test: PASS — 2 processes on cpu"),
        "{}",
        o.stdout
    );
}

#[test]
fn test_in_a_build_without_gpu_support_on_a_gpu_machine_tests_the_cpu_and_says_why() {
    if cfg!(feature = "nccl") {
        // This build would test the (stand-in) GPU; tests/integration/gpu.rs runs it on a real one.
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // A stand-in `nvidia-smi -L` listing one GPU (on a GPU machine the driver's list is read).
    let smi = dir.path().join("nvidia-smi");
    std::fs::write(
        &smi,
        "#!/bin/sh\necho 'GPU 0: Stand-in GPU (UUID: GPU-00000000-0000-0000-0000-000000000000)'\n",
    )
    .unwrap();
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let o = accelerate(dir.path(), &["test"], &[("PATH", &path)]);
    assert_eq!(o.code, 0, "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stderr
            .contains("accelerate test: testing the CPU: 1 GPU is visible, but this build")
            && o.stderr.contains("--features nccl"),
        "{}",
        o.stderr
    );
    assert!(
        o.stdout.contains("PASS — 2 processes on cpu") && o.stdout.contains("on the CPU: 1 GPU"),
        "{}",
        o.stdout
    );
}

#[test]
fn gpu_ids_reach_the_workers_as_cuda_visible_devices() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.yaml");
    // use_cpu keeps the job on the CPU wherever it runs; the GPU list still reaches the workers.
    std::fs::write(
        &config,
        "distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nmain_process_port: 0\n\
         gpu_ids: 1, 0\n",
    )
    .unwrap();
    let o = accelerate(
        dir.path(),
        &[
            "launch",
            "--config-file",
            config.to_str().unwrap(),
            "sh",
            "-c",
            "echo \"visible $CUDA_VISIBLE_DEVICES\"",
        ],
        &[("CUDA_VISIBLE_DEVICES", "7")],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(
        o.stdout
            .lines()
            .filter(|l| l.ends_with("visible 1,0"))
            .count(),
        2,
        "{}",
        o.stdout
    );
    assert!(
        o.stderr
            .contains("gpu_ids 1,0 from the config file replaces CUDA_VISIBLE_DEVICES=7"),
        "{}",
        o.stderr
    );
}
