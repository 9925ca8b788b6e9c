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
            .map(|(n, v)| (n.clone(), f32_bits(v)))
            .collect()
    }

    fn optimizer_bits(&self) -> Vec<(String, Vec<u32>)> {
        let state = self.opt.state().unwrap();
        let mut v: Vec<(String, Vec<u32>)> = state
            .tensors
            .iter()
            .map(|(k, t)| (k.clone(), f32_bits(t)))
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

/// The bits of an f32 tensor's elements, for comparisons that must be exact.
fn f32_bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
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
            let mut manifest: super::manifest::Manifest =
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

#[test]
fn a_checkpoint_root_holding_another_runs_newer_checkpoints_is_refused_and_left_alone() {
    // Another run left checkpoint_90 and checkpoint_100; this run is at step 1. Saving
    // checkpoint_1 with a keep limit of 2 used to delete checkpoint_1 itself, leaving the other
    // run's two for a later resume.
    let root = tempfile::tempdir().unwrap();
    let mut other = run(3);
    other.train(1, Some(3));
    for n in [90u64, 100] {
        other
            .acc
            .save_state(super::checkpoint_dir(root.path(), n))
            .unwrap();
    }
    let mut a = run(3);
    a.train(1, Some(3));
    assert_eq!(a.acc.optimizer_steps(), 1);
    let e = a
        .acc
        .save_checkpoint(root.path(), Some(2))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&root.path().display().to_string())
            && e.contains("newer than the checkpoint_1")
            && e.contains("another directory"),
        "{e}"
    );
    let left: Vec<u64> = super::list_checkpoints(root.path())
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(left, [90, 100], "nothing written, nothing deleted");
    // In a root of its own the same save works, and the keep limit keeps it.
    let own = tempfile::tempdir().unwrap();
    assert_eq!(
        a.acc.save_checkpoint(own.path(), Some(1)).unwrap(),
        own.path().join("checkpoint_1")
    );
    assert!(own
        .path()
        .join("checkpoint_1")
        .join("manifest.json")
        .exists());
}

/// Two complete checkpoints of one run, after 6 and after 9 micro-steps (2 and 3 optimizer steps;
/// the first has learning rate 0), laid out as a save of
/// the second over the first leaves them when it stops between its renames: the first at
/// `.ckpt.replaced`, the second at `.ckpt.staging` (without its manifest unless `complete`), no
/// `ckpt`. Returns the target and the parameters of each.
fn crashed_replace(root: &Path, complete: bool) -> (std::path::PathBuf, Run, Run) {
    let mut first = run(3);
    first.train(1, Some(6));
    first.acc.save_state(root.join("first")).unwrap();
    let mut second = run(3);
    second.train(1, Some(9));
    second.acc.save_state(root.join("second")).unwrap();
    if !complete {
        std::fs::remove_file(root.join("second").join("manifest.json")).unwrap();
    }
    std::fs::rename(root.join("first"), root.join(".ckpt.replaced")).unwrap();
    std::fs::rename(root.join("second"), root.join(".ckpt.staging")).unwrap();
    (root.join("ckpt"), first, second)
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_replace_interrupted_between_its_renames_is_finished_on_load_and_save() {
    let root = tempfile::tempdir().unwrap();
    let (target, _first, second) = crashed_replace(root.path(), true);
    let resumed = run(3);
    assert_eq!(resumed.acc.load_state(&target).unwrap(), target);
    assert_eq!(resumed.values(), second.values(), "the new, complete state");
    assert_eq!(resumed.acc.optimizer_steps(), 3);
    assert_eq!(names_in(root.path()), ["ckpt"]);
    resumed.acc.save_state(&target).unwrap();
    assert_eq!(names_in(root.path()), ["ckpt"]);

    // The same through the root, as --resume loads (the latest checkpoint_<N> under it).
    let root = tempfile::tempdir().unwrap();
    let (_, _first, second) = crashed_replace(root.path(), true);
    std::fs::rename(
        root.path().join(".ckpt.replaced"),
        root.path().join(".checkpoint_2.replaced"),
    )
    .unwrap();
    std::fs::rename(
        root.path().join(".ckpt.staging"),
        root.path().join(".checkpoint_2.staging"),
    )
    .unwrap();
    let resumed = run(3);
    assert_eq!(
        resumed.acc.load_state(root.path()).unwrap(),
        root.path().join("checkpoint_2")
    );
    assert_eq!(resumed.values(), second.values());
}

#[test]
fn a_replace_interrupted_before_the_new_state_was_complete_is_rolled_back() {
    let root = tempfile::tempdir().unwrap();
    let (target, first, _) = crashed_replace(root.path(), false);
    let loaded = run(3);
    assert_eq!(loaded.acc.load_state(&target).unwrap(), target);
    assert_eq!(
        loaded.values(),
        first.values(),
        "the previous, complete state"
    );
    assert_eq!(loaded.acc.optimizer_steps(), 2);
    assert_eq!(names_in(root.path()), ["ckpt"]);

    // A save that finds it first puts the previous checkpoint back, then replaces it whole.
    let root = tempfile::tempdir().unwrap();
    let (target, first, _) = crashed_replace(root.path(), false);
    let saver = run(3);
    assert_ne!(saver.values(), first.values());
    saver.acc.save_state(&target).unwrap();
    assert_eq!(names_in(root.path()), ["ckpt"]);
    let loaded = run(3);
    loaded.acc.load_state(&target).unwrap();
    assert_eq!(
        loaded.values(),
        saver.values(),
        "the save after the recovery"
    );
}

/// Draws `n` numbers from the accelerator's generator.
fn draws(acc: &Accelerator, n: usize) -> Vec<u64> {
    (0..n).map(|_| acc.rng().next_u64()).collect()
}

#[test]
fn each_ranks_generator_is_saved_and_restored_exactly() {
    let root = tempfile::tempdir().unwrap();
    let mut a = run(3);
    a.train(1, Some(4));
    draws(&a.acc, 7);
    a.acc.save_state(root.path().join("c")).unwrap();
    let after_save = draws(&a.acc, 5);
    let b = run(3);
    b.acc.load_state(root.path().join("c")).unwrap();
    assert_eq!(draws(&b.acc, 5), after_save, "the draws after the save");
    let fresh = run(3);
    assert_ne!(
        draws(&fresh.acc, 5),
        after_save,
        "the comparison could fail"
    );
    let text = std::fs::read_to_string(root.path().join("c").join("rng_0.json")).unwrap();
    assert!(text.contains("\"word_pos\""), "{text}");
}

#[test]
fn a_checkpoint_saved_before_generators_were_saved_still_loads() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("c");
    let mut a = run(3);
    a.train(1, Some(4));
    draws(&a.acc, 3);
    a.acc.save_state(&dir).unwrap();
    // As an older version wrote it: no rng_0.json, and the manifest does not list one.
    std::fs::remove_file(dir.join("rng_0.json")).unwrap();
    let m = dir.join("manifest.json");
    let mut manifest: super::manifest::Manifest =
        serde_json::from_slice(&std::fs::read(&m).unwrap()).unwrap();
    manifest.files.remove("rng_0.json");
    std::fs::write(&m, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let b = run(3);
    let before = draws(&run(3).acc, 4);
    b.acc.load_state(&dir).unwrap();
    assert_eq!(b.values(), a.values());
    assert_eq!(
        draws(&b.acc, 4),
        before,
        "the generator continues where it was"
    );
}

/// Adds `name` to the manifest's file list with the size and CRC-32 of `bytes`.
fn list_in_manifest(dir: &Path, name: &str, bytes: &[u8]) {
    let m = dir.join("manifest.json");
    let mut manifest: super::manifest::Manifest =
        serde_json::from_slice(&std::fs::read(&m).unwrap()).unwrap();
    manifest
        .files
        .insert(name.into(), super::manifest::file_entry(bytes));
    std::fs::write(&m, serde_json::to_vec(&manifest).unwrap()).unwrap();
}

#[test]
fn a_manifest_naming_a_file_outside_the_checkpoint_is_refused() {
    // Sizes and checksums that match: only the names give them away.
    refused(
        |d| {
            std::fs::write(d.join("../outside"), b"secret").unwrap();
            list_in_manifest(d, "../outside", b"secret");
        },
        &["manifest.json", "\"../outside\"", "not a plain file name"],
    );
    refused(
        |d| list_in_manifest(d, "/dev/null", b""),
        &["manifest.json", "\"/dev/null\"", "not a plain file name"],
    );
    // Read, it would never end.
    refused(
        |d| list_in_manifest(d, "/dev/zero", &[0; 64]),
        &["manifest.json", "\"/dev/zero\"", "not a plain file name"],
    );
    refused(
        |d| list_in_manifest(d, "..", b""),
        &["manifest.json", "\"..\"", "not a plain file name"],
    );
    refused(
        |d| {
            std::fs::create_dir(d.join("sub")).unwrap();
            std::fs::write(d.join("sub/x"), b"x").unwrap();
            list_in_manifest(d, "sub/x", b"x");
        },
        &["manifest.json", "\"sub/x\"", "not a plain file name"],
    );
    // A listed file that is a link to one outside (same bytes) is not a file of the checkpoint.
    refused(
        |d| {
            let name = "scheduler_0.json";
            let outside = d.join("../copy");
            std::fs::copy(d.join(name), &outside).unwrap();
            std::fs::remove_file(d.join(name)).unwrap();
            std::os::unix::fs::symlink(&outside, d.join(name)).unwrap();
        },
        &["scheduler_0.json", "not a regular file"],
    );
}

#[test]
fn a_replaced_checkpoint_that_cannot_be_deleted_fails_nothing() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("ckpt");
    let mut a = run(3);
    a.train(5, Some(3));
    a.acc.save_state(&target).unwrap();
    a.train(5, Some(3));
    {
        // Deleting the previous copy fails after the new one is in place (NFS's .nfsXXXX).
        let _failing = super::removal::injected::fail_under(&root.path().join(".ckpt.replaced"));
        a.acc
            .save_state(&target)
            .expect("a save that committed failed because its old copy could not be deleted");
        let b = run(3);
        b.acc.load_state(&target).unwrap();
        assert_eq!(b.values(), a.values(), "the new checkpoint is in place");
        // The next save, still unable to delete it, moves it aside and saves.
        a.train(5, Some(3));
        a.acc.save_state(&target).unwrap();
        let b = run(3);
        b.acc.load_state(&target).unwrap();
        assert_eq!(b.values(), a.values());
    }
    // Once deletion works again, the next save leaves only the checkpoint.
    a.acc.save_state(&target).unwrap();
    let left = names_in(root.path());
    assert!(left.contains(&"ckpt".to_string()), "{left:?}");
    assert!(!left.contains(&".ckpt.replaced".to_string()), "{left:?}");
}

#[test]
fn old_checkpoints_that_cannot_be_deleted_fail_nothing() {
    let root = tempfile::tempdir().unwrap();
    let mut a = run(3);
    a.train(5, Some(3));
    let first = a.acc.save_checkpoint(root.path(), Some(1)).unwrap();
    a.train(5, Some(3));
    let _failing = super::removal::injected::fail_under(&first);
    let second = a
        .acc
        .save_checkpoint(root.path(), Some(1))
        .expect("a save that committed failed because an old checkpoint could not be deleted");
    assert_eq!(second, root.path().join("checkpoint_2"));
    assert!(first.is_dir(), "kept, with a warning");
    assert_eq!(
        super::latest_checkpoint(root.path()).unwrap(),
        Some(second),
        "the new checkpoint is the latest"
    );
}
