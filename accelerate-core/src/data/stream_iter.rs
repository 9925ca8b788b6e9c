//! Iteration over one rank's batches of one epoch of a stream: one reader thread, `num_workers`
//! transforming threads, batches handed out in stream order.
//!
//! The reader reads the stream in order and cuts it into this rank's batches
//! ([`StreamSharder`]). For each batch it sends the consumer a slot, a one-batch channel, over a
//! bounded channel of `prefetch` slots (so the order of the slots is the order of the stream),
//! and the batch's records to the workers over a shared queue. A worker transforms the records,
//! collates them, moves the batch to the device and puts it in its slot. The consumer takes the
//! slots in order and waits on each, so the batches come out in stream order whatever worker
//! built them, and the same batches, bit for bit, as with one worker.
//!
//! Dropping the iterator drops the slots: the reader's next send fails and it returns, closing the
//! workers' queue; a worker returns after the batch it is building. Panics in the dataset are
//! caught on the thread they happen on and handed out as errors of the batch they hit.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::Device;

use super::batch::Batch;
use super::epoch_iter::{
    enable_pinned_staging, finish_device_work, order_before_prefetch, panic_message,
};
use super::iterable::IterableDataset;
use super::plan::BatchPlan;
use super::progress::LoaderProgress;
use super::stream_shard::{RankBatch, StreamSharder};
use crate::error::{Error, Result};

/// What a [`StreamIter`] needs to know; assembled by the streaming loader.
pub(crate) struct StreamSpec<S: IterableDataset> {
    pub dataset: Arc<S>,
    pub device: Device,
    pub epoch: u64,
    pub rank: usize,
    /// The layout of the batches: batch size, world size and drop_last (its length is unused).
    pub plan: BatchPlan,
    /// Batches skipped at the start of the epoch (resume): counted in the stream, not built.
    pub skip: usize,
    /// How many batches past the one handed out the reader must have seen (at least 1).
    pub lookahead: usize,
    pub num_workers: usize,
    /// Batches (built or being built) allowed to wait ahead of the consumer.
    pub prefetch: usize,
    pub batch_timeout: Duration,
    pub progress: Arc<LoaderProgress>,
}

/// One step of the stream as the reader reports it to the consumer, in order.
enum Message<B> {
    /// The next batch: a worker puts it in `batch`.
    Slot {
        /// The batch's index in this rank's epoch.
        index: usize,
        stream_len: Option<usize>,
        batch: Receiver<Result<B>>,
    },
    /// The stream has ended after `stream_len` records.
    End { stream_len: usize },
    /// Reading the stream failed.
    Failed(Error),
}

/// A batch's records on their way to a worker, and where the worker puts the batch.
struct Job<R, B> {
    records: Vec<R>,
    result: SyncSender<Result<B>>,
}

/// Iterator over this rank's batches of one epoch of a stream; see
/// [`StreamingLoader::iter_epoch`](super::StreamingLoader::iter_epoch).
///
/// After an error item the iteration ends. Dropping the iterator stops its threads after the
/// record or batch each is on.
pub struct StreamIter<S: IterableDataset> {
    messages: Option<Receiver<Message<S::Batch>>>,
    failed: Option<Error>,
    progress: Arc<LoaderProgress>,
    /// The progress's generation when this iteration started.
    generation: u64,
    plan: BatchPlan,
    epoch: u64,
    rank: usize,
    /// Index within the epoch of the next batch to hand out.
    next: usize,
    batch_timeout: Duration,
    finished: bool,
}

impl<S: IterableDataset> StreamIter<S> {
    pub(crate) fn start(spec: StreamSpec<S>) -> Self {
        spec.progress.start_stream_epoch(spec.epoch, spec.skip);
        let mut iter = Self {
            messages: None,
            failed: None,
            generation: spec.progress.generation(),
            progress: spec.progress.clone(),
            plan: spec.plan,
            epoch: spec.epoch,
            rank: spec.rank,
            next: spec.skip,
            batch_timeout: spec.batch_timeout,
            finished: false,
        };
        match spawn(spec) {
            Ok(messages) => iter.messages = Some(messages),
            Err(e) => iter.failed = Some(e),
        }
        iter
    }

    /// An iterator whose only item is `error` (an invalid configuration).
    pub(crate) fn failed(
        error: Error,
        epoch: u64,
        rank: usize,
        plan: BatchPlan,
        progress: Arc<LoaderProgress>,
    ) -> Self {
        Self {
            messages: None,
            failed: Some(error),
            // It started no iteration, so it ends none.
            generation: u64::MAX,
            progress,
            plan,
            epoch,
            rank,
            next: 0,
            batch_timeout: Duration::ZERO,
            finished: false,
        }
    }

    /// The epoch being iterated.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Batches of the epoch handed out so far on this rank, skipped ones included: the position to
    /// resume from.
    pub fn position(&self) -> usize {
        self.next
    }

    pub(crate) fn progress_handle(&self) -> &Arc<LoaderProgress> {
        &self.progress
    }

    /// The end of the stream is known: publish the plan of its length (the batches per epoch, and
    /// what `gather_for_metrics` drops).
    fn publish_length(&self, stream_len: usize) {
        let plan = BatchPlan::unchecked(stream_len, self.plan.batch_size(), self.plan.world_size())
            .with_drop_last(self.plan.drop_last());
        self.progress.set_plan(plan);
    }

    fn fail(&mut self, error: Error) -> Option<Result<S::Batch>> {
        self.finished = true;
        Some(Err(error))
    }

    fn timeout(&self, what: &str) -> Error {
        Error::Timeout {
            what: format!(
                "batch {} of epoch {} on rank {} from the streaming loader's {what}",
                self.next, self.epoch, self.rank
            ),
            after: self.batch_timeout,
            hint: "reading or transforming the stream is slow or stuck; raise the limit with \
                   StreamingLoader::batch_timeout"
                .into(),
        }
    }
}

impl<S: IterableDataset> Drop for StreamIter<S> {
    fn drop(&mut self) {
        // Left with `break`, `take` or an error: the loop is no longer inside this loader (as
        // for a map-style loader's `EpochIter`).
        self.progress.end_iteration_of(self.generation);
    }
}

impl<S: IterableDataset> Iterator for StreamIter<S> {
    type Item = Result<S::Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.finished {
            return None;
        }
        if let Some(e) = self.failed.take() {
            return self.fail(e);
        }
        let received = self.messages.as_ref()?.recv_timeout(self.batch_timeout);
        let message = match received {
            Ok(message) => message,
            Err(RecvTimeoutError::Timeout) => return self.fail(self.timeout("reader")),
            Err(RecvTimeoutError::Disconnected) => {
                let e = Error::Data(format!(
                    "the streaming loader's reader stopped before batch {} of epoch {} on rank {}",
                    self.next, self.epoch, self.rank
                ));
                return self.fail(e);
            }
        };
        match message {
            Message::Slot {
                index,
                stream_len,
                batch,
            } => match batch.recv_timeout(self.batch_timeout) {
                Ok(Ok(batch)) => {
                    debug_assert_eq!(index, self.next, "the reader sends the slots in order");
                    if let Some(len) = stream_len {
                        self.publish_length(len);
                    }
                    self.next += 1;
                    self.progress.record_yielded(self.next);
                    Some(Ok(batch))
                }
                Ok(Err(e)) => self.fail(e),
                Err(RecvTimeoutError::Timeout) => self.fail(self.timeout("workers")),
                Err(RecvTimeoutError::Disconnected) => {
                    let e = Error::Data(format!(
                        "the streaming loader's workers stopped before building batch {} of \
                         epoch {} on rank {}",
                        self.next, self.epoch, self.rank
                    ));
                    self.fail(e)
                }
            },
            Message::End { stream_len } => {
                self.publish_length(stream_len);
                self.finished = true;
                self.progress.end_iteration();
                None
            }
            Message::Failed(e) => self.fail(e),
        }
    }
}

/// Starts the reader and the workers of one epoch; returns the consumer's end of the slots.
fn spawn<S: IterableDataset>(spec: StreamSpec<S>) -> Result<Receiver<Message<S::Batch>>> {
    order_before_prefetch(&spec.device)?;
    let (messages, slots) = mpsc::sync_channel(spec.prefetch.max(1));
    let (work, queue) = mpsc::sync_channel::<Job<S::Record, S::Batch>>(spec.num_workers);
    let queue = Arc::new(Mutex::new(queue));
    let cannot_start = |e: std::io::Error| {
        Error::Data(format!(
            "cannot start the streaming loader's threads: {e}; use fewer num_workers"
        ))
    };
    for worker in 0..spec.num_workers {
        let (dataset, device, queue) = (spec.dataset.clone(), spec.device.clone(), queue.clone());
        std::thread::Builder::new()
            .name(format!(
                "accelerate-stream-rank{}-worker{worker}",
                spec.rank
            ))
            .spawn(move || transform_jobs(dataset.as_ref(), &device, &queue))
            .map_err(cannot_start)?;
    }
    let sharder = StreamSharder::new(
        spec.plan.batch_size(),
        spec.plan.world_size(),
        spec.rank,
        spec.plan.drop_last(),
        spec.skip,
        spec.lookahead,
    );
    let (dataset, epoch, rank) = (spec.dataset, spec.epoch, spec.rank);
    std::thread::Builder::new()
        .name(format!("accelerate-stream-rank{rank}-reader"))
        .spawn(move || {
            let read = catch_unwind(AssertUnwindSafe(|| {
                read_stream(dataset.as_ref(), epoch, sharder, &messages, &work)
            }));
            let last = match read {
                Ok(Ok(Some(stream_len))) => Message::End { stream_len },
                Ok(Ok(None)) => return, // the consumer is gone
                Ok(Err(e)) => Message::Failed(e),
                Err(panic) => Message::Failed(Error::Data(format!(
                    "reading the stream of epoch {epoch} on rank {rank} panicked: {}",
                    panic_message(panic.as_ref())
                ))),
            };
            let _ = messages.send(last);
        })
        .map_err(cannot_start)?;
    Ok(slots)
}

/// The reader: the stream's records into this rank's batches, each sent to the consumer as a slot
/// and to the workers as a job. `Ok(Some(length))` at the end of the stream, `Ok(None)` when the
/// consumer is gone.
fn read_stream<S: IterableDataset>(
    dataset: &S,
    epoch: u64,
    mut sharder: StreamSharder<S::Record>,
    messages: &SyncSender<Message<S::Batch>>,
    work: &SyncSender<Job<S::Record, S::Batch>>,
) -> Result<Option<usize>> {
    let dispatch = |batch: RankBatch<S::Record>| {
        let (result, slot) = mpsc::sync_channel(1);
        let message = Message::Slot {
            index: batch.index,
            stream_len: batch.stream_len,
            batch: slot,
        };
        messages.send(message).is_ok()
            && work
                .send(Job {
                    records: batch.records,
                    result,
                })
                .is_ok()
    };
    for record in dataset.records(epoch)? {
        for batch in sharder.push(record?) {
            if !dispatch(batch) {
                return Ok(None);
            }
        }
    }
    let (rest, stream_len) = sharder.finish()?;
    for batch in rest {
        if !dispatch(batch) {
            return Ok(None);
        }
    }
    Ok(Some(stream_len))
}

/// A worker: builds the batches of the jobs it takes until the queue closes.
fn transform_jobs<S: IterableDataset>(
    dataset: &S,
    device: &Device,
    queue: &Mutex<Receiver<Job<S::Record, S::Batch>>>,
) {
    enable_pinned_staging();
    loop {
        let job = queue.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok(job) = job else { return };
        let built = catch_unwind(AssertUnwindSafe(|| build(dataset, job.records, device)))
            .unwrap_or_else(|panic| {
                Err(Error::Data(format!(
                    "a streaming loader worker panicked transforming a batch: {}",
                    panic_message(panic.as_ref())
                )))
            });
        // The consumer may be gone (the iterator was dropped): nothing to do then.
        let _ = job.result.send(built);
    }
}

fn build<S: IterableDataset>(
    dataset: &S,
    records: Vec<S::Record>,
    device: &Device,
) -> Result<S::Batch> {
    let items = records
        .into_iter()
        .map(|r| dataset.transform(r))
        .collect::<Result<Vec<_>>>()?;
    let batch = dataset.collate(items)?.to_device(device)?;
    finish_device_work(device)?;
    Ok(batch)
}
