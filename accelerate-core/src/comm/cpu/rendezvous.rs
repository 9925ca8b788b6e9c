//! Finding the ring neighbours through the store and connecting to them.
//!
//! Each rank listens on an ephemeral port and publishes a card (address, a random nonce, its view
//! of the world size) in the store. It connects to its successor and introduces itself with the
//! successor's nonce; it accepts from its predecessor only a connection that presents its own
//! nonce. The nonces travel only through the store, which requires the job token, so a stray
//! connection to the port cannot take a neighbour's place; such connections are dropped and the
//! rank keeps waiting for the real one.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::options::CpuCommOptions;
use super::transport::RingLinks;
use crate::comm::keys::{KeySpace, CPU_COMM};
use crate::comm::store::Store;
use crate::error::{Error, Result};

/// Identifies a hello on a ring connection (and its version).
const HELLO_MAGIC: [u8; 4] = *b"ACR1";
/// magic, from rank, world size, instance, nonce.
pub(crate) const HELLO_BYTES: usize = 4 + 8 + 8 + 8 + 16;
/// The byte a listener answers an accepted hello with.
const ACCEPTED: u8 = 1;
/// Pause between polls of the listener and between connection attempts.
const POLL: Duration = Duration::from_millis(2);

/// What a rank publishes about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PeerCard {
    /// Where it listens for its predecessor.
    pub addr: SocketAddr,
    /// What its predecessor must present.
    pub nonce: u128,
    /// Its view of the world size.
    pub world_size: u64,
}

impl PeerCard {
    /// The card as published in the store.
    pub(crate) fn encode(&self) -> Vec<u8> {
        bincode::serialize(self).expect("a card of fixed-size fields always serializes")
    }

    /// Reads a card published in the store; `Err` says what is malformed.
    pub(crate) fn decode(bytes: &[u8]) -> std::result::Result<Self, String> {
        bincode::deserialize(bytes).map_err(|e| e.to_string())
    }
}

/// Connects `rank` to its ring neighbours; `options.timeout` bounds the whole setup. `instance`
/// (from [`next_instance`]) keeps the keys of successive communicators apart.
pub(crate) fn connect_ring(
    store: &dyn Store,
    rank: usize,
    world_size: usize,
    instance: u64,
    options: &CpuCommOptions,
) -> Result<RingLinks> {
    let deadline = Instant::now() + options.timeout;
    let next = (rank + 1) % world_size;
    let prev = (rank + world_size - 1) % world_size;
    let card_key = |r: usize| KeySpace::of(CPU_COMM, instance).key(&format!("rank{r}"));

    let listener = TcpListener::bind((options.bind_ip, 0)).map_err(|source| Error::Network {
        context: format!(
            "rank {rank}: listening on {} for the ring connection; set CpuCommOptions::bind_ip \
             to an address of this machine",
            options.bind_ip
        ),
        source,
    })?;
    let addr = listener.local_addr().map_err(|source| Error::Network {
        context: format!("rank {rank}: reading the ring listener's address"),
        source,
    })?;
    let nonce: u128 = rand::random();
    let card = PeerCard {
        addr,
        nonce,
        world_size: world_size as u64,
    };
    store.set(&card_key(rank), &card.encode())?;

    let next_card = read_card(
        store,
        &card_key(next),
        next,
        rank,
        world_size,
        deadline,
        options,
    )?;
    let mut to_next = connect_to(next_card.addr, next, rank, deadline, options)?;
    let hello = Hello {
        from: rank as u64,
        world_size: world_size as u64,
        instance,
        nonce: next_card.nonce,
    }
    .encode();
    to_next
        .write_all(&hello)
        .map_err(|e| disconnect(next, rank, "sending the ring hello to", e))?;

    let expected = Hello {
        from: prev as u64,
        world_size: world_size as u64,
        instance,
        nonce,
    };
    let from_prev = accept_from(&listener, prev, rank, &expected, deadline, options)?;

    // Only now wait for our successor's acceptance: it accepts after sending its own hello, so
    // nobody waits on a rank that is itself waiting.
    set_timeout(&to_next, remaining(deadline), next, rank)?;
    let mut ack = [0u8; 1];
    match to_next.read_exact(&mut ack) {
        Ok(()) if ack[0] == ACCEPTED => {}
        Ok(()) => {
            return Err(Error::Collective {
                op: "connect",
                peer: Some(next),
                problem: format!("rank {next} answered the ring hello with {}", ack[0]),
            })
        }
        Err(e) if is_timeout(&e) => return Err(setup_timeout(next, rank, options, "accept")),
        Err(e) => return Err(disconnect(next, rank, "waiting for the acceptance of", e)),
    }

    // Reads and writes time out every survey period, when the collective judges its peers (see
    // `transport`), not after the whole limit.
    let poll = crate::comm::liveness::beat_period(options.timeout);
    for (stream, peer) in [(&to_next, next), (&from_prev, prev)] {
        stream
            .set_nodelay(true)
            .map_err(|e| disconnect(peer, rank, "configuring the connection to", e))?;
        set_timeout(stream, poll, peer, rank)?;
    }
    Ok(RingLinks {
        to_next,
        from_prev,
        busy: options.busy_limit(),
        liveness: options.liveness.clone(),
    })
}

/// Numbers the communicators this rank creates on `store` (1, 2, ...). Communicators created one
/// after another on the same store must not see each other's keys: every rank counts its own
/// communicators, and all ranks create them in the same order, so the numbers agree.
pub(crate) fn next_instance(store: &dyn Store, rank: usize) -> Result<u64> {
    Ok(KeySpace::next(store, CPU_COMM, rank)?.instance())
}

fn read_card(
    store: &dyn Store,
    key: &str,
    peer: usize,
    rank: usize,
    world_size: usize,
    deadline: Instant,
    options: &CpuCommOptions,
) -> Result<PeerCard> {
    let bytes = match store.get(key, remaining(deadline)) {
        Ok(bytes) => bytes,
        Err(Error::Timeout { .. }) => return Err(setup_timeout(peer, rank, options, "publish")),
        Err(e) => return Err(e),
    };
    let card = PeerCard::decode(&bytes).map_err(|e| {
        Error::Store(format!(
            "rank {rank}: the ring address of rank {peer} under {key:?} is unreadable ({e}); \
             another program may be using the same store keys"
        ))
    })?;
    if card.world_size != world_size as u64 {
        return Err(Error::Config(format!(
            "rank {peer} was started with world size {} but rank {rank} with {world_size}; all \
             processes of a job must agree (check WORLD_SIZE / --num-processes)",
            card.world_size
        )));
    }
    Ok(card)
}

fn connect_to(
    addr: SocketAddr,
    peer: usize,
    rank: usize,
    deadline: Instant,
    options: &CpuCommOptions,
) -> Result<TcpStream> {
    loop {
        let left = remaining(deadline);
        match TcpStream::connect_timeout(&addr, left) {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() + POLL >= deadline => {
                return Err(Error::Network {
                    context: format!(
                        "rank {rank}: connecting to rank {peer} at {addr} for the ring (retried \
                         for {:?}); check that the ranks can reach each other and that \
                         CpuCommOptions::bind_ip is an address the others can reach",
                        options.timeout
                    ),
                    source: e,
                })
            }
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

/// The first bytes on a ring connection: who connects, and the proof that it belongs to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    /// The connecting rank.
    pub from: u64,
    /// Its view of the world size.
    pub world_size: u64,
    /// The communicator instance it connects for.
    pub instance: u64,
    /// The nonce the accepting rank published.
    pub nonce: u128,
}

impl Hello {
    /// The hello as sent: magic, then the fields, little-endian.
    pub(crate) fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut out = [0u8; HELLO_BYTES];
        out[..4].copy_from_slice(&HELLO_MAGIC);
        out[4..12].copy_from_slice(&self.from.to_le_bytes());
        out[12..20].copy_from_slice(&self.world_size.to_le_bytes());
        out[20..28].copy_from_slice(&self.instance.to_le_bytes());
        out[28..44].copy_from_slice(&self.nonce.to_le_bytes());
        out
    }
}

/// Reads a hello; `None` when the bytes do not start with the magic (not our protocol).
pub(crate) fn parse_hello(bytes: &[u8; HELLO_BYTES]) -> Option<Hello> {
    if bytes[..4] != HELLO_MAGIC {
        return None;
    }
    let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    Some(Hello {
        from: u64_at(4),
        world_size: u64_at(12),
        instance: u64_at(20),
        nonce: u128::from_le_bytes(bytes[28..44].try_into().expect("16 bytes")),
    })
}

/// Accepts the ring connection of `prev`: the first connection on `listener` whose hello equals
/// `expected`. Other connections (stray, of another job, instance or round) are dropped; after
/// `deadline` the wait fails with a timeout naming `prev`.
pub(crate) fn accept_from(
    listener: &TcpListener,
    prev: usize,
    rank: usize,
    expected: &Hello,
    deadline: Instant,
    options: &CpuCommOptions,
) -> Result<TcpStream> {
    listener
        .set_nonblocking(true)
        .map_err(|source| Error::Network {
            context: format!("rank {rank}: configuring the ring listener"),
            source,
        })?;
    loop {
        if Instant::now() >= deadline {
            return Err(setup_timeout(prev, rank, options, "connect"));
        }
        let (mut stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(POLL);
                continue;
            }
            // A connection that was reset before we took it, or a signal: keep listening.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(source) => {
                return Err(Error::Network {
                    context: format!("rank {rank}: accepting the ring connection of rank {prev}"),
                    source,
                })
            }
        };
        // A stray or slow connection must not block the real one for long.
        let patience = remaining(deadline).min(Duration::from_secs(5));
        let mut raw = [0u8; HELLO_BYTES];
        let hello = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(patience)))
            .and_then(|()| stream.read_exact(&mut raw))
            .ok()
            .and_then(|()| parse_hello(&raw));
        match hello {
            Some(hello) if hello == *expected => {
                stream
                    .write_all(&[ACCEPTED])
                    .map_err(|e| disconnect(prev, rank, "accepting the connection of", e))?;
                return Ok(stream);
            }
            other => {
                tracing::warn!(
                    "rank {rank}: dropping a ring connection from {from} that is not rank \
                     {prev} of this job ({other:?})"
                );
            }
        }
    }
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

fn set_timeout(stream: &TcpStream, timeout: Duration, peer: usize, rank: usize) -> Result<()> {
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| disconnect(peer, rank, "configuring the connection to", e))
}

fn setup_timeout(peer: usize, rank: usize, options: &CpuCommOptions, step: &str) -> Error {
    Error::Timeout {
        what: format!("rank {peer} to {step} its ring connection (seen from rank {rank})"),
        after: options.timeout,
        hint: format!(
            "rank {peer} may have failed to start or be stuck before creating its communicator; \
             {}",
            super::transport::timeout_hint()
        ),
    }
}

fn disconnect(peer: usize, rank: usize, doing: &str, e: std::io::Error) -> Error {
    Error::Collective {
        op: "connect",
        peer: Some(peer),
        problem: format!("rank {rank}: {doing} rank {peer} failed: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellos_parse_back_and_foreign_bytes_do_not() {
        let mut raw = [0u8; HELLO_BYTES];
        raw[..4].copy_from_slice(&HELLO_MAGIC);
        raw[4..12].copy_from_slice(&3u64.to_le_bytes());
        raw[12..20].copy_from_slice(&4u64.to_le_bytes());
        raw[20..28].copy_from_slice(&1u64.to_le_bytes());
        raw[28..44].copy_from_slice(&77u128.to_le_bytes());
        let expected = Hello {
            from: 3,
            world_size: 4,
            instance: 1,
            nonce: 77,
        };
        assert_eq!(parse_hello(&raw), Some(expected));
        raw[0] = b'G';
        assert_eq!(parse_hello(&raw), None);
    }
}
