//! Iteration over one rank's batches of one epoch, built ahead on a background thread.
//!
//! The prefetch thread gathers each batch ([`Dataset::get_batch`]) and moves it to the device
//! (through pinned memory when that is a GPU), waits for the copy to complete (see
//! `finish_device_work`), then sends it over a bounded channel of `prefetch` slots, so at most
//! that many finished batches wait in memory. Dropping the iterator drops the receiving end: a
//! producer blocked on a full channel wakes with an error and returns, one busy building a batch
//! returns right after it.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use candle_core::Device;

use super::batch::Batch;
use super::dataset::Dataset;
use super::progress::LoaderProgress;
use crate::error::{Error, Result};

/// What an [`EpochIter`] needs to know; assembled by the data loader.
pub(crate) struct EpochSpec<D: Dataset> {
    pub dataset: Arc<D>,
    pub device: Device,
    /// This rank's batches of the epoch that remain after the skipped ones.
    pub batches: Vec<Vec<usize>>,
    pub epoch: u64,
    pub rank: usize,
    /// Batches skipped at the start of the epoch (resume).
    pub skip: usize,
    /// This rank's batches per epoch, skipped ones included.
    pub batches_per_epoch: usize,
    /// Finished batches allowed to wait in the channel; 0 builds batches on the calling thread.
    pub prefetch: usize,
    /// Longest wait for one batch from the prefetch thread.
    pub batch_timeout: Duration,
    pub progress: Arc<LoaderProgress>,
}

/// Iterator over this rank's batches of one epoch; see
/// [`DataLoader::iter_epoch`](super::DataLoader::iter_epoch).
///
/// After an error item the iteration ends. Dropping the iterator stops its prefetch thread.
pub struct EpochIter<D: Dataset> {
    source: Source<D>,
    progress: Arc<LoaderProgress>,
    /// The progress's generation when this iteration started.
    generation: u64,
    epoch: u64,
    rank: usize,
    /// Index within the epoch of the next batch to hand out.
    next: usize,
    end: usize,
    batch_timeout: Duration,
    finished: bool,
}

enum Source<D: Dataset> {
    /// No prefetch: batches are built on the consumer's thread when asked for.
    Inline {
        dataset: Arc<D>,
        device: Device,
        batches: std::vec::IntoIter<Vec<usize>>,
    },
    /// Batches are built ahead on a background thread.
    Prefetch(Prefetcher<D::Batch>),
    /// The iteration could not start; the error is its only item.
    Failed(Option<Error>),
}

struct Prefetcher<B> {
    batches: Option<Receiver<Result<B>>>,
    /// Disconnects when the thread has returned (its sender is dropped last).
    done: Receiver<()>,
    thread: Option<JoinHandle<()>>,
}

impl<D: Dataset> EpochIter<D> {
    pub(crate) fn start(spec: EpochSpec<D>) -> Self {
        spec.progress
            .start_epoch(spec.epoch, spec.skip, spec.batches_per_epoch);
        let end = spec.skip + spec.batches.len();
        let source = if spec.prefetch == 0 {
            Source::Inline {
                dataset: spec.dataset,
                device: spec.device,
                batches: spec.batches.into_iter(),
            }
        } else if let Err(e) = order_before_prefetch(&spec.device) {
            Source::Failed(Some(e))
        } else {
            match spawn_prefetcher(
                spec.dataset,
                spec.device,
                spec.batches,
                spec.prefetch,
                spec.rank,
            ) {
                Ok(prefetcher) => Source::Prefetch(prefetcher),
                Err(e) => Source::Failed(Some(e)),
            }
        };
        Self {
            source,
            generation: spec.progress.generation(),
            progress: spec.progress,
            epoch: spec.epoch,
            rank: spec.rank,
            next: spec.skip,
            end,
            batch_timeout: spec.batch_timeout,
            finished: false,
        }
    }

    /// An iterator whose only item is `error` (an invalid configuration or resume position).
    pub(crate) fn failed(
        error: Error,
        epoch: u64,
        rank: usize,
        progress: Arc<LoaderProgress>,
    ) -> Self {
        Self {
            source: Source::Failed(Some(error)),
            // It started no iteration, so it ends none.
            generation: u64::MAX,
            progress,
            epoch,
            rank,
            next: 0,
            end: 0,
            batch_timeout: Duration::ZERO,
            finished: false,
        }
    }

    /// The epoch being iterated.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub(crate) fn progress_handle(&self) -> &Arc<LoaderProgress> {
        &self.progress
    }

    /// Batches of the epoch handed out so far on this rank, skipped ones included: the position to
    /// resume from.
    pub fn position(&self) -> usize {
        self.next
    }

    fn next_batch(&mut self) -> Option<Result<D::Batch>> {
        let batch_timeout = self.batch_timeout;
        let (epoch, rank, index) = (self.epoch, self.rank, self.next);
        match &mut self.source {
            Source::Failed(error) => error.take().map(Err),
            Source::Inline {
                dataset,
                device,
                batches,
            } => {
                let indices = batches.next()?;
                Some(build_batch(dataset.as_ref(), &indices, device))
            }
            Source::Prefetch(prefetcher) => {
                if index >= self.end {
                    return None;
                }
                let receiver = prefetcher.batches.as_ref()?;
                match receiver.recv_timeout(batch_timeout) {
                    Ok(batch) => Some(batch),
                    Err(RecvTimeoutError::Timeout) => Some(Err(Error::Timeout {
                        what: format!(
                            "batch {index} of epoch {epoch} on rank {rank} from the data loader's \
                             prefetch thread"
                        ),
                        after: batch_timeout,
                        hint: "Dataset::get_batch is slow or stuck; raise the limit with \
                               DataLoader::batch_timeout"
                            .into(),
                    })),
                    Err(RecvTimeoutError::Disconnected) => {
                        let cause = prefetcher.stop(batch_timeout);
                        Some(Err(Error::Data(format!(
                            "the data loader's prefetch thread stopped before batch {index} of \
                             epoch {epoch} on rank {rank}: {cause}"
                        ))))
                    }
                }
            }
        }
    }
}

impl<D: Dataset> Iterator for EpochIter<D> {
    type Item = Result<D::Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.finished {
            return None;
        }
        let item = self.next_batch();
        match &item {
            Some(Ok(_)) => {
                self.next += 1;
                self.progress.record_yielded(self.next);
            }
            Some(Err(_)) => self.finished = true,
            None => {
                self.finished = true;
                self.progress.end_iteration();
            }
        }
        item
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.finished {
            return (0, Some(0));
        }
        match &self.source {
            Source::Failed(error) => (0, Some(usize::from(error.is_some()))),
            _ => (0, Some(self.end - self.next)),
        }
    }
}

impl<D: Dataset> Drop for EpochIter<D> {
    fn drop(&mut self) {
        // Left with `break`, `take` or an error: the loop is no longer inside this loader.
        self.progress.end_iteration_of(self.generation);
        if let Source::Prefetch(prefetcher) = &mut self.source {
            prefetcher.stop(self.batch_timeout);
        }
    }
}

fn build_batch<D: Dataset>(dataset: &D, indices: &[usize], device: &Device) -> Result<D::Batch> {
    dataset.get_batch(indices)?.to_device(device)
}

fn spawn_prefetcher<D: Dataset>(
    dataset: Arc<D>,
    device: Device,
    batches: Vec<Vec<usize>>,
    depth: usize,
    rank: usize,
) -> Result<Prefetcher<D::Batch>> {
    let (sender, receiver) = mpsc::sync_channel(depth);
    let (done_sender, done) = mpsc::channel::<()>();
    let thread = std::thread::Builder::new()
        .name(format!("accelerate-data-rank{rank}"))
        .spawn(move || {
            // Dropped after `produce` has returned and released the dataset: its disconnection
            // tells the consumer that the thread is finished.
            let _done = done_sender;
            produce(dataset, device, batches, sender);
        })
        .map_err(|e| Error::Data(format!("cannot start the data loader's prefetch thread: {e}; use DataLoader::prefetch(0) to build batches on the calling thread")))?;
    Ok(Prefetcher {
        batches: Some(receiver),
        done,
        thread: Some(thread),
    })
}

/// The prefetch thread: builds the batches in order and sends them until done, until a batch fails
/// (its error is sent, then it stops), or until the receiver is gone.
fn produce<D: Dataset>(
    dataset: Arc<D>,
    device: Device,
    batches: Vec<Vec<usize>>,
    sender: SyncSender<Result<D::Batch>>,
) {
    enable_pinned_staging();
    for indices in batches {
        let batch = build_batch(dataset.as_ref(), &indices, &device).and_then(|batch| {
            finish_device_work(&device)?;
            Ok(batch)
        });
        let failed = batch.is_err();
        if sender.send(batch).is_err() || failed {
            return;
        }
    }
}

/// Waits, on the thread that starts the iteration, for the GPU work it queued so far: a dataset
/// that lives on the GPU was written by kernels and copies on this thread's per-thread stream,
/// and the prefetch thread reads it on its own stream, which nothing orders after this one (see
/// [`finish_device_work`]). Once per epoch, and nothing to wait for on the CPU.
pub(super) fn order_before_prefetch(device: &Device) -> Result<()> {
    if device.is_cpu() {
        return Ok(());
    }
    device.synchronize().map_err(|e| {
        Error::Device(format!(
            "waiting for {:?} before the data loader's prefetch thread starts: {e}",
            device.location()
        ))
    })
}

/// Lets a loader thread stage its host-to-GPU copies through pinned memory (see `pinned`); a
/// no-op without the `cuda` feature.
pub(super) fn enable_pinned_staging() {
    #[cfg(feature = "cuda")]
    super::pinned::enable_on_this_thread();
}

/// Waits on the prefetch thread until the GPU work it queued for a batch has completed: the
/// host-to-device copies, and any kernels `Dataset::get_batch` launched. Only then is the batch
/// sent to the training thread.
///
/// Why a wait here: candle queues this thread's work on its *per-thread* default stream
/// (`CudaContext::per_thread_stream`, CU_STREAM_PER_THREAD), and the training thread's kernels go
/// to its own; nothing orders one stream after the other, so without it a kernel could read the
/// batch's memory before the copy into it has landed (a stale batch).
///
/// Why a host wait on this thread rather than an event the training thread's stream waits on: the
/// wait costs the training thread nothing (this thread is `prefetch` batches ahead, and it only
/// waits for its own stream, never for the training kernels), and once it returns the batch is
/// complete memory that any thread may use or drop. An event would have to travel with every batch
/// and be waited on before *any* use, including a drop: cudarc frees device memory on the stream
/// handle stored in the slice, which for the per-thread stream means the stream of the thread that
/// drops it, so a batch dropped unread (an abandoned epoch) would be freed for reuse while its copy
/// could still be writing. After this wait that free is safe: it is ordered after the training
/// thread's reads on its stream, and CUDA's stream-ordered allocator hands the memory to another
/// stream's allocation only once that free is reached. It also makes the pinned staging buffer
/// reusable at once for the next batch. The price: this thread starts gathering the next batch
/// only once the transfer is done, which matters only where gathering plus copying takes longer
/// than a training step.
pub(super) fn finish_device_work(device: &Device) -> Result<()> {
    let failed = |e: &dyn std::fmt::Display| {
        Error::Device(format!(
            "copying a batch to {:?} on the data loader's prefetch thread failed: {e}",
            device.location()
        ))
    };
    device.synchronize().map_err(|e| failed(&e))?;
    #[cfg(feature = "cuda")]
    super::pinned::release().map_err(|e| failed(&e))?;
    Ok(())
}

impl<B> Prefetcher<B> {
    /// Disconnects the channel and waits (up to `limit`) for the thread to return; describes how it
    /// ended, for error messages.
    fn stop(&mut self, limit: Duration) -> String {
        self.batches = None;
        let Some(thread) = self.thread.take() else {
            return "it had already stopped".into();
        };
        match self.done.recv_timeout(limit) {
            Err(RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    "the data loader's prefetch thread is still building a batch after {limit:?}; \
                     leaving it to finish on its own"
                );
                "it did not finish in time".into()
            }
            // The thread never sends: any wake-up means it has returned.
            _ => match thread.join() {
                Ok(()) => "it ended without sending the batch".into(),
                Err(panic) => format!("it panicked: {}", panic_message(panic.as_ref())),
            },
        }
    }
}

pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".into()
    }
}
