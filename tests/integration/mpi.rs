//! Workers started by Open MPI's `mpirun`, directly and through `accelerate-launch
//! --mpirun-hostfile`: two ranks against one process with the global batch.
//!
//! The tests skip, saying why, where `mpirun` (Open MPI) is not installed; CI installs it and sets
//! `ACCELERATE_REQUIRE_MPI=1`, which turns a skip into a failure.

use std::path::Path;
use std::time::Duration;

use accelerate_tests::{
    built_binary, free_port, load_flat, max_abs_diff_flat, output_text, skip_unless_required,
    small_mlp_args, Job,
};

const LIMIT: Duration = Duration::from_secs(240);

/// Whether Open MPI's `mpirun` is here; says why not (or fails where CI requires it).
fn open_mpi_present() -> bool {
    let version = std::process::Command::new("mpirun")
        .arg("--version")
        .output();
    let problem = match version {
        Ok(o) if String::from_utf8_lossy(&o.stdout).contains("Open MPI") => return true,
        Ok(o) => format!(
            "`mpirun --version` is not Open MPI's: {}",
            String::from_utf8_lossy(&o.stdout).trim()
        ),
        Err(e) => format!("no mpirun ({e}); install openmpi-bin"),
    };
    skip_unless_required("ACCELERATE_REQUIRE_MPI", problem);
    false
}

/// The mlp on `samples` samples with batches of `batch` (SGD with momentum, seed 11), saving its
/// weights to `out`.
fn mlp_args(samples: usize, batch: usize, out: &Path) -> Vec<String> {
    small_mlp_args(samples, batch, "sgd", 11, out)
}

/// One process with the global batch of 2 ranks × K = 2 × batch 4, over the same 80 samples,
/// ends with the weights in `dist_out`.
fn assert_equals_one_process(dist_out: &Path, dir: &Path) {
    let single_out = dir.join("single.safetensors");
    let s = Job::mlp(1)
        .limit(LIMIT)
        .args(mlp_args(80, 16, &single_out))
        .run();
    assert!(s.status.success(), "{}", s.text());
    let d = max_abs_diff_flat(&load_flat(dist_out), &load_flat(&single_out));
    assert!(d < 2e-5, "max |Δθ| = {d}");
}

#[test]
fn two_ranks_started_by_mpirun_equal_one_process() {
    two_ranks_under_mpirun_equal_one_process(&[]);
}

/// `mpirun` inside an `sbatch` allocation: every rank inherits the batch step's `SLURM_PROCID=0`
/// and `SLURM_NTASKS`, which must not make each of them rank 0 (Open MPI's variables come first).
#[test]
fn mpirun_inside_a_slurm_allocation_ranks_by_open_mpi() {
    two_ranks_under_mpirun_equal_one_process(&[
        ("SLURM_JOB_ID", "42"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NODEID", "0"),
        ("SLURM_TASKS_PER_NODE", "2"),
    ]);
}

/// Two ranks under `mpirun -np 2`, with `inherited` in mpirun's environment (and so in every
/// rank's), end with the weights of one process with the global batch.
fn two_ranks_under_mpirun_equal_one_process(inherited: &[(&str, &str)]) {
    if !open_mpi_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dist_out = dir.path().join("mpirun.safetensors");
    let mut args = mlp_args(80, 4, &dist_out);
    args.extend(["--grad-accum".to_string(), "2".to_string()]);
    let port = free_port();
    // mpirun has no store of its own: rank 0 hosts ours on MASTER_PORT.
    let o = Job::new("mpirun")
        .limit(LIMIT)
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .args(["-x", "MASTER_ADDR=127.0.0.1"])
        .args(["-x", &format!("MASTER_PORT={port}")])
        .args(["-x", "ACCELERATE_JOB_TOKEN=token-of-the-mpirun-test"])
        .arg(built_binary("examples/mlp"))
        .args(args);
    let o = inherited
        .iter()
        .fold(o, |job, (name, value)| job.env(name, value))
        .run();
    assert!(o.status.success(), "{}", output_text(&o));
    assert_eq!(o.summary::<u64>("steps"), 10, "{}", o.text());
    // No launcher of ours set RAYON_NUM_THREADS: the ranks sized their pools themselves.
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("sized the CPU thread pool to"),
        "{}",
        o.text()
    );
    assert_equals_one_process(&dist_out, dir.path());
}

#[test]
fn the_launcher_with_an_mpirun_hostfile_equals_one_process() {
    if !open_mpi_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let hostfile = dir.path().join("hosts");
    std::fs::write(&hostfile, "# one machine\nlocalhost slots=2\n").unwrap();
    let dist_out = dir.path().join("hostfile.safetensors");
    let mut args = mlp_args(80, 4, &dist_out);
    args.extend(["--grad-accum".to_string(), "2".to_string()]);
    let o = Job::example("mlp")
        .limit(LIMIT)
        .launcher_flags(["--cpu", "--num-processes", "2", "--mpirun_hostfile"])
        .launcher_flags([&hostfile])
        .launcher_flags(["--main-process-port", &free_port().to_string()])
        .args(args)
        .run();
    assert!(o.status.success(), "{}", output_text(&o));
    assert_eq!(o.summary::<u64>("steps"), 10, "{}", o.text());
    assert_equals_one_process(&dist_out, dir.path());
}

#[test]
fn an_accelerate_config_with_an_mpirun_hostfile_equals_one_process() {
    if !open_mpi_present() {
        return;
    }
    // The shape Accelerate's `accelerate config` writes for mpirun (its docs,
    // usage_guides/intel_cpu.md), on one host: one machine, two CPU processes.
    let dir = tempfile::tempdir().unwrap();
    let hostfile = dir.path().join("hosts");
    std::fs::write(&hostfile, "localhost slots=2\n").unwrap();
    let config = dir.path().join("default_config.yaml");
    std::fs::write(
        &config,
        format!(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n\
             downcast_bf16: 'no'\nmachine_rank: 0\nmain_process_port: {}\n\
             main_training_function: main\nmixed_precision: 'no'\nmpirun_config:\n  \
             mpirun_hostfile: {}\nnum_machines: 1\nnum_processes: 2\nrdzv_backend: static\n\
             same_network: true\ntpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\n\
             use_cpu: true\n",
            free_port(),
            hostfile.display()
        ),
    )
    .unwrap();
    let dist_out = dir.path().join("config.safetensors");
    let mut args = mlp_args(80, 4, &dist_out);
    args.extend(["--grad-accum".to_string(), "2".to_string()]);
    let o = Job::example("mlp")
        .limit(LIMIT)
        .launcher_flags([std::ffi::OsStr::new("--config-file"), config.as_os_str()])
        .args(args)
        .run();
    assert!(o.status.success(), "{}", output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("with mpirun"),
        "{}",
        o.text()
    );
    assert_eq!(o.summary::<u64>("steps"), 10, "{}", o.text());
    assert_equals_one_process(&dist_out, dir.path());
}

#[test]
fn a_missing_mpirun_hostfile_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("never.safetensors");
    let missing = dir.path().join("no-such-hostfile");
    let o = Job::example("mlp")
        .limit(LIMIT)
        .launcher_flags(["--cpu", "--num-processes", "2", "--mpirun-hostfile"])
        .launcher_flags([&missing])
        .args(mlp_args(80, 4, &out))
        .run();
    assert_eq!(o.status.code(), Some(2), "{}", o.text());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--mpirun-hostfile") && err.contains("no-such-hostfile"),
        "{}",
        o.text()
    );
    assert!(!out.exists(), "a worker ran: {}", o.text());
    // The flags a hostfile job cannot take are named too.
    let hostfile = dir.path().join("hosts");
    std::fs::write(&hostfile, "localhost slots=2\n").unwrap();
    let o = Job::example("mlp")
        .limit(LIMIT)
        .launcher_flags(["--cpu", "--num-processes", "2", "--max-restarts", "1"])
        .launcher_flags([
            std::ffi::OsStr::new("--mpirun-hostfile"),
            hostfile.as_os_str(),
        ])
        .args(mlp_args(80, 4, &out))
        .run();
    assert_eq!(o.status.code(), Some(2), "{}", o.text());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--max-restarts"),
        "{}",
        o.text()
    );
    assert!(!out.exists(), "a worker ran: {}", o.text());
}
