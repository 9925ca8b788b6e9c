//! A store client that opens a new connection when its connection fails, for the heartbeat.
//!
//! [`TcpStoreClient`] never reuses a connection after an I/O failure (a late reply could be taken
//! for the answer to a later request). That is right for the rendezvous, but the heartbeat writes
//! every second for the whole job: one reset connection (a network blip, a NAT or conntrack table
//! flushed) would silence it for good, and the ranks on other machines would take a healthy rank
//! for dead after the silence limit. [`RedialingClient`] dials again instead, and repeats the
//! request once when that is safe.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Store, StoreDial, TcpStoreClient};
use crate::error::Result;

/// How long one redial may take. Short, because the caller (the heartbeat thread, or a rank
/// surveying its peers while it waits in a collective) has other work; a store that cannot be
/// reached in this time is tried again at the next call after [`REDIAL_PAUSE`].
const REDIAL_TIMEOUT: Duration = Duration::from_secs(2);

/// Calls made within this time after a failed redial fail at once instead of dialling again.
const REDIAL_PAUSE: Duration = Duration::from_secs(1);

/// A [`Store`] over a [`TcpStoreClient`] that is replaced by a new connection when it fails.
///
/// `set` and `get` are repeated once on the new connection: both are idempotent. `add` (and so
/// `barrier`) is not repeated, because the failed attempt may have counted already; it returns
/// the error, and the next call uses a new connection. A refusal by the server (a stale
/// generation after a restart, a wrong token) is final, as for the plain client.
#[derive(Debug)]
pub struct RedialingClient {
    /// The credentials every connection is dialled with.
    dial: StoreDial,
    timeout: Duration,
    state: Mutex<Dialled>,
}

#[derive(Debug)]
struct Dialled {
    client: Arc<TcpStoreClient>,
    /// No redial before this instant (set by a failed redial).
    quiet_until: Option<Instant>,
}

impl RedialingClient {
    /// Connects with `dial` as [`TcpStoreClient::connect`] does (retrying until `timeout` while
    /// nobody listens yet); later connections are dialled with the same credentials.
    pub fn connect(dial: StoreDial, timeout: Duration) -> Result<Self> {
        let client = dial.connect(timeout)?;
        Ok(Self {
            dial,
            timeout,
            state: Mutex::new(Dialled {
                client: Arc::new(client),
                quiet_until: None,
            }),
        })
    }

    /// The connection in use now.
    fn current(&self) -> Arc<TcpStoreClient> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .client
            .clone()
    }

    /// A working connection in place of `failed`: a new one, or the one another thread dialled
    /// meanwhile. Holds the lock while dialling so that threads do not dial in parallel.
    fn redial(&self, failed: &Arc<TcpStoreClient>) -> Result<Arc<TcpStoreClient>> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !Arc::ptr_eq(&state.client, failed) && !state.client.is_broken() {
            return Ok(state.client.clone());
        }
        if let Some(until) = state.quiet_until {
            if Instant::now() < until {
                return Err(crate::error::Error::Store(format!(
                    "rank {}: the connection to the store at {} failed and the last attempt to \
                     reconnect failed too; trying again shortly",
                    self.dial.rank, self.dial.addr
                )));
            }
        }
        let timeout = REDIAL_TIMEOUT.min(self.timeout);
        match self.dial.connect(timeout) {
            Ok(mut client) => {
                // Only the dialling is short: replies may take as long as on the first
                // connection, or a busy store would have the client redial again and again.
                client.set_request_timeout(self.timeout);
                tracing::debug!(
                    "rank {}: reconnected to the store at {} after a failed connection",
                    self.dial.rank,
                    self.dial.addr
                );
                state.client = Arc::new(client);
                state.quiet_until = None;
                Ok(state.client.clone())
            }
            Err(e) => {
                state.quiet_until = Some(Instant::now() + REDIAL_PAUSE);
                Err(e)
            }
        }
    }

    /// Runs `request` on a working connection (dialling first if the current one failed
    /// earlier); when the connection fails during the request, dials again and, if `repeat` (the
    /// request is idempotent), runs it once more on the new connection.
    fn call<T>(&self, repeat: bool, request: impl Fn(&TcpStoreClient) -> Result<T>) -> Result<T> {
        let mut client = self.current();
        if client.is_broken() && !client.is_refused() {
            client = self.redial(&client)?;
        }
        match request(&client) {
            Err(e) if client.is_broken() && !client.is_refused() => match self.redial(&client) {
                Ok(fresh) if repeat => request(&fresh),
                _ => Err(e),
            },
            result => result,
        }
    }

    /// Closes the current connection, as a network failure would (for tests).
    #[cfg(test)]
    pub(crate) fn cut_connection(&self) {
        self.current().disconnect();
    }
}

impl Store for RedialingClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(true, |c| c.set(key, value))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.call(true, |c| c.get(key, timeout))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.call(false, |c| c.add(key, delta))
    }

    fn barrier(&self, name: &str, world_size: usize, timeout: Duration) -> Result<()> {
        super::store_barrier(self, name, self.dial.rank, world_size, timeout)
    }
}
