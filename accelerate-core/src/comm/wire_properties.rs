//! Property tests of every decoder of bytes that come from another process: encoding any value
//! and decoding it gives the value back; truncated input is an error; arbitrary and mutated input
//! never panics; a hello of another job or round (wrong token, stale generation, foreign nonce) is
//! refused. The fuzz targets (`fuzz/`) search the same decoders with coverage guidance; these run
//! in every `cargo test`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;

use crate::comm::cpu::frame::{self, FrameKind, Header, OpCode, HEADER_BYTES, MAX_ABORT_BYTES};
use crate::comm::cpu::rendezvous::{self, Hello, PeerCard, HELLO_BYTES};
use crate::comm::cpu::shm::region::{self, Layout, MAX_REASON_BYTES, PIECE_ALIGN};
use crate::comm::cpu::shm::session::RoundTag;
use crate::comm::cpu::shm::setup::{decode_record, HostCard, Plan};
use crate::comm::cpu::{CpuCommOptions, TransportChoice};
use crate::comm::host_identity::HostIdentity;
use crate::comm::store::wire::{self, FrameError, Peer, Request, Response};
use crate::comm::store::wire::{HELLO_FRAME_LIMIT, MAX_FRAME_BYTES};
use crate::comm::store::StoreServer;
use crate::comm::ReduceOp;
use crate::error::Error;
use crate::fuzzing;

fn text() -> impl Strategy<Value = String> {
    prop_oneof![".{0,24}", any::<String>()]
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        (text(), any::<u64>(), any::<u64>()).prop_map(|(token, generation, rank)| {
            Request::HelloV1 {
                token,
                generation,
                rank,
            }
        }),
        (any::<u32>(), any::<[u8; 32]>())
            .prop_map(|(version, nonce)| Request::Hello { version, nonce }),
        (any::<[u8; 32]>(), peer()).prop_map(|(proof, peer)| Request::Prove { proof, peer }),
        (text(), vec(any::<u8>(), 0..200)).prop_map(|(key, value)| Request::Set { key, value }),
        (text(), any::<u64>()).prop_map(|(key, timeout_ms)| Request::Get { key, timeout_ms }),
        (text(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        (text(), any::<u64>(), text(), vec(any::<u8>(), 0..50)).prop_map(
            |(token, machine, farewell_log, farewell)| Request::LauncherHelloV1 {
                token,
                machine,
                farewell_log,
                farewell,
            }
        ),
        (text(), vec(any::<u8>(), 0..200)).prop_map(|(log, value)| Request::Append { log, value }),
    ]
}

fn peer() -> impl Strategy<Value = Peer> {
    prop_oneof![
        (any::<u64>(), any::<u64>())
            .prop_map(|(generation, rank)| Peer::Worker { generation, rank }),
        (any::<u64>(), text(), vec(any::<u8>(), 0..50)).prop_map(
            |(machine, farewell_log, farewell)| Peer::Launcher {
                machine,
                farewell_log,
                farewell,
            }
        ),
    ]
}

fn response() -> impl Strategy<Value = Response> {
    prop_oneof![
        Just(Response::Welcome),
        Just(Response::Done),
        vec(any::<u8>(), 0..200).prop_map(Response::Value),
        any::<i64>().prop_map(Response::Counter),
        Just(Response::NotFound),
        text().prop_map(Response::Failed),
        text().prop_map(Response::Refused),
        (any::<u32>(), any::<[u8; 32]>(), any::<[u8; 32]>()).prop_map(|(version, nonce, proof)| {
            Response::Challenge {
                version,
                nonce,
                proof,
            }
        }),
    ]
}

fn frame_kind() -> impl Strategy<Value = FrameKind> {
    prop_oneof![
        Just(FrameKind::Data),
        Just(FrameKind::KeepAlive),
        Just(FrameKind::Abort)
    ]
}

fn header() -> impl Strategy<Value = Header> {
    (
        frame_kind(),
        any::<u8>(),
        any::<u8>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(kind, op, dtype, index, seq, len)| Header {
            kind,
            op,
            dtype,
            index,
            seq,
            len,
        })
}

/// Every collective the CPU transports tag their frames and rounds with, and how an error names
/// it (written out here, not derived from the code under test).
const EVERY_COLLECTIVE: [(OpCode, &str); 10] = [
    (OpCode::AllReduce(ReduceOp::Sum), "all_reduce(Sum)"),
    (OpCode::AllReduce(ReduceOp::Mean), "all_reduce(Mean)"),
    (OpCode::AllReduce(ReduceOp::Max), "all_reduce(Max)"),
    (OpCode::Broadcast, "broadcast"),
    (OpCode::AllGather, "all_gather"),
    (OpCode::Barrier, "barrier"),
    (OpCode::ReduceScatter(ReduceOp::Sum), "reduce_scatter(Sum)"),
    (
        OpCode::ReduceScatter(ReduceOp::Mean),
        "reduce_scatter(Mean)",
    ),
    (OpCode::ReduceScatter(ReduceOp::Max), "reduce_scatter(Max)"),
    (OpCode::AllGatherInto, "all_gather_into"),
];

fn collective() -> impl Strategy<Value = (OpCode, &'static str)> {
    proptest::sample::select(EVERY_COLLECTIVE.to_vec())
}

#[test]
fn every_collective_has_its_own_code_and_other_codes_are_unknown() {
    let codes: Vec<u8> = EVERY_COLLECTIVE.iter().map(|(op, _)| op.code()).collect();
    let mut distinct = codes.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), codes.len(), "codes {codes:?}");
    for code in 0..=u8::MAX {
        let shown = OpCode::describe(code);
        match EVERY_COLLECTIVE.iter().find(|(op, _)| op.code() == code) {
            Some((_, name)) => assert_eq!(shown, *name),
            None => assert_eq!(shown, format!("unknown collective {code}")),
        }
    }
}

fn hello() -> impl Strategy<Value = Hello> {
    (any::<u64>(), any::<u64>(), any::<u64>(), any::<u128>()).prop_map(
        |(from, world_size, instance, nonce)| Hello {
            from,
            world_size,
            instance,
            nonce,
        },
    )
}

fn socket_addr() -> impl Strategy<Value = SocketAddr> {
    prop_oneof![
        (any::<[u8; 4]>(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::from((ip, port))),
        (any::<[u16; 8]>(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::from((ip, port))),
    ]
}

fn peer_card() -> impl Strategy<Value = PeerCard> {
    (socket_addr(), any::<u128>(), any::<u64>()).prop_map(|(addr, nonce, world_size)| PeerCard {
        addr,
        nonce,
        world_size,
    })
}

fn host_card() -> impl Strategy<Value = HostCard> {
    let choice = prop_oneof![
        Just(TransportChoice::Auto),
        Just(TransportChoice::Tcp),
        Just(TransportChoice::Shm)
    ];
    let host = proptest::option::of((text(), text(), text(), text()).prop_map(
        |(hostname, boot_id, pid_namespace, net_namespace)| HostIdentity {
            hostname,
            boot_id,
            pid_namespace,
            net_namespace,
        },
    ));
    (choice, any::<u64>(), host).prop_map(|(choice, world_size, host)| HostCard {
        choice,
        world_size,
        host,
    })
}

fn plan() -> impl Strategy<Value = Plan> {
    prop_oneof![
        text().prop_map(Plan::Tcp),
        (text(), any::<u128>()).prop_map(|(path, nonce)| Plan::Shm {
            path: path.into(),
            nonce
        }),
        text().prop_map(Plan::Refuse),
    ]
}

fn layout() -> impl Strategy<Value = Layout> {
    (1usize..=64, 1usize..=8192).prop_map(|(world_size, units)| Layout {
        world_size,
        piece_bytes: units * PIECE_ALIGN,
    })
}

/// A well-formed input of one of the fuzz targets, changed at random: bytes flipped, cut short or
/// extended.
fn mutated_seed() -> impl Strategy<Value = (usize, Vec<u8>)> {
    let targets = fuzzing::TARGETS.len();
    (
        0..targets,
        any::<Index>(),
        vec((any::<Index>(), any::<u8>()), 0..4),
        any::<Index>(),
        vec(any::<u8>(), 0..8),
    )
        .prop_map(|(target, which, flips, cut, tail)| {
            let seeds = fuzzing::seeds(fuzzing::TARGETS[target].0);
            let mut bytes = which.get(&seeds).clone();
            for (at, value) in flips {
                let i = at.index(bytes.len());
                bytes[i] ^= value;
            }
            bytes.truncate(cut.index(bytes.len() + 1));
            bytes.extend(tail);
            (target, bytes)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn store_requests_round_trip(r in request()) {
        let frame = wire::encode(&r).unwrap();
        let body = wire::read_frame(&mut &frame[..], MAX_FRAME_BYTES).unwrap();
        prop_assert_eq!(body.len() + 4, frame.len());
        prop_assert_eq!(wire::decode::<Request>(&body).unwrap(), r);
    }

    #[test]
    fn store_responses_round_trip(r in response()) {
        let frame = wire::encode(&r).unwrap();
        let body = wire::read_frame(&mut &frame[..], MAX_FRAME_BYTES).unwrap();
        prop_assert_eq!(wire::decode::<Response>(&body).unwrap(), r);
    }

    #[test]
    fn truncated_store_frames_are_errors(r in request(), cut in any::<Index>()) {
        let frame = wire::encode(&r).unwrap();
        let cut = cut.index(frame.len()); // strictly shorter than the frame
        let read = wire::read_frame(&mut &frame[..cut], MAX_FRAME_BYTES);
        prop_assert!(matches!(read, Err(FrameError::Io(_))), "{:?}", read);
        // A body cut short does not decode either (no message is a prefix of another).
        let body = &frame[4..];
        let short = &body[..cut.saturating_sub(4).min(body.len() - 1)];
        prop_assert!(wire::decode::<Request>(short).is_err());
    }

    #[test]
    fn store_frames_above_the_limit_are_refused_unread(len in (HELLO_FRAME_LIMIT as u32 + 1).., rest in vec(any::<u8>(), 0..64)) {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend(rest);
        match wire::read_frame(&mut &bytes[..], HELLO_FRAME_LIMIT) {
            Err(FrameError::TooLarge { announced, limit }) => {
                prop_assert_eq!(announced, len as usize);
                prop_assert_eq!(limit, HELLO_FRAME_LIMIT);
            }
            other => prop_assert!(false, "expected TooLarge, got {:?}", other),
        }
    }

    #[test]
    fn ring_headers_round_trip(h in header()) {
        let mut raw = [0u8; HEADER_BYTES];
        h.write(&mut raw);
        prop_assert_eq!(Header::parse(&raw).unwrap(), h);
    }

    #[test]
    fn ring_headers_of_every_collective_round_trip_and_name_it((op, name) in collective(), h in header()) {
        let h = Header { op: op.code(), ..h };
        let mut raw = [0u8; HEADER_BYTES];
        h.write(&mut raw);
        let parsed = Header::parse(&raw).unwrap();
        prop_assert_eq!(parsed, h);
        prop_assert_eq!(OpCode::describe(parsed.op), name);
    }

    #[test]
    fn a_ring_header_parses_exactly_when_its_kind_and_reserved_byte_are_valid(raw in any::<[u8; HEADER_BYTES]>()) {
        let valid = (1..=3).contains(&raw[0]) && raw[3] == 0;
        prop_assert_eq!(Header::parse(&raw).is_ok(), valid);
    }

    #[test]
    fn abort_payloads_round_trip(reporter in any::<u64>(), reason in text()) {
        prop_assume!(reason.len() <= MAX_ABORT_BYTES - 8);
        let payload = frame::encode_abort(reporter, &reason);
        prop_assert_eq!(frame::parse_abort(&payload).unwrap(), (reporter, reason));
        let short = payload.len().min(7);
        prop_assert!(frame::parse_abort(&payload[..short]).is_err());
    }

    #[test]
    fn ring_hellos_round_trip(h in hello()) {
        prop_assert_eq!(rendezvous::parse_hello(&h.encode()), Some(h));
    }

    #[test]
    fn peer_cards_round_trip_and_truncated_ones_are_errors(card in peer_card(), cut in any::<Index>()) {
        let bytes = card.encode();
        prop_assert_eq!(PeerCard::decode(&bytes).unwrap(), card);
        prop_assert!(PeerCard::decode(&bytes[..cut.index(bytes.len())]).is_err());
    }

    #[test]
    fn host_cards_round_trip_and_truncated_ones_are_errors(card in host_card(), cut in any::<Index>()) {
        let bytes = bincode::serialize(&card).unwrap();
        prop_assert_eq!(decode_record::<HostCard>(&bytes).unwrap(), card);
        prop_assert!(decode_record::<HostCard>(&bytes[..cut.index(bytes.len())]).is_err());
    }

    #[test]
    fn plans_round_trip_and_truncated_ones_are_errors(p in plan(), cut in any::<Index>()) {
        let bytes = bincode::serialize(&p).unwrap();
        prop_assert_eq!(decode_record::<Plan>(&bytes).unwrap(), p);
        prop_assert!(decode_record::<Plan>(&bytes[..cut.index(bytes.len())]).is_err());
    }

    #[test]
    fn shm_headers_round_trip(l in layout(), nonce in any::<u128>()) {
        let words = region::header_words(l, nonce);
        prop_assert_eq!(region::parse_header(&words, l.world_size, nonce, l.total_bytes()), Ok(l));
    }

    #[test]
    fn an_shm_header_of_another_job_or_world_is_refused(l in layout(), nonce in any::<u128>(), other in any::<u128>(), world in 1usize..=64) {
        let words = region::header_words(l, nonce);
        let len = l.total_bytes();
        if other != nonce {
            let e = region::parse_header(&words, l.world_size, other, len).unwrap_err();
            prop_assert!(e.contains("nonce"), "{}", e);
        }
        if world != l.world_size {
            let e = region::parse_header(&words, world, nonce, len).unwrap_err();
            prop_assert!(e.contains(&format!("created for {} ranks", l.world_size)), "{}", e);
        }
    }

    #[test]
    fn an_shm_header_that_parses_describes_the_file(words in any::<[u64; 6]>(), world in 0usize..1024, nonce in any::<u128>(), len in any::<usize>()) {
        // Arbitrary words never panic; the few that pass describe a layout of exactly the file.
        if let Ok(l) = region::parse_header(&words, world, nonce, len) {
            prop_assert_eq!(l.total_bytes(), len);
            prop_assert_eq!(region::header_words(l, nonce), words);
        }
    }

    #[test]
    fn round_tags_round_trip(words in any::<[u64; 7]>()) {
        let mut all = [0u64; 8];
        all[..7].copy_from_slice(&words);
        let tag = RoundTag::from_words(all);
        prop_assert_eq!(tag.words(), all);
        let shown = tag.describe();
        let seq = format!("#{}", words[0]);
        prop_assert!(shown.contains(&seq), "{}", shown);
    }

    #[test]
    fn round_tags_of_every_collective_round_trip_and_name_it((op, name) in collective(), words in any::<[u64; 7]>()) {
        let mut all = [0u64; 8];
        all[..7].copy_from_slice(&words);
        all[4] = u64::from(op.code());
        let tag = RoundTag::from_words(all);
        prop_assert_eq!(tag.words(), all);
        let shown = tag.describe();
        let start = format!("{name} #{}", words[0]);
        let starts_so = op == OpCode::Broadcast || shown.starts_with(&start);
        prop_assert!(starts_so, "{}", shown);
        prop_assert!(shown.starts_with(name), "{}", shown);
    }

    #[test]
    fn abort_records_keep_the_ranks_and_bound_the_reason(words in any::<[u32; 3]>(), reason in text()) {
        let mut area = [0u8; MAX_REASON_BYTES];
        let n = reason.len().min(MAX_REASON_BYTES);
        area[..n].copy_from_slice(&reason.as_bytes()[..n]);
        let (failed, reporter, read) = region::parse_abort_record(words, &area);
        prop_assert_eq!((failed, reporter), (words[0] as usize, words[1] as usize));
        // Lossy decoding can turn each of the bytes into a 3-byte replacement character.
        prop_assert!(read.len() <= 3 * MAX_REASON_BYTES);
        if words[2] as usize == n {
            if let Ok(valid) = std::str::from_utf8(&area[..n]) {
                prop_assert_eq!(read, valid);
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic_a_decoder(target in 0..fuzzing::TARGETS.len(), bytes in vec(any::<u8>(), 0..600)) {
        let _ = (fuzzing::TARGETS[target].1)(&bytes);
    }

    #[test]
    fn mutated_messages_never_panic_a_decoder((target, bytes) in mutated_seed()) {
        let _ = (fuzzing::TARGETS[target].1)(&bytes);
    }
}

const TOKEN: &str = "property-test-token";
/// The generation the shared test server admits.
const GENERATION: u64 = 3;

fn shared_server() -> SocketAddr {
    static SERVER: OnceLock<StoreServer> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), GENERATION).unwrap()
        })
        .local_addr()
}

/// Runs a handshake with `token` as worker `generation`/`rank` on a fresh connection; returns
/// the server's answer to the proof and the connection.
fn say_hello(token: &str, generation: u64, rank: u64) -> (Response, TcpStream) {
    let mut stream = TcpStream::connect(shared_server()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let peer = Peer::Worker { generation, rank };
    let (challenge, answer) = crate::comm::store::raw_handshake(&mut stream, token, peer);
    assert!(
        matches!(challenge, Some(Response::Challenge { .. })),
        "{challenge:?}"
    );
    (answer.expect("the server answered the proof"), stream)
}

/// Whether the server closed `stream` (it sends nothing more either way).
fn closed(mut stream: TcpStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(stream.read(&mut byte), Ok(0) | Err(_))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn a_store_hello_with_a_wrong_token_is_refused(token in text(), generation in any::<u64>(), rank in any::<u64>()) {
        prop_assume!(token != TOKEN);
        let (reply, stream) = say_hello(&token, generation, rank);
        match reply {
            Response::Refused(reason) => prop_assert!(
                reason.contains(&format!("rank {rank} presented a wrong job token")), "{}", reason
            ),
            other => prop_assert!(false, "expected a refusal, got {:?}", other),
        }
        prop_assert!(closed(stream));
    }

    #[test]
    fn a_store_hello_of_a_stale_generation_is_refused(generation in any::<u64>(), rank in any::<u64>()) {
        prop_assume!(generation != GENERATION);
        let (reply, stream) = say_hello(TOKEN, generation, rank);
        match reply {
            Response::Refused(reason) => prop_assert!(
                reason.contains(&format!(
                    "generation {generation} does not match the store's generation {GENERATION}"
                )),
                "{}", reason
            ),
            other => prop_assert!(false, "expected a refusal, got {:?}", other),
        }
        prop_assert!(closed(stream));
        // The right generation is welcome: the refusal was about the generation alone.
        prop_assert_eq!(say_hello(TOKEN, GENERATION, rank).0, Response::Welcome);
    }
}

/// What a ring listener does with a connection that sends `sent`: `Ok` with the acceptance byte
/// seen by the connecting side, or the listener's error once `patience` has passed.
fn ring_accept(
    expected: &Hello,
    sent: [u8; HELLO_BYTES],
    patience: Duration,
) -> (Result<(), Error>, Option<u8>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let connector = std::thread::spawn(move || {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream.write_all(&sent).unwrap();
        let mut ack = [0u8; 1];
        match stream.read(&mut ack) {
            Ok(1) => Some(ack[0]),
            _ => None, // closed: refused
        }
    });
    let deadline = Instant::now() + patience;
    let options = CpuCommOptions::default();
    let accepted = rendezvous::accept_from(&listener, 1, 0, expected, deadline, &options);
    // Dropping the listener's side of a refused connection lets the connector see it closed.
    let result = accepted.map(drop);
    (result, connector.join().unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn a_ring_hello_of_another_job_instance_or_rank_is_refused(expected in hello(), field in 0usize..4, value in any::<u128>()) {
        let mut wrong = expected;
        match field {
            0 => wrong.from = value as u64,
            1 => wrong.world_size = value as u64,
            2 => wrong.instance = value as u64,
            _ => wrong.nonce = value,
        }
        prop_assume!(wrong != expected);
        let (result, ack) = ring_accept(&expected, wrong.encode(), Duration::from_millis(300));
        prop_assert!(matches!(result, Err(Error::Timeout { .. })), "{:?}", result);
        prop_assert_eq!(ack, None);
        let (result, ack) = ring_accept(&expected, expected.encode(), Duration::from_secs(10));
        prop_assert!(result.is_ok(), "{:?}", result);
        prop_assert_eq!(ack, Some(1));
    }
}
