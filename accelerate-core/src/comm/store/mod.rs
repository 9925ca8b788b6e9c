//! The rendezvous store: a small key-value store over TCP through which the processes of a job
//! find each other (PyTorch c10d's `Store`, the part we need).
//!
//! [`StoreServer`] is hosted by the launcher, or by rank 0 when torchrun, SLURM or MPI started
//! the workers. Every process connects a [`TcpStoreClient`]. Client and server each prove that
//! they hold the job token without sending it (`auth`), and a worker presents its generation
//! (restart round), so a stray client, a program that took the port, or a stale worker of an
//! earlier round is refused.

mod auth;
mod client;
mod host;
mod redialing;
mod server;
#[cfg(test)]
mod test_jobs;
mod token_file;
pub(crate) mod wire;

#[cfg(test)]
mod tests;

use std::time::Duration;

#[cfg(test)]
pub(crate) use auth::raw_handshake;
pub use client::{StoreDial, TcpStoreClient};
pub(crate) use host::job_token;
pub use host::{check_master_addr, host_for_job};
pub use redialing::RedialingClient;
pub use server::StoreServer;
#[cfg(test)]
pub(crate) use test_jobs::on_store_clients;

use crate::error::{Error, Result};

/// A key-value store shared by the processes of a job.
pub trait Store: Send + Sync {
    /// Stores `value` under `key`, replacing any previous value, and wakes those waiting for it.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Returns the value of `key`, waiting until some process sets it; `Error::Timeout` after
    /// `timeout`.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// Atomically adds `delta` to the counter under `key` (a missing key counts as 0) and returns
    /// the new value. Counters are stored as decimal text, so `get` reads them as such.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Returns once `world_size` callers have entered the barrier `name`; `Error::Timeout`,
    /// naming the ranks that did not arrive, after `timeout`. A name may be reused: each group of
    /// `world_size` arrivals forms one round.
    fn barrier(&self, name: &str, world_size: usize, timeout: Duration) -> Result<()>;
}

/// A barrier built from `add`, `set` and `get`, for any [`Store`].
///
/// The `n`-th arrival (counted by `add`) belongs to round `(n - 1) / world_size`; the arrival that
/// completes a round sets the round's `done` key, which everyone waits for. Each caller also
/// records its rank, so a timeout can say who is missing.
pub fn store_barrier(
    store: &dyn Store,
    name: &str,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<()> {
    if world_size == 0 {
        return Err(Error::Config(format!(
            "barrier {name:?} with world size 0; the world size must be at least 1"
        )));
    }
    let size = world_size as i64;
    let arrived = store.add(&format!("barrier/{name}/arrived"), 1)?;
    let round = (arrived - 1) / size;
    let round_key = format!("barrier/{name}/{round}");
    store.set(&format!("{round_key}/rank{rank}"), b"")?;
    if arrived % size == 0 {
        store.set(&format!("{round_key}/done"), b"")?;
    }
    match store.get(&format!("{round_key}/done"), timeout) {
        Ok(_) => Ok(()),
        Err(Error::Timeout { .. }) => {
            let mut missing = Vec::new();
            for r in 0..world_size {
                match store.get(&format!("{round_key}/rank{r}"), Duration::ZERO) {
                    Ok(_) => {}
                    Err(Error::Timeout { .. }) => missing.push(r),
                    Err(e) => return Err(e),
                }
            }
            Err(Error::Timeout {
                what: format!("ranks {missing:?} to reach barrier {name:?}"),
                after: timeout,
                hint: "those processes may have crashed, hung or taken another code path; \
                       check their logs"
                    .into(),
            })
        }
        Err(e) => Err(e),
    }
}

/// Turns on TCP keepalive on socket `fd` (first probe after 60 s idle, then every 10 s, 6
/// probes), at both ends of a store connection: a connection that waits long for its next
/// request (a launcher's, a worker's between restarts) is kept open
/// through firewalls and NAT tables that drop idle flows, and a peer that vanished without
/// closing it (a machine that lost power) is noticed within two minutes.
pub(crate) fn keep_alive(fd: std::os::fd::RawFd) -> std::io::Result<()> {
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| {
        // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a live c_int on an open socket.
        let r = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    #[cfg(target_os = "linux")]
    {
        set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 60)?;
        set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10)?;
        set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 6)?;
    }
    Ok(())
}
