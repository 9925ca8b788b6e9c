//! Moving frames around the ring during one collective.
//!
//! Each rank holds two TCP connections: one to its successor (`next`), one from its predecessor
//! (`prev`). During a collective, a sender thread writes queued frames to `next` while the calling
//! thread reads from `prev` and reduces: receiving chunk `k` from `prev` overlaps with sending
//! earlier chunks to `next`, which is what pipelines the ring. The queue is unbounded on purpose:
//! with a bounded one, every rank could block on a full queue while its sender blocks on a peer
//! that is itself blocked on its queue — a deadlock around the ring. Memory stays bounded by the
//! tensor, since a rank never queues more than it will send in the collective.
//!
//! Failure handling: a closed connection or a silent peer becomes an error naming that peer; the
//! rank that sees it sends an abort frame to `next`, which relays it, so every rank learns which
//! rank failed instead of timing out on its own neighbour. While waiting for its input a rank's
//! sender sends keep-alive frames, so only the successor of a hung rank times out.
//!
//! Sockets time out every survey period, not after the whole limit: each time a wait judges its
//! peers ([`Patience`]). A peer that is gone fails the wait at once; a silent peer that is alive
//! (busy outside the collective) is waited for up to the busy limit.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use super::element::{self, Element};
use super::frame::{
    check_abort_ranks, encode_abort, parse_abort, FrameKind, Header, OpCode, HEADER_BYTES,
    MAX_ABORT_BYTES,
};
use crate::comm::liveness::{Liveness, Patience, Verdict};
use crate::error::{Error, Result};

/// The two ring connections of a rank, and how long it waits on its peers.
#[derive(Debug)]
pub(crate) struct RingLinks {
    /// Connection to `(rank + 1) % world_size`.
    pub to_next: TcpStream,
    /// Connection from `(rank + world_size - 1) % world_size`.
    pub from_prev: TcpStream,
    /// Longest wait on peers that are alive but do not join the collective.
    pub busy: Duration,
    /// The peers' liveness, when the job publishes it.
    pub liveness: Option<Arc<Liveness>>,
}

/// Where a collective sits: who we are and whom we talk to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RingPosition {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Elements per data frame (at least 1).
    pub chunk_elems: usize,
    /// Silence limit: longest wait on a peer that gives no sign of life.
    pub timeout: Duration,
}

impl RingPosition {
    /// The rank we send to.
    pub fn next(&self) -> usize {
        (self.rank + 1) % self.world_size
    }

    /// The rank we receive from.
    pub fn prev(&self) -> usize {
        (self.rank + self.world_size - 1) % self.world_size
    }
}

/// A collective that failed, and the rank held responsible.
#[derive(Debug)]
pub(crate) struct Failure {
    /// The error to return to the caller.
    pub error: Error,
    /// The rank that failed (closed, went silent, misbehaved), when known.
    pub peer: Option<usize>,
}

/// Identifies a collective in its frames.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tag {
    /// Which collective.
    pub op: OpCode,
    /// Element type code.
    pub dtype: u8,
    /// Sequence number on this communicator.
    pub seq: u64,
}

/// Frame buffers kept between collectives, so steady-state collectives allocate (and fault in)
/// no fresh memory for their frames.
pub(crate) type FramePool = Vec<Vec<u8>>;

/// Most frame buffers kept in a [`FramePool`] (16 x 512 KiB with the default chunk size).
const MAX_POOLED_FRAMES: usize = 16;

enum Outgoing {
    Data(Vec<u8>),
    Abort {
        failed: usize,
        reporter: usize,
        reason: String,
    },
}

/// The calling thread's side of a running collective.
pub(crate) struct Session<'a> {
    pos: RingPosition,
    tag: Tag,
    reader: &'a mut TcpStream,
    outgoing: mpsc::Sender<Outgoing>,
    /// Frames the sender has written, back for reuse.
    returned: mpsc::Receiver<Vec<u8>>,
    pool: FramePool,
    /// Index of the next data frame expected from `prev` (wraps, like the sender's).
    received: u32,
    buffer: Vec<u8>,
    bytes_sent: u64,
    /// Set by `recv` on failure: who failed, who reported it first, why.
    failure: Option<(usize, usize, String)>,
    busy: Duration,
    liveness: Option<&'a Liveness>,
}

impl Session<'_> {
    /// Where this collective runs.
    pub fn pos(&self) -> RingPosition {
        self.pos
    }

    /// Queues `values` as the next data frame to `next`; returns at once.
    pub fn send<T: Element>(&mut self, values: &[T]) {
        let mut frame = self
            .returned
            .try_recv()
            .ok()
            .or_else(|| self.pool.pop())
            .unwrap_or_default();
        frame.clear();
        frame.resize(HEADER_BYTES, 0);
        element::encode(values, &mut frame);
        self.bytes_sent += (values.len() * T::SIZE) as u64;
        // If the sender thread has stopped, its error is reported when the collective ends.
        let _ = self.outgoing.send(Outgoing::Data(frame));
    }

    /// Receives the next data frame from `prev`, which must hold exactly `bytes` bytes.
    pub fn recv(&mut self, bytes: usize) -> Result<&[u8]> {
        match self.recv_frame(bytes) {
            Ok(()) => Ok(&self.buffer),
            Err(Relay::Detected(failed, error)) => {
                self.failure = Some((failed, self.pos.rank, reason_of(&error)));
                Err(error)
            }
            Err(Relay::Aborted {
                failed,
                reporter,
                reason,
            }) => {
                let me = self.pos.rank;
                let problem = if failed == me {
                    format!(
                        "the other ranks gave up on this rank (rank {me}): {reason} (reported \
                         by rank {reporter})"
                    )
                } else {
                    format!("{reason} (reported by rank {reporter})")
                };
                self.failure = Some((failed, reporter, reason));
                Err(Error::Collective {
                    op: self.tag.op.name(),
                    peer: Some(failed),
                    problem,
                })
            }
        }
    }

    fn recv_frame(&mut self, bytes: usize) -> std::result::Result<(), Relay> {
        let prev = self.pos.prev();
        let mut patience = Patience::new(self.liveness, self.pos.timeout, self.busy);
        loop {
            let mut raw = [0u8; HEADER_BYTES];
            self.read_full(&mut raw, &mut patience)?;
            let header = Header::parse(&raw).map_err(|problem| {
                Relay::Detected(
                    prev,
                    self.mismatch(format!("malformed frame header ({problem})")),
                )
            })?;
            match header.kind {
                // The predecessor is alive but has nothing for us: it waits on its own
                // predecessor, whose successor reports first (see `Patience::peer_waits_too`).
                FrameKind::KeepAlive => patience.peer_waits_too(),
                FrameKind::Abort => return Err(self.read_abort(&header, &mut patience)),
                FrameKind::Data => {
                    if header.op != self.tag.op.code()
                        || header.dtype != self.tag.dtype
                        || header.seq != self.tag.seq
                        || header.index != self.received
                        || header.len != bytes as u64
                    {
                        let problem = format!(
                            "rank {prev} sent frame {} of {} #{} ({}, {} bytes) where frame {} \
                             of {} #{} ({}, {bytes} bytes) was expected; every rank must \
                             call the same collectives in the same order with tensors of the \
                             same shape and dtype{}",
                            header.index,
                            OpCode::describe(header.op),
                            header.seq,
                            element::describe_code(header.dtype),
                            header.len,
                            self.received,
                            OpCode::describe(self.tag.op.code()),
                            self.tag.seq,
                            element::describe_code(self.tag.dtype),
                            self.explain(prev),
                        );
                        return Err(Relay::Detected(prev, self.mismatch(problem)));
                    }
                    let mut buffer = std::mem::take(&mut self.buffer);
                    buffer.resize(bytes, 0);
                    let read = self.read_full(&mut buffer, &mut patience);
                    self.buffer = buffer;
                    read?;
                    self.received = self.received.wrapping_add(1);
                    return Ok(());
                }
            }
        }
    }

    /// Fills `buf` from `prev`, judging the peers each time the socket's read times out (every
    /// survey period).
    fn read_full(
        &mut self,
        buf: &mut [u8],
        patience: &mut Patience<'_>,
    ) -> std::result::Result<(), Relay> {
        let prev = self.pos.prev();
        let mut filled = 0;
        while filled < buf.len() {
            match self.reader.read(&mut buf[filled..]) {
                Ok(0) => {
                    let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                    return Err(Relay::Detected(prev, self.read_error(eof)));
                }
                Ok(n) => {
                    filled += n;
                    patience.heard_from_peer();
                }
                Err(e) if is_timeout(e.kind()) => match patience.judge(Some(prev)) {
                    Verdict::Wait => {}
                    verdict => {
                        let (peer, error) = self.verdict_error(verdict, prev);
                        return Err(Relay::Detected(peer, error));
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Relay::Detected(prev, self.read_error(e))),
            }
        }
        Ok(())
    }

    /// The error for a wait on `prev` that `verdict` ended, and the rank held responsible.
    fn verdict_error(&self, verdict: Verdict, prev: usize) -> (usize, Error) {
        let name = self.tag.op.name();
        let seq = self.tag.seq;
        verdict_error(verdict, prev, name, seq, self.liveness, "send data")
    }

    /// What the liveness records tell about why `peer` and this rank parted ways.
    fn explain(&self, peer: usize) -> String {
        self.liveness.map(|l| l.explain(peer)).unwrap_or_default()
    }

    fn read_abort(&mut self, header: &Header, patience: &mut Patience<'_>) -> Relay {
        let prev = self.pos.prev();
        if header.len < 8 || header.len > MAX_ABORT_BYTES as u64 {
            let problem = format!("abort frame with a payload of {} bytes", header.len);
            return Relay::Detected(prev, self.mismatch(problem));
        }
        let mut payload = vec![0u8; header.len as usize];
        if let Err(relay) = self.read_full(&mut payload, patience) {
            return relay;
        }
        let parsed = parse_abort(&payload).and_then(|(reporter, reason)| {
            check_abort_ranks(header.index as u64, reporter, self.pos.world_size)?;
            Ok((reporter, reason))
        });
        match parsed {
            Ok((reporter, reason)) => Relay::Aborted {
                failed: header.index as usize,
                reporter: reporter as usize,
                reason,
            },
            Err(problem) => Relay::Detected(prev, self.mismatch(problem)),
        }
    }

    fn read_error(&self, e: std::io::Error) -> Error {
        let prev = self.pos.prev();
        let name = self.tag.op.name();
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::Timeout {
                what: format!("rank {prev} in {name} #{} (it sent nothing)", self.tag.seq),
                after: self.pos.timeout,
                hint: format!(
                    "rank {prev} may have hung or crashed, or not have called this collective \
                     (every rank must call the same collectives in the same order); {}",
                    timeout_hint()
                ),
            },
            kind if is_disconnect(kind) => Error::Collective {
                op: name,
                peer: Some(prev),
                problem: format!(
                    "rank {prev} closed its connection during {name} #{}: the process exited \
                     or dropped its communicator{}",
                    self.tag.seq,
                    self.explain(prev)
                ),
            },
            _ => Error::Collective {
                op: name,
                peer: Some(prev),
                problem: format!("receiving from rank {prev} failed: {e}"),
            },
        }
    }

    fn mismatch(&self, problem: String) -> Error {
        Error::Collective {
            op: self.tag.op.name(),
            peer: Some(self.pos.prev()),
            problem: format!("protocol mismatch: {problem}"),
        }
    }
}

/// How a receive failed.
enum Relay {
    /// This rank saw `prev` (or the rank given) fail.
    Detected(usize, Error),
    /// Another rank's failure report arrived.
    Aborted {
        failed: usize,
        reporter: usize,
        reason: String,
    },
}

/// The part of an error worth relaying to the other ranks (without this rank's framing).
fn reason_of(error: &Error) -> String {
    match error {
        Error::Collective { problem, .. } => problem.clone(),
        other => other.to_string(),
    }
}

fn is_timeout(kind: std::io::ErrorKind) -> bool {
    matches!(
        kind,
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// The error for a wait on `awaited` (to `what`, e.g. "send data") in collective `name` #`seq`
/// that `verdict` ended, and the rank held responsible.
pub(crate) fn verdict_error(
    verdict: Verdict,
    awaited: usize,
    name: &'static str,
    seq: u64,
    liveness: Option<&Liveness>,
    what: &str,
) -> (usize, Error) {
    let explain = |peer: usize| liveness.map(|l| l.explain(peer)).unwrap_or_default();
    match verdict {
        Verdict::Wait => unreachable!("a wait that goes on has no error"),
        Verdict::Gone { peer, why } => (
            peer,
            Error::Collective {
                op: name,
                peer: Some(peer),
                problem: format!(
                    "rank {peer} {why} while this rank waited for rank {awaited} in {name} \
                     #{seq}; the job has to be restarted{}",
                    explain(peer)
                ),
            },
        ),
        Verdict::Silent { peer, after } => (
            peer,
            Error::Timeout {
                what: format!(
                    "rank {peer} to {what} in {name} #{seq} (it gave no sign of life: no data, \
                     no heartbeat{})",
                    explain(peer)
                ),
                after,
                hint: format!(
                    "rank {peer} or its machine may have crashed or hung; {}",
                    timeout_hint()
                ),
            },
        ),
        Verdict::Busy { after, activity } => {
            let doing = activity.map_or(String::new(), |a| format!(", {a}"));
            (
                awaited,
                Error::Timeout {
                    what: format!(
                        "rank {awaited} to {what} in {name} #{seq} (it is alive{doing}, but did \
                         not take part{})",
                        explain(awaited)
                    ),
                    after,
                    hint: format!(
                        "rank {awaited} may have hung, be busy outside the collective for longer \
                         than that, or not have called this collective (every rank must call the \
                         same collectives in the same order); {}",
                        busy_hint()
                    ),
                },
            )
        }
    }
}

/// What a timeout on a live but busy peer suggests.
pub(crate) fn busy_hint() -> String {
    format!(
        "if it is only busy, raise the limit with {}=<seconds> or CpuCommOptions::busy_timeout",
        crate::env::BUSY_PEER_TIMEOUT
    )
}

fn is_disconnect(kind: std::io::ErrorKind) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        kind,
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected
    )
}

/// What a timeout error suggests.
pub(crate) fn timeout_hint() -> String {
    format!(
        "if it is only slow, raise the limit with {}=<seconds> or CpuCommOptions::timeout",
        crate::env::COLLECTIVE_TIMEOUT
    )
}

/// How often an idle sender says it is alive: often enough that a peer's timeout never expires
/// on a live rank, rarely enough to cost nothing.
fn keepalive_interval(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(5))
}

/// Runs one collective: spawns the sender thread, runs `body` with the receiving side, and on
/// failure sends an abort frame to `next` so the failure travels around the ring.
///
/// Returns the body's result and the payload bytes queued for sending.
pub(crate) fn run_collective<R>(
    links: &mut RingLinks,
    pool: &mut FramePool,
    pos: RingPosition,
    tag: Tag,
    body: impl FnOnce(&mut Session<'_>) -> Result<R>,
) -> (std::result::Result<R, Failure>, u64) {
    let op = tag.op;
    let aborting = AtomicBool::new(false);
    let (outgoing, queue) = mpsc::channel::<Outgoing>();
    let (give_back, returned) = mpsc::channel::<Vec<u8>>();
    let RingLinks {
        to_next,
        from_prev,
        busy,
        liveness,
    } = links;
    let (busy, liveness) = (*busy, liveness.as_deref());
    if let Some(l) = liveness {
        l.entered(op.name(), tag.seq);
    }
    let outcome = std::thread::scope(|scope| {
        let aborting = &aborting;
        let sending = Sending {
            aborting,
            pos,
            tag,
            busy,
            liveness,
        };
        let sender = scope.spawn(move || send_loop(to_next, queue, give_back, sending));
        let mut session = Session {
            pos,
            tag,
            reader: from_prev,
            outgoing,
            returned,
            pool: std::mem::take(pool),
            received: 0,
            buffer: Vec::new(),
            bytes_sent: 0,
            failure: None,
            busy,
            liveness,
        };
        let result = body(&mut session);
        let bytes_sent = session.bytes_sent;
        let result = match result {
            Ok(value) => Ok(value),
            Err(error) => {
                let (failed, reporter, reason) = session
                    .failure
                    .take()
                    .unwrap_or_else(|| (pos.rank, pos.rank, reason_of(&error)));
                aborting.store(true, Ordering::SeqCst);
                let _ = session.outgoing.send(Outgoing::Abort {
                    failed,
                    reporter,
                    reason,
                });
                Err(Failure {
                    error,
                    peer: Some(failed),
                })
            }
        };
        let Session {
            outgoing,
            returned,
            pool: mut kept,
            ..
        } = session;
        drop(outgoing); // closes the queue: the sender finishes what is queued and stops
        let sent = sender.join().unwrap_or_else(|_| {
            Err(Error::Collective {
                op: op.name(),
                peer: None,
                problem: "the sender thread panicked".into(),
            })
        });
        let result = match (result, sent) {
            (Err(failure), _) => Err(failure),
            (Ok(_), Err(error)) => Err(Failure {
                error,
                peer: Some(pos.next()),
            }),
            (Ok(value), Ok(())) => Ok(value),
        };
        kept.extend(returned.try_iter());
        kept.truncate(MAX_POOLED_FRAMES);
        *pool = kept;
        (result, bytes_sent)
    });
    if let Some(l) = liveness {
        l.finished();
    }
    outcome
}

/// What the sender thread of a collective needs besides its connection and queues.
#[derive(Clone, Copy)]
struct Sending<'a> {
    aborting: &'a AtomicBool,
    pos: RingPosition,
    tag: Tag,
    busy: Duration,
    liveness: Option<&'a Liveness>,
}

fn send_loop(
    stream: &mut TcpStream,
    queue: mpsc::Receiver<Outgoing>,
    give_back: mpsc::Sender<Vec<u8>>,
    sending: Sending<'_>,
) -> Result<()> {
    let Sending {
        aborting,
        pos,
        tag,
        busy,
        liveness,
    } = sending;
    let Tag { op, dtype, seq } = tag;
    let next = pos.next();
    let write_error = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::Timeout {
            what: format!(
                "rank {next} to accept data in {} #{seq} (it stopped reading)",
                op.name()
            ),
            after: pos.timeout,
            hint: format!(
                "rank {next} may have hung or not have called this collective; {}",
                timeout_hint()
            ),
        },
        kind if is_disconnect(kind) => Error::Collective {
            op: op.name(),
            peer: Some(next),
            problem: format!(
                "rank {next} closed its connection during {} #{seq}: the process exited or \
                 dropped its communicator",
                op.name()
            ),
        },
        _ => Error::Collective {
            op: op.name(),
            peer: Some(next),
            problem: format!("sending to rank {next} failed: {e}"),
        },
    };
    let header = |kind, index: u32, len: usize| Header {
        kind,
        op: op.code(),
        dtype,
        index,
        seq,
        len: len as u64,
    };
    // Writes block when `next` does not read (busy outside the collective, with the socket
    // buffers full): judge it each time the write times out, as the receiving side does.
    let write_all = |stream: &mut TcpStream, bytes: &[u8]| -> Result<()> {
        let mut patience = Patience::new(liveness, pos.timeout, busy);
        let mut written = 0;
        while written < bytes.len() {
            match stream.write(&bytes[written..]) {
                Ok(0) => return Err(write_error(std::io::ErrorKind::WriteZero.into())),
                Ok(n) => {
                    written += n;
                    patience.heard_from_peer();
                }
                Err(e) if is_timeout(e.kind()) => match patience.judge(Some(next)) {
                    Verdict::Wait => {}
                    verdict => {
                        let what = "accept data (it stopped reading)";
                        return Err(verdict_error(verdict, next, op.name(), seq, liveness, what).1);
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(write_error(e)),
            }
        }
        Ok(())
    };
    let interval = keepalive_interval(pos.timeout);
    let mut index = 0u32;
    loop {
        match queue.recv_timeout(interval) {
            Ok(Outgoing::Data(mut frame)) => {
                if aborting.load(Ordering::SeqCst) {
                    continue; // the collective failed: skip to the abort frame
                }
                header(FrameKind::Data, index, frame.len() - HEADER_BYTES).write(&mut frame);
                write_all(stream, &frame)?;
                index = index.wrapping_add(1);
                let _ = give_back.send(frame);
            }
            Ok(Outgoing::Abort {
                failed,
                reporter,
                reason,
            }) => {
                let payload = encode_abort(reporter as u64, &reason);
                let mut frame = vec![0u8; HEADER_BYTES];
                header(FrameKind::Abort, failed as u32, payload.len()).write(&mut frame);
                frame.extend_from_slice(&payload);
                // Best effort: `next` may be the rank that failed.
                let _ = stream.write_all(&frame);
                return Ok(());
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let mut frame = [0u8; HEADER_BYTES];
                header(FrameKind::KeepAlive, 0, 0).write(&mut frame);
                write_all(stream, &frame)?;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
        }
    }
}
