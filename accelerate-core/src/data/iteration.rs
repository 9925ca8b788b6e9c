//! The loaders an accelerator prepared, where each stands (saved per rank in checkpoints), and
//! which of them a loop is inside ([`LoaderStack`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::loader_stack::LoaderStack;
use super::progress::LoaderProgress;
use crate::error::{Error, Result};

/// Where one data loader of a rank stands (saved per rank in checkpoints).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct LoaderPosition {
    /// The epoch to resume in.
    pub epoch: u64,
    /// Batches of that epoch this rank has already consumed.
    pub batches_consumed: usize,
    /// Batches per epoch on this rank (a different value means a different dataset or batch size);
    /// 0 for a streaming loader, whose length is not known in advance.
    pub batches_per_epoch: usize,
}

impl LoaderPosition {
    /// This position, saved by each of `old_world` ranks, as a rank of `new_world` continues it:
    /// global batch `i` goes to rank `i mod N` in an order that does not depend on `N`, so the
    /// `b · old_world` global batches consumed are `b · old_world / new_world` on each new rank.
    /// `batches_per_epoch` is the new loader's (`None` for a stream). Refused, with the reason,
    /// when the new ranks cannot share the consumed batches evenly, when they are more than the
    /// new loader's epoch holds, or inside a stream's epoch (its shards are read, not planned).
    pub fn for_world(
        self,
        old_world: usize,
        new_world: usize,
        batches_per_epoch: Option<usize>,
    ) -> std::result::Result<Self, String> {
        let epoch_start = Self {
            epoch: self.epoch,
            batches_consumed: 0,
            batches_per_epoch: batches_per_epoch.unwrap_or(0),
        };
        if self.batches_consumed == 0 {
            return Ok(epoch_start);
        }
        let b = self.batches_consumed;
        let global = b * old_world;
        let Some(now) = batches_per_epoch else {
            return Err(format!(
                "a streaming loader saved inside epoch {} ({b} batches on each of {old_world}                  ranks) cannot be split among {new_world}",
                self.epoch
            ));
        };
        if global % new_world != 0 {
            return Err(format!(
                "epoch {}: {global} global batches were consumed ({b} on each of {old_world}                  ranks), which {new_world} processes cannot share evenly",
                self.epoch
            ));
        }
        let consumed = global / new_world;
        match consumed.cmp(&now) {
            std::cmp::Ordering::Less => Ok(Self {
                batches_consumed: consumed,
                ..epoch_start
            }),
            std::cmp::Ordering::Equal => Ok(Self {
                epoch: self.epoch + 1,
                ..epoch_start
            }),
            std::cmp::Ordering::Greater => Err(format!(
                "epoch {}: {global} global batches were consumed ({b} on each of {old_world}                  ranks), more than the {now} per rank this run's loader has on {new_world}",
                self.epoch
            )),
        }
    }
}

/// The loaders an accelerator prepared, in order of preparation, and which of them a loop is
/// inside. Every prepared model of the accelerator shares it: a loader's end closes the window of
/// each model's accumulation alike.
#[derive(Debug, Default)]
pub(crate) struct PreparedLoaders {
    stack: Arc<LoaderStack>,
    loaders: Mutex<Vec<Arc<LoaderProgress>>>,
    /// The largest K − 1 of the models prepared: how far ahead streams read.
    window_lookahead: AtomicUsize,
}

impl PreparedLoaders {
    fn loaders(&self) -> std::sync::MutexGuard<'_, Vec<Arc<LoaderProgress>>> {
        self.loaders.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a prepared loader; its iteration now tells the loop's micro-steps where its
    /// epochs end. Returns its index (what checkpoints and the settings check call it).
    pub fn register(&self, progress: Arc<LoaderProgress>) -> Result<usize> {
        let mut loaders = self.loaders();
        let index = loaders.len();
        if !progress.attach(self.stack.clone(), index) {
            return Err(Error::Data(
                "this data loader was already prepared; prepare each loader once and iterate \
                 the one prepare() returned"
                    .into(),
            ));
        }
        progress.raise_window_lookahead(self.window_lookahead.load(Ordering::Acquire));
        loaders.push(progress);
        Ok(index)
    }

    /// Makes every stream, prepared or yet to be, read `batches` ahead at least: a model that
    /// accumulates K micro-steps needs K − 1 to know its window's length at its first micro-step.
    pub fn require_window_lookahead(&self, batches: usize) {
        let loaders = self.loaders();
        self.window_lookahead.fetch_max(batches, Ordering::AcqRel);
        for progress in loaders.iter() {
            progress.raise_window_lookahead(batches);
        }
    }

    /// Number of loaders prepared so far.
    pub fn len(&self) -> usize {
        self.loaders().len()
    }

    /// Every prepared loader's position on this rank, in order of preparation.
    pub fn positions(&self) -> Vec<LoaderPosition> {
        self.loaders()
            .iter()
            .map(|p| {
                let (epoch, batches_consumed) = p.resume_position();
                LoaderPosition {
                    epoch,
                    batches_consumed,
                    batches_per_epoch: p.batches_per_epoch_in_advance().unwrap_or(0),
                }
            })
            .collect()
    }

    /// Batches per epoch of every prepared loader on this rank, in order of preparation (`None`
    /// for a streaming loader).
    pub fn batches_per_epoch(&self) -> Vec<Option<usize>> {
        self.loaders()
            .iter()
            .map(|p| p.batches_per_epoch_in_advance())
            .collect()
    }

    /// Makes every loader continue from its saved position at its next `iter()`.
    pub fn resume(&self, positions: &[LoaderPosition]) {
        for (saved, progress) in positions.iter().zip(self.loaders().iter()) {
            progress.request_resume(saved.epoch, saved.batches_consumed);
        }
    }

    /// The loader the loop's current batch came from (what decides where a window ends and what
    /// `gather_for_metrics` drops).
    pub fn innermost(&self) -> Option<Arc<LoaderProgress>> {
        let id = self.stack.innermost()?;
        self.loaders().get(id).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loader_is_prepared_once() {
        let loaders = PreparedLoaders::default();
        let p = Arc::new(LoaderProgress::new(3));
        assert_eq!(loaders.register(p.clone()).unwrap(), 0);
        let e = loaders.register(p).unwrap_err().to_string();
        assert!(e.contains("already prepared"), "{e}");
        assert_eq!(loaders.len(), 1);
    }

    fn at(epoch: u64, batches_consumed: usize, batches_per_epoch: usize) -> LoaderPosition {
        LoaderPosition {
            epoch,
            batches_consumed,
            batches_per_epoch,
        }
    }

    /// 2 ranks × 3 batches = global batches 0..6: on 3 ranks, 2 each; at an epoch's start
    /// anything goes; the end of an epoch is the next one's start.
    #[test]
    fn a_position_is_remapped_by_global_batches() {
        assert_eq!(at(1, 3, 5).for_world(2, 3, Some(4)), Ok(at(1, 2, 4)));
        assert_eq!(at(1, 2, 4).for_world(3, 2, Some(5)), Ok(at(1, 3, 5)));
        assert_eq!(at(2, 0, 5).for_world(2, 3, Some(4)), Ok(at(2, 0, 4)));
        assert_eq!(at(0, 4, 4).for_world(3, 2, Some(6)), Ok(at(1, 0, 6)));
        assert_eq!(at(0, 0, 0).for_world(2, 3, None), Ok(at(0, 0, 0)));
        let err = at(1, 1, 5).for_world(2, 3, Some(4)).unwrap_err();
        assert!(err.contains("epoch 1: 2 global batches") && err.contains("3 processes"));
        assert!(at(0, 5, 5).for_world(2, 1, Some(5)).is_err());
        assert!(at(0, 1, 0).for_world(2, 1, None).is_err());
    }
}
