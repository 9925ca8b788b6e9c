//! Entry points for the fuzz targets in `fuzz/` and for the replay of their corpus in the tests:
//! one function per decoder of bytes that come from another process — the store's frames, the
//! ring's frame headers and hellos, the records ranks publish through the store, and the shared
//! mapping's header, round tags and abort record.
//!
//! Each function decodes arbitrary bytes the way the runtime does and returns `Err` with the
//! decoder's message when they are malformed. It panics only when an invariant is broken: a
//! decoder panicked, or a value it accepted does not encode back to the bytes it came from (a
//! decoder that accepts two spellings of one value can be made to disagree with its peer).
//!
//! Not part of the API: it exists only in the fuzz targets' builds (`cfg(fuzzing)`, which
//! cargo-fuzz sets) and in the unit tests, which replay the committed corpus
//! ([`corpus_replay`]); it changes with the wire formats.

use crate::comm::cpu::frame::{self, FrameKind, Header, HEADER_BYTES, MAX_ABORT_BYTES};
use crate::comm::cpu::rendezvous::{self, Hello, PeerCard, HELLO_BYTES};
use crate::comm::cpu::shm::region::{self, HEADER_WORDS, MAX_REASON_BYTES};
use crate::comm::cpu::shm::session::RoundTag;
use crate::comm::cpu::shm::setup::{self, HostCard, Plan};
use crate::comm::store::wire::{self, Request, Response};
use crate::comm::store::wire::{HELLO_FRAME_LIMIT, MAX_FRAME_BYTES};

#[cfg(test)]
mod corpus_replay;

/// A decoder under test: arbitrary bytes in, `Err` with the decoder's message when malformed.
pub type Target = fn(&[u8]) -> Result<(), String>;

/// Every target, by the name of its fuzz target (`fuzz/fuzz_targets/<name>.rs`) and corpus
/// directory (`fuzz/corpus/<name>/`).
pub const TARGETS: &[(&str, Target)] = &[
    ("store_request", store_request),
    ("store_response", store_response),
    ("ring_header", ring_header),
    ("ring_hello", ring_hello),
    ("store_records", store_records),
    ("shm_region_header", shm_region_header),
    ("shm_round_tag", shm_round_tag),
    ("shm_abort_record", shm_abort_record),
];

/// Reads `data` as the frames a store client sends on one connection, as the server does: the
/// two of the handshake under [`HELLO_FRAME_LIMIT`], the others under [`MAX_FRAME_BYTES`].
pub fn store_request(data: &[u8]) -> Result<(), String> {
    frames::<Request>(data, HELLO_FRAME_LIMIT)
}

/// Reads `data` as the frames the store sends back on one connection, as a client does.
pub fn store_response(data: &[u8]) -> Result<(), String> {
    frames::<Response>(data, MAX_FRAME_BYTES)
}

fn frames<T>(data: &[u8], first_limit: usize) -> Result<(), String>
where
    T: serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut rest = data;
    let mut limit = first_limit;
    let mut read = 0;
    while !rest.is_empty() {
        let before = rest;
        let body = wire::read_frame(&mut rest, limit).map_err(|e| e.to_string())?;
        let message: T = wire::decode(&body)?;
        let frame = &before[..before.len() - rest.len()];
        let again = wire::encode(&message)?;
        assert_eq!(
            again, frame,
            "{message:?} encodes to other bytes than it came from"
        );
        read += 1;
        if read == 2 {
            limit = MAX_FRAME_BYTES;
        }
    }
    Ok(())
}

/// Reads `data` as a ring frame header followed, for an abort frame, by its payload.
pub fn ring_header(data: &[u8]) -> Result<(), String> {
    let raw: &[u8; HEADER_BYTES] = data
        .get(..HEADER_BYTES)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| format!("{} bytes, shorter than a header", data.len()))?;
    let header = Header::parse(raw)?;
    let mut again = [0u8; HEADER_BYTES];
    header.write(&mut again);
    assert_eq!(
        &again, raw,
        "{header:?} writes other bytes than it came from"
    );
    if header.kind != FrameKind::Abort {
        return Ok(());
    }
    // As the transport does: the announced length is checked before anything is read.
    if header.len < 8 || header.len > MAX_ABORT_BYTES as u64 {
        return Err(format!(
            "abort frame with a payload of {} bytes",
            header.len
        ));
    }
    let payload = data[HEADER_BYTES..]
        .get(..header.len as usize)
        .ok_or("the abort payload is truncated")?;
    let (reporter, reason) = frame::parse_abort(payload)?;
    if std::str::from_utf8(&payload[8..]).is_ok() {
        assert_eq!(frame::encode_abort(reporter, &reason), payload);
    }
    Ok(())
}

/// Reads `data` as the hello that opens a ring connection.
pub fn ring_hello(data: &[u8]) -> Result<(), String> {
    let raw: &[u8; HELLO_BYTES] = data
        .try_into()
        .map_err(|_| format!("{} bytes, a hello has {HELLO_BYTES}", data.len()))?;
    let hello: Hello = rendezvous::parse_hello(raw).ok_or("not a ring hello (wrong magic)")?;
    assert_eq!(&hello.encode(), raw, "{hello:?} encodes to other bytes");
    Ok(())
}

/// Reads `data[1..]` as a record published through the store, chosen by `data[0] % 3`: a ring
/// address card, a shared-memory host card, or rank 0's transport plan.
pub fn store_records(data: &[u8]) -> Result<(), String> {
    let (&which, bytes) = data.split_first().ok_or("empty input")?;
    // The store hands back whole values; decoding reads a prefix of them.
    let again = match which % 3 {
        0 => PeerCard::decode(bytes)?.encode(),
        1 => encode_record(&setup::decode_record::<HostCard>(bytes)?),
        _ => encode_record(&setup::decode_record::<Plan>(bytes)?),
    };
    assert!(bytes.starts_with(&again), "a record encodes to other bytes");
    Ok(())
}

fn encode_record<T: serde::Serialize>(value: &T) -> Vec<u8> {
    bincode::serialize(value).expect("a decoded record encodes")
}

/// Reads `data` as the header words of a shared mapping (48 bytes), then the world size (`u16`),
/// the nonce (`u128`) and the file length (`u64`) the opening rank expects.
pub fn shm_region_header(data: &[u8]) -> Result<(), String> {
    const NEED: usize = 8 * HEADER_WORDS + 2 + 16 + 8;
    if data.len() < NEED {
        return Err(format!("{} bytes, {NEED} needed", data.len()));
    }
    let header: [u64; HEADER_WORDS] = std::array::from_fn(|i| u64_at(data, 8 * i));
    let at = 8 * HEADER_WORDS;
    let world_size = u16::from_le_bytes([data[at], data[at + 1]]) as usize;
    let nonce = u128::from_le_bytes(data[at + 2..at + 18].try_into().expect("16 bytes"));
    let file_len = u64_at(data, at + 18) as usize;
    let layout = region::parse_header(&header, world_size, nonce, file_len)?;
    assert_eq!(layout.total_bytes(), file_len);
    assert_eq!(region::header_words(layout, nonce), header);
    Ok(())
}

/// Reads `data` as the eight words of a round tag in a peer's staging half (64 bytes).
pub fn shm_round_tag(data: &[u8]) -> Result<(), String> {
    if data.len() < 64 {
        return Err(format!("{} bytes, a round tag has 64", data.len()));
    }
    let words: [u64; 8] = std::array::from_fn(|i| u64_at(data, 8 * i));
    let tag = RoundTag::from_words(words);
    let shown = tag.describe();
    assert!(!shown.is_empty());
    let mut expected = words;
    expected[7] = 0; // reserved: not part of the tag
    assert_eq!(tag.words(), expected);
    Ok(())
}

/// Reads `data` as an abort record of the shared mapping: failed rank, reporting rank and reason
/// length (three `u32`), then the reason area (zero-padded or cut to its size).
pub fn shm_abort_record(data: &[u8]) -> Result<(), String> {
    if data.len() < 12 {
        return Err(format!(
            "{} bytes, an abort record has at least 12",
            data.len()
        ));
    }
    let words: [u32; 3] =
        std::array::from_fn(|i| u32::from_le_bytes(data[4 * i..4 * i + 4].try_into().unwrap()));
    let mut area = [0u8; MAX_REASON_BYTES];
    let text = &data[12..data.len().min(12 + MAX_REASON_BYTES)];
    area[..text.len()].copy_from_slice(text);
    let (failed, reporter, reason) = region::parse_abort_record(words, &area);
    assert_eq!((failed, reporter), (words[0] as usize, words[1] as usize));
    let shown = (words[2] as usize).min(MAX_REASON_BYTES);
    if let Ok(valid) = std::str::from_utf8(&area[..shown]) {
        assert_eq!(reason, valid);
    }
    Ok(())
}

fn store_frame<T: serde::Serialize>(message: &T) -> Vec<u8> {
    wire::encode(message).expect("a seed message encodes")
}

fn u64_at(data: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"))
}

/// Well-formed inputs for each target (its seed corpus): every kind of message or record.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    match target {
        "store_request" => {
            let hello = Request::Hello {
                version: wire::PROTOCOL_VERSION,
                nonce: [7; wire::NONCE_BYTES],
            };
            let prove = Request::Prove {
                proof: [9; 32],
                peer: wire::Peer::Worker {
                    generation: 1,
                    rank: 3,
                },
            };
            let rest = [
                Request::Set {
                    key: "cpu_comm/1/rank0".into(),
                    value: vec![1, 2, 3],
                },
                Request::Get {
                    key: "barrier/x/0/done".into(),
                    timeout_ms: 5000,
                },
                Request::Add {
                    key: "barrier/x/arrived".into(),
                    delta: 1,
                },
            ];
            let mut session = store_frame(&hello);
            let mut seeds = vec![session.clone()];
            session.extend(store_frame(&prove));
            for request in &rest {
                session.extend(store_frame(request));
            }
            seeds.push(session);
            let mut launcher = store_frame(&hello);
            launcher.extend(store_frame(&Request::Prove {
                proof: [5; 32],
                peer: wire::Peer::Launcher {
                    machine: 1,
                    farewell_log: "launchers".into(),
                    farewell: vec![4, 1],
                },
            }));
            launcher.extend(store_frame(&Request::Append {
                log: "launchers".into(),
                value: vec![0, 1, 2],
            }));
            seeds.push(launcher);
            // Protocol 1's hellos, which the server decodes to tell such a client to upgrade.
            seeds.push(store_frame(&Request::HelloV1 {
                token: "0123456789abcdef".into(),
                generation: 1,
                rank: 3,
            }));
            seeds.push(store_frame(&Request::LauncherHelloV1 {
                token: "0123456789abcdef".into(),
                machine: 1,
                farewell_log: "launchers".into(),
                farewell: vec![4, 1],
            }));
            seeds
        }
        "store_response" => [
            Response::Welcome,
            Response::Done,
            Response::Value(b"127.0.0.1:4000".to_vec()),
            Response::Counter(-2),
            Response::NotFound,
            Response::Failed("not a counter".into()),
            Response::Refused("stale generation".into()),
            Response::Challenge {
                version: wire::PROTOCOL_VERSION,
                nonce: [3; wire::NONCE_BYTES],
                proof: [4; 32],
            },
        ]
        .iter()
        .map(store_frame)
        .collect(),
        "ring_header" => {
            let header = |kind, len: u64| {
                let mut raw = vec![0u8; HEADER_BYTES];
                Header {
                    kind,
                    op: 1,
                    dtype: 1,
                    index: 2,
                    seq: 7,
                    len,
                }
                .write(&mut raw);
                raw
            };
            let payload = frame::encode_abort(1, "rank 2 closed its connection");
            let mut abort = header(FrameKind::Abort, payload.len() as u64);
            abort.extend(payload);
            vec![
                header(FrameKind::Data, 4096),
                header(FrameKind::KeepAlive, 0),
                abort,
            ]
        }
        "ring_hello" => vec![Hello {
            from: 1,
            world_size: 4,
            instance: 2,
            nonce: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
        }
        .encode()
        .to_vec()],
        "store_records" => {
            let card = PeerCard {
                addr: "127.0.0.1:40000".parse().expect("address"),
                nonce: 99,
                world_size: 2,
            };
            let host = HostCard {
                choice: crate::comm::cpu::TransportChoice::Auto,
                world_size: 2,
                host: Some(crate::comm::host_identity::HostIdentity {
                    hostname: "node1".into(),
                    boot_id: "5d1c0a2e".into(),
                    pid_namespace: "pid:[4026531836]".into(),
                    net_namespace: "net:[4026531840]".into(),
                }),
            };
            let plans = [
                Plan::Tcp("ranks on several machines".into()),
                Plan::Shm {
                    path: "/dev/shm/accelerate-1".into(),
                    nonce: 7,
                },
                Plan::Refuse("transport choices differ".into()),
            ];
            let mut seeds = vec![
                [vec![0], card.encode()].concat(),
                [vec![1], encode_record(&host)].concat(),
            ];
            seeds.extend(plans.iter().map(|p| [vec![2], encode_record(p)].concat()));
            seeds
        }
        "shm_region_header" => {
            let layout = region::Layout {
                world_size: 2,
                piece_bytes: 512 << 10,
            };
            let nonce = (0xfeed_u128 << 64) | 0xbeef;
            let mut seed: Vec<u8> = region::header_words(layout, nonce)
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .collect();
            seed.extend((layout.world_size as u16).to_le_bytes());
            seed.extend(nonce.to_le_bytes());
            seed.extend((layout.total_bytes() as u64).to_le_bytes());
            vec![seed]
        }
        "shm_round_tag" => vec![RoundTag {
            seq: 3,
            round: 10,
            index: 1,
            len: 1000,
            op: 4,
            dtype: 1,
            root: 1,
        }
        .words()
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect()],
        "shm_abort_record" => {
            let reason = "rank 1 exited during all_reduce #4";
            let mut seed: Vec<u8> = [1u32, 0, reason.len() as u32]
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .collect();
            seed.extend(reason.as_bytes());
            vec![seed]
        }
        other => panic!("no fuzz target named {other:?}"),
    }
}
