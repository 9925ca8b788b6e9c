//! Gradient accumulation on one process, against a plain candle loop on one big batch.
//!
//! The reference side never touches the Accelerator, the gradient buffers or our optimizers: it
//! computes candle gradients of the big batch and applies PyTorch's update rules written out in
//! `ReferenceOptimizer`.

use std::sync::Arc;

use accelerate_core::data::{DataLoader, TensorDataset};
use accelerate_core::optim::{
    AdamW, AdamWConfig, LrScheduler, Optimizer, Schedule, Sgd, SgdConfig,
};
use accelerate_core::{Accelerator, ProcessState};
use accelerate_tests::{
    max_abs_diff, named_vars, snapshot, tiny_data, tiny_mlp, ReferenceOptimizer, TINY_IN,
};
use candle_core::{DType, Device, Tensor, Var};

fn accelerator(k: usize) -> Accelerator {
    Accelerator::builder()
        .gradient_accumulation_steps(k)
        .process_state(ProcessState::single())
        .build()
        .unwrap()
}

#[derive(Clone, Copy, Debug)]
enum Opt {
    SgdMomentum,
    AdamW,
}

/// Trains with the Accelerator (K micro-batches of `b`) and returns the final parameters.
fn train_accumulated(
    opt: Opt,
    samples: usize,
    b: usize,
    k: usize,
    epochs: usize,
) -> Vec<(String, Var)> {
    let mut acc = accelerator(k);
    let (varmap, model) = tiny_mlp(1).unwrap();
    let (x, y) = tiny_data(samples, 2).unwrap();
    let params = acc.prepare(&varmap).unwrap();
    let loader = DataLoader::new(Arc::new(TensorDataset::new(x, y).unwrap()), b)
        .shuffle(true)
        .seed(5);
    let mut loader = acc.prepare(loader).unwrap();
    let step = |acc: &Accelerator, x: &Tensor, y: &Tensor| {
        let _s = acc.accumulate();
        let loss = candle_nn::loss::cross_entropy(&model.forward(x).unwrap(), y).unwrap();
        acc.backward(&loss).unwrap();
    };
    match opt {
        Opt::SgdMomentum => {
            let cfg = SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                ..SgdConfig::default()
            };
            let mut o = acc.prepare(Sgd::new(params.clone(), cfg).unwrap()).unwrap();
            for _ in 0..epochs {
                for batch in loader.iter() {
                    let (x, y) = batch.unwrap();
                    step(&acc, &x, &y);
                    o.step().unwrap();
                    o.zero_grad();
                }
            }
        }
        Opt::AdamW => {
            let cfg = AdamWConfig {
                lr: 0.01,
                weight_decay: 0.1,
                ..AdamWConfig::default()
            };
            let mut o = acc
                .prepare(AdamW::new(params.clone(), cfg).unwrap())
                .unwrap();
            for _ in 0..epochs {
                for batch in loader.iter() {
                    let (x, y) = batch.unwrap();
                    step(&acc, &x, &y);
                    o.step().unwrap();
                    o.zero_grad();
                }
            }
        }
    }
    params
}

/// The reference: plain candle, batches of `big` in the same shuffled order, reference optimizer.
fn train_reference(
    opt: Opt,
    samples: usize,
    big: usize,
    epochs: usize,
) -> (Vec<(String, Var)>, usize) {
    let (varmap, model) = tiny_mlp(1).unwrap();
    let (x, y) = tiny_data(samples, 2).unwrap();
    let params = named_vars(&varmap);
    let mut reference = match opt {
        Opt::SgdMomentum => ReferenceOptimizer::sgd(0.1, 0.9),
        Opt::AdamW => ReferenceOptimizer::adamw(0.01, 0.1),
    };
    let mut loader = DataLoader::new(Arc::new(TensorDataset::new(x, y).unwrap()), big)
        .shuffle(true)
        .seed(5);
    let mut steps = 0;
    for _ in 0..epochs {
        for batch in loader.iter() {
            let (x, y) = batch.unwrap();
            let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
            reference.step(&params, &loss.backward().unwrap()).unwrap();
            steps += 1;
        }
    }
    (params, steps)
}

#[test]
fn k_micro_batches_equal_one_big_batch_sgd_momentum() {
    // 160 samples, 4 x 8 per window: 5 optimizer steps per epoch, 2 shuffled epochs.
    let ours = train_accumulated(Opt::SgdMomentum, 160, 8, 4, 2);
    let (reference, steps) = train_reference(Opt::SgdMomentum, 160, 32, 2);
    assert_eq!(steps, 10);
    let d = max_abs_diff(&ours, &reference);
    assert!(d < 1e-5, "max |Δθ| = {d}");
    // The comparison can fail: without accumulation (batch 8 steps) the result is far away.
    let unaccumulated = train_accumulated(Opt::SgdMomentum, 160, 8, 1, 2);
    assert!(max_abs_diff(&unaccumulated, &reference) > 1e-2);
}

#[test]
fn k_micro_batches_equal_one_big_batch_adamw() {
    let ours = train_accumulated(Opt::AdamW, 160, 8, 4, 2);
    let (reference, steps) = train_reference(Opt::AdamW, 160, 32, 2);
    assert_eq!(steps, 10);
    let d = max_abs_diff(&ours, &reference);
    assert!(d < 1e-5, "max |Δθ| = {d}");
}

#[test]
fn partial_last_window_is_weighted_by_its_true_length() {
    // 88 samples in micro-batches of 8: 11 per epoch, windows of 4, 4 and 3. The reference's last
    // batch holds 24 samples; dividing that window by K = 4 (as Accelerate does) would not match.
    let ours = train_accumulated(Opt::SgdMomentum, 88, 8, 4, 2);
    let (reference, steps) = train_reference(Opt::SgdMomentum, 88, 32, 2);
    assert_eq!(steps, 6);
    let d = max_abs_diff(&ours, &reference);
    assert!(d < 1e-5, "max |Δθ| = {d}");
}

/// Sequences of 5 positions with a per-sample number of valid positions (1..=5); the model maps
/// each position's features to a scalar, the loss is the squared error summed over valid positions.
fn sequence_data(n: usize) -> (Tensor, Tensor) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let mut x = Vec::new();
    let mut y = Vec::new();
    for _ in 0..n {
        let valid = rng.random_range(1..=5);
        for pos in 0..5 {
            for _ in 0..TINY_IN {
                x.push(rng.random_range(-1.0f32..1.0));
            }
            // Column 0 is the target, column 1 the mask (1 = a real item, 0 = padding).
            y.push(rng.random_range(-1.0f32..1.0));
            y.push(if pos < valid { 1.0 } else { 0.0 });
        }
    }
    (
        Tensor::from_vec(x, (n, 5, TINY_IN), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (n, 5, 2), &Device::Cpu).unwrap(),
    )
}

/// Summed squared error over valid positions, and the number of valid positions.
fn summed_loss(w: &Var, x: &Tensor, y: &Tensor) -> (Tensor, f64) {
    let pred = x
        .broadcast_matmul(&w.as_tensor().t().unwrap())
        .unwrap()
        .squeeze(2)
        .unwrap();
    let target = y.narrow(2, 0, 1).unwrap().squeeze(2).unwrap();
    let mask = y.narrow(2, 1, 1).unwrap().squeeze(2).unwrap();
    let err = ((pred - target).unwrap().sqr().unwrap() * &mask).unwrap();
    let items = mask.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
    (err.sum_all().unwrap(), items)
}

#[test]
fn item_weighted_windows_equal_one_batch_of_all_items() {
    let (x, y) = sequence_data(48);
    let w0 = Tensor::from_vec(
        vec![0.1f32, -0.2, 0.3, 0.0, 0.05, -0.1],
        (1, TINY_IN),
        &Device::Cpu,
    )
    .unwrap();
    let lr = 0.05;

    // Ours: micro-batches of 4, K = 3 (windows of 12 sequences with uneven token counts).
    let mut acc = accelerator(3);
    let w = Var::from_tensor(&w0).unwrap();
    let params = acc.prepare(vec![("w".to_string(), w.clone())]).unwrap();
    let cfg = SgdConfig {
        lr,
        ..SgdConfig::default()
    };
    let mut opt = acc.prepare(Sgd::new(params, cfg).unwrap()).unwrap();
    let loader = DataLoader::new(
        Arc::new(TensorDataset::new(x.clone(), y.clone()).unwrap()),
        4,
    );
    let mut loader = acc.prepare(loader).unwrap();
    let mut window_items = Vec::new();
    for window in loader.windows(3) {
        let window = window.unwrap();
        let per_batch: Vec<f64> = window
            .iter()
            .map(|(x, y)| summed_loss(&w, x, y).1)
            .collect();
        let items: f64 = per_batch.iter().sum();
        window_items.push(per_batch);
        acc.set_window_items(items as usize).unwrap();
        for (x, y) in window {
            let _s = acc.accumulate();
            acc.backward(&summed_loss(&w, &x, &y).0).unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        }
    }
    assert_eq!(window_items.len(), 4);
    // The windows really are uneven, so per-micro-batch averaging would give another answer.
    assert!(window_items.iter().any(|w| w.iter().any(|&n| n != w[0])));

    // Reference: one batch of 12 sequences per step, loss = sum over items / item count.
    let r = Var::from_tensor(&w0).unwrap();
    for step in 0..4 {
        let xs = x.narrow(0, step * 12, 12).unwrap();
        let ys = y.narrow(0, step * 12, 12).unwrap();
        let (sum, items) = summed_loss(&r, &xs, &ys);
        let loss = (sum / items).unwrap();
        let g = loss.backward().unwrap();
        let grad = g.get(r.as_tensor()).unwrap();
        r.set(&(r.as_tensor() - (grad * lr).unwrap()).unwrap())
            .unwrap();
    }
    let d = max_abs_diff(&[("w".into(), w)], &[("w".into(), r)]);
    assert!(d < 1e-6, "max |Δw| = {d}");
}

#[test]
fn an_item_weighted_window_after_an_abandoned_one_equals_one_batch_of_its_items() {
    // Epoch 0 trains one window, then leaves the next after one micro-step (a `break`); epoch 1
    // trains all four. The abandoned window must neither step nor change how epoch 1's first
    // window is weighted: world / items, not 1 / K.
    let (x, y) = sequence_data(48);
    let w0 = Tensor::from_vec(
        vec![0.1f32, -0.2, 0.3, 0.0, 0.05, -0.1],
        (1, TINY_IN),
        &Device::Cpu,
    )
    .unwrap();
    let lr = 0.05;
    let mut acc = accelerator(3);
    let w = Var::from_tensor(&w0).unwrap();
    let params = acc.prepare(vec![("w".to_string(), w.clone())]).unwrap();
    let cfg = SgdConfig {
        lr,
        ..SgdConfig::default()
    };
    let mut opt = acc.prepare(Sgd::new(params, cfg).unwrap()).unwrap();
    let loader = DataLoader::new(
        Arc::new(TensorDataset::new(x.clone(), y.clone()).unwrap()),
        4,
    );
    let mut loader = acc.prepare(loader).unwrap();
    for (epoch, windows) in [(0, 2), (1, 4)] {
        for (i, window) in loader.windows(3).take(windows).enumerate() {
            let window = window.unwrap();
            let items: f64 = window.iter().map(|(x, y)| summed_loss(&w, x, y).1).sum();
            acc.set_window_items(items as usize).unwrap();
            let abandoned = epoch == 0 && i == 1;
            for (x, y) in window.into_iter().take(if abandoned { 1 } else { 3 }) {
                let _s = acc.accumulate();
                acc.backward(&summed_loss(&w, &x, &y).0).unwrap();
                opt.step().unwrap();
                opt.zero_grad();
            }
        }
    }
    assert_eq!(acc.optimizer_steps(), 5);

    // Reference: one batch of 12 sequences per step: epoch 0's first window, then epoch 1's four.
    let r = Var::from_tensor(&w0).unwrap();
    for start in [0, 0, 12, 24, 36] {
        let (sum, items) = summed_loss(
            &r,
            &x.narrow(0, start, 12).unwrap(),
            &y.narrow(0, start, 12).unwrap(),
        );
        let g = (sum / items).unwrap().backward().unwrap();
        let grad = g.get(r.as_tensor()).unwrap();
        r.set(&(r.as_tensor() - (grad * lr).unwrap()).unwrap())
            .unwrap();
    }
    let d = max_abs_diff(&[("w".into(), w)], &[("w".into(), r)]);
    assert!(d < 1e-6, "max |Δw| = {d}");
}

#[test]
fn optimizer_and_scheduler_do_nothing_on_non_sync_micro_steps() {
    let k = 3;
    let mut acc = accelerator(k);
    let (varmap, model) = tiny_mlp(4).unwrap();
    let (x, y) = tiny_data(8 * 9, 3).unwrap();
    let params = acc.prepare(&varmap).unwrap();
    let cfg = SgdConfig {
        lr: 0.5,
        momentum: 0.9,
        ..SgdConfig::default()
    };
    let opt = Sgd::new(params.clone(), cfg).unwrap();
    let lr = opt.learning_rate().clone();
    let mut opt = acc.prepare(opt).unwrap();
    let schedule = Schedule::LinearWarmupDecay {
        warmup_steps: 0,
        total_steps: 3,
    };
    let mut sched = acc
        .prepare(LrScheduler::new(lr, schedule).unwrap())
        .unwrap();
    let mut loader = acc
        .prepare(DataLoader::new(
            Arc::new(TensorDataset::new(x, y).unwrap()),
            8,
        ))
        .unwrap();
    let mut lrs = Vec::new();
    for (i, batch) in loader.iter().enumerate() {
        let (x, y) = batch.unwrap();
        let step = acc.accumulate();
        assert_eq!(step.sync, i % k == k - 1, "micro-step {i}");
        assert_eq!(acc.sync_gradients(), step.sync);
        let before = snapshot(&params);
        let lr_before = opt.learning_rate();
        let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        acc.backward(&loss).unwrap();
        opt.step().unwrap();
        sched.step();
        opt.zero_grad();
        let changed = snapshot(&params) != before;
        assert_eq!(changed, step.sync, "parameters changed on micro-step {i}");
        if step.sync {
            lrs.push(lr_before);
        } else {
            assert_eq!(opt.learning_rate(), lr_before);
        }
    }
    assert_eq!(acc.optimizer_steps(), 3);
    // transformers' linear schedule without warmup: optimizer step s (0-based) uses
    // lr = 0.5 * (3 - s) / 3.
    let expected: Vec<f64> = (0..3).map(|s: usize| 0.5 * (3 - s) as f64 / 3.0).collect();
    assert_eq!(lrs.len(), 3);
    for (got, want) in lrs.iter().zip(&expected) {
        assert!((got - want).abs() < 1e-12, "{lrs:?} vs {expected:?}");
    }
    // One all-reduce (identity at world size 1) per bucket per optimizer step, none in between.
    assert_eq!(acc.comm_stats().all_reduces, 3);
}

#[test]
fn clipping_acts_on_the_whole_window() {
    // Clip to a norm smaller than the window's gradient: the result must equal clipping the
    // big-batch gradient, which differs from clipping each micro-batch.
    let max_norm = 0.05;
    let mut acc = accelerator(2);
    let (varmap, model) = tiny_mlp(6).unwrap();
    let (x, y) = tiny_data(16, 8).unwrap();
    let params = acc.prepare(&varmap).unwrap();
    let mut opt = acc
        .prepare(
            Sgd::new(
                params.clone(),
                SgdConfig {
                    lr: 1.0,
                    ..SgdConfig::default()
                },
            )
            .unwrap(),
        )
        .unwrap();
    let mut loader = acc
        .prepare(DataLoader::new(
            Arc::new(TensorDataset::new(x.clone(), y.clone()).unwrap()),
            8,
        ))
        .unwrap();
    let mut norms = Vec::new();
    for batch in loader.iter() {
        let (x, y) = batch.unwrap();
        let _s = acc.accumulate();
        let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        acc.backward(&loss).unwrap();
        norms.push(acc.clip_grad_norm(max_norm).unwrap());
        opt.step().unwrap();
        opt.zero_grad();
    }
    assert_eq!(norms[0], None, "no clipping before the window is complete");

    let (rmap, rmodel) = tiny_mlp(6).unwrap();
    let rparams = named_vars(&rmap);
    let loss = candle_nn::loss::cross_entropy(&rmodel.forward(&x).unwrap(), &y).unwrap();
    let grads = loss.backward().unwrap();
    let norm: f64 = rparams
        .iter()
        .map(|(_, v)| {
            let g = grads
                .get(v.as_tensor())
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap();
            g.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        })
        .sum::<f64>()
        .sqrt();
    let got = norms[1].unwrap();
    assert!((got - norm).abs() < 1e-5 * norm, "norm {got} vs {norm}");
    assert!(norm > max_norm);
    let coef = max_norm / (norm + 1e-6);
    for (_, v) in &rparams {
        let g = grads.get(v.as_tensor()).unwrap();
        v.set(&(v.as_tensor() - (g * coef).unwrap()).unwrap())
            .unwrap();
    }
    let d = max_abs_diff(&params, &rparams);
    assert!(d < 1e-6, "max |Δθ| = {d}");
}

#[test]
fn a_plain_loop_without_accumulate_steps_every_backward() {
    let mut acc = accelerator(1);
    let (varmap, model) = tiny_mlp(2).unwrap();
    let (x, y) = tiny_data(8, 1).unwrap();
    let params = acc.prepare(&varmap).unwrap();
    let mut opt = acc
        .prepare(
            Sgd::new(
                params.clone(),
                SgdConfig {
                    lr: 0.1,
                    ..SgdConfig::default()
                },
            )
            .unwrap(),
        )
        .unwrap();
    let (rmap, rmodel) = tiny_mlp(2).unwrap();
    let rparams = named_vars(&rmap);
    let mut reference = ReferenceOptimizer::sgd(0.1, 0.0);
    for _ in 0..3 {
        let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        acc.backward(&loss).unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        let rloss = candle_nn::loss::cross_entropy(&rmodel.forward(&x).unwrap(), &y).unwrap();
        reference
            .step(&rparams, &rloss.backward().unwrap())
            .unwrap();
    }
    assert!(max_abs_diff(&params, &rparams) < 1e-6);
    // A second backward in an explicit micro-step is refused rather than double-counted.
    let _s = acc.accumulate();
    let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
    acc.backward(&loss).unwrap();
    let e = acc.backward(&loss).unwrap_err().to_string();
    assert!(e.contains("backward was called twice"), "{e}");
}
