//! The store's wire format: length-prefixed bincode frames, and the messages they carry.
//!
//! A frame is a little-endian `u32` byte length followed by that many bytes of bincode. The length
//! is checked against a limit *before* anything is allocated, so a peer cannot make the server
//! reserve memory by announcing a huge frame, and the body's buffer grows only as its bytes
//! arrive, so announcing a large frame and sending little costs the reader little. Until a
//! connection has proven that it holds the job token, its limit is [`HELLO_FRAME_LIMIT`];
//! afterwards it is [`MAX_FRAME_BYTES`].
//!
//! A connection opens with a handshake in which each side proves it holds the job token without
//! sending it (see `super::auth`): the client's [`Request::Hello`] carries the protocol version
//! and its nonce, the server's [`Response::Challenge`] its nonce and its proof, the client's
//! [`Request::Prove`] its proof and who it is; then [`Response::Welcome`]. The variants of
//! protocol 1, which sent the token itself, keep their places so that a client of that version
//! is told why it is refused; the `Hello` variant and `Refused` keep theirs in every later
//! version for the same reason.

use std::io::{Read, Write};

use bincode::Options;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest frame (value plus key and framing) the store accepts from an authenticated client.
pub const MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

/// Largest frame accepted during the handshake, before a client has proven it holds the job
/// token.
pub const HELLO_FRAME_LIMIT: usize = 64 * 1024;

/// The version of the store's protocol that this build speaks; client and server must agree.
/// Version 1 sent the job token in clear; version 2 proves it by challenge and response.
pub const PROTOCOL_VERSION: u32 = 2;

/// Bytes of a handshake nonce.
pub const NONCE_BYTES: usize = 32;

/// A random value each side contributes to a handshake, so that no proof is ever valid twice.
pub type Nonce = [u8; NONCE_BYTES];

/// An HMAC-SHA256 that shows its sender holds the job token.
pub type Proof = [u8; 32];

/// What a client asks of the store.
///
/// One request at a time per connection: a client sends nothing until it has the reply to its
/// last request, and does not half-close while it waits (the server takes a connection that
/// closes during a `Get` for a client that left, and answers nothing more).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Request {
    /// Protocol 1's first frame, which carried the job token in clear. Never admitted: decoded
    /// only so that a client of that version is told to upgrade.
    HelloV1 {
        /// The token protocol 1 sent (ignored).
        token: String,
        /// The restart round.
        generation: u64,
        /// The client's rank.
        rank: u64,
    },
    /// Stores `value` under `key`, replacing any previous value.
    Set { key: String, value: Vec<u8> },
    /// Returns the value of `key`, waiting up to `timeout_ms` for it to be set.
    Get { key: String, timeout_ms: u64 },
    /// Adds `delta` to the counter under `key` (absent counts as 0) and returns the new value.
    Add { key: String, delta: i64 },
    /// Protocol 1's first frame of a launcher's control connection, with the token in clear.
    /// Never admitted, as [`Request::HelloV1`].
    LauncherHelloV1 {
        /// The token protocol 1 sent (ignored).
        token: String,
        /// The launcher's machine rank.
        machine: u64,
        /// The list its farewell went to.
        farewell_log: String,
        /// Its farewell.
        farewell: Vec<u8>,
    },
    /// Appends `value` to the list `log`: stores it under `"{log}/{index}"` with the next index
    /// (from 0, counted under the key `log`) and returns that index as a `Counter`.
    Append { log: String, value: Vec<u8> },
    /// First frame of every connection: the protocol version the client speaks and its nonce.
    Hello {
        /// [`PROTOCOL_VERSION`] of the client.
        version: u32,
        /// The client's fresh random nonce.
        nonce: Nonce,
    },
    /// Second frame, after the server's [`Response::Challenge`] proved it holds the token: the
    /// client's proof, and who it is (the proof covers that too, so it cannot be changed).
    Prove {
        /// The client's proof (see `super::auth::client_proof`).
        proof: Proof,
        /// Who the client is.
        peer: Peer,
    },
}

/// Who a client is, as it says in its [`Request::Prove`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Peer {
    /// A worker: the restart round it belongs to and its rank (for the server's messages).
    Worker {
        /// The restart round the client belongs to.
        generation: u64,
        /// The client's rank, for the server's log messages.
        rank: u64,
    },
    /// A machine's launcher, on its control connection: admitted whatever the generation. Its
    /// keys live apart from the workers' and outlive restarts; when the connection closes, for
    /// whatever reason, the server appends `farewell` (if not empty) to the list `farewell_log`.
    Launcher {
        /// The launcher's machine rank, for the server's log messages.
        machine: u64,
        /// The list the farewell goes to.
        farewell_log: String,
        /// What the server appends there when the connection closes.
        farewell: Vec<u8>,
    },
}

/// The store's answer to one [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Response {
    /// The client proved it holds the token and is admitted.
    Welcome,
    /// A `Set` was applied.
    Done,
    /// The value of a `Get`.
    Value(Vec<u8>),
    /// The new value of an `Add`.
    Counter(i64),
    /// A `Get` found no value within its timeout.
    NotFound,
    /// The request could not be carried out; the connection stays usable.
    Failed(String),
    /// The connection is refused (wrong token, stale generation, malformed frame, another
    /// protocol version); the server closes it after this frame.
    Refused(String),
    /// The server's answer to a [`Request::Hello`]: its version, its nonce, and its proof that
    /// it holds the job token.
    Challenge {
        /// [`PROTOCOL_VERSION`] of the server.
        version: u32,
        /// The server's fresh random nonce.
        nonce: Nonce,
        /// The server's proof (see `super::auth::server_proof`).
        proof: Proof,
    },
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The socket failed or was closed (`UnexpectedEof` when closed between frames).
    Io(std::io::Error),
    /// The announced length exceeds the limit; nothing was allocated.
    TooLarge { announced: usize, limit: usize },
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Io(e) => write!(f, "{e}"),
            FrameError::TooLarge { announced, limit } => write!(
                f,
                "frame of {announced} bytes exceeds the limit of {limit} bytes"
            ),
        }
    }
}

fn options(limit: usize) -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_limit(limit as u64)
        .reject_trailing_bytes()
}

/// Serializes `message` into a complete frame (length prefix included).
pub(crate) fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, String> {
    let body = options(MAX_FRAME_BYTES)
        .serialize(message)
        .map_err(|e| format!("cannot encode store message: {e}"))?;
    if body.len() > MAX_FRAME_BYTES {
        return Err(format!(
            "store message of {} bytes exceeds the frame limit of {MAX_FRAME_BYTES} bytes; \
             store large data in files and put their paths in the store",
            body.len()
        ));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Deserializes one frame body; anything malformed (including trailing bytes) is an error.
pub(crate) fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    options(body.len())
        .deserialize(body)
        .map_err(|e| format!("malformed store frame: {e}"))
}

fn check_length(prefix: [u8; 4], limit: usize) -> Result<usize, FrameError> {
    let announced = u32::from_le_bytes(prefix) as usize;
    if announced > limit {
        return Err(FrameError::TooLarge { announced, limit });
    }
    Ok(announced)
}

/// The first frame in `buffer` (bytes read so far), if all of it is there: its body and the
/// number of bytes it took. Refuses an announced length above `limit` as soon as the prefix is
/// there.
pub(crate) fn split_frame(
    buffer: &[u8],
    limit: usize,
) -> Result<Option<(Vec<u8>, usize)>, FrameError> {
    let &[a, b, c, d, ..] = buffer else {
        return Ok(None);
    };
    let len = check_length([a, b, c, d], limit)?;
    Ok(buffer.get(4..4 + len).map(|body| (body.to_vec(), 4 + len)))
}

/// Capacity reserved for a frame body before its bytes arrive; beyond it the buffer grows as
/// they do.
const INITIAL_BODY_CAPACITY: usize = 64 * 1024;

/// The body read so far, checked to be complete.
fn complete(body: Vec<u8>, len: usize) -> Result<Vec<u8>, FrameError> {
    if body.len() < len {
        return Err(FrameError::Io(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "the connection closed after {} of the frame's {len} bytes",
                body.len()
            ),
        )));
    }
    Ok(body)
}

/// Reads one frame body from a blocking stream.
pub(crate) fn read_frame(stream: &mut impl Read, limit: usize) -> Result<Vec<u8>, FrameError> {
    let mut prefix = [0u8; 4];
    stream.read_exact(&mut prefix).map_err(FrameError::Io)?;
    let len = check_length(prefix, limit)?;
    let mut body = Vec::with_capacity(len.min(INITIAL_BODY_CAPACITY));
    stream
        .take(len as u64)
        .read_to_end(&mut body)
        .map_err(FrameError::Io)?;
    complete(body, len)
}

/// Writes a complete frame (as made by [`encode`]) to a blocking stream.
pub(crate) fn write_frame(stream: &mut impl Write, frame: &[u8]) -> std::io::Result<()> {
    stream.write_all(frame)?;
    stream.flush()
}

/// Reads one frame body from an async stream.
pub(crate) async fn read_frame_async(
    stream: &mut (impl AsyncRead + Unpin),
    limit: usize,
) -> Result<Vec<u8>, FrameError> {
    let mut prefix = [0u8; 4];
    stream
        .read_exact(&mut prefix)
        .await
        .map_err(FrameError::Io)?;
    let len = check_length(prefix, limit)?;
    let mut body = Vec::with_capacity(len.min(INITIAL_BODY_CAPACITY));
    stream
        .take(len as u64)
        .read_to_end(&mut body)
        .await
        .map_err(FrameError::Io)?;
    complete(body, len)
}

/// Writes a complete frame to an async stream.
pub(crate) async fn write_frame_async(
    stream: &mut (impl AsyncWrite + Unpin),
    frame: &[u8],
) -> std::io::Result<()> {
    stream.write_all(frame).await?;
    stream.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_survives_the_round_trip() {
        let request = Request::Set {
            key: "a/b".into(),
            value: vec![1, 2, 3],
        };
        let frame = encode(&request).unwrap();
        // 4-byte prefix, then fixint bincode: variant u32, key length u64 + 3 bytes, value
        // length u64 + 3 bytes.
        assert_eq!(frame.len(), 4 + 4 + 8 + 3 + 8 + 3);
        assert_eq!(u32::from_le_bytes(frame[..4].try_into().unwrap()), 26);
        let body = read_frame(&mut &frame[..], MAX_FRAME_BYTES).unwrap();
        assert_eq!(decode::<Request>(&body).unwrap(), request);
    }

    #[test]
    fn an_oversized_length_is_refused_before_reading_the_body() {
        // Announces 1 GiB but carries nothing: must fail on the length, not on a short read.
        let frame = (1u32 << 30).to_le_bytes();
        match read_frame(&mut &frame[..], MAX_FRAME_BYTES) {
            Err(FrameError::TooLarge { announced, limit }) => {
                assert_eq!(announced, 1 << 30);
                assert_eq!(limit, MAX_FRAME_BYTES);
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }

    #[test]
    fn a_frame_is_split_off_only_once_all_of_it_is_there() {
        let mut bytes = encode(&Response::Counter(7)).unwrap();
        let whole = bytes.len();
        bytes.extend_from_slice(&[9, 9]); // the start of the next frame
        for have in 0..whole {
            assert!(split_frame(&bytes[..have], MAX_FRAME_BYTES)
                .unwrap()
                .is_none());
        }
        let (body, used) = split_frame(&bytes, MAX_FRAME_BYTES).unwrap().unwrap();
        assert_eq!(used, whole);
        assert_eq!(decode::<Response>(&body).unwrap(), Response::Counter(7));
        // The length is checked as soon as the prefix is there, before the body arrives.
        let huge = ((HELLO_FRAME_LIMIT + 1) as u32).to_le_bytes();
        assert!(matches!(
            split_frame(&huge, HELLO_FRAME_LIMIT),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn malformed_bodies_and_trailing_bytes_are_errors() {
        assert!(decode::<Request>(&[0xff, 0xff, 0xff, 0xff]).is_err());
        let mut body = encode(&Response::Done).unwrap()[4..].to_vec();
        assert_eq!(decode::<Response>(&body).unwrap(), Response::Done);
        body.push(0);
        assert!(decode::<Response>(&body).is_err());
        // A byte string claiming more bytes than the body holds is rejected, not allocated.
        let mut lying = 2u32.to_le_bytes().to_vec(); // variant Value
        lying.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode::<Response>(&lying).is_err());
    }
}
