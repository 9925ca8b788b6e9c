//! The communicator, reachable from the prepared optimizer and model.
//!
//! Under ZeRO, `optimizer.step()` all-gathers the updated parameters and, at stage 2,
//! `clip_grad_norm` all-reduces a norm; a prepared model's `backward` averages its gradients
//! across ranks: all are collectives, but the prepared objects hold only
//! the training state, not the `Accelerator` that owns the communicator. A communicator is neither
//! `Send` nor `Sync` (NCCL's holds its thread's CUDA state), while the prepared objects are. The
//! link therefore holds a weak reference that is upgraded, used and released only on the thread
//! that built the `Accelerator` (the `Accelerator` is not `Send`, so that is where the
//! communicator lives and dies); on any other thread it refuses with an error.

use std::sync::{Arc, Weak};
use std::thread::ThreadId;

use crate::comm::Communicator;
use crate::error::{Error, Result};

/// A weak, thread-checked handle to the `Accelerator`'s communicator.
#[derive(Clone)]
pub(crate) struct CommLink {
    owner: ThreadId,
    comm: Weak<dyn Communicator>,
}

// SAFETY: `comm` is upgraded, used and its strong reference dropped only on `owner`, checked at
// every use (`with`). On other threads the link is only moved or dropped, which touches the weak
// count (atomic) and, once the communicator is gone, frees its allocation: no method of the
// communicator runs there, and its destructor runs where the `Accelerator` drops its own `Arc`,
// on `owner`.
unsafe impl Send for CommLink {}
// SAFETY: as for `Send`: shared access only reaches the communicator on `owner`.
unsafe impl Sync for CommLink {}

impl std::fmt::Debug for CommLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommLink")
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl CommLink {
    /// A link to `comm`, usable on the calling thread only.
    pub fn new(comm: &Arc<dyn Communicator>) -> Self {
        Self {
            owner: std::thread::current().id(),
            comm: Arc::downgrade(comm),
        }
    }

    /// Runs `f` with the communicator; `what` names the call in the errors.
    pub fn with<R>(&self, what: &str, f: impl FnOnce(&dyn Communicator) -> Result<R>) -> Result<R> {
        if std::thread::current().id() != self.owner {
            return Err(Error::Config(format!(
                "{what} is a collective of every rank and needs the communicator, \
                 which lives on the thread that built the Accelerator: call it on that thread"
            )));
        }
        let comm = self.comm.upgrade().ok_or_else(|| {
            Error::Config(format!(
                "{what} after the Accelerator was dropped: it is a collective and \
                 needs the Accelerator's communicator"
            ))
        })?;
        f(comm.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::LocalCommunicator;

    #[test]
    fn refuses_other_threads_and_a_dropped_communicator() {
        let comm: Arc<dyn Communicator> =
            Arc::from(Box::new(LocalCommunicator::new()) as Box<dyn crate::comm::Communicator>);
        let link = CommLink::new(&comm);
        assert_eq!(link.with("x", |c| Ok(c.world_size())).unwrap(), 1);
        let err = std::thread::scope(|s| {
            s.spawn(|| link.with("optimizer.step()", |c| Ok(c.world_size())))
                .join()
                .unwrap()
        })
        .unwrap_err();
        assert!(err.to_string().contains("thread that built"), "{err}");
        drop(comm);
        let err = link.with("optimizer.step()", |_| Ok(())).unwrap_err();
        assert!(err.to_string().contains("dropped"), "{err}");
    }
}
