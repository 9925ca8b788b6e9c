//! The blocking store client used inside training processes.
//!
//! Plain `std::net`: its callers (communicator setup, barriers) are blocking code, and a training
//! process should not need an async runtime just to rendezvous.

use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::auth;
use super::wire::{decode, encode, read_frame, write_frame, FrameError, Peer, Request, Response};
use super::wire::{HELLO_FRAME_LIMIT, MAX_FRAME_BYTES, PROTOCOL_VERSION};
use super::Store;
use crate::error::{Error, Result};

/// How long the second try of a handshake that the server cut off may take to connect: the store
/// was there a moment ago, so a store that does not answer now has most likely exited.
const SECOND_HELLO_DIAL: Duration = Duration::from_secs(2);

/// Pause between connection attempts while the server is not up yet (doubling up to the cap).
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(10);
const MAX_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// A connection to a rendezvous store ([`super::StoreServer`]).
///
/// Requests from several threads are serialized on the one connection. After an I/O failure the
/// connection is not reused (a late reply could be mistaken for the answer to a later request):
/// every later request fails with the original cause.
#[derive(Debug)]
pub struct TcpStoreClient {
    addr: SocketAddr,
    local_addr: SocketAddr,
    rank: usize,
    /// Who this client is in messages: "rank 3", or "the launcher of machine 1".
    who: String,
    request_timeout: Duration,
    connection: Mutex<Connection>,
    /// A second handle of the socket, to close it while another thread waits on it.
    closer: TcpStream,
}

#[derive(Debug)]
struct Connection {
    stream: TcpStream,
    /// Why the connection is unusable, once it is.
    broken: Option<String>,
    /// Whether the server refused this client (as opposed to the connection failing): a new
    /// connection would be refused too.
    refused: bool,
}

/// What a rank dials the store with: the store's address and the rank's credentials (the job's
/// token, the restart generation it belongs to, its rank). Kept together so that a rank can dial
/// again with the same ones ([`super::RedialingClient`]).
#[derive(Debug, Clone)]
pub struct StoreDial {
    /// The store's address.
    pub addr: SocketAddr,
    /// The job's token, which client and store prove to each other.
    pub token: String,
    /// The restart generation the rank belongs to; a store of another generation refuses it.
    pub generation: u64,
    /// The rank dialling.
    pub rank: usize,
}

impl StoreDial {
    /// A connection with these credentials, as [`TcpStoreClient::connect`] makes it.
    pub fn connect(&self, timeout: Duration) -> Result<TcpStoreClient> {
        TcpStoreClient::connect(self.addr, &self.token, self.generation, self.rank, timeout)
    }
}

impl TcpStoreClient {
    /// Connects to the store at `addr`, proves that it holds `token` (and checks that the store
    /// does too) and presents `generation`, retrying until `timeout` while nobody listens there
    /// yet (the server may start after the workers).
    ///
    /// `timeout` also bounds how long any later `set` or `add` waits for its reply. A refusal
    /// by the server (wrong token, stale generation), or a server that cannot prove it holds
    /// the token, is returned at once, without retrying. A connection that the server closes
    /// during the handshake (as it does to make room when many connections arrive at once) is
    /// tried once more.
    pub fn connect(
        addr: SocketAddr,
        token: &str,
        generation: u64,
        rank: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let peer = Peer::Worker {
            generation,
            rank: rank as u64,
        };
        Self::connect_as(addr, token, peer, rank, format!("rank {rank}"), timeout)
    }

    /// Connects the launcher of machine `machine` to the store at `addr` for the launchers'
    /// control keys, which every generation shares (restarts are coordinated through them),
    /// retrying until `timeout` while nobody listens there yet. The handshake is
    /// [`TcpStoreClient::connect`]'s.
    ///
    /// When this connection closes, however it closes (the launcher exits or is killed, the
    /// network breaks), the server appends `farewell` to the list `farewell_log` (see
    /// [`TcpStoreClient::append`]); an empty `farewell` appends nothing.
    pub fn connect_launcher(
        addr: SocketAddr,
        token: &str,
        machine: usize,
        farewell_log: &str,
        farewell: Vec<u8>,
        timeout: Duration,
    ) -> Result<Self> {
        let peer = Peer::Launcher {
            machine: machine as u64,
            farewell_log: farewell_log.to_string(),
            farewell,
        };
        let who = format!("the launcher of machine {machine}");
        Self::connect_as(addr, token, peer, machine, who, timeout)
    }

    fn connect_as(
        addr: SocketAddr,
        token: &str,
        peer: Peer,
        rank: usize,
        who: String,
        timeout: Duration,
    ) -> Result<Self> {
        let timeout = timeout.max(Duration::from_millis(1));
        let deadline = Instant::now() + timeout;
        let mut closed_before = None;
        loop {
            let dial_until = match closed_before {
                None => deadline,
                Some(_) => deadline.min(Instant::now() + SECOND_HELLO_DIAL),
            };
            let stream = dial(addr, &who, timeout, dial_until)?;
            let client = Self::over(stream, addr, rank, who.clone(), timeout)?;
            match client.handshake(token, &peer, timeout) {
                Ok(()) => return Ok(client),
                Err(Handshake::Closed(cause)) => match closed_before {
                    None => {
                        tracing::debug!(
                            "{who}: the store at {addr} closed the connection during the \
                             handshake ({cause}); saying hello once more"
                        );
                        closed_before = Some(cause);
                    }
                    Some(first) => {
                        return Err(Error::Store(format!(
                            "{who}: the store at {addr} closed the connection during the \
                             handshake twice ({first}; then {cause}): it may be making room \
                             because too many connections arrive at once (a flood), or it is \
                             exiting"
                        )))
                    }
                },
                Err(Handshake::Failed(e)) => return Err(e),
            }
        }
    }

    /// A client over the connected `stream` (no handshake yet).
    fn over(
        stream: TcpStream,
        addr: SocketAddr,
        rank: usize,
        who: String,
        timeout: Duration,
    ) -> Result<Self> {
        let network = |what: &str, source| Error::Network {
            context: format!("{what} the rendezvous store at {addr} ({who})"),
            source,
        };
        stream
            .set_nodelay(true)
            .map_err(|e| network("configuring the connection to", e))?;
        super::keep_alive(std::os::fd::AsRawFd::as_raw_fd(&stream))
            .map_err(|e| network("enabling keepalive on the connection to", e))?;
        let closer = stream
            .try_clone()
            .map_err(|e| network("duplicating the connection to", e))?;
        let local_addr = stream
            .local_addr()
            .map_err(|e| network("reading the local address of the connection to", e))?;
        Ok(Self {
            addr,
            local_addr,
            rank,
            who,
            request_timeout: timeout,
            connection: Mutex::new(Connection {
                stream,
                broken: None,
                refused: false,
            }),
            closer,
        })
    }

    /// Proves to the store that this client holds `token`, after the store has proven it too;
    /// nothing this client sends depends on the token before that.
    fn handshake(&self, token: &str, peer: &Peer, reply_within: Duration) -> HandshakeResult {
        let client_nonce = auth::nonce();
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            nonce: client_nonce,
        };
        let (server_nonce, proof) = match self.handshake_step(&hello, reply_within)? {
            Response::Challenge {
                version,
                nonce,
                proof,
            } if version == PROTOCOL_VERSION => (nonce, proof),
            Response::Challenge { version, .. } => {
                return Err(self.fail(format!(
                    "the store at {} speaks version {version} of the rendezvous store's \
                     protocol and {} version {PROTOCOL_VERSION}: run every process of the job \
                     (launchers and workers) with the same accelerate-rs version",
                    self.addr, self.who
                )))
            }
            Response::Refused(reason) => {
                let older = if reason.contains("malformed") {
                    "; a store that cannot read the hello runs an older accelerate-rs (protocol \
                     1): run every process of the job with the same version"
                } else {
                    ""
                };
                return Err(self.fail(format!(
                    "the store at {} refused {}: {reason}{older}",
                    self.addr, self.who
                )));
            }
            other => {
                // A fake store's answer could be long: its start says what it was.
                let shown: String = format!("{other:?}").chars().take(80).collect();
                return Err(self.fail(self.not_proven(&shown)));
            }
        };
        if !auth::server_proof_holds(token, &client_nonce, &server_nonce, &proof) {
            return Err(self.fail(self.not_proven("a proof made with another token")));
        }
        let proof = auth::client_proof(token, &client_nonce, &server_nonce, peer)
            .map_err(|e| Handshake::Failed(Error::Store(format!("{}: {e}", self.who))))?;
        let prove = Request::Prove {
            proof,
            peer: peer.clone(),
        };
        match self.handshake_step(&prove, reply_within)? {
            Response::Welcome => Ok(()),
            Response::Refused(reason) => Err(self.fail(format!(
                "the store at {} refused {}: {reason}",
                self.addr, self.who
            ))),
            other => Err(Handshake::Failed(self.unexpected("hello", other))),
        }
    }

    /// Why a store that did not prove it holds the token is left, having been sent `answer`.
    fn not_proven(&self, answer: &str) -> String {
        format!(
            "the store at {} did not prove that it holds this job's token (it answered with \
             {answer}), so {} left without joining it. Either {} has a wrong job token (every \
             rank, and every machine's launcher, must run with the same ACCELERATE_JOB_TOKEN), \
             or the program listening there is not this job's store",
            self.addr, self.who, self.who
        )
    }

    /// Marks the connection refused (a new one would fare no better) and says why.
    fn fail(&self, why: String) -> Handshake {
        let mut connection = self.lock();
        connection.broken = Some(why.clone());
        connection.refused = true;
        Handshake::Failed(Error::Store(why))
    }

    /// Sends one handshake frame and reads the answer, telling a connection that the server
    /// closed (worth one more try) from other failures.
    fn handshake_step(
        &self,
        request: &Request,
        reply_within: Duration,
    ) -> std::result::Result<Response, Handshake> {
        let frame = encode(request)
            .map_err(|e| Handshake::Failed(Error::Store(format!("{}: {e}", self.who))))?;
        let mut connection = self.lock();
        match exchange(
            &mut connection.stream,
            &frame,
            reply_within,
            HELLO_FRAME_LIMIT,
        ) {
            Ok(response) => Ok(response),
            Err(ExchangeError::Closed(cause)) => {
                connection.broken = Some(cause.clone());
                Err(Handshake::Closed(cause))
            }
            Err(ExchangeError::Timeout) => {
                connection.broken = Some("the handshake timed out".into());
                Err(Handshake::Failed(Error::Timeout {
                    what: format!(
                        "the rendezvous store at {} to answer the hello of {}",
                        self.addr, self.who
                    ),
                    after: reply_within,
                    hint: "the store (launcher or rank 0) may be hung or overloaded, or the \
                           program listening there is not a rendezvous store"
                        .into(),
                }))
            }
            Err(ExchangeError::Failed(problem)) => {
                connection.broken = Some(problem.clone());
                Err(Handshake::Failed(Error::Store(format!(
                    "{}: the handshake with the store at {} failed: {problem}",
                    self.who, self.addr
                ))))
            }
        }
    }

    /// Lets later requests wait up to `timeout` for their reply (instead of the connection
    /// timeout given to `connect`).
    pub(super) fn set_request_timeout(&mut self, timeout: Duration) {
        self.request_timeout = timeout;
    }

    /// The address of the store this client talks to.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// This end's address of the connection: its IP is that of the interface which reaches the
    /// store, a good address to publish for peers on other machines.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Closes the connection now, even while another thread waits in a request on it (that
    /// request fails): the server sees the client leave at once (a launcher's farewell is
    /// appended), instead of when the waiting request ends.
    pub fn disconnect(&self) {
        let _ = self.closer.shutdown(std::net::Shutdown::Both);
    }

    /// Whether this connection failed (or was refused) and can no longer be used.
    pub fn is_broken(&self) -> bool {
        self.lock().broken.is_some()
    }

    /// Whether the server refused this client (a wrong token, a stale generation): a new
    /// connection with the same hello would be refused too.
    pub fn is_refused(&self) -> bool {
        self.lock().refused
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.connection.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The rank this client introduced itself as.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Sends one request and reads its reply, waiting at most `reply_within` for it.
    fn request(&self, request: &Request, reply_within: Duration, limit: usize) -> Result<Response> {
        let frame = encode(request).map_err(|e| Error::Store(format!("{}: {e}", self.who)))?;
        let mut connection = self.lock();
        if let Some(cause) = &connection.broken {
            return Err(Error::Store(format!(
                "the connection of {} to the store at {} failed earlier ({cause}); \
                 create a new client",
                self.who, self.addr
            )));
        }
        let result = exchange(&mut connection.stream, &frame, reply_within, limit);
        match result {
            Ok(Response::Refused(reason)) => {
                connection.broken = Some(format!("refused: {reason}"));
                connection.refused = true;
                Err(Error::Store(format!(
                    "the store at {} refused {}: {reason}",
                    self.addr, self.who
                )))
            }
            Ok(response) => Ok(response),
            Err(ExchangeError::Timeout) => {
                connection.broken = Some("a reply timed out".into());
                Err(Error::Timeout {
                    what: format!("a reply from the rendezvous store at {}", self.addr),
                    after: reply_within,
                    hint: "the store (launcher or rank 0) may be hung or overloaded".into(),
                })
            }
            Err(ExchangeError::Failed(problem) | ExchangeError::Closed(problem)) => {
                connection.broken = Some(problem.clone());
                Err(Error::Store(format!(
                    "{}: connection to the store at {} failed: {problem}; the launcher \
                     (or rank 0, which hosts the store) has probably exited",
                    self.who, self.addr
                )))
            }
        }
    }

    fn unexpected(&self, what: &str, response: Response) -> Error {
        let shown = match response {
            Response::Failed(reason) => return Error::Store(format!("{what}: {reason}")),
            Response::Value(v) => format!("a value of {} bytes", v.len()),
            other => format!("{other:?}"),
        };
        Error::Store(format!(
            "unexpected reply to {what} from the store at {}: {shown}; client and server are of \
             different versions",
            self.addr
        ))
    }

    /// Appends `value` to the list `log` and returns its index: the value is stored under
    /// `"{log}/{index}"`, indices counting from 0 in the order the store received the values, and
    /// the key `log` holds the number of entries. Readers follow the list by waiting for
    /// `"{log}/0"`, `"{log}/1"`, ...; an entry can never be missing between two others.
    pub fn append(&self, log: &str, value: &[u8]) -> Result<u64> {
        let request = Request::Append {
            log: log.to_string(),
            value: value.to_vec(),
        };
        match self.request(&request, self.request_timeout, MAX_FRAME_BYTES)? {
            Response::Counter(index) => u64::try_from(index).map_err(|_| {
                self.unexpected(&format!("append to {log:?}"), Response::Counter(index))
            }),
            other => Err(self.unexpected(&format!("append to {log:?}"), other)),
        }
    }

    /// Waits at most `timeout` for `key`; `Ok(None)` when it was not set in time.
    pub fn try_get(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
        let request = Request::Get {
            key: key.to_string(),
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        };
        // The server answers `NotFound` once `timeout` has passed; allow it time to do so.
        let reply_within = timeout.saturating_add(self.request_timeout);
        match self.request(&request, reply_within, MAX_FRAME_BYTES)? {
            Response::Value(value) => Ok(Some(value)),
            Response::NotFound => Ok(None),
            other => Err(self.unexpected(&format!("get {key:?}"), other)),
        }
    }
}

enum ExchangeError {
    Timeout,
    /// The server closed the connection (or reset it).
    Closed(String),
    Failed(String),
}

/// How a handshake failed: a connection the server closed is worth one more try, nothing else.
enum Handshake {
    Closed(String),
    Failed(Error),
}

type HandshakeResult = std::result::Result<(), Handshake>;

/// Opens a TCP connection to `addr`, retrying until `deadline` while nobody listens there.
pub(super) fn dial(
    addr: SocketAddr,
    who: &str,
    timeout: Duration,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut pause = FIRST_RETRY_PAUSE;
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let last_error = match TcpStream::connect_timeout(&addr, remaining.max(pause)) {
            Ok(stream) => return Ok(stream),
            Err(e) => e,
        };
        if Instant::now() + pause >= deadline {
            return Err(Error::Timeout {
                what: format!("the rendezvous store at {addr} to accept {who} ({last_error})"),
                after: timeout,
                hint: "check that the launcher (or rank 0) is running and that MASTER_ADDR/\
                       MASTER_PORT (or --main-process-ip/--main-process-port) point to it"
                    .into(),
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(MAX_RETRY_PAUSE);
    }
}

fn exchange(
    stream: &mut TcpStream,
    frame: &[u8],
    reply_within: Duration,
    limit: usize,
) -> std::result::Result<Response, ExchangeError> {
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => ExchangeError::Timeout,
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted
        | std::io::ErrorKind::BrokenPipe => ExchangeError::Closed(e.to_string()),
        _ => ExchangeError::Failed(e.to_string()),
    };
    stream.set_write_timeout(Some(reply_within)).map_err(io)?;
    stream.set_read_timeout(Some(reply_within)).map_err(io)?;
    write_frame(stream, frame).map_err(io)?;
    let body = read_frame(stream, limit).map_err(|e| match e {
        FrameError::Io(e) => io(e),
        other => ExchangeError::Failed(other.to_string()),
    })?;
    decode(&body).map_err(ExchangeError::Failed)
}

impl Store for TcpStoreClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let request = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        match self.request(&request, self.request_timeout, MAX_FRAME_BYTES)? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(&format!("set {key:?}"), other)),
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.try_get(key, timeout)?.ok_or_else(|| Error::Timeout {
            what: format!("key {key:?} in the rendezvous store at {}", self.addr),
            after: timeout,
            hint: "the process that publishes it may have failed or not reached that point; \
                   check the other ranks' logs"
                .into(),
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let request = Request::Add {
            key: key.to_string(),
            delta,
        };
        match self.request(&request, self.request_timeout, MAX_FRAME_BYTES)? {
            Response::Counter(value) => Ok(value),
            other => Err(self.unexpected(&format!("add to {key:?}"), other)),
        }
    }

    fn barrier(&self, name: &str, world_size: usize, timeout: Duration) -> Result<()> {
        super::store_barrier(self, name, self.rank, world_size, timeout)
    }
}
