//! Admission of a new connection: the handshake in which client and server prove to each other
//! that they hold the job token (`super::super::auth`), the client's generation, and the bound on
//! connections that are still in their handshake.
//!
//! At most `pending_limit` connections may be in their handshake at once. One more closes one of
//! them: the oldest that has not yet sent a complete frame, or, when every one has, the oldest.
//! A connection told to close first takes in whatever has already arrived, and when that holds
//! a complete frame it is served (and counted again) instead of closed: a rank whose hello was
//! on its way when a flood of idle connections came in is never the one evicted. The handshake
//! frames are read into a buffer of the connection's own, so being told to close never loses
//! bytes in the middle of a frame.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::super::auth;
use super::super::wire::{
    decode, encode, split_frame, write_frame_async, Peer, Request, Response, HELLO_FRAME_LIMIT,
    PROTOCOL_VERSION,
};
use super::{lock, stale_message, Farewell, Scope, Shared, HELLO_TIMEOUT};

/// The connections in their handshake, oldest first, each with the means to close it.
#[derive(Default)]
pub(super) struct PendingHellos {
    next_id: u64,
    waiting: VecDeque<Waiting>,
}

struct Waiting {
    id: u64,
    /// Whether it has sent a complete frame: an idle connection is closed before such a one.
    spoke: bool,
    close: oneshot::Sender<()>,
}

impl PendingHellos {
    /// Registers a new connection; past `limit`, one of them is told to close.
    pub(super) fn admit(&mut self, limit: usize) -> (u64, oneshot::Receiver<()>) {
        let id = self.next_id;
        self.next_id += 1;
        (id, self.push(id, false, limit))
    }

    /// Registers again a connection that was told to close but had a complete frame waiting,
    /// which was served: it now counts as one that spoke.
    fn readmit(&mut self, id: u64, limit: usize) -> oneshot::Receiver<()> {
        self.push(id, true, limit)
    }

    fn push(&mut self, id: u64, spoke: bool, limit: usize) -> oneshot::Receiver<()> {
        let (close, closed) = oneshot::channel();
        self.waiting.push_back(Waiting { id, spoke, close });
        while self.waiting.len() > limit {
            let victim = self.waiting.iter().position(|w| !w.spoke).unwrap_or(0);
            if let Some(victim) = self.waiting.remove(victim) {
                let _ = victim.close.send(());
            }
        }
        closed
    }

    /// Records that connection `id` sent a complete frame.
    fn spoke(&mut self, id: u64) {
        if let Some(w) = self.waiting.iter_mut().find(|w| w.id == id) {
            w.spoke = true;
        }
    }

    fn remove(&mut self, id: u64) {
        if let Some(i) = self.waiting.iter().position(|w| w.id == id) {
            self.waiting.remove(i);
        }
    }
}

/// Takes a connection off the pending list when its handshake ends, however it ends.
struct PendingGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        lock(&self.shared.pending).remove(self.id);
    }
}

/// How a handshake ended without admitting the connection.
pub(super) enum Ended {
    /// The client left, or the connection was closed to make room: nothing to say.
    Silently,
    /// The client is refused for this reason, which it is told.
    Refused(String),
}

/// What an admitted connection is: the keys it works on, and the farewell a launcher leaves.
pub(super) type Admitted = (Scope, Option<Farewell>);

/// Runs the handshake of a new connection (registered as pending under `id`, told through
/// `evicted` when it must make room) within [`HELLO_TIMEOUT`].
pub(super) async fn admit(
    stream: &mut TcpStream,
    peer: SocketAddr,
    shared: &Arc<Shared>,
    id: u64,
    evicted: oneshot::Receiver<()>,
) -> Result<Admitted, Ended> {
    let _pending = PendingGuard { shared, id };
    let mut handshake = Handshake {
        stream,
        peer,
        shared,
        id,
        evicted: Some(evicted),
        buffer: Vec::new(),
    };
    match tokio::time::timeout(HELLO_TIMEOUT, handshake.run()).await {
        Ok(outcome) => outcome,
        Err(_) => Err(Ended::Refused(format!(
            "no complete handshake within {HELLO_TIMEOUT:?}"
        ))),
    }
}

struct Handshake<'a> {
    stream: &'a mut TcpStream,
    peer: SocketAddr,
    shared: &'a Arc<Shared>,
    id: u64,
    /// Resolves when the connection must make room; `None` once it was told (or cannot be).
    evicted: Option<oneshot::Receiver<()>>,
    /// Bytes read and not yet taken as a frame.
    buffer: Vec<u8>,
}

impl Handshake<'_> {
    async fn run(&mut self) -> Result<Admitted, Ended> {
        let first = self.frame().await?;
        lock(&self.shared.pending).spoke(self.id);
        let client_nonce = match decode::<Request>(&first) {
            Ok(Request::Hello { version, nonce }) if version == PROTOCOL_VERSION => nonce,
            Ok(Request::Hello { version, .. }) => return Err(other_version(version)),
            Ok(Request::HelloV1 { .. } | Request::LauncherHelloV1 { .. }) => {
                return Err(other_version(1))
            }
            Ok(_) => {
                return Err(Ended::Refused(
                    "the first frame of a connection must be a hello".into(),
                ))
            }
            Err(e) => return Err(Ended::Refused(e)),
        };
        let token = &self.shared.token;
        let server_nonce = auth::nonce();
        let challenge = Response::Challenge {
            version: PROTOCOL_VERSION,
            nonce: server_nonce,
            proof: auth::server_proof(token, &client_nonce, &server_nonce),
        };
        let frame = encode(&challenge).map_err(Ended::Refused)?;
        if write_frame_async(self.stream, &frame).await.is_err() {
            return Err(Ended::Silently);
        }
        let second = match self.frame().await {
            Ok(second) => second,
            Err(Ended::Silently) => {
                // A client checks the store's proof before it proves anything itself: one that
                // leaves here found the proof wrong.
                tracing::warn!(
                    "rendezvous store: the client at {} left after the store proved that it \
                     holds the job token: it has another token, or is not a client of this job",
                    self.peer
                );
                return Err(Ended::Silently);
            }
            Err(e) => return Err(e),
        };
        let (proof, claimed) = match decode::<Request>(&second) {
            Ok(Request::Prove { proof, peer }) => (proof, peer),
            Ok(_) => {
                return Err(Ended::Refused(
                    "the second frame of a connection must prove that it holds the job token"
                        .into(),
                ))
            }
            Err(e) => return Err(Ended::Refused(e)),
        };
        if !auth::client_proof_holds(token, &client_nonce, &server_nonce, &claimed, &proof) {
            return Err(Ended::Refused(match claimed {
                Peer::Worker { rank, .. } => format!(
                    "rank {rank} presented a wrong job token; workers must use the token the \
                     launcher passed in ACCELERATE_JOB_TOKEN"
                ),
                Peer::Launcher { machine, .. } => format!(
                    "the launcher of machine {machine} presented a wrong job token; every \
                     machine's launcher must run with the same ACCELERATE_JOB_TOKEN"
                ),
            }));
        }
        if !self.buffer.is_empty() {
            // A client waits for its welcome; bytes sent before it are a replay or a bug.
            return Err(Ended::Refused(
                "a request arrived before the store welcomed the connection".into(),
            ));
        }
        match claimed {
            Peer::Worker { generation, .. } => {
                let current = self.shared.generation();
                if generation != current {
                    return Err(Ended::Refused(stale_message(generation, current)));
                }
                Ok((Scope::Worker { generation }, None))
            }
            Peer::Launcher {
                farewell_log,
                farewell,
                ..
            } => {
                let farewell = Farewell {
                    shared: self.shared.clone(),
                    log: farewell_log,
                    value: farewell,
                };
                Ok((Scope::Launcher, Some(farewell)))
            }
        }
    }

    /// The next handshake frame. When the connection is told to make room meanwhile, it is
    /// served only if a complete frame has already arrived.
    async fn frame(&mut self) -> Result<Vec<u8>, Ended> {
        loop {
            if let Some(body) = self.take_frame()? {
                // Told to make room after the frame came in, but before this looked: served
                // all the same, and counted again.
                if self.told_to_close() {
                    self.count_again();
                }
                return Ok(body);
            }
            let mut chunk = [0u8; 4096];
            let Self {
                stream, evicted, ..
            } = self;
            let told = async {
                match evicted {
                    Some(evicted) => evicted.await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            // Biased: bytes that are there are taken before an eviction is looked at.
            let told = tokio::select! {
                biased;
                read = stream.read(&mut chunk) => match read {
                    Ok(0) | Err(_) => return Err(Ended::Silently),
                    Ok(n) => {
                        self.buffer.extend_from_slice(&chunk[..n]);
                        false
                    }
                },
                told = told => {
                    self.evicted = None;
                    told
                }
            };
            if told {
                return self.last_chance();
            }
        }
    }

    /// Told to make room: takes in what has already arrived, without waiting, and serves a
    /// complete frame if there is one (registering the connection again, as one that spoke);
    /// otherwise the connection closes.
    fn last_chance(&mut self) -> Result<Vec<u8>, Ended> {
        let mut chunk = [0u8; 4096];
        loop {
            match self.stream.try_read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => self.buffer.extend_from_slice(&chunk[..n]),
                Err(_) => break, // WouldBlock: nothing more has arrived
            }
        }
        if let Some(body) = self.take_frame()? {
            self.count_again();
            return Ok(body);
        }
        tracing::warn!(
            "rendezvous store: closing the connection from {}, which has not finished its \
             handshake, to make room: more than {} connections are in theirs",
            self.peer,
            self.shared.pending_limit
        );
        Err(Ended::Silently)
    }

    /// Whether the connection has been told to make room (and not yet looked at it).
    fn told_to_close(&mut self) -> bool {
        let Some(evicted) = &mut self.evicted else {
            return false;
        };
        match evicted.try_recv() {
            Ok(()) => true,
            Err(oneshot::error::TryRecvError::Empty) => false,
            Err(oneshot::error::TryRecvError::Closed) => {
                self.evicted = None;
                false
            }
        }
    }

    /// Registers the connection again, as one that spoke, after it was told to make room but
    /// had a complete frame, which is served.
    fn count_again(&mut self) {
        let limit = self.shared.pending_limit;
        self.evicted = Some(lock(&self.shared.pending).readmit(self.id, limit));
    }

    /// Splits the first complete frame off the buffer, if there is one.
    fn take_frame(&mut self) -> Result<Option<Vec<u8>>, Ended> {
        match split_frame(&self.buffer, HELLO_FRAME_LIMIT) {
            Ok(Some((body, used))) => {
                self.buffer.drain(..used);
                Ok(Some(body))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(Ended::Refused(e.to_string())),
        }
    }
}

fn other_version(client: u32) -> Ended {
    Ended::Refused(format!(
        "this client speaks version {client} of the rendezvous store's protocol and the store \
         version {PROTOCOL_VERSION}: run every process of the job (launchers and workers) with \
         the same accelerate-rs version"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_connection_is_evicted_before_one_that_spoke() {
        let mut pending = PendingHellos::default();
        let (rank, mut rank_closed) = pending.admit(2);
        pending.spoke(rank);
        let (_idle, mut idle_closed) = pending.admit(2);
        // A third connection: the idle one goes, although the rank's connection is older.
        let (newest, mut newest_closed) = pending.admit(2);
        assert_eq!(idle_closed.try_recv(), Ok(()));
        assert!(rank_closed.try_recv().is_err());
        assert!(newest_closed.try_recv().is_err());
        // A connection that had a frame waiting when it was told to close comes back as one
        // that spoke; with no idle one left, the oldest goes.
        pending.spoke(newest);
        let _again = pending.readmit(99, 2);
        assert_eq!(rank_closed.try_recv(), Ok(()));
        assert!(newest_closed.try_recv().is_err());
    }
}
