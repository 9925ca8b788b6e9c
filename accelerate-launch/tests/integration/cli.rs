//! The launcher's answers to bad command lines, from the real binary.

use crate::common::{command, launcher};
use accelerate_test_support::free_port;

fn launch(args: &[&str]) -> (i32, String) {
    let o = launcher()
        .args(args)
        .output()
        .expect("run accelerate-launch");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn zero_processes_is_refused() {
    let (code, err) = launch(&["--cpu", "--num-processes", "0", "true"]);
    assert_eq!(code, 2);
    assert!(err.contains("--num-processes 0"), "{err}");
}

#[test]
fn more_gpus_than_exist_suggests_the_cpu() {
    // More than any machine has, so the test holds on GPU machines too.
    let (code, err) = launch(&["--num-gpus", "4096", "true"]);
    assert_eq!(code, 2);
    assert!(err.contains("visible GPU(s)"), "{err}");
    assert!(err.contains("--cpu --num-processes 4096"), "{err}");
}

#[test]
fn a_missing_program_is_named() {
    let (code, err) = launch(&[
        "--cpu",
        "--num-processes",
        "2",
        "--main-process-port",
        "0",
        "/nonexistent/trainer",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent/trainer"), "{err}");
}

#[test]
fn a_failing_rank_is_reported_with_its_exit_code() {
    let (code, err) = launch(&[
        "--cpu",
        "--num-processes",
        "2",
        "--main-process-port",
        "0",
        "sh",
        "-c",
        "exit $((RANK * 3))",
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("rank 1") && err.contains("exited with code 3"),
        "{err}"
    );
}

#[test]
fn a_taken_port_on_one_machine_falls_back_to_a_free_one_with_a_warning() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    // Each worker checks that it was given another port than the taken one.
    let check = format!("test \"$MASTER_PORT\" != {port} && test -n \"$MASTER_PORT\"");
    let (code, err) = launch(&[
        "--cpu",
        "--num-processes",
        "2",
        "--main-process-port",
        &port,
        "sh",
        "-c",
        &check,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!("--main-process-port {port} is in use")),
        "{err}"
    );
}

/// A directory holding a stand-in `nvidia-smi -L` that lists one GPU, so the launcher counts one
/// GPU on a machine without any (on a GPU machine the driver's own list is read instead).
fn one_fake_gpu() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let smi = dir.path().join("nvidia-smi");
    std::fs::write(
        &smi,
        "#!/bin/sh\necho 'GPU 0: Stand-in GPU (UUID: GPU-00000000-0000-0000-0000-000000000000)'\n",
    )
    .unwrap();
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

#[test]
fn ranks_per_gpu_starts_that_many_ranks_on_one_gpu_each_its_own_nccl_host() {
    let gpu = one_fake_gpu();
    let path = format!(
        "{}:{}",
        gpu.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let o = launcher()
        .env("PATH", path)
        .env_remove("CUDA_VISIBLE_DEVICES")
        .args([
            "--num-gpus",
            "1",
            "--ranks-per-gpu",
            "2",
            "--main-process-port",
            "0",
            "sh",
            "-c",
            "echo \"env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $ACCELERATE_GPU_INDEX \
             $ACCELERATE_DEVICE $NCCL_HOSTID\"",
        ])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut lines: Vec<Vec<&str>> = out
        .lines()
        .filter_map(|l| l.split_once("] env "))
        .map(|(_, rest)| rest.split(' ').collect())
        .collect();
    lines.sort();
    assert_eq!(lines.len(), 2, "{out}");
    for (rank, fields) in lines.iter().enumerate() {
        let r = rank.to_string();
        // rank, local rank, world size, local world size, GPU index, device.
        assert_eq!(
            fields[..6],
            [r.as_str(), &r, "2", "2", "0", "cuda"],
            "{out}"
        );
    }
    assert_ne!(lines[0][6], lines[1][6], "NCCL_HOSTID must differ: {out}");
    assert!(!lines[0][6].is_empty(), "{out}");
}

#[test]
fn ranks_per_gpu_keeps_the_gpu_count_checks_and_needs_num_gpus() {
    let (code, err) = launch(&["--num-gpus", "4096", "--ranks-per-gpu", "2", "true"]);
    assert_eq!(code, 2);
    assert!(err.contains("visible GPU(s)"), "{err}");
    let (code, err) = launch(&["--ranks_per_gpu", "2", "--cpu", "true"]);
    assert_eq!(code, 2);
    assert!(err.contains("--num-gpus"), "{err}");
    let (code, err) = launch(&["--num-gpus", "1", "--ranks-per-gpu", "0", "true"]);
    assert_eq!(code, 2);
    assert!(err.contains("--ranks-per-gpu 0"), "{err}");
}

/// Waits (bounded) until `path` exists; panics naming it otherwise.
fn wait_for_file(path: &std::path::Path, child: &mut std::process::Child) {
    for _ in 0..600 {
        if path.exists() {
            return;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the launcher ended ({status}) before {} appeared",
                path.display()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    panic!("{} did not appear within 30 s", path.display());
}

#[test]
fn ctrl_c_while_a_failed_group_is_torn_down_ends_the_launcher_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    // Attempt 0: rank 1 fails at once; rank 0 notes the SIGTERM of the teardown and carries on
    // (a slow shutdown), so the teardown lasts until the SIGINT below, which ends it. A restart
    // would leave the file `restarted`. Rank 1 fails only once rank 0's traps are set (the file
    // `ready`): a SIGTERM before them would end rank 0 at once and let the restart happen.
    let script = format!(
        "if [ \"$ACCELERATE_RESTART_COUNT\" != 0 ]; then touch {d}/restarted; exit 0; fi; \
         if [ \"$RANK\" = 1 ]; then while [ ! -e {d}/ready ]; do sleep 0.02; done; exit 3; fi; \
         trap 'touch {d}/term' TERM; trap 'touch {d}/int; exit 130' INT; touch {d}/ready; \
         while :; do sleep 0.05; done"
    );
    let mut child = launcher()
        .args([
            "--cpu",
            "--num-processes",
            "2",
            "--main-process-port",
            "0",
            "--max-restarts",
            "1",
            "--grace-period",
            "60",
            "sh",
            "-c",
            &script,
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_file(&dir.path().join("term"), &mut child);
    let interrupt = command("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupt.success());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(
        dir.path().join("int").exists(),
        "SIGINT not forwarded: {err}"
    );
    assert!(
        !dir.path().join("restarted").exists(),
        "restarted after Ctrl-C: {err}"
    );
    assert!(
        err.contains("rank 1") && err.contains("exited with code 3"),
        "{err}"
    );
}

#[test]
fn tee_keeps_the_log_of_the_attempt_that_failed() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let (code, err) = launch(&[
        "--cpu",
        "--num-processes",
        "2",
        "--main-process-port",
        "0",
        "--max-restarts",
        "1",
        "--tee",
        logs.to_str().unwrap(),
        "sh",
        "-c",
        "echo \"rank $RANK attempt $ACCELERATE_RESTART_COUNT\"; \
         if [ \"$RANK$ACCELERATE_RESTART_COUNT\" = 10 ]; then echo crash-reason >&2; exit 3; fi",
    ]);
    assert_eq!(code, 0, "{err}");
    let log = std::fs::read_to_string(logs.join("rank_1.log")).unwrap();
    let first = log.find("rank 1 attempt 0").expect(&log);
    let crash = log.find("crash-reason").expect(&log);
    let header = log.find("restart 1").expect(&log);
    let second = log.find("rank 1 attempt 1").expect(&log);
    assert!(first < header && crash < header && header < second, "{log}");
}

#[test]
fn quiet_still_shows_the_stderr_of_the_rank_that_failed() {
    let (code, err) = launch(&[
        "--cpu",
        "--num-processes",
        "2",
        "--main-process-port",
        "0",
        "--quiet",
        "sh",
        "-c",
        "if [ \"$RANK\" = 1 ]; then echo \"the reason rank $RANK failed\" >&2; exit 3; fi",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("the reason rank 1 failed"), "{err}");
}

#[test]
fn the_open_file_limit_is_raised_to_the_hard_limit_for_launcher_and_workers() {
    // The launcher starts with a low soft limit; its worker checks that it got the hard one.
    let o = command("sh")
        .args([
            "-c",
            "ulimit -Sn 256 && exec \"$0\" --cpu --num-processes 1 --main-process-port 0 sh -c \
             'echo \"soft $(ulimit -Sn) hard $(ulimit -Hn)\"'",
            env!("CARGO_BIN_EXE_accelerate-launch"),
        ])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let fields: Vec<&str> = out.split_whitespace().collect();
    let soft = fields.iter().position(|f| *f == "soft").expect(&out);
    let hard = fields.iter().position(|f| *f == "hard").expect(&out);
    assert_eq!(fields[soft + 1], fields[hard + 1], "{out}");
    assert_ne!(fields[soft + 1], "256", "{out}");
}

/// Shell code that sets `gone` to 1 when the process whose pid is in file `$1` no longer runs (no
/// such process, or a zombie waiting for its reaper), to 0 otherwise.
const GONE_CHECK: &str = "state=$(cut -d' ' -f3 /proc/$(cat \"$1\")/stat 2>/dev/null); \
     if [ -z \"$state\" ] || [ \"$state\" = Z ] || [ \"$state\" = X ]; then gone=1; else gone=0; fi";

#[test]
fn a_grandchild_of_a_worker_that_already_exited_is_gone_before_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    // Attempt 0: rank 1 starts a sleeping grandchild (which would hold the GPU memory and ports
    // it inherited), writes its pid and exits 0; then rank 0 fails. Attempt 1: rank 0 records
    // whether that grandchild still runs. The teardown of attempt 0 must reach the grandchild
    // although its parent had already exited.
    let script = format!(
        "set -- {d}/grandchild; \
         if [ \"$ACCELERATE_RESTART_COUNT\" = 1 ]; then \
           if [ \"$RANK\" = 0 ]; then {GONE_CHECK}; echo $gone > {d}/gone; fi; exit 0; fi; \
         if [ \"$RANK\" = 1 ]; then sleep 1000 & echo $! > {d}/pid.tmp; mv {d}/pid.tmp \"$1\"; \
           exit 0; fi; \
         while [ ! -e \"$1\" ]; do sleep 0.02; done; exit 3"
    );
    let (code, err) = launch(&[
        "--cpu",
        "--num-processes",
        "2",
        "--main-process-port",
        "0",
        "--max-restarts",
        "1",
        "--grace-period",
        "5",
        "sh",
        "-c",
        &script,
    ]);
    let pid = std::fs::read_to_string(dir.path().join("grandchild")).unwrap_or_default();
    // Whatever the outcome, leave no sleeping process behind.
    if let Ok(pid) = pid.trim().parse::<i32>() {
        // SAFETY: a signal to the test's own grandchild, identified by the pid it wrote.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    assert_eq!(code, 0, "{err}");
    let gone = std::fs::read_to_string(dir.path().join("gone")).unwrap();
    assert_eq!(
        gone.trim(),
        "1",
        "grandchild {} of rank 1 still ran in the restart: {err}",
        pid.trim()
    );
}

#[test]
fn a_grandchild_left_by_a_successful_job_is_gone_when_the_launcher_exits() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let script = format!(
        "if [ \"$RANK\" = 1 ]; then sleep 1000 & echo $! > {d}/pid.tmp; \
           mv {d}/pid.tmp {d}/grandchild; fi; exit 0"
    );
    let (code, err) = launch(&[
        "--cpu",
        "--num-processes",
        "2",
        "--main-process-port",
        "0",
        "--grace-period",
        "5",
        "sh",
        "-c",
        &script,
    ]);
    let pid = std::fs::read_to_string(dir.path().join("grandchild")).unwrap();
    let o = command("sh")
        .args([
            "-c",
            &format!("{GONE_CHECK}; echo $gone"),
            "sh",
            dir.path().join("grandchild").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    if let Ok(pid) = pid.trim().parse::<i32>() {
        // SAFETY: a signal to the test's own grandchild, identified by the pid it wrote.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "1",
        "grandchild {} of rank 1 outlived the launcher",
        pid.trim()
    );
}

#[test]
fn machine_1_waits_for_machine_0_whose_rank_0_works_alone_past_the_silence_limit() {
    // Two launchers on loopback as machines 0 and 1, one rank each. Rank 1 ends at once; rank 0
    // works on alone (a final save, an evaluation) four times as long as the limit after which a
    // launcher without any sign of life counts as gone. Machine 0's launcher is alive all along:
    // machine 1 must wait for its verdict and exit 0 with it, not call it stuck.
    let dir = tempfile::tempdir().unwrap();
    let done = dir.path().join("rank0-done");
    let script = format!(
        "if [ \"$RANK\" = 0 ]; then sleep 8; touch {}; fi; exit 0",
        done.display()
    );
    let port = free_port().to_string();
    let start = |machine: &str| {
        launcher()
            .env("ACCELERATE_JOB_TOKEN", "machines-on-loopback")
            .env("ACCELERATE_COLLECTIVE_TIMEOUT", "2")
            .args([
                "--cpu",
                "--num-processes",
                "2",
                "--num-machines",
                "2",
                "--machine-rank",
                machine,
                "--main-process-ip",
                "127.0.0.1",
                "--main-process-port",
                &port,
                "sh",
                "-c",
                &script,
            ])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let machine0 = start("0");
    let machine1 = start("1");
    let o1 = machine1.wait_with_output().unwrap();
    let o0 = machine0.wait_with_output().unwrap();
    let err1 = String::from_utf8_lossy(&o1.stderr);
    let err0 = String::from_utf8_lossy(&o0.stderr);
    assert_eq!(o0.status.code(), Some(0), "machine 0: {err0}");
    assert!(done.exists(), "rank 0 did not finish its work: {err0}");
    assert_eq!(o1.status.code(), Some(0), "machine 1: {err1}");
}
