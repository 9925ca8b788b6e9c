//! Which prepared loaders a loop is inside, innermost last: Accelerate's
//! `GradientState.active_dataloader`, kept per accelerator.
//!
//! A loader enters when its iteration starts or hands out a batch and leaves when its iterator
//! returns its end. The innermost loader is the one the loop's current batch came from: it decides
//! where an epoch's last accumulation window ends, and which wrap-around rows `gather_for_metrics`
//! drops. A training loop that evaluates inside an epoch has its evaluation loader on top while
//! that loop runs, and its training loader back on top at its next batch.

use std::sync::Mutex;

/// The loaders (by index of preparation) a loop is inside, innermost last.
#[derive(Debug, Default)]
pub(crate) struct LoaderStack {
    order: Mutex<Vec<usize>>,
}

impl LoaderStack {
    /// Loader `id` is handing out a batch: it is now the innermost.
    pub fn enter(&self, id: usize) {
        let mut order = self.order.lock().unwrap_or_else(|e| e.into_inner());
        if order.last() != Some(&id) {
            order.retain(|&i| i != id);
            order.push(id);
        }
    }

    /// Loader `id`'s iterator has returned its end.
    pub fn leave(&self, id: usize) {
        self.order
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|&i| i != id);
    }

    /// The loader the loop's current batch came from, if a loop is inside any.
    pub fn innermost(&self) -> Option<usize> {
        self.order
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last()
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_innermost_loader_is_the_one_that_handed_out_last_and_has_not_ended() {
        let s = LoaderStack::default();
        assert_eq!(s.innermost(), None);
        s.enter(0); // the training loop starts
        s.enter(1); // an evaluation loop inside it
        s.enter(1);
        assert_eq!(s.innermost(), Some(1));
        s.leave(1); // the evaluation loop ends
        assert_eq!(s.innermost(), Some(0));
        s.enter(1); // evaluated again, and left with a `break` (no end)
        s.enter(0); // the training loader's next batch
        assert_eq!(s.innermost(), Some(0));
        s.leave(0);
        assert_eq!(s.innermost(), Some(1));
        s.leave(1);
        assert_eq!(s.innermost(), None);
    }
}
