//! The rendezvous store's server: a tokio task per connection over one shared map.
//!
//! The launcher hosts it (or rank 0, when torchrun, SLURM or MPI started the workers). Every
//! connection must first prove that it holds the job token, and a worker must belong to the
//! current generation (`admission`); a connection that fails to, or that sends a malformed or
//! oversized frame, gets a `Refused` reply and is closed, and nothing else is affected.
//!
//! The launchers of a job on several machines hold control connections of their own: their keys
//! are kept apart from the workers' and outlive generations (the launchers coordinate restarts
//! through them), and when such a connection closes the server appends the farewell its launcher
//! left at hello, so the other machines learn at once that a launcher went away.
//!
//! Connections that have not finished their handshake are limited to [`MAX_PENDING_HELLOS`]: a
//! new one beyond that closes one of them, an idle one first (`admission`). A flood of idle
//! connections (a port scanner, a misconfigured client) then cannot exhaust the server's file
//! descriptors, and the job's own ranks, which say hello as soon as they connect, still get in.

mod admission;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinSet;

use super::wire::{
    decode, encode, read_frame_async, write_frame_async, FrameError, Request, Response,
    MAX_FRAME_BYTES,
};
use crate::error::{Error, Result};

/// How long a new connection may take to finish its handshake before it is dropped.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// How many connections may be in their handshake at once; one more closes one of them, the
/// oldest that has sent nothing if there is one. The job's ranks say hello right after
/// connecting, so only idle or slow connections are closed.
pub const MAX_PENDING_HELLOS: usize = 64;

/// Longest wait a single `get` may ask the server for (longer requests are capped).
const MAX_GET_WAIT: Duration = Duration::from_secs(30 * 24 * 3600);

/// How long the server tries to deliver a `Refused` reply before closing anyway.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// The store's data and admission rules, shared by all connections. Cloning gives another
/// handle to the same store.
///
/// Use it directly to serve inside an existing tokio runtime (the launcher); [`StoreServer`] wraps
/// it in a runtime thread of its own.
#[derive(Clone)]
pub struct StoreService {
    shared: Arc<Shared>,
}

struct Shared {
    token: String,
    generation: AtomicU64,
    /// The workers' keys: cleared by a new generation.
    data: Mutex<HashMap<String, Vec<u8>>>,
    /// The launchers' keys: they coordinate restarts, so they outlive generations.
    control: Mutex<HashMap<String, Vec<u8>>>,
    /// Woken on every change of `data`, `control` or `generation`, so waiting `get`s re-check.
    changed: Notify,
    /// Connections in their handshake, oldest first.
    pending: Mutex<admission::PendingHellos>,
    /// How many may be (`MAX_PENDING_HELLOS`; fewer in tests).
    pending_limit: usize,
}

impl std::fmt::Debug for StoreService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is a secret: never print it.
        f.debug_struct("StoreService")
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

impl StoreService {
    /// An empty store admitting clients that prove they hold `token` and belong to
    /// `generation`.
    pub fn new(token: String, generation: u64) -> Self {
        Self::with_pending_limit(token, generation, MAX_PENDING_HELLOS)
    }

    /// As [`StoreService::new`], with at most `limit` connections in their handshake at once
    /// (at least 1).
    pub(crate) fn with_pending_limit(token: String, generation: u64, limit: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                token,
                generation: AtomicU64::new(generation),
                data: Mutex::new(HashMap::new()),
                control: Mutex::new(HashMap::new()),
                changed: Notify::new(),
                pending: Mutex::new(admission::PendingHellos::default()),
                pending_limit: limit.max(1),
            }),
        }
    }

    /// The generation (restart round) clients must present.
    pub fn generation(&self) -> u64 {
        self.shared.generation.load(Ordering::SeqCst)
    }

    /// Starts a new round after a restart: clears every worker key and admits only workers of
    /// `generation` from now on (launchers' control keys stay). Connections of an earlier generation are refused at their next
    /// request, and `get`s they are waiting in end with a refusal.
    pub fn set_generation(&self, generation: u64) {
        let mut data = lock(&self.shared.data);
        data.clear();
        self.shared.generation.store(generation, Ordering::SeqCst);
        drop(data);
        self.shared.changed.notify_waiters();
    }

    /// Accepts and serves connections on `listener` until `shutdown` completes, then closes every
    /// connection (clients waiting in `get` see the connection close).
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<()> {
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let limit = self.shared.pending_limit;
                        let (id, evicted) = lock(&self.shared.pending).admit(limit);
                        connections.spawn(serve_connection(
                            stream,
                            peer,
                            self.shared.clone(),
                            id,
                            evicted,
                        ));
                    }
                    Err(e) => {
                        // Usually a transient shortage (file descriptors); keep serving the
                        // connections we have and try again shortly.
                        tracing::warn!("rendezvous store: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
        connections.shutdown().await;
        Ok(())
    }
}

/// Which keys a connection works on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// A worker of this generation: the workers' keys, refused once the generation moves on.
    Worker { generation: u64 },
    /// A machine's launcher: the control keys, whatever the generation.
    Launcher,
}

impl Shared {
    fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    fn keys(&self, scope: Scope) -> &Mutex<HashMap<String, Vec<u8>>> {
        match scope {
            Scope::Worker { .. } => &self.data,
            Scope::Launcher => &self.control,
        }
    }

    /// Why a connection of `scope` may no longer be served, if it may not.
    fn stale(&self, scope: Scope) -> Option<String> {
        match scope {
            Scope::Worker { generation } if generation != self.generation() => {
                Some(stale_message(generation, self.generation()))
            }
            _ => None,
        }
    }

    fn set(&self, scope: Scope, key: String, value: Vec<u8>) {
        lock(self.keys(scope)).insert(key, value);
        self.changed.notify_waiters();
    }

    fn append(&self, scope: Scope, log: String, value: Vec<u8>) -> Response {
        let mut data = lock(self.keys(scope));
        let index = match counter_value(&data, &log) {
            Ok(n) => n,
            Err(problem) => return Response::Failed(problem),
        };
        data.insert(format!("{log}/{index}"), value);
        data.insert(log, (index + 1).to_string().into_bytes());
        drop(data);
        self.changed.notify_waiters();
        Response::Counter(index)
    }

    fn add(&self, scope: Scope, key: String, delta: i64) -> Response {
        let mut data = lock(self.keys(scope));
        let current = match counter_value(&data, &key) {
            Ok(n) => n,
            Err(problem) => return Response::Failed(problem),
        };
        let Some(new) = i64::checked_add(current, delta) else {
            return Response::Failed(format!(
                "adding {delta} to counter {key:?} (= {current}) overflows i64"
            ));
        };
        // Counters are stored as decimal text, as in PyTorch's TCPStore, so `get` reads them.
        data.insert(key, new.to_string().into_bytes());
        drop(data);
        self.changed.notify_waiters();
        Response::Counter(new)
    }

    async fn get(&self, scope: Scope, key: &str, wait: Duration) -> Response {
        let deadline = tokio::time::Instant::now() + wait.min(MAX_GET_WAIT);
        loop {
            // Register for wake-ups before looking, so a `set` between the look and the wait is
            // not missed.
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(reason) = self.stale(scope) {
                return Response::Refused(reason);
            }
            if let Some(value) = lock(self.keys(scope)).get(key) {
                return Response::Value(value.clone());
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Response::NotFound;
            }
        }
    }
}

/// The counter under `key` (absent counts as 0), or why the key is not one.
fn counter_value(data: &HashMap<String, Vec<u8>>, key: &str) -> std::result::Result<i64, String> {
    match data.get(key) {
        None => Ok(0),
        Some(bytes) => std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                format!(
                    "key {key:?} holds a value that is not a counter (add and append store \
                     decimal integers there); use a different key"
                )
            }),
    }
}

/// Appends a launcher's farewell to its list when its control connection ends, however it
/// ends (closed, broken, refused, or the server shutting down).
struct Farewell {
    shared: Arc<Shared>,
    log: String,
    value: Vec<u8>,
}

impl Drop for Farewell {
    fn drop(&mut self) {
        if !self.value.is_empty() {
            let value = std::mem::take(&mut self.value);
            let _ = self
                .shared
                .append(Scope::Launcher, std::mem::take(&mut self.log), value);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The map stays consistent even if a holder panicked: every update is a single insert.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn stale_message(client: u64, store: u64) -> String {
    format!(
        "generation {client} does not match the store's generation {store}: this worker belongs \
         to another restart round of the job and may not join this one; it should exit"
    )
}

async fn refuse(stream: &mut TcpStream, peer: SocketAddr, reason: String) {
    tracing::warn!("rendezvous store: refusing connection from {peer}: {reason}");
    if let Ok(frame) = encode(&Response::Refused(reason)) {
        let _ =
            tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, write_frame_async(stream, &frame)).await;
    }
}

async fn serve_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    pending_id: u64,
    evicted: oneshot::Receiver<()>,
) {
    let _ = stream.set_nodelay(true);
    // A peer that vanished without closing (a machine that lost power) is noticed within two
    // minutes, even while the connection waits in a `get`.
    let _ = super::keep_alive(std::os::fd::AsRawFd::as_raw_fd(&stream));
    let admitted = admission::admit(&mut stream, peer, &shared, pending_id, evicted).await;
    let (scope, _farewell) = match admitted {
        Ok(admitted) => admitted,
        Err(admission::Ended::Silently) => return,
        Err(admission::Ended::Refused(reason)) => return refuse(&mut stream, peer, reason).await,
    };
    if !reply(&mut stream, &Response::Welcome).await {
        return;
    }
    loop {
        let body = match read_frame_async(&mut stream, MAX_FRAME_BYTES).await {
            Ok(body) => body,
            Err(FrameError::Io(_)) => return, // the client went away
            Err(e) => return refuse(&mut stream, peer, e.to_string()).await,
        };
        let request = match decode::<Request>(&body) {
            Ok(request) => request,
            Err(e) => return refuse(&mut stream, peer, e).await,
        };
        if let Some(reason) = shared.stale(scope) {
            return refuse(&mut stream, peer, reason).await;
        }
        let response = match request {
            Request::Hello { .. }
            | Request::Prove { .. }
            | Request::HelloV1 { .. }
            | Request::LauncherHelloV1 { .. } => {
                let reason = "a connection may say hello only once".to_string();
                return refuse(&mut stream, peer, reason).await;
            }
            Request::Set { key, value } => {
                shared.set(scope, key, value);
                Response::Done
            }
            Request::Get { key, timeout_ms } => {
                // A client that leaves while it waits (killed, or closed by another thread) is
                // noticed at once, not when the wait ends: a launcher's farewell must not wait.
                tokio::select! {
                    response = shared.get(scope, &key, Duration::from_millis(timeout_ms)) => response,
                    () = closed(&stream) => return,
                }
            }
            Request::Add { key, delta } => shared.add(scope, key, delta),
            Request::Append { log, value } => shared.append(scope, log, value),
        };
        if let Response::Refused(reason) = response {
            return refuse(&mut stream, peer, reason).await;
        }
        if !reply(&mut stream, &response).await {
            return;
        }
    }
}

/// Resolves once the client has closed its end (or the connection broke). A client sends nothing
/// while it waits for a reply, so bytes that arrive meanwhile only mean the wait goes on.
async fn closed(stream: &TcpStream) {
    let mut byte = [0u8; 1];
    match stream.peek(&mut byte).await {
        Ok(0) | Err(_) => {}
        Ok(_) => std::future::pending().await,
    }
}

async fn reply(stream: &mut TcpStream, response: &Response) -> bool {
    let frame = match encode(response) {
        Ok(frame) => frame,
        Err(e) => {
            tracing::error!("rendezvous store: {e}");
            return false;
        }
    };
    write_frame_async(stream, &frame).await.is_ok()
}

/// A rendezvous store served on a background thread with its own tokio runtime, until
/// [`StoreServer::shutdown`] or drop.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    service: StoreService,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The job's token file, when this store's token lives in one; removed after the store
    /// stops.
    token_file: Option<super::token_file::TokenFile>,
}

impl StoreServer {
    /// Binds `bind` (port 0 picks a free port) and serves on a background thread until dropped or
    /// [`shutdown`](Self::shutdown). Clients must prove that they hold `token` (an empty token
    /// protects nothing: anyone knows it), and workers must belong to `generation`.
    ///
    /// Single-machine jobs bind a loopback address, so nothing outside the machine can reach it.
    pub fn start(bind: SocketAddr, token: String, generation: u64) -> Result<Self> {
        let listener = std::net::TcpListener::bind(bind).map_err(|source| Error::Network {
            context: format!(
                "binding the rendezvous store to {bind}; another process may hold the port: \
                 choose another with --main-process-port (or MASTER_PORT), or 0 for a free one"
            ),
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| Error::Network {
            context: format!("reading the address of the rendezvous store bound to {bind}"),
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| Error::Network {
                context: format!("making the rendezvous store socket {addr} non-blocking"),
                source,
            })?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| Error::Network {
                context: "creating the rendezvous store's tokio runtime".into(),
                source,
            })?;
        let service = StoreService::new(token, generation);
        let (stop, stopped) = oneshot::channel::<()>();
        let serving = service.clone();
        let thread = std::thread::Builder::new()
            .name(format!("rendezvous-store-{}", addr.port()))
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(e) => {
                            tracing::error!("rendezvous store on {addr}: {e}");
                            return;
                        }
                    };
                    let shutdown = async move {
                        // Either an explicit stop or the server handle being dropped.
                        let _ = stopped.await;
                    };
                    if let Err(e) = serving.serve(listener, shutdown).await {
                        tracing::error!("rendezvous store on {addr}: {e}");
                    }
                });
            })
            .map_err(|source| Error::Network {
                context: "starting the rendezvous store thread".into(),
                source,
            })?;
        Ok(Self {
            addr,
            service,
            stop: Some(stop),
            thread: Some(thread),
            token_file: None,
        })
    }

    /// The address the store listens on (with the port actually bound).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Keeps `file` (the token file of this store's job) until the store stops.
    pub(crate) fn keep_token_file(&mut self, file: super::token_file::TokenFile) {
        self.token_file = Some(file);
    }

    /// The store being served, e.g. to start a new generation after a restart.
    pub fn service(&self) -> &StoreService {
        &self.service
    }

    /// Stops serving, closes every connection and waits for the server thread to end.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.token_file = None;
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}
