//! Telling a dead peer from a busy one, and saying how the ranks differ when they part ways.
//!
//! A rank waiting in a collective on a silent peer cannot tell from the silence alone whether the
//! peer died or works outside the collective (rank 0 saving a model, evaluating, inside
//! `main_process_first`). So every rank, when it joins, publishes a card in the store (its pid and
//! process start time, its machine, its command line) and a background thread refreshes its
//! heartbeat record there, which also says which collective the rank is in. A rank that drops its
//! communicator records that it left.
//!
//! A waiting rank judges a peer ([`Liveness::survey`]):
//! - on the same machine by its pid: an exited (or zombie, or reused) pid means dead at once;
//! - on another machine by its heartbeat: a count that has not advanced for the silence limit
//!   (`ACCELERATE_COLLECTIVE_TIMEOUT`) means the peer or its machine is gone;
//! - anywhere by its "left" record.
//!
//! A peer alive in this sense is waited for up to the much longer busy limit
//! (`ACCELERATE_BUSY_PEER_TIMEOUT`, see [`Patience`]). The heartbeat thread has its own store
//! connection, so a long `get` on the main connection never delays it.
//!
//! The cards also explain a failure when the ranks took different paths: the command lines are
//! compared ([`describe_argument_difference`]), since a flag given to one machine only is the
//! usual cause.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::host_identity::{self, HostIdentity};
use super::store::Store;
use crate::error::{Error, Result};

/// Most differences between two command lines named in one message.
const MAX_HUNKS: usize = 3;

/// What a rank publishes about itself when it joins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ProcessCard {
    pid: u32,
    /// Start time of the process in clock ticks since boot (0: unknown); tells a reused pid.
    start_time: u64,
    /// The machine; `None` where the system does not tell (then only heartbeats count).
    host: Option<HostIdentity>,
    /// The command line, program first.
    args: Vec<String>,
}

/// Which collective a rank is in, or which it finished last.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activity {
    /// The collective running now: its name and sequence number.
    pub current: Option<(String, u64)>,
    /// The last collective finished.
    pub last: Option<(String, u64)>,
}

impl std::fmt::Display for Activity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.current, &self.last) {
            (Some((op, seq)), _) => write!(f, "in {op} #{seq}"),
            (None, Some((op, seq))) => write!(f, "outside any collective, after {op} #{seq}"),
            (None, None) => write!(f, "before its first collective"),
        }
    }
}

/// A rank's heartbeat record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Beat {
    /// Alive: `count` advances with every beat.
    Alive { count: u64, activity: Activity },
    /// The rank dropped its communicator (returned, failed, or finished).
    Left { activity: Activity },
}

/// What the last survey concluded about a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerState {
    /// Its process runs (same machine) or its heartbeat advanced within the silence limit; with
    /// what it is doing, when known.
    Alive(Option<Activity>),
    /// No sign of life for this long, at least the silence limit (heartbeat stopped, or never
    /// seen): the process or its machine is gone.
    Silent(Duration),
    /// It is gone; says how.
    Gone(String),
}

#[derive(Debug, Default)]
struct PeerView {
    card: Option<ProcessCard>,
    last_count: Option<u64>,
    last_sign: Option<Instant>,
    state: Option<PeerState>,
}

#[derive(Debug, Default)]
struct Views {
    surveyed: Option<Instant>,
    peers: Vec<PeerView>,
}

/// This rank's heartbeat and its view of the others' (see the module documentation).
pub struct Liveness {
    rank: usize,
    world_size: usize,
    prefix: String,
    store: Arc<dyn Store>,
    card: ProcessCard,
    silence: Duration,
    period: Duration,
    activity: Arc<Mutex<Activity>>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    beating: Mutex<Option<JoinHandle<()>>>,
    views: Mutex<Views>,
}

impl std::fmt::Debug for Liveness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Liveness")
            .field("rank", &self.rank)
            .field("silence", &self.silence)
            .finish_non_exhaustive()
    }
}

/// How often heartbeats are written and peers surveyed, for a silence limit: several beats per
/// limit, at most one a second.
pub fn beat_period(silence: Duration) -> Duration {
    (silence / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

impl Liveness {
    /// Publishes this rank's card and first heartbeat in `store` (a connection of its own: the
    /// heartbeat thread must never queue behind a long `get`) under the keys of `generation`,
    /// then starts the heartbeat thread. `silence` is the limit after which a peer without
    /// heartbeat counts as gone.
    pub fn start(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        generation: u64,
        silence: Duration,
    ) -> Result<Arc<Self>> {
        let card = ProcessCard {
            pid: std::process::id(),
            start_time: host_identity::own_start_time(),
            host: HostIdentity::of_this_process(),
            args: std::env::args_os()
                .map(|a| a.to_string_lossy().into_owned())
                .collect(),
        };
        let prefix = format!("accelerate/liveness/{generation}");
        let encoded = serde_json::to_vec(&card).map_err(|e| Error::Store(e.to_string()))?;
        store.set(&format!("{prefix}/card/{rank}"), &encoded)?;
        let activity = Arc::new(Mutex::new(Activity::default()));
        let period = beat_period(silence);
        let beat_key = format!("{prefix}/beat/{rank}");
        let first = Beat::Alive {
            count: 0,
            activity: Activity::default(),
        };
        store.set(&beat_key, &encode(&first))?;
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let thread = {
            let (store, activity, stop) = (store.clone(), activity.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("heartbeat-{rank}"))
                .spawn(move || beat_until_stopped(&*store, &beat_key, &activity, &stop, period))
                .map_err(|e| Error::Store(format!("starting the heartbeat thread: {e}")))?
        };
        Ok(Arc::new(Self {
            rank,
            world_size,
            prefix,
            store,
            card,
            silence,
            period,
            activity,
            stop,
            beating: Mutex::new(Some(thread)),
            views: Mutex::new(Views {
                surveyed: None,
                peers: (0..world_size).map(|_| PeerView::default()).collect(),
            }),
        }))
    }

    /// How often peers are surveyed (and heartbeats written).
    pub fn period(&self) -> Duration {
        self.period
    }

    /// The silence limit: a peer without heartbeat for this long is gone.
    pub fn silence(&self) -> Duration {
        self.silence
    }

    /// Records that this rank entered collective `op` number `seq` (published with the next beat).
    pub fn entered(&self, op: &str, seq: u64) {
        let mut a = self.activity.lock().unwrap_or_else(|e| e.into_inner());
        a.current = Some((op.to_string(), seq));
    }

    /// Records that this rank finished the collective it was in.
    pub fn finished(&self) {
        let mut a = self.activity.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(current) = a.current.take() {
            a.last = Some(current);
        }
    }

    /// The state of every rank (this one is always alive); refreshed from the store and the
    /// process table at most once per [`Liveness::period`].
    pub fn survey(&self) -> Vec<PeerState> {
        let mut views = self.views.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let fresh = views
            .surveyed
            .is_some_and(|at| now.duration_since(at) < self.period);
        if !fresh {
            views.surveyed = Some(now);
            for peer in 0..self.world_size {
                if peer != self.rank {
                    let state = self.judge(peer, &mut views.peers[peer], now);
                    views.peers[peer].state = Some(state);
                }
            }
        }
        (0..self.world_size)
            .map(|peer| {
                views.peers[peer]
                    .state
                    .clone()
                    .unwrap_or(PeerState::Alive(None))
            })
            .collect()
    }

    fn judge(&self, peer: usize, view: &mut PeerView, now: Instant) -> PeerState {
        if view.card.is_none() {
            view.card = self.read(&format!("{}/card/{peer}", self.prefix));
        }
        let beat: Option<Beat> = self.read(&format!("{}/beat/{peer}", self.prefix));
        let activity = match beat {
            Some(Beat::Left { activity }) => {
                return PeerState::Gone(format!("left the job ({activity} when it left)"))
            }
            Some(Beat::Alive { count, activity }) => {
                if view.last_count != Some(count) {
                    view.last_count = Some(count);
                    view.last_sign = Some(now);
                }
                Some(activity)
            }
            None => None,
        };
        if let Some(card) = &view.card {
            let local = card.host.is_some() && card.host == self.card.host;
            if local {
                if !host_identity::is_alive(card.pid, card.start_time) {
                    return PeerState::Gone(format!("died (its process {} is gone)", card.pid));
                }
                view.last_sign = Some(now);
            }
        }
        let silent_for = now.duration_since(*view.last_sign.get_or_insert(now));
        if silent_for < self.silence {
            PeerState::Alive(activity)
        } else {
            PeerState::Silent(silent_for)
        }
    }

    fn read<T: for<'de> Deserialize<'de>>(&self, key: &str) -> Option<T> {
        // Zero wait: a missing record is an answer, not something to wait for.
        let bytes = self.store.get(key, Duration::ZERO).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// What `peer` was doing at its last heartbeat, when known.
    pub fn activity_of(&self, peer: usize) -> Option<Activity> {
        match self.read(&format!("{}/beat/{peer}", self.prefix))? {
            Beat::Alive { activity, .. } | Beat::Left { activity } => Some(activity),
        }
    }

    /// How `peer`'s command line differs from this rank's, as a sentence; `None` when they are
    /// the same or `peer`'s is unknown. The program path is not compared (it may differ between
    /// machines).
    pub fn argument_difference(&self, peer: usize) -> Option<String> {
        let theirs: ProcessCard = self.read(&format!("{}/card/{peer}", self.prefix))?;
        describe_argument_difference(
            (self.rank, self.card.args.get(1..).unwrap_or_default()),
            (peer, theirs.args.get(1..).unwrap_or_default()),
        )
    }

    /// Everything known that explains why `peer` and this rank parted ways: their command lines'
    /// difference and what `peer` was doing; empty when nothing is known.
    pub fn explain(&self, peer: usize) -> String {
        let mut out = String::new();
        if let Some(activity) = self.activity_of(peer) {
            out.push_str(&format!("; rank {peer} was last {activity}"));
        }
        if let Some(diff) = self.argument_difference(peer) {
            out.push_str(&format!("; {diff}"));
        }
        out
    }
}

impl Drop for Liveness {
    fn drop(&mut self) {
        {
            let (stopped, wake) = &*self.stop;
            *stopped.lock().unwrap_or_else(|e| e.into_inner()) = true;
            wake.notify_all();
        }
        if let Some(thread) = self
            .beating
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = thread.join();
        }
        let activity = self
            .activity
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        // Best effort: peers that miss it still see the process gone or the heartbeat stop.
        let key = format!("{}/beat/{}", self.prefix, self.rank);
        let _ = self.store.set(&key, &encode(&Beat::Left { activity }));
    }
}

fn encode(beat: &Beat) -> Vec<u8> {
    serde_json::to_vec(beat).expect("a beat of strings and numbers always serializes")
}

fn beat_until_stopped(
    store: &dyn Store,
    key: &str,
    activity: &Mutex<Activity>,
    stop: &(Mutex<bool>, Condvar),
    period: Duration,
) {
    let (stopped, wake) = stop;
    let mut count = 0u64;
    let mut warned = false;
    loop {
        {
            let guard = stopped.lock().unwrap_or_else(|e| e.into_inner());
            let (guard, _) = wake
                .wait_timeout_while(guard, period, |stopped| !*stopped)
                .unwrap_or_else(|e| e.into_inner());
            if *guard {
                return;
            }
        }
        count += 1;
        let activity = activity.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Err(e) = store.set(key, &encode(&Beat::Alive { count, activity })) {
            if !warned {
                tracing::warn!(
                    "cannot refresh this rank's heartbeat in the store ({e}); ranks on other \
                     machines will take it for dead after the silence limit"
                );
                warned = true;
            }
        }
    }
}

/// How long to wait on peers in one wait, and what it concluded.
///
/// A wait fails when a peer is gone (at once for the awaited peer; after one survey period of
/// grace for the others, whose part of the collective may already be delivered), when the
/// awaited peer gave no sign of life for the silence limit, or when the peers are alive but the
/// wait lasted the busy limit.
pub(crate) struct Patience<'a> {
    liveness: Option<&'a Liveness>,
    silence: Duration,
    busy: Duration,
    started: Instant,
    last_sign: Instant,
    gone_since: Vec<Option<Instant>>,
    peer_waits_too: bool,
}

/// What [`Patience::judge`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Keep waiting.
    Wait,
    /// `peer` is gone; `why` says how.
    Gone { peer: usize, why: String },
    /// The awaited peer gave no sign of life for `after`.
    Silent { peer: usize, after: Duration },
    /// The peers are alive but the wait lasted `after`; `activity` is what the awaited peer was
    /// doing, when known.
    Busy {
        after: Duration,
        activity: Option<Activity>,
    },
}

impl<'a> Patience<'a> {
    /// Starts a wait with the silence and busy limits (the busy limit is never shorter than the
    /// silence limit).
    pub(crate) fn new(liveness: Option<&'a Liveness>, silence: Duration, busy: Duration) -> Self {
        let now = Instant::now();
        Self {
            liveness,
            silence,
            busy: busy.max(silence),
            started: now,
            last_sign: now,
            gone_since: Vec::new(),
            peer_waits_too: false,
        }
    }

    /// The awaited peer showed a sign of life (data, a keep-alive, a live pid).
    pub(crate) fn heard_from_peer(&mut self) {
        self.last_sign = Instant::now();
    }

    /// The awaited peer is itself waiting inside the collective (it sends keep-alives): it is
    /// not the rank that holds everyone up, so this wait allows one silence limit more than the
    /// busy limit, letting the culprit's own neighbour report first.
    pub(crate) fn peer_waits_too(&mut self) {
        self.heard_from_peer();
        self.peer_waits_too = true;
    }

    /// The busy limit of this wait.
    pub(crate) fn busy_limit(&self) -> Duration {
        if self.peer_waits_too {
            self.busy + self.silence
        } else {
            self.busy
        }
    }

    /// Judges the wait on `awaited` (`None`: on every peer, as NCCL's watchdog does).
    pub(crate) fn judge(&mut self, awaited: Option<usize>) -> Verdict {
        let now = Instant::now();
        let mut activity = None;
        if let Some(liveness) = self.liveness {
            let states = liveness.survey();
            if self.gone_since.len() < states.len() {
                self.gone_since.resize(states.len(), None);
            }
            for (peer, state) in states.into_iter().enumerate() {
                let why = match state {
                    PeerState::Gone(why) => why,
                    PeerState::Silent(d) => format!(
                        "gave no sign of life for {d:?} (its heartbeat stopped: the process \
                         or its machine is gone)"
                    ),
                    PeerState::Alive(a) => {
                        self.gone_since[peer] = None;
                        if Some(peer) == awaited {
                            self.last_sign = now;
                            activity = a;
                        }
                        continue;
                    }
                };
                let since = *self.gone_since[peer].get_or_insert(now);
                if Some(peer) == awaited || now.duration_since(since) >= liveness.period() {
                    return Verdict::Gone { peer, why };
                }
            }
        }
        if let Some(peer) = awaited {
            if now.duration_since(self.last_sign) >= self.silence {
                return Verdict::Silent {
                    peer,
                    after: self.silence,
                };
            }
        }
        let limit = self.busy_limit();
        if now.duration_since(self.started) >= limit {
            return Verdict::Busy {
                after: limit,
                activity,
            };
        }
        Verdict::Wait
    }
}

/// Says how two command lines differ, e.g. "the ranks were started with different arguments:
/// rank 0 with `--save-model out.st`, rank 1 without it"; `None` when they are equal.
///
/// The arguments are aligned on their longest common subsequence, so an added flag shows as
/// just that flag rather than as every argument after it.
pub fn describe_argument_difference(
    (a_rank, a): (usize, &[String]),
    (b_rank, b): (usize, &[String]),
) -> Option<String> {
    if a == b {
        return None;
    }
    // lcs[i][j]: length of the longest common subsequence of a[i..] and b[j..].
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    let mut hunks: Vec<(Vec<&str>, Vec<&str>)> = Vec::new();
    let mut current: (Vec<&str>, Vec<&str>) = (Vec::new(), Vec::new());
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            if !current.0.is_empty() || !current.1.is_empty() {
                hunks.push(std::mem::take(&mut current));
            }
            i += 1;
            j += 1;
        } else if j == b.len() || (i < a.len() && lcs[i + 1][j] >= lcs[i][j + 1]) {
            current.0.push(&a[i]);
            i += 1;
        } else {
            current.1.push(&b[j]);
            j += 1;
        }
    }
    if !current.0.is_empty() || !current.1.is_empty() {
        hunks.push(current);
    }
    let quote = |words: &[&str]| format!("`{}`", words.join(" "));
    let mut parts: Vec<String> = hunks
        .iter()
        .take(MAX_HUNKS)
        .map(
            |(ours, theirs)| match (ours.is_empty(), theirs.is_empty()) {
                (false, true) => {
                    format!(
                        "rank {a_rank} with {}, rank {b_rank} without it",
                        quote(ours)
                    )
                }
                (true, false) => {
                    format!(
                        "rank {b_rank} with {}, rank {a_rank} without it",
                        quote(theirs)
                    )
                }
                _ => format!(
                    "rank {a_rank} with {} where rank {b_rank} has {}",
                    quote(ours),
                    quote(theirs)
                ),
            },
        )
        .collect();
    if hunks.len() > MAX_HUNKS {
        parts.push(format!("{} more differences", hunks.len() - MAX_HUNKS));
    }
    Some(format!(
        "the ranks were started with different arguments: {}; every process of a job must run \
         the same command (a flag given to one machine only makes its ranks take another path)",
        parts.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn an_added_flag_is_named_alone() {
        let a = words("--steps 10 --save-model out.st --lr 0.1");
        let b = words("--steps 10 --lr 0.1");
        let d = describe_argument_difference((0, &a), (1, &b)).unwrap();
        assert!(
            d.contains("rank 0 with `--save-model out.st`, rank 1 without it"),
            "{d}"
        );
        let d = describe_argument_difference((1, &b), (0, &a)).unwrap();
        assert!(
            d.contains("rank 0 with `--save-model out.st`, rank 1 without it"),
            "{d}"
        );
        assert_eq!(describe_argument_difference((0, &a), (1, &a)), None);
    }

    #[test]
    fn a_changed_value_is_named_with_both_values() {
        let a = words("--lr 0.1 --steps 10");
        let b = words("--lr 0.2 --steps 10");
        let d = describe_argument_difference((0, &a), (2, &b)).unwrap();
        assert!(
            d.contains("rank 0 with `0.1` where rank 2 has `0.2`"),
            "{d}"
        );
    }

    /// A store in memory, for one process.
    #[derive(Default)]
    struct MemoryStore(Mutex<std::collections::HashMap<String, Vec<u8>>>);

    impl Store for MemoryStore {
        fn set(&self, key: &str, value: &[u8]) -> Result<()> {
            self.0.lock().unwrap().insert(key.into(), value.to_vec());
            Ok(())
        }
        fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
            self.0
                .lock()
                .unwrap()
                .get(key)
                .cloned()
                .ok_or_else(|| Error::Timeout {
                    what: key.into(),
                    after: timeout,
                    hint: String::new(),
                })
        }
        fn add(&self, _: &str, _: i64) -> Result<i64> {
            unimplemented!()
        }
        fn barrier(&self, _: &str, _: usize, _: Duration) -> Result<()> {
            unimplemented!()
        }
    }

    /// Publishes a card for `rank` as if it ran on another machine, with the given beat.
    fn remote_peer(store: &MemoryStore, rank: usize, beat: &Beat) {
        let card = ProcessCard {
            pid: 1,
            start_time: 0,
            host: None,
            args: vec![],
        };
        let prefix = "accelerate/liveness/0";
        store
            .set(
                &format!("{prefix}/card/{rank}"),
                &serde_json::to_vec(&card).unwrap(),
            )
            .unwrap();
        store
            .set(&format!("{prefix}/beat/{rank}"), &encode(beat))
            .unwrap();
    }

    #[test]
    fn a_remote_peer_whose_heartbeat_stops_becomes_silent_then_gone() {
        let store = Arc::new(MemoryStore::default());
        let alive = |count| Beat::Alive {
            count,
            activity: Activity::default(),
        };
        remote_peer(&store, 1, &alive(0));
        let silence = Duration::from_millis(200);
        let me = Liveness::start(store.clone(), 0, 2, 0, silence).unwrap();
        let mut patience = Patience::new(Some(&me), silence, Duration::from_secs(3600));
        // Advancing beats keep it alive well past the silence limit.
        let started = Instant::now();
        let mut count = 0;
        while started.elapsed() < 3 * silence {
            count += 1;
            remote_peer(&store, 1, &alive(count));
            assert_eq!(patience.judge(Some(1)), Verdict::Wait);
            std::thread::sleep(me.period());
        }
        // Stopped beats: silent, then the wait fails naming it.
        let verdict = loop {
            match patience.judge(Some(1)) {
                Verdict::Wait => std::thread::sleep(me.period()),
                other => break other,
            }
        };
        assert!(
            matches!(verdict, Verdict::Gone { peer: 1, ref why } if why.contains("no sign of life"))
                || verdict
                    == Verdict::Silent {
                        peer: 1,
                        after: silence
                    },
            "{verdict:?}"
        );
    }

    #[test]
    fn a_peer_that_left_is_gone_and_this_rank_records_its_own_leaving() {
        let store = Arc::new(MemoryStore::default());
        remote_peer(
            &store,
            1,
            &Beat::Left {
                activity: Activity {
                    current: None,
                    last: Some(("barrier".into(), 42)),
                },
            },
        );
        let me = Liveness::start(store.clone(), 0, 2, 0, Duration::from_secs(60)).unwrap();
        let mut patience = Patience::new(Some(&me), me.silence(), Duration::from_secs(3600));
        match patience.judge(Some(1)) {
            Verdict::Gone { peer: 1, why } => {
                assert!(
                    why.contains("left the job") && why.contains("barrier #42"),
                    "{why}"
                )
            }
            other => panic!("{other:?}"),
        }
        me.entered("all_reduce", 7);
        drop(me);
        let beat: Beat = serde_json::from_slice(
            &store
                .get("accelerate/liveness/0/beat/0", Duration::ZERO)
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            beat,
            Beat::Left {
                activity: Activity {
                    current: Some(("all_reduce".into(), 7)),
                    last: None
                }
            }
        );
    }

    #[test]
    fn a_live_local_peer_is_waited_for_until_the_busy_limit() {
        let store = Arc::new(MemoryStore::default());
        // Rank 1 is this very process: alive by its pid, whatever its heartbeat says.
        let peer = Liveness::start(store.clone(), 1, 2, 0, Duration::from_millis(40)).unwrap();
        let me = Liveness::start(store.clone(), 0, 2, 0, Duration::from_millis(40)).unwrap();
        let busy = Duration::from_millis(400);
        let mut patience = Patience::new(Some(&me), me.silence(), busy);
        let started = Instant::now();
        let verdict = loop {
            match patience.judge(Some(1)) {
                Verdict::Wait => std::thread::sleep(me.period()),
                other => break other,
            }
        };
        assert!(
            matches!(verdict, Verdict::Busy { after, .. } if after == busy),
            "{verdict:?}"
        );
        assert!(started.elapsed() >= busy);
        drop(peer);
    }

    /// The beat count rank `rank` last published in `store` (generation 0).
    fn beat_count(store: &dyn Store, rank: usize) -> Option<u64> {
        let bytes = store
            .get(
                &format!("accelerate/liveness/0/beat/{rank}"),
                Duration::ZERO,
            )
            .ok()?;
        match serde_json::from_slice(&bytes).ok()? {
            Beat::Alive { count, .. } => Some(count),
            Beat::Left { .. } => None,
        }
    }

    #[test]
    fn the_heartbeat_goes_on_after_its_store_connection_is_cut() {
        use crate::comm::store::{RedialingClient, StoreDial, StoreServer, TcpStoreClient};
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t".into(), 0).unwrap();
        let limit = Duration::from_secs(10);
        let dial = StoreDial {
            addr: server.local_addr(),
            token: "t".into(),
            generation: 0,
            rank: 0,
        };
        let heartbeat = Arc::new(RedialingClient::connect(dial, limit).unwrap());
        let me = Liveness::start(heartbeat.clone(), 0, 2, 0, Duration::from_millis(40)).unwrap();
        let reader = TcpStoreClient::connect(server.local_addr(), "t", 0, 1, limit).unwrap();
        // Waits (bounded) until the published count passes `above`.
        let beats_past = |above: u64| {
            let deadline = Instant::now() + limit;
            loop {
                match beat_count(&reader, 0) {
                    Some(count) if count > above => return count,
                    _ if Instant::now() > deadline => {
                        panic!("the heartbeat stopped at {above} beats")
                    }
                    _ => std::thread::sleep(me.period()),
                }
            }
        };
        let before = beats_past(0);
        heartbeat.cut_connection();
        // A connection that failed once would silence it for good: peers on other machines
        // would take this healthy rank for dead after the silence limit.
        let after = beats_past(before + 2);
        assert!(after > before + 2);
        drop(me);
    }
}
