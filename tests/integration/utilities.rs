//! The smaller pieces Accelerate users reach for, against hand-computed values and Accelerate's
//! own outputs: the `no_sync` guard and `sync_each_batch`, `clip_grad_value`, object and tensor
//! collectives on 1, 2 and 3 ranks, `split_between_processes`, `on_main_process` and
//! `local_main_process_first`, `set_seed`, and `register_for_checkpointing`.

use std::sync::{Arc, Mutex};

use accelerate_core::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use accelerate_core::{Accelerator, Error, Model, ProcessState};
use accelerate_tests::{named_vars, ranks_as_threads, snapshot, tiny_data, tiny_mlp};
use candle_core::{DType, Device, Tensor, Var};
use rand::RngCore;
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

fn single() -> accelerate_core::AcceleratorBuilder {
    Accelerator::builder().process_state(ProcessState::single())
}

fn values(var: &Var) -> Vec<f32> {
    var.as_tensor().to_vec1().unwrap()
}

/// `sum(w · x)`: its gradient with respect to `w` is `x`, so every gradient below is written out.
fn linear_loss(w: &Var, x: &[f32]) -> Tensor {
    let x = Tensor::new(x, &Device::Cpu).unwrap();
    (w.as_tensor() * x).unwrap().sum_all().unwrap()
}

/// Rank r's input at micro-step j.
fn input(rank: usize, j: usize) -> [f32; 2] {
    [(1 + rank + 2 * j) as f32, -(((rank + 1) * (j + 1)) as f32)]
}

// ---- no_sync and sync_each_batch ----

/// Accelerate's manual accumulation with K = 1: the first micro-step's backward inside
/// `no_sync`, the second outside, each loss halved by the loop. On 2 ranks, `w` must move by
/// `lr` times the mean of the four inputs (written out below), in one all-reduce; inside the guard
/// the gradient is the rank's own and the optimizer does not step.
#[test]
fn no_sync_accumulates_locally_and_the_next_sync_averages_everything() {
    let lr = 0.1;
    let results = ranks_as_threads(2, Accelerator::builder, |mut acc| {
        let rank = acc.process_index();
        let w = Var::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
        let params = acc.prepare(vec![("w".to_string(), w.clone())]).unwrap();
        let cfg = SgdConfig {
            lr,
            ..SgdConfig::default()
        };
        let mut opt = acc.prepare(Sgd::new(params, cfg).unwrap()).unwrap();
        {
            let _guard = acc.no_sync();
            let _step = acc.accumulate();
            acc.backward(&(linear_loss(&w, &input(rank, 0)) * 0.5).unwrap())
                .unwrap();
            assert!(!acc.sync_gradients(), "no micro-step syncs inside no_sync");
            let local = acc
                .model()
                .gradient("w")
                .unwrap()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let own = input(rank, 0).map(|v| v * 0.5);
            assert_eq!(
                local, own,
                "rank {rank}: inside no_sync the gradient is its own"
            );
            opt.step().unwrap();
            opt.zero_grad();
            assert_eq!(values(&w), vec![1.0, -2.0], "no step inside no_sync");
            assert_eq!(acc.gradient_sync_stats().all_reduces, 0);
        }
        let _step = acc.accumulate();
        acc.backward(&(linear_loss(&w, &input(rank, 1)) * 0.5).unwrap())
            .unwrap();
        assert!(acc.sync_gradients());
        opt.step().unwrap();
        opt.zero_grad();
        (
            values(&w),
            acc.gradient_sync_stats().all_reduces,
            acc.model().gradient_buckets(),
        )
    });
    // Inputs: rank 0: [1, -1], [3, -2]; rank 1: [2, -2], [4, -4]. Mean: [2.5, -2.25].
    let expected = [1.0 - lr * 2.5, -2.0 + lr * 2.25];
    for (rank, (w, all_reduces, buckets)) in results.into_iter().enumerate() {
        for (got, want) in w.iter().zip(expected) {
            assert!(
                (*got as f64 - want).abs() < 1e-6,
                "rank {rank}: {w:?} vs {expected:?}"
            );
        }
        assert_eq!(
            all_reduces, buckets as u64,
            "one sync for the two micro-steps"
        );
    }
}

/// The guard scoped around the backward pass only, the step after it (what Rust's scoping
/// invites): the window ended under the guard, so its gradients are each rank's own. The step
/// must not apply them (each rank would step with its own, and the replicas would drift apart);
/// the next backward outside the guard averages everything, and then the step applies
/// `lr` times the mean of the four inputs, on every rank alike.
#[test]
fn a_step_after_the_guard_is_dropped_waits_for_the_averaging_backward() {
    let lr = 0.1;
    let results = ranks_as_threads(2, Accelerator::builder, |mut acc| {
        let rank = acc.process_index();
        let w = Var::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
        let params = acc.prepare(vec![("w".to_string(), w.clone())]).unwrap();
        let cfg = SgdConfig {
            lr,
            ..SgdConfig::default()
        };
        let mut opt = acc.prepare(Sgd::new(params, cfg).unwrap()).unwrap();
        {
            let _guard = acc.no_sync();
            acc.backward(&(linear_loss(&w, &input(rank, 0)) * 0.5).unwrap())
                .unwrap();
        }
        assert!(
            !acc.sync_gradients(),
            "rank {rank}: the window's gradients are unaveraged"
        );
        assert_eq!(acc.clip_grad_norm(1e-3).unwrap(), None);
        opt.step().unwrap();
        opt.zero_grad();
        assert_eq!(values(&w), vec![1.0, -2.0], "rank {rank} stepped alone");
        acc.backward(&(linear_loss(&w, &input(rank, 1)) * 0.5).unwrap())
            .unwrap();
        assert!(acc.sync_gradients());
        opt.step().unwrap();
        opt.zero_grad();
        values(&w)
    });
    // As in the test above: the mean of the four inputs is [2.5, -2.25].
    let expected = [1.0 - lr * 2.5, -2.0 + lr * 2.25];
    for (rank, w) in results.into_iter().enumerate() {
        for (got, want) in w.iter().zip(expected) {
            assert!(
                (*got as f64 - want).abs() < 1e-6,
                "rank {rank}: {w:?} vs {expected:?}"
            );
        }
    }
}

/// A saved checkpoint between the `no_sync` micro-step and the one that syncs keeps the rank's
/// unsynced gradient, so the resumed run ends where the uninterrupted one does.
#[test]
fn a_checkpoint_inside_a_no_sync_accumulation_keeps_the_local_gradient() {
    let dir = tempfile::tempdir().unwrap();
    let run = |resume: bool| {
        let mut acc = single().build().unwrap();
        let w = Var::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
        let params = acc.prepare(vec![("w".to_string(), w.clone())]).unwrap();
        let mut opt = acc
            .prepare(
                Sgd::new(
                    params,
                    SgdConfig {
                        lr: 0.5,
                        ..SgdConfig::default()
                    },
                )
                .unwrap(),
            )
            .unwrap();
        if resume {
            acc.load_state(dir.path()).unwrap();
        } else {
            let _guard = acc.no_sync();
            let _step = acc.accumulate();
            acc.backward(&linear_loss(&w, &[2.0, 4.0])).unwrap();
            opt.step().unwrap();
            opt.zero_grad();
            drop(_guard);
            acc.save_state(dir.path()).unwrap();
        }
        let _step = acc.accumulate();
        acc.backward(&linear_loss(&w, &[6.0, -8.0])).unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        values(&w)
    };
    // w - 0.5 · ([2, 4] + [6, -8]) = [1 - 4, -2 + 2].
    assert_eq!(run(false), vec![-3.0, 0.0]);
    assert_eq!(
        run(true),
        vec![-3.0, 0.0],
        "the resumed run lost the unsynced gradient"
    );
}

/// `sync_each_batch`: the same parameters as syncing once per window (AdamW, K = 3, 2 ranks,
/// 6 micro-steps), with an all-reduce of every bucket on every micro-step instead of every third.
#[test]
fn sync_each_batch_gives_the_same_parameters_with_an_all_reduce_per_micro_step() {
    const K: usize = 3;
    const B: usize = 4;
    let micro_steps = 6;
    let (x, y) = tiny_data(2 * B * micro_steps, 5).unwrap();
    let run = |each: bool| {
        ranks_as_threads(
            2,
            || {
                Accelerator::builder()
                    .gradient_accumulation_steps(K)
                    .sync_each_batch(each)
            },
            |mut acc| {
                let (varmap, model) = tiny_mlp(7).unwrap();
                let params = acc.prepare(&varmap).unwrap();
                let mut opt = acc
                    .prepare(AdamW::new(params, AdamWConfig::default()).unwrap())
                    .unwrap();
                for j in 0..micro_steps {
                    let start = (2 * j + acc.process_index()) * B;
                    let _step = acc.accumulate();
                    let logits = model.forward(&x.narrow(0, start, B).unwrap()).unwrap();
                    let loss =
                        candle_nn::loss::cross_entropy(&logits, &y.narrow(0, start, B).unwrap())
                            .unwrap();
                    acc.backward(&loss).unwrap();
                    opt.step().unwrap();
                    opt.zero_grad();
                }
                let names = named_vars(&varmap);
                (
                    snapshot(&names),
                    acc.gradient_sync_stats().all_reduces,
                    acc.model().gradient_buckets() as u64,
                    acc.optimizer_steps(),
                )
            },
        )
    };
    let once = run(false);
    let each = run(true);
    for (rank, (a, b)) in once.iter().zip(&each).enumerate() {
        let diff =
            a.0.iter()
                .flatten()
                .zip(b.0.iter().flatten())
                .map(|(p, q)| (p - q).abs())
                .fold(0f32, f32::max);
        assert!(diff < 1e-5, "rank {rank}: parameters differ by {diff}");
        assert_eq!(a.3, 2, "two optimizer steps either way");
        assert_eq!(b.3, 2);
        assert_eq!(a.1, 2 * a.2, "rank {rank}: one sync per window by default");
        assert_eq!(
            b.1,
            6 * b.2,
            "rank {rank}: one sync per micro-step with sync_each_batch"
        );
    }
}

// ---- clip_grad_value ----

/// K = 2 on one process: the window's averaged gradient `(g1 + g2) / 2` is clamped elementwise to
/// `[-1, 1]` (PyTorch's `clip_grad_value_`) on the sync micro-step only, then SGD with lr 1.
#[test]
fn clip_grad_value_clamps_the_window_average_on_sync_micro_steps() {
    let mut acc = single().gradient_accumulation_steps(2).build().unwrap();
    let w = Var::new(&[0.0f32, 0.0, 0.0, 0.0], &Device::Cpu).unwrap();
    let params = acc.prepare(vec![("w".to_string(), w.clone())]).unwrap();
    let mut opt = acc
        .prepare(
            Sgd::new(
                params,
                SgdConfig {
                    lr: 1.0,
                    ..SgdConfig::default()
                },
            )
            .unwrap(),
        )
        .unwrap();
    let inputs: [[f32; 4]; 2] = [[3.0, -5.0, 0.5, 1.0], [1.0, 1.0, 0.25, -4.0]];
    for (j, x) in inputs.iter().enumerate() {
        let _step = acc.accumulate();
        acc.backward(&linear_loss(&w, x)).unwrap();
        let clipped = acc.clip_grad_value(1.0).unwrap();
        assert_eq!(clipped, j == 1, "acts on the sync micro-step only");
        if j == 0 {
            // Not clipped: the first half of the window, 3 / 2 = 1.5 > 1.
            let g = acc
                .model()
                .gradient("w")
                .unwrap()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert_eq!(g, vec![1.5, -2.5, 0.25, 0.5]);
        }
        opt.step().unwrap();
        opt.zero_grad();
    }
    // Window average [2, -2, 0.375, -1.5], clamped to [1, -1, 0.375, -1].
    assert_eq!(values(&w), vec![-1.0, 1.0, -0.375, 1.0]);
    let err = acc.clip_grad_value(-1.0).unwrap_err();
    assert!(err.to_string().contains("finite number >= 0"), "{err}");
}

/// Per model: a second model's `clip_grad_value` clamps its own gradients only.
#[test]
fn clip_grad_value_per_model() {
    let mut acc = single().build().unwrap();
    let a = Var::new(&[0.0f32, 0.0], &Device::Cpu).unwrap();
    let b = Var::new(&[0.0f32, 0.0], &Device::Cpu).unwrap();
    acc.prepare(vec![("a".to_string(), a.clone())]).unwrap();
    let second = acc
        .prepare(Model::new(vec![("b".to_string(), b.clone())]))
        .unwrap();
    let _s1 = acc.accumulate();
    acc.backward(&linear_loss(&a, &[4.0, -0.5])).unwrap();
    let _s2 = second.accumulate();
    second.backward(&linear_loss(&b, &[4.0, -0.5])).unwrap();
    assert!(second.clip_grad_value(2.0).unwrap());
    let gb = second
        .gradient("b")
        .unwrap()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let ga = acc
        .model()
        .gradient("a")
        .unwrap()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(gb, vec![2.0, -0.5]);
    assert_eq!(
        ga,
        vec![4.0, -0.5],
        "the first model's gradients are untouched"
    );
}

// ---- collectives ----

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Report {
    rank: usize,
    name: String,
    losses: Vec<f64>,
}

fn report(rank: usize) -> Report {
    Report {
        rank,
        name: "r".repeat(rank * 7),
        losses: (0..rank).map(|i| i as f64 * 0.5).collect(),
    }
}

/// On 1, 2 and 3 ranks: `broadcast` gives every rank the last rank's tensor (f32 and u32, in
/// their own dtype), `gather_object` every rank's value of a different size in rank order, and
/// `broadcast_object` the last rank's value.
#[test]
fn broadcast_and_object_collectives_on_one_two_and_three_ranks() {
    for n in 1..=3 {
        let results = ranks_as_threads(n, Accelerator::builder, |acc| {
            let rank = acc.process_index();
            let from = n - 1;
            let t = Tensor::new(&[rank as f32, 10.0 * rank as f32, -1.0], &Device::Cpu).unwrap();
            let b = acc.broadcast(&t, from).unwrap().to_vec1::<f32>().unwrap();
            let ints = Tensor::new(&[[rank as u32; 2]; 2], &Device::Cpu).unwrap();
            let bi = acc.broadcast(&ints, from).unwrap();
            assert_eq!(bi.dtype(), DType::U32);
            let bi = bi.to_vec2::<u32>().unwrap();
            let gathered = acc.gather_object(&report(rank)).unwrap();
            let object = acc.broadcast_object(report(rank), from).unwrap();
            let err = acc.broadcast(&t, n).unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{err}");
            (b, bi, gathered, object)
        });
        let last = (n - 1) as f32;
        for (rank, (b, bi, gathered, object)) in results.into_iter().enumerate() {
            assert_eq!(b, vec![last, 10.0 * last, -1.0], "n={n} rank {rank}");
            assert_eq!(bi, vec![vec![n as u32 - 1; 2]; 2], "n={n} rank {rank}");
            assert_eq!(
                gathered,
                (0..n).map(report).collect::<Vec<_>>(),
                "n={n} rank {rank}"
            );
            assert_eq!(object, report(n - 1), "n={n} rank {rank}");
        }
    }
}

/// A rank passing another type to `gather_object` gets an error naming the rank whose value
/// does not parse.
#[test]
fn gather_object_of_another_type_names_the_rank() {
    let results = ranks_as_threads(2, Accelerator::builder, |acc| {
        if acc.process_index() == 0 {
            acc.gather_object(&1u64)
                .map(|_| ())
                .map_err(|e| e.to_string())
        } else {
            acc.gather_object(&"one".to_string())
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    });
    let err = results[0].clone().unwrap_err();
    assert!(err.contains("rank 1"), "{err}");
}

/// Accelerate 1.15's `split_between_processes` on these inputs (run once, its output written
/// here): 10 items on 3 ranks, 2 on 3, 4 on 2 and 3 on 4, without and with `apply_padding`.
#[test]
fn split_between_processes_cuts_and_pads_as_accelerate() {
    #[allow(clippy::type_complexity)]
    let cases: [(usize, usize, &[&[usize]], &[&[usize]]); 4] = [
        (
            3,
            10,
            &[&[0, 1, 2, 3], &[4, 5, 6], &[7, 8, 9]],
            &[&[0, 1, 2, 3], &[4, 5, 6, 9], &[7, 8, 9, 9]],
        ),
        (3, 2, &[&[0], &[1], &[]], &[&[0], &[1], &[1]]),
        (2, 4, &[&[0, 1], &[2, 3]], &[&[0, 1], &[2, 3]]),
        (4, 3, &[&[0], &[1], &[2], &[]], &[&[0], &[1], &[2], &[2]]),
    ];
    for (n, len, plain, padded) in cases {
        let items: Vec<usize> = (0..len).collect();
        let got = ranks_as_threads(n, Accelerator::builder, |acc| {
            (
                acc.split_between_processes(&items).to_vec(),
                acc.split_between_processes_padded(&items),
            )
        });
        for (rank, (p, q)) in got.into_iter().enumerate() {
            assert_eq!(p, plain[rank], "n={n} len={len} rank {rank}");
            assert_eq!(q, padded[rank], "n={n} len={len} rank {rank} padded");
        }
    }
}

/// `on_main_process` runs on rank 0 only; `local_main_process_first` runs the local main process
/// (rank 0 here: the threads share one machine) before every other.
#[test]
fn on_main_process_and_local_main_process_first() {
    let order = Mutex::new(Vec::new());
    let results = ranks_as_threads(3, Accelerator::builder, |acc| {
        let rank = acc.process_index();
        let ran = acc.on_main_process(|| rank * 10);
        let first = acc
            .local_main_process_first(|| order.lock().unwrap().push(rank))
            .map(|()| rank);
        (ran, first.unwrap())
    });
    assert_eq!(
        results,
        vec![(Some(0), 0), (None, 1), (None, 2)],
        "on_main_process returns on the main process only"
    );
    assert_eq!(
        order.lock().unwrap()[0],
        0,
        "the local main process goes first"
    );
    assert_eq!(order.lock().unwrap().len(), 3);
}

// ---- set_seed ----

/// ChaCha8 keyed as the documentation says: the seed and the rank as little-endian u64s, then the
/// 16-byte tag.
fn chacha(seed: u64, rank: u64, tag: &[u8; 16]) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&rank.to_le_bytes());
    key[16..].copy_from_slice(tag);
    ChaCha8Rng::from_seed(key)
}

/// After `set_seed(7)` an accelerator built with seed 1 draws what ChaCha8 keyed by (7, rank)
/// draws, on each of 2 ranks; `rank_rng(stream)` is the ChaCha8 of (7, rank, user tag) on that
/// stream.
#[test]
fn set_seed_restarts_the_rank_generator_and_seeds_the_user_generator() {
    let results = ranks_as_threads(
        2,
        || Accelerator::builder().seed(1),
        |mut acc| {
            let before = acc.rng().next_u64();
            acc.set_seed(7).unwrap();
            let after = acc.rng().next_u64();
            let mut user = acc.rank_rng(3);
            (acc.seed(), before, after, user.next_u64())
        },
    );
    for (rank, (seed, before, after, user)) in results.into_iter().enumerate() {
        assert_eq!(seed, 7);
        assert_eq!(
            before,
            chacha(1, rank as u64, b"accel-rs rankrng").next_u64()
        );
        assert_eq!(
            after,
            chacha(7, rank as u64, b"accel-rs rankrng").next_u64()
        );
        let mut expected = chacha(7, rank as u64, b"accel-rs userrng");
        expected.set_stream(3);
        assert_eq!(user, expected.next_u64(), "rank {rank}");
    }
}

// ---- register_for_checkpointing ----

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Progress {
    epoch: u32,
    best_loss: f64,
    notes: Vec<String>,
}

fn progress() -> Progress {
    Progress {
        epoch: 3,
        best_loss: 0.125,
        notes: vec!["warmup done".into()],
    }
}

/// A run preparing `w`, and the handles of the user objects it registered.
type Run = (
    Accelerator,
    Option<Arc<Mutex<u64>>>,
    Option<Arc<Mutex<Progress>>>,
);

/// A run preparing `w` and registering `objects` user objects: a counter, then a struct.
fn run_with(objects: usize) -> Run {
    let mut acc = single().build().unwrap();
    let w = Var::new(&[1.0f32], &Device::Cpu).unwrap();
    acc.prepare(vec![("w".to_string(), w)]).unwrap();
    let counter = (objects >= 1).then(|| acc.register_for_checkpointing(0u64));
    let state = (objects >= 2).then(|| {
        acc.register_for_checkpointing(Progress {
            epoch: 0,
            best_loss: 1e9,
            notes: Vec::new(),
        })
    });
    (acc, counter, state)
}

fn manifest(dir: &std::path::Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

/// Saved values come back after `load_state`, in a fresh run; the files are listed in the
/// manifest with their sizes, and hold the values as CBOR (RFC 8949: 42 is `0x18 0x2a`, a text
/// string's UTF-8 bytes are written as they are).
#[test]
fn registered_objects_are_saved_and_loaded_with_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (acc, counter, state) = run_with(2);
    let (counter, state) = (counter.unwrap(), state.unwrap());
    *counter.lock().unwrap() = 42;
    *state.lock().unwrap() = progress();
    acc.save_state(dir.path()).unwrap();
    *counter.lock().unwrap() = 43;

    let m = manifest(dir.path());
    assert_eq!(m["custom_objects"], 2);
    let counter_bytes = std::fs::read(dir.path().join("custom_checkpoint_0.cbor")).unwrap();
    assert_eq!(counter_bytes, [0x18, 0x2a]);
    let state_bytes = std::fs::read(dir.path().join("custom_checkpoint_1.cbor")).unwrap();
    assert!(state_bytes.windows(11).any(|w| w == b"warmup done"));
    for (i, bytes) in [counter_bytes, state_bytes].iter().enumerate() {
        let name = format!("custom_checkpoint_{i}.cbor");
        assert_eq!(m["files"][&name]["bytes"], bytes.len(), "{name}");
    }

    let (fresh, c2, s2) = run_with(2);
    fresh.load_state(dir.path()).unwrap();
    assert_eq!(*c2.unwrap().lock().unwrap(), 42);
    assert_eq!(*s2.unwrap().lock().unwrap(), progress());
}

/// A checkpoint with another number of registered objects is refused, naming both counts, and
/// nothing is loaded; one without any loads when nothing is registered and its manifest has no
/// trace of them (the format of checkpoints before this feature).
#[test]
fn another_count_of_registered_objects_is_refused() {
    let with_two = tempfile::tempdir().unwrap();
    let with_none = tempfile::tempdir().unwrap();
    let (acc, c, _) = run_with(2);
    *c.unwrap().lock().unwrap() = 9;
    acc.save_state(with_two.path()).unwrap();
    let (plain, _, _) = run_with(0);
    plain.save_state(with_none.path()).unwrap();
    assert!(manifest(with_none.path()).get("custom_objects").is_none());
    // Version 1, which builds before registered objects read alike; with objects, version 2,
    // which they refuse rather than lose the objects; a version newer than any (3 is ZeRO stage
    // 3's sharded parameters) is refused here.
    assert_eq!(manifest(with_none.path())["format_version"], 1);
    assert_eq!(manifest(with_two.path())["format_version"], 2);
    let newer = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(with_none.path()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), newer.path().join(entry.file_name())).unwrap();
    }
    let text = std::fs::read_to_string(newer.path().join("manifest.json")).unwrap();
    let bumped = text.replace("\"format_version\": 1", "\"format_version\": 4");
    assert_ne!(text, bumped);
    std::fs::write(newer.path().join("manifest.json"), bumped).unwrap();
    let (plain3, _, _) = run_with(0);
    let err = plain3.load_state(newer.path()).unwrap_err().to_string();
    assert!(err.contains("format version 4"), "{err}");

    let (one, c1, _) = run_with(1);
    let err = one.load_state(with_two.path()).unwrap_err().to_string();
    assert!(
        err.contains("holds 2 object(s) registered for checkpointing")
            && err.contains("this run registered 1"),
        "{err}"
    );
    assert_eq!(*c1.as_ref().unwrap().lock().unwrap(), 0, "nothing loaded");
    let err = one.load_state(with_none.path()).unwrap_err().to_string();
    assert!(err.contains("holds 0 object(s)"), "{err}");

    let (plain2, _, _) = run_with(0);
    plain2.load_state(with_none.path()).unwrap();
    let err = plain2.load_state(with_two.path()).unwrap_err().to_string();
    assert!(err.contains("this run registered 0"), "{err}");
}

/// A value of another type, or a file changed on disk, is refused by name before anything loads.
#[test]
fn a_registered_object_of_another_type_or_corrupt_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (acc, c, _) = run_with(1);
    *c.unwrap().lock().unwrap() = 5;
    acc.save_state(dir.path()).unwrap();

    let mut other = single().build().unwrap();
    let w = Var::new(&[1.0f32], &Device::Cpu).unwrap();
    other.prepare(vec![("w".to_string(), w)]).unwrap();
    let text = other.register_for_checkpointing(String::from("kept"));
    let err = other.load_state(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("custom_checkpoint_0.cbor") && err.contains("String"),
        "{err}"
    );
    assert_eq!(*text.lock().unwrap(), "kept");

    std::fs::write(dir.path().join("custom_checkpoint_0.cbor"), b"6").unwrap();
    let (fresh, c2, _) = run_with(1);
    let err = fresh.load_state(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("custom_checkpoint_0.cbor") && err.contains("checksum"),
        "{err}"
    );
    assert_eq!(*c2.unwrap().lock().unwrap(), 0);
}

/// The usual `best_loss = inf`, and a NaN, saved and loaded back as the floats they were (JSON
/// would write both as `null`, which does not read back as an f64).
#[test]
fn non_finite_floats_in_registered_objects_survive_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let build = || {
        let mut acc = single().build().unwrap();
        let w = Var::new(&[1.0f32], &Device::Cpu).unwrap();
        acc.prepare(vec![("w".to_string(), w)]).unwrap();
        let best = acc.register_for_checkpointing(0.0f64);
        let pair = acc.register_for_checkpointing((0.0f64, 0.0f32));
        (acc, best, pair)
    };
    let (acc, best, pair) = build();
    *best.lock().unwrap() = f64::INFINITY;
    *pair.lock().unwrap() = (f64::NEG_INFINITY, f32::NAN);
    acc.save_state(dir.path()).unwrap();
    let (fresh, best, pair) = build();
    fresh.load_state(dir.path()).unwrap();
    assert_eq!(*best.lock().unwrap(), f64::INFINITY);
    let (low, nan) = *pair.lock().unwrap();
    assert_eq!(low, f64::NEG_INFINITY);
    assert!(nan.is_nan());
}

/// A loop that saves while holding a handle's guard gets an error naming the object, not a wait
/// on itself forever; nothing is written.
#[test]
fn saving_while_holding_a_handle_is_an_error_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let (acc, counter, _) = run_with(1);
    let counter = counter.unwrap();
    let guard = counter.lock().unwrap();
    let err = acc.save_state(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("registered object 0") && err.contains("drop the guard"),
        "{err}"
    );
    assert!(!dir.path().join("manifest.json").exists());
    drop(guard);
    acc.save_state(dir.path()).unwrap();
    let guard = counter.lock().unwrap();
    let err = acc.load_state(dir.path()).unwrap_err().to_string();
    assert!(err.contains("drop the guard"), "{err}");
    drop(guard);
}

/// Ranks that registered different numbers of objects cannot save: only the main process's
/// values are written and every rank loads them, so the checkpoint would not load here. Every
/// rank gets the error, naming each rank's count.
#[test]
fn ranks_registering_different_counts_cannot_save() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let errors = ranks_as_threads(2, Accelerator::builder, |mut acc| {
        let w = Var::new(&[1.0f32], &Device::Cpu).unwrap();
        acc.prepare(vec![("w".to_string(), w)]).unwrap();
        if acc.process_index() == 0 {
            acc.register_for_checkpointing(5u64);
        }
        acc.save_state(&path).unwrap_err().to_string()
    });
    for err in errors {
        assert!(err.contains("rank 0: 1, rank 1: 0"), "{err}");
    }
    assert!(!dir.path().join("manifest.json").exists());
}

/// Infinities and NaN survive `gather_object` and `broadcast_object` on 2 ranks (the classic
/// `best_loss = inf`, a diverged loss), and so does a map with integer keys; a value of another
/// type is still refused, naming the rank that sent it.
#[test]
fn object_collectives_keep_non_finite_floats_and_refuse_another_type() {
    let results = ranks_as_threads(2, Accelerator::builder, |acc| {
        let rank = acc.process_index();
        let mine = vec![f64::INFINITY, f64::NAN, -(rank as f64) - 0.5];
        let gathered = acc.gather_object(&mine).unwrap();
        let from_one = acc
            .broadcast_object((f64::NEG_INFINITY, rank as f64, f64::NAN), 1)
            .unwrap();
        let keyed = std::collections::BTreeMap::from([(rank as u64 + 7, f64::INFINITY)]);
        let keyed = acc.broadcast_object(keyed, 1).unwrap();
        let mismatch = if rank == 0 {
            acc.gather_object(&vec![1.0f64, f64::NAN])
                .map(|_| ())
                .map_err(|e| e.to_string())
        } else {
            acc.gather_object(&"nan".to_string())
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        (gathered, from_one, keyed, mismatch)
    });
    for (rank, (gathered, from_one, keyed, _)) in results.iter().enumerate() {
        assert_eq!(gathered.len(), 2, "rank {rank}");
        for (sender, row) in gathered.iter().enumerate() {
            assert_eq!(row[0], f64::INFINITY, "rank {rank}, sent by {sender}");
            assert!(row[1].is_nan(), "rank {rank}, sent by {sender}: {row:?}");
            assert_eq!(row[2], -(sender as f64) - 0.5, "rank {rank}");
        }
        assert_eq!(from_one.0, f64::NEG_INFINITY, "rank {rank}");
        assert_eq!(from_one.1, 1.0, "rank {rank}: rank 1's value");
        assert!(from_one.2.is_nan(), "rank {rank}: {from_one:?}");
        assert_eq!(
            keyed,
            &std::collections::BTreeMap::from([(8u64, f64::INFINITY)]),
            "rank {rank}"
        );
    }
    let err = results[0].3.clone().unwrap_err();
    assert!(
        err.contains("rank 1") && err.contains("not of the type"),
        "{err}"
    );
}

/// A value whose `Serialize` implementation fails (on the rank given), as a user type with a
/// field it refuses to write might.
struct Unwritable {
    fails: bool,
}

impl serde::Serialize for Unwritable {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.fails {
            return Err(serde::ser::Error::custom(
                "this value refuses to be written",
            ));
        }
        serializer.serialize_u32(3)
    }
}

impl<'de> serde::Deserialize<'de> for Unwritable {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        u32::deserialize(deserializer).map(|_| Unwritable { fails: false })
    }
}

/// A rank whose value cannot be serialized still takes part in `gather_object` and
/// `broadcast_object`: every rank returns an error naming rank 1, and the ranks stay in step (a
/// broadcast right after gives every rank rank 0's values; had a rank left early, the others
/// would still be inside the object collective and that broadcast would be refused or wait).
#[test]
fn an_object_that_cannot_be_serialized_fails_every_rank_naming_it() {
    let results = ranks_as_threads(2, Accelerator::builder, |acc| {
        let rank = acc.process_index();
        let value = Unwritable { fails: rank == 1 };
        let gathered = acc
            .gather_object(&value)
            .map(|_| ())
            .map_err(|e| e.to_string());
        let after_gather = acc
            .broadcast(
                &Tensor::new(&[rank as f64, 2.0, 3.0], &Device::Cpu).unwrap(),
                0,
            )
            .and_then(|t| Ok(t.to_vec1::<f64>()?))
            .map_err(|e| e.to_string());
        let value = Unwritable { fails: rank == 1 };
        let broadcast = acc
            .broadcast_object(value, 1)
            .map(|_| ())
            .map_err(|e| e.to_string());
        let after_broadcast = acc
            .broadcast(&Tensor::new(&[rank as f64, 5.0], &Device::Cpu).unwrap(), 0)
            .and_then(|t| Ok(t.to_vec1::<f64>()?))
            .map_err(|e| e.to_string());
        (gathered, after_gather, broadcast, after_broadcast)
    });
    for (rank, (gathered, after_gather, broadcast, after_broadcast)) in results.iter().enumerate() {
        for err in [gathered, broadcast] {
            let err = err.clone().unwrap_err();
            assert!(
                err.contains("rank 1") && err.contains("cannot be serialized"),
                "rank {rank}: {err}"
            );
        }
        assert_eq!(
            after_gather.as_ref().unwrap(),
            &vec![0.0, 2.0, 3.0],
            "rank {rank}"
        );
        assert_eq!(
            after_broadcast.as_ref().unwrap(),
            &vec![0.0, 5.0],
            "rank {rank}"
        );
    }
    let own = results[1].0.clone().unwrap_err();
    assert!(own.contains("this value refuses to be written"), "{own}");
}

/// `broadcast` of a 3-element view of a 100,000-element buffer returns a tensor of exactly those
/// 3 elements (not a copy of the whole buffer), with rank 1's values, and not tracked: the
/// values are rank 1's, so no gradient flows back into the caller's variable.
#[test]
fn broadcast_of_a_view_holds_only_the_view_and_is_not_tracked() {
    let results = ranks_as_threads(2, Accelerator::builder, |acc| {
        let rank = acc.process_index() as f64;
        let base = (Tensor::arange(0f32, 100_000., &Device::Cpu).unwrap() + 1e6 * rank).unwrap();
        let var = Var::from_tensor(&base).unwrap();
        let view = var.as_tensor().narrow(0, 10, 3).unwrap();
        let out = acc.broadcast(&view, 1).unwrap();
        let (storage, layout) = out.storage_and_layout();
        let held = match &*storage {
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.len(),
            other => panic!("expected f32 host storage, got {:?}", other.dtype()),
        };
        let offset = layout.start_offset();
        drop(storage);
        let grads = out.sum_all().unwrap().backward().unwrap();
        let input_grad = grads.get(var.as_tensor()).is_some();
        (
            out.to_vec1::<f32>().unwrap(),
            held,
            offset,
            input_grad,
            values(&var)[10],
        )
    });
    for (rank, (vals, held, offset, input_grad, untouched)) in results.into_iter().enumerate() {
        assert_eq!(
            vals,
            vec![1e6 + 10.0, 1e6 + 11.0, 1e6 + 12.0],
            "rank {rank}"
        );
        assert!(!input_grad, "rank {rank}: a gradient flowed into the input");
        assert_eq!((held, offset), (3, 0), "rank {rank}: elements held, offset");
        assert_eq!(
            untouched,
            1e6 * rank as f32 + 10.0,
            "rank {rank}: the input changed"
        );
    }
}

/// `broadcast` keeps the tensor's dtype (bf16, f16, u8, i64, f64, and i32, which the
/// communicators do not carry and which travels converted), with rank 1's values; u8 and bf16
/// travel in their own dtype (the root sends 1 and 2 bytes per element, plus the few dozen bytes
/// of the collectives' agreements, not the 8 and 4 of i64 and f32); ranks passing different
/// dtypes (bf16 against f32, i32 against i64) are refused on every rank, naming both.
#[test]
fn broadcast_keeps_each_dtype_and_refuses_mismatched_dtypes() {
    let dtypes = [
        DType::BF16,
        DType::F16,
        DType::U8,
        DType::I64,
        DType::F64,
        DType::I32,
    ];
    let results = ranks_as_threads(2, Accelerator::builder, |acc| {
        let rank = acc.process_index() as f32;
        let kept: Vec<_> = dtypes
            .iter()
            .map(|&dtype| {
                let t = Tensor::new(&[3f32 + rank, 200.0 + rank], &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let out = acc.broadcast(&t, 1).unwrap();
                let vals = out.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
                (out.dtype(), vals)
            })
            .collect();
        let sent: Vec<u64> = [DType::U8, DType::BF16]
            .iter()
            .map(|&dtype| {
                let t = Tensor::zeros(10_000, dtype, &Device::Cpu).unwrap();
                let before = acc.comm_stats().bytes_sent;
                acc.broadcast(&t, 1).unwrap();
                acc.comm_stats().bytes_sent - before
            })
            .collect();
        let mismatched: Vec<_> = [(DType::BF16, DType::F32), (DType::I32, DType::I64)]
            .iter()
            .map(|&(on_zero, on_one)| {
                let dtype = if rank == 0.0 { on_zero } else { on_one };
                let t = Tensor::new(&[1f32, 2.0], &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                acc.broadcast(&t, 0).map(|_| ()).map_err(|e| e.to_string())
            })
            .collect();
        (kept, sent, mismatched)
    });
    let root_sent = &results[1].1;
    for (sent, payload) in root_sent.iter().zip([10_000u64, 20_000]) {
        assert!(
            (payload..payload + 1_000).contains(sent),
            "the root sent {sent} bytes for a payload of {payload}"
        );
    }
    for (rank, (kept, _, mismatched)) in results.into_iter().enumerate() {
        for (&dtype, (got, vals)) in dtypes.iter().zip(kept) {
            assert_eq!(got, dtype, "rank {rank}");
            assert_eq!(vals, vec![4.0, 201.0], "rank {rank}, {dtype:?}");
        }
        for (err, names) in mismatched
            .into_iter()
            .zip([["bf16", "f32"], ["i32", "i64"]])
        {
            let err = err.unwrap_err();
            assert!(
                err.contains(names[0]) && err.contains(names[1]) && err.contains("dtype"),
                "rank {rank}: {err}"
            );
        }
    }
}
