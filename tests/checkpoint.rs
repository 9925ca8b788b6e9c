//! Exact resume with the real `mlp` example: a run stopped after optimizer step s (with a
//! checkpoint there) and resumed with `--resume` ends with bitwise the same parameters as the same
//! run uninterrupted, on 1 and 2 ranks with K = 2, stopped inside an epoch and at its end. And
//! `save_model` output read back by Python's `safetensors` package.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use accelerate_tests::{
    children_by_rank, free_port, load_flat, output_text, send_signal, tiny_mlp, Job,
};

const LIMIT: Duration = Duration::from_secs(240);

/// Runs the mlp on `n` processes (directly when 1, through the launcher otherwise) with K = 2,
/// batch 4, 5 batches per rank per epoch (windows of 2, 2, 1: 3 optimizer steps per epoch), two
/// epochs, AdamW, shuffled; `extra` flags appended. Expects success.
fn train(n: usize, out: &Path, ckpt: &Path, extra: &[&str]) -> std::process::Output {
    let o = train_output(n, out, ckpt, extra);
    assert!(o.status.success(), "{}", output_text(&o));
    o
}

/// [`train`], whatever its outcome.
fn train_output(n: usize, out: &Path, ckpt: &Path, extra: &[&str]) -> std::process::Output {
    Job::mlp(n)
        .args(mlp_args(n, out, ckpt, extra))
        .limit(LIMIT)
        .run()
        .0
}

/// The mlp flags of [`train`] for `n` ranks.
fn mlp_args(n: usize, out: &Path, ckpt: &Path, extra: &[&str]) -> Vec<String> {
    let samples = (5 * n * 4).to_string();
    let mut args: Vec<String> = [
        "--hidden",
        "16",
        "--samples",
        &samples,
        "--batch-size",
        "4",
        "--grad-accum",
        "2",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--seed",
        "3",
        "--epochs",
        "2",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--save-model",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn bits(path: &Path) -> BTreeMap<String, Vec<u32>> {
    load_flat(path)
        .into_iter()
        .map(|(n, v)| (n, v.into_iter().map(f32::to_bits).collect()))
        .collect()
}

fn stop_and_resume(n: usize, stop_at: u64) {
    stop_and_resume_with(n, stop_at, &[]);
}

/// [`stop_and_resume`] with `extra` flags in all three runs.
fn stop_and_resume_with(n: usize, stop_at: u64, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole.safetensors");
    let uninterrupted = train(n, &whole, &dir.path().join("unused"), extra);

    let ckpt = dir.path().join("ckpt");
    let stopped = dir.path().join("stopped.safetensors");
    let s = stop_at.to_string();
    let stop = ["--max-steps", &s, "--checkpoint-every", &s];
    train(n, &stopped, &ckpt, &[&stop[..], extra].concat());
    assert!(ckpt.join(format!("checkpoint_{stop_at}")).is_dir());

    let resumed = dir.path().join("resumed.safetensors");
    let o = train(n, &resumed, &ckpt, &[&["--resume"][..], extra].concat());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains(&format!("at optimizer step {stop_at}")) && out.contains("steps=6"),
        "{}",
        output_text(&o)
    );
    // The stop happened before the end: the comparison below could have failed.
    assert_ne!(bits(&stopped), bits(&whole));
    assert_eq!(
        bits(&resumed),
        bits(&whole),
        "{n} rank(s), stopped after step {stop_at}: resumed parameters differ"
    );
    if extra.contains(&"--eval-steps") {
        // The evaluation loader's restored position is an epoch's start: the resumed run's
        // final evaluation covers the whole split, as the uninterrupted run's does.
        let eval_loss = |o: &std::process::Output| {
            let out = String::from_utf8_lossy(&o.stdout).into_owned();
            out.split_whitespace()
                .find_map(|w| w.strip_prefix("eval_loss=").map(str::to_string))
                .unwrap_or_else(|| panic!("no eval_loss=:\n{}", output_text(o)))
        };
        assert_eq!(eval_loss(&o), eval_loss(&uninterrupted));
    }
}

#[test]
fn one_rank_stopped_mid_epoch_resumes_bitwise() {
    // Step 2 ends after 4 of epoch 0's 5 batches.
    stop_and_resume(1, 2);
}

#[test]
fn one_rank_stopped_at_an_epoch_boundary_resumes_bitwise() {
    stop_and_resume(1, 3);
}

#[test]
fn two_ranks_stopped_mid_epoch_resume_bitwise() {
    stop_and_resume(2, 2);
}

#[test]
fn two_ranks_stopped_at_an_epoch_boundary_resume_bitwise() {
    stop_and_resume(2, 3);
}

#[test]
fn two_ranks_evaluating_every_two_steps_resume_bitwise() {
    // The stopped run evaluates at step 2 right before its checkpoint, and the resumed one at
    // steps 4 and 6: neither evaluation may move the training loader, its RNG or its gradients.
    stop_and_resume_with(2, 2, &["--eval-steps", "2"]);
}

#[test]
fn keep_limit_and_resume_without_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let o = train(
        1,
        &dir.path().join("a.safetensors"),
        &ckpt,
        &[
            "--resume",
            "--checkpoint-every",
            "1",
            "--checkpoints-keep",
            "2",
        ],
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("no checkpoint in"),
        "{}",
        output_text(&o)
    );
    let mut left: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["checkpoint_5", "checkpoint_6"]);
}

fn checkpoints_in(dir: &Path) -> Vec<String> {
    let mut left: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    left
}

#[test]
fn a_fresh_run_into_another_runs_checkpoints_is_refused_or_starts_over_when_asked() {
    // Another run left checkpoint_90 and checkpoint_100 (its checkpoints 1 and 2, renamed).
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let out = dir.path().join("a.safetensors");
    train(
        1,
        &out,
        &ckpt,
        &["--max-steps", "2", "--checkpoint-every", "1"],
    );
    std::fs::rename(ckpt.join("checkpoint_1"), ckpt.join("checkpoint_90")).unwrap();
    std::fs::rename(ckpt.join("checkpoint_2"), ckpt.join("checkpoint_100")).unwrap();

    // A new run with a keep limit used to delete each checkpoint it wrote and leave the other
    // run's two, which a later --resume continued.
    let fresh = ["--checkpoint-every", "1", "--checkpoints-keep", "2"];
    let o = train_output(1, &out, &ckpt, &fresh);
    assert!(!o.status.success(), "accepted:\n{}", output_text(&o));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains(&format!("--checkpoint-dir {}", ckpt.display()))
            && e.contains("checkpoint_100")
            && e.contains("--resume")
            && e.contains("another --checkpoint-dir")
            && e.contains("--overwrite-checkpoints"),
        "{e}"
    );
    assert_eq!(checkpoints_in(&ckpt), ["checkpoint_100", "checkpoint_90"]);

    // Asked to, it starts over: the other run's checkpoints are gone, its own two newest remain,
    // and a resume continues this run (its last checkpoint is its end: no step is left).
    let o = train(
        1,
        &out,
        &ckpt,
        &[&fresh[..], &["--overwrite-checkpoints"]].concat(),
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("deleted 2 checkpoint(s)"),
        "{}",
        output_text(&o)
    );
    assert_eq!(checkpoints_in(&ckpt), ["checkpoint_5", "checkpoint_6"]);
    let o = train(1, &out, &ckpt, &["--resume"]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("at optimizer step 6"),
        "{}",
        output_text(&o)
    );
}

/// Runs 2 ranks of the mlp with `extra`, expects both to fail, and checks that rank 0's error
/// names the cause, that rank 1's names rank 0 and the cause, and that no rank was left waiting
/// at a barrier. The ranks are started like torchrun starts them, without our launcher: the
/// launcher stops the other ranks as soon as one fails, which could stop rank 1 before it
/// prints, and would hide a rank 1 that never learns of rank 0's failure.
fn both_ranks_fail_with_the_cause(ckpt: &Path, out: &Path, extra: &[&str], cause: &str) {
    let port = free_port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let job = Job::mlp(1)
                .args(mlp_args(2, out, ckpt, extra))
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                // torchrun's store would hold MASTER_PORT; rank 0 hosts ours one above it.
                .env("MASTER_PORT", (port - 1).to_string())
                .limit(LIMIT);
            std::thread::spawn(move || job.run())
        })
        .collect();
    let outputs: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    for (rank, o) in outputs.iter().enumerate() {
        let text = output_text(o);
        assert!(!o.status.success(), "rank {rank} accepted:\n{text}");
        assert!(!text.contains("left the job"), "rank {rank}: {text}");
        assert!(!text.contains("timed out"), "rank {rank}: {text}");
        assert!(text.contains(cause), "rank {rank}: {text}");
    }
    // Rank 1 learnt of rank 0's failure from the agreement, not from a dead peer.
    let rank1 = output_text(&outputs[1]);
    assert!(rank1.contains("rank 0 failed:"), "rank 1: {rank1}");
}

#[test]
fn a_checkpoint_that_rank_0_cannot_write_ends_both_ranks_with_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    // A regular file where rank 0 creates the staging directory of checkpoint_1.
    std::fs::write(ckpt.join(".checkpoint_1.staging"), b"in the way").unwrap();
    both_ranks_fail_with_the_cause(
        &ckpt,
        &dir.path().join("m.safetensors"),
        &["--checkpoint-every", "1"],
        ".checkpoint_1.staging",
    );
}

#[test]
fn a_model_that_rank_0_cannot_write_ends_both_ranks_with_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    // A regular file where the model's directory should be.
    let blocker = dir.path().join("not_a_dir");
    std::fs::write(&blocker, b"in the way").unwrap();
    both_ranks_fail_with_the_cause(
        &dir.path().join("ckpt"),
        &blocker.join("model.safetensors"),
        &[],
        "not_a_dir",
    );
}

/// `save_model` output, sharded and not, read by Python's `safetensors.numpy` and compared with
/// the parameters as this test wrote them to JSON. Skipped (saying so) without python3 and the
/// packages; CI installs them.
#[test]
fn python_safetensors_reads_save_model_output() {
    let python_ok = Command::new("python3")
        .args(["-c", "import safetensors.numpy, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !python_ok {
        eprintln!("SKIPPED: python3 with safetensors and numpy is not installed (pip install safetensors numpy)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut acc = accelerate_core::Accelerator::builder()
        .process_state(accelerate_core::ProcessState::single())
        .build()
        .unwrap();
    let (varmap, _) = tiny_mlp(4).unwrap();
    let params = acc.prepare(&varmap).unwrap();
    let expected: serde_json::Map<String, serde_json::Value> = params
        .iter()
        .map(|(n, v)| {
            let values = v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (
                n.clone(),
                serde_json::json!({"shape": v.dims(), "dtype": "float32", "values": values}),
            )
        })
        .collect();
    std::fs::write(
        dir.path().join("expected.json"),
        serde_json::to_vec(&expected).unwrap(),
    )
    .unwrap();
    let single = dir.path().join("single");
    acc.save_model(&single).unwrap();
    let sharded = dir.path().join("sharded");
    // l1.weight is 8x6 f32 = 192 bytes: a 200-byte limit gives several shards.
    acc.save_model_sharded(&sharded, 200).unwrap();
    assert!(sharded.join("model.safetensors.index.json").exists());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/check_save_model.py");
    for d in [&single, &sharded] {
        let o = Job::new("python3")
            .arg(&script)
            .arg(d)
            .arg(dir.path().join("expected.json"))
            .limit(Duration::from_secs(60))
            .run();
        assert!(o.status.success(), "{}", output_text(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("ok"),
            "{}",
            output_text(&o)
        );
    }
}

/// Pid of the launcher's child whose environment says `RANK=<rank>`.
fn worker_pid(launcher_pid: u32, rank: usize) -> Option<u32> {
    children_by_rank(launcher_pid)
        .into_iter()
        .find_map(|(r, pid)| (r == rank).then_some(pid))
}

#[test]
fn a_killed_rank_restarts_from_the_latest_checkpoint_and_ends_like_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let args = |out: &Path, ckpt: &Path| -> Vec<String> {
        [
            "--hidden",
            "128",
            "--samples",
            "4096",
            "--batch-size",
            "8",
            "--grad-accum",
            "2",
            "--optimizer",
            "adamw",
            "--lr",
            "0.003",
            "--seed",
            "5",
            "--epochs",
            "2",
            "--checkpoint-every",
            "16",
            "--resume",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
            "--save-model",
            out.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let launch = || {
        Job::mlp(2)
            .launcher_flags(["--max-restarts", "1"])
            .launcher_flags(["--grace-period", "2"])
            .limit(LIMIT)
    };
    let whole = dir.path().join("whole.safetensors");
    let o = launch()
        .args(args(&whole, &dir.path().join("ckpt_whole")))
        .run();
    assert!(o.status.success(), "{}", output_text(&o));

    let ckpt = dir.path().join("ckpt");
    let killed = dir.path().join("killed.safetensors");
    let mut child = launch()
        .args(args(&killed, &ckpt))
        .command()
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out_pipe = child.stdout.take().unwrap();
    let err_pipe = child.stderr.take().unwrap();
    let read = |mut p: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = p.read_to_string(&mut s);
            s
        })
    };
    let (out_reader, err_reader) = (read(Box::new(out_pipe)), read(Box::new(err_pipe)));
    // Kill rank 1 once the first checkpoint exists (well before the run's 256 optimizer steps).
    let start = std::time::Instant::now();
    let victim = loop {
        if ckpt.join("checkpoint_16").is_dir() {
            if let Some(pid) = worker_pid(child.id(), 1) {
                break pid;
            }
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the job ended before the kill"
        );
        assert!(start.elapsed() < LIMIT, "no checkpoint appeared");
        std::thread::sleep(Duration::from_millis(5));
    };
    send_signal(victim, "KILL");
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < LIMIT, "the restarted job did not finish");
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (out_reader.join().unwrap(), err_reader.join().unwrap());
    assert!(status.success(), "{out}\n{err}");
    assert!(
        err.contains("killed by signal 9") && err.contains("restart 1 of 1"),
        "{err}"
    );
    assert!(out.contains("steps=256"), "{out}");
    assert_eq!(
        bits(&killed),
        bits(&whole),
        "the restarted run ended elsewhere"
    );
}
