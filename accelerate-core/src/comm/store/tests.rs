//! Store tests: real server, real sockets on loopback, clients on threads.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use super::auth::raw_handshake;
use super::server::{StoreService, HELLO_TIMEOUT};
use super::wire::{decode, encode, Peer, Request, Response, MAX_FRAME_BYTES, PROTOCOL_VERSION};
use super::*;
use crate::error::Error;

const TOKEN: &str = "job-token-for-tests";
const WAIT: Duration = Duration::from_secs(10);

fn server() -> StoreServer {
    StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 0).unwrap()
}

fn worker(rank: u64) -> Peer {
    Peer::Worker {
        generation: 0,
        rank,
    }
}

fn client(server: &StoreServer, rank: usize) -> TcpStoreClient {
    TcpStoreClient::connect(server.local_addr(), TOKEN, 0, rank, WAIT).unwrap()
}

/// Runs `task(t)` for each `t` in `0..threads`, each on its own thread, at once; returns all
/// their results, sorted.
fn sorted_results_of_threads<T: Ord + Send>(
    threads: usize,
    task: impl Fn(usize) -> Vec<T> + Sync,
) -> Vec<T> {
    let mut all: Vec<T> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let task = &task;
                scope.spawn(move || task(t))
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    all.sort();
    all
}

/// Reads what the server says to a raw connection: `Some(reply)` for a frame, `None` once closed.
fn read_raw_reply(stream: &mut TcpStream) -> Option<Response> {
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let mut prefix = [0u8; 4];
    stream.read_exact(&mut prefix).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(prefix) as usize];
    stream.read_exact(&mut body).ok()?;
    Some(decode(&body).unwrap())
}

fn assert_closed(stream: &mut TcpStream) {
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected the server to close the connection, got {other:?}"),
    }
}

#[test]
fn set_get_and_add_are_shared_between_clients() {
    let server = server();
    let a = client(&server, 0);
    let b = client(&server, 1);
    a.set("greeting", b"hello").unwrap();
    assert_eq!(b.get("greeting", WAIT).unwrap(), b"hello");
    b.set("greeting", b"bye").unwrap();
    assert_eq!(a.get("greeting", WAIT).unwrap(), b"bye");
    assert_eq!(a.add("counter", 5).unwrap(), 5);
    assert_eq!(b.add("counter", -2).unwrap(), 3);
    // Counters read back as decimal text, as in PyTorch's TCPStore.
    assert_eq!(a.get("counter", WAIT).unwrap(), b"3");
    assert_eq!(a.get("greeting", Duration::ZERO).unwrap(), b"bye");
}

#[test]
fn add_is_atomic_under_concurrency() {
    let server = server();
    let threads = 4;
    let per_thread = 50;
    let seen = sorted_results_of_threads(threads, |rank| {
        let c = client(&server, rank);
        (0..per_thread)
            .map(|_| c.add("n", 1).unwrap())
            .collect::<Vec<_>>()
    });
    // Every increment returned a distinct value: 1..=200, nothing lost or duplicated.
    assert_eq!(
        seen,
        (1..=(threads * per_thread) as i64).collect::<Vec<_>>()
    );
}

#[test]
fn get_waits_for_a_later_set() {
    let server = server();
    let waiter = client(&server, 0);
    let setter = client(&server, 1);
    let handle = std::thread::spawn(move || waiter.get("late", WAIT));
    std::thread::sleep(Duration::from_millis(50));
    setter.set("late", &[42]).unwrap();
    assert_eq!(handle.join().unwrap().unwrap(), vec![42]);
}

#[test]
fn get_of_a_missing_key_times_out_with_the_key_named() {
    let server = server();
    let c = client(&server, 0);
    let err = c.get("never/set", Duration::from_millis(100)).unwrap_err();
    match &err {
        Error::Timeout { what, after, .. } => {
            assert!(what.contains("never/set"), "{err}");
            assert_eq!(*after, Duration::from_millis(100));
        }
        other => panic!("expected a timeout, got {other}"),
    }
    // The connection is still in step: the next request gets its own answer.
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k", WAIT).unwrap(), b"v");
}

#[test]
fn barrier_releases_all_ranks_and_can_be_reused() {
    let server = server();
    let world = 3;
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let c = client(&server, rank);
            std::thread::spawn(move || {
                for round in 0..3 {
                    c.set(&format!("before/{round}/{rank}"), b"").unwrap();
                    c.barrier("sync", world, WAIT).unwrap();
                    // Everyone wrote before entering, so after the barrier all keys exist.
                    for r in 0..world {
                        c.get(&format!("before/{round}/{r}"), Duration::ZERO)
                            .unwrap();
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn barrier_timeout_names_the_missing_ranks() {
    let server = server();
    let c0 = client(&server, 0);
    let c2 = client(&server, 2);
    let other = std::thread::spawn(move || c2.barrier("b", 4, Duration::from_secs(2)));
    // Wait until rank 2 has arrived (its arrival record exists), so the outcome is certain.
    c0.get("barrier/b/0/rank2", WAIT).unwrap();
    let err = c0.barrier("b", 4, Duration::from_millis(300)).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("[1, 3]"), "{text}");
    assert!(matches!(err, Error::Timeout { .. }));
    assert!(other.join().unwrap().is_err());
}

#[test]
fn a_wrong_token_is_refused_and_others_keep_working() {
    let server = server();
    let good = client(&server, 0);
    let err = TcpStoreClient::connect(server.local_addr(), "guess", 0, 1, WAIT).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::Store(_)), "{text}");
    assert!(text.contains("wrong job token"), "{text}");
    good.set("still", b"here").unwrap();
    assert_eq!(client(&server, 2).get("still", WAIT).unwrap(), b"here");
}

#[test]
fn a_stale_generation_is_refused() {
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 3).unwrap();
    let err = TcpStoreClient::connect(server.local_addr(), TOKEN, 2, 0, WAIT).unwrap_err();
    assert!(err.to_string().contains("generation 2"), "{err}");
    let current = TcpStoreClient::connect(server.local_addr(), TOKEN, 3, 0, WAIT).unwrap();
    current.set("k", b"v").unwrap();
    // A restart: the old round's clients and keys are gone.
    server.service().set_generation(4);
    let err = current.get("k", WAIT).unwrap_err();
    assert!(err.to_string().contains("generation 3"), "{err}");
    let next = TcpStoreClient::connect(server.local_addr(), TOKEN, 4, 0, WAIT).unwrap();
    assert!(matches!(
        next.get("k", Duration::ZERO),
        Err(Error::Timeout { .. })
    ));
}

#[test]
fn a_restart_wakes_a_stale_client_waiting_in_get() {
    let server = server();
    let old = client(&server, 0);
    let waiting = std::thread::spawn(move || old.get("never", WAIT));
    std::thread::sleep(Duration::from_millis(50));
    server.service().set_generation(1);
    let err = waiting.join().unwrap().unwrap_err();
    assert!(err.to_string().contains("restart round"), "{err}");
}

#[test]
fn garbage_is_refused_and_the_server_keeps_serving() {
    let server = server();
    let good = client(&server, 0);
    // An HTTP request: its first four bytes read as a length of about 540 MB.
    let mut http = TcpStream::connect(server.local_addr()).unwrap();
    http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    match read_raw_reply(&mut http) {
        Some(Response::Refused(reason)) => assert!(reason.contains("exceeds"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_closed(&mut http);
    // A small frame whose body is not a valid message.
    let mut junk = TcpStream::connect(server.local_addr()).unwrap();
    junk.write_all(&[5, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef, 0x01])
        .unwrap();
    match read_raw_reply(&mut junk) {
        Some(Response::Refused(reason)) => assert!(reason.contains("malformed"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_closed(&mut junk);
    good.set("after", b"garbage").unwrap();
    assert_eq!(client(&server, 1).get("after", WAIT).unwrap(), b"garbage");
}

#[test]
fn an_oversized_frame_after_the_hello_is_refused() {
    let server = server();
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    let (_, welcome) = raw_handshake(&mut raw, TOKEN, worker(9));
    assert_eq!(welcome, Some(Response::Welcome));
    // Announce one byte more than the limit, send nothing else: refused on the length alone.
    raw.write_all(&((MAX_FRAME_BYTES + 1) as u32).to_le_bytes())
        .unwrap();
    match read_raw_reply(&mut raw) {
        Some(Response::Refused(reason)) => assert!(reason.contains("exceeds"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_closed(&mut raw);
    let good = client(&server, 0);
    good.set("k", b"v").unwrap();
}

#[test]
fn adding_to_a_non_counter_fails_but_keeps_the_connection() {
    let server = server();
    let c = client(&server, 0);
    c.set("text", b"abc").unwrap();
    let err = c.add("text", 1).unwrap_err();
    assert!(err.to_string().contains("not a counter"), "{err}");
    assert_eq!(c.add("real", 2).unwrap(), 2);
}

#[test]
fn connect_retries_until_the_server_starts() {
    // Find a free port, release it, and start the server there only after the client began.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let connecting = std::thread::spawn(move || TcpStoreClient::connect(addr, TOKEN, 0, 0, WAIT));
    std::thread::sleep(Duration::from_millis(100));
    let server = StoreServer::start(addr, TOKEN.into(), 0).unwrap();
    let c = connecting.join().unwrap().unwrap();
    c.set("k", b"v").unwrap();
    drop(server);
}

#[test]
fn connect_without_a_server_times_out() {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let err = TcpStoreClient::connect(addr, TOKEN, 0, 3, Duration::from_millis(200)).unwrap_err();
    match &err {
        Error::Timeout { what, .. } => assert!(what.contains("rank 3"), "{err}"),
        other => panic!("expected a timeout, got {other}"),
    }
}

#[test]
fn shutdown_closes_client_connections() {
    let server = server();
    let c = client(&server, 0);
    server.shutdown();
    let err = c.set("k", b"v").unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
}

#[test]
fn the_service_serves_inside_an_existing_runtime() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let service = StoreService::new(TOKEN.into(), 0);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = {
        let service = service.clone();
        runtime.spawn(async move {
            service
                .serve(listener, async {
                    let _ = stopped.await;
                })
                .await
        })
    };
    let c = TcpStoreClient::connect(addr, TOKEN, 0, 0, WAIT).unwrap();
    assert_eq!(c.add("x", 7).unwrap(), 7);
    let store: Arc<dyn Store> = Arc::new(c);
    assert_eq!(store.get("x", WAIT).unwrap(), b"7");
    stop.send(()).unwrap();
    runtime.block_on(serving).unwrap().unwrap();
}

/// Tells the re-executed test binary to serve a store for
/// `a_flood_of_idle_connections_leaves_room_for_the_jobs_ranks`.
const FEW_FDS_CHILD_ENV: &str = "ACCELERATE_TEST_STORE_WITH_FEW_FDS";

/// File descriptors the store process of the flood test may hold: fewer than the flood.
const FEW_FDS: u64 = 128;

/// The store of the flood test, in a process of its own with [`FEW_FDS`] file descriptors: it
/// prints its port and serves until its stdin closes.
#[test]
#[ignore = "started by a_flood_of_idle_connections_leaves_room_for_the_jobs_ranks"]
fn store_with_few_file_descriptors() {
    if std::env::var_os(FEW_FDS_CHILD_ENV).is_none() {
        return;
    }
    let server = server();
    println!("port {}", server.local_addr().port());
    std::io::stdout().flush().unwrap();
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
}

#[test]
fn a_flood_of_idle_connections_leaves_room_for_the_jobs_ranks() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            "comm::store::tests::store_with_few_file_descriptors",
            "--ignored",
            "--nocapture",
        ])
        .env(FEW_FDS_CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // SAFETY: setrlimit is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: FEW_FDS,
                rlim_max: FEW_FDS,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command.spawn().unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let port: u16 = stdout
        .lines()
        .map_while(|l| l.ok())
        .find_map(|l| l.strip_prefix("port ").map(|p| p.parse().unwrap()))
        .expect("the store process printed no port");
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    // More idle connections than the store process has file descriptors; none says hello.
    let flood: Vec<TcpStream> = (0..2 * FEW_FDS)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok())
        .collect();
    assert!(
        flood.len() as u64 > FEW_FDS,
        "only {} connected",
        flood.len()
    );
    // A rank of the job still gets in, well before the idle ones would time out.
    let within = HELLO_TIMEOUT / 2;
    let rank = TcpStoreClient::connect(addr, TOKEN, 0, 0, within)
        .expect("a rank could not join the store during a flood of idle connections");
    rank.set("k", b"v").unwrap();
    assert_eq!(rank.get("k", within).unwrap(), b"v");
    drop(flood);
    drop(child.stdin.take());
    child.wait().unwrap();
}

fn launcher(server: &StoreServer, machine: usize, farewell: &[u8]) -> TcpStoreClient {
    TcpStoreClient::connect_launcher(
        server.local_addr(),
        TOKEN,
        machine,
        "launchers",
        farewell.to_vec(),
        WAIT,
    )
    .unwrap()
}

#[test]
fn appended_entries_are_numbered_in_order_and_never_leave_a_gap() {
    let server = server();
    let a = launcher(&server, 0, b"");
    let b = launcher(&server, 1, b"");
    let indices = sorted_results_of_threads(4, |w| {
        (0..25)
            .map(|i| a.append("log", format!("{w}:{i}").as_bytes()).unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(indices, (0..100).collect::<Vec<u64>>());
    // Every index holds exactly one entry, and each writer's entries keep its order.
    let entries: Vec<String> = (0..100)
        .map(|i| String::from_utf8(b.get(&format!("log/{i}"), WAIT).unwrap()).unwrap())
        .collect();
    for w in 0..4 {
        let mine: Vec<usize> = entries
            .iter()
            .filter_map(|e| e.strip_prefix(&format!("{w}:")))
            .map(|i| i.parse().unwrap())
            .collect();
        assert_eq!(mine, (0..25).collect::<Vec<_>>(), "writer {w}");
    }
    assert_eq!(b.get("log", WAIT).unwrap(), b"100");
}

#[test]
fn launcher_keys_are_apart_from_workers_and_outlive_a_new_generation() {
    let server = server();
    let l = launcher(&server, 0, b"");
    let w = client(&server, 0);
    l.set("k", b"launcher").unwrap();
    w.set("k", b"worker").unwrap();
    assert_eq!(l.get("k", WAIT).unwrap(), b"launcher");
    assert_eq!(w.get("k", WAIT).unwrap(), b"worker");
    server.service().set_generation(1);
    // The worker of generation 0 is refused; the launcher keeps its connection and its keys.
    assert!(w.get("k", WAIT).is_err());
    assert_eq!(l.get("k", WAIT).unwrap(), b"launcher");
    let w1 = TcpStoreClient::connect(server.local_addr(), TOKEN, 1, 0, WAIT).unwrap();
    assert!(
        w1.get("k", Duration::ZERO).is_err(),
        "worker keys were cleared"
    );
}

#[test]
fn a_closed_launcher_connection_leaves_its_farewell() {
    let server = server();
    let watcher = launcher(&server, 0, b"");
    let leaving = launcher(&server, 1, b"machine 1 left");
    watcher.append("launchers", b"first").unwrap();
    drop(leaving);
    assert_eq!(watcher.get("launchers/0", WAIT).unwrap(), b"first");
    assert_eq!(watcher.get("launchers/1", WAIT).unwrap(), b"machine 1 left");
    // A launcher with the wrong token is refused at once, naming its machine.
    let e = TcpStoreClient::connect_launcher(
        server.local_addr(),
        "not-the-token",
        3,
        "launchers",
        b"x".to_vec(),
        WAIT,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("machine 3") && e.contains("wrong job token"),
        "{e}"
    );
    // ...and leaves no farewell: it never joined.
    assert!(watcher
        .get("launchers/2", Duration::from_millis(200))
        .is_err());
}

#[test]
fn a_launcher_that_leaves_while_it_waits_in_get_is_noticed_at_once() {
    let server = server();
    let watcher = launcher(&server, 0, b"");
    let leaving = Arc::new(launcher(&server, 1, b"machine 1 left"));
    let waiting = leaving.clone();
    // Waits far longer than the watcher below will.
    let waiter = std::thread::spawn(move || waiting.try_get("never-set", Duration::from_secs(600)));
    std::thread::sleep(Duration::from_millis(100));
    leaving.disconnect();
    assert_eq!(watcher.get("launchers/0", WAIT).unwrap(), b"machine 1 left");
    assert!(waiter.join().unwrap().is_err());
}

fn redialing(server: &StoreServer, rank: usize) -> RedialingClient {
    let dial = StoreDial {
        addr: server.local_addr(),
        token: TOKEN.into(),
        generation: 0,
        rank,
    };
    RedialingClient::connect(dial, WAIT).unwrap()
}

#[test]
fn a_redialing_client_repeats_set_and_get_on_a_new_connection_after_a_cut() {
    let server = server();
    let heartbeat = redialing(&server, 0);
    let other = client(&server, 1);
    heartbeat.set("beat", b"1").unwrap();
    heartbeat.cut_connection();
    heartbeat.set("beat", b"2").unwrap();
    assert_eq!(other.get("beat", WAIT).unwrap(), b"2");
    heartbeat.cut_connection();
    other.set("theirs", b"x").unwrap();
    assert_eq!(heartbeat.get("theirs", Duration::ZERO).unwrap(), b"x");
}

#[test]
fn a_redialing_client_does_not_repeat_an_add_that_may_have_counted() {
    let server = server();
    let counter = redialing(&server, 0);
    assert_eq!(counter.add("n", 1).unwrap(), 1);
    counter.cut_connection();
    // The add failed with the connection; repeating it could count it twice.
    assert!(counter.add("n", 1).is_err());
    // The next call runs on the new connection; the failed add never reached the server (the
    // cut closed the sending side first), so this is the second.
    assert_eq!(counter.add("n", 1).unwrap(), 2);
    assert_eq!(client(&server, 1).get("n", WAIT).unwrap(), b"2");
}

#[test]
fn a_redialing_client_refused_by_a_restart_stays_refused() {
    let server = server();
    let stale = redialing(&server, 0);
    stale.set("k", b"v").unwrap();
    server.service().set_generation(1);
    for _ in 0..2 {
        let err = stale.set("k", b"w").unwrap_err();
        assert!(err.to_string().contains("generation 0"), "{err}");
    }
}

// ---- Issue 30: authentication of the rendezvous and admission under a flood. ----

/// Everything a connection sends until it closes (or `WAIT` passes).
fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let mut seen = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return seen,
            Ok(n) => seen.extend_from_slice(&chunk[..n]),
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn the_client_never_sends_the_token_and_refuses_a_server_that_does_not_know_it() {
    for answer in [FakeAnswer::Welcome, FakeAnswer::ChallengeWithoutTheToken] {
        a_server_that_does_not_know_the_token(answer);
    }
}

#[derive(Debug, Clone, Copy)]
enum FakeAnswer {
    /// Welcomes whatever it is sent.
    Welcome,
    /// Answers the hello with a challenge whose proof is made with another token.
    ChallengeWithoutTheToken,
}

fn a_server_that_does_not_know_the_token(answer: FakeAnswer) {
    // A program that holds the port and answers "welcome" to whatever it is sent, as a server
    // that does not know the token can.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let first = super::wire::read_frame(&mut stream, MAX_FRAME_BYTES).unwrap();
        let reply = match (answer, decode::<Request>(&first)) {
            (FakeAnswer::ChallengeWithoutTheToken, Ok(Request::Hello { nonce, .. })) => {
                let server_nonce = super::auth::nonce();
                Response::Challenge {
                    version: PROTOCOL_VERSION,
                    nonce: server_nonce,
                    proof: super::auth::server_proof("a guess", &nonce, &server_nonce),
                }
            }
            _ => Response::Welcome,
        };
        stream.write_all(&encode(&reply).unwrap()).unwrap();
        let mut seen = (first.len() as u32).to_le_bytes().to_vec();
        seen.extend(first);
        seen.extend(read_until_closed(&mut stream));
        seen
    });
    let outcome = TcpStoreClient::connect(addr, TOKEN, 0, 1, WAIT);
    let error = outcome.as_ref().err().map(ToString::to_string);
    drop(outcome);
    let on_the_wire = fake.join().unwrap();
    assert!(
        !contains(&on_the_wire, TOKEN.as_bytes()),
        "{answer:?}: the client sent the job token in clear to a server that does not know it"
    );
    let error = error.unwrap_or_else(|| {
        panic!("{answer:?}: the client accepted a server that does not know the token")
    });
    assert!(
        error.contains("did not prove that it holds this job's token")
            && error.contains("ACCELERATE_JOB_TOKEN"),
        "{answer:?}: {error}"
    );
    // It sent its hello (a nonce) and nothing after it: no proof for the fake to work on.
    let hello = super::wire::split_frame(&on_the_wire, MAX_FRAME_BYTES)
        .unwrap()
        .expect("the client sent its hello");
    assert_eq!(
        hello.1,
        on_the_wire.len(),
        "{answer:?}: more than the hello was sent"
    );
    assert!(matches!(
        decode::<Request>(&hello.0),
        Ok(Request::Hello { .. })
    ));
}

#[test]
fn a_client_told_that_its_hello_is_malformed_names_an_older_store() {
    // What a store of protocol 1 answers to a hello of protocol 2, whose variant it does not know.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let old_store = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let _ = super::wire::read_frame(&mut stream, MAX_FRAME_BYTES);
        let refusal = Response::Refused(
            "malformed store frame: invalid value: integer `6`, expected variant index 0 <= i < 6"
                .into(),
        );
        stream.write_all(&encode(&refusal).unwrap()).unwrap();
        read_until_closed(&mut stream)
    });
    let e = TcpStoreClient::connect(addr, TOKEN, 0, 2, WAIT)
        .unwrap_err()
        .to_string();
    old_store.join().unwrap();
    assert!(
        e.contains("rank 2") && e.contains("older accelerate-rs") && e.contains("same version"),
        "{e}"
    );
}

/// A relay between a client and `target` that records what the client sends.
fn recording_relay(target: SocketAddr) -> (SocketAddr, std::thread::JoinHandle<Vec<u8>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let relay = std::thread::spawn(move || {
        let (mut client, _) = listener.accept().unwrap();
        let mut server = TcpStream::connect(target).unwrap();
        let (mut client_back, mut server_back) =
            (client.try_clone().unwrap(), server.try_clone().unwrap());
        let back = std::thread::spawn(move || {
            let _ = std::io::copy(&mut server_back, &mut client_back);
            let _ = client_back.shutdown(std::net::Shutdown::Both);
        });
        let mut recorded = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            match client.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    recorded.extend_from_slice(&chunk[..n]);
                    if server.write_all(&chunk[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = server.shutdown(std::net::Shutdown::Both);
        back.join().unwrap();
        recorded
    });
    (addr, relay)
}

#[test]
fn a_recorded_session_replayed_on_a_new_connection_is_refused() {
    // Whoever reads the network records a rank's session; replaying it must not let them in.
    let server = server();
    let (relay, recording) = recording_relay(server.local_addr());
    let rank = TcpStoreClient::connect(relay, TOKEN, 0, 1, WAIT).unwrap();
    rank.set("card/1", b"the rank's address").unwrap();
    drop(rank);
    let recorded = recording.join().unwrap();
    let mut replay = TcpStream::connect(server.local_addr()).unwrap();
    replay.write_all(&recorded).unwrap();
    let mut replies = Vec::new();
    while let Some(reply) = read_raw_reply(&mut replay) {
        replies.push(reply);
    }
    assert!(
        !replies.contains(&Response::Welcome) && !replies.contains(&Response::Done),
        "a replayed session was admitted: {replies:?}"
    );
    assert!(
        matches!(replies.last(), Some(Response::Refused(_))),
        "{replies:?}"
    );
}

#[test]
fn the_client_says_hello_again_once_when_the_connection_closes_during_it() {
    // The store closes the first connection during its hello (as when a flood evicts it), then
    // serves normally: the rank gets in on its second try.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let store = std::thread::spawn(move || {
        let (mut first, _) = listener.accept().unwrap();
        first.set_read_timeout(Some(WAIT)).unwrap();
        let _ = super::wire::read_frame(&mut first, MAX_FRAME_BYTES);
        drop(first);
        serve_until(StoreService::new(TOKEN.into(), 0), listener, stopped);
    });
    let rank = TcpStoreClient::connect(addr, TOKEN, 0, 0, WAIT)
        .expect("the rank gave up after one closed hello");
    rank.set("k", b"v").unwrap();
    assert_eq!(rank.get("k", WAIT).unwrap(), b"v");
    drop(rank);
    stop.send(()).unwrap();
    store.join().unwrap();
}

/// Serves `service` on `listener` on a thread of its own until the returned sender is used.
fn serve_on_thread(
    service: StoreService,
    listener: std::net::TcpListener,
) -> (
    tokio::sync::oneshot::Sender<()>,
    std::thread::JoinHandle<()>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || serve_until(service, listener, stopped));
    (stop, thread)
}

/// Serves `service` on `listener` on this thread until `stopped` receives (or its sender drops).
fn serve_until(
    service: StoreService,
    listener: std::net::TcpListener,
    stopped: tokio::sync::oneshot::Receiver<()>,
) {
    listener.set_nonblocking(true).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        service
            .serve(listener, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
}

/// Sends a hello to the store on `stream`; returns the nonce it carries.
fn say_hello(stream: &mut TcpStream) -> super::wire::Nonce {
    let client_nonce = super::auth::nonce();
    let hello = Request::Hello {
        version: PROTOCOL_VERSION,
        nonce: client_nonce,
    };
    stream.write_all(&encode(&hello).unwrap()).unwrap();
    client_nonce
}

#[test]
fn a_hello_that_has_arrived_is_served_before_its_connection_is_evicted() {
    // The rank connects and says hello before the store runs at all; then enough idle
    // connections arrive to push it off the list of those in their handshake. The store accepts
    // them all in one go before any connection is served, so when the rank's turn comes both its
    // hello and its eviction are there. Tokio's `select!` picks among ready branches at random
    // unless told otherwise, so the race is run several times.
    let limit = 4;
    for trial in 0..16 {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut rank = TcpStream::connect(addr).unwrap();
        let client_nonce = say_hello(&mut rank);
        let flood: Vec<TcpStream> = (0..limit)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let service = StoreService::with_pending_limit(TOKEN.into(), 0, limit);
        let (stop, serving) = serve_on_thread(service, listener);
        let challenge = read_raw_reply(&mut rank);
        let Some(Response::Challenge { nonce, .. }) = challenge else {
            panic!(
                "trial {trial}: the rank was evicted although its hello had arrived: {challenge:?}"
            );
        };
        let proof = super::auth::client_proof(TOKEN, &client_nonce, &nonce, &worker(0)).unwrap();
        let prove = Request::Prove {
            proof,
            peer: worker(0),
        };
        rank.write_all(&encode(&prove).unwrap()).unwrap();
        assert_eq!(
            read_raw_reply(&mut rank),
            Some(Response::Welcome),
            "trial {trial}"
        );
        drop(flood);
        stop.send(()).unwrap();
        serving.join().unwrap();
    }
}

#[test]
fn a_flood_of_idle_connections_does_not_evict_a_rank_that_said_hello() {
    // Two connections may be in their handshake. The rank says hello and gets the challenge;
    // then ten idle connections arrive, each of which closes another; the rank still finishes.
    let limit = 2;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let service = StoreService::with_pending_limit(TOKEN.into(), 0, limit);
    let (stop, serving) = serve_on_thread(service, listener);
    let mut rank = TcpStream::connect(addr).unwrap();
    let client_nonce = say_hello(&mut rank);
    let Some(Response::Challenge { nonce, .. }) = read_raw_reply(&mut rank) else {
        panic!("no challenge");
    };
    let mut flood: Vec<TcpStream> = (0..10).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // Each idle connection but the last `limit - 1` was closed to make room for a newer one:
    // the server closed exactly the idle ones, oldest first.
    for idle in flood.iter_mut().take(10 - (limit - 1)) {
        assert_closed(idle);
    }
    let proof = super::auth::client_proof(TOKEN, &client_nonce, &nonce, &worker(0)).unwrap();
    let prove = Request::Prove {
        proof,
        peer: worker(0),
    };
    rank.write_all(&encode(&prove).unwrap()).unwrap();
    assert_eq!(read_raw_reply(&mut rank), Some(Response::Welcome));
    drop(flood);
    stop.send(()).unwrap();
    serving.join().unwrap();
}

#[test]
fn a_client_without_the_token_can_neither_read_nor_write_a_key() {
    let server = server();
    let rank = client(&server, 0);
    rank.set("card/0", b"address and nonce of rank 0").unwrap();
    let addr = server.local_addr();
    // No token, and a wrong one: refused before anything is read or written.
    for token in ["", "guess"] {
        let e = TcpStoreClient::connect(addr, token, 0, 1, WAIT)
            .unwrap_err()
            .to_string();
        assert!(e.contains("wrong job token"), "{e}");
    }
    // A client that skips the handshake, or sends requests with a proof made with another
    // token, is refused; it never gets a value, and its write never lands.
    let requests = [
        Request::Get {
            key: "card/0".into(),
            timeout_ms: 0,
        },
        Request::Set {
            key: "card/1".into(),
            value: b"intruder".to_vec(),
        },
    ];
    for request in &requests {
        let mut raw = TcpStream::connect(addr).unwrap();
        raw.write_all(&encode(request).unwrap()).unwrap();
        assert!(
            matches!(read_raw_reply(&mut raw), Some(Response::Refused(_))),
            "{request:?} without a handshake"
        );
        assert_closed(&mut raw);
        let mut raw = TcpStream::connect(addr).unwrap();
        let (_, answer) = raw_handshake(&mut raw, "guess", worker(1));
        match answer {
            Some(Response::Refused(reason)) => {
                assert!(
                    reason.contains("rank 1 presented a wrong job token"),
                    "{reason}"
                )
            }
            other => panic!("a proof with a wrong token got {other:?}"),
        }
        let _ = raw.write_all(&encode(request).unwrap());
        assert_eq!(
            read_raw_reply(&mut raw),
            None,
            "{request:?} after a wrong proof"
        );
    }
    assert!(matches!(
        rank.get("card/1", Duration::ZERO),
        Err(Error::Timeout { .. })
    ));
    // Protocol 1's hello, which sends the token itself, is refused even with the right token.
    let mut old = TcpStream::connect(addr).unwrap();
    let hello_v1 = Request::HelloV1 {
        token: TOKEN.into(),
        generation: 0,
        rank: 1,
    };
    old.write_all(&encode(&hello_v1).unwrap()).unwrap();
    match read_raw_reply(&mut old) {
        Some(Response::Refused(reason)) => assert!(
            reason.contains("version 1") && reason.contains("same accelerate-rs version"),
            "{reason}"
        ),
        other => panic!("a protocol 1 hello got {other:?}"),
    }
}
