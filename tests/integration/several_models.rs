//! Two models in one loop, each with its own optimizer and accumulation, and frozen parameters:
//! against a single-process candle loop on the whole batch with PyTorch's update rules written
//! out (`ReferenceOptimizer`), and across a checkpoint.
//!
//! The models are a "generator" `a` that accumulates K=2 micro-steps per AdamW step and a
//! "discriminator" `b` that steps SGD with momentum every micro-step. Each loss also reaches the
//! other model's parameters (`0.5 · mean(other(x)²)`), so a backward pass that leaked into the
//! other model's gradients would change the result.

use std::sync::Arc;

use accelerate_core::data::{DataLoader, TensorDataset};
use accelerate_core::optim::{
    AdamW, AdamWConfig, LearningRate, LrScheduler, Schedule, Sgd, SgdConfig,
};
use accelerate_core::{Accelerator, Model, PreparedModel, ProcessState};
use accelerate_tests::{
    named_vars, ranks_as_threads, snapshot, tiny_data, tiny_mlp, ReferenceOptimizer, TinyMlp,
};
use candle_core::{Tensor, Var};

/// Samples per rank per micro-step.
const B: usize = 4;
/// The generator's micro-steps per optimizer step.
const K_A: usize = 2;
const A_CFG: AdamWConfig = AdamWConfig {
    lr: 0.01,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.1,
};
const B_LR: f64 = 0.1;
const B_MOMENTUM: f64 = 0.9;

fn b_cfg() -> SgdConfig {
    SgdConfig {
        lr: B_LR,
        momentum: B_MOMENTUM,
        ..SgdConfig::default()
    }
}

/// `own`'s cross-entropy on `(x, y)` plus `0.5 · mean(other(x)²)`.
fn coupled_loss(own: &TinyMlp, other: &TinyMlp, x: &Tensor, y: &Tensor) -> Tensor {
    let ce = candle_nn::loss::cross_entropy(&own.forward(x).unwrap(), y).unwrap();
    let reach = (other.forward(x).unwrap().sqr().unwrap().mean_all().unwrap() * 0.5).unwrap();
    (ce + reach).unwrap()
}

/// The reference: one process, the whole global batch of every micro-step, candle's gradients and
/// the written-out update rules. `b` steps every micro-step; `a`'s gradients are averaged over its
/// window of K_A micro-steps (computed with `b` as it is at each micro-step) and applied at the
/// window's end. With `freeze_a_l1`, `a`'s first layer never moves.
fn reference(
    global: usize,
    micro_steps: usize,
    freeze_a_l1: bool,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let (a_map, a) = tiny_mlp(1).unwrap();
    let (b_map, b) = tiny_mlp(2).unwrap();
    let (x, y) = tiny_data(global * micro_steps, 3).unwrap();
    let a_params: Vec<(String, Var)> = named_vars(&a_map)
        .into_iter()
        .filter(|(n, _)| !(freeze_a_l1 && n.starts_with("l1.")))
        .collect();
    let b_params = named_vars(&b_map);
    let mut a_opt = ReferenceOptimizer::adamw(A_CFG.lr, A_CFG.weight_decay);
    let mut b_opt = ReferenceOptimizer::sgd(B_LR, B_MOMENTUM);
    let mut a_window: Vec<Tensor> = Vec::new();
    for j in 0..micro_steps {
        let xs = x.narrow(0, j * global, global).unwrap();
        let ys = y.narrow(0, j * global, global).unwrap();
        let grads = coupled_loss(&b, &a, &xs, &ys).backward().unwrap();
        b_opt.step(&b_params, &grads).unwrap();

        let mut grads = coupled_loss(&a, &b, &xs, &ys).backward().unwrap();
        let g: Vec<Tensor> = a_params
            .iter()
            .map(|(_, v)| grads.get(v.as_tensor()).unwrap().clone())
            .collect();
        a_window = if a_window.is_empty() {
            g
        } else {
            a_window
                .iter()
                .zip(&g)
                .map(|(s, g)| (s + g).unwrap())
                .collect()
        };
        if (j + 1) % K_A == 0 {
            // The window's mean, in the store of this micro-step (whose other entries the
            // reference optimizer does not read).
            for ((_, v), s) in a_params.iter().zip(&a_window) {
                grads.insert(v.as_tensor(), (s / K_A as f64).unwrap());
            }
            a_opt.step(&a_params, &grads).unwrap();
            a_window.clear();
        }
    }
    (snapshot(&named_vars(&a_map)), snapshot(&b_params))
}

/// Prepares the two models (and their optimizers) on `acc`; `a` keeps the accelerator's K
/// (built with K_A), `b` takes K=1 of its own.
struct TwoModels {
    a: TinyMlp,
    b: TinyMlp,
    a_prepared: PreparedModel,
    b_prepared: PreparedModel,
    a_opt: accelerate_core::PreparedOptimizer<AdamW>,
    b_opt: accelerate_core::PreparedOptimizer<Sgd>,
}

impl TwoModels {
    fn new(acc: &mut Accelerator, a_seed: u64, b_seed: u64, freeze_a_l1: bool) -> Self {
        let (a_map, a) = tiny_mlp(a_seed).unwrap();
        let (b_map, b) = tiny_mlp(b_seed).unwrap();
        let mut a_model = Model::from_varmap(&a_map);
        if freeze_a_l1 {
            a_model = a_model.freeze(|name| name.starts_with("l1."));
        }
        let a_prepared = acc.prepare(a_model).unwrap();
        let b_prepared = acc
            .prepare(Model::from_varmap(&b_map).gradient_accumulation_steps(1))
            .unwrap();
        let a_opt = acc
            .prepare(AdamW::new(a_prepared.parameters().to_vec(), A_CFG).unwrap())
            .unwrap();
        let b_opt = acc
            .prepare(Sgd::new(b_prepared.parameters().to_vec(), b_cfg()).unwrap())
            .unwrap();
        Self {
            a,
            b,
            a_prepared,
            b_prepared,
            a_opt,
            b_opt,
        }
    }

    /// One micro-step of the loop: the discriminator steps, then the generator accumulates.
    fn micro_step(&mut self, x: &Tensor, y: &Tensor) {
        let _b_step = self.b_prepared.accumulate();
        let loss = coupled_loss(&self.b, &self.a, x, y);
        self.b_prepared.backward(&loss).unwrap();
        self.b_opt.step().unwrap();
        self.b_opt.zero_grad();

        let _a_step = self.a_prepared.accumulate();
        let loss = coupled_loss(&self.a, &self.b, x, y);
        self.a_prepared.backward(&loss).unwrap();
        self.a_opt.step().unwrap();
        self.a_opt.zero_grad();
    }

    fn values(&self) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let a: Vec<(String, Var)> = self
            .a_prepared
            .parameters()
            .iter()
            .chain(self.a_prepared.frozen_parameters())
            .cloned()
            .collect();
        let mut a = a;
        a.sort_by(|x, y| x.0.cmp(&y.0));
        (snapshot(&a), snapshot(self.b_prepared.parameters()))
    }
}

fn assert_close(ours: &[Vec<f32>], reference: &[Vec<f32>], what: &str) {
    assert_eq!(ours.len(), reference.len(), "{what}");
    for (i, (o, r)) in ours.iter().zip(reference).enumerate() {
        for (x, y) in o.iter().zip(r) {
            assert!(
                (x - y).abs() <= 2e-5 * (1.0 + y.abs()),
                "{what}, parameter {i}: ours {x} vs reference {y}"
            );
        }
    }
}

/// 2 ranks, each with B samples per micro-step, equal one process on batches of 2·B: the
/// discriminator steps every micro-step, the generator every K_A, and neither backward pass
/// reaches the other model's gradients.
#[test]
fn two_models_on_two_ranks_train_as_one_process_on_the_whole_batch() {
    for freeze_a_l1 in [false, true] {
        let micro_steps = 6;
        let (x, y) = tiny_data(2 * B * micro_steps, 3).unwrap();
        let ours = ranks_as_threads(
            2,
            || Accelerator::builder().gradient_accumulation_steps(K_A),
            |mut acc| {
                // Rank 1 starts from other weights: prepare broadcasts rank 0's, frozen ones too.
                let seeds = if acc.process_index() == 0 {
                    (1, 2)
                } else {
                    (11, 12)
                };
                let mut m = TwoModels::new(&mut acc, seeds.0, seeds.1, freeze_a_l1);
                assert_eq!(m.b_prepared.gradient_accumulation_steps(), 1);
                assert_eq!(m.a_prepared.gradient_accumulation_steps(), K_A);
                for j in 0..micro_steps {
                    let start = (2 * j + acc.process_index()) * B;
                    m.micro_step(
                        &x.narrow(0, start, B).unwrap(),
                        &y.narrow(0, start, B).unwrap(),
                    );
                    if freeze_a_l1 && (j + 1) % K_A != 0 {
                        assert!(
                            m.a_prepared.gradient("l1.weight").unwrap().is_none(),
                            "a frozen parameter has no gradient buffer"
                        );
                        assert!(m.a_prepared.gradient("l2.weight").unwrap().is_some());
                    }
                }
                assert_eq!(m.b_prepared.optimizer_steps(), micro_steps as u64);
                assert_eq!(m.a_prepared.optimizer_steps(), (micro_steps / K_A) as u64);
                m.values()
            },
        );
        let (ref_a, ref_b) = reference(2 * B, micro_steps, freeze_a_l1);
        for (rank, (a, b)) in ours.iter().enumerate() {
            let what = format!("rank {rank}, frozen first layer: {freeze_a_l1}");
            assert_close(a, &ref_a, &format!("generator, {what}"));
            assert_close(b, &ref_b, &format!("discriminator, {what}"));
        }
    }
}

/// An optimizer may hold only trained parameters of one model.
#[test]
fn an_optimizer_over_frozen_parameters_or_two_models_is_refused() {
    let mut acc = Accelerator::builder()
        .process_state(ProcessState::single())
        .build()
        .unwrap();
    let (a_map, _) = tiny_mlp(1).unwrap();
    let (b_map, _) = tiny_mlp(2).unwrap();
    let a = acc
        .prepare(Model::from_varmap(&a_map).freeze(|n| n.starts_with("l1.")))
        .unwrap();
    let b = acc.prepare(Model::from_varmap(&b_map)).unwrap();
    assert_eq!(
        a.frozen_parameters()
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        ["l1.bias", "l1.weight"]
    );

    let with_frozen = named_vars(&a_map);
    let e = acc
        .prepare(Sgd::new(with_frozen, b_cfg()).unwrap())
        .err()
        .expect("an optimizer over frozen parameters")
        .to_string();
    assert!(e.contains("l1.weight") && e.contains("frozen"), "{e}");

    let both: Vec<(String, Var)> = a
        .parameters()
        .iter()
        .cloned()
        .chain(
            b.parameters()
                .iter()
                .map(|(n, v)| (format!("b.{n}"), v.clone())),
        )
        .collect();
    let e = acc
        .prepare(Sgd::new(both, b_cfg()).unwrap())
        .err()
        .expect("an optimizer over two models")
        .to_string();
    assert!(e.contains("several prepared models"), "{e}");

    let e = acc
        .prepare(Model::from_varmap(&a_map).freeze(|_| true))
        .expect_err("a model with every parameter frozen")
        .to_string();
    assert!(e.contains("frozen"), "{e}");

    // A scheduler whose optimizer is not prepared (yet) could follow either model's steps.
    let lr = LearningRate::new(0.1);
    let e = acc
        .prepare(LrScheduler::new(lr.clone(), Schedule::Constant).unwrap())
        .err()
        .expect("a scheduler driving no prepared optimizer, two models prepared")
        .to_string();
    assert!(e.contains("after the optimizer"), "{e}");
}

/// Saved inside the generator's window (after micro-step 3 of 6, the discriminator having stepped
/// three times), loaded into a fresh process, and continued: both models end bitwise where an
/// uninterrupted run ends.
#[test]
fn a_checkpoint_holds_both_models_and_resumes_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let micro_steps = 6;
    let run = |save_after: Option<usize>, load: bool| {
        let mut acc = Accelerator::builder()
            .gradient_accumulation_steps(K_A)
            .process_state(ProcessState::single())
            .build()
            .unwrap();
        let mut m = TwoModels::new(&mut acc, 1, 2, true);
        let (x, y) = tiny_data(B * micro_steps, 3).unwrap();
        let loader = DataLoader::new(Arc::new(TensorDataset::new(x, y).unwrap()), B);
        let mut loader = acc.prepare(loader).unwrap();
        if load {
            acc.load_state(dir.path()).unwrap();
        }
        for (j, batch) in loader.iter().enumerate() {
            let (x, y) = batch.unwrap();
            m.micro_step(&x, &y);
            if save_after == Some(j + 1) {
                acc.save_state(dir.path()).unwrap();
                return None;
            }
        }
        Some((
            m.values(),
            m.a_prepared.optimizer_steps(),
            m.b_prepared.optimizer_steps(),
        ))
    };
    let whole = run(None, false).unwrap();
    assert!(run(Some(3), false).is_none());
    for file in [
        "model.safetensors",
        "model_1.safetensors",
        "optimizer_0.json",
        "model_1.optimizer_0.json",
        "rank_0_gradients.safetensors",
        "model_1.accumulation.json",
    ] {
        assert!(dir.path().join(file).is_file(), "{file} is missing");
    }
    assert!(
        !dir.path()
            .join("model_1.rank_0_gradients.safetensors")
            .exists(),
        "the discriminator (K=1) is never inside a window between micro-steps"
    );
    let resumed = run(None, true).unwrap();
    assert_eq!(resumed.1, whole.1);
    assert_eq!(resumed.2, whole.2);
    assert!(
        resumed.0 == whole.0,
        "the resumed run differs from the uninterrupted one"
    );

    // A run that prepared one model only is refused, naming the difference.
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(K_A)
        .process_state(ProcessState::single())
        .build()
        .unwrap();
    let (a_map, _) = tiny_mlp(1).unwrap();
    acc.prepare(Model::from_varmap(&a_map).freeze(|n| n.starts_with("l1.")))
        .unwrap();
    let e = acc.load_state(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("2 prepared model(s)") && e.contains("prepared 1"),
        "{e}"
    );
}

/// Two models stepping on the batches of `windows(2)`: each batch counts once, however many
/// models begin a micro-step on it, so both see windows of two (4 batches: 2 optimizer steps
/// each), in whichever order they begin.
#[test]
fn two_models_on_the_windows_of_one_loader_see_each_batch_once() {
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(2)
        .process_state(ProcessState::single())
        .build()
        .unwrap();
    let (a_map, a) = tiny_mlp(1).unwrap();
    let (b_map, b) = tiny_mlp(2).unwrap();
    let a_model = acc.prepare(Model::from_varmap(&a_map)).unwrap();
    let b_model = acc.prepare(Model::from_varmap(&b_map)).unwrap();
    let mut a_opt = acc
        .prepare(Sgd::new(a_model.parameters().to_vec(), b_cfg()).unwrap())
        .unwrap();
    let mut b_opt = acc
        .prepare(Sgd::new(b_model.parameters().to_vec(), b_cfg()).unwrap())
        .unwrap();
    let (x, y) = tiny_data(4 * B, 3).unwrap();
    let mut loader = acc
        .prepare(DataLoader::new(
            Arc::new(TensorDataset::new(x, y).unwrap()),
            B,
        ))
        .unwrap();
    let mut windows = Vec::new();
    for (w, window) in loader.windows(2).enumerate() {
        for (x, y) in window.unwrap() {
            // The second window's micro-steps begin with the other model first.
            let order = if w == 0 { [0, 1] } else { [1, 0] };
            for m in order {
                let (model, net, other, opt) = if m == 0 {
                    (&a_model, &a, &b, &mut a_opt)
                } else {
                    (&b_model, &b, &a, &mut b_opt)
                };
                let step = model.accumulate();
                windows.push((m, step.window_len, step.sync));
                model.backward(&coupled_loss(net, other, &x, &y)).unwrap();
                opt.step().unwrap();
                opt.zero_grad();
            }
        }
    }
    assert_eq!(a_model.optimizer_steps(), 2);
    assert_eq!(b_model.optimizer_steps(), 2);
    assert_eq!(
        windows,
        [
            (0, 2, false),
            (1, 2, false),
            (0, 2, true),
            (1, 2, true),
            (1, 2, false),
            (0, 2, false),
            (1, 2, true),
            (0, 2, true)
        ]
    );
}

/// `save_model` writes the whole first model, its frozen parameters too (a Hugging Face loader
/// needs every weight), with their values.
#[test]
fn save_model_writes_the_frozen_parameters_too() {
    let dir = tempfile::tempdir().unwrap();
    let mut acc = Accelerator::builder()
        .process_state(ProcessState::single())
        .build()
        .unwrap();
    let (map, _) = tiny_mlp(1).unwrap();
    let expected: Vec<(String, Vec<f32>)> = named_vars(&map)
        .into_iter()
        .map(|(n, v)| (n, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    acc.prepare(Model::from_varmap(&map).freeze(|n| n.starts_with("l1.")))
        .unwrap();
    acc.save_model(dir.path()).unwrap();
    let saved = candle_core::safetensors::load(
        dir.path().join("model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let mut names: Vec<&String> = saved.keys().collect();
    names.sort();
    assert_eq!(names, ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]);
    for (name, values) in expected {
        let got = saved[&name]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(got, values, "{name}");
    }
}

#[test]
fn the_second_model_weights_its_window_by_the_items_of_its_own_count() {
    // Model b (prepared second, K = 2) takes item-weighted windows: rank 0 has 3 then 2 rows, rank
    // 1 has 4 then 1, and each passes the *sum* of its rows' cross-entropies. b's synced gradient
    // must be that of the mean cross-entropy over all 10 rows in one process. Model a (the first,
    // K = 1) only takes part, so an item count applied to the wrong model would show.
    const ROWS: [[usize; 2]; 2] = [[3, 2], [4, 1]];
    let (x, y) = tiny_data(10, 7).unwrap();
    let (reference_map, reference_model) = tiny_mlp(2).unwrap();
    let loss = candle_nn::loss::cross_entropy(&reference_model.forward(&x).unwrap(), &y).unwrap();
    let grads = loss.backward().unwrap();
    let reference: Vec<(String, Vec<f32>)> = named_vars(&reference_map)
        .into_iter()
        .map(|(name, var)| {
            let g = grads.get(var.as_tensor()).unwrap();
            (name, g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect();
    let per_rank = ranks_as_threads(2, Accelerator::builder, |mut acc| {
        let rank = acc.process_index();
        let (a_map, _) = tiny_mlp(1).unwrap();
        let (b_map, b) = tiny_mlp(2).unwrap();
        acc.prepare(Model::from_varmap(&a_map)).unwrap();
        let b_prepared = acc
            .prepare(Model::from_varmap(&b_map).gradient_accumulation_steps(2))
            .unwrap();
        let start = ROWS[..rank].iter().flatten().sum::<usize>();
        let rows = ROWS[rank];
        b_prepared.set_window_items(rows[0] + rows[1]).unwrap();
        let mut first = start;
        for n in rows {
            let _step = b_prepared.accumulate();
            let xs = x.narrow(0, first, n).unwrap();
            let ys = y.narrow(0, first, n).unwrap();
            let mean = candle_nn::loss::cross_entropy(&b.forward(&xs).unwrap(), &ys).unwrap();
            b_prepared.backward(&(mean * n as f64).unwrap()).unwrap();
            first += n;
        }
        assert!(b_prepared.sync_gradients());
        b_prepared
            .parameters()
            .iter()
            .map(|(name, _)| {
                let g = b_prepared.gradient(name).unwrap().unwrap();
                (
                    name.clone(),
                    g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                )
            })
            .collect::<Vec<_>>()
    });
    for ours in per_rank {
        for ((name, got), (_, want)) in ours.iter().zip(&reference) {
            let d = got
                .iter()
                .zip(want)
                .map(|(g, w)| (g - w).abs())
                .fold(0f32, f32::max);
            assert!(d < 1e-6, "{name}: max |Δg| = {d}");
        }
    }
}

/// Under mixed precision the model holds half-precision compute copies and the state trains f32
/// masters; a parameter of a model prepared before, passed again in another model, is still
/// recognised and refused (two masters of one weight would each overwrite it).
#[test]
fn a_parameter_shared_between_models_is_refused_under_mixed_precision() {
    let mut acc = Accelerator::builder()
        .process_state(ProcessState::single())
        .mixed_precision(accelerate_core::MixedPrecision::Bf16)
        .build()
        .unwrap();
    let half = |v: f32| {
        Var::from_tensor(
            &Tensor::new(&[v, v], &candle_core::Device::Cpu)
                .unwrap()
                .to_dtype(candle_core::DType::BF16)
                .unwrap(),
        )
        .unwrap()
    };
    let shared = half(1.0);
    acc.prepare(Model::new(vec![("w".into(), shared.clone())]))
        .unwrap();
    let e = acc
        .prepare(Model::new(vec![
            ("v".into(), half(2.0)),
            ("w_again".into(), shared),
        ]))
        .expect_err("a parameter of the first model in the second")
        .to_string();
    assert!(
        e.contains("w_again") && e.contains("prepared before"),
        "{e}"
    );
}
