//! Loops that leave a loader before its end (`take`, `break`): the accumulation windows, what
//! `gather_for_metrics` keeps and where a checkpoint resumes must be those of the loop that was
//! actually run. Each expectation is counted by hand from the loop's shape.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use accelerate_core::data::{DataLoader, TensorDataset};
use accelerate_core::optim::{Gradients, Optimizer, OptimizerState, Sgd, SgdConfig};
use accelerate_core::{Accelerator, ProcessState, Result};
use accelerate_tests::ranks_as_threads;
use candle_core::{DType, Device, Tensor, Var};

fn single(k: usize) -> Accelerator {
    Accelerator::builder()
        .process_state(ProcessState::single())
        .gradient_accumulation_steps(k)
        .build()
        .unwrap()
}

/// `n` samples whose features are their own indices.
fn indices(n: usize) -> Arc<TensorDataset> {
    let x = Tensor::arange(0f32, n as f32, &Device::Cpu).unwrap();
    let y = Tensor::zeros(n, DType::U32, &Device::Cpu).unwrap();
    Arc::new(TensorDataset::new(x, y).unwrap())
}

/// A gather after every loop has ended keeps every row, also when the training loop took exactly
/// its batches with `take` (its iterator never returned its end) before an evaluation loop.
#[test]
fn a_gather_after_the_loops_keeps_every_row_when_a_loader_was_left_at_its_last_batch() {
    let mut acc = single(1);
    let mut train = acc.prepare(DataLoader::new(indices(10), 4)).unwrap();
    let mut eval = acc.prepare(DataLoader::new(indices(6), 3)).unwrap();
    let steps = train.len();
    for batch in train.iter().take(steps) {
        batch.unwrap();
        let _step = acc.accumulate();
    }
    let mut seen = 0;
    for batch in eval.iter() {
        seen += acc
            .gather_for_metrics(&batch.unwrap().0)
            .unwrap()
            .dim(0)
            .unwrap();
    }
    assert_eq!(seen, 6);
    let totals = Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
    assert_eq!(acc.gather_for_metrics(&totals).unwrap().dim(0).unwrap(), 3);
}

/// A `windows()` loop left with `break` inside its last, shorter window (whose batches had all
/// been fetched) no longer counts as inside the loader: a gather after it keeps every row.
#[test]
fn a_gather_after_a_windows_loop_left_inside_its_last_window_keeps_every_row() {
    let mut acc = single(2);
    let mut train = acc.prepare(DataLoader::new(indices(5), 1)).unwrap();
    'epoch: for window in train.windows(2) {
        let window = window.unwrap();
        for (i, _) in window.iter().enumerate() {
            let _step = acc.accumulate();
            if window.len() == 1 && i == 0 {
                break 'epoch;
            }
        }
    }
    let totals = Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
    assert_eq!(acc.gather_for_metrics(&totals).unwrap().dim(0).unwrap(), 3);
}

/// K = 2 over 8 training batches: 4 windows, 4 optimizer steps, syncing on every second
/// micro-step, whether the loop iterates batches or windows, although after the first micro-step
/// of every window an evaluation loop reads one batch and breaks.
#[test]
fn an_evaluation_loop_left_with_break_inside_a_window_does_not_change_the_windows() {
    for use_windows in [false, true] {
        let mut acc = single(2);
        let w = Var::new(&[1.0f32], &Device::Cpu).unwrap();
        let params = acc.prepare(vec![("w".to_string(), w.clone())]).unwrap();
        let mut opt = acc
            .prepare(Sgd::new(params, SgdConfig::default()).unwrap())
            .unwrap();
        let mut train = acc.prepare(DataLoader::new(indices(8), 1)).unwrap();
        let mut eval = acc.prepare(DataLoader::new(indices(4), 1)).unwrap();
        let mut syncs = Vec::new();
        let mut body = |x: Tensor, acc: &Accelerator, eval: &mut DataLoader<TensorDataset>| {
            let step = acc.accumulate();
            acc.backward(&(x * w.as_tensor()).unwrap().sum_all().unwrap())
                .unwrap();
            opt.step().unwrap();
            opt.zero_grad();
            syncs.push(step.sync);
            if !step.sync {
                if let Some(b) = eval.iter().next() {
                    b.unwrap();
                }
            }
        };
        if use_windows {
            for window in train.windows(2) {
                for (x, _) in window.unwrap() {
                    body(x, &acc, &mut eval);
                }
            }
        } else {
            for b in train.iter() {
                body(b.unwrap().0, &acc, &mut eval);
            }
        }
        let what = if use_windows { "windows()" } else { "iter()" };
        assert_eq!(syncs, [false, true].repeat(4), "{what}");
        assert_eq!(acc.optimizer_steps(), 4, "{what}");
        // SGD, lr 0.01 by default: each window's mean gradient is the mean of its two indices.
        let expected = 1.0 - 0.01 * (0.5 + 2.5 + 4.5 + 6.5);
        let got = w.as_tensor().to_vec1::<f32>().unwrap()[0];
        assert!(
            (got - expected as f32).abs() < 1e-6,
            "{what}: w = {got}, expected {expected}"
        );
    }
}

/// A loop that stopped after 2 of an epoch's 6 batches (a step limit), checkpointed after it:
/// the resumed loader continues that epoch with its third batch, in the order the whole epoch
/// has (read here from `iter_epoch`, which no checkpoint touches). The loader that went on
/// without a checkpoint starts the next epoch at its next `iter()`, as PyTorch's does.
#[test]
fn a_checkpoint_after_a_loop_stopped_early_resumes_inside_that_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let build = || {
        let mut acc = single(1);
        let w = Var::new(&[1.0f32], &Device::Cpu).unwrap();
        acc.prepare(vec![("w".to_string(), w)]).unwrap();
        let loader = DataLoader::new(indices(6), 1).shuffle(true).seed(9);
        let loader = acc.prepare(loader).unwrap();
        (acc, loader)
    };
    let batches = |it: &mut dyn Iterator<Item = Result<(Tensor, Tensor)>>, n: usize| -> Vec<f32> {
        it.take(n)
            .flat_map(|b| b.unwrap().0.to_vec1::<f32>().unwrap())
            .collect()
    };
    let (acc, mut loader) = build();
    let epoch0 = batches(&mut loader.iter_epoch(0, 0), 6);
    let epoch1 = batches(&mut loader.iter_epoch(1, 0), 6);
    assert_eq!(batches(&mut loader.iter(), 2), epoch0[..2]);
    acc.save_state(dir.path()).unwrap();
    assert_eq!(batches(&mut loader.iter(), 2), epoch1[..2]);
    drop((acc, loader));
    let (acc, mut loader) = build();
    acc.load_state(dir.path()).unwrap();
    assert_eq!(batches(&mut loader.iter(), 4), epoch0[2..]);
    assert_eq!(batches(&mut loader.iter(), 2), epoch1[..2]);
}

/// An optimizer that counts the calls of `state()`, which copies every moment to the host.
struct Counting(Sgd, Arc<AtomicUsize>);

impl Optimizer for Counting {
    fn step(&mut self, grads: Gradients<'_>) -> Result<()> {
        self.0.step(grads)
    }
    fn learning_rate(&self) -> &accelerate_core::optim::LearningRate {
        self.0.learning_rate()
    }
    fn params(&self) -> &[(String, Var)] {
        self.0.params()
    }
    fn state(&self) -> Result<OptimizerState> {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.state()
    }
    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        self.0.load_state(state)
    }
}

/// Only the main process writes the optimizers' state, so only it copies them out: on N GPUs a
/// copy per rank would be N times the host memory of the moments.
#[test]
fn save_state_copies_the_optimizer_state_on_the_main_process_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let calls = ranks_as_threads(2, Accelerator::builder, |mut acc| {
        let w = Var::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
        let params = acc.prepare(vec![("w".to_string(), w)]).unwrap();
        let counter = Arc::new(AtomicUsize::new(0));
        let cfg = SgdConfig {
            momentum: 0.9,
            ..SgdConfig::default()
        };
        let _opt = acc
            .prepare(Counting(Sgd::new(params, cfg).unwrap(), counter.clone()))
            .unwrap();
        acc.save_state(&path).unwrap();
        counter.load(Ordering::SeqCst)
    });
    assert_eq!(calls, [1, 0]);
}

/// Passes its input through, with no backward pass: a loss made with it fails in `backward`.
struct NoBackward;

impl candle_core::CustomOp1 for NoBackward {
    fn name(&self) -> &'static str {
        "no-backward"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        Ok((storage.clone(), layout.shape().clone()))
    }
}

/// A loop without `accumulate()` (K = 2) leaves its first epoch after one micro-step, so that
/// window is abandoned; in the next epoch the first backward fails, and the loop retries the
/// micro-step with a good loss. The abandoned window's sum must still be discarded: the gradient
/// at the next sync is the mean of the new window's two micro-steps, (x₀ + x₁) / 2 for
/// `loss = w · (x + 100)`, i.e. 100.5, not (100 + 100 + 101) / 2.
#[test]
fn a_failed_backward_after_an_abandoned_window_still_discards_it() {
    let mut acc = single(2);
    let w = Var::new(&[1.0f32], &Device::Cpu).unwrap();
    acc.prepare(vec![("w".to_string(), w.clone())]).unwrap();
    let mut train = acc.prepare(DataLoader::new(indices(4), 1)).unwrap();
    let loss_of = |x: &Tensor| {
        (w.as_tensor() * (x + 100.0).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
    };
    if let Some(batch) = train.iter().next() {
        acc.backward(&loss_of(&batch.unwrap().0)).unwrap();
    }
    let mut gradient = None;
    for (i, batch) in train.iter().enumerate() {
        let loss = loss_of(&batch.unwrap().0);
        if i == 0 {
            let failing = loss.apply_op1(NoBackward).unwrap();
            assert!(acc.backward(&failing).is_err());
        }
        acc.backward(&loss).unwrap();
        if i == 1 {
            assert!(acc.sync_gradients());
            gradient = acc.model().gradient("w").unwrap();
            break;
        }
    }
    let gradient = gradient.unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(gradient, [100.5]);
}
