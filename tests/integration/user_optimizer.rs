//! An optimizer written outside the library, against the public `Optimizer` trait only, goes
//! through `Accelerator::prepare` like the library's own: it steps on the micro-steps that sync,
//! with the window's averaged gradients, and on no other.

use accelerate_core::optim::Gradients;
use accelerate_core::optim::{LearningRate, Optimizer, OptimizerState};
use accelerate_core::{Accelerator, Error, ProcessState, Result};
use candle_core::{Device, Tensor, Var};

/// Plain SGD without momentum, from scratch: `p -= lr · g`.
struct PlainSgd {
    params: Vec<(String, Var)>,
    lr: LearningRate,
}

impl Optimizer for PlainSgd {
    fn step(&mut self, grads: Gradients<'_>) -> Result<()> {
        let lr = self.lr.get();
        for (name, var) in &self.params {
            if let Some(g) = grads.get(name) {
                var.set(&(var.as_tensor() - (g * lr)?)?)?;
            }
        }
        Ok(())
    }

    fn learning_rate(&self) -> &LearningRate {
        &self.lr
    }

    fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    fn state(&self) -> Result<OptimizerState> {
        let mut state = OptimizerState::new("plain_sgd");
        state.scalars.insert("lr".into(), self.lr.get());
        Ok(state)
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        let lr = state.scalars.get("lr").copied();
        let lr = lr.ok_or_else(|| Error::Optimizer("plain_sgd state lacks \"lr\"".into()))?;
        self.lr.set(lr);
        Ok(())
    }
}

fn values(var: &Var) -> Vec<f32> {
    var.as_tensor().to_vec1().unwrap()
}

#[test]
fn a_user_optimizer_steps_only_on_sync_micro_steps_with_averaged_gradients() {
    let mut acc = Accelerator::builder()
        .process_state(ProcessState::single())
        .gradient_accumulation_steps(2)
        .build()
        .unwrap();
    let w = Var::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
    let params = acc.prepare(vec![("w".to_string(), w.clone())]).unwrap();
    let mut opt = acc
        .prepare(PlainSgd {
            params,
            lr: LearningRate::new(0.5),
        })
        .unwrap();

    // loss = sum(w · x), so each micro-step's gradient is x; with K = 2 the window's gradient is
    // the mean of its two x.
    let xs = [[1.0f32, 2.0], [3.0, -4.0], [0.5, 0.5], [-1.0, 1.0]];
    // By hand, lr 0.5: window 1 mean [2, -1]: w = [1 - 1, -2 + 0.5] = [0, -1.5];
    // window 2 mean [-0.25, 0.75]: w = [0 + 0.125, -1.5 - 0.375] = [0.125, -1.875].
    let expected_after = [[1.0f32, -2.0], [0.0, -1.5], [0.0, -1.5], [0.125, -1.875]];
    for (i, (x, expected)) in xs.iter().zip(expected_after).enumerate() {
        let _step = acc.accumulate();
        let x = Tensor::new(x, &Device::Cpu).unwrap();
        let loss = (w.as_tensor() * &x).unwrap().sum_all().unwrap();
        acc.backward(&loss).unwrap();
        assert_eq!(acc.sync_gradients(), i % 2 == 1, "micro-step {i}");
        opt.step().unwrap();
        opt.zero_grad();
        assert_eq!(values(&w), expected, "after micro-step {i}");
    }
    assert_eq!(opt.state().unwrap().scalars["lr"], 0.5);
}

#[test]
fn an_optimizer_listing_a_parameter_twice_is_refused_by_name() {
    // A user's optimizer with "w" in two parameter groups would update it twice per step.
    let mut acc = Accelerator::builder()
        .process_state(ProcessState::single())
        .build()
        .unwrap();
    let w = Var::new(&[1.0f32], &Device::Cpu).unwrap();
    let b = Var::new(&[0.0f32], &Device::Cpu).unwrap();
    let params = acc
        .prepare(vec![("w".to_string(), w.clone()), ("b".to_string(), b)])
        .unwrap();
    let mut twice = params.clone();
    twice.push(("w".to_string(), w));
    twice.sort_by(|a, b| a.0.cmp(&b.0));
    let err = acc
        .prepare(PlainSgd {
            params: twice,
            lr: LearningRate::new(0.5),
        })
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("\"w\" more than once"), "{err}");
}

/// Two ranks as threads of this process, joined as under torchrun (rank 0 hosts the store on
/// MASTER_PORT + 1); `f` runs on each rank's accelerator.
fn two_ranks<R: Send>(
    builder: impl Fn() -> accelerate_core::AcceleratorBuilder + Sync,
    f: impl Fn(Accelerator) -> R + Sync,
) -> Vec<R> {
    let port = loop {
        // A free port whose successor is free too.
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            break p;
        }
    };
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let (builder, f) = (&builder, &f);
                scope.spawn(move || {
                    let state = ProcessState {
                        rank,
                        world_size: 2,
                        local_rank: rank,
                        local_world_size: 2,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                        job_token: String::new(),
                        restart_count: 0,
                        launcher: accelerate_core::Launcher::Torchrun,
                    };
                    f(builder().process_state(state).build().unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Linear regression data: sample `i` is `(x_i, y_i)` with `x_i` in R³.
fn sample(i: usize) -> ([f32; 3], f32) {
    let f = i as f32;
    (
        [(f * 0.7).sin(), (f * 1.3).cos(), 0.1 * f - 0.5],
        (f * 0.37).sin() * 2.0,
    )
}

/// Mean squared error of `x·w + b` against `y` over samples `range`.
fn mse(w: &Var, b: &Var, range: std::ops::Range<usize>) -> Tensor {
    let n = range.len();
    let (xs, ys): (Vec<[f32; 3]>, Vec<f32>) = range.map(sample).unzip();
    let x = Tensor::new(xs.concat(), &Device::Cpu)
        .unwrap()
        .reshape((n, 3))
        .unwrap();
    let y = Tensor::new(ys, &Device::Cpu).unwrap();
    let pred = x
        .matmul(&w.as_tensor().unsqueeze(1).unwrap())
        .unwrap()
        .squeeze(1)
        .unwrap()
        .broadcast_add(b.as_tensor())
        .unwrap();
    ((pred - y).unwrap().sqr().unwrap().sum_all().unwrap() / n as f64).unwrap()
}

/// Fresh model parameters, the same on every rank.
fn linear_model() -> (Var, Var) {
    let w = Var::new(&[0.3f32, -0.2, 0.1], &Device::Cpu).unwrap();
    let b = Var::new(&[0.05f32], &Device::Cpu).unwrap();
    (w, b)
}

#[test]
fn candle_nn_sgd_on_two_ranks_with_accumulation_equals_one_process_with_the_big_batch() {
    use accelerate_core::optim::CandleOptimizer;
    const WINDOWS: usize = 3;
    const MICRO: usize = 2; // samples per micro-batch
    const K: usize = 2;
    let global = 2 * K * MICRO;

    // 2 ranks × K = 2: rank r's micro-step j of window s takes samples
    // (s·4 + r·2 + j)·2 .. +2, so each window covers the same 8 samples as one big batch.
    let ranks = two_ranks(
        || Accelerator::builder().gradient_accumulation_steps(K),
        |mut acc| {
            let rank = acc.process_index();
            let (w, b) = linear_model();
            let params = acc
                .prepare(vec![
                    ("w".to_string(), w.clone()),
                    ("b".to_string(), b.clone()),
                ])
                .unwrap();
            let mut opt = acc
                .prepare(CandleOptimizer::<candle_nn::SGD>::new(params, 0.2).unwrap())
                .unwrap();
            for s in 0..WINDOWS {
                for j in 0..K {
                    let before = values(&w);
                    let _step = acc.accumulate();
                    let start = (s * 2 * K + rank * K + j) * MICRO;
                    acc.backward(&mse(&w, &b, start..start + MICRO)).unwrap();
                    opt.step().unwrap();
                    opt.zero_grad();
                    if j + 1 < K {
                        assert_eq!(values(&w), before, "no update on a non-sync micro-step");
                    }
                }
            }
            (values(&w), values(&b))
        },
    );
    assert_eq!(ranks[0], ranks[1], "both ranks hold the same weights");

    // One process, K = 1, the whole window's 8 samples as one batch.
    let mut acc = Accelerator::builder()
        .process_state(ProcessState::single())
        .build()
        .unwrap();
    let (w, b) = linear_model();
    let params = acc
        .prepare(vec![
            ("w".to_string(), w.clone()),
            ("b".to_string(), b.clone()),
        ])
        .unwrap();
    let mut opt = acc
        .prepare(CandleOptimizer::<candle_nn::SGD>::new(params, 0.2).unwrap())
        .unwrap();
    for s in 0..WINDOWS {
        let _step = acc.accumulate();
        acc.backward(&mse(&w, &b, s * global..(s + 1) * global))
            .unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    let single = (values(&w), values(&b));
    for (got, want) in [(&ranks[0].0, &single.0), (&ranks[0].1, &single.1)] {
        for (g, e) in got.iter().zip(want) {
            assert!(
                (g - e).abs() < 1e-6,
                "2 ranks {got:?} vs one process {want:?}"
            );
        }
    }
    let (w0, _) = linear_model();
    assert!(
        single
            .0
            .iter()
            .zip(values(&w0))
            .any(|(a, b)| (a - b).abs() > 1e-2),
        "the weights moved: the comparison could have failed"
    );

    // Its state cannot be checkpointed: refused by name, nothing written.
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let err = acc.save_state(&ckpt).unwrap_err().to_string();
    assert!(
        err.contains("CandleOptimizer<candle_nn::optim::SGD>"),
        "{err}"
    );
    assert!(!ckpt.exists(), "nothing written");
}
