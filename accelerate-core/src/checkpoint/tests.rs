//! Checkpoints through the `Accelerator` on one process: exact resume inside an accumulation
//! window, and every kind of damage refused before anything is loaded.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Module, VarBuilder, VarMap};

use crate::data::{DataLoader, TensorDataset};
use crate::optim::{AdamW, AdamWConfig, LrScheduler, Schedule};
use crate::{Accelerator, PreparedOptimizer, PreparedScheduler, ProcessState};

struct Run {
    acc: Accelerator,
    model: candle_nn::Linear,
    params: Vec<(String, Var)>,
    opt: PreparedOptimizer<AdamW>,
    sched: PreparedScheduler,
    loader: DataLoader<TensorDataset>,
}

/// A 4 → 3 linear model on 40 seeded samples, batches of 4 (10 per epoch), K = 3, AdamW with a
/// linear decay (so the learning rate differs at every step), shuffled.
fn run(out: usize) -> Run {
    let mut acc = Accelerator::builder()
        .process_state(ProcessState::single())
        .gradient_accumulation_steps(3)
        .build()
        .unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = candle_nn::linear(4, out, vb.pp("l1")).unwrap();
    // Same start for every run: overwrite candle's unseeded initialisation.
    for (name, var) in varmap.data().lock().unwrap().iter() {
        let n = var.elem_count();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 7 + name.len()) % 11) as f32 / 10.0 - 0.5)
            .collect();
        var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap())
            .unwrap();
    }
    let params = acc.prepare(&varmap).unwrap();
    let opt = acc
        .prepare(AdamW::new(params.clone(), AdamWConfig::default()).unwrap())
        .unwrap();
    let sched = acc
        .prepare(
            LrScheduler::new(
                opt.learning_rate_handle(),
                Schedule::LinearWarmupDecay {
                    warmup_steps: 1,
                    total_steps: 20,
                },
            )
            .unwrap(),
        )
        .unwrap();
    let x: Vec<f32> = (0..160)
        .map(|i| ((i * 37) % 17) as f32 / 8.0 - 1.0)
        .collect();
    let y: Vec<u32> = (0..40).map(|i| (i * 5 % 3) as u32).collect();
    let ds = TensorDataset::new(
        Tensor::from_vec(x, (40, 4), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, 40, &Device::Cpu).unwrap(),
    )
    .unwrap();
    let loader = acc
        .prepare(
            DataLoader::new(Arc::new(ds), 4)
                .shuffle(true)
                .seed(5)
                .prefetch(0),
        )
        .unwrap();
    Run {
        acc,
        model,
        params,
        opt,
        sched,
        loader,
    }
}

impl Run {
    /// Trains until `epochs` epochs are done, or stops after `stop_after` micro-steps (counted from
    /// this call). Returns whether it stopped early.
    fn train(&mut self, epochs: u64, stop_after: Option<usize>) -> bool {
        let mut micro = 0;
        for _ in self.loader.next_epoch()..epochs {
            for batch in self.loader.iter() {
                let (x, y) = batch.unwrap();
                let _step = self.acc.accumulate();
                let logits = self.model.forward(&x).unwrap();
                let loss = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
                self.acc.backward(&loss).unwrap();
                self.opt.step().unwrap();
                self.sched.step();
                self.opt.zero_grad();
                micro += 1;
                if stop_after == Some(micro) {
                    return true;
                }
            }
        }
        false
    }

    /// As [`Run::train`], iterating `windows(3)` with item-weighted accumulation (a sample is an
    /// item; the loss is the batch's summed cross-entropy), stopping after `stop_after` whole
    /// windows (counted from this call).
    fn train_windows(&mut self, epochs: u64, stop_after: Option<usize>) -> bool {
        let mut windows = 0;
        for _ in self.loader.next_epoch()..epochs {
            for window in self.loader.windows(3) {
                let window = window.unwrap();
                let items: usize = window.iter().map(|(x, _)| x.dims()[0]).sum();
                self.acc.set_window_items(items).unwrap();
                for (x, y) in window {
                    let _step = self.acc.accumulate();
                    let logits = self.model.forward(&x).unwrap();
                    let mean = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
                    self.acc
                        .backward(&(mean * x.dims()[0] as f64).unwrap())
                        .unwrap();
                    self.opt.step().unwrap();
                    self.sched.step();
                    self.opt.zero_grad();
                }
                windows += 1;
                if stop_after == Some(windows) {
                    return true;
                }
            }
        }
        false
    }

    fn values(&self) -> Vec<(String, Vec<u32>)> {
        self.params
            .iter()
            .map(|(n, v)| {
                let bits = v
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .into_iter()
                    .map(f32::to_bits)
                    .collect();
                (n.clone(), bits)
            })
            .collect()
    }

    fn optimizer_bits(&self) -> Vec<(String, Vec<u32>)> {
        let state = self.opt.state().unwrap();
        let mut v: Vec<(String, Vec<u32>)> = state
            .tensors
            .iter()
            .map(|(k, t)| {
                let bits = t
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .into_iter()
                    .map(f32::to_bits)
                    .collect();
                (k.clone(), bits)
            })
            .collect();
        v.extend(state.scalars.iter().map(|(k, s)| {
            (
                k.clone(),
                vec![s.to_bits() as u32, (s.to_bits() >> 32) as u32],
            )
        }));
        v
    }
}

#[test]
fn a_save_inside_an_accumulation_window_resumes_bitwise() {
    let root = tempfile::tempdir().unwrap();
    let mut whole = run(3);
    assert!(!whole.train(2, None));
    assert_eq!(
        whole.acc.optimizer_steps(),
        8,
        "4 windows (3+3+3+1) per epoch"
    );

    // 14 micro-steps: epoch 1 after 4 batches, one micro-step into its second window.
    let mut first = run(3);
    assert!(first.train(2, Some(14)));
    assert_eq!(first.acc.optimizer_steps(), 5);
    let saved = first.acc.save_checkpoint(root.path(), Some(2)).unwrap();
    assert_eq!(saved, root.path().join("checkpoint_5"));

    let mut resumed = run(3);
    assert_ne!(resumed.values(), first.values());
    assert_eq!(resumed.acc.load_state(root.path()).unwrap(), saved);
    assert_eq!(resumed.values(), first.values());
    assert_eq!(resumed.acc.optimizer_steps(), 5);
    assert_eq!(resumed.loader.next_epoch(), 1);
    assert!(!resumed.train(2, None));
    assert_eq!(resumed.acc.optimizer_steps(), 8);
    assert_eq!(
        resumed.values(),
        whole.values(),
        "final parameters, bit for bit"
    );
    assert_eq!(resumed.optimizer_bits(), whole.optimizer_bits());
    assert_eq!(resumed.sched.steps(), whole.sched.steps());
}

#[test]
fn a_save_after_a_window_of_windows_resumes_after_that_window_bitwise() {
    let mut whole = run(3);
    assert!(!whole.train_windows(2, None));
    assert_eq!(
        whole.acc.optimizer_steps(),
        8,
        "4 windows (3+3+3+1) per epoch"
    );
    // Inside epoch 0, at its end (the short last window), and inside epoch 1.
    for (windows, epoch) in [(2, 0), (3, 0), (4, 1), (6, 1)] {
        let root = tempfile::tempdir().unwrap();
        let mut first = run(3);
        assert!(first.train_windows(2, Some(windows)));
        assert_eq!(first.acc.optimizer_steps(), windows as u64);
        first.acc.save_state(root.path()).unwrap();

        let mut resumed = run(3);
        resumed.acc.load_state(root.path()).unwrap();
        assert_eq!(
            resumed.loader.next_epoch(),
            epoch,
            "after {windows} windows"
        );
        assert!(!resumed.train_windows(2, None));
        assert_eq!(resumed.acc.optimizer_steps(), 8, "after {windows} windows");
        assert_eq!(
            resumed.values(),
            whole.values(),
            "saved after {windows} windows: final parameters, bit for bit"
        );
    }
}

fn rewrite(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut b = std::fs::read(path).unwrap();
    f(&mut b);
    std::fs::write(path, b).unwrap();
}

/// Saves a checkpoint after 6 micro-steps, damages a copy of it with `damage`, and checks that
/// loading it into a run that has trained further fails with an error containing every piece of
/// `expected`, and changes nothing.
fn refused(damage: impl FnOnce(&Path), expected: &[&str]) {
    let root = tempfile::tempdir().unwrap();
    let mut a = run(3);
    a.train(1, Some(6));
    let dir = root.path().join("ckpt");
    a.acc.save_state(&dir).unwrap();
    damage(&dir);
    a.train(1, Some(3));
    let (params, opt, lr, steps) = (
        a.values(),
        a.optimizer_bits(),
        a.opt.learning_rate(),
        a.acc.optimizer_steps(),
    );
    let e = a.acc.load_state(&dir).unwrap_err().to_string();
    for piece in expected {
        assert!(e.contains(piece), "{piece:?} not in: {e}");
    }
    assert_eq!(a.values(), params, "parameters untouched");
    assert_eq!(a.optimizer_bits(), opt, "optimizer untouched");
    assert_eq!(a.opt.learning_rate(), lr);
    assert_eq!(a.acc.optimizer_steps(), steps);
}

#[test]
fn a_missing_file_is_named() {
    refused(
        |d| std::fs::remove_file(d.join("optimizer_0.safetensors")).unwrap(),
        &["optimizer_0.safetensors", "missing"],
    );
    refused(
        |d| std::fs::remove_file(d.join("manifest.json")).unwrap(),
        &["ckpt", "no manifest.json"],
    );
}

#[test]
fn a_flipped_byte_is_a_checksum_mismatch() {
    refused(
        |d| {
            rewrite(&d.join("model.safetensors"), |b| {
                *b.last_mut().unwrap() ^= 1
            })
        },
        &["model.safetensors", "checksum mismatch"],
    );
    refused(
        |d| rewrite(&d.join("rank_0.json"), |b| b[2] ^= 4),
        &["rank_0.json", "checksum mismatch"],
    );
}

#[test]
fn a_truncated_file_is_named() {
    refused(
        |d| rewrite(&d.join("scheduler_0.json"), |b| b.truncate(5)),
        &["scheduler_0.json", "truncated"],
    );
}

#[test]
fn a_corrupt_manifest_is_refused() {
    refused(
        |d| std::fs::write(d.join("manifest.json"), b"{ not json").unwrap(),
        &["manifest.json", "not valid"],
    );
}

#[test]
fn another_world_size_is_refused() {
    refused(
        |d| {
            rewrite(&d.join("manifest.json"), |b| {
                let s = String::from_utf8(b.clone()).unwrap();
                *b = s
                    .replace("\"world_size\": 1", "\"world_size\": 2")
                    .into_bytes();
            })
        },
        &["manifest.json", "saved by 2 processes", "--num-processes 2"],
    );
}

#[test]
fn a_file_with_a_valid_checksum_but_bad_content_is_refused() {
    // Rewritten consistently (checksum updated): the content itself is checked too.
    refused(
        |d| {
            std::fs::write(d.join("accumulation.json"), b"[1, 2]").unwrap();
            let m = d.join("manifest.json");
            let mut manifest: super::Manifest =
                serde_json::from_slice(&std::fs::read(&m).unwrap()).unwrap();
            manifest.files.insert(
                "accumulation.json".into(),
                super::manifest::file_entry(b"[1, 2]"),
            );
            std::fs::write(&m, serde_json::to_vec(&manifest).unwrap()).unwrap();
        },
        &["accumulation.json", "corrupt"],
    );
}

#[test]
fn a_different_model_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let mut a = run(3);
    a.train(1, Some(3));
    a.acc.save_state(root.path().join("c")).unwrap();
    let b = run(2);
    let before = b.values();
    let e = b
        .acc
        .load_state(root.path().join("c"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("different model") && e.contains("\"l1.weight\" was saved as [3, 4] f32"),
        "{e}"
    );
    assert_eq!(b.values(), before);
}

#[test]
fn a_directory_without_checkpoints_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let a = run(3);
    let e = a.acc.load_state(root.path()).unwrap_err().to_string();
    assert!(e.contains("neither a checkpoint"), "{e}");
    let e = a
        .acc
        .load_state(root.path().join("absent"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("absent") && e.contains("no such directory"),
        "{e}"
    );
}
