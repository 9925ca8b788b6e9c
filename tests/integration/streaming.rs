//! Streaming data (`StreamingLoader` over `JsonlShards`) against a single-process reading of the
//! same JSONL stream: plain Rust over the files' lines, each rank's batches computed by the
//! documented rule (rank `r` takes records `r·B .. (r+1)·B` of each global batch of `B·N`; an
//! incomplete last global batch is dropped with drop_last, and otherwise completed with the first
//! records of the stream on several ranks). Training on N ranks × K micro-batches is compared with
//! one process stepping on batches of N·K·B of the same stream, PyTorch's SGD written out.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use accelerate_core::data::{JsonlShards, StreamingLoader};
use accelerate_core::optim::{Sgd, SgdConfig};
use accelerate_core::{Accelerator, Model, Result};
use accelerate_tests::{named_vars, ranks_as_threads, snapshot, tiny_mlp, ReferenceOptimizer};
use candle_core::{Device, Tensor};

/// Features of record `id`: a fixed formula, so the reference needs nothing but the id.
fn features(id: i64) -> Vec<f32> {
    (0..6)
        .map(|j| ((id * 7 + j * 3) % 11) as f32 / 11.0 - 0.5)
        .collect()
}

/// Writes records `0..len` as JSON lines into `shards` files of `dir` (the last one may hold
/// fewer; a blank line ends the first shard, which readers skip).
fn write_stream(dir: &Path, len: i64, shards: usize) -> Vec<PathBuf> {
    let per_shard = (len as usize).div_ceil(shards).max(1) as i64;
    (0..shards)
        .map(|s| {
            let path = dir.join(format!("part-{s}.jsonl"));
            let mut text = String::new();
            for id in (s as i64 * per_shard)..((s as i64 + 1) * per_shard).min(len) {
                let x = features(id);
                text.push_str(&serde_json::json!({"id": id, "x": x, "y": id % 3}).to_string());
                text.push('\n');
            }
            if s == 0 {
                text.push('\n');
            }
            std::fs::write(&path, text).unwrap();
            path
        })
        .collect()
}

/// The reference reading: every non-blank line of the shards, in order, as its id.
fn reference_ids(shards: &[PathBuf]) -> Vec<i64> {
    shards
        .iter()
        .flat_map(|p| {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| {
                    serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                        .as_i64()
                        .unwrap()
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Rank `rank`'s batches by the documented rule.
fn expected_batches(
    ids: &[i64],
    b: usize,
    n: usize,
    rank: usize,
    drop_last: bool,
) -> Vec<Vec<i64>> {
    let round = b * n;
    let rounds = if drop_last {
        ids.len() / round
    } else {
        ids.len().div_ceil(round)
    };
    (0..rounds)
        .map(|k| {
            (rank * b..(rank + 1) * b)
                .map(|j| k * round + j)
                .filter(|&pos| pos < ids.len() || n > 1)
                .map(|pos| ids[pos % ids.len()])
                .collect()
        })
        .filter(|batch: &Vec<i64>| !batch.is_empty())
        .collect()
}

/// The dataset of ids: each record's id, as a batch of i64 ids.
fn id_stream(shards: &[PathBuf]) -> JsonlShards<i64, Tensor> {
    JsonlShards::new(
        shards.to_vec(),
        |v| Ok(v["id"].as_i64().expect("an id")),
        |ids| Ok(Tensor::new(ids, &Device::Cpu)?),
    )
    .unwrap()
}

/// The training dataset: (features, class); the features are computed from the JSON array with
/// some extra arithmetic, so that the transform costs something and its result is checked.
fn training_stream(shards: &[PathBuf]) -> JsonlShards<(Vec<f32>, u32), (Tensor, Tensor)> {
    JsonlShards::new(
        shards.to_vec(),
        |v| {
            let x: Vec<f32> = serde_json::from_value(v["x"].clone())
                .map_err(|e| accelerate_core::Error::Data(format!("bad x: {e}")))?;
            let y = v["y"]
                .as_u64()
                .ok_or_else(|| accelerate_core::Error::Data("no y".into()))?;
            Ok((x, y as u32))
        },
        |items| {
            let n = items.len();
            let (x, y): (Vec<Vec<f32>>, Vec<u32>) = items.into_iter().unzip();
            let x = Tensor::from_vec(x.concat(), (n, 6), &Device::Cpu)?;
            Ok((x, Tensor::new(y, &Device::Cpu)?))
        },
    )
    .unwrap()
}

fn ids_of(batches: impl Iterator<Item = Result<Tensor>>) -> Vec<Vec<i64>> {
    batches
        .map(|b| b.unwrap().to_vec1::<i64>().unwrap())
        .collect()
}

#[test]
fn every_rank_gets_its_slice_of_each_global_batch_as_a_plain_reading_says() {
    let dir = tempfile::tempdir().unwrap();
    for len in [0i64, 1, 5, 23, 24, 25] {
        let shards = write_stream(dir.path(), len, 3);
        let ids = reference_ids(&shards);
        assert_eq!(ids.len() as i64, len);
        for n in 1..=3 {
            for drop_last in [false, true] {
                let mut counts = Vec::new();
                for rank in 0..n {
                    let mut loader = StreamingLoader::new(Arc::new(id_stream(&shards)), 4)
                        .drop_last(drop_last)
                        .shard(rank, n);
                    let ours = ids_of(loader.iter());
                    let expected = expected_batches(&ids, 4, n, rank, drop_last);
                    assert_eq!(
                        ours, expected,
                        "len {len}, {n} ranks, rank {rank}, drop_last {drop_last}"
                    );
                    counts.push(ours.len());
                    // The next epoch reads the same stream again.
                    assert_eq!(ids_of(loader.iter()), expected);
                }
                assert!(
                    counts.iter().all(|&c| c == counts[0]),
                    "ranks end together: {counts:?}"
                );
            }
        }
    }
}

#[test]
fn three_workers_hand_out_the_batches_of_one_worker_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let shards = write_stream(dir.path(), 203, 4);
    let batches = |workers: usize| -> Vec<(Vec<Vec<f32>>, Vec<u32>)> {
        let mut loader = StreamingLoader::new(Arc::new(training_stream(&shards)), 5)
            .num_workers(workers)
            .shard(1, 2);
        loader
            .iter()
            .map(|b| {
                let (x, y) = b.unwrap();
                (x.to_vec2().unwrap(), y.to_vec1().unwrap())
            })
            .collect()
    };
    let one = batches(1);
    let three = batches(3);
    // Against the reference too: rank 1 of 2, the ids by the rule, the features by the formula.
    let expected = expected_batches(&reference_ids(&shards), 5, 2, 1, false);
    assert_eq!(one.len(), expected.len());
    for ((x, y), ids) in one.iter().zip(&expected) {
        let want: Vec<Vec<f32>> = ids.iter().map(|&id| features(id)).collect();
        assert_eq!(x, &want);
        assert_eq!(
            y,
            &ids.iter().map(|&id| (id % 3) as u32).collect::<Vec<_>>()
        );
    }
    let bits = |b: &[(Vec<Vec<f32>>, Vec<u32>)]| -> Vec<u32> {
        b.iter()
            .flat_map(|(x, _)| x.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>())
            .collect()
    };
    assert_eq!(bits(&one), bits(&three));
    assert_eq!(one, three);
}

#[test]
fn gather_for_metrics_on_ranks_returns_each_record_of_the_stream_once() {
    let dir = tempfile::tempdir().unwrap();
    // 26 records, batches of 3 on 3 ranks: 3 global batches, the last holds 8 real of 9.
    let shards = write_stream(dir.path(), 26, 2);
    let ids = reference_ids(&shards);
    let gathered = ranks_as_threads(3, Accelerator::builder, |mut acc| {
        let mut loader = acc
            .prepare(StreamingLoader::new(Arc::new(id_stream(&shards)), 3))
            .unwrap();
        let mut all = Vec::new();
        for batch in loader.iter() {
            let g = acc.gather_for_metrics(&batch.unwrap()).unwrap();
            all.extend(g.to_vec1::<i64>().unwrap());
        }
        all
    });
    for g in gathered {
        assert_eq!(
            g, ids,
            "the stream in order, without the completing duplicate"
        );
    }
}

/// A stream's loop left with `take` at its last batch no longer counts as inside the loader: a
/// gather after it keeps every row (as for a map-style loader).
#[test]
fn a_gather_after_a_stream_loop_left_at_its_last_batch_keeps_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let shards = write_stream(dir.path(), 9, 1);
    let mut acc = Accelerator::builder()
        .process_state(accelerate_core::ProcessState::single())
        .build()
        .unwrap();
    let mut loader = acc
        .prepare(StreamingLoader::new(Arc::new(id_stream(&shards)), 4))
        .unwrap();
    // 9 records in batches of 4: 4, 4 and a last batch of 1.
    let sizes: Vec<usize> = loader
        .iter()
        .take(3)
        .map(|b| b.unwrap().dim(0).unwrap())
        .collect();
    assert_eq!(sizes, [4, 4, 1]);
    let totals = Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
    assert_eq!(acc.gather_for_metrics(&totals).unwrap().dim(0).unwrap(), 3);
}

/// How a run gives its model K micro-steps.
#[derive(Clone, Copy)]
enum KFrom {
    /// The accelerator's builder; the loader is prepared after the model.
    Builder,
    /// The model's own `Model::gradient_accumulation_steps`, prepared after the loader.
    ModelAfterLoader,
}

/// Trains the tiny model on `n` ranks (threads), K micro-batches of `b` each, for `epochs`
/// epochs of the stream; returns rank 0's final parameters.
fn train_on_ranks(
    shards: &[PathBuf],
    n: usize,
    k: usize,
    b: usize,
    epochs: usize,
) -> Vec<Vec<f32>> {
    train_on_ranks_with(shards, n, k, b, epochs, KFrom::Builder)
}

fn train_on_ranks_with(
    shards: &[PathBuf],
    n: usize,
    k: usize,
    b: usize,
    epochs: usize,
    k_from: KFrom,
) -> Vec<Vec<f32>> {
    let builder_k = match k_from {
        KFrom::Builder => k,
        KFrom::ModelAfterLoader => 1,
    };
    let builder = move || Accelerator::builder().gradient_accumulation_steps(builder_k);
    let params = ranks_as_threads(n, builder, |mut acc| {
        let (varmap, model) = tiny_mlp(1).unwrap();
        let loader = StreamingLoader::new(Arc::new(training_stream(shards)), b).num_workers(2);
        let (params, mut loader) = match k_from {
            KFrom::Builder => {
                let params = acc.prepare(&varmap).unwrap();
                (params, acc.prepare(loader).unwrap())
            }
            KFrom::ModelAfterLoader => {
                let loader = acc.prepare(loader).unwrap();
                let model = Model::from_varmap(&varmap).gradient_accumulation_steps(k);
                let prepared = acc.prepare(model).unwrap();
                assert_eq!(prepared.gradient_accumulation_steps(), k);
                (prepared.parameters().to_vec(), loader)
            }
        };
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..SgdConfig::default()
        };
        let mut opt = acc.prepare(Sgd::new(params.clone(), cfg).unwrap()).unwrap();
        for _ in 0..epochs {
            for batch in loader.iter() {
                let (x, y) = batch.unwrap();
                let _step = acc.accumulate();
                let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
                acc.backward(&loss).unwrap();
                opt.step().unwrap();
                opt.zero_grad();
            }
        }
        snapshot(&params)
    });
    params.into_iter().next().unwrap()
}

/// The reference: one process, plain candle, batches of `big` consecutive records of the stream
/// read with plain Rust, PyTorch's SGD with momentum written out.
fn train_reference(shards: &[PathBuf], big: usize, epochs: usize) -> (Vec<Vec<f32>>, usize) {
    let (varmap, model) = tiny_mlp(1).unwrap();
    let params = named_vars(&varmap);
    let mut reference = ReferenceOptimizer::sgd(0.1, 0.9);
    let ids = reference_ids(shards);
    let mut steps = 0;
    for _ in 0..epochs {
        for chunk in ids.chunks(big) {
            let x: Vec<f32> = chunk.iter().flat_map(|&id| features(id)).collect();
            let x = Tensor::from_vec(x, (chunk.len(), 6), &Device::Cpu).unwrap();
            let y: Vec<u32> = chunk.iter().map(|&id| (id % 3) as u32).collect();
            let y = Tensor::new(y, &Device::Cpu).unwrap();
            let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
            reference.step(&params, &loss.backward().unwrap()).unwrap();
            steps += 1;
        }
    }
    (snapshot(&params), steps)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn n_ranks_times_k_micro_batches_of_a_stream_equal_one_process_with_the_big_batch() {
    let dir = tempfile::tempdir().unwrap();
    // 2 ranks, K = 3, B = 4: 64 records are 8 global batches, windows of 3, 3 and 2 (the last
    // weighted by its true length, known at its first micro-step from the look-ahead); the
    // reference steps on 24, 24 and 16 records.
    let shards = write_stream(dir.path(), 64, 3);
    let ours = train_on_ranks(&shards, 2, 3, 4, 2);
    let (reference, steps) = train_reference(&shards, 24, 2);
    assert_eq!(steps, 6);
    let d = max_diff(&ours, &reference);
    assert!(d < 1e-5, "2 ranks: max |Δθ| = {d}");
    // 3 ranks, K = 2, B = 4: 60 records are 5 global batches, windows of 2, 2 and 1.
    let shards = write_stream(dir.path(), 60, 2);
    let ours = train_on_ranks(&shards, 3, 2, 4, 1);
    let (reference, steps) = train_reference(&shards, 24, 1);
    assert_eq!(steps, 3);
    let d = max_diff(&ours, &reference);
    assert!(d < 1e-5, "3 ranks: max |Δθ| = {d}");
    // The comparison can fail: one rank without accumulation is far from it.
    let alone = train_on_ranks(&shards, 1, 1, 4, 1);
    assert!(max_diff(&alone, &reference) > 1e-3);
}

#[test]
fn a_model_prepared_after_the_stream_with_its_own_k_weights_its_last_window_by_its_length() {
    // The stream is prepared while K is 1; the model prepared after it accumulates 3 micro-steps.
    // 2 ranks, B = 4, 64 records: windows of 3, 3 and 2 batches per epoch, the last of 16
    // records, which the stream must read 2 batches ahead to know at the window's start.
    let dir = tempfile::tempdir().unwrap();
    let shards = write_stream(dir.path(), 64, 3);
    let ours = train_on_ranks_with(&shards, 2, 3, 4, 2, KFrom::ModelAfterLoader);
    let (reference, steps) = train_reference(&shards, 24, 2);
    assert_eq!(steps, 6);
    let d = max_diff(&ours, &reference);
    assert!(d < 1e-5, "max |Δθ| = {d}");
}

/// Trains on 2 ranks, K = 2, for 2 epochs of the stream; with `stop_at`, stops after that many
/// micro-steps and saves a checkpoint into `dir`, then a fresh set of ranks loads it and trains
/// to the end. Returns rank 0's final parameters.
fn train_resumable(shards: &[PathBuf], stop_at: Option<usize>, dir: &Path) -> Vec<Vec<f32>> {
    let builder = || Accelerator::builder().gradient_accumulation_steps(2);
    let setup = |acc: &mut Accelerator| {
        let (varmap, model) = tiny_mlp(1).unwrap();
        let params = acc.prepare(&varmap).unwrap();
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..SgdConfig::default()
        };
        let opt = acc.prepare(Sgd::new(params.clone(), cfg).unwrap()).unwrap();
        let loader = StreamingLoader::new(Arc::new(training_stream(shards)), 3).num_workers(3);
        (model, params, opt, acc.prepare(loader).unwrap())
    };
    let run = |resume: bool, stop_at: Option<usize>| {
        ranks_as_threads(2, builder, |mut acc| {
            let (model, params, mut opt, mut loader) = setup(&mut acc);
            if resume {
                acc.load_state(dir).unwrap();
            }
            let mut micro_steps = 0;
            'epochs: while loader.next_epoch() < 2 {
                for batch in loader.iter() {
                    let (x, y) = batch.unwrap();
                    let _step = acc.accumulate();
                    let logits = model.forward(&x).unwrap();
                    acc.backward(&candle_nn::loss::cross_entropy(&logits, &y).unwrap())
                        .unwrap();
                    opt.step().unwrap();
                    opt.zero_grad();
                    micro_steps += 1;
                    if Some(micro_steps) == stop_at {
                        acc.save_state(dir).unwrap();
                        break 'epochs;
                    }
                }
            }
            snapshot(&params)
        })
        .remove(0)
    };
    match stop_at {
        None => run(false, None),
        Some(at) => {
            run(false, Some(at));
            run(true, None)
        }
    }
}

#[test]
fn a_resumed_run_equals_an_uninterrupted_one_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    // 41 records, batches of 3 on 2 ranks: 7 batches per epoch (the last completed), windows
    // of 2, 2, 2, 1.
    let shards = write_stream(dir.path(), 41, 2);
    let uninterrupted = train_resumable(&shards, None, &dir.path().join("unused"));
    // Stopped inside epoch 1, in the middle of a window (micro-step 7 + 3 = batch 3 of epoch 1),
    // and at the end of a window in epoch 0.
    for stop_at in [10, 4] {
        let ckpt = dir.path().join(format!("ckpt-{stop_at}"));
        let resumed = train_resumable(&shards, Some(stop_at), &ckpt);
        assert_eq!(
            resumed, uninterrupted,
            "stopped after {stop_at} micro-steps"
        );
    }
    // The comparison can fail: a run that skips nothing after loading differs.
    let dir2 = dir.path().join("ckpt-10");
    let replayed = ranks_as_threads(
        2,
        || Accelerator::builder().gradient_accumulation_steps(2),
        |mut acc| {
            let (varmap, _model) = tiny_mlp(1).unwrap();
            let params = acc.prepare(&varmap).unwrap();
            let cfg = SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                ..SgdConfig::default()
            };
            let _opt = acc.prepare(Sgd::new(params.clone(), cfg).unwrap()).unwrap();
            let mut loader = acc
                .prepare(StreamingLoader::new(Arc::new(training_stream(&shards)), 3))
                .unwrap();
            acc.load_state(&dir2).unwrap();
            // The loader resumes in epoch 1 after 3 batches: its first batch is the 4th of the epoch.
            let first = loader
                .iter()
                .next()
                .unwrap()
                .unwrap()
                .1
                .to_vec1::<u32>()
                .unwrap();
            (loader.next_epoch(), first)
        },
    );
    let ids = reference_ids(&shards);
    let fourth = &expected_batches(&ids, 3, 2, 0, false)[3];
    assert_eq!(replayed[0].0, 2, "the resumed epoch was 1");
    assert_eq!(
        replayed[0].1,
        fourth.iter().map(|&id| (id % 3) as u32).collect::<Vec<_>>()
    );
}

#[test]
fn bad_input_names_the_file_and_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.jsonl");
    let e = JsonlShards::new([&missing], Ok, |_: Vec<serde_json::Value>| {
        Ok(Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu)?)
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("missing.jsonl"), "{e}");

    // A shard removed after the dataset was built: the iteration's error names it.
    let shards = write_stream(dir.path(), 10, 2);
    let dataset = id_stream(&shards);
    std::fs::remove_file(&shards[1]).unwrap();
    let mut loader = StreamingLoader::new(Arc::new(dataset), 2);
    let e = loader
        .iter()
        .find_map(|b| b.err())
        .expect("an error")
        .to_string();
    assert!(e.contains("part-1.jsonl"), "{e}");

    // A malformed line 3 of the second shard.
    let shards = write_stream(dir.path(), 10, 2);
    let mut text = std::fs::read_to_string(&shards[1]).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let broken = format!(
        "{}\n{}\n{{\"id\": 7,\n{}\n",
        lines[0],
        lines[1],
        lines[3..].join("\n")
    );
    text = broken;
    std::fs::write(&shards[1], text).unwrap();
    let mut loader = StreamingLoader::new(Arc::new(id_stream(&shards)), 2).num_workers(2);
    let results: Vec<_> = loader.iter().collect();
    let e = results.last().unwrap().as_ref().unwrap_err().to_string();
    assert!(e.contains("part-1.jsonl:3"), "{e}");
    assert!(
        results[..results.len() - 1].iter().all(|r| r.is_ok()),
        "the batches before it"
    );
}
