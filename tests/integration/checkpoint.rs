//! Exact resume with the real `mlp` example: a run stopped after optimizer step s (with a
//! checkpoint there) and resumed with `--resume` ends with bitwise the same parameters as the same
//! run uninterrupted, on 1 and 2 ranks with K = 2, stopped inside an epoch and at its end. And
//! `save_model` output read back by Python's `safetensors` package.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use accelerate_tests::{
    free_port, kill_rank_once_checkpointed, load_flat, output_text, restart_mlp_args, tiny_mlp, Job,
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

#[test]
fn a_killed_rank_restarts_from_the_latest_checkpoint_and_ends_like_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let args = restart_mlp_args;
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
    kill_rank_once_checkpointed(&mut child, 1, &ckpt.join("checkpoint_16"), LIMIT);
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

/// Rank 0's copy of a checkpoint root holds `checkpoint_3` and `checkpoint_7`, rank 1's (`b`)
/// only `checkpoint_3`, as on machines that do not share the directory; the two differ in a
/// registered counter (the step each was saved at), so loading one or the other would train
/// apart. Returns the roots `(a, b)`.
fn roots_seen_apart(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    use accelerate_core::Accelerator;
    use accelerate_tests::ranks_as_threads;
    let (a, b) = (dir.join("a"), dir.join("b"));
    let saved = ranks_as_threads(2, Accelerator::builder, |mut acc| {
        let (varmap, _) = tiny_mlp(1).unwrap();
        acc.prepare(&varmap).unwrap();
        let counter = acc.register_for_checkpointing(0u64);
        for step in [3, 7] {
            *counter.lock().unwrap() = step;
            acc.save_state(a.join(format!("checkpoint_{step}")))
                .unwrap();
        }
        acc.wait_for_everyone().unwrap();
    });
    assert_eq!(saved.len(), 2);
    copy_dir(&a, &b);
    std::fs::remove_dir_all(b.join("checkpoint_7")).unwrap();
    (a, b)
}

/// What each of 2 thread-ranks returns from `load(acc, rank)` after preparing the tiny model and
/// registering the counter of [`roots_seen_apart`], with the counter's value after it.
fn load_on_two_ranks(
    load: impl Fn(&accelerate_core::Accelerator, usize) -> accelerate_core::Result<String> + Sync,
) -> Vec<(Result<String, String>, u64)> {
    use accelerate_core::Accelerator;
    use accelerate_tests::ranks_as_threads;
    ranks_as_threads(2, Accelerator::builder, |mut acc| {
        let (varmap, _) = tiny_mlp(1).unwrap();
        acc.prepare(&varmap).unwrap();
        let counter = acc.register_for_checkpointing(0u64);
        let rank = acc.process_index();
        let loaded = load(&acc, rank).map_err(|e| e.to_string());
        let value = *counter.lock().unwrap();
        (loaded, value)
    })
}

/// Every rank failed, nothing was loaded, and each error names `pieces`.
fn all_refused(results: &[(Result<String, String>, u64)], pieces: &[&str]) {
    for (rank, (result, counter)) in results.iter().enumerate() {
        let e = result.as_ref().expect_err(&format!(
            "rank {rank} loaded {result:?} while the other rank's checkpoint differs"
        ));
        for piece in pieces {
            assert!(e.contains(piece), "rank {rank}: {piece:?} not in: {e}");
        }
        assert_eq!(*counter, 0, "rank {rank} loaded something");
    }
}

#[test]
fn ranks_that_find_different_latest_checkpoints_load_nothing_and_name_both() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = roots_seen_apart(dir.path());
    // Each rank resolves "the latest" under its own copy of the root.
    let loaded = load_on_two_ranks(|acc, rank| {
        let mine = if rank == 0 { &a } else { &b };
        acc.load_state(mine).map(|p| p.display().to_string())
    });
    all_refused(
        &loaded,
        &[
            "rank 0: ",
            "checkpoint_7 (step 0",
            "rank 1: ",
            "checkpoint_3 (step 0",
        ],
    );
}

#[test]
fn ranks_given_checkpoints_they_resolved_apart_load_nothing_and_name_both() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = roots_seen_apart(dir.path());
    // As a caller that resolves "the latest" itself passes what it found on each rank.
    let loaded = load_on_two_ranks(|acc, rank| {
        let root = if rank == 0 { &a } else { &b };
        let latest = accelerate_core::latest_checkpoint(root)?.unwrap();
        acc.load_state(latest).map(|p| p.display().to_string())
    });
    all_refused(
        &loaded,
        &[
            &format!("rank 0: {}", a.join("checkpoint_7").display()),
            &format!("rank 1: {}", b.join("checkpoint_3").display()),
        ],
    );
    // The same checkpoint copied to each machine's own path is one checkpoint: both load it.
    let loaded = load_on_two_ranks(|acc, rank| {
        let root = if rank == 0 { &a } else { &b };
        acc.load_state(root.join("checkpoint_3"))
            .map(|p| p.display().to_string())
    });
    for (rank, (result, counter)) in loaded.iter().enumerate() {
        assert!(result.is_ok(), "rank {rank}: {result:?}");
        assert_eq!(*counter, 3, "rank {rank}");
    }
}

#[test]
fn a_rank_that_finds_no_checkpoint_still_joins_and_every_rank_names_both() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = roots_seen_apart(dir.path());
    let empty = dir.path().join("empty");
    // Rank 1 sees no checkpoint: through resume_latest, and as a caller passing what it found.
    let through_latest = load_on_two_ranks(|acc, rank| {
        let root = if rank == 0 { &a } else { &empty };
        acc.resume_latest(root).map(|p| format!("{p:?}"))
    });
    let through_found = load_on_two_ranks(|acc, rank| {
        let found = match rank {
            0 => accelerate_core::latest_checkpoint(&a)?,
            _ => None,
        };
        acc.resume_from(found).map(|p| format!("{p:?}"))
    });
    for loaded in [through_latest, through_found] {
        all_refused(
            &loaded,
            &[
                &format!("rank 0: {} (step 0", a.join("checkpoint_7").display()),
                "rank 1: none found",
            ],
        );
    }
    // None on every rank: nothing to load, and every rank says so.
    let none = load_on_two_ranks(|acc, _| acc.resume_latest(&empty).map(|p| format!("{p:?}")));
    for (rank, (result, counter)) in none.iter().enumerate() {
        assert_eq!(result.as_deref(), Ok("None"), "rank {rank}");
        assert_eq!(*counter, 0);
    }
    // The same latest on every rank: loaded.
    let both = load_on_two_ranks(|acc, _| acc.resume_latest(&a).map(|p| format!("{p:?}")));
    for (rank, (result, counter)) in both.iter().enumerate() {
        assert!(
            result.as_ref().unwrap().contains("checkpoint_7"),
            "rank {rank}: {result:?}"
        );
        assert_eq!(*counter, 7);
    }
}

/// Copies the directory tree `from` to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The mlp on 2 processes under ZeRO stage 1 (`ACCELERATE_ZERO_STAGE`), as [`train`] runs it.
fn train_zero_1(out: &Path, ckpt: &Path, extra: &[&str]) -> std::process::Output {
    let o = Job::mlp(2)
        .args(mlp_args(2, out, ckpt, extra))
        .env("ACCELERATE_ZERO_STAGE", "1")
        .limit(LIMIT)
        .run()
        .0;
    assert!(o.status.success(), "{}", output_text(&o));
    o
}

/// Stage 1 on 2 processes: `save_model` writes bitwise the model file plain data parallel
/// writes (every rank holds the full parameters after the step's all-gather), each rank saves its
/// own optimizer pieces, and a run stopped after step 2 and resumed ends there too.
#[test]
fn zero_stage_1_saves_the_full_model_and_resumes_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain.safetensors");
    train(2, &plain, &dir.path().join("unused"), &[]);
    let whole = dir.path().join("whole.safetensors");
    train_zero_1(&whole, &dir.path().join("unused_too"), &[]);
    assert_eq!(bits(&whole), bits(&plain), "stage 1's model file differs");

    let ckpt = dir.path().join("ckpt");
    let stopped = dir.path().join("stopped.safetensors");
    train_zero_1(
        &stopped,
        &ckpt,
        &["--max-steps", "2", "--checkpoint-every", "2"],
    );
    for r in 0..2 {
        let shard = ckpt.join(format!("checkpoint_2/optimizer_0.rank_{r}.safetensors"));
        assert!(shard.is_file(), "{} is missing", shard.display());
    }
    assert!(!ckpt.join("checkpoint_2/optimizer_0.safetensors").exists());
    let resumed = dir.path().join("resumed.safetensors");
    let o = train_zero_1(&resumed, &ckpt, &["--resume"]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("at optimizer step 2"),
        "{}",
        output_text(&o)
    );
    assert_ne!(bits(&stopped), bits(&whole));
    assert_eq!(bits(&resumed), bits(&whole), "the resumed run differs");
}

// ---- ZeRO: per-rank optimizer pieces, re-cut for another stage or world size ----

mod zero {
    use std::path::Path;
    use std::sync::Arc;

    use accelerate_core::data::{DataLoader, TensorDataset};
    use accelerate_core::optim::{AdamW, AdamWConfig, OptimizerState};
    use accelerate_core::Accelerator;
    use accelerate_tests::{named_vars, ranks_as_threads, tiny_data, tiny_mlp};
    use candle_core::Tensor;

    /// Samples: 12 global batches of 2 per epoch: 6 per rank on 2 ranks, 4 on 3.
    const SAMPLES: usize = 24;
    const BATCH: usize = 2;
    /// Optimizer steps of a whole run (K = 1: two epochs on 2 ranks, almost three on 3).
    const STEPS: u64 = 11;

    /// One rank's end: its parameters' bits (sorted by name) and its optimizer's state.
    struct End {
        params: Vec<(String, Vec<u32>)>,
        state: OptimizerState,
    }

    /// Where a run starts and stops.
    #[derive(Clone, Copy, Default)]
    struct Plan<'a> {
        /// Load this checkpoint after preparing.
        from: Option<&'a Path>,
        /// Or rank r loads `from_per_rank[r]` (copies of one checkpoint).
        from_per_rank: Option<&'a [std::path::PathBuf]>,
        /// Save into this directory after this many micro-steps, and stop there.
        save: Option<(&'a Path, usize)>,
        /// Stop right after loading (the loaded state is the end).
        stop_after_load: bool,
        /// Gradient accumulation steps (1 unless set).
        k: usize,
    }

    /// The tiny MLP trained with AdamW on `n` threads under ZeRO stage `stage`, K micro-steps per
    /// window, on a shuffled loader, until [`STEPS`] optimizer steps (or as `plan` says).
    fn run(n: usize, stage: u8, plan: Plan<'_>) -> Vec<Result<End, String>> {
        let k = plan.k.max(1);
        ranks_as_threads(
            n,
            || {
                Accelerator::builder()
                    .zero_stage(stage)
                    .gradient_accumulation_steps(k)
            },
            |mut acc| -> Result<End, String> {
                let (varmap, model) = tiny_mlp(1).unwrap();
                let params = acc.prepare(&varmap).unwrap();
                let cfg = AdamWConfig {
                    lr: 0.05,
                    ..AdamWConfig::default()
                };
                let mut opt = acc.prepare(AdamW::new(params, cfg).unwrap()).unwrap();
                let (x, y) = tiny_data(SAMPLES, 5).unwrap();
                let loader = DataLoader::new(Arc::new(TensorDataset::new(x, y).unwrap()), BATCH)
                    .shuffle(true)
                    .seed(9);
                let mut loader = acc.prepare(loader).unwrap();
                let end = |opt: &accelerate_core::PreparedOptimizer<AdamW>| End {
                    params: named_vars(&varmap)
                        .into_iter()
                        .map(|(name, var)| {
                            let v: Vec<f32> =
                                var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                            (name, v.into_iter().map(f32::to_bits).collect())
                        })
                        .collect(),
                    state: opt.state().unwrap(),
                };
                let from = plan
                    .from
                    .or_else(|| Some(plan.from_per_rank?[acc.process_index()].as_path()));
                if let Some(dir) = from {
                    acc.load_state(dir).map_err(|e| e.to_string())?;
                    if plan.stop_after_load {
                        return Ok(end(&opt));
                    }
                }
                let mut micro = 0;
                loop {
                    for batch in loader.iter() {
                        let (x, y) = batch.unwrap();
                        let _step = acc.accumulate();
                        let logits = model.forward(&x).unwrap();
                        let loss = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
                        acc.backward(&loss).unwrap();
                        opt.step().unwrap();
                        opt.zero_grad();
                        micro += 1;
                        if let Some((dir, at)) = plan.save {
                            if micro == at {
                                acc.save_state(dir).unwrap();
                                return Ok(end(&opt));
                            }
                        }
                        if acc.optimizer_steps() == STEPS {
                            return Ok(end(&opt));
                        }
                    }
                }
            },
        )
    }

    fn ok(ends: Vec<Result<End, String>>) -> Vec<End> {
        ends.into_iter().map(|e| e.unwrap()).collect()
    }

    /// Every rank ends with the same parameters; returns them.
    fn agreed(ends: &[End]) -> &[(String, Vec<u32>)] {
        for (r, e) in ends.iter().enumerate() {
            assert!(e.params == ends[0].params, "rank {r}'s parameters differ");
        }
        &ends[0].params
    }

    fn flat_bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.into_iter().map(f32::to_bits).collect()
    }

    /// An optimizer state's tensors (flattened) and scalars, as bits, by key.
    type FlatState = (Vec<(String, Vec<u32>)>, Vec<(String, u64)>);

    /// The full state assembled from the ranks' pieces: each rank owns one contiguous block of
    /// the flat parameter space, in rank order, so a parameter's pieces follow one another in
    /// rank order; scalars are rank 0's.
    fn assembled(ends: &[End]) -> FlatState {
        let mut tensors: std::collections::BTreeMap<String, Vec<u32>> = Default::default();
        for e in ends {
            for (k, t) in &e.state.tensors {
                tensors.entry(k.clone()).or_default().extend(flat_bits(t));
            }
        }
        let scalars = ends[0]
            .state
            .scalars
            .iter()
            .map(|(k, v)| (k.clone(), v.to_bits()))
            .collect();
        (tensors.into_iter().collect(), scalars)
    }

    /// A stage-0 state, flattened like [`assembled`].
    fn full(end: &End) -> FlatState {
        (
            end.state
                .tensors
                .iter()
                .map(|(k, t)| (k.clone(), flat_bits(t)))
                .collect(),
            end.state
                .scalars
                .iter()
                .map(|(k, v)| (k.clone(), v.to_bits()))
                .collect(),
        )
    }

    fn manifest(dir: &Path) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
    }

    /// Stage 1 on 2 ranks: each rank writes its pieces and no full optimizer file is written; the
    /// manifest's pieces tile every parameter once; resumed on 2 ranks under stage 1 the run ends
    /// bitwise where the uninterrupted one does (and where plain data parallel does).
    #[test]
    fn stage_1_saves_per_rank_pieces_and_resumes_bitwise() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ckpt");
        let whole = ok(run(2, 1, Plan::default()));
        let plain = ok(run(2, 0, Plan::default()));
        assert!(
            agreed(&whole) == agreed(&plain),
            "stage 1 differs from stage 0"
        );
        let save = Plan {
            save: Some((&dir, 4)),
            ..Plan::default()
        };
        let stopped = ok(run(2, 1, save));
        assert!(agreed(&stopped) != agreed(&whole), "stopped before the end");
        for r in 0..2 {
            assert!(dir
                .join(format!("optimizer_0.rank_{r}.safetensors"))
                .is_file());
        }
        assert!(!dir.join("optimizer_0.safetensors").exists());
        assert!(dir.join("optimizer_0.json").is_file());
        let m = manifest(&dir);
        assert_eq!(m["format_version"], 2);
        assert_eq!(m["zero"]["stage"], 1);
        assert_eq!(m["zero"]["world_size"], 2);
        for p in m["parameters"].as_array().unwrap() {
            let name = p["name"].as_str().unwrap();
            let numel: u64 = p["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .product();
            let mut covered = vec![0; numel as usize];
            for rank in m["zero"]["pieces"].as_array().unwrap() {
                for piece in rank.as_array().unwrap() {
                    if piece["param"] == name {
                        let start = piece["start"].as_u64().unwrap();
                        for e in start..start + piece["len"].as_u64().unwrap() {
                            covered[e as usize] += 1;
                        }
                    }
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "{name}: {covered:?}");
        }
        let resume = Plan {
            from: Some(&dir),
            ..Plan::default()
        };
        let resumed = ok(run(2, 1, resume));
        assert!(agreed(&resumed) == agreed(&whole), "resumed run differs");
        for (r, (a, b)) in resumed.iter().zip(&whole).enumerate() {
            assert!(full(a) == full(b), "rank {r}'s optimizer pieces differ");
        }
    }

    /// Stage 2 on 2 ranks: saved between windows and inside one (K = 2, where the window's sums
    /// are whole buckets), resumed under stage 2 it ends bitwise where the uninterrupted run
    /// ends; its checkpoint also loads under stage 1, which on 2 ranks reduces to the same bits.
    #[test]
    fn stage_2_checkpoints_resume_bitwise_and_load_under_stage_1() {
        for (k, at) in [(1, 4), (2, 5)] {
            let root = tempfile::tempdir().unwrap();
            let dir = root.path().join("s2");
            let plan = |save, from| Plan {
                save,
                from,
                k,
                ..Plan::default()
            };
            let whole = ok(run(2, 2, plan(None, None)));
            let stage_1 = ok(run(2, 1, plan(None, None)));
            assert!(
                agreed(&whole) == agreed(&stage_1),
                "K={k}: stage 2 vs stage 1"
            );
            let stopped = ok(run(2, 2, plan(Some((&dir, at)), None)));
            assert!(agreed(&stopped) != agreed(&whole), "stopped before the end");
            assert_eq!(manifest(&dir)["zero"]["stage"], 2);
            for r in 0..2 {
                assert!(dir
                    .join(format!("optimizer_0.rank_{r}.safetensors"))
                    .is_file());
            }
            let resumed = ok(run(2, 2, plan(None, Some(&dir))));
            assert!(
                agreed(&resumed) == agreed(&whole),
                "K={k}: resumed run differs"
            );
            let as_stage_1 = ok(run(2, 1, plan(None, Some(&dir))));
            assert!(
                agreed(&as_stage_1) == agreed(&whole),
                "K={k}: 2 -> 1 differs"
            );
        }
    }

    /// A stage-0 checkpoint resumed under stage 1 ends bitwise where uninterrupted stage 0
    /// ends; a stage-1 checkpoint loaded under stage 0 gives every rank the full state a stage-0
    /// run has at the same step.
    #[test]
    fn stage_0_and_stage_1_checkpoints_load_under_each_other() {
        let root = tempfile::tempdir().unwrap();
        let (plain_dir, sharded_dir) = (root.path().join("s0"), root.path().join("s1"));
        let whole = ok(run(2, 0, Plan::default()));
        let at_4 = ok(run(
            2,
            0,
            Plan {
                save: Some((&plain_dir, 4)),
                ..Plan::default()
            },
        ));
        assert!(manifest(&plain_dir).get("zero").is_none());
        let resumed = ok(run(
            2,
            1,
            Plan {
                from: Some(&plain_dir),
                ..Plan::default()
            },
        ));
        assert!(agreed(&resumed) == agreed(&whole), "0 -> 1 differs");

        ok(run(
            2,
            1,
            Plan {
                save: Some((&sharded_dir, 4)),
                ..Plan::default()
            },
        ));
        let loaded = ok(run(
            2,
            0,
            Plan {
                from: Some(&sharded_dir),
                stop_after_load: true,
                ..Plan::default()
            },
        ));
        let reference = full(&at_4[0]);
        assert!(!reference.0.is_empty());
        for (r, e) in loaded.iter().enumerate() {
            assert!(full(e) == reference, "rank {r}: 1 -> 0 state differs");
            assert_eq!(e.params, at_4[0].params);
        }
    }

    /// Stage 1 saved by 2 ranks at the end of epoch 0 (6 steps), loaded by 3, and by 3 ranks
    /// (4 steps), loaded by 2: the pieces over the new ranks assemble into the full state of a
    /// stage-0 run at that step; training continues, bitwise as a stage-0 checkpoint resumed on
    /// the new number of ranks does.
    #[test]
    fn another_world_size_recuts_the_pieces_at_an_epoch_boundary() {
        for (old, new, epoch_end) in [(2, 3, 6), (3, 2, 4)] {
            let root = tempfile::tempdir().unwrap();
            let (plain_dir, sharded_dir) = (root.path().join("s0"), root.path().join("s1"));
            let save = |dir| Plan {
                save: Some((dir, epoch_end)),
                ..Plan::default()
            };
            let reference = ok(run(old, 0, save(&plain_dir)));
            ok(run(old, 1, save(&sharded_dir)));
            let loaded = ok(run(
                new,
                1,
                Plan {
                    from: Some(&sharded_dir),
                    stop_after_load: true,
                    ..Plan::default()
                },
            ));
            assert!(
                assembled(&loaded) == full(&reference[0]),
                "{old} -> {new}: the re-cut pieces differ from the saved state"
            );
            let from = |dir| Plan {
                from: Some(dir),
                ..Plan::default()
            };
            let sharded = ok(run(new, 1, from(&sharded_dir)));
            let plain = ok(run(new, 0, from(&plain_dir)));
            assert!(
                agreed(&sharded) == agreed(&plain),
                "{old} -> {new}: continued runs differ"
            );
            assert!(agreed(&sharded) != reference[0].params.as_slice());
        }
    }

    /// Another number of processes is refused inside an accumulation window, and where the new
    /// ranks cannot share the consumed batches evenly, each time naming the fix.
    #[test]
    fn another_world_size_mid_window_or_uneven_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let mid_window = root.path().join("mid");
        ok(run(
            2,
            1,
            Plan {
                save: Some((&mid_window, 3)),
                k: 2,
                ..Plan::default()
            },
        ));
        let refused = run(
            3,
            1,
            Plan {
                from: Some(&mid_window),
                k: 2,
                ..Plan::default()
            },
        );
        for e in refused {
            let e = e.err().expect("refused");
            assert!(
                e.contains("saved by 2 processes but this run has 3")
                    && e.contains("accumulation window")
                    && e.contains("--num-processes 2"),
                "{e}"
            );
        }
        let uneven = root.path().join("uneven");
        ok(run(
            2,
            1,
            Plan {
                save: Some((&uneven, 1)),
                ..Plan::default()
            },
        ));
        for e in run(
            3,
            1,
            Plan {
                from: Some(&uneven),
                ..Plan::default()
            },
        ) {
            let e = e.err().expect("refused");
            assert!(
                e.contains("epoch 0: 2 global batches")
                    && e.contains("resume at an epoch boundary or with --num-processes 2"),
                "{e}"
            );
        }
    }

    /// Copies of `dir`, one per rank of `new` ranks, each without the optimizer shards that rank
    /// does not need: every saved rank's file but those `needs(new_rank)` names.
    fn copies_without_unneeded_shards(
        dir: &Path,
        old: usize,
        new: usize,
        needs: impl Fn(usize) -> Vec<usize>,
    ) -> Vec<std::path::PathBuf> {
        (0..new)
            .map(|r| {
                let copy = dir.with_file_name(format!("copy_for_rank_{r}"));
                super::copy_dir(dir, &copy);
                for saved in (0..old).filter(|s| !needs(r).contains(s)) {
                    std::fs::remove_file(
                        copy.join(format!("optimizer_0.rank_{saved}.safetensors")),
                    )
                    .unwrap();
                }
                copy
            })
            .collect()
    }

    /// Each rank reads only the optimizer shards its own pieces come from: with every other
    /// rank's shard deleted from the copy it loads, the same world size and stage loads each
    /// rank's own shard alone, and 2 -> 3 ranks (re-cut) reads saved rank 0's for new rank 0,
    /// both for new rank 1 and saved rank 1's for new rank 2; each ends with the state a load
    /// of the whole checkpoint gives.
    #[test]
    fn each_rank_reads_only_the_shards_it_needs() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ckpt");
        ok(run(
            2,
            1,
            Plan {
                save: Some((&dir, 6)),
                ..Plan::default()
            },
        ));
        for (new, needs) in [
            (2, &(|r| vec![r]) as &dyn Fn(usize) -> Vec<usize>),
            (3, &|r| match r {
                0 => vec![0],
                1 => vec![0, 1],
                _ => vec![1],
            }),
        ] {
            let whole = ok(run(
                new,
                1,
                Plan {
                    from: Some(&dir),
                    stop_after_load: true,
                    ..Plan::default()
                },
            ));
            let copies = copies_without_unneeded_shards(&dir, 2, new, needs);
            let loaded = run(
                new,
                1,
                Plan {
                    from_per_rank: Some(&copies),
                    stop_after_load: true,
                    ..Plan::default()
                },
            );
            for (r, (got, want)) in loaded.into_iter().zip(&whole).enumerate() {
                let got = got.unwrap_or_else(|e| panic!("2 -> {new} ranks, rank {r}: {e}"));
                assert!(
                    full(&got) == full(want),
                    "2 -> {new}, rank {r}: state differs"
                );
                assert_eq!(got.params, want.params);
            }
            for copy in copies {
                std::fs::remove_dir_all(copy).unwrap();
            }
        }
    }
}
