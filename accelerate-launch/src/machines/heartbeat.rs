//! The launchers' heartbeats: how a launcher tells another machine's launcher that is busy (its
//! workers still run: rank 0 saving or evaluating alone) from one that is gone (frozen, its
//! machine lost), by that launcher's liveness in the store rather than by a clock started on this
//! machine when its own workers ended.
//!
//! Each launcher's heartbeat thread, on a store connection of its own, raises its counter
//! `launcher-beats/<machine>` once a period and reads the counters of the launchers it watches
//! (machine 0 watches every other machine, the others watch machine 0: the store carries O(M)
//! requests a period, not O(M²)). A counter that advanced is a sign of life; the waiting code
//! ([`Signs`]) times the silences with its own clock, so paused time in tests applies to them.

use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use accelerate_core::comm::{Store, TcpStoreClient};
use tokio::time::Instant;

use super::LOG;

/// The store key of `machine`'s heartbeat counter (a launchers' control key).
fn beat_key(machine: usize) -> String {
    format!("launcher-beats/{machine}")
}

/// How often a launcher beats and reads the others' beats, for a silence limit: several beats
/// per limit, at most one every five seconds (a thousand machines then cost machine 0's store a
/// few hundred requests a second).
pub(super) fn beat_period(silence: Duration) -> Duration {
    (silence / 4).clamp(Duration::from_millis(10), Duration::from_secs(5))
}

/// This launcher's heartbeat thread and the counters it last read.
pub(super) struct Heartbeat {
    /// The last counter read for each machine (`None`: none read yet).
    counts: Arc<Mutex<Vec<Option<i64>>>>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
    period: Duration,
}

impl std::fmt::Debug for Heartbeat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heartbeat")
            .field("period", &self.period)
            .finish_non_exhaustive()
    }
}

impl Heartbeat {
    /// Starts the heartbeat of `machine` (of `num_machines`) through the store at `store_addr`,
    /// beating once per [`beat_period`] of `silence`.
    pub(super) fn start(
        store_addr: SocketAddr,
        token: &str,
        machine: usize,
        num_machines: usize,
        silence: Duration,
    ) -> Result<Self, String> {
        let period = beat_period(silence);
        let watched: Vec<usize> = if machine == 0 {
            (1..num_machines).collect()
        } else {
            vec![0]
        };
        let counts = Arc::new(Mutex::new(vec![None; num_machines]));
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let dial = {
            let token = token.to_string();
            // An empty farewell: this connection closing says nothing; the launcher's own
            // control connection does.
            move || {
                TcpStoreClient::connect_launcher(
                    store_addr,
                    &token,
                    machine,
                    LOG,
                    Vec::new(),
                    period.max(Duration::from_secs(1)),
                )
                .ok()
            }
        };
        let first = dial();
        let thread = {
            let (counts, stop) = (counts.clone(), stop.clone());
            std::thread::Builder::new()
                .name("launcher-heartbeat".into())
                .spawn(move || {
                    beat_until_stopped(first, dial, machine, &watched, &counts, &stop, period)
                })
                .map_err(|e| format!("cannot start the launcher's heartbeat thread: {e}"))?
        };
        Ok(Self {
            counts,
            stop,
            thread: Some(thread),
            period,
        })
    }

    /// How often the counters are refreshed.
    pub(super) fn period(&self) -> Duration {
        self.period
    }

    /// The counters last read, one per machine (this machine's and unwatched ones stay `None`).
    pub(super) fn counts(&self) -> Vec<Option<i64>> {
        self.counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        {
            let (stopped, wake) = &*self.stop;
            *stopped.lock().unwrap_or_else(|e| e.into_inner()) = true;
            wake.notify_all();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn beat_until_stopped(
    mut store: Option<TcpStoreClient>,
    dial: impl Fn() -> Option<TcpStoreClient>,
    machine: usize,
    watched: &[usize],
    counts: &Mutex<Vec<Option<i64>>>,
    stop: &(Mutex<bool>, Condvar),
    period: Duration,
) {
    let (stopped, wake) = stop;
    loop {
        // A connection that failed is dialled again: a network blip must not silence this
        // launcher for good (the others would take it for gone).
        if store.as_ref().is_none_or(TcpStoreClient::is_broken) {
            store = dial();
        }
        if let Some(client) = &store {
            let _ = client.add(&beat_key(machine), 1);
            for &m in watched {
                if let Ok(Some(bytes)) = client.try_get(&beat_key(m), Duration::ZERO) {
                    let count = std::str::from_utf8(&bytes)
                        .ok()
                        .and_then(|s| s.parse().ok());
                    if let Some(count) = count {
                        counts.lock().unwrap_or_else(|e| e.into_inner())[m] = Some(count);
                    }
                }
            }
        }
        let guard = stopped.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = wake
            .wait_timeout_while(guard, period, |stopped| !*stopped)
            .unwrap_or_else(|e| e.into_inner());
        if *guard {
            return;
        }
    }
}

/// The signs of life a waiting launcher has seen: when each machine's counter last changed, on
/// the waiting code's clock.
#[derive(Debug, Default)]
pub(super) struct Signs {
    /// Per machine: the counter last seen and when it was first seen at that value.
    last: Vec<Option<(Option<i64>, Instant)>>,
}

impl Signs {
    /// Takes in the counters read (`counts`) at `now`: a counter seen for the first time, or
    /// changed, is a sign of life.
    pub(super) fn note(&mut self, counts: &[Option<i64>], now: Instant) {
        if self.last.len() < counts.len() {
            self.last.resize(counts.len(), None);
        }
        for (last, count) in self.last.iter_mut().zip(counts) {
            match last {
                Some((seen, _)) if seen == count => {}
                _ => *last = Some((*count, now)),
            }
        }
    }

    /// How long `machine` has given no sign of life at `now` (since it was first looked at, if
    /// its counter never changed).
    pub(super) fn silent_for(&self, machine: usize, now: Instant) -> Duration {
        match self.last.get(machine) {
            Some(Some((_, since))) => now.saturating_duration_since(*since),
            _ => Duration::ZERO,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_that_advances_is_alive_and_one_that_stops_grows_silent() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut signs = Signs::default();
        signs.note(&[None, Some(1)], at(0));
        assert_eq!(signs.silent_for(1, at(0)), Duration::ZERO);
        signs.note(&[None, Some(2)], at(10));
        assert_eq!(signs.silent_for(1, at(10)), Duration::ZERO);
        // Stopped at 2: silent since it was first seen at 2.
        signs.note(&[None, Some(2)], at(25));
        assert_eq!(signs.silent_for(1, at(25)), Duration::from_secs(15));
        // Never read: silent since the first look.
        assert_eq!(signs.silent_for(0, at(25)), Duration::from_secs(25));
        // A counter read at last is a sign.
        signs.note(&[Some(1), Some(2)], at(30));
        assert_eq!(signs.silent_for(0, at(30)), Duration::ZERO);
    }

    #[test]
    fn the_period_gives_several_beats_per_silence_limit() {
        assert_eq!(
            beat_period(Duration::from_secs(2)),
            Duration::from_millis(500)
        );
        assert_eq!(
            beat_period(Duration::from_secs(300)),
            Duration::from_secs(5)
        );
        assert_eq!(
            beat_period(Duration::from_millis(1)),
            Duration::from_millis(10)
        );
    }
}
