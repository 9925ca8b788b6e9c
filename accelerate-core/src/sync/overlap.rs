//! The overlap thread: on the sync micro-step, a scoped worker fills gradient buckets 1, 2, ...
//! while the calling thread reduces the buckets already filled.

use candle_core::backprop::GradStore;
use candle_core::Var;

use crate::error::Result;
use crate::grads::{prepare_bucket, GradientBucket, GradientBuffers};

/// How [`GradientBuffers::accumulate_and_reduce`] runs the sync micro-step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SyncOptions {
    /// Fill the buffers that received no gradient this window with zeros before their bucket is
    /// reduced (needed when whole buckets are reduced across ranks).
    pub fill_missing: bool,
    /// Fill later buckets on a worker thread while earlier ones are reduced.
    pub overlap: bool,
}

impl GradientBuffers {
    /// The sync micro-step's work on the buffers: adds `scale * grad(p)` for every parameter (as
    /// [`accumulate`](Self::accumulate)), fills the buffers that received no gradient this window
    /// with zeros when `options.fill_missing` is set (see `fill_missing_with_zeros`), and hands
    /// every bucket, in order, to `reduce` once its gradients are complete.
    ///
    /// With `options.overlap`, a scoped worker thread fills buckets 1, 2, ... while `reduce` runs
    /// on the calling thread for the buckets already filled, so the reduction of bucket i overlaps
    /// the preparation of the buckets after it. `reduce` stays on the calling thread because a
    /// communicator is neither `Send` nor `Sync` (NCCL's holds the thread's CUDA state). Each
    /// bucket is still filled by the same additions in the same order and reduced only once it
    /// is complete, so the result is bitwise the same with and without overlap.
    ///
    /// On an error (of `reduce` or of an accumulation) the first one is returned and the buffers
    /// hold a partial window, as after a failed [`accumulate`](Self::accumulate).
    pub(crate) fn accumulate_and_reduce(
        &mut self,
        params: &[(String, Var)],
        grads: &GradStore,
        scale: f64,
        options: SyncOptions,
        mut reduce: impl FnMut(&GradientBucket) -> Result<()>,
    ) -> Result<()> {
        let fill_missing = options.fill_missing;
        let (slots, buckets) = self.begin_sync(params, grads, fill_missing)?;
        if !options.overlap || buckets.len() < 2 {
            // Every bucket prepared at once, then reduced: the same work as one bucket's share.
            prepare_bucket(slots, params, grads, scale, fill_missing)?;
            return buckets.iter().try_for_each(reduce);
        }
        let ranges: Vec<_> = buckets.iter().map(|b| b.params()).collect();
        let (first_slots, later_slots) = slots.split_at_mut(ranges[0].end);
        prepare_bucket(
            first_slots,
            &params[ranges[0].clone()],
            grads,
            scale,
            fill_missing,
        )?;
        std::thread::scope(|scope| {
            // The worker announces each bucket it has filled (or the error that stopped it); the
            // calling thread reduces a bucket only after its announcement.
            let (filled_tx, filled_rx) = std::sync::mpsc::channel::<Result<usize>>();
            let worker = scope.spawn(move || {
                let mut rest = later_slots;
                for (b, range) in ranges.iter().enumerate().skip(1) {
                    let (slots, tail) = std::mem::take(&mut rest).split_at_mut(range.len());
                    rest = tail;
                    let filled =
                        prepare_bucket(slots, &params[range.clone()], grads, scale, fill_missing)
                            .map(|()| b);
                    let failed = filled.is_err();
                    // A closed channel means the calling thread stopped on an error of its own.
                    if filled_tx.send(filled).is_err() || failed {
                        break;
                    }
                }
            });
            let mut outcome = Ok(());
            for (b, bucket) in buckets.iter().enumerate() {
                if b > 0 {
                    match filled_rx.recv() {
                        Ok(Ok(filled)) => debug_assert_eq!(filled, b),
                        Ok(Err(e)) => {
                            outcome = Err(e);
                            break;
                        }
                        // The worker ended without a word: it panicked (re-raised below).
                        Err(_) => break,
                    }
                }
                if let Err(e) = reduce(bucket) {
                    outcome = Err(e);
                    break;
                }
            }
            // Lets a worker that is still filling stop at its next announcement.
            drop(filled_rx);
            if let Err(panic) = worker.join() {
                std::panic::resume_unwind(panic);
            }
            outcome
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::grads::scale_in_place_for_tests as scale_in_place;
    use crate::grads::test_fixtures::*;
    use candle_core::{DType, Device};

    /// Runs a sync step after one non-sync micro-step; returns the buckets as `reduce` saw them
    /// (in call order) and the buffers afterwards.
    fn sync_step(overlap: bool) -> (Vec<(usize, BucketBits)>, Vec<BucketBits>) {
        let params = model();
        let mut g = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        g.accumulate(&params, &grads(&params, 3), 0.5).unwrap();
        let first_param: Vec<usize> = g.buckets().iter().map(|b| b.params().start).collect();
        let mut seen = Vec::new();
        let options = SyncOptions {
            fill_missing: true,
            overlap,
        };
        g.accumulate_and_reduce(&params, &grads(&params, 4), 0.5, options, |bucket| {
            let b = first_param
                .iter()
                .position(|&p| p == bucket.params().start)
                .unwrap();
            let v = bucket.flat().to_vec1::<f32>().unwrap();
            seen.push((b, v.iter().map(|x| x.to_bits()).collect()));
            // Stands in for the average over ranks: every element changes.
            scale_in_place(bucket.flat(), 1.0 / 3.0)
        })
        .unwrap();
        (seen, flats(&g))
    }

    #[test]
    fn an_overlapped_sync_step_reduces_complete_buckets_in_order_and_equals_the_plain_one() {
        let (seen_plain, after_plain) = sync_step(false);
        let (seen_overlap, after_overlap) = sync_step(true);
        let order: Vec<usize> = seen_overlap.iter().map(|(b, _)| *b).collect();
        assert_eq!(order, (0..after_plain.len()).collect::<Vec<_>>());
        // Each bucket was complete (both micro-steps added, missing ones zero) when reduced.
        assert_eq!(seen_plain, seen_overlap);
        assert_eq!(after_plain, after_overlap);
        // The reduction did act (the comparison could have failed).
        assert_ne!(
            seen_plain
                .iter()
                .map(|(_, v)| v.clone())
                .collect::<Vec<_>>(),
            after_plain
        );
    }

    #[test]
    fn errors_of_the_worker_and_of_the_reduction_are_returned() {
        let params = model();
        let grads = grads(&params, 5);
        let options = SyncOptions {
            fill_missing: true,
            overlap: true,
        };
        // A reduction failing at bucket 1: returned, and no bucket after it is reduced.
        let mut g = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        let mut calls = 0;
        let r = g.accumulate_and_reduce(&params, &grads, 1.0, options, |_| {
            calls += 1;
            if calls == 2 {
                Err(Error::Config("reduction failed".into()))
            } else {
                Ok(())
            }
        });
        assert!(matches!(r, Err(Error::Config(m)) if m == "reduction failed"));
        assert_eq!(calls, 2);

        // An accumulation failing on the worker (a gradient whose shape does not fit the last
        // bucket's parameter): returned, and that bucket is never reduced.
        let mut g = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        let last = g.buckets().len() - 1;
        let (last_name, last_var) = params[g.buckets()[last].params().start].clone();
        let mut wrong = params.clone();
        let stranger = Var::zeros(3, DType::F32, &Device::Cpu).unwrap();
        let stranger_grads = (stranger.as_tensor() * 2.0)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut merged = grads;
        merged.insert(
            stranger.as_tensor(),
            stranger_grads.get(&stranger).unwrap().clone(),
        );
        let i = params.iter().position(|(n, _)| *n == last_name).unwrap();
        wrong[i] = (last_name.clone(), stranger);
        assert_ne!(last_var.dims(), wrong[i].1.dims());
        let mut reduced = Vec::new();
        let r = g.accumulate_and_reduce(&wrong, &merged, 1.0, options, |bucket| {
            reduced.push(bucket.params().start);
            Ok(())
        });
        assert!(
            matches!(&r, Err(Error::Parameters(m)) if m.contains(&last_name)),
            "{r:?}"
        );
        assert_eq!(reduced.len(), last);
    }
}
