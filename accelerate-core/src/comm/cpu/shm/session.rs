//! One rank's side of the shared mapping, and the running of one collective over it.
//!
//! Collectives proceed in rounds numbered from the creation of the mapping; every rank runs the
//! same rounds, so the numbers agree. In round `g` a rank uses staging half `g % 2` of its slot;
//! it writes that half only after every other rank has finished reading its round `g - 2` (the
//! previous use of the half), which lets a rank fill one half while the others read the other.
//!
//! Waiting: check the peer's counter, spin briefly (the peer is usually a few microseconds
//! away), then sleep on the counter with a futex in slices. Between slices the waiter checks the
//! abort record, whether the peer left (dropped its communicator) or its process died, whether
//! another rank crashed, and the busy limit: a peer whose process runs is alive, so it is waited
//! for up to the busy limit however long it stays outside the collective. A rank that fails
//! posts an abort record naming the culprit and wakes everyone, so every rank reports the same
//! culprit instead of timing out on its own.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::futex;
use super::region::{Counter, Region, ABORT_NONE, ABORT_POSTED, ABORT_WRITING};
use crate::comm::cpu::element::{self, Element};
use crate::comm::cpu::frame::OpCode;
use crate::comm::cpu::transport::{busy_hint, Failure, Tag};
use crate::comm::host_identity;
use crate::comm::liveness::{Liveness, Patience, Verdict};
use crate::comm::ReduceOp;
use crate::error::{Error, Result};

/// How long a waiter spins before sleeping: a few round trips between cores, short enough not
/// to steal a core from compute threads for long.
const SPIN: Duration = Duration::from_micros(30);
/// How often a sleeping waiter re-checks that the peer is alive (and the abort record).
const LIVENESS_PERIOD: Duration = Duration::from_millis(100);
/// Elements reduced per block: the accumulator stays in L1.
const REDUCE_BLOCK: usize = 1024;

/// This rank's attachment to the shared mapping, kept for the communicator's lifetime.
#[derive(Debug)]
pub(crate) struct ShmLinks {
    region: Region,
    rank: usize,
    /// Rounds run so far; the same number on every rank between collectives.
    rounds: u64,
    /// Longest wait on peers that are alive but do not join the collective.
    busy: Duration,
    /// The peers' liveness, when the job publishes it (for other causes and explanations).
    liveness: Option<Arc<Liveness>>,
}

impl ShmLinks {
    /// Attaches `rank` to `region`, whose control block already holds this process's pid; waits
    /// on live peers up to `busy`.
    pub(crate) fn new(
        region: Region,
        rank: usize,
        busy: Duration,
        liveness: Option<Arc<Liveness>>,
    ) -> Self {
        Self {
            region,
            rank,
            rounds: 0,
            busy,
            liveness,
        }
    }

    /// The mapping.
    #[cfg(test)]
    pub(crate) fn region(&self) -> &Region {
        &self.region
    }

    /// Runs one collective; returns the body's result and the payload bytes this rank staged
    /// for its peers. On failure, posts the abort record (unless another rank's was read).
    /// `timeout` is the silence limit (see [`crate::comm::CpuCommOptions::timeout`]).
    pub(crate) fn run<R>(
        &mut self,
        tag: Tag,
        timeout: Duration,
        body: impl FnOnce(&mut ShmSession<'_>) -> Result<R>,
    ) -> (std::result::Result<R, Failure>, u64) {
        if let Some(l) = &self.liveness {
            l.entered(tag.op.name(), tag.seq);
        }
        let outcome = self.run_session(tag, timeout, body);
        if let Some(l) = &self.liveness {
            l.finished();
        }
        outcome
    }

    fn run_session<R>(
        &mut self,
        tag: Tag,
        timeout: Duration,
        body: impl FnOnce(&mut ShmSession<'_>) -> Result<R>,
    ) -> (std::result::Result<R, Failure>, u64) {
        let rank = self.rank;
        let mut session = ShmSession {
            busy: self.busy,
            liveness: self.liveness.as_deref(),
            region: &self.region,
            rank,
            world_size: self.region.layout().world_size,
            piece_bytes: self.region.layout().piece_bytes,
            tag,
            timeout,
            rounds: &mut self.rounds,
            shape: Shape::default(),
            bytes_sent: 0,
            failure: None,
        };
        let result = body(&mut session);
        let bytes_sent = session.bytes_sent;
        let failure = session.failure.take();
        match result {
            Ok(value) => (Ok(value), bytes_sent),
            Err(error) => {
                let (failed, reporter, reason) =
                    failure.unwrap_or_else(|| (rank, rank, reason_of(&error)));
                if reporter == rank {
                    post_abort(&self.region, failed, rank, &reason);
                }
                let failure = Failure {
                    error,
                    peer: Some(failed),
                };
                (Err(failure), bytes_sent)
            }
        }
    }
}

impl Drop for ShmLinks {
    fn drop(&mut self) {
        // Peers blocked on this rank learn at once that it is gone; peers that already have
        // what they need from it are unaffected (they check their counter first).
        self.region.departed(self.rank).store(1, Ordering::SeqCst);
        for counter in Counter::ALL {
            futex::wake_all(self.region.counter(self.rank, counter));
        }
    }
}

/// Posts the abort record (the first poster wins) and wakes every waiter of every rank.
fn post_abort(region: &Region, failed: usize, reporter: usize, reason: &str) {
    let state = region.abort_state();
    if state
        .compare_exchange(
            ABORT_NONE,
            ABORT_WRITING,
            Ordering::SeqCst,
            Ordering::SeqCst,
        )
        .is_ok()
    {
        region.write_abort(failed, reporter, reason);
        state.store(ABORT_POSTED, Ordering::SeqCst);
    }
    for rank in 0..region.layout().world_size {
        for counter in Counter::ALL {
            futex::wake_all(region.counter(rank, counter));
        }
    }
}

/// The part of an error worth relaying to the other ranks (without this rank's framing).
fn reason_of(error: &Error) -> String {
    match error {
        Error::Collective { problem, .. } => problem.clone(),
        other => other.to_string(),
    }
}

/// What every rank must agree on in a collective, besides its kind and dtype.
#[derive(Debug, Clone, Copy, Default)]
struct Shape {
    /// Elements per rank.
    len: u64,
    /// Broadcast root (0 otherwise).
    root: u64,
    /// First round of the collective.
    first_round: u64,
}

/// The round tag: what a rank writes at the start of its staging half before publishing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RoundTag {
    /// Sequence number of the collective on the communicator.
    pub seq: u64,
    /// Round of the job (counts every round of every collective).
    pub round: u64,
    /// Index of the round within its collective.
    pub index: u64,
    /// Elements per rank.
    pub len: u64,
    /// [`OpCode::code`] of the collective.
    pub op: u64,
    /// Element type code.
    pub dtype: u64,
    /// Broadcast root (0 otherwise).
    pub root: u64,
}

impl RoundTag {
    /// The tag as the words written to the staging half (the last one is reserved, 0).
    pub(crate) fn words(self) -> [u64; 8] {
        [
            self.seq, self.round, self.index, self.len, self.op, self.dtype, self.root, 0,
        ]
    }

    /// The tag a peer wrote; every value is possible (a peer in another collective, or of
    /// another version), and [`RoundTag::describe`] must show any of them.
    pub(crate) fn from_words(w: [u64; 8]) -> Self {
        Self {
            seq: w[0],
            round: w[1],
            index: w[2],
            len: w[3],
            op: w[4],
            dtype: w[5],
            root: w[6],
        }
    }

    /// The tag in words, for mismatch errors.
    pub(crate) fn describe(&self) -> String {
        let root = if self.op == OpCode::Broadcast.code() as u64 {
            format!(" from rank {}", self.root)
        } else {
            String::new()
        };
        format!(
            "{}{root} #{} ({}, {} elements), round {} of the job",
            OpCode::describe(self.op as u8),
            self.seq,
            element::describe_code(self.dtype as u8),
            self.len,
            self.round
        )
    }
}

/// The calling rank's side of one running collective.
pub(crate) struct ShmSession<'a> {
    region: &'a Region,
    rank: usize,
    world_size: usize,
    piece_bytes: usize,
    tag: Tag,
    /// Silence limit.
    timeout: Duration,
    busy: Duration,
    liveness: Option<&'a Liveness>,
    rounds: &'a mut u64,
    shape: Shape,
    bytes_sent: u64,
    /// Set on failure: who failed, who reported it first, why.
    failure: Option<(usize, usize, String)>,
}

impl ShmSession<'_> {
    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub(crate) fn world_size(&self) -> usize {
        self.world_size
    }

    /// Elements of type `T` in one piece (one rank's share of a staging half).
    pub(crate) fn piece_elems<T: Element>(&self) -> usize {
        self.piece_bytes / T::SIZE
    }

    /// Elements of type `T` in a whole staging half.
    pub(crate) fn area_elems<T: Element>(&self) -> usize {
        self.world_size * self.piece_elems::<T>()
    }

    /// Starts a collective of `rounds` rounds over `len` elements per rank (`root`: broadcast
    /// root, else 0); returns the number of its first round.
    pub(crate) fn begin(&mut self, len: usize, root: usize, rounds: usize) -> u64 {
        let first_round = *self.rounds;
        *self.rounds += rounds as u64;
        self.shape = Shape {
            len: len as u64,
            root: root as u64,
            first_round,
        };
        first_round
    }

    fn expected_tag(&self, round: u64) -> RoundTag {
        RoundTag {
            seq: self.tag.seq,
            round,
            index: round - self.shape.first_round,
            len: self.shape.len,
            op: self.tag.op.code() as u64,
            dtype: self.tag.dtype as u64,
            root: self.shape.root,
        }
    }

    /// The other ranks, starting after this one (so that ranks do not all wait on rank 0 first).
    pub(crate) fn peers(&self) -> impl Iterator<Item = usize> {
        let (w, r) = (self.world_size, self.rank);
        (1..w).map(move |i| (r + i) % w)
    }

    /// Waits until this rank may write its staging half of `round` (every peer has read the
    /// half's previous round), then writes the round tag there.
    pub(crate) fn reserve_half(&mut self, round: u64) -> Result<()> {
        if round >= 2 {
            for q in self.peers() {
                // Consumed counts rounds read; `round - 2` read means a count of `round - 1`.
                self.await_count(q, Counter::Consumed, round - 1)?;
            }
        }
        let words = self.expected_tag(round).words();
        for (slot, value) in self.region.tag(self.rank, half(round)).iter().zip(words) {
            slot.store(value, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Records that this rank has done `counter`'s step for `round`, waking whoever waits.
    pub(crate) fn mark(&self, counter: Counter, round: u64) {
        let word = self.region.counter(self.rank, counter);
        word.store((round + 1) as u32, Ordering::SeqCst);
        if self.region.waiters(self.rank).load(Ordering::SeqCst) > 0 {
            futex::wake_all(word);
        }
    }

    /// Waits until rank `peer` has done `counter`'s step for `round`; for `Published`, also
    /// checks that the peer is in the same collective (its round tag).
    pub(crate) fn await_peer(&mut self, peer: usize, counter: Counter, round: u64) -> Result<()> {
        self.await_count(peer, counter, round + 1)?;
        if counter == Counter::Published {
            self.check_tag(peer, round)?;
        }
        Ok(())
    }

    /// Copies `values` into this rank's staging half of `round`, at element `offset`.
    pub(crate) fn stage<T: Element>(&mut self, round: u64, offset: usize, values: &[T]) {
        let (base, bytes) = self.region.data(self.rank, half(round));
        assert!(
            (offset + values.len()) * T::SIZE <= bytes,
            "staging overflow"
        );
        // SAFETY: in bounds (checked); aligned for T (pieces are 64-byte aligned); only this
        // rank writes its own half, and no peer reads it before the `Published` mark that
        // follows, nor after its `Consumed` mark, which `reserve_half` waited for.
        unsafe {
            let dst = base.cast::<T>().add(offset);
            std::ptr::copy_nonoverlapping(values.as_ptr(), dst, values.len());
        }
        self.bytes_sent += (values.len() * T::SIZE) as u64;
    }

    /// Copies from rank `peer`'s staging half of `round`, at element `offset`, into `out`.
    pub(crate) fn fetch<T: Element>(&self, peer: usize, round: u64, offset: usize, out: &mut [T]) {
        let source = self.peer_slice::<T>(peer, round, offset, out.len());
        out.copy_from_slice(source);
    }

    fn peer_slice<T: Element>(&self, peer: usize, round: u64, offset: usize, len: usize) -> &[T] {
        let (base, bytes) = self.region.data(peer, half(round));
        assert!((offset + len) * T::SIZE <= bytes, "staging overread");
        // SAFETY: in bounds (checked) and aligned; the caller awaited the peer's mark for this
        // round, and the peer does not rewrite the half before this rank's `Consumed` mark.
        // Every bit pattern is a valid value of every element type.
        unsafe { std::slice::from_raw_parts(base.cast::<T>().add(offset).cast_const(), len) }
    }

    /// The copies the peers staged at this rank's piece of `round` (`len` elements; empty for
    /// this rank itself, in rank order), and where this rank's own piece of its staging half
    /// starts (in bounds for `len` elements, checked).
    fn piece_sources<T: Element>(&self, round: u64, len: usize) -> (Vec<&[T]>, *mut T) {
        let (w, r) = (self.world_size, self.rank);
        let offset = r * self.piece_elems::<T>();
        let sources = (0..w)
            .map(|q| {
                if q == r {
                    &[][..]
                } else {
                    self.peer_slice::<T>(q, round, offset, len)
                }
            })
            .collect();
        let (base, bytes) = self.region.data(r, half(round));
        assert!((offset + len) * T::SIZE <= bytes, "staging overflow");
        // SAFETY: in bounds (checked above).
        (sources, unsafe { base.cast::<T>().add(offset) })
    }

    /// Reduces this rank's piece of `round`: `own` (its part of the tensor) combined in rank
    /// order with the copies the peers staged at this rank's piece, divided by the world size
    /// for `Mean`; the result replaces `own` and is staged for the peers at the same place.
    pub(crate) fn reduce_owned<T: Element>(&mut self, round: u64, own: &mut [T], op: ReduceOp) {
        let len = own.len();
        let (sources, slot) = self.piece_sources::<T>(round, len);
        // SAFETY: in bounds and aligned; this rank's own piece, written only by it, read by the
        // peers only after the `Reduced` mark that follows.
        let staged = unsafe { std::slice::from_raw_parts_mut(slot, len) };
        reduce_in_rank_order(self.rank, own, &sources, staged, op);
        self.bytes_sent += (len * T::SIZE) as u64;
    }

    /// Reduces this rank's piece of `round` for a reduce-scatter: `own` (its input piece)
    /// combined in rank order with the copies the peers staged at this rank's piece, divided by
    /// the world size for `Mean`, written to `out`. `own` is left as it is and the result is not
    /// for the peers: they read nothing back.
    pub(crate) fn reduce_into<T: Element>(
        &mut self,
        round: u64,
        own: &[T],
        out: &mut [T],
        op: ReduceOp,
    ) {
        let len = own.len();
        let (sources, slot) = self.piece_sources::<T>(round, len);
        // SAFETY: in bounds and aligned; this rank's own piece of its own half, which only it
        // writes and which no peer reads in a reduce-scatter (each reads nothing back). The
        // reduction writes its second copy there, where it costs no allocation; it is not sent,
        // so not counted in `bytes_sent`.
        let unused = unsafe { std::slice::from_raw_parts_mut(slot, len) };
        out.copy_from_slice(own);
        reduce_in_rank_order(self.rank, out, &sources, unused, op);
    }

    fn check_tag(&mut self, peer: usize, round: u64) -> Result<()> {
        let words = self
            .region
            .tag(peer, half(round))
            .map(|w| w.load(Ordering::Relaxed));
        let theirs = RoundTag::from_words(words);
        let expected = self.expected_tag(round);
        if theirs == expected {
            return Ok(());
        }
        let problem = format!(
            "protocol mismatch: rank {peer} is in {} where this rank is in {}; every rank must \
             call the same collectives in the same order with tensors of the same shape and \
             dtype",
            theirs.describe(),
            expected.describe()
        );
        Err(self.detected(
            peer,
            Error::Collective {
                op: self.tag.op.name(),
                peer: Some(peer),
                problem,
            },
        ))
    }

    fn detected(&mut self, peer: usize, error: Error) -> Error {
        self.failure = Some((peer, self.rank, reason_of(&error)));
        error
    }

    /// Waits until `peer`'s `counter` reaches `target` (wrapping comparison).
    fn await_count(&mut self, peer: usize, counter: Counter, target: u64) -> Result<()> {
        let word = self.region.counter(peer, counter);
        let target = target as u32;
        let reached = |value: u32| value.wrapping_sub(target) as i32 >= 0;
        if reached(word.load(Ordering::Acquire)) {
            return Ok(());
        }
        let spin_start = Instant::now();
        loop {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            if reached(word.load(Ordering::Acquire)) {
                return Ok(());
            }
            if spin_start.elapsed() >= SPIN {
                break;
            }
        }
        let waiting_on = self.region.waiting_on(self.rank);
        waiting_on.store(peer as u32 + 1, Ordering::SeqCst);
        let result = self.sleep_until(peer, counter, word, reached);
        waiting_on.store(0, Ordering::SeqCst);
        result
    }

    fn sleep_until(
        &mut self,
        peer: usize,
        counter: Counter,
        word: &AtomicU32,
        reached: impl Fn(u32) -> bool,
    ) -> Result<()> {
        let mut patience = Patience::new(self.liveness, self.timeout, self.busy);
        let mut next_liveness_check = Instant::now() + LIVENESS_PERIOD;
        let waiters = self.region.waiters(peer);
        loop {
            if let Some(error) = self.posted_abort() {
                return Err(error);
            }
            if self.region.departed(peer).load(Ordering::SeqCst) != 0 {
                let error = self.left(
                    peer,
                    "left the job (its process exited or dropped its communicator)",
                );
                return Err(self.detected(peer, error));
            }
            let now = Instant::now();
            if now >= next_liveness_check {
                if let Some((gone, what)) = self.crashed_peer(peer) {
                    let error = self.left(gone, &what);
                    return Err(self.detected(gone, error));
                }
                // Its process runs: alive, however long it stays outside the collective.
                patience.heard_from_peer();
                match patience.judge(Some(peer)) {
                    Verdict::Wait => {}
                    Verdict::Busy { .. } => {
                        let (culprit, chain) = self.culprit(peer);
                        let error = self.timed_out(peer, counter, culprit, &chain, &patience);
                        return Err(self.detected(culprit, error));
                    }
                    Verdict::Gone { peer: gone, why } => {
                        let error = self.left(gone, &why);
                        return Err(self.detected(gone, error));
                    }
                    Verdict::Silent { peer: silent, .. } => {
                        let error = self.left(silent, "gave no sign of life");
                        return Err(self.detected(silent, error));
                    }
                }
                next_liveness_check = now + LIVENESS_PERIOD;
            }
            waiters.fetch_add(1, Ordering::SeqCst);
            let value = word.load(Ordering::SeqCst);
            if !reached(value) {
                futex::wait(word, value, LIVENESS_PERIOD);
            }
            waiters.fetch_sub(1, Ordering::SeqCst);
            if reached(word.load(Ordering::Acquire)) {
                return Ok(());
            }
        }
    }

    /// A rank whose process is gone: `peer` (awaited) in any case, another rank only if it did
    /// not leave cleanly (a rank that dropped its communicator may have delivered its part of
    /// this collective already; a crashed one cannot be counted on). Returns it and how it went.
    fn crashed_peer(&self, peer: usize) -> Option<(usize, String)> {
        let others = self.peers().filter(|&q| q != peer);
        std::iter::once(peer).chain(others).find_map(|q| {
            if q != peer && self.region.departed(q).load(Ordering::SeqCst) != 0 {
                return None;
            }
            let pid = self.region.pid(q).load(Ordering::Relaxed);
            let started = self.region.start_time(q).load(Ordering::Relaxed);
            (!host_identity::is_alive(pid, started))
                .then(|| (q, format!("died (process {pid} is gone)")))
        })
    }

    /// The error of another rank's abort record, if one was posted.
    fn posted_abort(&mut self) -> Option<Error> {
        if self.region.abort_state().load(Ordering::Acquire) != ABORT_POSTED {
            return None;
        }
        let (failed, reporter, reason) = self.region.read_abort();
        let me = self.rank;
        let problem = if failed == me {
            format!(
                "the other ranks gave up on this rank (rank {me}): {reason} (reported by rank \
                 {reporter})"
            )
        } else {
            format!("{reason} (reported by rank {reporter})")
        };
        self.failure = Some((failed, reporter, reason));
        Some(Error::Collective {
            op: self.tag.op.name(),
            peer: Some(failed),
            problem,
        })
    }

    fn left(&self, peer: usize, what: &str) -> Error {
        let name = self.tag.op.name();
        let explain = self.liveness.map(|l| l.explain(peer)).unwrap_or_default();
        Error::Collective {
            op: name,
            peer: Some(peer),
            problem: format!(
                "rank {peer} {what} during {name} #{}; the job has to be restarted{explain}",
                self.tag.seq
            ),
        }
    }

    /// Follows the chain of ranks waiting on ranks, from `peer`, to the one that is not waiting
    /// on anybody: the rank that holds everyone up. Returns it and the chain.
    fn culprit(&self, peer: usize) -> (usize, Vec<usize>) {
        let mut chain = vec![peer];
        let mut current = peer;
        for _ in 0..self.world_size {
            let on = self.region.waiting_on(current).load(Ordering::SeqCst) as usize;
            if on == 0 {
                break;
            }
            let next = on - 1;
            if next >= self.world_size || next == self.rank || chain.contains(&next) {
                break;
            }
            chain.push(next);
            current = next;
        }
        (current, chain)
    }

    fn timed_out(
        &self,
        peer: usize,
        counter: Counter,
        culprit: usize,
        chain: &[usize],
        patience: &Patience<'_>,
    ) -> Error {
        let name = self.tag.op.name();
        let seq = self.tag.seq;
        let doing = self
            .liveness
            .and_then(|l| l.activity_of(culprit))
            .map_or(String::new(), |a| format!(", {a}"));
        let what = if chain.len() == 1 {
            format!(
                "rank {peer} in {name} #{seq} (to {}; it is alive{doing})",
                counter.describe()
            )
        } else {
            let via: Vec<String> = chain.iter().map(|r| format!("rank {r}")).collect();
            format!(
                "rank {culprit} in {name} #{seq} (this rank waited for rank {peer} to {}; the \
                 ranks wait on each other as {}; rank {culprit} is alive{doing})",
                counter.describe(),
                via.join(" -> ")
            )
        };
        let explain = self
            .liveness
            .map(|l| l.explain(culprit))
            .unwrap_or_default();
        Error::Timeout {
            what,
            after: patience.busy_limit(),
            hint: format!(
                "rank {culprit} may have hung, be busy outside the collective for longer than \
                 that, or not have called it (every rank must call the same collectives in the \
                 same order){explain}; {}",
                busy_hint()
            ),
        }
    }
}

fn half(round: u64) -> usize {
    (round % 2) as usize
}

/// Combines, element by element and in rank order 0, 1, …, the pieces of every rank: `own` for
/// rank `own_rank`, `others[q]` for the others (`others[own_rank]` is ignored). The result
/// (divided by the number of ranks for `Mean`) overwrites `own` and is copied to `copy_to`.
///
/// One rank computes each element, always in the same order, so the result is deterministic
/// and every rank ends with the same bits.
pub(crate) fn reduce_in_rank_order<T: Element>(
    own_rank: usize,
    own: &mut [T],
    others: &[&[T]],
    copy_to: &mut [T],
    op: ReduceOp,
) {
    let ranks = others.len();
    match op {
        ReduceOp::Sum => reduce_with(own_rank, own, others, copy_to, T::sum_of, |v| v),
        ReduceOp::Mean => reduce_with(own_rank, own, others, copy_to, T::sum_of, |v| {
            T::divided(v, ranks)
        }),
        ReduceOp::Max => reduce_with(own_rank, own, others, copy_to, T::max_of, |v| v),
    }
}

/// [`reduce_in_rank_order`] with the operation as `combine` and the final step (division for
/// `Mean`) as `finish`. Blocks of [`REDUCE_BLOCK`] elements: the partial result of ranks
/// `0..last` stays in L1, and the last rank's values are combined in the same pass that writes
/// both destinations, so the pieces are read once and the outputs written once.
#[inline(always)]
fn reduce_with<T: Element>(
    own_rank: usize,
    own: &mut [T],
    others: &[&[T]],
    copy_to: &mut [T],
    combine: impl Fn(T, T) -> T + Copy,
    finish: impl Fn(T) -> T + Copy,
) {
    let ranks = others.len();
    let last = ranks - 1;
    let len = own.len();
    let mut partial = [T::default(); REDUCE_BLOCK];
    let mut start = 0;
    while start < len {
        let end = (start + REDUCE_BLOCK).min(len);
        let piece = |q: usize| &others[q][start..end];
        let own_block = &mut own[start..end];
        let out = &mut copy_to[start..end];
        if ranks == 2 && own_rank == 0 {
            // Two ranks, this one first: combine in place with rank 1.
            let values = own_block.iter_mut().zip(piece(1)).zip(out.iter_mut());
            for ((o, &b), c) in values {
                let v = finish(combine(*o, b));
                *o = v;
                *c = v;
            }
            start = end;
            continue;
        }
        // The combination of ranks 0..last, in order.
        let first: &[T] = if ranks == 2 {
            piece(0)
        } else {
            let acc = &mut partial[..end - start];
            acc.copy_from_slice(if own_rank == 0 { own_block } else { piece(0) });
            for q in 1..last {
                let source = if q == own_rank { &*own_block } else { piece(q) };
                for (a, &b) in acc.iter_mut().zip(source) {
                    *a = combine(*a, b);
                }
            }
            acc
        };
        if own_rank == last {
            for ((o, &a), c) in own_block.iter_mut().zip(first).zip(out.iter_mut()) {
                let v = finish(combine(a, *o));
                *o = v;
                *c = v;
            }
        } else {
            let lasts = piece(last);
            let values = own_block
                .iter_mut()
                .zip(first)
                .zip(out.iter_mut().zip(lasts));
            for ((o, &a), (c, &b)) in values {
                let v = finish(combine(a, b));
                *o = v;
                *c = v;
            }
        }
        start = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::cpu::shm::region::Layout;

    #[test]
    fn a_timeout_names_the_rank_at_the_end_of_the_waiting_chain() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout {
            world_size: 4,
            piece_bytes: 64,
        };
        let region = Region::create(&dir.path().join("region"), layout, 9).unwrap();
        for rank in 0..4 {
            region.pid(rank).store(std::process::id(), Ordering::SeqCst);
        }
        // Rank 1 waits on rank 2, which waits on rank 3, which waits on nobody: it holds up
        // everyone, and rank 0 waiting on rank 1 must say so.
        region.waiting_on(1).store(2 + 1, Ordering::SeqCst);
        region.waiting_on(2).store(3 + 1, Ordering::SeqCst);
        // Every rank is this live process: the wait ends at the busy limit.
        let mut links = ShmLinks::new(region, 0, Duration::from_millis(50), None);
        let tag = Tag {
            op: OpCode::Barrier,
            dtype: 3,
            seq: 1,
        };
        let (result, _) = links.run(tag, Duration::from_millis(10), |s| {
            s.begin(0, 0, 1);
            s.await_peer(1, Counter::Published, 0)
        });
        let failure = result.unwrap_err();
        assert_eq!(failure.peer, Some(3));
        let Error::Timeout { what, .. } = &failure.error else {
            panic!("{}", failure.error)
        };
        assert!(what.starts_with("rank 3 in barrier #1"), "{what}");
        assert!(what.contains("rank 1 -> rank 2 -> rank 3"), "{what}");
        // The failure was posted for the other ranks, naming rank 3 and reported by rank 0.
        let (failed, reporter, _) = links.region().read_abort();
        assert_eq!((failed, reporter), (3, 0));
        assert_eq!(
            links.region().abort_state().load(Ordering::SeqCst),
            ABORT_POSTED
        );
    }

    #[test]
    fn reduction_follows_rank_order_and_writes_both_destinations() {
        // Three ranks; rank 1 holds its piece in `own`. In f32, -1e8 + 1e8 + 1 is 1 only when
        // the two large values meet first, as in rank order 0, 1, 2; adding rank 2's 1 to
        // either of them first would lose it (1e8 + 1 rounds to 1e8).
        let rank0 = [-1e8f32, 2.0, f32::NAN];
        let rank2 = [1.0f32, 7.0, 1.0];
        let mut own = [1e8f32, -3.0, 5.0];
        let mut staged = [0f32; 3];
        reduce_in_rank_order(
            1,
            &mut own,
            &[&rank0, &[], &rank2],
            &mut staged,
            ReduceOp::Sum,
        );
        assert_eq!(own[..2], [1.0, 6.0]);
        assert!(own[2].is_nan());
        assert_eq!(staged[..2], own[..2]);

        let mut own = [4i64, -9, 10];
        let mut staged = [0i64; 3];
        let r0 = [1i64, -1, 3];
        let r2 = [2i64, -2, 2];
        reduce_in_rank_order(1, &mut own, &[&r0, &[], &r2], &mut staged, ReduceOp::Mean);
        // (1 + 4 + 2) / 3 = 2 (truncated), (-1 - 9 - 2) / 3 = -4, 15 / 3 = 5.
        assert_eq!(own, [2, -4, 5]);
        assert_eq!(staged, own);

        // Every position of this rank among 2 to 4 ranks, every op, several blocks: equal to a
        // plain left fold over the ranks' values in rank order.
        let value = |q: usize, i: usize| ((q * 7 + i * 13) % 29) as f32 * 0.37 - 4.0;
        for ranks in 2..=4 {
            for own_rank in 0..ranks {
                for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                    let len = 2 * REDUCE_BLOCK + 5;
                    let columns: Vec<Vec<f32>> = (0..ranks)
                        .map(|q| (0..len).map(|i| value(q, i)).collect())
                        .collect();
                    let others: Vec<&[f32]> = (0..ranks)
                        .map(|q| {
                            if q == own_rank {
                                &[][..]
                            } else {
                                &columns[q][..]
                            }
                        })
                        .collect();
                    let mut own = columns[own_rank].clone();
                    let mut staged = vec![0f32; len];
                    reduce_in_rank_order(own_rank, &mut own, &others, &mut staged, op);
                    let want: Vec<f32> = (0..len)
                        .map(|i| {
                            let mut v = columns[0][i];
                            for column in &columns[1..] {
                                v = match op {
                                    ReduceOp::Max => v.max(column[i]),
                                    _ => v + column[i],
                                };
                            }
                            if op == ReduceOp::Mean {
                                v / ranks as f32
                            } else {
                                v
                            }
                        })
                        .collect();
                    let bits = |xs: &[f32]| xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&own),
                        bits(&want),
                        "{ranks} ranks, rank {own_rank}, {op:?}"
                    );
                    assert_eq!(bits(&staged), bits(&want));
                }
            }
        }

        let mut own = [0.5f64; 2500]; // several blocks
        let mut staged = vec![0f64; 2500];
        let other: Vec<f64> = (0..2500).map(|i| i as f64).collect();
        reduce_in_rank_order(0, &mut own, &[&[], &other], &mut staged, ReduceOp::Max);
        let want: Vec<f64> = (0..2500).map(|i| (i as f64).max(0.5)).collect();
        assert_eq!(own.to_vec(), want);
        assert_eq!(staged, want);
    }
}
