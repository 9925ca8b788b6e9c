//! The micro-step counter and the sync decision of gradient accumulation.
//!
//! A window is K consecutive micro-steps whose gradients are summed locally and reduced across ranks
//! once, on the window's last micro-step, where the optimizer steps. The decision follows Accelerate
//! with one correction:
//! - a window closes after K micro-steps, and always at the end of the data loader (the loader's
//!   [`LoaderProgress`] says how many batches remain), so a final partial window still syncs;
//! - each micro-step's loss is scaled by 1/k, where k is the window's *true* length (K, or fewer for
//!   the last window of an epoch) — Accelerate divides by K always, under-weighting that window;
//! - in item-weighted mode the scale is `world_size / global_items`, where `global_items` is the item
//!   count (e.g. tokens) of the whole window on all ranks, so the gradient equals that of one batch
//!   holding the whole window (transformers' `num_items_in_batch` fix). The mean all-reduce then
//!   divides by `world_size` again.
//!
//! The counter resets when the loader starts a new epoch.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::data::LoaderProgress;
use crate::error::{Error, Result};

/// What one micro-step is: its place in the window and whether it syncs.
#[derive(Debug, Clone, Copy, PartialEq)]
#[must_use = "the micro-step says whether gradients sync; `let _step = accelerator.accumulate();`"]
pub struct MicroStep {
    /// Whether gradients are reduced and the optimizer steps at the end of this micro-step.
    pub sync: bool,
    /// Position of this micro-step in its window, `0..window_len`.
    pub index: usize,
    /// Number of micro-steps in this window (K, or fewer for the last window of an epoch).
    pub window_len: usize,
    /// Factor applied to this micro-step's gradient before it is added to the window's sum.
    pub loss_scale: f64,
}

/// What a checkpoint keeps of the accumulation state: enough to continue a window that was saved
/// in its middle, and the optimizer step count.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AccumulationCounters {
    /// K, micro-steps per optimizer step, when the state was saved.
    pub steps: usize,
    /// Micro-steps already taken in the current window (0 at a window boundary).
    pub taken: usize,
    /// Length of the current window (K, or fewer for the last window of an epoch).
    pub window_len: usize,
    /// `world_size / global_items` of the current window, in item-weighted mode.
    pub item_scale: Option<f64>,
    /// Optimizer steps taken so far.
    pub optimizer_steps: u64,
}

/// The accumulation state machine (one per `Accelerator`).
#[derive(Debug)]
pub(crate) struct Accumulation {
    steps: usize,
    /// Micro-steps already begun in the current window.
    taken: usize,
    window_len: usize,
    current: Option<MicroStep>,
    /// `world_size / global_items` of the current window, in item-weighted mode.
    item_scale: Option<f64>,
    /// Generation of the loader epoch the current window belongs to.
    loader_generation: Option<u64>,
    /// Whether a backward pass has run for the current micro-step.
    backward_done: bool,
    /// Whether the current micro-step was begun by `accumulate()` (not implicitly by `backward`).
    explicit: bool,
    /// Optimizer steps taken (not skipped).
    optimizer_steps: u64,
    /// Whether the last sync micro-step's optimizer step was skipped (fp16 overflow).
    step_was_skipped: bool,
    /// Whether the optimizer stepped in the current micro-step (the scheduler follows it).
    optimizer_stepped: bool,
    /// Set when a window was left unfinished (the loop left an epoch mid-window): its partial
    /// gradient sum must be discarded, not carried into the next window.
    abandoned_window: bool,
    /// Who this accumulation is to a loader handing out windows: each prepared model's is
    /// distinct, so a batch that several models step on counts once.
    consumer: usize,
}

impl Accumulation {
    pub fn new(steps: usize) -> Result<Self> {
        if steps == 0 {
            return Err(Error::Config(format!(
                "gradient accumulation steps must be at least 1 (1 means no accumulation); check \
                 {} and `gradient_accumulation_steps`",
                crate::env::GRADIENT_ACCUMULATION_STEPS
            )));
        }
        static NEXT_CONSUMER: AtomicUsize = AtomicUsize::new(0);
        Ok(Self {
            consumer: NEXT_CONSUMER.fetch_add(1, Ordering::Relaxed),
            steps,
            taken: 0,
            window_len: steps,
            current: None,
            item_scale: None,
            loader_generation: None,
            backward_done: false,
            explicit: false,
            optimizer_steps: 0,
            step_was_skipped: false,
            optimizer_stepped: false,
            abandoned_window: false,
        })
    }

    /// K, the configured number of micro-steps per window.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Optimizer steps taken (not skipped).
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps
    }

    /// Whether the last sync micro-step's optimizer step was skipped (fp16 overflow).
    pub fn step_was_skipped(&self) -> bool {
        self.step_was_skipped
    }

    /// Whether the scheduler advances in this micro-step: the optimizer stepped, not skipped.
    pub fn scheduler_steps_now(&self) -> bool {
        self.optimizer_stepped && !self.step_was_skipped
    }

    /// The sync micro-step's optimizer updated the parameters.
    pub fn record_optimizer_step(&mut self) {
        self.optimizer_steps += 1;
        self.step_was_skipped = false;
        self.optimizer_stepped = true;
    }

    /// The sync micro-step's optimizer step was skipped (fp16 overflow): the scheduler stays.
    pub fn record_skipped_step(&mut self) {
        self.step_was_skipped = true;
    }

    /// Whether a window was left unfinished since the last call (its partial gradient sum must be
    /// discarded); clears the mark.
    pub fn take_abandoned_window(&mut self) -> bool {
        std::mem::take(&mut self.abandoned_window)
    }

    /// The counters a checkpoint saves.
    pub fn counters(&self) -> AccumulationCounters {
        AccumulationCounters {
            steps: self.steps,
            taken: self.taken,
            window_len: self.window_len,
            item_scale: self.item_scale,
            optimizer_steps: self.optimizer_steps,
        }
    }

    /// Checks that `saved` can be restored into an accumulation of K = `self.steps`.
    pub fn check_restorable(
        &self,
        saved: &AccumulationCounters,
    ) -> std::result::Result<(), String> {
        if saved.taken > 0 && saved.steps != self.steps {
            return Err(format!(
                "it was saved inside an accumulation window of K={} micro-steps, but this run \
                 uses K={}; resume with the same gradient accumulation steps",
                saved.steps, self.steps
            ));
        }
        if saved.taken >= saved.window_len.max(1) || saved.window_len > saved.steps {
            return Err(format!(
                "its counters are inconsistent ({} micro-steps taken of a window of {}, K={})",
                saved.taken, saved.window_len, saved.steps
            ));
        }
        Ok(())
    }

    /// Continues from saved counters (checked with [`check_restorable`](Self::check_restorable)).
    /// The loader epoch of a restored window is adopted from the first micro-step after the resume,
    /// whose iteration is a new one.
    pub fn restore(&mut self, saved: &AccumulationCounters) {
        self.taken = saved.taken;
        self.window_len = if saved.taken > 0 {
            saved.window_len
        } else {
            self.steps
        };
        self.item_scale = saved.item_scale;
        self.optimizer_steps = saved.optimizer_steps;
        self.loader_generation = None;
        self.current = None;
        self.backward_done = false;
        self.explicit = false;
        self.step_was_skipped = false;
        self.optimizer_stepped = false;
        self.abandoned_window = false;
    }

    /// Whether the current window has not begun yet (no micro-step taken in it).
    pub fn at_window_start(&self, loader: Option<&Arc<LoaderProgress>>) -> bool {
        self.taken == 0 || self.new_epoch(loader)
    }

    fn new_epoch(&self, loader: Option<&Arc<LoaderProgress>>) -> bool {
        match (loader, self.loader_generation) {
            (Some(p), Some(g)) => p.generation() != g,
            _ => false,
        }
    }

    /// Closes the window of a past epoch that the loop left unfinished (a `break`, or a loader
    /// without a known end): that window never synced, so its partial sum must not leak onward
    /// (`abandoned_window` tells the accelerator to discard it) and its item scale ends with it.
    /// Called by whatever first touches the new epoch's window: its first micro-step, or
    /// `set_window_items` before it, whose scale must then survive that micro-step.
    fn leave_window_of_a_past_epoch(&mut self, loader: Option<&Arc<LoaderProgress>>) {
        if self.new_epoch(loader) && self.taken != 0 {
            self.taken = 0;
            self.item_scale = None;
            self.abandoned_window = true;
        }
    }

    /// Begins a micro-step. `loader` is the training loader, if one was prepared; it has already
    /// handed out this micro-step's batch.
    pub fn begin(&mut self, loader: Option<&Arc<LoaderProgress>>) -> MicroStep {
        if let Some(p) = loader {
            // Iterating `windows()`: this micro-step's batch counts as handed out now.
            p.begin_window_batch(self.consumer);
        }
        if self.taken != 0 && self.loader_generation.is_none() {
            // A window restored from a checkpoint continues in the resumed iteration.
            self.loader_generation = loader.map(|p| p.generation());
        }
        self.leave_window_of_a_past_epoch(loader);
        if self.taken == 0 {
            self.window_len = self.steps;
            if let Some(p) = loader {
                self.loader_generation = Some(p.generation());
                let per_epoch = p.batches_per_epoch();
                let yielded = p.batches_yielded();
                if per_epoch > 0 && yielded > 0 && yielded <= per_epoch {
                    // The current batch is already counted in `yielded`.
                    let remaining = per_epoch - yielded + 1;
                    self.window_len = self.steps.min(remaining);
                }
            }
        }
        let index = self.taken;
        let sync = index + 1 >= self.window_len;
        let loss_scale = self.item_scale.unwrap_or(1.0 / self.window_len as f64);
        let step = MicroStep {
            sync,
            index,
            window_len: self.window_len,
            loss_scale,
        };
        self.taken = if sync { 0 } else { index + 1 };
        self.current = Some(step);
        self.backward_done = false;
        self.optimizer_stepped = false;
        if sync {
            self.step_was_skipped = false;
        }
        step
    }

    /// Begins a micro-step on the loop's request (`accumulate()`).
    pub fn begin_explicit(&mut self, loader: Option<&Arc<LoaderProgress>>) -> MicroStep {
        let step = self.begin(loader);
        self.explicit = true;
        step
    }

    /// The micro-step a backward pass belongs to. A loop that never calls `accumulate()` gets a
    /// new micro-step per backward; one that does gets exactly one backward per micro-step.
    pub fn current_for_backward(
        &mut self,
        loader: Option<&Arc<LoaderProgress>>,
    ) -> Result<MicroStep> {
        match self.current {
            Some(step) if !self.backward_done => Ok(step),
            Some(_) if self.explicit => Err(Error::Config(
                "backward was called twice in one micro-step; add the losses and call backward \
                 once, or call accelerator.accumulate() before each backward"
                    .into(),
            )),
            _ => {
                let step = self.begin(loader);
                self.explicit = false;
                Ok(step)
            }
        }
    }

    /// Records that the current micro-step's backward pass ran; closes the item window on sync.
    pub fn backward_finished(&mut self) {
        self.backward_done = true;
        if self.current.is_some_and(|s| s.sync) {
            self.item_scale = None;
        }
    }

    /// Whether the current micro-step syncs (true before any micro-step: a loop without
    /// accumulation steps every time).
    pub fn sync_gradients(&self) -> bool {
        self.current.is_none_or(|s| s.sync)
    }

    /// Switches the window about to begin to item-weighted mode with `global_items` items over all
    /// ranks.
    pub fn set_window_items(
        &mut self,
        global_items: f64,
        world_size: usize,
        loader: Option<&Arc<LoaderProgress>>,
    ) -> Result<()> {
        if !self.at_window_start(loader) {
            return Err(Error::Config(format!(
                "set_window_items was called in the middle of an accumulation window (after \
                 micro-step {} of {}); call it once per window, before the window's first \
                 `accumulate()`",
                self.taken, self.window_len
            )));
        }
        if global_items <= 0.0 || !global_items.is_finite() {
            return Err(Error::Config(format!(
                "an accumulation window holds {global_items} items over all ranks; item-weighted \
                 accumulation needs at least one item (skip empty windows, or count padding out \
                 only where real items remain)"
            )));
        }
        self.leave_window_of_a_past_epoch(loader);
        self.item_scale = Some(world_size as f64 / global_items);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn syncs(acc: &mut Accumulation, n: usize) -> Vec<(bool, usize)> {
        (0..n)
            .map(|_| {
                let s = acc.begin(None);
                (s.sync, s.window_len)
            })
            .collect()
    }

    #[test]
    fn without_a_loader_every_kth_micro_step_syncs() {
        let mut acc = Accumulation::new(3).unwrap();
        let got: Vec<bool> = syncs(&mut acc, 7).into_iter().map(|s| s.0).collect();
        assert_eq!(got, [false, false, true, false, false, true, false]);
        assert!(Accumulation::new(0).is_err());
    }

    #[test]
    fn item_scale_set_after_an_abandoned_window_holds_for_the_next_window() {
        // 4 batches per epoch, K = 2. Epoch 0: the loop leaves after one micro-step of a window.
        let progress = Arc::new(LoaderProgress::new(4));
        let loader = Some(&progress);
        let mut acc = Accumulation::new(2).unwrap();
        progress.start_epoch(0, 0, 4);
        acc.set_window_items(8.0, 2, loader).unwrap();
        progress.record_yielded(1);
        let first = acc.begin(loader);
        assert_eq!((first.sync, first.loss_scale), (false, 2.0 / 8.0));
        // Epoch 1: the next window is item-weighted with 10 items over 2 ranks.
        progress.start_epoch(1, 0, 4);
        acc.set_window_items(10.0, 2, loader).unwrap();
        for (yielded, sync) in [(1, false), (2, true)] {
            progress.record_yielded(yielded);
            let step = acc.begin(loader);
            assert_eq!(step.index, yielded - 1);
            assert_eq!(step.sync, sync);
            assert_eq!(step.loss_scale, 2.0 / 10.0, "world / items, not 1 / K");
        }
        assert!(
            acc.abandoned_window,
            "the partial sum of epoch 0 is discarded"
        );
    }

    #[test]
    fn k_one_always_syncs_with_unit_scale() {
        let mut acc = Accumulation::new(1).unwrap();
        for _ in 0..4 {
            let s = acc.begin(None);
            assert!(s.sync);
            assert_eq!(s.loss_scale, 1.0);
        }
    }
}
