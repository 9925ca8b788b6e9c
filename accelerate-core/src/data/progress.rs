//! Where a rank's iteration over its data loader stands, readable from anywhere.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use std::sync::{Arc, OnceLock};

use super::loader_stack::LoaderStack;
use super::plan::BatchPlan;

/// The window last handed out by `windows()`: where it starts, its length, and on how many of its
/// batches each consumer (a prepared model's accumulation) has begun a micro-step.
#[derive(Debug)]
struct PendingWindow {
    start: usize,
    len: usize,
    begun: Vec<(usize, usize)>,
}

/// Per-rank view of where iteration stands, shared (`Arc`) between a
/// [`DataLoader`](super::DataLoader) and whoever needs to know, such as the accelerator's
/// gradient-accumulation logic: the end of the loader always syncs gradients, and the accumulation
/// counter resets when an epoch starts.
///
/// The iterator updates it on the consumer side, as each batch is handed out, so it describes what
/// the training loop has received, not what the prefetch thread has prepared.
#[derive(Debug, Default)]
pub struct LoaderProgress {
    epoch: AtomicU64,
    batches_yielded: AtomicUsize,
    batches_per_epoch: AtomicUsize,
    generation: AtomicU64,
    /// The stack of loaders a loop is inside, of the accelerator that prepared this loader, and
    /// this loader's index in it (unset for a loader no accelerator prepared).
    stack: OnceLock<(Arc<LoaderStack>, usize)>,
    /// The loader's batch plan (None until a loader publishes it): what `gather_for_metrics`
    /// asks to drop the wrap-around duplicates.
    plan: std::sync::Mutex<Option<BatchPlan>>,
    /// Whether a loop is iterating the current epoch: set when the epoch's iteration starts (and
    /// when a window is handed out), cleared when the iterator has returned its end. Accelerate's
    /// `GradientState.in_dataloader`: `gather_for_metrics` drops wrap-around rows only inside it.
    iterating: AtomicBool,
    /// Batches of the window last handed out by `DataLoader::windows` that no micro-step has begun
    /// yet: the loop consumes a window one batch per micro-step, and each counts as handed out
    /// when its micro-step begins (so a checkpoint saved at the window's end resumes after it).
    window: std::sync::Mutex<Option<PendingWindow>>,
    /// A position restored from a checkpoint, `(epoch, batches to skip)`, that the loader's next
    /// `iter()` starts from (set by `Accelerator::load_state`, which cannot reach the loader).
    pending_resume: std::sync::Mutex<Option<(u64, usize)>>,
    /// Whether the loader reads a stream, whose batches per epoch are known only once its end is.
    streamed: AtomicBool,
    /// The batches a stream must read ahead so that every prepared model knows its window's length
    /// at the window's first micro-step: the largest K − 1 of the accelerator's models, raised
    /// as models are prepared (a model prepared after the loader may accumulate longer).
    window_lookahead: AtomicUsize,
}

/// What [`LoaderProgress::batches_per_epoch`] reports for a stream whose end has not been seen in
/// the current epoch: more batches than any window needs, never the end.
pub const UNKNOWN_BATCHES_PER_EPOCH: usize = usize::MAX;

impl LoaderProgress {
    /// Progress of a loader that has not started iterating and hands out `batches_per_epoch`
    /// batches per epoch on this rank.
    pub fn new(batches_per_epoch: usize) -> Self {
        Self {
            batches_per_epoch: AtomicUsize::new(batches_per_epoch),
            ..Self::default()
        }
    }

    /// Progress of a streaming loader: its batches per epoch are
    /// [`UNKNOWN_BATCHES_PER_EPOCH`] until the stream's end is seen.
    pub(crate) fn for_stream() -> Self {
        Self {
            batches_per_epoch: AtomicUsize::new(UNKNOWN_BATCHES_PER_EPOCH),
            streamed: AtomicBool::new(true),
            ..Self::default()
        }
    }

    /// Makes a stream read at least `batches` ahead from its next iteration on.
    pub(crate) fn raise_window_lookahead(&self, batches: usize) {
        self.window_lookahead.fetch_max(batches, Ordering::AcqRel);
    }

    /// The batches a stream must read ahead for the accumulation windows of the models prepared.
    pub(crate) fn window_lookahead(&self) -> usize {
        self.window_lookahead.load(Ordering::Acquire)
    }

    /// The batches per epoch known before iterating: `None` for a streaming loader (a checkpoint
    /// cannot compare a stream's length before reading it).
    pub fn batches_per_epoch_in_advance(&self) -> Option<usize> {
        (!self.streamed.load(Ordering::Acquire)).then(|| self.batches_per_epoch())
    }

    /// Epoch of the batch last handed out (set when that epoch's iteration starts).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Batches this rank has handed out in the current epoch, including those skipped to resume.
    pub fn batches_yielded(&self) -> usize {
        self.batches_yielded.load(Ordering::Acquire)
    }

    /// Batches this rank hands out per epoch ([`UNKNOWN_BATCHES_PER_EPOCH`] for a stream until the
    /// reader has seen its end: the loader looks ahead far enough that it is known by the first
    /// micro-step of the last accumulation window, and at the last batch).
    pub fn batches_per_epoch(&self) -> usize {
        self.batches_per_epoch.load(Ordering::Acquire)
    }

    /// Number of epoch iterations started so far; incremented every time one starts.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Batches of the current epoch not handed out yet.
    pub fn remaining(&self) -> usize {
        self.batches_per_epoch()
            .saturating_sub(self.batches_yielded())
    }

    /// Whether an epoch has started and all its batches have been handed out: the batch last handed
    /// out was the epoch's last.
    pub fn at_end(&self) -> bool {
        self.generation() > 0 && self.remaining() == 0
    }

    /// Whether a loop is inside an iteration of this loader: it has started an epoch and the
    /// iterator has not returned its end yet. The last batch handed out is inside; code after the
    /// loop is not.
    pub fn iterating(&self) -> bool {
        self.iterating.load(Ordering::Acquire)
    }

    /// Whether the batch last handed out was the epoch's last, inside the loop over it: what
    /// `gather_for_metrics` drops wrap-around rows for (Accelerate's
    /// `GradientState.end_of_dataloader`, which is false once the loop has ended).
    pub fn in_last_batch_of_loop(&self) -> bool {
        self.iterating() && self.at_end()
    }

    /// [`end_iteration`](Self::end_iteration), if the iteration that started at `generation` is
    /// still the current one: an iterator dropped after a newer one started leaves that one be.
    pub(crate) fn end_iteration_of(&self, generation: u64) {
        if self.generation() == generation {
            self.end_iteration();
        }
    }

    /// Records that the loop is no longer inside the current epoch: its iterator returned its end,
    /// or was dropped before it (a `break`, a `take`). The position stays where the loop left it,
    /// so a checkpoint saved after a loop stopped at a step limit resumes there.
    pub(crate) fn end_iteration(&self) {
        self.iterating.store(false, Ordering::Release);
        if let Some((stack, id)) = self.stack.get() {
            stack.leave(*id);
        }
    }

    /// Records the start of `epoch`'s iteration at batch `skip`.
    pub(crate) fn start_epoch(&self, epoch: u64, skip: usize, batches_per_epoch: usize) {
        self.epoch.store(epoch, Ordering::Release);
        self.batches_per_epoch
            .store(batches_per_epoch, Ordering::Release);
        self.batches_yielded.store(skip, Ordering::Release);
        *self.window.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.iterating.store(true, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.touch();
    }

    /// Records the start of a stream's `epoch` at batch `skip`: its length is unknown again until
    /// the reader reaches its end.
    pub(crate) fn start_stream_epoch(&self, epoch: u64, skip: usize) {
        *self.plan.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.start_epoch(epoch, skip, UNKNOWN_BATCHES_PER_EPOCH);
    }

    /// Records that the `count`-th batch of the current epoch has been handed out.
    pub(crate) fn record_yielded(&self, count: usize) {
        self.batches_yielded.store(count, Ordering::Release);
        self.touch();
    }

    /// Records that a window of `len` batches from batch `start` on has been handed out as a
    /// whole: none of it counts as consumed until [`begin_window_batch`](Self::begin_window_batch)
    /// counts its batches one by one.
    /// The loop is iterating again even if fetching the window's batches reached the epoch's end:
    /// the window's micro-steps are still to come.
    pub(crate) fn record_window(&self, start: usize, len: usize) {
        self.batches_yielded.store(start, Ordering::Release);
        *self.window.lock().unwrap_or_else(|e| e.into_inner()) = Some(PendingWindow {
            start,
            len,
            begun: Vec::new(),
        });
        self.iterating.store(true, Ordering::Release);
        self.touch();
    }

    /// Counts the next batch of the pending window as handed out (a micro-step is beginning on
    /// it); does nothing when no window is pending (batches handed out one by one are counted by
    /// the iterator itself).
    ///
    /// `consumer` names whose micro-step it is (each prepared model's accumulation has its own):
    /// several models begin a micro-step on the same batch, and the batch counts once, when the
    /// first of them begins on it.
    pub(crate) fn begin_window_batch(&self, consumer: usize) {
        let mut window = self.window.lock().unwrap_or_else(|e| e.into_inner());
        let Some(w) = window.as_mut() else {
            return;
        };
        let index = match w.begun.iter().position(|(c, _)| *c == consumer) {
            Some(i) => i,
            None => {
                w.begun.push((consumer, 0));
                w.begun.len() - 1
            }
        };
        if w.begun[index].1 < w.len {
            w.begun[index].1 += 1;
            let furthest = w.begun.iter().map(|(_, n)| *n).max().unwrap_or(0);
            self.batches_yielded
                .store(w.start + furthest, Ordering::Release);
            drop(window);
            self.touch();
        }
    }

    /// This loader handed out a batch or started an epoch: it is the innermost loader of the loop.
    fn touch(&self) {
        if let Some((stack, id)) = self.stack.get() {
            stack.enter(*id);
        }
    }

    /// Makes this loader the `id`-th of an accelerator's `stack`; a loader is prepared once.
    pub(crate) fn attach(&self, stack: Arc<LoaderStack>, id: usize) -> bool {
        self.stack.set((stack, id)).is_ok()
    }

    /// The batch plan the loader follows (`None` for progress no loader publishes to).
    pub fn plan(&self) -> Option<BatchPlan> {
        *self.plan.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where an exact resume continues: `(epoch, batches of it already consumed)`. At the end of an
    /// epoch that is the start of the next one; before any iteration, the start of epoch 0 (or a
    /// position restored but not yet iterated).
    pub fn resume_position(&self) -> (u64, usize) {
        if let Some(pending) = self.pending_resume() {
            return pending;
        }
        if self.generation() == 0 {
            return (0, 0);
        }
        if self.at_end() {
            (self.epoch() + 1, 0)
        } else {
            (self.epoch(), self.batches_yielded())
        }
    }

    /// Makes the loader's next `iter()` iterate `epoch` from batch `skip` on.
    pub(crate) fn request_resume(&self, epoch: u64, skip: usize) {
        *self
            .pending_resume
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some((epoch, skip));
    }

    /// The restored position not yet taken by the loader, if any.
    pub(crate) fn pending_resume(&self) -> Option<(u64, usize)> {
        *self
            .pending_resume
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the restored position (the loader is about to iterate from it).
    pub(crate) fn take_resume(&self) -> Option<(u64, usize)> {
        self.pending_resume
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Publishes the loader's plan, and the batches per epoch it gives this rank.
    pub(crate) fn set_plan(&self, plan: BatchPlan) {
        self.batches_per_epoch
            .store(plan.batches_per_rank(), Ordering::Release);
        *self.plan.lock().unwrap_or_else(|e| e.into_inner()) = Some(plan);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_move_with_epoch_starts_and_hand_outs() {
        let p = LoaderProgress::new(4);
        assert_eq!((p.generation(), p.batches_per_epoch()), (0, 4));
        assert!(!p.at_end(), "nothing has started yet");
        p.start_epoch(2, 1, 4);
        assert_eq!((p.epoch(), p.batches_yielded(), p.generation()), (2, 1, 1));
        assert_eq!(p.remaining(), 3);
        p.record_yielded(4);
        assert!(p.at_end());
        p.start_epoch(3, 0, 4);
        assert_eq!((p.epoch(), p.batches_yielded(), p.generation()), (3, 0, 2));
        assert!(!p.at_end());
    }

    #[test]
    fn a_window_counts_its_batches_as_their_micro_steps_begin() {
        let p = LoaderProgress::new(10);
        p.start_epoch(0, 0, 10);
        p.record_window(6, 3);
        assert_eq!(p.batches_yielded(), 6, "handed out, none begun");
        p.begin_window_batch(0);
        assert_eq!(p.batches_yielded(), 7);
        p.begin_window_batch(0);
        p.begin_window_batch(0);
        assert_eq!(p.resume_position(), (0, 9), "the whole window consumed");
        p.begin_window_batch(0);
        assert_eq!(p.batches_yielded(), 9, "nothing pending: no change");
        p.record_window(9, 1);
        p.begin_window_batch(0);
        assert!(p.at_end());
        assert_eq!(p.resume_position(), (1, 0));
        // A new epoch drops what is left of a window.
        p.record_window(0, 3);
        p.start_epoch(1, 0, 10);
        p.begin_window_batch(0);
        assert_eq!(p.batches_yielded(), 0);
    }

    #[test]
    fn the_last_batch_is_inside_the_loop_until_the_iterator_ends() {
        let p = LoaderProgress::new(2);
        assert!(!p.iterating() && !p.in_last_batch_of_loop());
        p.start_epoch(0, 0, 2);
        p.record_yielded(1);
        assert!(p.iterating() && !p.in_last_batch_of_loop());
        p.record_yielded(2);
        assert!(p.in_last_batch_of_loop(), "the loop body of the last batch");
        p.end_iteration();
        assert!(p.at_end() && !p.in_last_batch_of_loop(), "after the loop");
        // Windows: fetching the last window reaches the end before its micro-steps run.
        p.start_epoch(1, 0, 2);
        p.end_iteration();
        p.record_window(0, 2);
        p.begin_window_batch(0);
        p.begin_window_batch(0);
        assert!(p.in_last_batch_of_loop());
    }

    #[test]
    fn resume_position_is_the_next_unconsumed_batch() {
        let p = LoaderProgress::new(4);
        assert_eq!(p.resume_position(), (0, 0), "nothing iterated yet");
        p.start_epoch(2, 0, 4);
        p.record_yielded(3);
        assert_eq!(
            p.resume_position(),
            (2, 3),
            "mid-epoch: skip the 3 consumed"
        );
        p.record_yielded(4);
        assert_eq!(
            p.resume_position(),
            (3, 0),
            "epoch finished: the next one from its start"
        );
        p.request_resume(7, 1);
        assert_eq!(
            p.resume_position(),
            (7, 1),
            "a restored position wins until taken"
        );
        assert_eq!(p.take_resume(), Some((7, 1)));
        assert_eq!(p.resume_position(), (3, 0));
    }
}
