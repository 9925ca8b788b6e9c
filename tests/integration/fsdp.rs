//! ZeRO stage 3 (fully sharded) against plain data parallel (stage 0) and against one process
//! training on the whole global batch with PyTorch's update rules written out
//! (`ReferenceOptimizer`).
//!
//! The tiny MLP runs as two units, `l1` (its input is the data, which needs no gradient: the
//! unit's node hangs on its anchor) and `l2` (its input is `l1`'s output). Its 56- and 27-element
//! units are cut so that rank pieces straddle parameters and the last block is padded, on 2 and
//! on 3 ranks. Ranks are threads of this process (`ranks_as_threads`), over the CPU communicator.

use accelerate_core::optim::{AdamW, AdamWConfig};
use accelerate_core::{Accelerator, GradientSyncStats, Model, PreparedModel, UnitSpec};
use accelerate_tests::{
    bits, global_batch_reference, load_flat, max_abs_diff_flat, max_diff, named_vars,
    prepared_step, ranks_as_threads, snapshot, tiny_data, tiny_forward_units as forward_units,
    tiny_mlp, tiny_units as units, Opt,
};
use candle_core::Tensor;

const BATCH: usize = 3;
const STEPS: usize = 4;

/// How a run computes the model.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    /// The tiny MLP's own forward over its `Linear`s (stage 0 only).
    Plain,
    /// Through the prepared model's units.
    Units,
    /// Through the units, each micro-batch in two parts: every unit runs twice per pass.
    Split,
}

/// One rank's outcome: the whole parameters after training (sorted by name), the norms
/// `clip_grad_norm` reported, and the gradient traffic.
type RankResult = (Vec<Vec<f32>>, Vec<f64>, GradientSyncStats);

/// Trains the tiny MLP for `STEPS` optimizer steps on `n` ranks, K micro-batches of `BATCH`, under
/// `stage`; rank r's micro-step j of step s takes samples `s·G + (j·n + r)·BATCH ..` of the global
/// batch of `G = n·K·BATCH`. With `clip`, gradients are clipped to that norm.
fn train(
    n: usize,
    k: usize,
    stage: u8,
    opt: Opt,
    path: Path,
    clip: Option<f64>,
) -> Vec<RankResult> {
    train_with(n, k, stage, (opt, path, clip), None)
}

/// [`train`] with the units gathered `prefetch` = (forward, backward) units ahead (`None`: the
/// default).
fn train_with(
    n: usize,
    k: usize,
    stage: u8,
    (opt, path, clip): (Opt, Path, Option<f64>),
    prefetch: Option<(usize, usize)>,
) -> Vec<RankResult> {
    let global = n * k * BATCH;
    let (x, y) = tiny_data(global * STEPS, 5).unwrap();
    ranks_as_threads(
        n,
        || {
            let builder = Accelerator::builder()
                .gradient_accumulation_steps(k)
                .zero_stage(stage);
            match prefetch {
                Some((forward, backward)) => builder.fsdp_prefetch(forward, backward),
                None => builder,
            }
        },
        |mut acc| {
            let (varmap, mlp) = tiny_mlp(3).unwrap();
            let model = acc
                .prepare_model(Model::new(named_vars(&varmap)).units(units()))
                .unwrap();
            let params = model.parameters().to_vec();
            let mut step = prepared_step(&mut acc, params.clone(), opt);
            let rank = acc.process_index();
            let mut norms = Vec::new();
            for s in 0..STEPS {
                for j in 0..k {
                    let start = s * global + (j * n + rank) * BATCH;
                    let _m = acc.accumulate();
                    let xb = x.narrow(0, start, BATCH).unwrap();
                    let logits = match path {
                        Path::Plain => mlp.forward(&xb).unwrap(),
                        Path::Units => forward_units(&model, &xb).unwrap(),
                        Path::Split => {
                            let first = forward_units(&model, &xb.narrow(0, 0, 1).unwrap());
                            let rest = forward_units(&model, &xb.narrow(0, 1, BATCH - 1).unwrap());
                            Tensor::cat(&[first.unwrap(), rest.unwrap()], 0).unwrap()
                        }
                    };
                    let loss = candle_nn::loss::cross_entropy(
                        &logits,
                        &y.narrow(0, start, BATCH).unwrap(),
                    )
                    .unwrap();
                    acc.backward(&loss).unwrap();
                    if let Some(max) = clip {
                        if let Some(norm) = acc.clip_grad_norm(max).unwrap() {
                            norms.push(norm);
                        }
                    }
                    step();
                }
            }
            let whole: Vec<Vec<f32>> = model
                .whole_parameters()
                .unwrap()
                .iter()
                .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .collect();
            (whole, norms, acc.gradient_sync_stats())
        },
    )
}

/// One process, the whole global batch per step, PyTorch's rules (`ReferenceOptimizer`).
fn reference(n: usize, k: usize, opt: Opt) -> Vec<Vec<f32>> {
    global_batch_reference(n, k, BATCH, STEPS, opt)
}

/// Stage 3 on 1, 2 and 3 ranks, K = 1 and 2, SGD with momentum and AdamW: every rank ends with the
/// parameters of one process training on the global batch, and with stage 0's. The units path
/// at stage 0 is the plain model bit for bit (it is the same call).
#[test]
fn stage_three_trains_as_one_process_on_the_global_batch() {
    for opt in [Opt::SgdMomentum, Opt::AdamW] {
        for n in [1, 2, 3] {
            for k in [1, 2] {
                let expected = reference(n, k, opt);
                let initial = snapshot(&named_vars(&tiny_mlp(3).unwrap().0));
                assert!(
                    max_diff(&expected, &initial) > 1e-2,
                    "training moved the weights"
                );
                let plain = train(n, k, 0, opt, Path::Plain, None);
                let units0 = train(n, k, 0, opt, Path::Units, None);
                assert_eq!(
                    bits(&units0[0].0),
                    bits(&plain[0].0),
                    "{opt:?} n={n} k={k}: the units path at stage 0 is the plain model"
                );
                let sharded = train(n, k, 3, opt, Path::Units, None);
                for (rank, (got, _, _)) in sharded.iter().enumerate() {
                    let d = max_diff(got, &expected);
                    assert!(
                        d < 1e-5,
                        "{opt:?} n={n} k={k} rank {rank}: max |Δ| = {d} against one process"
                    );
                    assert_eq!(bits(got), bits(&sharded[0].0), "ranks agree bitwise");
                }
                let d = max_diff(&sharded[0].0, &plain[0].0);
                eprintln!("{opt:?} n={n} k={k}: stage 3 against stage 0, max |Δ| = {d:e}");
                if n == 2 {
                    assert_eq!(
                        bits(&sharded[0].0),
                        bits(&plain[0].0),
                        "{opt:?} n=2 k={k}: on two ranks a mean of two is the same sum either way"
                    );
                } else {
                    assert!(
                        d <= 1e-6,
                        "{opt:?} n={n} k={k}: max |Δ| = {d} against stage 0"
                    );
                }
            }
        }
    }
}

/// A unit may run several times in one pass (Llama's packed rows run every unit once per group
/// of documents): its gradients are summed over the runs and reduced after its last backward.
/// Stage 3 then trains as stage 0 running the same split.
#[test]
fn units_run_several_times_per_pass_train_as_stage_zero() {
    for n in [2, 3] {
        let plain = train(n, 2, 0, Opt::AdamW, Path::Split, None);
        // Gathered as each unit runs: the counts below are those of the design.
        let sharded = train_with(n, 2, 3, (Opt::AdamW, Path::Split, None), Some((0, 0)));
        let d = max_diff(&sharded[0].0, &plain[0].0);
        eprintln!("split batches, n={n}: stage 3 against stage 0, max |Δ| = {d:e}");
        assert!(d <= 1e-6, "n={n}: max |Δ| = {d}");
        let whole = train(n, 2, 0, Opt::AdamW, Path::Units, None);
        assert!(
            max_diff(&plain[0].0, &whole[0].0) <= 1e-5,
            "splitting the batch changes only the order of sums"
        );
        // Each unit gathered for its 2 forward and 2 backward runs, per micro-step.
        assert_eq!(sharded[0].2.all_gathers, 2 * 4 * (STEPS * 2) as u64);
        assert_eq!(sharded[0].2.reduce_scatters, 2 * STEPS as u64);
    }
}

/// Gradient traffic at stage 3: each micro-step gathers each unit twice (forward, backward); only
/// the sync micro-step reduce-scatters, once per unit, plus two small all-reduces that agree on
/// the units' run counts and on presence and overflow; nothing is all-reduced whole.
#[test]
fn only_the_sync_micro_step_reduces_and_every_pass_gathers() {
    let (n, k) = (2, 2);
    let runs = train_with(n, k, 3, (Opt::AdamW, Path::Units, None), Some((0, 0)));
    let stats = runs[0].2;
    let micro_steps = (STEPS * k) as u64;
    assert_eq!(stats.all_gathers, 2 * 2 * micro_steps);
    // Two units of 56 and 27 elements, padded to 56 and 28 on 2 ranks, in f32, twice per
    // micro-step.
    assert_eq!(stats.gather_bytes, 2 * micro_steps * (56 + 28) * 4);
    assert_eq!(
        stats.reduce_scatters,
        2 * STEPS as u64,
        "two units, once per optimizer step"
    );
    assert_eq!(
        stats.all_reduces,
        2 * STEPS as u64,
        "per optimizer step: the units' run counts, then the verdict"
    );
    // Unit buffers of 56 and 27 elements, padded to 56 and 28 on 2 ranks, in f32; the run
    // counts of 2 units and their negations; presence of 4 parameters and the overflow flag.
    assert_eq!(
        stats.bytes,
        STEPS as u64 * ((56 + 28) * 4 + 2 * 2 * 4 + (4 + 1) * 4)
    );
}

/// Prefetch (units gathered ahead on a thread of their own) changes when the units are
/// gathered, not what: every depth trains bit for bit as gathering each unit when it runs, on 2
/// and 3 ranks. Where the units run in the same order every pass, no gather is wasted: as many
/// as without prefetch, of which those the order predicts are issued ahead: after the first
/// forward pass, the second unit's gather in each forward, and from the first backward pass on,
/// the first unit's gather in each backward.
#[test]
fn prefetch_gathers_ahead_and_trains_bitwise_as_without() {
    let k = 2;
    let micro_steps = (STEPS * k) as u64;
    for n in [2, 3] {
        let off = train_with(n, k, 3, (Opt::AdamW, Path::Units, None), Some((0, 0)));
        assert_eq!(off[0].2.gathers_ahead, 0);
        for (depth, ahead) in [
            ((1, 1), 2 * micro_steps - 1),
            ((2, 2), 2 * micro_steps - 1),
            ((1, 0), micro_steps - 1),
            ((0, 1), micro_steps),
        ] {
            let on = train_with(n, k, 3, (Opt::AdamW, Path::Units, None), Some(depth));
            assert_eq!(bits(&on[0].0), bits(&off[0].0), "n={n} {depth:?}");
            assert_eq!(on[0].2.all_gathers, off[0].2.all_gathers, "n={n} {depth:?}");
            assert_eq!(
                on[0].2.gather_bytes, off[0].2.gather_bytes,
                "n={n} {depth:?}"
            );
            assert_eq!(on[0].2.gathers_ahead, ahead, "n={n} {depth:?}");
        }
    }
    // Units run twice per pass: the order mispredicts at the passes' ends (a few gathers more),
    // and the training is still the same.
    let off = train_with(2, k, 3, (Opt::SgdMomentum, Path::Split, None), Some((0, 0)));
    let on = train_with(2, k, 3, (Opt::SgdMomentum, Path::Split, None), Some((2, 2)));
    assert_eq!(bits(&on[0].0), bits(&off[0].0));
    assert!(on[0].2.gathers_ahead > 0);
    assert!(on[0].2.all_gathers >= off[0].2.all_gathers);
}

/// `keep_gathered_in_window(true)`: each unit is gathered once per window (K = 2: 1 gather where
/// re-gathering makes 4) and the training is the same, bit for bit; an evaluation forward after
/// the step sees the updated weights (its logits equal the re-gathering run's).
#[test]
fn kept_gathered_units_train_alike_with_one_gather_per_window() {
    let (n, k) = (2, 2);
    let global = n * k * BATCH;
    let (x, y) = tiny_data(global * STEPS, 5).unwrap();
    let run = |keep: bool, ahead: usize| {
        ranks_as_threads(
            n,
            || {
                Accelerator::builder()
                    .gradient_accumulation_steps(k)
                    .zero_stage(3)
                    .keep_gathered_in_window(keep)
                    .fsdp_prefetch(ahead, ahead)
            },
            |mut acc| {
                let (varmap, _) = tiny_mlp(3).unwrap();
                let model = acc
                    .prepare_model(Model::new(named_vars(&varmap)).units(units()))
                    .unwrap();
                let mut step = prepared_step(&mut acc, model.parameters().to_vec(), Opt::AdamW);
                let rank = acc.process_index();
                let mut evals = Vec::new();
                for s in 0..STEPS {
                    for j in 0..k {
                        let start = s * global + (j * n + rank) * BATCH;
                        let _m = acc.accumulate();
                        let logits =
                            forward_units(&model, &x.narrow(0, start, BATCH).unwrap()).unwrap();
                        let loss = candle_nn::loss::cross_entropy(
                            &logits,
                            &y.narrow(0, start, BATCH).unwrap(),
                        )
                        .unwrap();
                        acc.backward(&loss).unwrap();
                        step();
                    }
                    let eval = forward_units(&model, &x.narrow(0, 0, BATCH).unwrap()).unwrap();
                    evals.push(eval.flatten_all().unwrap().to_vec1::<f32>().unwrap());
                }
                let whole: Vec<Vec<f32>> = model
                    .whole_parameters()
                    .unwrap()
                    .iter()
                    .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                    .collect();
                (whole, evals, acc.gradient_sync_stats())
            },
        )
    };
    let (regather, kept) = (run(false, 0), run(true, 0));
    assert_eq!(bits(&kept[0].0), bits(&regather[0].0), "the same training");
    let kept_ahead = run(true, 1);
    assert_eq!(
        bits(&kept_ahead[0].0),
        bits(&regather[0].0),
        "with prefetch too"
    );
    assert_eq!(kept_ahead[0].1, regather[0].1);
    // Evaluations between the steps link their last unit to the next window's first; where the
    // pass changes the links are cleared, so at most the first backward pass after each
    // evaluation gathers one unit ahead that the window may not use.
    let ahead = run(false, 1);
    assert_eq!(
        bits(&ahead[0].0),
        bits(&regather[0].0),
        "prefetch trains alike"
    );
    assert_eq!(ahead[0].1, regather[0].1, "and evaluates alike");
    let extra = ahead[0].2.all_gathers - regather[0].2.all_gathers;
    assert!(
        extra < STEPS as u64,
        "{extra} gathers more than without prefetch"
    );
    assert!(ahead[0].2.gathers_ahead > 0);
    assert_eq!(
        kept[0].1, regather[0].1,
        "evaluations see the updated weights"
    );
    // Gathers are counted by the next backward pass, so the last evaluation's are not. Two
    // units; re-gathering: every micro-step gathers each unit for its forward and its backward
    // (2·2·K per step), every evaluation each unit once. Kept: the first window gathers each
    // unit once; each evaluation after a step gathers the updated units, which the next window
    // then uses (2 per step in all).
    let steps = STEPS as u64;
    assert_eq!(
        regather[0].2.all_gathers,
        steps * 2 * 2 * k as u64 + (steps - 1) * 2
    );
    assert_eq!(kept[0].2.all_gathers, steps * 2);
}

/// `clip_grad_norm` at stage 3 adds the squares of every rank's pieces: stage 0's norm, and the
/// clipped training matches stage 0's.
#[test]
fn clip_grad_norm_at_stage_three_sees_every_piece() {
    for n in [2, 3] {
        let plain = train(n, 2, 0, Opt::AdamW, Path::Plain, Some(0.05));
        let sharded = train(n, 2, 3, Opt::AdamW, Path::Units, Some(0.05));
        let (p_norms, s_norms) = (&plain[0].1, &sharded[0].1);
        assert_eq!(p_norms.len(), STEPS);
        for (p, s) in p_norms.iter().zip(s_norms) {
            assert!(*p > 0.05, "the clip acts: norm {p}");
            assert!(
                ((p - s) / p).abs() < 1e-6,
                "n={n}: norm {s} at stage 3, {p} at stage 0"
            );
        }
        for rank in &sharded {
            assert_eq!(&rank.1, s_norms, "every rank reports the same norm");
            let d = max_diff(&rank.0, &plain[0].0);
            assert!(d <= 1e-6, "n={n}: clipped training max |Δ| = {d}");
        }
    }
}

/// A model prepared at stage 3 without units is refused, naming the fix.
#[test]
fn stage_three_needs_units() {
    let mut acc = Accelerator::builder().zero_stage(3).build().unwrap();
    let (varmap, _) = tiny_mlp(3).unwrap();
    let err = acc
        .prepare_model(Model::new(named_vars(&varmap)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("declares no units") && err.contains("Model::new(params).units"),
        "{err}"
    );
}

/// What stage 3 refuses, by name: a parameter read outside its unit (its gradient would be
/// lost); `save_model` writes the whole model, gathered, equal to the parameters.
#[test]
fn stage_three_refuses_what_it_cannot_train_and_saves_whole_models() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_path_buf();
    let results = ranks_as_threads(
        2,
        || Accelerator::builder().zero_stage(3),
        |mut acc| {
            let (x, y) = tiny_data(BATCH, 5).unwrap();
            let (varmap, mlp) = tiny_mlp(3).unwrap();
            let model = acc
                .prepare_model(Model::new(named_vars(&varmap)).units(units()))
                .unwrap();
            // The plain model reads the whole Vars it was built from.
            let _m = acc.accumulate();
            let logits = mlp.forward(&x).unwrap();
            let loss = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
            let outside = acc.backward(&loss).unwrap_err().to_string();
            acc.save_model(out.join("model")).unwrap();
            let whole = model.whole_parameters().unwrap();
            (outside, whole)
        },
    );
    let (outside, whole) = &results[0];
    assert!(
        outside.contains("read outside the model's units"),
        "{outside}"
    );
    let saved = accelerate_core::load_safetensors(
        out.join("model").join(accelerate_core::MODEL_SAFETENSORS),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let initial = named_vars(&tiny_mlp(3).unwrap().0);
    assert_eq!(saved.len(), initial.len());
    for ((name, t), (iname, ivar)) in whole.iter().zip(&initial) {
        assert_eq!(name, iname);
        let w = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let s = saved[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(s, w, "{name}: saved as gathered");
        let i = ivar.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(
            w, i,
            "{name}: no step was taken, so the weights are the initial ones"
        );
    }
    assert_eq!(results[1].1.len(), whole.len(), "rank 1 gathered too");
}

/// The bytes of `path`.
fn bytes(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// An example under the launcher on `n` CPU ranks at ZeRO `stage`, one compute thread each.
fn example_job(name: &str, n: usize, stage: u8) -> accelerate_tests::Job {
    accelerate_tests::Job::example(name)
        .ranks(n)
        .launcher_flags(["--zero-stage", &stage.to_string()])
        .env("RAYON_NUM_THREADS", "1")
        .limit(std::time::Duration::from_secs(300))
}

/// The `gpt` example at stage 3 on 2 and 3 ranks, K = 1 and 2, with AdamW and with SGD: the model
/// it saves is stage 0's, byte for byte (the units are recomputed bitwise on the CPU, and the
/// means are the same).
#[test]
fn the_gpt_example_at_stage_three_saves_stage_zeros_model() {
    let dir = tempfile::tempdir().unwrap();
    for n in [2, 3] {
        for k in [1, 2] {
            for optimizer in ["adamw", "sgd"] {
                let saved: Vec<Vec<u8>> = [0u8, 3]
                    .iter()
                    .map(|&stage| {
                        let path = dir
                            .path()
                            .join(format!("gpt-{n}-{k}-{optimizer}-{stage}.safetensors"));
                        let o = example_job("gpt", n, stage)
                            .args(["--max-steps", "4", "--batch-size", "4", "--width", "32"])
                            .args(["--context", "32", "--grad-accum", &k.to_string()])
                            .args(["--optimizer", optimizer])
                            .arg("--save-model")
                            .arg(&path)
                            .run();
                        assert!(o.status.success(), "{}", o.text());
                        assert_eq!(o.summary::<u8>("zero_stage"), stage);
                        bytes(&path)
                    })
                    .collect();
                assert!(
                    saved[0] == saved[1],
                    "n={n} k={k} {optimizer}: stage 3 saved another model than stage 0"
                );
            }
        }
    }
}

/// The `llama` example fine-tuning the fixture model directory on the JSONL and chat corpus
/// (packed rows: every unit runs once per group of documents) at stage 3 on 2 and 3 ranks with
/// K = 1 and 2, with AdamW and with SGD: the model directory it writes holds stage 0's weights,
/// byte for byte on 2 ranks (a mean of two is the same sum either way), within 1e-6 on 3.
/// Under bf16 its losses are stage 0's.
#[test]
fn the_llama_example_at_stage_three_fine_tunes_as_stage_zero() {
    let dir = tempfile::tempdir().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let grid = [
        (2, 2, "adamw"),
        (2, 2, "sgd"),
        (2, 1, "sgd"),
        (3, 1, "adamw"),
        (3, 2, "sgd"),
    ];
    for (n, k, optimizer) in grid {
        let weights: Vec<std::path::PathBuf> = [0u8, 3]
            .iter()
            .map(|&stage| {
                let out = dir
                    .path()
                    .join(format!("llama-{n}-{k}-{optimizer}-{stage}"));
                let o = example_job("llama", n, stage)
                    .arg("--model")
                    .arg(root.join("llama-dir"))
                    .arg("--train-file")
                    .arg(root.join("text/corpus.jsonl"))
                    .arg(root.join("text/chat.jsonl"))
                    .args([
                        "--block-size",
                        "32",
                        "--batch-size",
                        "4",
                        "--max-steps",
                        "4",
                    ])
                    .args(["--grad-accum", &k.to_string(), "--optimizer", optimizer])
                    .arg("--output-dir")
                    .arg(&out)
                    .run();
                assert!(o.status.success(), "{}", o.text());
                out.join("model.safetensors")
            })
            .collect();
        let what = format!("{n} ranks, K={k}, {optimizer}");
        if n == 2 {
            assert!(
                bytes(&weights[0]) == bytes(&weights[1]),
                "{what}: stage 3 wrote other weights than stage 0"
            );
        } else {
            let (plain, sharded) = (load_flat(&weights[0]), load_flat(&weights[1]));
            let d = max_abs_diff_flat(&plain, &sharded);
            eprintln!("llama, {what}: stage 3 against stage 0, max |Δθ| = {d:e}");
            assert!(d <= 1e-6, "{what}: max |Δθ| = {d}");
        }
    }
    let losses: Vec<Vec<f64>> = [0u8, 3]
        .iter()
        .map(|&stage| {
            let metrics = dir.path().join(format!("bf16-{stage}.jsonl"));
            let o = example_job("llama", 2, stage)
                .launcher_flags(["--mixed-precision", "bf16"])
                .args(["--max-steps", "4", "--grad-accum", "2"])
                .arg("--metrics")
                .arg(&metrics)
                .run();
            assert!(o.status.success(), "{}", o.text());
            accelerate_tests::metric_losses(&metrics)
        })
        .collect();
    assert_eq!(losses[0].len(), 4);
    for (a, b) in losses[0].iter().zip(&losses[1]) {
        assert!(
            (a - b).abs() <= 1e-6 * a.abs(),
            "bf16: loss {b} at stage 3, {a} at stage 0"
        );
    }
}

/// fp16 at stage 3: only rank 1's gradient overflows, in elements whose averaged gradient rank 0
/// keeps. Every rank sees it and skips the step alike, the loss scale halves everywhere, nothing
/// moves; the next, finite step updates every rank alike (`w` is one unit of 8 elements, 4 per
/// rank).
#[test]
fn an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank() {
    use accelerate_core::optim::{Sgd, SgdConfig};
    use accelerate_core::MixedPrecision;
    let per_rank = ranks_as_threads(
        2,
        || {
            Accelerator::builder()
                .zero_stage(3)
                .mixed_precision(MixedPrecision::Fp16)
        },
        |mut acc| {
            let dtype = acc.compute_dtype();
            let w = candle_core::Var::from_tensor(
                &Tensor::full(0.5f32, 8, &candle_core::Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap();
            let model = acc
                .prepare_model(
                    Model::new(vec![("w".to_string(), w)]).units(vec![UnitSpec::new("w", ["w"])]),
                )
                .unwrap();
            let cfg = SgdConfig {
                lr: 0.1,
                ..SgdConfig::default()
            };
            let params = model.parameters().to_vec();
            let mut opt = acc.prepare(Sgd::new(params, cfg).unwrap()).unwrap();
            let rank = acc.process_index();
            let whole =
                |m: &PreparedModel| m.whole_parameters().unwrap()[0].1.to_vec1::<f32>().unwrap();
            let initial = whole(&model);
            let mut train_on = |x: Vec<f32>| {
                let x = Tensor::new(x.as_slice(), &candle_core::Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let _m = acc.accumulate();
                let unit = model.unit("w").unwrap();
                let wx = unit.forward(&x, |x, p| p.get("w")? * x).unwrap();
                let loss = wx
                    .to_dtype(candle_core::DType::F32)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                acc.backward(&loss).unwrap();
                opt.step().unwrap();
                opt.zero_grad();
            };
            // Rank 1's gradient at elements 0..4 (rank 0's piece) is 1e4 · 2^16: beyond f16's
            // 65504, so inf in the backward pass; rank 0's is small everywhere.
            let big = if rank == 1 { 1e4f32 } else { 0.5 };
            train_on((0..8).map(|i| if i < 4 { big } else { 0.25 }).collect());
            let skipped = (acc.step_was_skipped(), acc.loss_scale(), whole(&model));
            // A finite step: x = 0.25 everywhere on both ranks, so every element moves by -0.025.
            train_on(vec![0.25; 8]);
            (initial, skipped, acc.step_was_skipped(), whole(&model))
        },
    );
    for (rank, (initial, (skipped, scale, after_skip), skipped_again, after)) in
        per_rank.into_iter().enumerate()
    {
        assert!(skipped, "rank {rank} skipped the overflowing step");
        assert_eq!(scale, Some(32768.0), "rank {rank}: the scale halved");
        assert_eq!(after_skip, initial, "rank {rank}: nothing moved");
        assert!(!skipped_again);
        for v in &after {
            assert!((v - (0.5 - 0.1 * 0.25)).abs() < 1e-6, "rank {rank}: {v}");
        }
    }
}

/// bf16 at stage 3 (gathers and compute in bf16, f32 masters, f32 reductions) against stage 2
/// (bf16 compute copies of f32 masters, f32 reductions): the same arithmetic, so the same
/// weights, on 2 and 3 ranks with K = 2.
#[test]
fn bf16_at_stage_three_trains_as_stage_two() {
    use accelerate_core::MixedPrecision;
    for n in [2, 3] {
        let global = n * 2 * BATCH;
        let (x, y) = tiny_data(global * STEPS, 5).unwrap();
        let run = |stage: u8| {
            ranks_as_threads(
                n,
                || {
                    Accelerator::builder()
                        .gradient_accumulation_steps(2)
                        .mixed_precision(MixedPrecision::Bf16)
                        .zero_stage(stage)
                },
                |mut acc| {
                    let (varmap, _) = accelerate_tests::tiny_mlp(3).unwrap();
                    let vars: Vec<(String, candle_core::Var)> = named_vars(&varmap)
                        .into_iter()
                        .map(|(name, v)| {
                            let half = v.as_tensor().to_dtype(candle_core::DType::BF16).unwrap();
                            (name, candle_core::Var::from_tensor(&half).unwrap())
                        })
                        .collect();
                    let model = acc.prepare_model(Model::new(vars).units(units())).unwrap();
                    let cfg = AdamWConfig {
                        lr: 0.02,
                        weight_decay: 0.1,
                        ..AdamWConfig::default()
                    };
                    let params = model.parameters().to_vec();
                    let mut opt = acc.prepare(AdamW::new(params, cfg).unwrap()).unwrap();
                    let rank = acc.process_index();
                    for s in 0..STEPS {
                        for j in 0..2 {
                            let start = s * global + (j * n + rank) * BATCH;
                            let _m = acc.accumulate();
                            let xb = x
                                .narrow(0, start, BATCH)
                                .unwrap()
                                .to_dtype(candle_core::DType::BF16)
                                .unwrap();
                            let logits = forward_units(&model, &xb)
                                .unwrap()
                                .to_dtype(candle_core::DType::F32)
                                .unwrap();
                            let loss = candle_nn::loss::cross_entropy(
                                &logits,
                                &y.narrow(0, start, BATCH).unwrap(),
                            )
                            .unwrap();
                            acc.backward(&loss).unwrap();
                            opt.step().unwrap();
                            opt.zero_grad();
                        }
                    }
                    model
                        .whole_parameters()
                        .unwrap()
                        .iter()
                        .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                        .collect::<Vec<_>>()
                },
            )
        };
        let (two, three) = (run(2), run(3));
        let initial = snapshot(&named_vars(&tiny_mlp(3).unwrap().0));
        assert!(
            max_diff(&two[0], &initial) > 1e-2,
            "training moved the weights"
        );
        let d = max_diff(&two[0], &three[0]);
        eprintln!("bf16, n={n}: stage 3 against stage 2, max |Δ| = {d:e}");
        assert!(d <= 1e-6, "n={n}: max |Δ| = {d}");
    }
}

/// The worker's `tiny_train` at stage 3 builds its model on the host and prepares it with units
/// (on a GPU, `prepare` then moves only each rank's pieces to the device: the GPU test
/// `a_host_built_model_at_stage_three_on_two_nccl_ranks_equals_one_process` runs this program
/// over NCCL). Under the launcher on 2 CPU ranks it saves stage 0's weights bit for bit, with
/// and without prefetch (asked through the launcher's flags, over a TCP ring: the prefetch
/// thread's communicator is a second ring between the processes).
#[test]
fn the_workers_stage_three_path_saves_stage_zeros_weights() {
    let dir = tempfile::tempdir().unwrap();
    let prefetch = [
        "--fsdp-forward-prefetch",
        "1",
        "--fsdp-backward-prefetch",
        "BACKWARD_PRE",
    ];
    let runs: [(&str, &[&str]); 3] = [("0", &[]), ("3", &[]), ("3", &prefetch)];
    let saved: Vec<_> = runs
        .iter()
        .enumerate()
        .map(|(i, (stage, flags))| {
            let out = dir.path().join(format!("tiny-{i}.safetensors"));
            let o = accelerate_tests::Job::worker()
                .ranks(2)
                .launcher_flags(["--zero-stage", stage])
                .launcher_flags(*flags)
                .env("ACCELERATE_CPU_TRANSPORT", "tcp")
                .arg("tiny_train")
                .arg(&out)
                .args(["2", "4", "160"])
                .limit(std::time::Duration::from_secs(300))
                .run();
            let text = accelerate_tests::output_text(&o);
            assert!(o.status.success(), "{text}");
            // Only the run that asked for prefetch gathered units ahead.
            let none_ahead = text.contains("\"gathers_ahead\":0");
            assert_eq!(none_ahead, flags.is_empty(), "{text}");
            load_flat(&out)
        })
        .collect();
    assert_eq!(saved[0].len(), 4);
    for run in 1..3 {
        for (name, plain) in &saved[0] {
            let sharded = &saved[run][name];
            let same = plain
                .iter()
                .zip(sharded)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{name}: stage 3 ({:?}) differs from stage 0",
                runs[run].1
            );
        }
    }
}
