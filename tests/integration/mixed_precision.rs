//! Mixed precision on the CPU: fp16 overflow skips the step (and the scaler backs off) and the next
//! step matches an update computed by hand; bf16 gradient buffers equal the sum of independently
//! computed bf16 gradients; the scaler and the masters survive a checkpoint; bf16 training of the
//! `mlp` workload converges like f32; two ranks under `accelerate-launch --mixed-precision bf16`
//! end with identical parameters; the compute copies the optimizers write in their update's pass
//! are bitwise the cast of the masters the runtime made after every step.

use std::path::Path;
use std::time::Duration;

use accelerate_core::optim::{
    split_decay, AdamW, AdamWConfig, Lion, LionConfig, LrScheduler, Optimizer, ParamGroup,
    Schedule, Sgd, SgdConfig,
};
use accelerate_core::{Accelerator, LossScalerConfig, MixedPrecision, ProcessState};
use accelerate_tests::{
    metric_losses, named_vars, output_text as text, ranks_as_threads, tensor_bits, CopiesOrCast,
    Job,
};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module, VarBuilder, VarMap};

const LIMIT: Duration = Duration::from_secs(240);

fn accelerator(mode: MixedPrecision, k: usize, growth_interval: u64) -> Accelerator {
    Accelerator::builder()
        .process_state(ProcessState::single())
        .gradient_accumulation_steps(k)
        .mixed_precision(mode)
        .loss_scaler(LossScalerConfig {
            growth_interval,
            ..LossScalerConfig::default()
        })
        .build()
        .unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Sets every Var of `varmap` (whatever its dtype) from f32 values.
fn set_f32(varmap: &VarMap, name: &str, v: &[f32]) {
    let data = varmap.data().lock().unwrap();
    let var = &data[name];
    let t = Tensor::from_vec(v.to_vec(), var.dims(), &Device::Cpu).unwrap();
    var.set(&t.to_dtype(var.dtype()).unwrap()).unwrap();
}

/// A 3 → 2 linear layer in the accelerator's compute dtype, with weights f16 represents exactly.
fn fp16_layer(acc: &Accelerator) -> (VarMap, Linear) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, acc.compute_dtype(), &Device::Cpu);
    let layer = candle_nn::linear(3, 2, vb.pp("l")).unwrap();
    set_f32(&varmap, "l.weight", &[0.5, -0.25, 0.125, 0.75, 0.5, -0.5]);
    set_f32(&varmap, "l.bias", &[0.25, -0.125]);
    (varmap, layer)
}

// Small enough that the scaled f16 gradients of the squared error stay below 65504 at a scale
// of 2^15 (a larger input overflows there too, as it would in PyTorch).
const X: [[f32; 3]; 2] = [[0.25, 0.5, -0.25], [0.125, -0.25, 0.5]];
const T: [[f32; 2]; 2] = [[1.0, 0.0], [0.0, 1.0]];

/// Gradient of mean((W x + b - t)^2) over the 2x2 outputs, in f64 from the formula:
/// dW[o][j] = 2/4 Σ_i r[i][o] x[i][j], db[o] = 2/4 Σ_i r[i][o].
fn hand_gradient(w: &[f32], b: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let (mut gw, mut gb) = (vec![0f64; 6], vec![0f64; 2]);
    for (x, t) in X.iter().zip(&T) {
        for o in 0..2 {
            let y: f64 = (0..3)
                .map(|j| w[o * 3 + j] as f64 * x[j] as f64)
                .sum::<f64>()
                + b[o] as f64;
            let r = y - t[o] as f64;
            for j in 0..3 {
                gw[o * 3 + j] += 0.5 * r * x[j] as f64;
            }
            gb[o] += 0.5 * r;
        }
    }
    (gw, gb)
}

#[test]
fn an_fp16_overflow_skips_the_step_and_the_next_step_matches_a_hand_computed_update() {
    let mut acc = accelerator(MixedPrecision::Fp16, 1, 2);
    assert_eq!(acc.compute_dtype(), DType::F16);
    let (varmap, layer) = fp16_layer(&acc);
    let params = acc.prepare(&varmap).unwrap();
    assert!(params.iter().all(|(_, v)| v.dtype() == DType::F32));
    let lr = 0.1;
    let sgd = Sgd::new(
        params.clone(),
        SgdConfig {
            lr,
            momentum: 0.9,
            ..SgdConfig::default()
        },
    )
    .unwrap();
    let mut opt = acc.prepare(sgd).unwrap();
    let schedule = Schedule::LinearWarmupDecay {
        warmup_steps: 0,
        total_steps: 10,
    };
    let mut sched = acc
        .prepare(LrScheduler::new(opt.learning_rate_handle(), schedule).unwrap())
        .unwrap();
    let x = Tensor::new(&X, &Device::Cpu).unwrap();
    let t = Tensor::new(&T, &Device::Cpu).unwrap();
    let forward = |acc: &Accelerator| {
        layer
            .forward(&x.to_dtype(acc.compute_dtype()).unwrap())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let master = |i: usize| values(params[i].1.as_tensor());
    let (b0, w0) = (master(0), master(1));
    let compute0 = named_vars(&varmap);
    let compute_before: Vec<Vec<f32>> = compute0.iter().map(|(_, v)| values(v)).collect();
    assert_eq!(acc.loss_scale(), Some(65536.0));

    // Step 1: the loss is finite in f32 (1e6·Σy), but its gradient times the scale 2^16 is far
    // beyond f16's 65504: inf in the half-precision backward pass.
    let _s = acc.accumulate();
    let loss = (forward(&acc) * 1e6).unwrap().sum_all().unwrap();
    assert!(loss.to_scalar::<f32>().unwrap().is_finite());
    acc.backward(&loss).unwrap();
    opt.step().unwrap();
    sched.step();
    opt.zero_grad();
    assert!(acc.step_was_skipped() && opt.step_was_skipped());
    assert_eq!(acc.optimizer_steps(), 0);
    assert_eq!(
        (master(0), master(1)),
        (b0.clone(), w0.clone()),
        "masters unchanged"
    );
    let compute_after: Vec<Vec<f32>> = compute0.iter().map(|(_, v)| values(v)).collect();
    assert_eq!(compute_after, compute_before, "compute copies unchanged");
    assert_eq!(opt.learning_rate(), lr, "the scheduler did not step");
    assert_eq!(sched.steps(), 0);
    assert!(
        opt.state().unwrap().tensors.is_empty(),
        "no momentum buffer"
    );
    assert_eq!(acc.loss_scale(), Some(32768.0), "backed off by 0.5");
    assert!(
        acc.model().gradient("l.weight").unwrap().is_none(),
        "gradients dropped"
    );

    // Step 2: a good step, against SGD's first update (buf = g, p -= lr·g) from the hand gradient
    // of the f32 masters.
    let _s = acc.accumulate();
    let loss = (forward(&acc) - &t)
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap();
    acc.backward(&loss).unwrap();
    let (gw, gb) = hand_gradient(&w0, &b0);
    // The buffers hold the true gradient: the scale 32768 was divided out.
    let got_gw = values(&acc.model().gradient("l.weight").unwrap().unwrap());
    for (g, want) in got_gw.iter().zip(&gw) {
        assert!(
            (*g as f64 - want).abs() < 2e-3 * (1.0 + want.abs()),
            "{g} vs {want}"
        );
    }
    opt.step().unwrap();
    sched.step();
    opt.zero_grad();
    assert!(!acc.step_was_skipped());
    assert_eq!(acc.optimizer_steps(), 1);
    assert_eq!(sched.steps(), 1);
    assert!((opt.learning_rate() - 0.09).abs() < 1e-12);
    let (w1, b1) = (master(1), master(0));
    let mut moved = 0f64;
    for (i, want) in gw.iter().enumerate() {
        let expect = w0[i] as f64 - lr * want;
        // f16 forward and backward: ~1e-3 relative error in the gradient.
        assert!(
            (w1[i] as f64 - expect).abs() < 1e-3,
            "w[{i}] {} vs {expect}",
            w1[i]
        );
        moved = moved.max((w1[i] - w0[i]).abs() as f64);
    }
    for (i, want) in gb.iter().enumerate() {
        let expect = b0[i] as f64 - lr * want;
        assert!(
            (b1[i] as f64 - expect).abs() < 1e-3,
            "b[{i}] {} vs {expect}",
            b1[i]
        );
    }
    assert!(
        moved > 0.01,
        "the update is far larger than the tolerance: {moved}"
    );
    // The compute copies hold the new masters rounded to f16.
    for ((_, c), (_, m)) in named_vars(&varmap).iter().zip(&params) {
        assert_eq!(c.dtype(), DType::F16);
        let rounded = m.as_tensor().to_dtype(DType::F16).unwrap();
        assert_eq!(values(c), values(&rounded));
    }
    assert_eq!(
        acc.loss_scale(),
        Some(32768.0),
        "one good step of an interval of 2"
    );

    // Step 3: the second consecutive good step grows the scale by 2.
    let _s = acc.accumulate();
    let loss = (forward(&acc) - &t)
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap();
    acc.backward(&loss).unwrap();
    opt.step().unwrap();
    assert_eq!(acc.optimizer_steps(), 2);
    assert_eq!(acc.loss_scale(), Some(65536.0));
}

/// A 5 → 4 → 3 tanh MLP in `dtype` with fixed weights (rounded to `dtype`).
fn small_mlp(dtype: DType) -> (VarMap, impl Fn(&Tensor) -> Tensor) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
    let l1 = candle_nn::linear(5, 4, vb.pp("l1")).unwrap();
    let l2 = candle_nn::linear(4, 3, vb.pp("l2")).unwrap();
    for (name, var) in named_vars(&varmap) {
        let v: Vec<f32> = (0..var.elem_count())
            .map(|i| ((i * 7 + name.len() * 3) % 13) as f32 / 13.0 - 0.45)
            .collect();
        set_f32(&varmap, &name, &v);
    }
    let forward = move |x: &Tensor| {
        let h = l1
            .forward(&x.to_dtype(dtype).unwrap())
            .unwrap()
            .tanh()
            .unwrap();
        l2.forward(&h).unwrap().to_dtype(DType::F32).unwrap()
    };
    (varmap, forward)
}

fn micro_batch(i: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..6 * 5)
        .map(|j| (((i * 31 + j * 17) % 23) as f32 - 11.0) / 7.0)
        .collect();
    let y: Vec<u32> = (0..6).map(|j| ((i + j * 2) % 3) as u32).collect();
    (
        Tensor::from_vec(x, (6, 5), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, 6, &Device::Cpu).unwrap(),
    )
}

#[test]
fn bf16_buffers_hold_the_f32_sum_of_each_micro_steps_bf16_gradient() {
    const K: usize = 4;
    let mut acc = accelerator(MixedPrecision::Bf16, K, 2000);
    assert_eq!(acc.loss_scale(), None, "no loss scaling under bf16");
    let (varmap, forward) = small_mlp(acc.compute_dtype());
    acc.prepare(&varmap).unwrap();
    for i in 0..K {
        let (x, y) = micro_batch(i);
        let step = acc.accumulate();
        assert_eq!(step.sync, i == K - 1);
        let loss = candle_nn::loss::cross_entropy(&forward(&x), &y).unwrap();
        acc.backward(&loss).unwrap();
    }

    // Independently: a plain candle model holding the same bf16 weights, one backward pass per
    // micro-batch, each bf16 gradient cast to f32, scaled by 1/K and summed in f32.
    let (ref_map, ref_forward) = small_mlp(DType::BF16);
    let (f32_map, f32_forward) = small_mlp(DType::F32);
    for (name, var) in named_vars(&f32_map) {
        // The f32 model starts from the same (bf16-representable) values.
        set_f32(
            &f32_map,
            &name,
            &values(&ref_map.data().lock().unwrap()[&name]),
        );
        assert_eq!(var.dtype(), DType::F32);
    }
    let mut want: Vec<Option<Tensor>> = vec![None; 4];
    let mut full: Vec<Option<Tensor>> = vec![None; 4];
    for i in 0..K {
        let (x, y) = micro_batch(i);
        for (map, fwd, sums) in [
            (
                &ref_map,
                &ref_forward as &dyn Fn(&Tensor) -> Tensor,
                &mut want,
            ),
            (&f32_map, &f32_forward, &mut full),
        ] {
            let loss = candle_nn::loss::cross_entropy(&fwd(&x), &y).unwrap();
            let grads = loss.backward().unwrap();
            for (slot, (_, var)) in sums.iter_mut().zip(named_vars(map)) {
                let g = grads.get(var.as_tensor()).unwrap();
                let g = (g.to_dtype(DType::F32).unwrap() * (1.0 / K as f64)).unwrap();
                *slot = Some(match slot.take() {
                    None => g,
                    Some(s) => (s + g).unwrap(),
                });
            }
        }
    }
    let mut bf16_vs_f32 = 0f32;
    for (j, (name, _)) in named_vars(&varmap).iter().enumerate() {
        let got = values(&acc.model().gradient(name).unwrap().unwrap());
        assert_eq!(
            acc.model().gradient(name).unwrap().unwrap().dtype(),
            DType::F32
        );
        let want = values(want[j].as_ref().unwrap());
        let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * scale, "{name}: {g} vs {w}");
        }
        for (w, f) in want.iter().zip(values(full[j].as_ref().unwrap())) {
            bf16_vs_f32 = bf16_vs_f32.max((w - f).abs());
        }
    }
    // The check could fail: f32 compute gives visibly different gradients.
    assert!(
        bf16_vs_f32 > 1e-4,
        "bf16 and f32 gradients agree to {bf16_vs_f32}"
    );
}

#[test]
fn an_optimizer_built_from_the_half_compute_copies_is_refused() {
    let mut acc = accelerator(MixedPrecision::Bf16, 1, 2000);
    let (varmap, _) = small_mlp(acc.compute_dtype());
    acc.prepare(&varmap).unwrap();
    let sgd = Sgd::new(named_vars(&varmap), SgdConfig::default()).unwrap();
    let e = acc.prepare(sgd).err().unwrap().to_string();
    assert!(
        e.contains("not the f32 master weight") && e.contains("BF16"),
        "{e}"
    );

    let mut acc = accelerator(MixedPrecision::Bf16, 1, 2000);
    let (f32_map, _) = small_mlp(DType::F32);
    let e = acc.prepare(&f32_map).err().unwrap().to_string();
    assert!(e.contains("compute_dtype()"), "{e}");
}

#[test]
fn the_loss_scaler_and_the_master_weights_come_back_from_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let train = |acc: &mut Accelerator, layer: &Linear, steps: &[bool]| {
        let x = Tensor::new(&X, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap();
        for &overflow in steps {
            let _s = acc.accumulate();
            let y = layer.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
            let factor = if overflow { 1e6 } else { 1.0 };
            let loss = (y * factor).unwrap().mean_all().unwrap();
            acc.backward(&loss).unwrap();
        }
    };
    let setup = || {
        let mut acc = accelerator(MixedPrecision::Fp16, 1, 3);
        let (varmap, layer) = fp16_layer(&acc);
        let params = acc.prepare(&varmap).unwrap();
        let opt = acc
            .prepare(Sgd::new(params.clone(), SgdConfig::default()).unwrap())
            .unwrap();
        (acc, varmap, layer, params, opt)
    };
    let (mut acc, _, layer, params, mut opt) = setup();
    for overflow in [true, false] {
        train(&mut acc, &layer, &[overflow]);
        opt.step().unwrap();
        opt.zero_grad();
    }
    // Backed off once, then one good step of an interval of 3.
    assert_eq!(acc.loss_scale(), Some(32768.0));
    acc.save_state(dir.path()).unwrap();
    let saved: Vec<Vec<f32>> = params.iter().map(|(_, v)| values(v)).collect();

    let (mut acc2, varmap2, layer2, params2, mut opt2) = setup();
    // Make the fresh run's masters differ, so that the load must restore them.
    for (_, v) in &params2 {
        v.set(&v.as_tensor().zeros_like().unwrap()).unwrap();
    }
    acc2.load_state(dir.path()).unwrap();
    assert_eq!(acc2.loss_scale(), Some(32768.0));
    for ((_, v), want) in params2.iter().zip(&saved) {
        assert_eq!(v.dtype(), DType::F32);
        assert_eq!(&values(v), want);
    }
    for ((_, c), (_, m)) in named_vars(&varmap2).iter().zip(&params2) {
        assert_eq!(values(c), values(&m.to_dtype(DType::F16).unwrap()));
    }
    // The growth tracker came back too (1 of 3): two more good steps grow the scale, not three.
    for expected in [32768.0, 65536.0] {
        train(&mut acc2, &layer2, &[false]);
        opt2.step().unwrap();
        opt2.zero_grad();
        assert_eq!(acc2.loss_scale(), Some(expected));
    }
}

/// Trains the `mlp` example alone in `mode`; returns the per-step losses.
fn train_mlp(mode: &str, metrics: &Path, model: &Path) -> Vec<f64> {
    let o = Job::mlp(1)
        .args([
            "--hidden",
            "64",
            "--samples",
            "2048",
            "--epochs",
            "4",
            "--lr",
            "0.003",
            "--seed",
            "5",
            "--mixed-precision",
            mode,
            "--metrics",
            metrics.to_str().unwrap(),
            "--save-model",
            model.to_str().unwrap(),
        ])
        .limit(LIMIT)
        .run();
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&format!("mixed_precision={mode}")),
        "{}",
        text(&o)
    );
    metric_losses(metrics)
}

#[test]
fn bf16_training_of_the_mlp_workload_converges_like_f32() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let f32_loss = train_mlp("no", &p("no.jsonl"), &p("no.safetensors"));
    let bf16_loss = train_mlp("bf16", &p("bf16.jsonl"), &p("bf16.safetensors"));
    assert_eq!(bf16_loss.len(), 128);
    assert_eq!(f32_loss.len(), bf16_loss.len());
    // The mean over the last half epoch (16 steps), less noisy than one batch's loss.
    let tail = |l: &[f64]| l[l.len() - 16..].iter().sum::<f64>() / 16.0;
    let (first, end, end32) = (bf16_loss[0], tail(&bf16_loss), tail(&f32_loss));
    assert!(first > 2.0, "starts near ln(10): {first}");
    assert!(
        end < first / 10.0,
        "bf16 loss fell from {first} to only {end}"
    );
    assert!(
        (end - end32).abs() < 0.25 * end32,
        "bf16 ends at {end}, f32 at {end32}"
    );
    // The saved weights are the f32 masters, and they are not the f32 run's (bf16 did compute).
    let bf16 = candle_core::safetensors::load(p("bf16.safetensors"), &Device::Cpu).unwrap();
    let f32w = candle_core::safetensors::load(p("no.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(bf16.len(), 6);
    let mut differ = false;
    for (name, t) in &bf16 {
        assert_eq!(t.dtype(), DType::F32, "{name}");
        differ |= values(t) != values(&f32w[name]);
    }
    assert!(differ);
}

#[test]
fn a_bad_mixed_precision_in_the_environment_names_the_variable_and_the_choices() {
    let o = Job::mlp(1)
        .args(["--hidden", "8", "--samples", "64", "--max-steps", "1"])
        .env("ACCELERATE_MIXED_PRECISION", "fp8")
        .limit(LIMIT)
        .run();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("ACCELERATE_MIXED_PRECISION") && err.contains("no, bf16 or fp16"),
        "{}",
        text(&o)
    );
}

#[test]
fn two_ranks_under_the_launchers_bf16_flag_end_with_identical_parameters() {
    let o = Job::worker()
        .ranks(2)
        .launcher_flags(["--mixed_precision", "bf16"])
        .arg("mixed")
        .limit(LIMIT)
        .run();
    assert!(o.status.success(), "{}", text(&o));
    // 48 samples, batches of 4 on 2 ranks: 6 batches per rank, K = 2, two epochs.
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains(r#"result: {"identical":true,"steps":6}"#),
        "{}",
        text(&o)
    );
}

#[test]
fn gradients_averaged_in_bf16_are_the_rounded_mean_and_half_the_traffic() {
    // Each rank's gradient of sum(w * x) is its own x: the reduction can be checked by hand.
    let xs: [Vec<f32>; 2] = [
        (0..300).map(|i| (i as f32 * 0.731).sin() * 3.0).collect(),
        (0..300)
            .map(|i| (i as f32 * 1.377).cos() * 0.01 + 1.0)
            .collect(),
    ];
    let run = |dtype: DType| {
        ranks_as_threads(
            2,
            || Accelerator::builder().gradient_reduce_dtype(dtype),
            |mut acc| {
                let varmap = VarMap::new();
                let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
                let w = vb.get(300, "w").unwrap();
                acc.prepare(&varmap).unwrap();
                let x = Tensor::new(xs[acc.process_index()].as_slice(), &Device::Cpu).unwrap();
                let _step = acc.accumulate();
                acc.backward(&(&w * &x).unwrap().sum_all().unwrap())
                    .unwrap();
                let g = values(&acc.model().gradient("w").unwrap().unwrap());
                (g, acc.gradient_sync_stats().bytes)
            },
        )
    };
    let exact = run(DType::F32);
    let compressed = run(DType::BF16);
    // Both ranks agree, in either mode.
    assert_eq!(exact[0].0, exact[1].0);
    assert_eq!(compressed[0].0, compressed[1].0);
    let bf = |v: f32| half::bf16::from_f32(v).to_f32();
    for (i, (&a, &b)) in xs[0].iter().zip(&xs[1]).enumerate() {
        assert_eq!(exact[0].0[i], (a + b) / 2.0, "f32 mean at {i}");
        // The ring adds the two bf16 values (exactly, in f32), rounds the sum to bf16 and halves it.
        assert_eq!(
            compressed[0].0[i],
            bf(bf(a) + bf(b)) / 2.0,
            "bf16 mean at {i}"
        );
    }
    assert_ne!(exact[0].0, compressed[0].0, "the rounding is visible");
    // The bucket carries one more element: the flag of missing gradients.
    assert_eq!(exact[0].1, 301 * 4);
    assert_eq!(compressed[0].1, 301 * 2);
}

/// The optimizers of the copy test: AdamW in two groups (weights with decay, biases without), SGD
/// with Nesterov momentum and weight decay, Lion with weight decay.
fn copy_test_optimizer(
    which: usize,
    params: Vec<(String, candle_core::Var)>,
) -> Box<dyn Optimizer + Send> {
    match which {
        0 => {
            let split = split_decay(params);
            let decay = AdamWConfig {
                lr: 0.02,
                weight_decay: 0.1,
                ..AdamWConfig::default()
            };
            let no_decay = AdamWConfig {
                lr: 0.01,
                weight_decay: 0.0,
                ..decay
            };
            Box::new(
                AdamW::with_groups(vec![
                    ParamGroup::new(split.decay, decay),
                    ParamGroup::new(split.no_decay, no_decay),
                ])
                .unwrap(),
            )
        }
        1 => Box::new(
            Sgd::new(
                params,
                SgdConfig {
                    lr: 0.1,
                    momentum: 0.9,
                    nesterov: true,
                    weight_decay: 0.01,
                    ..SgdConfig::default()
                },
            )
            .unwrap(),
        ),
        _ => Box::new(
            Lion::new(
                params,
                LionConfig {
                    lr: 0.01,
                    weight_decay: 0.1,
                    ..LionConfig::default()
                },
            )
            .unwrap(),
        ),
    }
}

/// What a run ends with, bit for bit: the masters, the compute copies and the optimizer state.
type CopyRun = (Vec<Vec<u32>>, Vec<Vec<u32>>, Vec<(String, Vec<u32>)>);

/// Six optimizer steps of the small MLP under `mode` with optimizer `which`, its compute copies
/// written by the update (`keep_copies`) or cast by the runtime after each step. Under fp16 the
/// second window's loss is scaled to overflow, so that step is skipped. With `resume`, the state
/// is saved there after three steps and training continues in a new accelerator, model and
/// optimizer loaded from it.
fn train_copies(
    mode: MixedPrecision,
    which: usize,
    keep_copies: bool,
    resume: Option<&Path>,
) -> CopyRun {
    let setup = || {
        let mut acc = accelerator(mode, 1, 2000);
        let (varmap, forward) = small_mlp(acc.compute_dtype());
        let params = acc.prepare(&varmap).unwrap();
        let inner = copy_test_optimizer(which, params.clone());
        let opt = acc.prepare(CopiesOrCast { inner, keep_copies }).unwrap();
        (acc, varmap, forward, params, opt)
    };
    let (mut acc, mut varmap, mut forward, mut params, mut opt) = setup();
    for s in 0..6 {
        if s == 3 {
            if let Some(dir) = resume {
                acc.save_state(dir).unwrap();
                (acc, varmap, forward, params, opt) = setup();
                acc.load_state(dir).unwrap();
            }
        }
        let (x, y) = micro_batch(s);
        let _step = acc.accumulate();
        let mut loss = candle_nn::loss::cross_entropy(&forward(&x), &y).unwrap();
        let overflow = mode == MixedPrecision::Fp16 && s == 1;
        if overflow {
            loss = (loss * 1e30).unwrap();
        }
        acc.backward(&loss).unwrap();
        opt.step().unwrap();
        assert_eq!(opt.step_was_skipped(), overflow, "step {s}");
        if !overflow {
            // The runtime skipped the cast exactly where the update wrote the copy.
            opt.with_inner(|inner| {
                for (name, _) in &params {
                    assert_eq!(
                        inner.wrote_compute_copy(name),
                        keep_copies,
                        "{name}, step {s}"
                    );
                }
            })
            .unwrap();
        }
        opt.zero_grad();
    }
    let masters = params.iter().map(|(_, v)| tensor_bits(v)).collect();
    let compute = named_vars(&varmap)
        .iter()
        .map(|(_, v)| {
            assert_eq!(v.dtype(), mode.compute_dtype());
            tensor_bits(v)
        })
        .collect();
    let state = opt.state().unwrap();
    let state = state
        .tensors
        .iter()
        .map(|(k, t)| (k.clone(), tensor_bits(t)))
        .chain(state.scalars.iter().map(|(k, v)| {
            (
                k.clone(),
                vec![v.to_bits() as u32, (v.to_bits() >> 32) as u32],
            )
        }))
        .collect();
    (masters, compute, state)
}

#[test]
fn compute_copies_written_by_the_update_equal_a_cast_after_every_step() {
    for mode in [MixedPrecision::Bf16, MixedPrecision::Fp16] {
        for which in 0..3 {
            let label = format!("{mode}, optimizer {which}");
            let cast = train_copies(mode, which, false, None);
            let written = train_copies(mode, which, true, None);
            assert_eq!(written.0, cast.0, "{label}: masters");
            assert_eq!(written.1, cast.1, "{label}: compute copies");
            assert_eq!(written.2, cast.2, "{label}: optimizer state");
            let dir = tempfile::tempdir().unwrap();
            let resumed = train_copies(mode, which, true, Some(dir.path()));
            assert_eq!(resumed, cast, "{label}: saved and resumed after 3 steps");
            // The copies are the masters rounded: the check above compares something that moved.
            let initial = {
                let (varmap, _) = small_mlp(mode.compute_dtype());
                named_vars(&varmap)
                    .iter()
                    .map(|(_, v)| tensor_bits(v))
                    .collect::<Vec<_>>()
            };
            assert_ne!(written.1, initial, "{label}: the compute copies moved");
        }
    }
}
