//! Grouping an epoch's batches into accumulation windows.

use std::sync::Arc;

use super::progress::LoaderProgress;
use crate::error::{Error, Result};

/// Iterator over windows of up to `k` consecutive batches of one epoch (the last may be shorter);
/// see [`DataLoader::windows`](super::DataLoader::windows) and
/// [`StreamingLoader::windows`](super::StreamingLoader::windows). `I` is the epoch's batch
/// iterator ([`EpochIter`](super::EpochIter) or [`StreamIter`](super::StreamIter)).
///
/// A whole window is fetched before it is returned, so a training loop can count the window's
/// items (e.g. tokens) before its first backward pass. An error ends the iteration; the batches
/// already fetched for that window are dropped with it.
pub struct WindowIter<I> {
    batches: I,
    progress: Arc<LoaderProgress>,
    /// The progress's generation when this iteration started.
    generation: u64,
    epoch: u64,
    /// Batches of the epoch fetched so far, skipped ones included.
    position: usize,
    size: usize,
    finished: bool,
}

impl<I> WindowIter<I> {
    /// Windows of `size` batches of `batches`, an iteration of `epoch` that starts at batch
    /// `position` and reports to `progress`.
    pub(crate) fn new(
        batches: I,
        size: usize,
        epoch: u64,
        position: usize,
        progress: Arc<LoaderProgress>,
    ) -> Self {
        Self {
            batches,
            generation: progress.generation(),
            progress,
            epoch,
            position,
            size,
            finished: false,
        }
    }

    /// The epoch being iterated.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Batches of the epoch handed out so far (in returned windows), skipped ones included.
    pub fn position(&self) -> usize {
        self.position
    }
}

impl<I> Drop for WindowIter<I> {
    fn drop(&mut self) {
        // Left inside a window (also the last, after the batch iterator ended): the loop is no
        // longer inside this loader.
        self.progress.end_iteration_of(self.generation);
    }
}

impl<B, I: Iterator<Item = Result<B>>> Iterator for WindowIter<I> {
    type Item = Result<Vec<B>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.finished {
            return None;
        }
        if self.size == 0 {
            self.finished = true;
            return Some(Err(Error::Config(
                "DataLoader::windows(0): an accumulation window holds at least one batch; pass \
                 the number of gradient-accumulation steps (>= 1)"
                    .into(),
            )));
        }
        let start = self.position;
        let mut window = Vec::with_capacity(self.size);
        while window.len() < self.size {
            match self.batches.next() {
                Some(Ok(batch)) => {
                    window.push(batch);
                    self.position += 1;
                }
                Some(Err(e)) => {
                    self.finished = true;
                    return Some(Err(e));
                }
                None => break,
            }
        }
        if window.is_empty() {
            self.finished = true;
            // The loop over the epoch ends here, also when the batch iterator already ended while
            // the last (shorter) window was fetched.
            self.progress.end_iteration();
            None
        } else {
            // The loop consumes the window's batches after this returns, one per micro-step: the
            // accelerator counts each as handed out when its micro-step begins, so it sees the
            // window start (and how many batches remain from there) at the first micro-step, and
            // a checkpoint saved at the window's end resumes after the window.
            self.progress.record_window(start, window.len());
            Some(Ok(window))
        }
    }
}
