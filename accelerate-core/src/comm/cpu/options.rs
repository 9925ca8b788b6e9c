//! Settings of the CPU communicator.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::comm::liveness::Liveness;
use crate::env::{BUSY_PEER_TIMEOUT, COLLECTIVE_TIMEOUT, CPU_TRANSPORT};
use crate::error::{Error, Result};

/// Default for [`CpuCommOptions::timeout`]: how long a peer may give no sign of life at all
/// (no data, no heartbeat, no live process). Also bounds each step of the connection setup.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);

/// Default for [`CpuCommOptions::busy_timeout`]: 30 minutes, PyTorch's default process-group
/// timeout (`default_pg_timeout`, which Gloo uses; NCCL's is 10 minutes).
pub const DEFAULT_BUSY_PEER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Default for [`CpuCommOptions::chunk_bytes`]: large enough that per-frame costs vanish, small
/// enough that the ring's pipeline fills quickly.
pub const DEFAULT_CHUNK_BYTES: usize = 512 * 1024;

/// Which transport a [`super::CpuCommunicator`] uses between its ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TransportChoice {
    /// Shared memory when every rank of the job runs on this machine, TCP otherwise.
    #[default]
    Auto,
    /// TCP between all ranks, even on one machine.
    Tcp,
    /// Shared memory; connecting fails when the ranks are not all on one machine.
    Shm,
}

impl TransportChoice {
    /// The value of [`CPU_TRANSPORT`] that selects this choice.
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Shm => "shm",
        }
    }
}

/// How a [`super::CpuCommunicator`] connects and how long it waits.
#[derive(Debug, Clone)]
pub struct CpuCommOptions {
    /// Silence limit: longest a rank waits on a peer that gives no sign of life (no data, no
    /// heartbeat, for a peer on this machine no running process) before failing with an error
    /// naming that peer. Also bounds each step of the connection setup. A peer whose process is
    /// gone, or that left the job, fails the wait at once.
    pub timeout: Duration,
    /// Busy limit: longest a collective waits on peers that are alive but do not join it (rank 0
    /// saving a model or evaluating alone, or a hung rank). Never shorter than
    /// [`CpuCommOptions::timeout`]. Peers count as alive through [`CpuCommOptions::liveness`];
    /// without it, only a peer that sends keep-alives or, over shared memory, whose process runs.
    pub busy_timeout: Duration,
    /// This rank's heartbeat and its view of the others' (set by
    /// [`crate::comm::join::join`]); `None` when the communicator is built directly on a store.
    pub liveness: Option<Arc<Liveness>>,
    /// Payload bytes per data frame; collectives are pipelined in chunks of this size. Over
    /// shared memory it is the size of the pieces staged per rank and round (capped so that a
    /// rank's staging slot stays within a few MiB whatever the world size).
    pub chunk_bytes: usize,
    /// Address this rank listens on for its ring predecessor and publishes to the others:
    /// loopback for single-machine jobs, this machine's address otherwise
    /// ([`crate::comm::TcpStoreClient::local_addr`] gives the one that reaches the store).
    pub bind_ip: IpAddr,
    /// TCP, shared memory, or shared memory when possible (the default). Every rank of a job
    /// must make the same choice.
    pub transport: TransportChoice,
}

impl PartialEq for CpuCommOptions {
    /// Equal settings and the same liveness monitor (by identity).
    fn eq(&self, other: &Self) -> bool {
        let same_liveness = match (&self.liveness, &other.liveness) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        self.timeout == other.timeout
            && self.busy_timeout == other.busy_timeout
            && self.chunk_bytes == other.chunk_bytes
            && self.bind_ip == other.bind_ip
            && self.transport == other.transport
            && same_liveness
    }
}

impl Eq for CpuCommOptions {}

impl Default for CpuCommOptions {
    /// 300 s silence limit, 30 min busy limit, no liveness monitor, 512 KiB chunks, loopback,
    /// automatic transport. Ignores the environment; see [`CpuCommOptions::from_env`].
    fn default() -> Self {
        Self {
            timeout: DEFAULT_COLLECTIVE_TIMEOUT,
            busy_timeout: DEFAULT_BUSY_PEER_TIMEOUT,
            liveness: None,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            bind_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            transport: TransportChoice::Auto,
        }
    }
}

impl CpuCommOptions {
    /// The defaults, with the silence limit taken from `ACCELERATE_COLLECTIVE_TIMEOUT`, the busy
    /// limit from `ACCELERATE_BUSY_PEER_TIMEOUT` and the transport from
    /// `ACCELERATE_CPU_TRANSPORT` when set.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// [`CpuCommOptions::from_env`] over any source of variables (tests pass a map instead of
    /// changing the process environment, which other test threads read).
    pub(crate) fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut options = Self::default();
        if let Some(value) = lookup(COLLECTIVE_TIMEOUT) {
            options.timeout = parse_timeout(&value)?;
        }
        if let Some(value) = lookup(BUSY_PEER_TIMEOUT) {
            options.busy_timeout = parse_seconds(BUSY_PEER_TIMEOUT, &value)?;
        }
        if let Some(value) = lookup(CPU_TRANSPORT) {
            options.transport = parse_transport(&value)?;
        }
        Ok(options)
    }

    /// The busy limit in force: [`CpuCommOptions::busy_timeout`], or the silence limit if that
    /// is longer (raising `ACCELERATE_COLLECTIVE_TIMEOUT` alone still makes every wait longer).
    pub fn busy_limit(&self) -> Duration {
        self.busy_timeout.max(self.timeout)
    }

    /// Checks that the options can work.
    pub fn validate(&self) -> Result<()> {
        if self.timeout.is_zero() {
            return Err(Error::Config(format!(
                "CpuCommOptions::timeout is zero; use a positive duration (default \
                 {DEFAULT_COLLECTIVE_TIMEOUT:?}, or {COLLECTIVE_TIMEOUT}=<seconds>)"
            )));
        }
        if self.chunk_bytes < 8 {
            return Err(Error::Config(format!(
                "CpuCommOptions::chunk_bytes is {}; it must hold at least one 8-byte element \
                 (default {DEFAULT_CHUNK_BYTES})",
                self.chunk_bytes
            )));
        }
        if self.bind_ip.is_unspecified() {
            return Err(Error::Config(format!(
                "CpuCommOptions::bind_ip is {}, which the other ranks cannot connect to; use \
                 127.0.0.1 on one machine, or this machine's address on several \
                 (TcpStoreClient::local_addr gives the one that reaches the store)",
                self.bind_ip
            )));
        }
        Ok(())
    }
}

/// Parses a timeout in seconds (fractions allowed) as given in `ACCELERATE_COLLECTIVE_TIMEOUT`.
pub fn parse_timeout(value: &str) -> Result<Duration> {
    parse_seconds(COLLECTIVE_TIMEOUT, value)
}

/// Parses a positive number of seconds given in the environment variable `name`.
fn parse_seconds(name: &str, value: &str) -> Result<Duration> {
    let seconds: Option<f64> = value.trim().parse().ok();
    match seconds {
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
        _ => Err(Error::Env {
            name: name.into(),
            value: value.into(),
            problem: "expected a positive number of seconds, e.g. 600 or 2.5".into(),
        }),
    }
}

/// Parses a transport choice as given in `ACCELERATE_CPU_TRANSPORT` (case-insensitive; empty
/// means `auto`).
pub fn parse_transport(value: &str) -> Result<TransportChoice> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(TransportChoice::Auto),
        "tcp" => Ok(TransportChoice::Tcp),
        "shm" => Ok(TransportChoice::Shm),
        _ => Err(Error::Env {
            name: CPU_TRANSPORT.into(),
            value: value.into(),
            problem: "expected auto (shared memory when every rank is on this machine, TCP \
                      otherwise), tcp or shm"
                .into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_parse_as_seconds() {
        assert_eq!(parse_timeout("600").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_timeout(" 2.5 ").unwrap(), Duration::from_millis(2500));
        for bad in ["", "0", "-3", "ten", "inf", "NaN"] {
            let err = parse_timeout(bad).unwrap_err().to_string();
            assert!(err.contains(COLLECTIVE_TIMEOUT), "{err}");
        }
    }

    #[test]
    fn transports_parse_from_the_environment_variable() {
        assert_eq!(parse_transport("auto").unwrap(), TransportChoice::Auto);
        assert_eq!(parse_transport("").unwrap(), TransportChoice::Auto);
        assert_eq!(parse_transport(" TCP ").unwrap(), TransportChoice::Tcp);
        assert_eq!(parse_transport("shm").unwrap(), TransportChoice::Shm);
        let err = parse_transport("rdma").unwrap_err().to_string();
        assert!(err.contains(CPU_TRANSPORT) && err.contains("rdma"), "{err}");

        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let none = CpuCommOptions::from_lookup(env(&[])).unwrap();
        assert_eq!(none.transport, TransportChoice::Auto);
        let tcp = CpuCommOptions::from_lookup(env(&[(CPU_TRANSPORT, "tcp")])).unwrap();
        assert_eq!(tcp.transport, TransportChoice::Tcp);
        assert_eq!(tcp.timeout, DEFAULT_COLLECTIVE_TIMEOUT);
        let both =
            CpuCommOptions::from_lookup(env(&[(CPU_TRANSPORT, "shm"), (COLLECTIVE_TIMEOUT, "7")]))
                .unwrap();
        assert_eq!(
            (both.transport, both.timeout),
            (TransportChoice::Shm, Duration::from_secs(7))
        );
        assert_eq!(both.busy_limit(), DEFAULT_BUSY_PEER_TIMEOUT);
        let busy = CpuCommOptions::from_lookup(env(&[
            (COLLECTIVE_TIMEOUT, "1"),
            (BUSY_PEER_TIMEOUT, "3.5"),
        ]))
        .unwrap();
        assert_eq!(busy.busy_limit(), Duration::from_millis(3500));
        let long_silence = CpuCommOptions::from_lookup(env(&[(COLLECTIVE_TIMEOUT, "7200")]));
        assert_eq!(
            long_silence.unwrap().busy_limit(),
            Duration::from_secs(7200),
            "raising the silence limit alone raises the busy limit with it"
        );
        let err = CpuCommOptions::from_lookup(env(&[(BUSY_PEER_TIMEOUT, "soon")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(BUSY_PEER_TIMEOUT), "{err}");
        assert!(CpuCommOptions::from_lookup(env(&[(CPU_TRANSPORT, "udp")])).is_err());
    }

    #[test]
    fn unusable_options_are_rejected_with_the_field_named() {
        assert!(CpuCommOptions::default().validate().is_ok());
        let zero = CpuCommOptions {
            timeout: Duration::ZERO,
            ..Default::default()
        };
        assert!(zero.validate().unwrap_err().to_string().contains("timeout"));
        let tiny = CpuCommOptions {
            chunk_bytes: 4,
            ..Default::default()
        };
        assert!(tiny
            .validate()
            .unwrap_err()
            .to_string()
            .contains("chunk_bytes"));
        let any = CpuCommOptions {
            bind_ip: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            ..Default::default()
        };
        assert!(any.validate().unwrap_err().to_string().contains("bind_ip"));
    }
}
