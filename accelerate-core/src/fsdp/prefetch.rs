//! Prefetch: a thread with a communicator of its own all-gathers the units the model is expected
//! to run next, while the training thread computes the current one (FSDP's forward and backward
//! prefetch, bounded to a number of units ahead).
//!
//! - **Which units.** The order the units ran in before: in the forward pass the unit that
//!   followed this one last time, and so on; in the backward pass the unit whose backward followed
//!   this one's last time, else the one whose forward preceded it (the backward pass runs the
//!   forward in reverse). The first pass has nothing to go by and gathers as it goes.
//! - **The same gathers on every rank.** Only the training thread asks for gathers, in an order
//!   that depends only on the units it has run; every rank runs the same units in the same order
//!   (what stage 3 requires anyway), so every rank's thread gathers the same units in the same
//!   order. The thread's communicator ([`Communicator::connect_sibling`]) carries nothing else,
//!   so its gathers never interleave with the training thread's collectives.
//! - **Bounded.** At most `depth` units are gathered ahead (in flight or waiting to be used) besides
//!   the one being run. A gathered unit is valid until the pieces change: every buffer gathered
//!   ahead is waited for and dropped before an optimizer step or a restore
//!   ([`release`](Prefetcher::release)).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use candle_core::Tensor;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::zero::PrefetchDepth;

/// Which pass a unit runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    Forward,
    Backward,
}

/// The order the units ran in, as far as it predicts the next ones.
#[derive(Debug)]
struct Order {
    /// Per unit: the unit whose forward followed its forward last time.
    forward_next: Vec<Option<usize>>,
    /// Per unit: the unit whose forward preceded its forward last time.
    forward_prev: Vec<Option<usize>>,
    /// Per unit: the unit whose backward followed its backward last time.
    backward_next: Vec<Option<usize>>,
    /// The unit that ran last, and in which pass.
    last: Option<(Pass, usize)>,
}

impl Order {
    fn new(units: usize) -> Self {
        Self {
            forward_next: vec![None; units],
            forward_prev: vec![None; units],
            backward_next: vec![None; units],
            last: None,
        }
    }

    /// Unit `u` runs in `pass`: it follows the last unit if that ran in the same pass. Where
    /// the pass changes, the pass that ended had no unit after its last one, and the one that
    /// begins none before `u`: links an evaluation loop made (its last unit, then its first)
    /// would otherwise predict a gather into the other pass on every training step.
    fn record(&mut self, pass: Pass, u: usize) {
        match (self.last, pass) {
            (Some((Pass::Forward, l)), Pass::Forward) => {
                self.forward_next[l] = Some(u);
                self.forward_prev[u] = Some(l);
            }
            (Some((Pass::Backward, l)), Pass::Backward) => self.backward_next[l] = Some(u),
            (Some((Pass::Forward, l)), Pass::Backward) => self.forward_next[l] = None,
            (Some((Pass::Backward, l)), Pass::Forward) => {
                self.backward_next[l] = None;
                self.forward_prev[u] = None;
            }
            (None, _) => {}
        }
        self.last = Some((pass, u));
    }

    /// Up to `depth` units expected after `u` in `pass`, nearest first, none twice and not `u`.
    fn ahead(&self, pass: Pass, u: usize, depth: usize) -> Vec<usize> {
        let next = |x: usize| match pass {
            Pass::Forward => self.forward_next[x],
            Pass::Backward => self.backward_next[x].or(self.forward_prev[x]),
        };
        let mut units = Vec::with_capacity(depth);
        let mut at = u;
        while units.len() < depth {
            match next(at) {
                Some(n) if n != u && !units.contains(&n) => {
                    units.push(n);
                    at = n;
                }
                _ => break,
            }
        }
        units
    }
}

/// A gather for the thread: this rank's block of unit `unit`.
struct Request {
    unit: usize,
    send: Tensor,
}

/// The thread's answer: the unit and its gathered buffer (or why not).
type Answer = (usize, Result<Tensor>);

/// What the training thread keeps of the prefetch.
#[derive(Debug)]
struct Lookahead {
    order: Order,
    /// Units asked of the thread, oldest first, whose answer was not read yet.
    in_flight: VecDeque<usize>,
    /// Per unit: its gathered buffer, read from the thread and not used yet.
    ready: Vec<Option<Tensor>>,
    requests: Sender<Request>,
    answers: Receiver<Answer>,
    /// Gathers asked of the thread so far, which every rank's count must equal.
    issued: u64,
}

impl Lookahead {
    fn asked(&self, u: usize) -> bool {
        self.ready[u].is_some() || self.in_flight.contains(&u)
    }

    /// Units gathered ahead and not used yet, in flight or read, other than `u`.
    fn held_besides(&self, u: usize) -> usize {
        let in_flight = self.in_flight.iter().filter(|&&v| v != u).count();
        let ready = self.ready.iter().enumerate();
        in_flight + ready.filter(|&(v, r)| v != u && r.is_some()).count()
    }

    /// Reads the oldest answer into `ready`.
    fn read_one(&mut self) -> Result<()> {
        let Some(expected) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let (unit, gathered) = self.answers.recv().map_err(|_| thread_gone())?;
        debug_assert_eq!(unit, expected, "answers come in the order asked");
        self.ready[unit] = Some(gathered?);
        Ok(())
    }
}

fn thread_gone() -> Error {
    Error::Collective {
        op: "all_gather_into",
        peer: None,
        problem: "the ZeRO stage 3 prefetch thread ended without answering (it panicked; its \
                message is above)"
            .into(),
    }
}

/// The prefetch of a fully sharded model (see the module).
pub(crate) struct Prefetcher {
    depth: PrefetchDepth,
    lookahead: Mutex<Lookahead>,
    /// Set when the prefetcher is dropped: the thread starts no gather it was asked for before
    /// (its peers may never issue theirs; the one under way ends by its communicator's timeout).
    closing: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Prefetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher")
            .field("depth", &self.depth)
            .finish_non_exhaustive()
    }
}

fn lock(m: &Mutex<Lookahead>) -> std::sync::MutexGuard<'_, Lookahead> {
    // Every update leaves the queue consistent; a panic elsewhere poisons nothing here.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Prefetcher {
    /// Starts the thread over `comm` (a sibling of the training thread's communicator) for a
    /// model of `units` units.
    pub fn start(
        comm: Box<dyn Communicator + Send>,
        units: usize,
        depth: PrefetchDepth,
    ) -> Result<Self> {
        let (requests, work) = channel::<Request>();
        let (answer, answers) = channel::<Answer>();
        let closing = Arc::new(AtomicBool::new(false));
        let closed = closing.clone();
        let thread = std::thread::Builder::new()
            .name("zero3-prefetch".into())
            .spawn(move || {
                for Request { unit, send } in work {
                    if closed.load(Ordering::Acquire) {
                        break;
                    }
                    let gathered = (|| {
                        // Every rank's block, in rank order.
                        let len = send.elem_count() * comm.world_size();
                        let out = Tensor::zeros(len, send.dtype(), send.device())?;
                        comm.all_gather_into_agreed(&send, &out)?;
                        Ok(out)
                    })();
                    if answer.send((unit, gathered)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| Error::Config(format!("cannot start the prefetch thread: {e}")))?;
        Ok(Self {
            depth,
            lookahead: Mutex::new(Lookahead {
                order: Order::new(units),
                in_flight: VecDeque::new(),
                ready: vec![None; units],
                requests,
                answers,
                issued: 0,
            }),
            closing,
            thread: Some(thread),
        })
    }

    /// Unit `u` is about to run in `pass`: asks the thread for it (unless it was asked before
    /// or is `kept` gathered for the window) and for the units expected next, up to the depth,
    /// then waits for `u`'s buffer. `send_buffer(v)` gives this rank's block of unit `v` in a
    /// buffer of its own (the thread reads it while the training thread goes on). Returns `u`'s
    /// buffer (`None` when it is kept) and the units asked now, whose traffic the caller counts.
    pub fn take(
        &self,
        u: usize,
        pass: Pass,
        kept: &dyn Fn(usize) -> bool,
        send_buffer: &dyn Fn(usize) -> Result<Tensor>,
    ) -> Result<(Option<Tensor>, Vec<usize>)> {
        let mut ahead = lock(&self.lookahead);
        ahead.order.record(pass, u);
        let depth = match pass {
            Pass::Forward => self.depth.forward,
            Pass::Backward => self.depth.backward,
        };
        let mut asked = Vec::new();
        let wanted = std::iter::once(u).chain(ahead.order.ahead(pass, u, depth));
        for v in wanted {
            if kept(v) || ahead.asked(v) {
                continue;
            }
            if v != u && ahead.held_besides(u) >= depth {
                break;
            }
            let send = send_buffer(v)?;
            ahead
                .requests
                .send(Request { unit: v, send })
                .map_err(|_| thread_gone())?;
            ahead.in_flight.push_back(v);
            ahead.issued += 1;
            asked.push(v);
        }
        if kept(u) {
            return Ok((None, asked));
        }
        while ahead.ready[u].is_none() {
            if ahead.in_flight.is_empty() {
                unreachable!("unit {u} was asked above or before");
            }
            ahead.read_one()?;
        }
        Ok((ahead.ready[u].take(), asked))
    }

    /// Waits for every gather in flight and drops every buffer gathered ahead: the pieces are
    /// about to change. The gathers' errors are dropped with them (the communicator reports a
    /// broken ring again at its next use).
    pub fn release(&self) {
        let mut ahead = lock(&self.lookahead);
        while !ahead.in_flight.is_empty() {
            // Each read takes one off the queue, answered or not.
            let _ = ahead.read_one();
        }
        ahead.ready.iter_mut().for_each(|r| *r = None);
    }

    /// Gathers asked of the thread so far: every rank must have asked as many (a rank that
    /// dropped what it had gathered ahead after an error of its own is out of step with the
    /// others from then on).
    pub fn issued(&self) -> u64 {
        lock(&self.lookahead).issued
    }

    /// Units gathered ahead and not used yet (tests).
    #[cfg(test)]
    fn held(&self) -> usize {
        lock(&self.lookahead).held_besides(usize::MAX)
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Closing the requests ends the thread after the gather under way, if any.
        self.closing.store(true, Ordering::Release);
        let (requests, _) = channel();
        let lookahead = self.lookahead.get_mut().unwrap_or_else(|e| e.into_inner());
        drop(std::mem::replace(&mut lookahead.requests, requests));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::LocalCommunicator;
    use candle_core::{DType, Device};

    #[test]
    fn the_order_predicts_from_the_last_pass_and_links_only_within_a_pass() {
        let mut order = Order::new(4);
        for u in 0..4 {
            order.record(Pass::Forward, u);
        }
        assert_eq!(order.ahead(Pass::Forward, 0, 2), vec![1, 2]);
        assert_eq!(order.ahead(Pass::Forward, 2, 5), vec![3]);
        // No backward ran yet: the forward order, reversed.
        order.record(Pass::Backward, 3);
        assert_eq!(order.ahead(Pass::Backward, 3, 3), vec![2, 1, 0]);
        // The forward's last unit and the backward's first are not linked.
        assert_eq!(order.ahead(Pass::Forward, 3, 1), Vec::<usize>::new());
        // A backward order of its own wins over the reversed forward.
        order.record(Pass::Backward, 1);
        order.record(Pass::Backward, 2);
        order.record(Pass::Backward, 0);
        assert_eq!(order.ahead(Pass::Backward, 3, 3), vec![1, 2, 0]);
        // Nor is the backward's last unit linked to the next forward's first.
        order.record(Pass::Forward, 0);
        assert_eq!(order.backward_next[0], None);
        assert_eq!(order.forward_next[0], Some(1));
    }

    #[test]
    fn a_unit_run_twice_in_a_pass_predicts_no_unit_twice() {
        let mut order = Order::new(2);
        for u in [0, 1, 0, 1] {
            order.record(Pass::Forward, u);
        }
        assert_eq!(order.ahead(Pass::Forward, 0, 4), vec![1]);
        assert_eq!(order.ahead(Pass::Forward, 1, 4), vec![0]);
    }

    /// Runs `passes` forward passes over `units` units through a prefetcher of forward depth
    /// `depth` (one rank: the gather is a copy); returns the units asked at each step and the
    /// most units held ahead at once, and checks each unit got its own buffer.
    fn forward_passes(units: usize, depth: usize, passes: usize) -> (Vec<Vec<usize>>, usize) {
        let prefetch = Prefetcher::start(
            Box::new(LocalCommunicator::new()),
            units,
            PrefetchDepth {
                forward: depth,
                backward: 0,
            },
        )
        .unwrap();
        let send = |v: usize| Ok(Tensor::full(v as f32, 3, &Device::Cpu)?);
        let (mut asked, mut most) = (Vec::new(), 0);
        for _ in 0..passes {
            for u in 0..units {
                let (got, now) = prefetch.take(u, Pass::Forward, &|_| false, &send).unwrap();
                let got = got.unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(got, vec![u as f32; 3], "unit {u} got another unit's buffer");
                asked.push(now);
                most = most.max(prefetch.held());
            }
        }
        prefetch.release();
        assert_eq!(prefetch.held(), 0);
        (asked, most)
    }

    #[test]
    fn units_are_asked_ahead_once_the_order_is_known_and_never_beyond_the_depth() {
        let (asked, most) = forward_passes(4, 1, 2);
        // First pass: each unit when it runs. Second: the next one ahead, and at the last unit
        // the next pass's first (forward passes without a backward between, as in evaluation).
        let expected = [[0].as_slice(), &[1], &[2], &[3], &[0, 1], &[2], &[3], &[0]];
        assert_eq!(asked, expected);
        assert_eq!(most, 1);
        let (asked, most) = forward_passes(4, 2, 2);
        assert_eq!(asked[4..], [vec![0, 1, 2], vec![3], vec![0], vec![1]]);
        assert_eq!(most, 2);
        // Every unit gathered once per pass whatever the depth, plus those asked for a pass
        // that did not come.
        for depth in [0, 1, 3, 8] {
            let (asked, _) = forward_passes(5, depth, 3);
            let all: Vec<usize> = asked.concat();
            for u in 0..5 {
                let extra = usize::from(u < depth.min(4));
                let count = all.iter().filter(|&&v| v == u).count();
                assert_eq!(count, 3 + extra, "depth {depth}, unit {u}");
            }
        }
    }

    #[test]
    fn kept_units_are_not_gathered_and_a_misprediction_still_gets_its_unit() {
        let prefetch = Prefetcher::start(
            Box::new(LocalCommunicator::new()),
            3,
            PrefetchDepth {
                forward: 1,
                backward: 1,
            },
        )
        .unwrap();
        let send = |v: usize| Ok(Tensor::full(v as f32, 2, &Device::Cpu)?);
        for u in 0..3 {
            prefetch.take(u, Pass::Forward, &|_| false, &send).unwrap();
        }
        // Unit 1 is kept: not asked, and `take` hands nothing back for it.
        let kept = |v: usize| v == 1;
        let (got, asked) = prefetch.take(0, Pass::Forward, &kept, &send).unwrap();
        assert_eq!(asked, vec![0]);
        assert!(got.is_some());
        let (got, asked) = prefetch.take(1, Pass::Forward, &kept, &send).unwrap();
        assert!(got.is_none() && asked == vec![2]);
        // Unit 2 was asked ahead, but 0 runs: 0 is gathered, 2 stays held.
        let (got, asked) = prefetch.take(0, Pass::Forward, &|_| false, &send).unwrap();
        assert_eq!(got.unwrap().to_vec1::<f32>().unwrap(), vec![0.0, 0.0]);
        assert_eq!(asked, vec![0]);
        assert_eq!(prefetch.held(), 1);
        let (got, asked) = prefetch.take(2, Pass::Forward, &|_| false, &send).unwrap();
        assert_eq!(got.unwrap().to_vec1::<f32>().unwrap(), vec![2.0, 2.0]);
        // 0 followed 2 last time.
        assert_eq!(asked, vec![0]);
        assert_eq!(prefetch.held(), 1);
    }

    #[test]
    fn a_failed_gather_is_the_error_of_the_unit_that_waits_for_it() {
        let prefetch = Prefetcher::start(
            Box::new(LocalCommunicator::new()),
            1,
            PrefetchDepth::DEFAULT,
        )
        .unwrap();
        // A dtype no communicator carries is refused by the gather.
        let send = |_| Ok(Tensor::zeros(2, DType::I32, &Device::Cpu)?);
        let err = prefetch
            .take(0, Pass::Forward, &|_| false, &send)
            .unwrap_err();
        assert!(err.to_string().contains("all_gather"), "{err}");
        assert_eq!(prefetch.held(), 0);
    }
}
