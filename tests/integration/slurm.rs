//! SLURM for real: jobs on a one-node cluster of the `slurm-wlm` and `munge` packages
//! ([`SlurmCluster`]) against one process with the global batch, as the launcher's tests in
//! `distributed.rs` are.
//!
//! - `srun -n 2 mlp ...`: one task per rank, the ranks reading SLURM's variables
//!   (`SLURM_PROCID`, `SLURM_NTASKS`, ...) and rank 0 hosting the store on `MASTER_PORT`.
//! - `sbatch scripts/slurm/train.sbatch mlp ...`: the book's batch script, one
//!   `accelerate-launch` per node starting the node's ranks.
//!
//! Where SLURM cannot run (packages missing, not root) each test says why (past libtest's output
//! capture, [`accelerate_tests::skip`]) and passes, unless
//! `ACCELERATE_REQUIRE_SLURM=1` (CI) makes that a failure.

use std::path::{Path, PathBuf};
use std::time::Duration;

use accelerate_tests::slurm_cluster::{describe_failure, SlurmCluster};
use accelerate_tests::{
    built_binary, free_port, load_flat, max_abs_diff_flat, output_text, small_mlp_args, Job,
};

const LIMIT: Duration = Duration::from_secs(240);

/// 80 samples, micro-batches of 4 per rank, K = 2 on 2 ranks: 16 samples per optimizer step,
/// 5 steps per epoch, 10 over the two epochs.
const SAMPLES: usize = 80;
const MICRO_BATCH: usize = 4;
const GRAD_ACCUM: usize = 2;
const RANKS: usize = 2;

/// The `mlp` arguments of the distributed runs, saving the weights to `out`.
fn distributed_args(out: &Path) -> Vec<String> {
    let mut args = small_mlp_args(SAMPLES, MICRO_BATCH, "sgd", 11, out);
    args.extend(["--grad-accum".into(), GRAD_ACCUM.to_string()]);
    args
}

/// The weights of one process (no launcher, no SLURM) over the same samples with the global
/// batch, saved in `dir`.
fn one_process_weights(dir: &Path) -> PathBuf {
    let out = dir.join("one_process.safetensors");
    let o = Job::mlp(1)
        .limit(LIMIT)
        .args(small_mlp_args(
            SAMPLES,
            RANKS * GRAD_ACCUM * MICRO_BATCH,
            "sgd",
            11,
            &out,
        ))
        .run();
    assert!(o.status.success(), "{}", output_text(&o));
    assert_eq!(o.summary::<u64>("steps"), 10, "{}", output_text(&o));
    out
}

/// Asserts that the weights in `distributed` are those of one process with the global batch.
fn assert_equals_one_process(dir: &Path, distributed: &Path, what: &str) {
    let single = one_process_weights(dir);
    let d = max_abs_diff_flat(&load_flat(distributed), &load_flat(&single));
    assert!(d < 2e-5, "{what}: max |Δθ| against one process = {d}");
}

#[test]
fn srun_with_one_task_per_rank_equals_one_process() {
    let Some(cluster) = SlurmCluster::for_test() else {
        return;
    };
    let dir = cluster.scratch("srun");
    let out = dir.join("srun.safetensors");
    // No MASTER_ADDR: on one node the ranks meet on loopback; rank 0 hosts the store on
    // MASTER_PORT.
    let o = Job::new("srun")
        .args(["--partition", "test", "--job-name", "accelerate-srun"])
        .args(["--ntasks", &RANKS.to_string(), "--nodes", "1"])
        // Two tasks even on a one-CPU machine; which task printed a line, as `0: `.
        .args([
            "--overcommit",
            "--label",
            "--kill-on-bad-exit=1",
            "--time",
            "10",
        ])
        .arg(built_binary("examples/mlp"))
        .args(distributed_args(&out))
        .env("SLURM_CONF", cluster.conf())
        .env("MASTER_PORT", free_port().to_string())
        .env("ACCELERATE_JOB_TOKEN", "shared-secret-of-this-test")
        .env("ACCELERATE_USE_CPU", "1")
        .limit(LIMIT)
        .run();
    assert!(o.status.success(), "{}", describe_failure(&cluster, &o));
    // Ten optimizer steps: the two tasks trained as ranks of one job (two lone processes would
    // each step 20 times), and only rank 0 (task 0) printed the summary.
    assert_eq!(o.summary::<u64>("steps"), 10, "{}", o.text());
    let summaries: Vec<&str> = std::str::from_utf8(&o.stdout)
        .unwrap()
        .lines()
        .filter(|l| l.contains(" steps="))
        .collect();
    assert!(
        summaries.len() == 1 && summaries[0].trim_start().starts_with("0:"),
        "one summary line, from task 0: {summaries:?}"
    );
    assert_equals_one_process(&dir, &out, "srun -n 2");
}

#[test]
fn sbatch_script_with_one_launcher_per_node_equals_one_process() {
    let Some(cluster) = SlurmCluster::for_test() else {
        return;
    };
    let dir = cluster.scratch("sbatch");
    let out = dir.join("sbatch.safetensors");
    let log = dir.join("job.out");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/slurm/train.sbatch");
    // The script as a user submits it; the test only says where the launcher is, runs CPU
    // ranks, and gives the store a free port. The script makes the job token.
    let o = Job::new("sbatch")
        .args(["--wait", "--partition", "test", "--time", "10"])
        .arg("--output")
        .arg(&log)
        .arg("--chdir")
        .arg(&dir)
        .arg(&script)
        .arg(built_binary("examples/mlp"))
        .args(distributed_args(&out))
        .env("SLURM_CONF", cluster.conf())
        .env("LAUNCHER", built_binary("accelerate-launch"))
        .env("PROCESSES_PER_NODE", RANKS.to_string())
        .env("LAUNCHER_FLAGS", "--cpu")
        .env("MASTER_PORT", free_port().to_string())
        .limit(LIMIT)
        .run();
    let job_output = std::fs::read_to_string(&log).unwrap_or_else(|e| format!("({e})"));
    assert!(
        o.status.success(),
        "{}\n=== job output ({}):\n{job_output}",
        describe_failure(&cluster, &o),
        log.display()
    );
    // The launcher's rank-prefixed summary from rank 0: ten steps over the global batch.
    let summary = job_output
        .lines()
        .find(|l| l.starts_with("[rank 0]") && l.contains(" steps="))
        .unwrap_or_else(|| panic!("no summary from rank 0 in the job output:\n{job_output}"));
    assert!(
        summary.split_whitespace().any(|w| w == "steps=10"),
        "{summary}"
    );
    // --exclusive gave the job the whole node, and the launcher's step got every CPU of it
    // (slurm.conf's CPUs=), not the one CPU a task gets by default.
    let layout = format!("1 node(s) x 2 rank(s) on {} CPU(s)", cluster.cpus());
    assert!(
        job_output.contains(&layout),
        "the script's layout line, {layout:?}:\n{job_output}"
    );
    assert_equals_one_process(&dir, &out, "sbatch train.sbatch");
}

#[test]
fn the_book_shows_the_sbatch_script_the_test_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let script = std::fs::read_to_string(root.join("scripts/slurm/train.sbatch")).unwrap();
    let chapter = std::fs::read_to_string(root.join("docs/src/clusters.md")).unwrap();
    assert!(
        chapter.contains(&format!("```bash\n{}\n```", script.trim_end())),
        "docs/src/clusters.md must show scripts/slurm/train.sbatch as it is; paste it again"
    );
}
