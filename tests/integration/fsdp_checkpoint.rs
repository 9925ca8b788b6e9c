//! Checkpoints of ZeRO stage 3 (fully sharded): saved mid-training (between windows and inside
//! one), resumed at the same number of ranks, loaded at another number and at another stage,
//! against the uninterrupted run; stage 0 and stage 2 checkpoints loaded at stage 3; damaged
//! per-rank files refused. Both ways of saving the parameters (`FULL_STATE_DICT`, gathered into
//! `model.safetensors`; `SHARDED_STATE_DICT`, each rank's pieces) are run.
//!
//! Every run takes the same global micro-batches: micro-step t (over the whole run) takes samples
//! `t·G .. (t+1)·G` of the data (`G` = 6), rank r of n the `G/n` from `t·G + r·G/n`, so that 1, 2
//! and 3 ranks average the same samples. The micro-step counter is registered for
//! checkpointing: a resumed run continues from the micro-step it was saved at. The tiny MLP runs
//! as two units (`l1`, `l2`) or as one (`mlp`, its 83 elements cut so that on 2 ranks rank 0 holds
//! no piece of `l2.*` and on 3 ranks two ranks hold no piece of some parameter: those step counts
//! live only on other ranks). Ranks are threads of this process (`ranks_as_threads`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use accelerate_core::optim::{AdamW, AdamWConfig, OptimizerState};
use accelerate_core::{Accelerator, Model, PreparedModel, StateDictType, UnitSpec};
use accelerate_tests::{
    bits, max_diff, named_vars, ranks_as_threads, snapshot, tiny_data, tiny_forward_units,
    tiny_layer, tiny_mlp, tiny_units,
};
use candle_core::{Module, Tensor};

/// Samples per micro-step over all ranks.
const GLOBAL: usize = 6;
/// Optimizer steps of an uninterrupted run.
const STEPS: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Units {
    /// `l1` and `l2`.
    Two,
    /// The whole MLP as one unit.
    One,
}

fn unit_specs(units: Units) -> Vec<UnitSpec> {
    match units {
        Units::Two => tiny_units(),
        Units::One => vec![UnitSpec::new("mlp", ["l1.", "l2."])],
    }
}

/// The tiny MLP's forward through its units.
fn forward(model: &PreparedModel, units: Units, x: &Tensor) -> accelerate_core::Result<Tensor> {
    match units {
        Units::Two => tiny_forward_units(model, x),
        Units::One => model.unit("mlp")?.forward(x, |x, p| {
            tiny_layer(p, "l2")?.forward(&tiny_layer(p, "l1")?.forward(x)?.tanh()?)
        }),
    }
}

/// One run: `n` ranks at `stage`, K = `k`, the model as `units`; it loads `from` after preparing
/// (and stops there with `stop_after_load`), and saves after micro-step `save.1` (counted over
/// the whole run) and stops there, its parameters as `save.2` says (`None`: as `save_state`
/// decides). Otherwise it trains until [`STEPS`] optimizer steps.
#[derive(Clone, Copy)]
struct Plan<'a> {
    n: usize,
    stage: u8,
    k: usize,
    units: Units,
    save: Option<(&'a Path, usize, Option<StateDictType>)>,
    from: Option<&'a Path>,
    stop_after_load: bool,
}

impl Plan<'_> {
    fn new(n: usize, stage: u8, k: usize, units: Units) -> Self {
        Plan {
            n,
            stage,
            k,
            units,
            save: None,
            from: None,
            stop_after_load: false,
        }
    }
}

/// One rank's end: every parameter whole (sorted by name), this rank's optimizer state, the
/// micro-steps taken, and the error `load_state` returned (the run stops there).
struct End {
    whole: Vec<Vec<f32>>,
    state: OptimizerState,
    micro: usize,
    load_error: Option<String>,
}

fn run(plan: Plan<'_>) -> Vec<End> {
    let (x, y) = tiny_data(GLOBAL * plan.k * STEPS, 5).unwrap();
    ranks_as_threads(
        plan.n,
        || {
            Accelerator::builder()
                .gradient_accumulation_steps(plan.k)
                .zero_stage(plan.stage)
        },
        |mut acc| {
            let (varmap, _) = tiny_mlp(3).unwrap();
            let model = acc
                .prepare_model(Model::new(named_vars(&varmap)).units(unit_specs(plan.units)))
                .unwrap();
            let cfg = AdamWConfig {
                lr: 0.02,
                weight_decay: 0.1,
                ..AdamWConfig::default()
            };
            let mut opt = acc
                .prepare(AdamW::new(model.parameters().to_vec(), cfg).unwrap())
                .unwrap();
            let micro = acc.register_for_checkpointing(0usize);
            let end = |opt: &accelerate_core::PreparedOptimizer<AdamW>, load_error| End {
                whole: model
                    .whole_parameters()
                    .unwrap()
                    .iter()
                    .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                    .collect(),
                state: opt.state().unwrap(),
                micro: *micro.lock().unwrap(),
                load_error,
            };
            if let Some(dir) = plan.from {
                if let Err(e) = acc.load_state(dir) {
                    return end(&opt, Some(e.to_string()));
                }
                if plan.stop_after_load {
                    return end(&opt, None);
                }
            }
            let b = GLOBAL / plan.n;
            let rank = acc.process_index();
            loop {
                let t = *micro.lock().unwrap();
                if t == STEPS * plan.k {
                    return end(&opt, None);
                }
                let _m = acc.accumulate();
                let start = t * GLOBAL + rank * b;
                let logits = forward(&model, plan.units, &x.narrow(0, start, b).unwrap()).unwrap();
                let loss = candle_nn::loss::cross_entropy(&logits, &y.narrow(0, start, b).unwrap())
                    .unwrap();
                acc.backward(&loss).unwrap();
                opt.step().unwrap();
                opt.zero_grad();
                *micro.lock().unwrap() += 1;
                if let Some((dir, at, kind)) = plan.save {
                    if t + 1 == at {
                        match kind {
                            Some(kind) => acc.save_state_with(dir, kind).unwrap(),
                            None => acc.save_state(dir).unwrap(),
                        }
                        return end(&opt, None);
                    }
                }
            }
        },
    )
}

/// Every rank loaded and ended with the same parameters, bitwise; returns them.
fn agreed(ends: &[End]) -> &[Vec<f32>] {
    for (r, e) in ends.iter().enumerate() {
        assert_eq!(e.load_error, None, "rank {r}");
        assert_eq!(bits(&e.whole), bits(&ends[0].whole), "rank {r} differs");
    }
    &ends[0].whole
}

/// An optimizer state as bits: tensors flattened, and scalars, by key.
type FlatState = (BTreeMap<String, Vec<u32>>, BTreeMap<String, u64>);

fn flat_bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    v.into_iter().map(f32::to_bits).collect()
}

/// A whole (stage-0) optimizer state, as bits.
fn full(state: &OptimizerState) -> FlatState {
    (
        state
            .tensors
            .iter()
            .map(|(k, t)| (k.clone(), flat_bits(t)))
            .collect(),
        state
            .scalars
            .iter()
            .map(|(k, v)| (k.clone(), v.to_bits()))
            .collect(),
    )
}

/// The whole state from every rank's pieces at stage 3: each rank keeps one contiguous range of
/// each parameter, ranks in element order, so a key's pieces follow one another in rank order;
/// scalars are the union (a rank holding no piece of a parameter has no step count of it).
fn assembled(ends: &[End]) -> FlatState {
    let mut tensors: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    let mut scalars = BTreeMap::new();
    for e in ends {
        for (k, t) in &e.state.tensors {
            tensors.entry(k.clone()).or_default().extend(flat_bits(t));
        }
        for (k, v) in &e.state.scalars {
            let old = scalars.insert(k.clone(), v.to_bits());
            assert!(
                old.is_none_or(|o| o == v.to_bits()),
                "ranks disagree on {k}"
            );
        }
    }
    (tensors, scalars)
}

fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

/// The parameters (sorted by name, flattened) assembled from every rank's
/// `model.rank_<r>.safetensors` at the element ranges the manifest lists for it: each element
/// exactly once.
fn parameters_from_rank_files(dir: &Path) -> Vec<Vec<f32>> {
    let m = manifest(dir);
    let mut whole: BTreeMap<String, Vec<Option<f32>>> = BTreeMap::new();
    for p in m["parameters"].as_array().unwrap() {
        let numel: u64 = p["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .product();
        whole.insert(
            p["name"].as_str().unwrap().to_string(),
            vec![None; numel as usize],
        );
    }
    for (r, pieces) in m["zero"]["pieces"].as_array().unwrap().iter().enumerate() {
        let file = accelerate_core::load_safetensors(
            dir.join(format!("model.rank_{r}.safetensors")),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        assert_eq!(file.len(), pieces.as_array().unwrap().len(), "rank {r}");
        for piece in pieces.as_array().unwrap() {
            let name = piece["param"].as_str().unwrap();
            let start = piece["start"].as_u64().unwrap() as usize;
            let values: Vec<f32> = file[name].to_vec1().unwrap();
            assert_eq!(values.len() as u64, piece["len"].as_u64().unwrap());
            for (i, v) in values.into_iter().enumerate() {
                let slot = &mut whole.get_mut(name).unwrap()[start + i];
                assert!(slot.is_none(), "{name}[{}] saved twice", start + i);
                *slot = Some(v);
            }
        }
    }
    whole
        .into_iter()
        .map(|(name, v)| {
            v.into_iter()
                .enumerate()
                .map(|(i, x)| x.unwrap_or_else(|| panic!("{name}[{i}] saved by no rank")))
                .collect()
        })
        .collect()
}

/// Copies the directory `from` to `to` (flat: a checkpoint holds files only).
fn copy_dir(from: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    to.to_path_buf()
}

/// Saved on 2 ranks at stage 3, between windows (K = 1, after 2 steps) and inside one (K = 2,
/// after the first micro-step of the second window), both ways, with two units and one: the
/// checkpoint holds what it says (the manifest's pieces tile every parameter; the rank files or
/// `model.safetensors` hold the parameters the run had; the window's sums per rank), and resumed
/// on 2 ranks at stage 3, and at stage 0, the run ends bitwise where the uninterrupted one does.
#[test]
fn resumed_on_as_many_ranks_a_stage_three_run_ends_bitwise_where_it_would_have() {
    let root = tempfile::tempdir().unwrap();
    for units in [Units::Two, Units::One] {
        for (k, at) in [(1, 2), (2, 3)] {
            let plan = Plan::new(2, 3, k, units);
            let whole = run(plan);
            let whole = agreed(&whole);
            for kind in [StateDictType::Full, StateDictType::Sharded] {
                let what = format!("{units:?} K={k} {kind:?}");
                let dir = root.path().join(what.replace([' ', '='], "_"));
                let stopped = run(Plan {
                    save: Some((&dir, at, Some(kind))),
                    ..plan
                });
                let at_save = agreed(&stopped).to_vec();
                assert_ne!(
                    bits(&at_save),
                    bits(whole),
                    "{what}: stopped before the end"
                );
                let m = manifest(&dir);
                assert_eq!(m["zero"]["stage"], 3, "{what}");
                assert_eq!(m["world_size"], 2);
                for r in 0..2 {
                    assert!(dir
                        .join(format!("optimizer_0.rank_{r}.safetensors"))
                        .is_file());
                    assert_eq!(
                        dir.join(format!("rank_{r}_gradients.safetensors"))
                            .is_file(),
                        k == 2,
                        "{what}: the window's sums are saved inside a window only"
                    );
                }
                assert!(!dir.join("optimizer_0.safetensors").exists());
                match kind {
                    StateDictType::Full => {
                        assert_eq!(m["format_version"], 2, "{what}");
                        assert!(m["zero"].get("sharded_parameters").is_none());
                        assert!(!dir.join("model.rank_0.safetensors").exists());
                        let saved = accelerate_core::load_safetensors(
                            dir.join("model.safetensors"),
                            &candle_core::Device::Cpu,
                        )
                        .unwrap();
                        let saved: BTreeMap<String, Tensor> = saved.into_iter().collect();
                        let saved: Vec<Vec<f32>> = saved
                            .values()
                            .map(|t| t.flatten_all().unwrap().to_vec1().unwrap())
                            .collect();
                        assert_eq!(bits(&saved), bits(&at_save), "{what}: model.safetensors");
                    }
                    StateDictType::Sharded => {
                        assert_eq!(m["format_version"], 3, "{what}");
                        assert_eq!(m["zero"]["sharded_parameters"], true);
                        assert!(!dir.join("model.safetensors").exists());
                        assert_eq!(
                            bits(&parameters_from_rank_files(&dir)),
                            bits(&at_save),
                            "{what}: the rank files' pieces"
                        );
                    }
                }
                for stage in [3, 0] {
                    let resumed = run(Plan {
                        stage,
                        from: Some(&dir),
                        ..plan
                    });
                    assert_eq!(resumed[0].micro, STEPS * k);
                    assert_eq!(
                        bits(agreed(&resumed)),
                        bits(whole),
                        "{what}: resumed at stage {stage} differs from the uninterrupted run \
                         (max |Δ| = {:e})",
                        max_diff(agreed(&resumed), whole)
                    );
                }
            }
        }
    }
}

/// Saved on 2 ranks at stage 3 between windows (K = 2, after 2 steps), both ways, the whole MLP
/// as one unit (rank 0 holds no piece of `l2.*`, whose step counts only rank 1 has). Loaded
/// without training, at stage 0 on 1, 2 and 3 ranks and at stage 3 on 3 ranks, the parameters and
/// the whole optimizer state (moments and step counts) are bitwise those a stage-0 run holds at
/// that point (re-cutting moves values, it computes nothing). Continued on 1 and 3 ranks at stage
/// 3 and at 0, and on 2 at stage 0, every run ends within 1e-6 of the uninterrupted stage-3 run
/// (bitwise on 2 ranks, where the sums are the same). Inside a window another number of ranks
/// is refused on every rank, naming the fix.
#[test]
fn stage_three_checkpoints_load_at_other_world_sizes_and_stages() {
    let root = tempfile::tempdir().unwrap();
    let (k, at) = (2, 4);
    let plan = Plan::new(2, 3, k, Units::One);
    let reference = run(plan);
    let reference = agreed(&reference);
    let stage_0_dir = root.path().join("s0");
    let stage_0 = run(Plan {
        stage: 0,
        save: Some((&stage_0_dir, at, None)),
        ..plan
    });
    let stage_0_state = full(&stage_0[0].state);
    assert!(stage_0_state.0.contains_key("exp_avg.l2.bias"));
    assert!(stage_0_state.1.contains_key("step.l2.bias"));
    for kind in [StateDictType::Full, StateDictType::Sharded] {
        let dir = root.path().join(format!("{kind:?}"));
        let saver = run(Plan {
            save: Some((&dir, at, Some(kind))),
            ..plan
        });
        assert!(
            !saver[0].state.scalars.contains_key("step.l2.bias")
                && saver[1].state.scalars.contains_key("step.l2.bias"),
            "rank 0 holds no piece of l2.bias, rank 1 does"
        );
        let loaded = |n, stage| {
            run(Plan {
                n,
                stage,
                from: Some(&dir),
                stop_after_load: true,
                ..plan
            })
        };
        for n in [1, 2, 3] {
            let ends = loaded(n, 0);
            for (r, e) in ends.iter().enumerate() {
                assert!(
                    full(&e.state) == stage_0_state,
                    "{kind:?} at stage 0 on {n} rank(s), rank {r}: the optimizer state differs"
                );
            }
            assert_eq!(
                bits(agreed(&ends)),
                bits(&stage_0[0].whole),
                "{kind:?} n={n}"
            );
        }
        let ends = loaded(3, 3);
        assert!(
            assembled(&ends) == stage_0_state,
            "{kind:?} at stage 3 on 3 ranks: the pieces differ from the saved state"
        );
        assert_eq!(bits(agreed(&ends)), bits(&stage_0[0].whole));
        assert!(
            !ends[0].state.scalars.contains_key("step.l2.bias")
                && ends[2].state.scalars.contains_key("step.l2.bias"),
            "on 3 ranks only rank 2 holds a piece of l2.bias"
        );

        for (n, stage) in [(1, 3), (3, 3), (1, 0), (3, 0), (2, 0)] {
            let ends = run(Plan {
                n,
                stage,
                from: Some(&dir),
                ..plan
            });
            let got = agreed(&ends);
            let d = max_diff(got, reference);
            eprintln!("{kind:?} 2 ranks -> {n} at stage {stage}: max |Δ| = {d:e}");
            assert!(
                d <= 1e-6,
                "{kind:?} 2 -> {n} at stage {stage}: max |Δ| = {d} against the uninterrupted run"
            );
            if n == 2 {
                assert_eq!(bits(got), bits(reference), "{kind:?} 2 -> 2 at stage 0");
            }
            assert!(max_diff(got, &stage_0[0].whole) > 1e-4, "training went on");
        }
    }

    let mid_window = root.path().join("mid");
    run(Plan {
        save: Some((&mid_window, 3, Some(StateDictType::Sharded))),
        ..plan
    });
    let refused = run(Plan {
        n: 3,
        from: Some(&mid_window),
        ..plan
    });
    let initial = snapshot(&named_vars(&tiny_mlp(3).unwrap().0));
    for (r, e) in refused.iter().enumerate() {
        let err = e.load_error.as_deref().expect("refused");
        assert!(
            err.contains("saved by 2 processes but this run has 3")
                && err.contains("accumulation window")
                && err.contains("--num-processes 2"),
            "rank {r}: {err}"
        );
        assert_eq!(
            bits(&e.whole),
            bits(&initial),
            "rank {r}: nothing was loaded"
        );
    }
}

/// Checkpoints of stage 0 (two units) and stage 2 (one unit) on 2 ranks, saved between windows
/// and inside one (K = 2), loaded at stage 3 on 2 ranks (and on 3 between windows): each run
/// ends within 1e-6 of the uninterrupted run of the stage that saved (bitwise on 2 ranks).
#[test]
fn stage_zero_and_stage_two_checkpoints_continue_at_stage_three() {
    let root = tempfile::tempdir().unwrap();
    for (stage, units) in [(0, Units::Two), (2, Units::One)] {
        let plan = Plan::new(2, stage, 2, units);
        let reference = run(plan);
        let reference = agreed(&reference);
        for at in [4, 3] {
            let dir = root.path().join(format!("s{stage}_{at}"));
            run(Plan {
                save: Some((&dir, at, None)),
                ..plan
            });
            assert!(manifest(&dir)["zero"].get("sharded_parameters").is_none());
            let worlds: &[usize] = if at == 4 { &[2, 3] } else { &[2] };
            for &n in worlds {
                let ends = run(Plan {
                    n,
                    stage: 3,
                    from: Some(&dir),
                    ..plan
                });
                let got = agreed(&ends);
                let d = max_diff(got, reference);
                eprintln!(
                    "stage {stage} on 2 ranks (saved after micro-step {at}) -> stage 3 on {n}: \
                     max |Δ| = {d:e}"
                );
                assert!(
                    d <= 1e-6,
                    "stage {stage} -> 3, n={n}, at {at}: max |Δ| = {d}"
                );
                if n == 2 {
                    assert_eq!(bits(got), bits(reference), "stage {stage} -> 3 at {at}");
                }
            }
        }
    }
}

/// A sharded checkpoint whose per-rank file is missing or damaged is refused on every rank, the
/// file and the problem named (on the rank that read it, and through it on the others), and
/// nothing is loaded. Saved through `save_state` without `ACCELERATE_FSDP_STATE_DICT_TYPE`: each
/// rank's pieces, the default.
#[test]
fn a_missing_or_damaged_rank_file_is_refused_and_nothing_is_loaded() {
    if std::env::var_os(accelerate_core::env::FSDP_STATE_DICT_TYPE).is_some() {
        eprintln!(
            "skipped: ACCELERATE_FSDP_STATE_DICT_TYPE is set, and this test saves without it"
        );
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ckpt");
    let plan = Plan::new(2, 3, 1, Units::One);
    run(Plan {
        save: Some((&dir, 2, None)),
        ..plan
    });
    assert!(
        dir.join("model.rank_1.safetensors").is_file(),
        "the default"
    );
    assert!(!dir.join("model.safetensors").exists());
    let initial = snapshot(&named_vars(&tiny_mlp(3).unwrap().0));

    let missing = copy_dir(&dir, &root.path().join("missing"));
    std::fs::remove_file(missing.join("model.rank_1.safetensors")).unwrap();
    let flip = |name: &str| {
        let copy = copy_dir(&dir, &root.path().join(format!("flipped_{name}")));
        let path = copy.join(name);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
        copy
    };
    let model_flipped = flip("model.rank_0.safetensors");
    let optimizer_flipped = flip("optimizer_0.rank_0.safetensors");
    for (from, n, file, problem) in [
        (&missing, 2, "model.rank_1.safetensors", "missing"),
        (
            &model_flipped,
            2,
            "model.rank_0.safetensors",
            "checksum mismatch",
        ),
        // On 3 ranks new ranks 0 and 1 take pieces saved by rank 0.
        (
            &optimizer_flipped,
            3,
            "optimizer_0.rank_0.safetensors",
            "checksum mismatch",
        ),
    ] {
        let ends = run(Plan {
            n,
            from: Some(from),
            ..plan
        });
        for (r, e) in ends.iter().enumerate() {
            let err = e
                .load_error
                .as_deref()
                .unwrap_or_else(|| panic!("{file} on rank {r}: loaded"));
            assert!(
                err.contains(file) && err.contains(problem),
                "{file}, n={n}, rank {r}: {err}"
            );
            assert_eq!(bits(&e.whole), bits(&initial), "{file}: rank {r} loaded");
            assert_eq!(e.micro, 0);
        }
    }
}
