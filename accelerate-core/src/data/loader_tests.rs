//! Tests of the data loader through its public API: what each rank receives, resume, prefetch,
//! windows, progress, and clean shutdown of the prefetch thread.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};

use super::test_support::{IndexBatch, IndexDataset};
use super::{DataLoader, Dataset, TensorDataset};
use crate::error::Result;

/// Generous limit for work that takes milliseconds; reaching it means a hang, not slowness.
const WATCHDOG: Duration = Duration::from_secs(60);

fn indices(batches: impl Iterator<Item = Result<IndexBatch>>) -> Vec<Vec<usize>> {
    batches.map(|b| b.unwrap().0).collect()
}

fn loader(len: usize, batch_size: usize) -> DataLoader<IndexDataset> {
    DataLoader::new(Arc::new(IndexDataset::new(len)), batch_size)
}

/// Runs `f` on another thread and fails (instead of hanging) if it does not finish in time.
fn within_watchdog<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(WATCHDOG)
        .expect("the operation hung (or panicked) instead of finishing")
}

#[test]
fn defaults_iterate_in_order_with_a_partial_last_batch() {
    let mut l = loader(7, 3);
    assert_eq!(
        (l.len(), l.rank(), l.world_size(), l.batch_size()),
        (3, 0, 1, 3)
    );
    assert_eq!(
        indices(l.iter()),
        vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]]
    );
    assert_eq!(
        (l.samples_per_epoch(), l.wrapped_samples_per_epoch()),
        (7, 0)
    );
    assert_eq!(l.dataset().len(), 7);
}

#[test]
fn every_rank_gets_entries_rank_plus_multiples_of_n_of_one_shared_plan() {
    // (len, batch, world, drop_last), including datasets smaller than batch * world.
    let cases = [
        (23, 4, 3, false),
        (23, 4, 3, true),
        (24, 3, 2, false),
        (5, 4, 3, false),
        (5, 4, 3, true),
        (1, 2, 4, false),
        (40, 5, 8, false),
    ];
    for (len, b, n, drop_last) in cases {
        let what = format!("len {len}, batch {b}, world {n}, drop_last {drop_last}");
        let loaders: Vec<_> = (0..n)
            .map(|r| {
                loader(len, b)
                    .shuffle(true)
                    .seed(17)
                    .drop_last(drop_last)
                    .shard(r, n)
            })
            .collect();
        let plan = loaders[0].epoch_plan(2);
        for (r, l) in loaders.iter().enumerate() {
            assert_eq!(l.epoch_plan(2), plan, "{what}: rank {r} sees another plan");
            let expected: Vec<_> = plan.iter().skip(r).step_by(n).cloned().collect();
            assert_eq!(indices(l.iter_epoch(2, 0)), expected, "{what}: rank {r}");
            assert_eq!(l.len(), expected.len(), "{what}: rank {r}");
            assert_eq!(
                l.len(),
                loaders[0].len(),
                "{what}: ranks step equally often"
            );
        }
        let flat: Vec<usize> = plan.iter().flatten().copied().collect();
        let real = loaders[0].samples_per_epoch();
        let mut seen = flat[..real].to_vec();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), real, "{what}: a real sample appears twice");
        if drop_last {
            // Whole rounds of n full batches only: floor(floor(len / b) / n) * n * b samples.
            assert_eq!(flat.len(), len / b / n * n * b, "{what}");
            assert_eq!(real, flat.len(), "{what}");
        } else {
            assert_eq!(seen, (0..len).collect::<Vec<_>>(), "{what}");
            // ceil(ceil(len / b) / n) rounds of n full batches; the rest of the slots wrap around.
            let batches = len / b + usize::from(len % b != 0);
            let rounds = batches / n + usize::from(batches % n != 0);
            assert_eq!(flat.len(), rounds * n * b, "{what}");
            assert_eq!(loaders[0].wrapped_samples_per_epoch(), rounds * n * b - len);
        }
    }
}

#[test]
fn the_order_depends_on_seed_and_epoch_only() {
    let l = loader(50, 5).shuffle(true).seed(3);
    assert_ne!(l.epoch_plan(0), l.epoch_plan(1));
    assert_ne!(
        l.epoch_plan(0),
        loader(50, 5).shuffle(true).seed(4).epoch_plan(0)
    );
    let again = loader(50, 5).shuffle(true).seed(3).shard(1, 2);
    let flat = |plan: Vec<Vec<usize>>| plan.concat();
    assert_eq!(flat(again.epoch_plan(0)), flat(l.epoch_plan(0)));

    let plain = loader(50, 5);
    assert_eq!(flat(plain.epoch_plan(7)), (0..50).collect::<Vec<_>>());
}

#[test]
fn skip_resumes_at_the_right_batch() {
    let l = loader(20, 2).shuffle(true).seed(1).shard(1, 2);
    let full = indices(l.iter_epoch(4, 0));
    assert_eq!(full.len(), 5);
    let progress = l.progress();

    let mut resumed = l.iter_epoch(4, 3);
    assert_eq!((progress.epoch(), progress.batches_yielded()), (4, 3));
    assert_eq!(resumed.position(), 3);
    assert_eq!(resumed.next().unwrap().unwrap().0, full[3]);
    assert_eq!(progress.batches_yielded(), 4);
    assert_eq!(resumed.next().unwrap().unwrap().0, full[4]);
    assert!(resumed.next().is_none());
    assert!(progress.at_end());

    assert!(indices(l.iter_epoch(4, 5)).is_empty());
    assert!(progress.at_end());
    let err = l.iter_epoch(4, 6).next().unwrap().unwrap_err().to_string();
    assert!(
        err.contains("after 6 batches") && err.contains("only 5"),
        "{err}"
    );
}

#[test]
fn resume_at_positions_the_next_epoch_then_counting_goes_on() {
    let mut l = loader(8, 2);
    l.resume_at(5, 2);
    let mut it = l.iter();
    assert_eq!((it.epoch(), it.position()), (5, 2));
    assert_eq!(it.next().unwrap().unwrap().0, vec![4, 5]);
    drop(it);
    let it = l.iter();
    assert_eq!((it.epoch(), it.position()), (6, 0));
    drop(it);
    l.set_epoch(1);
    assert_eq!(l.next_epoch(), 1);
    let mut epochs = Vec::new();
    for _ in 0..2 {
        let it = (&mut l).into_iter();
        epochs.push(it.epoch());
    }
    assert_eq!(epochs, vec![1, 2]);
}

#[test]
fn progress_follows_the_consumer_and_counts_epoch_starts() {
    let mut l = loader(5, 2).prefetch(3);
    let progress = l.progress();
    assert_eq!(
        (progress.generation(), progress.batches_per_epoch()),
        (0, 3)
    );
    let mut it = l.iter();
    assert_eq!(
        (
            progress.generation(),
            progress.epoch(),
            progress.batches_yielded()
        ),
        (1, 0, 0)
    );
    it.next().unwrap().unwrap();
    // However far the prefetch thread has run ahead, one batch has been handed out.
    assert_eq!(progress.batches_yielded(), 1);
    assert!(!progress.at_end());
    it.next().unwrap().unwrap();
    it.next().unwrap().unwrap();
    assert!(progress.at_end());
    assert!(it.next().is_none());
    drop(it);
    let _it = l.iter();
    assert_eq!(
        (
            progress.generation(),
            progress.epoch(),
            progress.batches_yielded()
        ),
        (2, 1, 0)
    );
}

#[test]
fn sharding_updates_the_shared_progress() {
    let l = loader(10, 2);
    let progress = l.progress();
    assert_eq!(progress.batches_per_epoch(), 5);
    let l = l.shard(0, 2);
    assert_eq!(progress.batches_per_epoch(), 3);
    let _l = l.drop_last(true);
    assert_eq!(progress.batches_per_epoch(), 2);
}

/// x row `s` = [3s, 3s+1, 3s+2], y row `s` = 10 + s.
fn tensor_rows(n: usize) -> TensorDataset {
    let x = Tensor::arange(0f32, (3 * n) as f32, &Device::Cpu)
        .unwrap()
        .reshape((n, 3))
        .unwrap();
    let y = Tensor::arange(10i64, 10 + n as i64, &Device::Cpu).unwrap();
    TensorDataset::new(x, y).unwrap()
}

#[test]
fn prefetched_batches_equal_direct_gathers_of_the_plan() {
    let dataset = Arc::new(tensor_rows(11));
    for depth in [0, 1, 2, 5] {
        let l = DataLoader::new(Arc::clone(&dataset), 3)
            .shuffle(true)
            .seed(8)
            .prefetch(depth)
            .shard(1, 2);
        let plan = l.epoch_plan(1);
        let mut count = 0;
        for (i, batch) in l.iter_epoch(1, 0).enumerate() {
            let (bx, by) = batch.unwrap();
            let samples = &plan[1 + 2 * i];
            let (dx, dy) = dataset.get_batch(samples).unwrap();
            assert_eq!(bx.to_vec2::<f32>().unwrap(), dx.to_vec2::<f32>().unwrap());
            assert_eq!(by.to_vec1::<i64>().unwrap(), dy.to_vec1::<i64>().unwrap());
            let hand_x: Vec<Vec<f32>> = samples
                .iter()
                .map(|&s| (0..3).map(|c| (3 * s + c) as f32).collect())
                .collect();
            let hand_y: Vec<i64> = samples.iter().map(|&s| 10 + s as i64).collect();
            assert_eq!(bx.to_vec2::<f32>().unwrap(), hand_x, "prefetch {depth}");
            assert_eq!(by.to_vec1::<i64>().unwrap(), hand_y, "prefetch {depth}");
            count += 1;
        }
        // 11 samples, batch 3, 2 ranks: 4 global batches, 2 per rank.
        assert_eq!(count, 2, "prefetch {depth}");
    }
}

#[test]
fn windows_group_consecutive_batches_with_a_short_last_window() {
    let mut l = loader(14, 2);
    let plan = l.epoch_plan(0);
    let windows: Vec<Vec<Vec<usize>>> = l
        .windows(3)
        .map(|w| w.unwrap().into_iter().map(|b| b.0).collect())
        .collect();
    assert_eq!(
        windows.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![3, 3, 1]
    );
    assert_eq!(windows.concat(), plan);
    assert_eq!(l.next_epoch(), 1, "a pass of windows is an epoch");

    let sizes = |l: &mut DataLoader<IndexDataset>, k| {
        l.windows(k).map(|w| w.unwrap().len()).collect::<Vec<_>>()
    };
    assert_eq!(sizes(&mut l, 7), vec![7]);
    assert_eq!(sizes(&mut l, 10), vec![7]);
    assert_eq!(sizes(&mut l, 1), vec![1; 7]);

    let mut zero = l.windows(0);
    let err = zero.next().unwrap().unwrap_err().to_string();
    assert!(err.contains("windows(0)"), "{err}");
    assert!(zero.next().is_none());
}

#[test]
fn dropping_an_iterator_mid_epoch_stops_its_thread() {
    for depth in [1, 2, 4] {
        for taken in [0, 1, 3] {
            let dataset = Arc::new(IndexDataset::new(10_000));
            let l = DataLoader::new(Arc::clone(&dataset), 1).prefetch(depth);
            let refs = within_watchdog(move || {
                let mut it = l.iter_epoch(0, 0);
                for _ in 0..taken {
                    it.next().unwrap().unwrap();
                }
                drop(it);
                // The loader's reference and the test's: the thread has released its own.
                Arc::strong_count(l.dataset())
            });
            assert_eq!(refs, 2, "prefetch {depth}, {taken} taken");
        }
    }
}

#[test]
fn a_failing_batch_is_reported_and_ends_the_epoch() {
    for depth in [0, 2] {
        let dataset = IndexDataset {
            fail_at: Some(5),
            ..IndexDataset::new(10)
        };
        let l = DataLoader::new(Arc::new(dataset), 2).prefetch(depth);
        let items: Vec<_> = within_watchdog(move || l.iter_epoch(0, 0).collect());
        assert_eq!(items.len(), 3, "prefetch {depth}");
        assert_eq!(items[1].as_ref().unwrap().0, vec![2, 3]);
        let err = items[2].as_ref().unwrap_err().to_string();
        assert!(err.contains("sample 5 is unreadable"), "{err}");
    }
}

#[test]
fn a_panicking_dataset_is_reported_instead_of_ending_silently() {
    let dataset = IndexDataset {
        panic_at: Some(5),
        ..IndexDataset::new(10)
    };
    let l = DataLoader::new(Arc::new(dataset), 2).prefetch(2);
    let items: Vec<_> = within_watchdog(move || l.iter_epoch(0, 0).collect());
    assert_eq!(items.len(), 3);
    let err = items[2].as_ref().unwrap_err().to_string();
    assert!(
        err.contains("batch 2 of epoch 0") && err.contains("panicked") && err.contains("cursed"),
        "{err}"
    );
}

#[test]
fn invalid_configurations_are_the_first_item() {
    let err = loader(10, 0).iter_epoch(0, 0).next().unwrap().unwrap_err();
    assert!(err.to_string().contains("batch size is 0"), "{err}");
    let err = loader(10, 2)
        .shard(2, 2)
        .iter_epoch(0, 0)
        .next()
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("rank 2 of 2"), "{err}");
    let mut it = loader(10, 2).shard(0, 0).iter_epoch(0, 0);
    assert!(it.next().unwrap().is_err());
    assert!(it.next().is_none());
}

/// A dataset whose batches wait for the test to open a gate (or for the watchdog).
struct GatedDataset {
    gate: std::sync::Mutex<mpsc::Receiver<()>>,
}

impl Dataset for GatedDataset {
    type Item = usize;
    type Batch = IndexBatch;

    fn len(&self) -> usize {
        4
    }

    fn get(&self, index: usize) -> Result<usize> {
        let _ = self.gate.lock().unwrap().recv_timeout(WATCHDOG);
        Ok(index)
    }

    fn collate(&self, items: Vec<usize>) -> Result<IndexBatch> {
        Ok(IndexBatch(items))
    }
}

#[test]
fn a_batch_that_never_comes_is_a_timeout_error_naming_the_setting() {
    let (open, gate) = mpsc::channel();
    let dataset = GatedDataset {
        gate: std::sync::Mutex::new(gate),
    };
    let l = DataLoader::new(Arc::new(dataset), 2).batch_timeout(Duration::from_millis(10));
    let mut it = l.iter_epoch(0, 0);
    // The gate stays closed until after the wait, so the batch cannot arrive in time.
    let err = it.next().unwrap().unwrap_err().to_string();
    assert!(
        err.contains("batch 0 of epoch 0") && err.contains("DataLoader::batch_timeout"),
        "{err}"
    );
    assert!(it.next().is_none());
    for _ in 0..2 {
        open.send(()).unwrap();
    }
}
