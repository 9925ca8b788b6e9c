//! ZeRO stage 3's memory proof, through the launcher: per-rank memory is (parameters +
//! gradients + optimizer state) / N plus a unit and the activations, so a model that does not
//! fit one rank's budget trains on 2 and 3 ranks, and ends where stage 0 on one process does.
//! And the `mlp` example at `--zero-stage 3` trains as it does at stage 0.
//!
//! The budget is a heap budget: the test program (`tests/bin/heap_budget.rs`) counts every byte
//! its global allocator hands out and refuses to go past `ACCELERATE_TEST_HEAP_BUDGET`.

use std::path::Path;
use std::time::Duration;

use accelerate_tests::{
    built_binary, load_flat, max_abs_diff_flat, metric_losses, output_text, small_mlp_args, Job,
};
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(240);

/// The heap test's model: 16 units of one 512 × 512 linear layer with bias each.
const LAYERS: usize = 16;
const WIDTH: usize = 512;
/// Elements of one unit, and of the model.
const UNIT: usize = WIDTH * WIDTH + WIDTH;
const P: usize = LAYERS * UNIT;
/// The global batch: 48 rows, split evenly over 1, 2 or 3 ranks.
const BATCH: usize = 48;

/// The budget: 15 bytes per parameter. Under plain data parallelism (stage 0) AdamW's training
/// state alone is 16 (the f32 parameter, its gradient buffer, two moments) on every rank, so the
/// model does not fit; fully sharded on N ranks the state is 16/N (8 on two ranks), and the
/// rest of [`training_bound`] is a few units and the activations.
const BUDGET: usize = 15 * P;

/// Runs the heap test program on `n` ranks under the launcher at `stage`, with the budget or
/// without.
fn heap_job(n: usize, stage: u8, budget: Option<usize>) -> accelerate_tests::JobOutput {
    let mut job = Job::new(built_binary("accelerate-test-heap"))
        .ranks(n)
        .launcher_flags(["--zero-stage", &stage.to_string()])
        .args(["--layers", &LAYERS.to_string()])
        .args(["--width", &WIDTH.to_string()])
        .args(["--batch", &BATCH.to_string()])
        .args(["--steps", "3"])
        .limit(LIMIT);
    job = match budget {
        Some(b) => job.env("ACCELERATE_TEST_HEAP_BUDGET", b.to_string()),
        None => job.env_remove("ACCELERATE_TEST_HEAP_BUDGET"),
    };
    job.run()
}

/// The `result: {json}` line of a successful run.
fn result(o: &accelerate_tests::JobOutput) -> Value {
    assert!(o.status.success(), "{}", output_text(o));
    let out = o.stdout_text();
    let line = out
        .lines()
        .find_map(|l| l.split_once("result: ").map(|(_, json)| json))
        .unwrap_or_else(|| panic!("no result line:\n{}", output_text(o)));
    serde_json::from_str(line).unwrap()
}

fn floats(v: &Value, key: &str) -> Vec<f64> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} in {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Unit elements padded to a multiple of `n` (each unit is one flat buffer cut into n blocks).
fn padded_unit(n: usize) -> usize {
    UNIT.div_ceil(n) * n
}

/// The parts of what one rank of `n` may allocate over the training steps at stage 3, beyond
/// what it held before the model existed, in bytes: see [`training_bound`].
fn training_terms(n: usize) -> [(&'static str, usize); 4] {
    let block = LAYERS * padded_unit(n) / n;
    let activation = (BATCH / n) * WIDTH * 4;
    [
        // Its 1/N of the parameters, of their gradients and of AdamW's two moments, in f32.
        ("16P/N state", 16 * block),
        // Each unit's reduce-scattered block of the averaged gradient, held from the unit's
        // backward pass until the step's end hands them all to the optimizer's gradients.
        ("4P/N reduced blocks", 4 * block),
        // During one unit's backward pass, whole units in f32: the gathered buffer and its copy
        // into fresh variables, the recomputation's gradients as candle's backward pass builds
        // them (a zero tensor, the term added into it and the sum, for the weight and again for
        // its transpose), the unit's window gradient sum, and the reduce-scatter's buffers.
        ("8 units", 8 * 4 * padded_unit(n)),
        // Every unit's input and output kept by the graph, and a dozen more such tensors while a
        // unit is recomputed and differentiated and while the loss is.
        ("activations", (2 * LAYERS + 12) * activation),
    ]
}

/// The most one rank of `n` may allocate over the training steps beyond what it held before the
/// model existed, at stage 3: [`training_terms`] with a quarter of slack.
fn training_bound(n: usize) -> f64 {
    1.25 * training_terms(n).iter().map(|(_, b)| b).sum::<usize>() as f64
}

/// What one rank of `n` may allocate from the start through `prepare` and the optimizer's
/// construction, beyond what it held before, with the same slack: the whole model (every rank
/// builds it before `prepare` cuts it: 4 bytes per parameter), and its pieces and their gradient
/// buffers (4 bytes each per element of its blocks; AdamW's moments come at its first step).
fn setup_bound(n: usize) -> f64 {
    1.25 * (4 * P + 8 * LAYERS * padded_unit(n) / n) as f64
}

/// The memory proof. A model whose parameters dominate (P = 4.2 M, 16 units) under a
/// heap budget of 15 bytes per parameter: stage 0 on one process runs out (the allocator's
/// refusal names the allocation), stage 3 on 2 and on 3 ranks trains within it, ends within
/// 1e-6 of an unbudgeted stage-0 run on one process, and each rank's peak stays within the bound
/// derived from the model.
#[test]
fn a_model_too_large_for_one_rank_trains_fully_sharded_on_two_and_three() {
    let reference = result(&heap_job(1, 0, None));
    assert_eq!(reference["parameters"].as_u64(), Some(P as u64));
    let ref_losses = floats(&reference, "losses");
    assert!(
        ref_losses[2] < ref_losses[0],
        "training lowers the loss: {ref_losses:?}"
    );
    let ref_train = floats(&reference, "train_peak_bytes")[0];
    let ref_base = floats(&reference, "base_bytes")[0];
    eprintln!(
        "stage 0, 1 rank, no budget: base {:.1} MiB, setup peak {:.1} MiB, training peak {:.1} \
         MiB; the budget is {:.1} MiB",
        ref_base / 1048576.0,
        floats(&reference, "setup_peak_bytes")[0] / 1048576.0,
        ref_train / 1048576.0,
        BUDGET as f64 / 1048576.0
    );
    // The count sees the model: stage 0 holds its 16 bytes per parameter during training.
    assert!(ref_train - ref_base >= 16.0 * P as f64, "{ref_train}");
    assert!(ref_train > BUDGET as f64, "the budget binds stage 0");

    let refused = heap_job(1, 0, Some(BUDGET));
    let text = output_text(&refused);
    assert!(!refused.status.success(), "stage 0 fit the budget:\n{text}");
    assert!(
        text.contains("memory allocation of") && text.contains("bytes failed"),
        "the refusal names the allocation:\n{text}"
    );

    for n in [2, 3] {
        let run = result(&heap_job(n, 3, Some(BUDGET)));
        assert_eq!(run["zero_stage"].as_u64(), Some(3));
        assert_eq!(run["ranks"].as_u64(), Some(n as u64));
        let losses = floats(&run, "losses");
        let d_loss = max_diff(&losses, &ref_losses);
        let d_probe = max_diff(&floats(&run, "probe"), &floats(&reference, "probe"));
        let d_probe_loss =
            (run["probe_loss"].as_f64().unwrap() - reference["probe_loss"].as_f64().unwrap()).abs();
        let (sq, ref_sq) = (
            run["param_sq"].as_f64().unwrap(),
            reference["param_sq"].as_f64().unwrap(),
        );
        eprintln!(
            "stage 3, {n} ranks, budget {:.1} MiB: max |Δ loss| {d_loss:e}, max |Δ probe| \
             {d_probe:e}, |Δ probe loss| {d_probe_loss:e}, Σθ² {sq} against {ref_sq}",
            BUDGET as f64 / 1048576.0
        );
        assert!(
            d_loss <= 1e-6,
            "{n} ranks: losses {losses:?} vs {ref_losses:?}"
        );
        assert!(
            d_probe <= 1e-6,
            "{n} ranks: probe outputs differ by {d_probe}"
        );
        assert!(
            d_probe_loss <= 1e-6,
            "{n} ranks: probe loss differs by {d_probe_loss}"
        );
        assert!(
            ((sq - ref_sq) / ref_sq).abs() <= 1e-6,
            "{n} ranks: Σθ² {sq} vs {ref_sq}"
        );

        let bases = floats(&run, "base_bytes");
        let setups = floats(&run, "setup_peak_bytes");
        let trains = floats(&run, "train_peak_bytes");
        assert_eq!(trains.len(), n);
        for r in 0..n {
            let (train, setup) = (trains[r] - bases[r], setups[r] - bases[r]);
            let terms: Vec<String> = training_terms(n)
                .iter()
                .map(|(what, b)| format!("{what} {:.2}", *b as f64 / 1048576.0))
                .collect();
            eprintln!(
                "  rank {r}: base {:.2} MiB; training peak {:.2} MiB above it, bound {:.2} MiB \
                 = 1.25 × ({}); setup peak {:.2} MiB above it, bound {:.2} MiB",
                bases[r] / 1048576.0,
                train / 1048576.0,
                training_bound(n) / 1048576.0,
                terms.join(" + "),
                setup / 1048576.0,
                setup_bound(n) / 1048576.0
            );
            assert!(
                train <= training_bound(n),
                "{n} ranks, rank {r}: training peak {train} > bound {}",
                training_bound(n)
            );
            assert!(
                setup <= setup_bound(n),
                "{n} ranks, rank {r}: setup peak {setup} > bound {}",
                setup_bound(n)
            );
            // The count sees the sharded state: at least its 16 bytes per element of a block.
            assert!(train >= (16 * P / n) as f64, "{n} ranks, rank {r}: {train}");
        }
    }
}

/// The `mlp` example's arguments for the stage comparison, writing the model to `out` and the
/// per-step losses to `metrics`.
fn mlp_args(batch: usize, k: usize, optimizer: &str, out: &Path, metrics: &Path) -> Vec<String> {
    let mut args = small_mlp_args(240, batch, optimizer, 11, out);
    args.extend(
        [
            "--grad-accum",
            &k.to_string(),
            "--metrics",
            metrics.to_str().unwrap(),
            "--eval-fraction",
            "0.2",
            "--eval-steps",
            "3",
        ]
        .map(String::from),
    );
    args
}

/// The `mlp` example, one unit per layer, on 2 and 3 ranks × K = 1, 2 under the launcher, with
/// AdamW and with SGD: at `--zero-stage 3` every step's global loss, the evaluations and the
/// saved model are stage 0's within 1e-6 (on two ranks a mean of two is the same sum either way:
/// bit for bit).
#[test]
fn the_mlp_example_at_stage_three_trains_as_at_stage_zero() {
    let dir = tempfile::tempdir().unwrap();
    let grid = [
        (2, 1, "adamw"),
        (2, 2, "sgd"),
        (3, 1, "sgd"),
        (3, 2, "adamw"),
    ];
    for (n, k, optimizer) in grid {
        let mut runs = Vec::new();
        for stage in [0u8, 3] {
            let out = dir
                .path()
                .join(format!("model_{n}_{k}_{stage}.safetensors"));
            let metrics = dir.path().join(format!("metrics_{n}_{k}_{stage}.jsonl"));
            let o = Job::example("mlp")
                .ranks(n)
                .args(mlp_args(4, k, optimizer, &out, &metrics))
                .args(["--zero-stage", &stage.to_string()])
                .limit(LIMIT)
                .run();
            assert!(o.status.success(), "{}", output_text(&o));
            assert_eq!(o.summary::<u8>("zero_stage"), stage, "{}", output_text(&o));
            let eval: f64 = o.summary("eval_loss");
            runs.push((load_flat(&out), metric_losses(&metrics), eval, o));
        }
        let (stage0, stage3) = (&runs[0], &runs[1]);
        let d_model = max_abs_diff_flat(&stage3.0, &stage0.0);
        let d_loss = max_diff(&stage3.1, &stage0.1);
        let d_eval = (stage3.2 - stage0.2).abs();
        eprintln!(
            "mlp, {n} ranks, K={k}, {optimizer}: stage 3 against stage 0: max |Δθ| {d_model:e}, max |Δ loss| \
             {d_loss:e}, |Δ eval_loss| {d_eval:e}"
        );
        assert_eq!(stage0.1.len(), stage3.1.len());
        assert!(stage0.1.len() >= 4, "{:?}", stage0.1);
        assert!(d_model <= 1e-6, "{n} ranks, K={k}: max |Δθ| = {d_model}");
        assert!(
            d_loss <= 1e-6,
            "{n} ranks, K={k}: {:?} vs {:?}",
            stage3.1,
            stage0.1
        );
        assert!(
            d_eval <= 1e-6,
            "{n} ranks, K={k}: eval_loss {} vs {}",
            stage3.2,
            stage0.2
        );
        // Stage 3 moved the weights: the comparison could have failed.
        let initial = dir.path().join("initial.safetensors");
        let init_metrics = dir.path().join("initial.jsonl");
        let mut a = mlp_args(4, k, optimizer, &initial, &init_metrics);
        a.extend(["--max-steps".into(), "0".into()]);
        let o = Job::mlp(1).limit(LIMIT).args(a).run();
        assert!(o.status.success(), "{}", output_text(&o));
        assert!(max_abs_diff_flat(&load_flat(&initial), &stage3.0) > 1e-3);
        if n == 2 {
            assert_eq!(stage3.0, stage0.0, "K={k}: two ranks, bit for bit");
        }
    }
}
