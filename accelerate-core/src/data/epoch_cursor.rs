//! Which epoch a loader's next `iter()` reads, and from which batch: the counter both the
//! map-style and the streaming loader keep, with a position restored by `load_state` (which
//! reaches the loader only through its shared progress) taking precedence.

use super::progress::LoaderProgress;

/// The epoch of a loader's next `iter()` and the batches it skips.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct EpochCursor {
    /// Epoch of the next `iter()` call.
    next_epoch: u64,
    /// Batches the next `iter()` call skips (set by `resume_at`).
    resume_skip: usize,
}

impl EpochCursor {
    /// The epoch and skip the next `iter()` reads (a position `load_state` restored first), and
    /// advances to the following epoch, read from its start.
    pub fn advance(&mut self, progress: &LoaderProgress) -> (u64, usize) {
        if let Some((epoch, skip)) = progress.take_resume() {
            self.next_epoch = epoch;
            self.resume_skip = skip;
        }
        let epoch = self.next_epoch;
        let skip = std::mem::take(&mut self.resume_skip);
        self.next_epoch += 1;
        (epoch, skip)
    }

    /// Makes the next `iter()` read `epoch` from batch `skip` on, replacing a restored position.
    pub fn resume_at(&mut self, progress: &LoaderProgress, epoch: u64, skip: usize) {
        progress.take_resume();
        self.next_epoch = epoch;
        self.resume_skip = skip;
    }

    /// Epoch of the next `iter()` call (a restored position's, if one is pending).
    pub fn next_epoch(&self, progress: &LoaderProgress) -> u64 {
        progress
            .pending_resume()
            .map_or(self.next_epoch, |(epoch, _)| epoch)
    }
}
