//! The `gpt` example end to end: it learns (its loss falls well below the unigram entropy of its
//! text, computed here from the text's character counts), two ranks with item-weighted
//! accumulation equal one process with the whole global batch, and bad flags are refused with
//! messages that name them.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use accelerate_tests::{
    load_flat, max_abs_diff_flat, metric_losses, output_text as text, summary_value, Job, JobOutput,
};

const LIMIT: Duration = Duration::from_secs(240);

/// The `gpt` example, alone unless given [`Job::ranks`].
fn gpt() -> Job {
    Job::example("gpt").limit(LIMIT)
}

fn sonnets() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/sonnets.txt");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `-Σ p ln p` over the characters of `text`, in nats.
fn char_entropy(text: &str) -> f64 {
    let mut counts: HashMap<char, f64> = HashMap::new();
    for c in text.chars() {
        *counts.entry(c).or_default() += 1.0;
    }
    let n: f64 = counts.values().sum();
    counts.values().map(|&c| -(c / n) * (c / n).ln()).sum()
}

fn distinct_chars(text: &str) -> usize {
    let mut v: Vec<char> = text.chars().collect();
    v.sort_unstable();
    v.dedup();
    v.len()
}

/// The example alone (no launcher environment), bounded in time. One compute thread: the tests
/// run side by side, and candle's CPU thread pool spins at barriers, which on oversubscribed
/// cores is many times slower than one thread.
fn run_gpt(args: &[&str]) -> JobOutput {
    gpt().args(args).env("RAYON_NUM_THREADS", "1").run()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn it_learns_the_built_in_text_well_below_its_unigram_entropy() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let o = run_gpt(&[
        "--context",
        "32",
        "--max-steps",
        "150",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let sonnets = sonnets();
    let entropy = char_entropy(&sonnets);
    // The example reports the same entropy (its own computation, from its tokens).
    let reported = summary_value::<f64>(&o, "unigram_entropy");
    assert!((reported - entropy).abs() < 1e-5, "{reported} vs {entropy}");
    let l = metric_losses(&metrics);
    assert_eq!(l.len(), 150);
    // Small initial weights give near-uniform predictions: the first loss per token is about
    // ln(vocabulary), which also shows the loss is normalized per token.
    let uniform = (distinct_chars(&sonnets) as f64).ln();
    assert!((l[0] - uniform).abs() < 0.1, "{} vs ln V = {uniform}", l[0]);
    let end = mean(&l[l.len() - 10..]);
    assert!(
        end < entropy - 0.5,
        "mean loss of the last 10 steps {end:.4}, unigram entropy {entropy:.4}\n{}",
        text(&o)
    );
}

#[test]
fn it_learns_a_text_file_given_with_text_almost_perfectly() {
    // A repeated sentence is predictable from a few characters of context, although its
    // characters alone carry ~3 nats each. The first characters of a window lack that context,
    // which keeps the loss per token of windows of 16 to 32 characters above zero.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fox.txt");
    let fox = "the quick brown fox jumps over the lazy dog. ".repeat(100);
    std::fs::write(&file, &fox).unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let o = run_gpt(&[
        "--text",
        file.to_str().unwrap(),
        "--context",
        "32",
        "--max-steps",
        "150",
        "--lr",
        "0.01",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let entropy = char_entropy(&fox);
    assert!((summary_value::<f64>(&o, "unigram_entropy") - entropy).abs() < 1e-5);
    let l = metric_losses(&metrics);
    let end = mean(&l[l.len() - 10..]);
    assert!(
        end < entropy / 3.0,
        "last losses {:?}; unigram entropy {entropy}",
        &l[l.len() - 10..]
    );
}

fn small_model_args(out: &Path, batch: usize, steps: u64) -> Vec<String> {
    [
        "--layers",
        "1",
        "--width",
        "32",
        "--heads",
        "2",
        "--context",
        "16",
        "--seed",
        "5",
        "--batch-size",
        &batch.to_string(),
        "--max-steps",
        &steps.to_string(),
        "--save-model",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn two_ranks_with_two_micro_batches_equal_one_process_with_the_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let dist = dir.path().join("dist.safetensors");
    let mut args = small_model_args(&dist, 4, 12);
    args.extend(["--grad-accum".to_string(), "2".to_string()]);
    let d = gpt().ranks(2).args(&args).run();
    assert!(d.status.success(), "{}", text(&d));
    assert_eq!(summary_value::<f64>(&d, "steps"), 12.0, "{}", text(&d));
    assert_eq!(
        summary_value::<f64>(&d, "micro_steps"),
        24.0,
        "{}",
        text(&d)
    );

    // One process, one micro-batch holding the same 2 x 2 x 4 windows per step. Its batches are
    // padded to other lengths than the ranks' smaller ones; item weighting makes that irrelevant.
    let single = dir.path().join("single.safetensors");
    let s = run_gpt(
        &small_model_args(&single, 16, 12)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(s.status.success(), "{}", text(&s));
    let (a, b) = (load_flat(&dist), load_flat(&single));
    assert!(a.contains_key("h.0.attn.c_attn.weight") && a.contains_key("lm_head.weight"));
    let diff = max_abs_diff_flat(&a, &b);
    assert!(
        diff < 1e-4,
        "max |Δθ| between 2 ranks x K=2 and 1 process = {diff}"
    );
    let (ld, ls) = (
        summary_value::<f64>(&d, "final_loss"),
        summary_value::<f64>(&s, "final_loss"),
    );
    assert!((ld - ls).abs() < 1e-4, "final loss {ld} vs {ls}");

    // The comparison could have failed: training moved the weights far more than the tolerance.
    let init = dir.path().join("init.safetensors");
    let i = run_gpt(
        &small_model_args(&init, 16, 0)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(i.status.success(), "{}", text(&i));
    let moved: BTreeMap<String, Vec<f32>> = load_flat(&init);
    assert!(max_abs_diff_flat(&moved, &b) > 0.01);
}

/// A run of 20 optimizer steps with K = 3 and `extra` flags, stopped after 10 (checkpoints every 5)
/// and resumed with `--resume`, ends with bitwise the parameters of the same run uninterrupted.
/// Returns the uninterrupted run's parameters.
/// `(step, loss, tokens)` of each line of a `--metrics` file.
fn metric_steps(path: &Path) -> Vec<(u64, f64, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let f = |k: &str| v[k].as_f64().unwrap();
            (v["step"].as_u64().unwrap(), f("loss"), f("tokens"))
        })
        .collect()
}

#[test]
fn log_every_reports_the_mean_loss_of_its_steps_and_leaves_training_unchanged() {
    // Two ranks x K=2, 7 steps: reports after steps 3 and 6, and the partial interval (step 7)
    // when the run ends. A report's loss is per token over its steps: the mean of the per-step
    // losses weighted by their tokens (windows vary in length).
    let dir = tempfile::tempdir().unwrap();
    let run = |every: &str| {
        let out = dir.path().join(format!("every{every}.safetensors"));
        let metrics = dir.path().join(format!("every{every}.jsonl"));
        let mut args = small_model_args(&out, 4, 7);
        args.extend(["--grad-accum", "2", "--log-every", every, "--metrics"].map(String::from));
        args.push(metrics.to_str().unwrap().to_string());
        let o = gpt().ranks(2).args(&args).run();
        assert!(o.status.success(), "{}", text(&o));
        (o, load_flat(&out), metric_steps(&metrics))
    };
    let (o1, weights1, every1) = run("1");
    let (o3, weights3, every3) = run("3");
    assert_eq!(
        every1.iter().map(|s| s.0).collect::<Vec<_>>(),
        (1..=7).collect::<Vec<_>>()
    );
    assert_eq!(every3.iter().map(|s| s.0).collect::<Vec<_>>(), [3, 6, 7]);
    let losses: Vec<f64> = every1.iter().map(|s| s.1).collect();
    for (&(_, got, tokens), steps) in every3.iter().zip([0..3, 3..6, 6..7]) {
        let interval = &every1[steps.clone()];
        let want_tokens: f64 = interval.iter().map(|s| s.2).sum();
        let want = interval.iter().map(|s| s.1 * s.2).sum::<f64>() / want_tokens;
        assert_eq!(tokens, want_tokens, "steps {steps:?}");
        assert!(
            (got - want).abs() <= 1e-12 * want,
            "steps {steps:?}: reported {got}, token-weighted mean of per-step losses {want}"
        );
    }
    // The summary's final loss is the last report's: step 7 alone.
    assert_eq!(
        summary_value::<f64>(&o3, "final_loss"),
        summary_value::<f64>(&o1, "final_loss")
    );
    assert_eq!(summary_value::<f64>(&o3, "steps"), 7.0);
    // Reading the loss less often changes nothing in training.
    assert_eq!(max_abs_diff_flat(&weights1, &weights3), 0.0);
    assert!(
        losses[0] != losses[6],
        "training moved the loss: {losses:?}"
    );
}

fn resumes_bitwise(extra: &[&str]) -> BTreeMap<String, Vec<f32>> {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let with = |out: &Path, steps: u64, more: &[&str]| {
        let mut a = small_model_args(out, 4, steps);
        a.extend(["--grad-accum", "3"].iter().map(|s| s.to_string()));
        a.extend(extra.iter().chain(more).map(|s| s.to_string()));
        let o = run_gpt(&a.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(o.status.success(), "{}", text(&o));
        o
    };
    let whole = dir.path().join("whole.safetensors");
    with(&whole, 20, &[]);
    let part = dir.path().join("part.safetensors");
    let c = ckpt.to_str().unwrap();
    with(
        &part,
        10,
        &["--checkpoint-every", "5", "--checkpoint-dir", c],
    );
    let resumed = dir.path().join("resumed.safetensors");
    let o = with(&resumed, 20, &["--resume", "--checkpoint-dir", c]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("resumed from"),
        "{}",
        text(&o)
    );
    assert!(
        !String::from_utf8_lossy(&o.stderr).contains("no random generator state"),
        "{}",
        text(&o)
    );
    assert_eq!(
        summary_value::<f64>(&o, "micro_steps"),
        30.0,
        "10 windows of 3 after the resume"
    );
    let whole = load_flat(&whole);
    assert_eq!(
        max_abs_diff_flat(&whole, &load_flat(&resumed)),
        0.0,
        "{extra:?}: the resumed run ended elsewhere"
    );
    assert!(max_abs_diff_flat(&whole, &load_flat(&part)) > 0.0);
    whole
}

#[test]
fn a_run_resumed_from_a_checkpoint_ends_bitwise_like_an_uninterrupted_one() {
    resumes_bitwise(&[]);
}

#[test]
fn a_run_with_dropout_resumed_from_a_checkpoint_ends_bitwise_like_an_uninterrupted_one() {
    let with_dropout = resumes_bitwise(&["--dropout", "0.2"]);
    // Dropout does act: the same run without it ends elsewhere.
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain.safetensors");
    let mut a = small_model_args(&plain, 4, 20);
    a.extend(
        ["--grad-accum", "3", "--dropout", "0"]
            .iter()
            .map(|s| s.to_string()),
    );
    let o = run_gpt(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o));
    assert!(max_abs_diff_flat(&with_dropout, &load_flat(&plain)) > 1e-4);
}

#[test]
fn two_ranks_with_dropout_resume_bitwise() {
    // Each rank draws its own masks from its own generator, saved as rng_<rank>.json.
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let c = ckpt.to_str().unwrap().to_string();
    let launch = |out: &Path, steps: u64, more: &[&str]| {
        let mut a = small_model_args(out, 4, steps);
        a.extend(
            ["--grad-accum", "2", "--dropout", "0.2"]
                .iter()
                .map(|s| s.to_string()),
        );
        a.extend(more.iter().map(|s| s.to_string()));
        let o = gpt().ranks(2).args(&a).env("RAYON_NUM_THREADS", "1").run();
        assert!(o.status.success(), "{}", text(&o));
        o
    };
    let whole = dir.path().join("whole.safetensors");
    launch(&whole, 12, &[]);
    launch(
        &dir.path().join("part.safetensors"),
        6,
        &["--checkpoint-every", "6", "--checkpoint-dir", &c],
    );
    assert!(ckpt.join("checkpoint_6").join("rng_1.json").is_file());
    let resumed = dir.path().join("resumed.safetensors");
    launch(&resumed, 12, &["--resume", "--checkpoint-dir", &c]);
    assert_eq!(
        max_abs_diff_flat(&load_flat(&whole), &load_flat(&resumed)),
        0.0
    );
}

#[test]
fn bf16_mixed_precision_trains_below_the_unigram_entropy() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let o = run_gpt(&[
        "--context",
        "16",
        "--max-steps",
        "100",
        "--mixed-precision",
        "bf16",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("mixed_precision=bf16"));
    let l = metric_losses(&metrics);
    let end = mean(&l[l.len() - 10..]);
    let entropy = char_entropy(&sonnets());
    assert!(end < entropy - 0.3, "{end} vs {entropy}");
}

/// Runs the example with `args`, expects failure, and returns its stderr.
fn refused(args: &[&str]) -> String {
    let o = run_gpt(args);
    assert!(!o.status.success(), "accepted {args:?}:\n{}", text(&o));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn bad_flags_and_bad_text_files_are_refused_with_the_flag_named() {
    let dir = tempfile::tempdir().unwrap();
    let e = refused(&["--width", "30", "--heads", "4"]);
    assert!(e.contains("--width 30") && e.contains("--heads 4"), "{e}");
    assert!(e.contains("divisible"), "{e}");

    let e = refused(&["--batch-size", "0"]);
    assert!(e.contains("--batch-size"), "{e}");
    let e = refused(&["--heads", "0"]);
    assert!(e.contains("--heads"), "{e}");

    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, b"").unwrap();
    let e = refused(&["--text", empty.to_str().unwrap()]);
    assert!(e.contains("--text") && e.contains("empty"), "{e}");

    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9 au lait, caf\xe9 noir").unwrap();
    let e = refused(&["--text", latin1.to_str().unwrap()]);
    assert!(e.contains("--text") && e.contains("not UTF-8"), "{e}");
    assert!(e.contains("offset 3"), "{e}");

    let short = dir.path().join("short.txt");
    std::fs::write(&short, "a short text of forty characters, or so.").unwrap();
    let e = refused(&["--text", short.to_str().unwrap(), "--context", "64"]);
    assert!(
        e.contains("--context 64") && e.contains("larger than the text"),
        "{e}"
    );

    let missing = dir.path().join("missing.txt");
    let e = refused(&["--text", missing.to_str().unwrap()]);
    assert!(e.contains("--text") && e.contains("missing.txt"), "{e}");

    let e = refused(&["--mixed-precision", "fp8"]);
    assert!(e.contains("fp8"), "{e}");

    let e = refused(&["--dropout", "1"]);
    assert!(e.contains("--dropout") && e.contains("[0, 1)"), "{e}");
}

/// `--max-steps` means what transformers' `max_steps` means: it overrides `--epochs`, the run
/// takes exactly that many optimizer steps over as many epochs as they need, and the schedule
/// spans them. The text gives fewer steps per epoch than that (checked from the windows the run
/// reports), and the linear schedule's rate at step `s` (0-based) is `lr · (10 − s) / 10`.
#[test]
fn max_steps_overrides_epochs_and_the_schedule_spans_all_its_steps() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("short.txt");
    // Windows of 4 to 8 characters overlapping by half over 132 characters: about 30.
    std::fs::write(&file, "abcdefghijk".repeat(12)).unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let (steps, lr) = (10u64, 0.01);
    let small = "--context 8 --layers 1 --width 8 --heads 1 --batch-size 8 --epochs 1";
    let mut flags: Vec<String> = small.split(' ').map(String::from).collect();
    flags.extend(["--text".into(), file.to_str().unwrap().into()]);
    flags.extend([
        "--max-steps".into(),
        steps.to_string(),
        "--lr".into(),
        lr.to_string(),
    ]);
    flags.extend(["--schedule", "linear", "--metrics"].map(String::from));
    flags.push(metrics.to_str().unwrap().into());
    let o = run_gpt(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    let windows: usize = out
        .split(" windows of 4..=8 characters")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no window count in the output:\n{out}"));
    assert!(
        windows.div_ceil(8) < 5,
        "{windows} windows: the test needs fewer than 5 steps per epoch\n{out}"
    );
    assert_eq!(summary_value::<u64>(&o, "steps"), steps, "{out}");
    let rates: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(rates.len(), steps as usize, "{out}");
    for (s, rate) in rates.iter().enumerate() {
        let expected = lr * (steps - s as u64) as f64 / steps as f64;
        assert!(
            (rate - expected).abs() < 1e-12,
            "step {s}: lr {rate}, expected {expected}"
        );
    }
}
