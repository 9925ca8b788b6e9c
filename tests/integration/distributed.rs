//! Multi-process tests: the real launcher starting real worker processes on this machine.
//!
//! Equivalence is checked against a single process (no launcher) with an N·K times larger batch
//! over the same samples; collectives against values computed in closed form.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use accelerate_tests::{
    alive, children_by_rank, free_port, load_flat, max_abs_diff_flat, output_text, send_signal,
    small_mlp_args, Job, JobOutput,
};

const LIMIT: Duration = Duration::from_secs(240);

/// The test worker running `scenario` on `n` CPU ranks under the launcher.
fn worker(n: usize, scenario: &str) -> Job {
    Job::worker().ranks(n).arg(scenario).limit(LIMIT)
}

/// Common arguments: a small model, shuffled, no progress noise.
fn mlp_args(samples: usize, batch: usize, optimizer: &str, out: &Path) -> Vec<String> {
    small_mlp_args(samples, batch, optimizer, 11, out)
}

/// Runs the mlp with `args` on `n` CPU ranks under the launcher, which gets `launcher_flags`.
fn launch(n: usize, launcher_flags: &[&str], args: &[String]) -> JobOutput {
    Job::example("mlp")
        .ranks(n)
        .launcher_flags(launcher_flags)
        .args(args)
        .limit(LIMIT)
        .run()
}

/// How a distributed run is given its ZeRO stage.
#[derive(Debug, Clone, Copy)]
enum Zero {
    /// Not at all: plain data parallel, stage 0.
    Unset,
    /// `accelerate-launch <flag> <stage>`, exported to the workers as `ACCELERATE_ZERO_STAGE`.
    Launcher(&'static str, u8),
    /// The example's own `--zero-stage <stage>`.
    Program(u8),
}

/// `n` ranks under the launcher with micro-batches of 4 and K = 1, 2, 4 end with the weights of
/// one process (stage 0, no launcher) with batches of 4·n·K, whatever ZeRO stage the ranks run.
fn equivalence(n: usize, optimizer: &str, tolerance: f32, zero: Zero) {
    let (launcher_flags, program_flags, stage) = match zero {
        Zero::Unset => (vec![], vec![], 0),
        Zero::Launcher(flag, stage) => (vec![flag.to_string(), stage.to_string()], vec![], stage),
        Zero::Program(stage) => (
            vec![],
            vec!["--zero-stage".into(), stage.to_string()],
            stage,
        ),
    };
    let launcher_flags: Vec<&str> = launcher_flags.iter().map(String::as_str).collect();
    let dir = tempfile::tempdir().unwrap();
    for k in [1usize, 2, 4] {
        let b = 4;
        // Five windows per epoch, two epochs: 10 optimizer steps over whole global batches.
        let samples = 5 * n * k * b;
        let dist_out = dir.path().join(format!("dist_{n}_{k}.safetensors"));
        let mut args = mlp_args(samples, b, optimizer, &dist_out);
        args.extend(["--grad-accum".to_string(), k.to_string()]);
        args.extend(program_flags.iter().cloned());
        let o = launch(n, &launcher_flags, &args);
        assert!(o.status.success(), "{}", output_text(&o));
        assert_eq!(o.summary::<u64>("steps"), 10, "{}", output_text(&o));
        // The stage the ranks trained under, as the Accelerator reports it: the switch reached
        // them.
        assert_eq!(o.summary::<u8>("zero_stage"), stage, "{}", output_text(&o));

        let single_out = dir.path().join(format!("single_{n}_{k}.safetensors"));
        let s = Job::mlp(1)
            .limit(LIMIT)
            .args(mlp_args(samples, n * k * b, optimizer, &single_out))
            .run();
        assert!(s.status.success(), "{}", output_text(&s));
        assert_eq!(s.summary::<u64>("steps"), 10);
        assert_eq!(s.summary::<u8>("zero_stage"), 0);

        let d = max_abs_diff_flat(&load_flat(&dist_out), &load_flat(&single_out));
        assert!(
            d < tolerance,
            "{n} ranks, K={k}, {optimizer}, {zero:?}: max |Δθ| = {d}"
        );
        // The runs did move the weights: the comparison could have failed.
        let init_out = dir.path().join("init.safetensors");
        let mut a = mlp_args(samples, b, optimizer, &init_out);
        a.extend(["--max-steps".into(), "0".into()]);
        assert!(Job::mlp(1).limit(LIMIT).args(a).run().status.success());
        assert!(
            max_abs_diff_flat(&load_flat(&init_out), &load_flat(&single_out)) > 100.0 * tolerance
        );
    }
}

#[test]
fn two_ranks_equal_one_process_with_sgd_momentum() {
    equivalence(2, "sgd", 2e-5, Zero::Unset);
}

#[test]
fn three_ranks_equal_one_process_with_sgd_momentum() {
    equivalence(3, "sgd", 2e-5, Zero::Unset);
}

#[test]
fn two_ranks_equal_one_process_with_adamw() {
    equivalence(2, "adamw", 1e-4, Zero::Unset);
}

#[test]
fn three_ranks_equal_one_process_with_adamw() {
    equivalence(3, "adamw", 1e-4, Zero::Unset);
}

#[test]
fn two_ranks_under_zero_1_equal_one_process_with_sgd_momentum() {
    equivalence(2, "sgd", 2e-5, Zero::Launcher("--zero-stage", 1));
}

#[test]
fn three_ranks_under_zero_1_equal_one_process_with_sgd_momentum() {
    equivalence(3, "sgd", 2e-5, Zero::Launcher("--zero-stage", 1));
}

#[test]
fn two_ranks_under_zero_1_equal_one_process_with_adamw() {
    equivalence(2, "adamw", 1e-4, Zero::Launcher("--zero-stage", 1));
}

#[test]
fn three_ranks_under_zero_1_equal_one_process_with_adamw() {
    equivalence(3, "adamw", 1e-4, Zero::Launcher("--zero-stage", 1));
}

#[test]
fn two_ranks_under_zero_2_equal_one_process_with_sgd_momentum() {
    equivalence(2, "sgd", 2e-5, Zero::Launcher("--zero_stage", 2));
}

#[test]
fn three_ranks_under_zero_2_equal_one_process_with_sgd_momentum() {
    equivalence(3, "sgd", 2e-5, Zero::Launcher("--zero_stage", 2));
}

#[test]
fn two_ranks_under_zero_2_equal_one_process_with_adamw() {
    equivalence(2, "adamw", 1e-4, Zero::Launcher("--zero_stage", 2));
}

#[test]
fn three_ranks_under_zero_2_equal_one_process_with_adamw() {
    equivalence(3, "adamw", 1e-4, Zero::Launcher("--zero_stage", 2));
}

#[test]
fn the_examples_own_zero_stage_flag_sets_the_stage_as_the_launchers_does() {
    equivalence(2, "adamw", 1e-4, Zero::Program(1));
}

#[test]
fn gradients_are_reduced_once_per_bucket_per_optimizer_step() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.safetensors");
    let mut args = mlp_args(2 * 4 * 4 * 5, 4, "sgd", &out);
    args.extend(["--grad-accum".to_string(), "4".to_string()]);
    // A 10 KiB cap splits the sorted parameters of the H=16 model into three buckets:
    // [l1.bias] (64 B; l1.weight would overflow it), [l1.weight] (50,176 B, alone), and
    // [l2.bias, l2.weight, l3.bias, l3.weight] (64 + 1,024 + 40 + 640 B).
    let o = Job::mlp(2)
        .limit(LIMIT)
        .args(&args)
        .env("ACCELERATE_BUCKET_CAP_MB", format!("{}", 10.0 / 1024.0))
        .run();
    assert!(o.status.success(), "{}", output_text(&o));
    let (steps, micro) = (o.summary::<u64>("steps"), o.summary::<u64>("micro_steps"));
    assert_eq!((steps, micro), (10, 40), "{}", output_text(&o));
    assert_eq!(o.summary::<u64>("buckets"), 3);
    assert_eq!(o.summary::<u64>("grad_all_reduces"), steps * 3);
    let params = 16 * 784 + 16 + 16 * 16 + 16 + 10 * 16 + 10;
    // Plus, per step, the f32 flag that travels with the last bucket (whether any rank missed a
    // gradient).
    assert_eq!(o.summary::<u64>("grad_bytes"), steps * (params + 1) * 4);
}

#[test]
fn non_sync_micro_steps_send_nothing() {
    for n in [2, 3] {
        let o = worker(n, "nosync").run();
        assert!(o.status.success(), "{n} ranks: {}", output_text(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("result: ok"),
            "{}",
            output_text(&o)
        );
    }
}

#[test]
fn a_partial_last_window_on_two_ranks_equals_the_short_last_batch() {
    // 80 samples, 2 ranks x micro-batches of 4: 10 micro-steps per rank and epoch, so with K = 4
    // the windows hold 4, 4 and 2 micro-steps; one process with batch 32 sees 32, 32 and 16.
    let dir = tempfile::tempdir().unwrap();
    let dist_out = dir.path().join("dist.safetensors");
    let mut args = mlp_args(80, 4, "sgd", &dist_out);
    args.extend(["--grad-accum".to_string(), "4".to_string()]);
    let o = launch(2, &[], &args);
    assert!(o.status.success(), "{}", output_text(&o));
    assert_eq!(o.summary::<u64>("steps"), 6, "{}", output_text(&o));
    let single_out = dir.path().join("single.safetensors");
    let s = Job::mlp(1)
        .limit(LIMIT)
        .args(mlp_args(80, 32, "sgd", &single_out))
        .run();
    assert!(s.status.success(), "{}", output_text(&s));
    let d = max_abs_diff_flat(&load_flat(&dist_out), &load_flat(&single_out));
    assert!(d < 2e-5, "max |Δθ| = {d}");
}

#[test]
fn gather_for_metrics_returns_each_sample_once() {
    for (n, samples, batch, shuffle) in [(2, 10, 3, 1), (3, 10, 3, 0), (2, 9, 4, 1), (3, 2, 4, 1)] {
        let o = worker(n, "gather")
            .args([samples, batch, shuffle].map(|v| v.to_string()))
            .run();
        assert!(o.status.success(), "{}", output_text(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        let line = out
            .lines()
            .find_map(|l| l.split("result: ").nth(1))
            .expect("result line");
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let mut got: Vec<usize> = v["gathered"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as usize)
            .collect();
        // The raw gather really held duplicates, so something had to be dropped.
        assert!(v["raw_rows"].as_u64().unwrap() as usize > samples, "{line}");
        got.sort();
        assert_eq!(
            got,
            (0..samples).collect::<Vec<_>>(),
            "{n} ranks, {samples} samples, batch {batch}"
        );
    }
}

#[test]
fn collectives_match_closed_forms_on_two_and_three_ranks() {
    for n in [2, 3] {
        let o = worker(n, "collectives").run();
        assert!(o.status.success(), "{}", output_text(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("result: ok"),
            "{}",
            output_text(&o)
        );
    }
}

#[test]
fn ring_all_reduce_between_processes_for_world_sizes_one_to_five() {
    for n in 1..=5 {
        let o = worker(n, "allreduce").run();
        assert!(o.status.success(), "{n} ranks: {}", output_text(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("result: ok"),
            "{}",
            output_text(&o)
        );
    }
}

#[test]
fn workers_started_like_torchrun_find_each_other_without_the_launcher() {
    // torchrun's own store would sit on MASTER_PORT; rank 0 hosts ours on MASTER_PORT + 1.
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let dist_out = dir.path().join("torchrun.safetensors");
    let mut children: Vec<_> = (0..2)
        .map(|rank| {
            let mut args = mlp_args(80, 4, "sgd", &dist_out);
            args.extend(["--grad-accum".to_string(), "2".to_string()]);
            Job::mlp(1)
                .limit(LIMIT)
                .args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", (port - 1).to_string())
                .command()
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + LIMIT;
    for child in &mut children {
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "a torchrun-style worker failed: {status}");
                break;
            }
            assert!(Instant::now() < deadline, "torchrun-style workers hung");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let single_out = dir.path().join("single.safetensors");
    assert!(Job::mlp(1)
        .limit(LIMIT)
        .args(mlp_args(80, 16, "sgd", &single_out))
        .run()
        .status
        .success());
    let d = max_abs_diff_flat(&load_flat(&dist_out), &load_flat(&single_out));
    assert!(d < 2e-5, "max |Δθ| = {d}");
}

#[test]
fn two_launchers_as_two_machines_equal_one_process() {
    // Machine ranks 0 and 1 on this host, two processes each: the multi-machine path (store bound
    // to every interface, the token shared through the environment) with four ranks.
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let dist_out = dir.path().join("two_machines.safetensors");
    let mut args = mlp_args(160, 4, "sgd", &dist_out);
    args.extend(["--grad-accum".to_string(), "2".to_string()]);
    let machines: Vec<_> = (0..2)
        .map(|machine| {
            let job = Job::example("mlp")
                .limit(LIMIT)
                .launcher_flags(["--cpu", "--num-processes", "4", "--num-machines", "2"])
                .launcher_flags([
                    "--machine-rank",
                    &machine.to_string(),
                    "--main-process-ip",
                    "127.0.0.1",
                ])
                .launcher_flags(["--main-process-port", &port.to_string()])
                .args(&args)
                .env("ACCELERATE_JOB_TOKEN", "shared-secret-of-this-test");
            std::thread::spawn(move || job.run())
        })
        .collect();
    for m in machines {
        let o = m.join().unwrap();
        assert!(o.status.success(), "{}", output_text(&o));
    }
    let single_out = dir.path().join("single.safetensors");
    assert!(Job::mlp(1)
        .limit(LIMIT)
        .args(mlp_args(160, 32, "sgd", &single_out))
        .run()
        .status
        .success());
    let d = max_abs_diff_flat(&load_flat(&dist_out), &load_flat(&single_out));
    assert!(d < 2e-5, "max |Δθ| = {d}");
}

#[test]
fn a_multi_machine_job_without_a_shared_token_is_refused() {
    // The job environment, ACCELERATE_JOB_TOKEN included, is never inherited.
    let o = Job::new("true")
        .launcher_flags([
            "--cpu",
            "--num-processes",
            "2",
            "--num-machines",
            "2",
            "--main-process-ip",
            "127.0.0.1",
        ])
        .limit(LIMIT)
        .run();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        output_text(&o).contains("ACCELERATE_JOB_TOKEN"),
        "{}",
        output_text(&o)
    );
}

#[test]
fn max_restarts_starts_a_new_round_after_a_failure() {
    let o = worker(2, "flaky")
        .launcher_flags(["--max-restarts", "1"])
        .launcher_flags(["--grace-period", "1"])
        .run();
    assert!(o.status.success(), "{}", output_text(&o));
    let all = output_text(&o);
    assert!(
        all.contains("rank 1") && all.contains("exited with code 3"),
        "{all}"
    );
    assert!(
        all.contains("restarting every rank (restart 1 of 1)"),
        "{all}"
    );
    assert!(all.contains("result: ok"), "{all}");

    let o = worker(2, "flaky")
        .launcher_flags(["--grace-period", "1"])
        .run();
    assert_eq!(o.status.code(), Some(1), "{}", output_text(&o));
}

/// Starts a 2-rank mlp job that would train for a very long time and waits until both workers
/// run; returns the launcher and the workers' (rank, pid).
fn start_endless_two_rank_job(dir: &Path) -> (std::process::Child, Vec<(usize, u32)>) {
    let out = dir.join("never.safetensors");
    let mut args = mlp_args(4096, 8, "sgd", &out);
    let at = args.iter().position(|a| a == "--epochs").unwrap();
    args[at + 1] = "1000".into();
    let mut child = Job::mlp(2)
        .limit(LIMIT)
        .args(&args)
        .command()
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let w = children_by_rank(child.id());
        if w.len() == 2 {
            return (child, w);
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the launcher ended early with {status}");
        }
        assert!(Instant::now() < deadline, "workers did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_to_the_launcher_reaches_every_worker() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, workers) = start_endless_two_rank_job(dir.path());
    send_signal(child.id(), "TERM");
    let sent = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if sent.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the launcher did not stop within 60 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(128 + 15));
    for (rank, pid) in workers {
        assert!(!alive(pid), "rank {rank} (pid {pid}) outlived the launcher");
    }
}

#[test]
fn different_parameters_on_different_ranks_are_refused() {
    let o = worker(2, "mismatch").run();
    assert!(!o.status.success());
    let all = output_text(&o);
    assert!(
        all.contains("rank 1 has different parameters than rank 0"),
        "{all}"
    );
    assert!(
        all.contains("\"l1.bias [3] F32\", rank 1 has \"l1.bias [2] F32\""),
        "{all}"
    );
}

#[test]
fn a_killed_rank_stops_the_job_and_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, workers) = start_endless_two_rank_job(dir.path());
    // Let training begin (the rendezvous is over once parameters were broadcast).
    std::thread::sleep(Duration::from_secs(2));
    let victim = workers.iter().find(|(r, _)| *r == 1).unwrap().1;
    send_signal(victim, "KILL");
    let killed_at = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        // "Within seconds": SIGTERM to the survivor, SIGKILL after the 5 s grace at worst.
        if killed_at.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("the launcher did not stop within 20 s of a rank being killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(!status.success());
    assert!(
        stderr.contains(&format!(
            "rank 1 (pid {victim}) was killed by signal 9 (SIGKILL)"
        )),
        "{stderr}"
    );
    for (rank, pid) in workers {
        assert!(!alive(pid), "rank {rank} (pid {pid}) outlived the launcher");
    }
}

#[test]
fn a_single_process_opens_no_socket() {
    // strace records every network system call of the program and its threads.
    if Command::new("strace").arg("-V").output().is_err() {
        eprintln!("SKIPPED: strace is not installed (.ci/run installs it)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace");
    let out = dir.path().join("m.safetensors");
    let o = Job::new("strace")
        .args(["-f", "-e", "trace=socket,connect,bind,listen", "-o"])
        .arg(&trace)
        .arg(accelerate_tests::built_binary("examples/mlp"))
        .args(mlp_args(64, 8, "sgd", &out))
        .limit(LIMIT)
        .run();
    assert!(o.status.success(), "{}", output_text(&o));
    let calls = std::fs::read_to_string(&trace).unwrap();
    let network: Vec<&str> = calls
        .lines()
        .filter(|l| {
            ["socket(", "connect(", "bind(", "listen("]
                .iter()
                .any(|c| l.contains(c))
        })
        .collect();
    assert!(network.is_empty(), "network calls: {network:?}");
}

#[test]
fn a_rank_busy_alone_for_longer_than_the_silence_limit_does_not_fail_the_job() {
    // Rank 0 works inside main_process_first for 4 s, four times the silence limit, while rank 1
    // waits in its barrier: rank 0 is alive, so rank 1 keeps waiting (up to the busy limit).
    for transport in ["tcp", "shm"] {
        let o = worker(2, "busy-first")
            .arg("4000")
            .env("ACCELERATE_COLLECTIVE_TIMEOUT", "1")
            .env("ACCELERATE_CPU_TRANSPORT", transport)
            .run();
        assert!(o.status.success(), "over {transport}: {}", output_text(&o));
        // 1 + 2: both ranks took part in the all-reduce after the busy stretch.
        assert!(
            String::from_utf8_lossy(&o.stdout).contains(r#"result: {"sum":3.0}"#),
            "over {transport}: {}",
            output_text(&o)
        );
    }
}

#[test]
fn a_killed_rank_fails_the_waiting_ranks_promptly_even_while_another_is_busy() {
    // Three ranks started like torchrun (no launcher to tear the job down): one is SIGKILLed,
    // one stays alive outside any collective, one waits in an all-reduce on the busy one (its
    // ring predecessor over TCP; its first peer over shared memory). The waiting rank must fail
    // well before the busy limit (30 min by default) and name the killed rank.
    for (transport, waiting, busy) in [("tcp", 1usize, 0usize), ("shm", 0, 1)] {
        let dead = 2;
        let port = free_port();
        let mut children: Vec<_> = (0..3)
            .map(|rank| {
                Job::worker()
                    .args(["dead-peer", &busy.to_string(), &dead.to_string()])
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", "3")
                    .env("LOCAL_RANK", rank.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", (port - 1).to_string())
                    .env("ACCELERATE_CPU_TRANSPORT", transport)
                    .command()
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        // Bounded far below the busy and silence limits: a survivor that waited on the busy
        // rank instead would still be running.
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = children[waiting].try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        for child in &mut children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let mut stderr = String::new();
        use std::io::Read;
        children[waiting]
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        let status = status.unwrap_or_else(|| {
            panic!("over {transport}, rank {waiting} still waited after 60 s:\n{stderr}")
        });
        assert!(!status.success(), "over {transport}:\n{stderr}");
        assert!(
            stderr.contains("collective all_reduce failed with rank 2")
                && stderr.contains("rank 2 died")
                && stderr.contains("all_reduce #"),
            "over {transport}, rank {waiting} did not name the killed rank:\n{stderr}"
        );
    }
}

#[test]
fn a_flag_given_to_one_machine_only_is_named_when_the_ranks_part_ways() {
    // Two launchers as two machines of one process each; only machine 0 gets --save-model, so
    // only rank 0 waits in save_model's agreement on the outcome while rank 1 finishes and
    // leaves.
    for transport in ["tcp", "shm"] {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model.safetensors");
        let machines: Vec<_> = (0..2)
            .map(|machine| {
                let mut args = small_mlp_args(32, 4, "sgd", 11, &dir.path().join("unused"));
                // small_mlp_args saves a model; keep that flag on machine 0 only.
                let at = args.iter().position(|a| a == "--save-model").unwrap();
                args.drain(at..at + 2);
                if machine == 0 {
                    args.extend(["--save-model".into(), model.to_str().unwrap().to_string()]);
                }
                let job = Job::example("mlp")
                    .limit(LIMIT)
                    .launcher_flags(["--cpu", "--num-processes", "2", "--num-machines", "2"])
                    .launcher_flags(["--machine-rank", &machine.to_string()])
                    .launcher_flags(["--main-process-ip", "127.0.0.1"])
                    .launcher_flags(["--main-process-port", &port.to_string()])
                    .args(&args)
                    .env("ACCELERATE_JOB_TOKEN", "shared-secret-of-this-test")
                    .env("ACCELERATE_CPU_TRANSPORT", transport);
                std::thread::spawn(move || job.run())
            })
            .collect();
        let outputs: Vec<_> = machines.into_iter().map(|m| m.join().unwrap()).collect();
        let machine0 = output_text(&outputs[0]);
        assert!(
            !outputs[0].status.success(),
            "over {transport}:\n{machine0}"
        );
        assert!(
            machine0.contains("rank 1")
                && machine0.contains("during all_gather #")
                && machine0.contains(&format!(
                    "rank 0 with `--save-model {}`, rank 1 without it",
                    model.display()
                )),
            "over {transport}, the error does not name the differing flag:\n{machine0}"
        );
    }
}

#[test]
fn data_loaders_that_differ_between_ranks_are_refused_naming_the_setting() {
    // Rank 1's loader differs from rank 0's in one setting; prepare must fail on both ranks,
    // naming the setting, both values and the ranks, instead of a hang or a mixed-up training.
    for (setting, expected) in [
        ("seed", "seed is 3 (rank 0) vs 4 (rank 1)"),
        ("length", "dataset length is 24 (rank 0) vs 20 (rank 1)"),
        ("batch", "batch size is 4 (rank 0) vs 3 (rank 1)"),
        ("shuffle", "shuffle is true (rank 0) vs false (rank 1)"),
        ("drop-last", "drop_last is false (rank 0) vs true (rank 1)"),
    ] {
        let o = worker(2, "loader-mismatch").arg(setting).run();
        assert!(!o.status.success(), "{setting}: {}", output_text(&o));
        let all = output_text(&o);
        assert!(
            all.contains(&format!(
                "the data loader #1 (in order of preparation) differs between the ranks: \
                 {expected}. "
            )),
            "{setting}: {all}"
        );
        assert!(!all.contains("prepare accepted"), "{setting}: {all}");
    }
}

#[test]
fn gather_for_metrics_after_the_loop_keeps_every_row() {
    // 7 samples, batches of 3, 2 ranks: each rank gets 2 batches (6 rows), the last round holds
    // 1 real sample. Inside the loop the duplicates are dropped; after it, as in Accelerate, a
    // gather of one row per rank keeps both rows, with `iter()` and with `windows()`.
    let o = worker(2, "gather-after-loop").run();
    assert!(o.status.success(), "{}", output_text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out
        .lines()
        .find_map(|l| l.split("result: ").nth(1))
        .expect("result line");
    let epochs: serde_json::Value = serde_json::from_str(line).unwrap();
    let expected = serde_json::json!({
        "in_loop": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        "after_loop": [6.0, 6.0],
    });
    assert_eq!(epochs, serde_json::json!([expected, expected]), "{line}");
}

/// Parameters that get no gradient on some ranks, or on all: with 2 ranks they must train as one
/// process on the whole batch does (`Accelerator::backward`'s semantics of missing gradients).
mod missing_gradients {
    use accelerate_core::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
    use accelerate_core::Accelerator;
    use accelerate_tests::{ranks_as_threads, snapshot, ReferenceOptimizer};
    use candle_core::{Device, Tensor, Var};

    /// Samples for the unused-parameter test: 4 features, a target, and whether the sample takes the
    /// side path through `u` (see `routed_loss`). Steps of 8 samples; step 0's side-path samples are
    /// all in rank 0's half, step 1 has none, step 2 has some in both halves, step 3 only in rank 1's.
    fn routed_data() -> (Tensor, Tensor, Tensor) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        let side: [&[usize]; 4] = [&[1, 2], &[], &[0, 6], &[5]];
        let n = 8 * side.len();
        let x: Vec<f32> = (0..n * 4).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let t: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let c: Vec<f32> = (0..n)
            .map(|i| f32::from(u8::from(side[i / 8].contains(&(i % 8)))))
            .collect();
        let cpu = &Device::Cpu;
        (
            Tensor::from_vec(x, (n, 4), cpu).unwrap(),
            Tensor::from_vec(t, (n, 1), cpu).unwrap(),
            Tensor::from_vec(c, (n, 1), cpu).unwrap(),
        )
    }

    /// Mean squared error of `x·w + c·(x·u)`; `u` enters the graph only if some sample of the batch
    /// takes the side path (as a routed layer would), `z` never.
    fn routed_loss(params: &[(String, Var)], x: &Tensor, t: &Tensor, c: &Tensor) -> Tensor {
        let get = |name: &str| &params.iter().find(|(n, _)| n == name).unwrap().1;
        let mut pred = x.matmul(get("w").as_tensor()).unwrap();
        if c.sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0 {
            let side = (x.matmul(get("u").as_tensor()).unwrap() * c).unwrap();
            pred = (pred + side).unwrap();
        }
        (pred - t).unwrap().sqr().unwrap().mean_all().unwrap()
    }

    fn routed_params() -> Vec<(String, Var)> {
        let cpu = &Device::Cpu;
        let var = |values: Vec<f32>, shape: (usize, usize)| {
            Var::from_tensor(&Tensor::from_vec(values, shape, cpu).unwrap()).unwrap()
        };
        vec![
            ("u".into(), var(vec![0.3, -0.1, 0.2, 0.4], (4, 1))),
            ("w".into(), var(vec![0.1, 0.2, -0.3, 0.05], (4, 1))),
            ("z".into(), var(vec![0.5, -0.5, 0.25], (3, 1))),
        ]
    }

    #[test]
    fn parameters_without_gradients_on_some_or_all_ranks_train_as_on_one_process() {
        let (x, t, c) = routed_data();
        let steps = x.dim(0).unwrap() / 8;
        // Under ZeRO stage 2 the missing flag does not travel with a bucket (each rank keeps only
        // its block): the ranks agree on it in the verdict after the reduce-scatter instead.
        for (adamw, stage) in [false, true]
            .into_iter()
            .flat_map(|a| [(a, 0u8), (a, 1), (a, 2)])
        {
            // 2 ranks x K=2 micro-batches of 2: rank r's micro-step j of step s takes samples
            // 8s + 4r + 2j and the next.
            let ours = ranks_as_threads(
                2,
                || {
                    Accelerator::builder()
                        .gradient_accumulation_steps(2)
                        .zero_stage(stage)
                },
                |mut acc| {
                    let params = acc.prepare(routed_params()).unwrap();
                    let mut opt: Box<dyn FnMut()> = if adamw {
                        let cfg = AdamWConfig {
                            lr: 0.05,
                            weight_decay: 0.1,
                            ..AdamWConfig::default()
                        };
                        let mut o = acc
                            .prepare(AdamW::new(params.clone(), cfg).unwrap())
                            .unwrap();
                        Box::new(move || {
                            o.step().unwrap();
                            o.zero_grad();
                        })
                    } else {
                        let cfg = SgdConfig {
                            lr: 0.1,
                            momentum: 0.9,
                            ..SgdConfig::default()
                        };
                        let mut o = acc.prepare(Sgd::new(params.clone(), cfg).unwrap()).unwrap();
                        Box::new(move || {
                            o.step().unwrap();
                            o.zero_grad();
                        })
                    };
                    let mut had_gradient = Vec::new();
                    for s in 0..steps {
                        for j in 0..2 {
                            let start = 8 * s + 4 * acc.process_index() + 2 * j;
                            let part = |v: &Tensor| v.narrow(0, start, 2).unwrap();
                            let _step = acc.accumulate();
                            let loss = routed_loss(&params, &part(&x), &part(&t), &part(&c));
                            acc.backward(&loss).unwrap();
                            if j == 1 {
                                // At stage 2 a gradient that exists is whole on no rank: asking
                                // for it is an error, and asking for one that does not exist
                                // is not.
                                let has = |name: &str| match acc.model().gradient(name) {
                                    Ok(g) => g.is_some(),
                                    Err(e) if stage == 2 => {
                                        assert!(e.to_string().contains("zero_stage(1)"), "{e}");
                                        true
                                    }
                                    Err(e) => panic!("{e}"),
                                };
                                had_gradient.push([has("u"), has("z")]);
                            }
                            opt();
                        }
                    }
                    (snapshot(&params), had_gradient)
                },
            );
            // Reference: one process, plain candle, the 8 samples of each step in one batch.
            let reference = routed_params();
            let mut optimizer = if adamw {
                ReferenceOptimizer::adamw(0.05, 0.1)
            } else {
                ReferenceOptimizer::sgd(0.1, 0.9)
            };
            for s in 0..steps {
                let part = |v: &Tensor| v.narrow(0, 8 * s, 8).unwrap();
                let loss = routed_loss(&reference, &part(&x), &part(&t), &part(&c));
                optimizer
                    .step(&reference, &loss.backward().unwrap())
                    .unwrap();
            }
            let expected = snapshot(&reference);
            let initial = snapshot(&routed_params());
            for (rank, (got, had_gradient)) in ours.iter().enumerate() {
                let d = got
                    .iter()
                    .flatten()
                    .zip(expected.iter().flatten())
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                assert!(
                    d < 1e-5,
                    "rank {rank}, adamw {adamw}, stage {stage}: max |Δθ| = {d}"
                );
                assert_eq!(
                    got[2], initial[2],
                    "rank {rank}: z must not move (adamw {adamw})"
                );
                // On both ranks: u had a gradient in the steps where some rank used it, z never.
                let expected_presence =
                    [[true, false], [false, false], [true, false], [true, false]];
                assert_eq!(had_gradient, &expected_presence, "rank {rank}");
            }
            // The comparison could fail: u and w really trained.
            assert!(expected[0] != initial[0] && expected[1] != initial[1]);
        }
    }
}
