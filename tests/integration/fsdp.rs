//! ZeRO stage 3 (fully sharded) against plain data parallel (stage 0) and against one process
//! training on the whole global batch with PyTorch's update rules written out
//! (`ReferenceOptimizer`).
//!
//! The tiny MLP runs as two units, `l1` (its input is the data, which needs no gradient: the
//! unit's node hangs on its anchor) and `l2` (its input is `l1`'s output). Its 56- and 27-element
//! units are cut so that rank pieces straddle parameters and the last block is padded, on 2 and
//! on 3 ranks. Ranks are threads of this process (`ranks_as_threads`), over the CPU communicator.

use accelerate_core::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use accelerate_core::{Accelerator, GradientSyncStats, Model, PreparedModel, UnitParams, UnitSpec};
use accelerate_tests::{
    named_vars, ranks_as_threads, snapshot, tiny_data, tiny_mlp, ReferenceOptimizer,
};
use candle_core::{Module, Tensor};
use candle_nn::Linear;

const BATCH: usize = 3;
const STEPS: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Opt {
    SgdMomentum,
    AdamW,
}

/// How a run computes the model.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    /// The tiny MLP's own forward over its `Linear`s (stage 0 only).
    Plain,
    /// Through the prepared model's units.
    Units,
}

/// One rank's outcome: the whole parameters after training (sorted by name), the norms
/// `clip_grad_norm` reported, and the gradient traffic.
type RankResult = (Vec<Vec<f32>>, Vec<f64>, GradientSyncStats);

fn units() -> Vec<UnitSpec> {
    vec![UnitSpec::new("l1", ["l1."]), UnitSpec::new("l2", ["l2."])]
}

/// The tiny MLP's forward through its units.
fn forward_units(model: &PreparedModel, x: &Tensor) -> accelerate_core::Result<Tensor> {
    let h = model.unit("l1")?.forward(x, |x, p| {
        Linear::new(p.get("l1.weight")?, Some(p.get("l1.bias")?))
            .forward(x)?
            .tanh()
    })?;
    model.unit("l2")?.forward(&h, |h, p| {
        Linear::new(p.get("l2.weight")?, Some(p.get("l2.bias")?)).forward(h)
    })
}

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
    let global = n * k * BATCH;
    let (x, y) = tiny_data(global * STEPS, 5).unwrap();
    ranks_as_threads(
        n,
        || {
            Accelerator::builder()
                .gradient_accumulation_steps(k)
                .zero_stage(stage)
        },
        |mut acc| {
            let (varmap, mlp) = tiny_mlp(3).unwrap();
            let model = acc
                .prepare_model(Model::new(named_vars(&varmap)).units(units()))
                .unwrap();
            let params = model.parameters().to_vec();
            let mut step: Box<dyn FnMut()> = match opt {
                Opt::SgdMomentum => {
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
                }
                Opt::AdamW => {
                    let cfg = AdamWConfig {
                        lr: 0.02,
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
                }
            };
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
    let global = n * k * BATCH;
    let (x, y) = tiny_data(global * STEPS, 5).unwrap();
    let (varmap, model) = tiny_mlp(3).unwrap();
    let params = named_vars(&varmap);
    let mut optimizer = match opt {
        Opt::SgdMomentum => ReferenceOptimizer::sgd(0.1, 0.9),
        Opt::AdamW => ReferenceOptimizer::adamw(0.02, 0.1),
    };
    for s in 0..STEPS {
        let logits = model
            .forward(&x.narrow(0, s * global, global).unwrap())
            .unwrap();
        let loss =
            candle_nn::loss::cross_entropy(&logits, &y.narrow(0, s * global, global).unwrap())
                .unwrap();
        optimizer.step(&params, &loss.backward().unwrap()).unwrap();
    }
    snapshot(&params)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn bits(a: &[Vec<f32>]) -> Vec<u32> {
    a.iter().flatten().map(|x| x.to_bits()).collect()
}

/// Stage 3 on 2 and 3 ranks, K = 1 and 2, SGD with momentum and AdamW: every rank ends with the
/// parameters of one process training on the global batch, and with stage 0's. The units path
/// at stage 0 is the plain model bit for bit (it is the same call).
#[test]
fn stage_three_trains_as_one_process_on_the_global_batch() {
    for opt in [Opt::SgdMomentum, Opt::AdamW] {
        for n in [2, 3] {
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

/// Gradient traffic at stage 3: each micro-step gathers each unit twice (forward, backward); only
/// the sync micro-step reduce-scatters, once per unit, plus one small all-reduce that agrees on
/// presence and overflow; nothing is all-reduced whole.
#[test]
fn only_the_sync_micro_step_reduces_and_every_pass_gathers() {
    let (n, k) = (2, 2);
    let runs = train(n, k, 3, Opt::AdamW, Path::Units, None);
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
        stats.all_reduces, STEPS as u64,
        "the verdict, once per optimizer step"
    );
    // Unit buffers of 56 and 27 elements, padded to 56 and 28 on 2 ranks, in f32.
    assert_eq!(stats.bytes, STEPS as u64 * ((56 + 28) * 4 + (4 + 1) * 4));
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
/// lost) and a unit run twice in one pass; `save_model` writes the whole model, gathered, equal
/// to the parameters.
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
            // The same unit twice in one pass.
            let l1 = model.unit("l1").unwrap();
            let block = |x: &Tensor, p: &UnitParams| {
                Linear::new(p.get("l1.weight")?, Some(p.get("l1.bias")?))
                    .forward(x)?
                    .tanh()
            };
            let a = l1.forward(&x, block).unwrap();
            let b = l1.forward(&x, block).unwrap();
            let loss = (a + b).unwrap().sum_all().unwrap();
            let twice = acc.backward(&loss).unwrap_err().to_string();
            acc.save_model(out.join("model")).unwrap();
            let whole = model.whole_parameters().unwrap();
            (outside, twice, whole)
        },
    );
    let (outside, twice, whole) = &results[0];
    assert!(
        outside.contains("read outside the model's units"),
        "{outside}"
    );
    assert!(twice.contains("ran more than once"), "{twice}");
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
    assert_eq!(results[1].2.len(), whole.len(), "rank 1 gathered too");
}
