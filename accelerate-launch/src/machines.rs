//! The launchers of a job on several machines, kept in step through the rendezvous store on
//! machine 0.
//!
//! Every machine's launcher holds two control connections to the store
//! ([`TcpStoreClient::connect_launcher`]): one follows the list `launchers` of [`Event`]s, the
//! other appends to it. The list is the job's history, in one order for every launcher:
//!
//! - `Joined`: a launcher connected (its machine rank and host name, for messages, and its
//!   version: every machine must run the same one).
//! - `Ended`: a machine's workers of one attempt have all exited, and how: success, a rank failed,
//!   stopped because of another machine, or interrupted by a signal.
//! - `Verdict`: machine 0's decision on an attempt, once every machine has ended it (or gone):
//!   exit with a code, or restart, after it opened the store's next generation.
//! - `Leaving`: a launcher exits without waiting for the verdict (a signal, workers that could not
//!   start): the job cannot restart with it.
//! - `Departed`: appended by the store itself when a launcher's connection closes, whatever the
//!   cause, so a launcher killed outright is noticed at once.
//!
//! While its workers run, a launcher stops them as soon as another machine ends its attempt badly
//! or its launcher departs, and says which machine. Machine 0 decides whether to restart (its
//! `--max-restarts` counts); every machine's launcher then starts its workers of the next attempt,
//! and they resume from their checkpoint as on one machine.
//!
//! Once its workers have ended, a launcher waits for the others as long as they show signs of
//! life ([`heartbeat`]): a machine whose rank works on alone (rank 0's final save or evaluation)
//! is busy, not stuck, however long it takes. Only a launcher that gives no sign of life for the
//! silence limit (`ACCELERATE_COLLECTIVE_TIMEOUT`, 300 s) is given up on.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use accelerate_core::comm::{Store, StoreServer, TcpStoreClient};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::signals::SignalWatch;
use crate::supervise::{signal_name, Outcome};

mod heartbeat;

use heartbeat::{Heartbeat, Signs};

/// This launcher's version; the launchers of one job must agree on it.
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The store's list the launchers write their events to.
const LOG: &str = "launchers";

/// How long one wait for the next event lasts before it is asked again; an answer within it
/// (even "nothing yet") shows that machine 0's store is alive.
const POLL: Duration = Duration::from_secs(30);

/// How long machine 0 waits, after an attempt went wrong, for the other machines to report that
/// their workers have stopped (beyond the grace period they give their workers).
const STOP_REPORT_MARGIN: Duration = Duration::from_secs(60);

/// How long a launcher waits on a peer launcher's decision or report before it says once that it
/// is waiting, and for whom.
const WAIT_NOTICE: Duration = Duration::from_secs(60);

/// How long machine 0 keeps its store up after announcing the end of the job, until every other
/// launcher has read it and left: the store closes when machine 0's launcher exits, and a
/// launcher that had not read the verdict yet would take that for a lost machine 0.
const LINGER: Duration = Duration::from_secs(30);

/// How long a launcher tries to reconnect its posting connection when an append failed (a
/// connection idle for the whole attempt may have been dropped by the network).
const RECONNECT: Duration = Duration::from_secs(10);

/// One entry of the launchers' list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Event {
    /// A launcher connected.
    Joined {
        machine: usize,
        host: String,
        version: String,
        /// Random, per launcher: tells this launcher's departure from another's of the same
        /// machine rank (one refused as a duplicate).
        id: u64,
    },
    /// A machine's workers of `attempt` have all exited.
    Ended {
        machine: usize,
        attempt: u32,
        end: LocalEnd,
    },
    /// Machine 0's decision on `attempt`.
    Verdict { attempt: u32, next: Next },
    /// A launcher's connection closed (appended by the store).
    Departed { machine: usize, id: u64 },
    /// A launcher is about to exit without waiting for machine 0's verdict (a signal, workers
    /// that could not start): no restart can include it.
    Leaving { machine: usize, reason: String },
}

/// How one machine's workers of one attempt ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LocalEnd {
    /// Every worker exited with code 0.
    Success,
    /// A worker failed (what happened, e.g. "rank 3 (pid 12) exited with code 1").
    Failed(String),
    /// The launcher stopped its workers because of another machine (why).
    Stopped(String),
    /// The launcher received this signal.
    Interrupted(i32),
}

impl LocalEnd {
    /// The end of a group as `supervise::run_group` reported it.
    pub fn from_outcome(outcome: &Outcome) -> Self {
        match outcome {
            Outcome::Interrupted { signal, .. } => LocalEnd::Interrupted(*signal),
            Outcome::Stopped(reason) => LocalEnd::Stopped(reason.clone()),
            Outcome::Failed(failure) => LocalEnd::Failed(failure.to_string()),
            Outcome::Success => LocalEnd::Success,
        }
    }
}

/// What follows an attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Next {
    /// Every machine starts its workers of the next attempt.
    Restart,
    /// Every launcher exits with `code`, printing `reason` unless it is empty.
    Exit { code: u8, reason: String },
}

/// This machine's launcher as a member of the group of launchers.
pub struct MachineLink {
    machine: usize,
    num_machines: usize,
    store_addr: SocketAddr,
    /// The job token, to reconnect `post`.
    token: String,
    /// The connection the follower thread waits on; closed when the link is dropped.
    watch: Arc<TcpStoreClient>,
    post: TcpStoreClient,
    events: mpsc::UnboundedReceiver<Followed>,
    /// Host names of the machines that joined.
    hosts: BTreeMap<usize, String>,
    /// The launcher id each machine joined with.
    ids: BTreeMap<usize, u64>,
    /// Why machines left before the verdict, where they said (`Leaving`).
    left: BTreeMap<usize, String>,
    /// Machines whose launcher's connection closed.
    departed: BTreeSet<usize>,
    /// How each machine ended each attempt.
    ended: BTreeMap<u32, BTreeMap<usize, LocalEnd>>,
    /// Machine 0's decisions.
    verdicts: BTreeMap<u32, Next>,
    /// Why the list can no longer be followed (the store on machine 0 is gone).
    lost: Option<String>,
    /// This launcher's heartbeat, and its reading of the others'.
    heartbeat: Option<Heartbeat>,
    /// The signs of life seen from the other launchers.
    signs: Signs,
    /// How long a launcher may give no sign of life before it counts as gone.
    silence: Duration,
}

/// What the follower thread passes on.
#[derive(Debug)]
enum Followed {
    Event(Event),
    /// The store could not be read (machine 0 or the network is gone).
    Broken(String),
    /// An entry another version of the launcher wrote.
    Unreadable(String),
}

impl std::fmt::Debug for MachineLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is a secret: never print it.
        f.debug_struct("MachineLink")
            .field("machine", &self.machine)
            .field("num_machines", &self.num_machines)
            .field("store_addr", &self.store_addr)
            .finish_non_exhaustive()
    }
}

impl Drop for MachineLink {
    fn drop(&mut self) {
        // The others learn at once that this launcher left (the store appends its farewell),
        // and the follower thread ends.
        self.watch.disconnect();
    }
}

impl MachineLink {
    /// Joins the group of launchers through the store at `store_addr`, waiting up to `timeout`
    /// for it to accept (machine 0's launcher may start after this one), and starts this
    /// launcher's heartbeat. `timeout` is also the silence limit: a launcher that gives no sign of
    /// life for that long while this one waits on it counts as gone.
    pub fn join(
        store_addr: SocketAddr,
        token: &str,
        machine: usize,
        num_machines: usize,
        host: &str,
        timeout: Duration,
    ) -> Result<Self, String> {
        let id: u64 = rand::random();
        let farewell = encode(&Event::Departed { machine, id });
        let connect = |farewell: Vec<u8>| {
            TcpStoreClient::connect_launcher(store_addr, token, machine, LOG, farewell, timeout)
                .map_err(|e| {
                    format!(
                        "machine {machine} cannot join the job through the store on machine 0 \
                         at {store_addr}: {e}"
                    )
                })
        };
        let watch = Arc::new(connect(farewell)?);
        // The store answers by now: the posting connection's requests need no long timeout.
        let post = TcpStoreClient::connect_launcher(
            store_addr,
            token,
            machine,
            LOG,
            Vec::new(),
            RECONNECT,
        )
        .map_err(|e| format!("machine {machine}: a second connection to the store failed: {e}"))?;
        let heartbeat = Heartbeat::start(store_addr, token, machine, num_machines, timeout)?;
        let (tx, events) = mpsc::unbounded_channel();
        let following = watch.clone();
        std::thread::Builder::new()
            .name("launcher-events".into())
            .spawn(move || follow(&following, tx))
            .map_err(|e| format!("cannot start the thread that follows the launchers: {e}"))?;
        let mut link = Self {
            machine,
            num_machines,
            store_addr,
            token: token.to_string(),
            watch,
            post,
            events,
            hosts: BTreeMap::new(),
            departed: BTreeSet::new(),
            ended: BTreeMap::new(),
            verdicts: BTreeMap::new(),
            lost: None,
            ids: BTreeMap::new(),
            left: BTreeMap::new(),
            heartbeat: Some(heartbeat),
            signs: Signs::default(),
            silence: timeout,
        };
        let index = link.publish(&Event::Joined {
            machine,
            host: host.to_string(),
            version: VERSION.to_string(),
            id,
        })?;
        link.check_history(index)?;
        Ok(link)
    }

    /// Refuses to join, before any worker starts, when the entries before ours (`0..index`) show
    /// that this launcher does not belong: the job has already started, another launcher holds
    /// this machine rank, or another machine runs another version. The launchers already there
    /// ignore a refused launcher's entries.
    fn check_history(&self, index: u64) -> Result<(), String> {
        let mut holders: BTreeMap<usize, (u64, String)> = BTreeMap::new();
        for i in 0..index {
            let bytes = self
                .post
                .get(&format!("{LOG}/{i}"), RECONNECT)
                .map_err(|e| format!("reading the launchers' list from the store: {e}"))?;
            let event = bincode::deserialize::<Event>(&bytes)
                .map_err(|e| unreadable_message(i, &e.to_string()))?;
            match event {
                Event::Joined {
                    machine,
                    host,
                    version,
                    id,
                } => {
                    if version != VERSION {
                        return Err(format!(
                            "machine {machine} ({host}) runs accelerate-launch {version}, this \
                             machine {VERSION}; run the same version on every machine"
                        ));
                    }
                    holders.insert(machine, (id, host));
                }
                Event::Departed { machine, id }
                    if holders.get(&machine).is_some_and(|(held, _)| *held == id) =>
                {
                    holders.remove(&machine);
                }
                Event::Leaving { machine, .. } => {
                    holders.remove(&machine);
                }
                Event::Ended { attempt, .. } | Event::Verdict { attempt, .. } => {
                    return Err(format!(
                        "the job is already running (attempt {attempt} has ended on some \
                         machine): a launcher cannot join a running job; start every machine's \
                         launcher again"
                    ));
                }
                _ => {}
            }
        }
        if let Some((_, host)) = holders.get(&self.machine) {
            return Err(format!(
                "machine {} has already joined from {host}: give each machine its own \
                 --machine-rank",
                self.machine
            ));
        }
        Ok(())
    }

    /// Resolves, with the reason, once this machine's workers of `attempt` must stop because of
    /// another machine: it ended the attempt badly, its launcher went away, machine 0 decided the
    /// attempt's end, or machine 0's store can no longer be reached. Cancel-safe: the state lives
    /// in `self`, so it can sit in a `select!` beside the workers.
    pub async fn stop_reason(&mut self, attempt: u32) -> String {
        loop {
            if let Some(reason) = self.reason_to_stop(attempt) {
                return reason;
            }
            self.next_event().await;
        }
    }

    /// Reports how this machine's workers of `attempt` ended.
    pub fn report_end(&mut self, attempt: u32, end: LocalEnd) -> Result<(), String> {
        // Known here at once, whenever the follower reads it back.
        self.ended
            .entry(attempt)
            .or_default()
            .insert(self.machine, end.clone());
        self.publish(&Event::Ended {
            machine: self.machine,
            attempt,
            end,
        })
        .map(|_| ())
    }

    /// Ends the job from this machine outside the normal end of an attempt (a signal before the
    /// workers started, a group that could not start): machine 0 announces the end to the others
    /// and waits for them to leave; another machine reports its end of `attempt`.
    pub async fn abandon(&mut self, attempt: u32, end: LocalEnd) {
        let reason = format!("{} {}", self.name(self.machine), describe(&end));
        if self.machine != 0 {
            // First, so that machine 0 never counts on this launcher for a restart.
            let leaving = Event::Leaving {
                machine: self.machine,
                reason: describe(&end),
            };
            if let Err(e) = self.publish(&leaving) {
                eprintln!("accelerate-launch: {e}");
            }
        }
        if let Err(e) = self.report_end(attempt, end) {
            eprintln!("accelerate-launch: {e}");
        }
        if self.machine == 0 {
            let next = exit(1, reason);
            if let Err(e) = self.publish(&Event::Verdict { attempt, next }) {
                eprintln!("accelerate-launch: {e}");
            }
            self.linger(attempt).await;
        }
    }

    /// Waits for the job's decision on `attempt`, after this machine reported its end. Machine 0
    /// makes it (`store` is the store it hosts; `max_restarts` its flag) once every machine has
    /// ended the attempt or gone; the others wait for it. A signal received meanwhile ends the
    /// launcher without another attempt.
    pub async fn settle(
        &mut self,
        attempt: u32,
        store: Option<&StoreServer>,
        max_restarts: u32,
        grace: Duration,
        signals: &mut SignalWatch,
    ) -> Next {
        if self.machine != 0 {
            // Machine 0 decides within its own bounds once its workers have ended, however long
            // they work on after ours: wait as long as its launcher shows signs of life.
            let waiting_since = tokio::time::Instant::now();
            let mut told = false;
            loop {
                if let Some(next) = self.verdicts.get(&attempt) {
                    return next.clone();
                }
                if let Some(lost) = &self.lost {
                    return exit(1, lost.clone());
                }
                let limit = self.silence;
                if self.silent_for(0) >= limit {
                    return exit(
                        1,
                        format!(
                            "machine 0's launcher gave no sign of life for {limit:?} (its \
                             heartbeat in the store stopped) while this machine waited for its \
                             decision on attempt {attempt}: it is stuck, or its machine is gone"
                        ),
                    );
                }
                if !told && waiting_since.elapsed() >= WAIT_NOTICE {
                    told = true;
                    eprintln!(
                        "accelerate-launch: this machine's workers have ended; waiting for {} \
                         (its launcher is alive: its workers are still running, or it is \
                         deciding)",
                        self.name(0)
                    );
                }
                let period = self.beat_period();
                tokio::select! {
                    _ = self.next_event() => {}
                    () = tokio::time::sleep(period) => {}
                    Some(signal) = signals.next() => {
                        let leaving = Event::Leaving {
                            machine: self.machine,
                            reason: format!("received {}", signal_name(signal)),
                        };
                        if let Err(e) = self.publish(&leaving) {
                            eprintln!("accelerate-launch: {e}");
                        }
                        return interrupted(signal);
                    }
                }
            }
        }
        let next = tokio::select! {
            next = self.decide(attempt, max_restarts, grace) => next,
            Some(signal) = signals.next() => {
                exit(1, format!("machine 0's launcher received {}", signal_name(signal)))
            }
        };
        if next == Next::Restart {
            // Before anyone hears of the restart, so that no worker of the next attempt finds
            // the store still in the old generation.
            if let Some(store) = store {
                store.service().set_generation(u64::from(attempt) + 1);
            }
        }
        if let Err(e) = self.publish(&Event::Verdict {
            attempt,
            next: next.clone(),
        }) {
            eprintln!("accelerate-launch: {e}");
        }
        if matches!(next, Next::Exit { .. }) {
            tokio::select! {
                _ = self.linger(attempt) => {}
                Some(_) = signals.next() => {}
            }
        }
        next
    }

    /// Machine 0, after announcing the end of the job: waits (up to [`LINGER`]) until every
    /// other launcher that joined has left, so that none finds the store gone before it read
    /// the verdict.
    async fn linger(&mut self, attempt: u32) {
        let deadline = tokio::time::Instant::now() + LINGER;
        // Once our own verdict has come back through the list, every launcher that joined
        // before it is known here.
        while self.lost.is_none() && !self.verdicts.contains_key(&attempt) {
            if tokio::time::timeout_at(deadline, self.next_event())
                .await
                .is_err()
            {
                return;
            }
        }
        while self.lost.is_none()
            && (0..self.num_machines).any(|m| {
                m != self.machine && self.hosts.contains_key(&m) && !self.departed.contains(&m)
            })
        {
            if tokio::time::timeout_at(deadline, self.next_event())
                .await
                .is_err()
            {
                return;
            }
        }
    }

    /// Machine 0's decision on `attempt`: waits until every machine has ended it or gone.
    async fn decide(&mut self, attempt: u32, max_restarts: u32, grace: Duration) -> Next {
        let waiting_since = tokio::time::Instant::now();
        let mut told = false;
        let mut failure_seen: Option<tokio::time::Instant> = None;
        loop {
            if let Some(lost) = &self.lost {
                return exit(1, lost.clone());
            }
            let pending: Vec<usize> = (0..self.num_machines)
                .filter(|m| self.end_of(*m, attempt).is_none() && !self.departed.contains(m))
                .collect();
            if pending.is_empty() {
                break;
            }
            // Once one machine ended badly, the others are stopping their workers: wait for them
            // a bounded time. While all goes well, they may take long to finish (final saves):
            // wait as long as their launchers show signs of life.
            let failed = self
                .ended
                .get(&attempt)
                .is_some_and(|ends| ends.values().any(|e| *e != LocalEnd::Success));
            if failed {
                failure_seen.get_or_insert_with(tokio::time::Instant::now);
            }
            let Some(seen) = failure_seen else {
                let limit = self.silence;
                let silent: Vec<usize> = pending
                    .iter()
                    .copied()
                    .filter(|m| self.silent_for(*m) >= limit)
                    .collect();
                if !silent.is_empty() {
                    let names: Vec<String> = silent
                        .iter()
                        .map(|m| {
                            self.unreported(
                                *m,
                                &format!(
                                    "gave no sign of life for {limit:?} (its launcher's heartbeat in \
                                     the store stopped) before it reported the end of its workers"
                                ),
                            )
                        })
                        .collect();
                    return exit(
                        1,
                        format!(
                            "{} after machine 0's workers ended; giving up on the job",
                            names.join("; ")
                        ),
                    );
                }
                if !told && waiting_since.elapsed() >= WAIT_NOTICE {
                    told = true;
                    let names: Vec<String> = pending.iter().map(|m| self.name(*m)).collect();
                    eprintln!(
                        "accelerate-launch: this machine's workers have ended; waiting for the \
                         workers of {} (their launchers are alive)",
                        names.join(", ")
                    );
                }
                let period = self.beat_period();
                tokio::select! {
                    _ = self.next_event() => {}
                    () = tokio::time::sleep(period) => {}
                }
                continue;
            };
            let limit = grace + STOP_REPORT_MARGIN;
            if tokio::time::timeout_at(seen + limit, self.next_event())
                .await
                .is_err()
            {
                let names: Vec<String> = pending
                    .iter()
                    .map(|m| self.unreported(*m, "did not report the end of its workers"))
                    .collect();
                return exit(
                    1,
                    format!(
                        "{} within {limit:?} after the attempt went wrong; giving up on the job",
                        names.join("; ")
                    ),
                );
            }
        }
        let ends = self.ended.get(&attempt).cloned().unwrap_or_default();
        if let Some(m) = (0..self.num_machines).find(|m| !ends.contains_key(m)) {
            return exit(1, format!("{}; stopped the job", self.departed_message(m)));
        }
        if ends.values().all(|e| *e == LocalEnd::Success) {
            return exit(0, String::new());
        }
        // The first machine that ended badly on its own (not stopped on behalf of another).
        let cause = ends
            .iter()
            .find(|(_, e)| matches!(e, LocalEnd::Failed(_) | LocalEnd::Interrupted(_)))
            .or_else(|| ends.iter().find(|(_, e)| **e != LocalEnd::Success))
            .map(|(m, e)| format!("{}: {}", self.name(*m), describe(e)))
            .unwrap_or_default();
        if let Some((m, LocalEnd::Interrupted(signal))) = ends
            .iter()
            .find(|(_, e)| matches!(e, LocalEnd::Interrupted(_)))
        {
            return exit(
                1,
                format!(
                    "{}'s launcher received {}; stopped the job without a restart",
                    self.name(*m),
                    signal_name(*signal)
                ),
            );
        }
        let gone: Vec<String> = (0..self.num_machines)
            .filter(|m| self.departed.contains(m))
            .map(|m| self.name(m))
            .collect();
        if !gone.is_empty() {
            return exit(
                1,
                format!(
                    "{cause}; cannot restart: the launcher of {} has gone (a restart needs every \
                     machine's launcher)",
                    gone.join(", ")
                ),
            );
        }
        if attempt >= max_restarts {
            let tail = if max_restarts > 0 {
                format!("; giving up after {max_restarts} restart(s) (--max-restarts)")
            } else {
                String::new()
            };
            return exit(1, format!("{cause}{tail}"));
        }
        Next::Restart
    }

    /// "machine 1 (host-b) <what>", or for a machine that never joined, why that may be.
    fn unreported(&self, machine: usize, what: &str) -> String {
        if self.hosts.contains_key(&machine) {
            format!("{} {what}", self.name(machine))
        } else {
            format!(
                "machine {machine} never joined (its launcher did not reach the store on port {}; \
                 check that it runs, with this --main-process-ip and --main-process-port)",
                self.store_addr.port()
            )
        }
    }

    /// How often the heartbeats are read.
    fn beat_period(&self) -> Duration {
        self.heartbeat
            .as_ref()
            .map_or(heartbeat::beat_period(self.silence), Heartbeat::period)
    }

    /// How long `machine`'s launcher has given no sign of life, as of the heartbeats read last.
    fn silent_for(&mut self, machine: usize) -> Duration {
        let now = tokio::time::Instant::now();
        if let Some(heartbeat) = &self.heartbeat {
            self.signs.note(&heartbeat.counts(), now);
        }
        self.signs.silent_for(machine, now)
    }

    /// Stops this launcher's heartbeat, as a frozen launcher's stops.
    #[cfg(test)]
    fn stop_heartbeat(&mut self) {
        self.heartbeat = None;
    }

    fn end_of(&self, machine: usize, attempt: u32) -> Option<&LocalEnd> {
        self.ended.get(&attempt).and_then(|ends| ends.get(&machine))
    }

    fn reason_to_stop(&self, attempt: u32) -> Option<String> {
        if let Some(lost) = &self.lost {
            return Some(lost.clone());
        }
        if let Some(Next::Exit { reason, .. }) = self.verdicts.get(&attempt) {
            return Some(format!("machine 0 ended the job: {reason}"));
        }
        if let Some(ends) = self.ended.get(&attempt) {
            if let Some((m, end)) = ends
                .iter()
                .find(|(m, e)| **m != self.machine && **e != LocalEnd::Success)
            {
                return Some(format!("{} {}", self.name(*m), describe(end)));
            }
        }
        let gone = self
            .departed
            .iter()
            .find(|m| **m != self.machine && self.end_of(**m, attempt).is_none())?;
        Some(self.departed_message(*gone))
    }

    fn departed_message(&self, machine: usize) -> String {
        match self.left.get(&machine) {
            Some(reason) => format!("{}'s launcher left the job: {reason}", self.name(machine)),
            None => format!(
                "{}'s launcher disconnected from the store while its workers were running (it \
                 was killed, or its machine or network failed)",
                self.name(machine)
            ),
        }
    }

    /// Takes the next event into the state (or records that the list is lost).
    async fn next_event(&mut self) {
        if self.lost.is_some() {
            return std::future::pending().await;
        }
        match self.events.recv().await {
            Some(Followed::Event(event)) => self.absorb(event),
            Some(Followed::Unreadable(why)) => self.lost = Some(why),
            Some(Followed::Broken(e)) => self.lost = Some(self.lost_message(&e)),
            None => self.lost = Some(self.lost_message("the follower thread ended")),
        }
    }

    fn absorb(&mut self, event: Event) {
        match event {
            Event::Joined {
                machine,
                host,
                version,
                id,
            } => {
                // Another version, or a machine rank already held: that launcher refuses itself
                // (check_history); the group ignores it.
                let held = self.ids.contains_key(&machine) && !self.departed.contains(&machine);
                if version == VERSION && !held {
                    self.departed.remove(&machine);
                    self.left.remove(&machine);
                    self.ids.insert(machine, id);
                    self.hosts.insert(machine, host);
                }
            }
            Event::Ended {
                machine,
                attempt,
                end,
            } => {
                self.ended
                    .entry(attempt)
                    .or_default()
                    .entry(machine)
                    .or_insert(end);
            }
            Event::Verdict { attempt, next } => {
                self.verdicts.insert(attempt, next);
            }
            Event::Departed { machine, id } => {
                if self.ids.get(&machine) == Some(&id) {
                    self.departed.insert(machine);
                }
            }
            Event::Leaving { machine, reason } => {
                if self.ids.contains_key(&machine) {
                    self.departed.insert(machine);
                    self.left.insert(machine, reason);
                }
            }
        }
    }

    fn lost_message(&self, cause: &str) -> String {
        format!(
            "lost machine 0: the store its launcher hosts at {} no longer answers ({cause}); \
             machine 0's launcher has exited or was killed, or the network between the machines \
             failed",
            self.store_addr
        )
    }

    /// "machine 1 (host-b)".
    fn name(&self, machine: usize) -> String {
        match self.hosts.get(&machine) {
            Some(host) => format!("machine {machine} ({host})"),
            None => format!("machine {machine}"),
        }
    }

    /// Appends `event`; after a failure, once more on a fresh connection (an idle connection
    /// may have been dropped by the network while the workers ran).
    fn publish(&mut self, event: &Event) -> Result<u64, String> {
        if let Some(lost) = &self.lost {
            return Err(lost.clone());
        }
        let bytes = encode(event);
        let first = match self.post.append(LOG, &bytes) {
            Ok(index) => return Ok(index),
            Err(e) => e,
        };
        let retried = TcpStoreClient::connect_launcher(
            self.store_addr,
            &self.token,
            self.machine,
            LOG,
            Vec::new(),
            RECONNECT,
        )
        .and_then(|post| {
            let index = post.append(LOG, &bytes)?;
            self.post = post;
            Ok(index)
        });
        retried.map_err(|again| {
            format!(
                "cannot reach the store on machine 0 at {}: {first}; reconnecting failed too: \
                 {again}",
                self.store_addr
            )
        })
    }
}

/// "failed: rank 3 (pid 12) exited with code 1", for messages.
fn describe(end: &LocalEnd) -> String {
    match end {
        LocalEnd::Success => "finished".into(),
        LocalEnd::Failed(what) => format!("failed: {what}"),
        LocalEnd::Stopped(why) => format!("stopped its workers ({why})"),
        LocalEnd::Interrupted(signal) => format!("received {}", signal_name(*signal)),
    }
}

fn unreadable_message(index: u64, problem: &str) -> String {
    format!(
        "entry {index} of the launchers' list is not one this version ({VERSION}) reads \
         ({problem}): another machine runs another version of accelerate-launch; run the same \
         version on every machine"
    )
}

fn exit(code: u8, reason: String) -> Next {
    Next::Exit { code, reason }
}

fn interrupted(signal: i32) -> Next {
    exit(
        (128 + signal) as u8,
        format!(
            "received {}; not waiting for machine 0",
            signal_name(signal)
        ),
    )
}

fn encode(event: &Event) -> Vec<u8> {
    // A plain enum of strings and integers always serializes.
    bincode::serialize(event).unwrap_or_default()
}

/// Follows the list from its first entry, sending every event (or the failure that ends the
/// following) until the receiver is dropped.
fn follow(watch: &TcpStoreClient, tx: mpsc::UnboundedSender<Followed>) {
    let mut index = 0u64;
    loop {
        let sent = match watch.try_get(&format!("{LOG}/{index}"), POLL) {
            Ok(None) => continue,
            Ok(Some(bytes)) => {
                index += 1;
                match bincode::deserialize::<Event>(&bytes) {
                    Ok(event) => tx.send(Followed::Event(event)),
                    Err(e) => {
                        let why = unreadable_message(index - 1, &e.to_string());
                        let _ = tx.send(Followed::Unreadable(why));
                        return;
                    }
                }
            }
            Err(e) => {
                let _ = tx.send(Followed::Broken(e.to_string()));
                return;
            }
        };
        if sent.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests;
