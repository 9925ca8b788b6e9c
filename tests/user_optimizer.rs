//! An optimizer written outside the library, against the public `Optimizer` trait only, goes
//! through `Accelerator::prepare` like the library's own: it steps on the micro-steps that sync,
//! with the window's averaged gradients, and on no other.

use accelerate_core::optim::{LearningRate, Optimizer, OptimizerState};
use accelerate_core::GradientBuffers;
use accelerate_core::{Accelerator, Error, ProcessState, Result};
use candle_core::{Device, Tensor, Var};

/// Plain SGD without momentum, from scratch: `p -= lr · g`.
struct PlainSgd {
    params: Vec<(String, Var)>,
    lr: LearningRate,
}

impl Optimizer for PlainSgd {
    fn step(&mut self, grads: &GradientBuffers) -> Result<()> {
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
