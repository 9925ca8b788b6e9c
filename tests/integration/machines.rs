//! Two machines over a real link: two network namespaces joined by a veth pair, one
//! `accelerate-launch` in each with `--num-machines 2`. The tests make and remove the namespaces
//! themselves (as root); where they cannot, they skip, saying why (`ACCELERATE_REQUIRE_NETNS=1`,
//! set by CI, turns the skip into a failure).
//!
//! The namespaces share this kernel, its file systems and `/dev/shm`: only the network separates
//! the two machines, as it does on a cluster. The ranks must therefore talk TCP (the transport
//! `auto` picks for ranks in different network namespaces), and machine 0's store is reached at
//! its veth address.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use accelerate_tests::{
    children_by_rank, kill_rank_once_checkpointed, load_flat, max_abs_diff_flat, output_text,
    restart_mlp_args, send_signal, skip_unless_required, small_mlp_args, Job,
};

const LIMIT: Duration = Duration::from_secs(300);
/// The two machines' addresses on the link.
const ADDRESS: [&str; 2] = ["10.231.0.1", "10.231.0.2"];
const TOKEN: &str = "the-two-machines-share-this-token";

/// Two network namespaces joined by a veth pair, removed again on drop.
struct TwoMachines {
    namespaces: [String; 2],
}

impl TwoMachines {
    /// Makes the pair, or says why it cannot.
    fn create() -> Result<Self, String> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let id = format!(
            "{}{}",
            std::process::id() % 100_000,
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        // Interface names hold at most 15 bytes.
        let machines = Self {
            namespaces: [format!("accm{id}a"), format!("accm{id}b")],
        };
        let veth = [format!("acv{id}a"), format!("acv{id}b")];
        let [a, b] = &machines.namespaces;
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        ip(&[
            "link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1],
        ])?;
        for (m, ns) in machines.namespaces.iter().enumerate() {
            ip(&["link", "set", &veth[m], "netns", ns])?;
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{}/24", ADDRESS[m]),
                "dev",
                &veth[m],
            ])?;
            ip(&["-n", ns, "link", "set", &veth[m], "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(machines)
    }

    /// `job` run on machine `machine` (inside its namespace), with the shared job token.
    fn on(&self, machine: usize, job: Job) -> Job {
        job.inside(["ip", "netns", "exec", &self.namespaces[machine]])
            .env("ACCELERATE_JOB_TOKEN", TOKEN)
    }

    /// The mlp under the launcher of machine `machine` of two, `per_machine` ranks each.
    fn mlp(&self, machine: usize, per_machine: usize, args: &[String]) -> Job {
        let total = (2 * per_machine).to_string();
        self.on(
            machine,
            Job::example("mlp")
                .limit(LIMIT)
                .launcher_flags(["--cpu", "--num-processes", &total, "--num-machines", "2"])
                .launcher_flags(["--machine-rank", &machine.to_string()])
                .launcher_flags(["--main-process-ip", ADDRESS[0], "--grace-period", "2"])
                .args(args),
        )
    }
}

impl Drop for TwoMachines {
    fn drop(&mut self) {
        // Removing a namespace removes the veth end inside it, and with it the pair.
        for ns in &self.namespaces {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let o = std::process::Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        ))
    }
}

/// The two machines, or `None` (with the reason printed) where namespaces cannot be made.
fn two_machines() -> Option<TwoMachines> {
    match TwoMachines::create() {
        Ok(m) => Some(m),
        Err(why) => {
            skip_unless_required(
                "ACCELERATE_REQUIRE_NETNS",
                format!("network namespaces cannot be made here (needs root): {why}"),
            );
            None
        }
    }
}

/// The mlp's arguments: `samples` samples, per-rank batch `batch`, K = `k`, saving to `out`.
fn mlp_args(samples: usize, batch: usize, k: usize, out: &Path) -> Vec<String> {
    let mut args = small_mlp_args(samples, batch, "sgd", 11, out);
    args.extend(["--grad-accum".into(), k.to_string()]);
    args
}

/// A job's stderr, read on a thread so that the pipe never fills.
fn spawn_with_stderr(job: Job) -> (Child, std::thread::JoinHandle<String>) {
    let mut child = job
        .command()
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = pipe.read_to_string(&mut s);
        s
    });
    (child, reader)
}

/// Waits until launcher `child` runs `n` workers.
fn wait_for_workers(child: &mut Child, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while children_by_rank(child.id()).len() < n {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the launcher ended early with {status}");
        }
        assert!(Instant::now() < deadline, "the workers did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `child` to exit, failing the test after `limit`.
fn wait_bounded(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the launcher did not end within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn two_namespaces_as_two_machines_equal_one_process_over_tcp() {
    let Some(net) = two_machines() else { return };
    let dir = tempfile::tempdir().unwrap();
    let dist_out = dir.path().join("two_machines.safetensors");
    let args = mlp_args(160, 4, 2, &dist_out);
    let runs: Vec<_> = (0..2)
        .map(|m| {
            let job = net.mlp(m, 2, &args);
            std::thread::spawn(move || job.run())
        })
        .collect();
    let outputs: Vec<_> = runs.into_iter().map(|r| r.join().unwrap()).collect();
    for o in &outputs {
        assert!(o.status.success(), "{}", o.text());
    }
    // Rank 0 (on machine 0) prints the summary: the ranks talk TCP although they share
    // /dev/shm, since they are in different networks.
    assert_eq!(outputs[0].summary::<String>("transport"), "tcp");
    let single_out = dir.path().join("single.safetensors");
    let o = Job::mlp(1)
        .limit(LIMIT)
        .args(mlp_args(160, 32, 1, &single_out))
        .run();
    assert!(o.status.success(), "{}", o.text());
    let d = max_abs_diff_flat(&load_flat(&dist_out), &load_flat(&single_out));
    assert!(d < 2e-5, "max |Δθ| = {d}");
}

/// Two machines of one rank each on a job that would train for a long time, both running.
fn endless_job(net: &TwoMachines, dir: &Path) -> Vec<(Child, std::thread::JoinHandle<String>)> {
    let mut args = mlp_args(4096, 8, 1, &dir.join("never.safetensors"));
    let at = args.iter().position(|a| a == "--epochs").unwrap();
    args[at + 1] = "1000".into();
    let mut launchers: Vec<_> = (0..2)
        .map(|m| spawn_with_stderr(net.mlp(m, 1, &args)))
        .collect();
    for (child, _) in &mut launchers {
        wait_for_workers(child, 1);
    }
    launchers
}

#[test]
fn killing_machine_1s_launcher_ends_machine_0s_naming_it() {
    let Some(net) = two_machines() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut launchers = endless_job(&net, dir.path());
    let (mut m1, m1_err) = launchers.pop().unwrap();
    let (mut m0, m0_err) = launchers.pop().unwrap();
    send_signal(m1.id(), "KILL");
    let _ = wait_bounded(&mut m1, LIMIT);
    drop(m1_err);
    let status = wait_bounded(&mut m0, Duration::from_secs(60));
    let err = m0_err.join().unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("machine 1") && err.contains("launcher disconnected"),
        "{err}"
    );
}

#[test]
fn killing_machine_0s_launcher_ends_machine_1s_naming_it() {
    let Some(net) = two_machines() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut launchers = endless_job(&net, dir.path());
    let (mut m1, m1_err) = launchers.pop().unwrap();
    let (mut m0, _m0_err) = launchers.pop().unwrap();
    send_signal(m0.id(), "KILL");
    let _ = wait_bounded(&mut m0, LIMIT);
    // Machine 1 learns it from the closed store connection, not from a timeout.
    let status = wait_bounded(&mut m1, Duration::from_secs(60));
    let err = m1_err.join().unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("lost machine 0"), "{err}");
    assert!(err.contains(&format!("{}:29500", ADDRESS[0])), "{err}");
}

#[test]
fn a_launcher_with_a_wrong_token_is_refused_before_its_workers_start() {
    let Some(net) = two_machines() else { return };
    let dir = tempfile::tempdir().unwrap();
    let args = mlp_args(4096, 8, 1, &dir.path().join("never.safetensors"));
    let (mut m0, _m0_err) = spawn_with_stderr(net.mlp(0, 1, &args));
    let o = net
        .mlp(1, 1, &args)
        .env("ACCELERATE_JOB_TOKEN", "not-the-token-of-machine-0")
        .run();
    let text = output_text(&o);
    assert_eq!(o.status.code(), Some(2), "{text}");
    assert!(
        text.contains("wrong job token") && text.contains("same ACCELERATE_JOB_TOKEN"),
        "{text}"
    );
    assert!(!text.contains("[rank 1]"), "a worker started: {text}");
    let _ = m0.kill();
    let _ = m0.wait();
}

#[test]
fn a_killed_rank_on_machine_1_restarts_both_machines_from_the_checkpoint() {
    let Some(net) = two_machines() else { return };
    let dir = tempfile::tempdir().unwrap();
    // The single-machine restart test's run, its two ranks on two machines.
    let args = restart_mlp_args;
    let launch =
        |m: usize, args: &[String]| net.mlp(m, 1, args).launcher_flags(["--max-restarts", "1"]);
    // The uninterrupted run.
    let whole = dir.path().join("whole.safetensors");
    let whole_args = args(&whole, &dir.path().join("ckpt_whole"));
    let runs: Vec<_> = (0..2)
        .map(|m| {
            let job = launch(m, &whole_args);
            std::thread::spawn(move || job.run())
        })
        .collect();
    for r in runs {
        let o = r.join().unwrap();
        assert!(o.status.success(), "{}", o.text());
    }

    // The same run with rank 1 (machine 1's worker) killed after the first checkpoint.
    let ckpt = dir.path().join("ckpt");
    let killed = dir.path().join("killed.safetensors");
    let killed_args = args(&killed, &ckpt);
    let (mut m0, m0_err) = spawn_with_stderr(launch(0, &killed_args));
    let (mut m1, m1_err) = spawn_with_stderr(launch(1, &killed_args));
    kill_rank_once_checkpointed(&mut m1, 1, &ckpt.join("checkpoint_16"), LIMIT);
    let s0 = wait_bounded(&mut m0, LIMIT);
    let s1 = wait_bounded(&mut m1, LIMIT);
    let (e0, e1) = (m0_err.join().unwrap(), m1_err.join().unwrap());
    assert!(
        s0.success() && s1.success(),
        "machine 0:\n{e0}\nmachine 1:\n{e1}"
    );
    assert!(e1.contains("killed by signal 9"), "{e1}");
    // Machine 0 stopped its worker because of machine 1, and both restarted.
    assert!(e0.contains("machine 1"), "{e0}");
    for e in [&e0, &e1] {
        assert!(
            e.contains("restarting every rank on every machine (restart 1"),
            "{e}"
        );
    }
    let (a, b) = (load_flat(&killed), load_flat(&whole));
    assert_eq!(a, b, "the restarted run ended elsewhere");
}
