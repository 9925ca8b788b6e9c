//! How each end of a store connection proves that it holds the job token without sending it: a
//! challenge and response with HMAC-SHA256 (RFC 2104) keyed by the token.
//!
//! The client sends a fresh random nonce; the server answers with its own nonce and
//! `HMAC(token, server label, client nonce, server nonce)`; the client checks that proof, and
//! only then answers with `HMAC(token, client label, client nonce, server nonce, who it is)`.
//! So:
//!
//! - the token never crosses the network, and someone who reads the traffic cannot replay a
//!   proof: the other side's nonce is new on every connection;
//! - a program that holds the port without knowing the token (it bound the port first) cannot
//!   produce the server's proof, and the client leaves before it has sent anything that depends
//!   on the token;
//! - the labels keep a proof of one side from ever passing as the other's, and the client's
//!   proof covers what it claims to be (rank, generation, or launcher and farewell), which
//!   cannot then be altered in transit.
//!
//! Comparisons of proofs take the same time whatever the bytes (`hmac`'s `verify_slice`).

use hmac::{Hmac, Mac};
use rand::Rng;
use sha2::Sha256;

use super::wire::{Nonce, Peer, Proof, PROTOCOL_VERSION};

type HmacSha256 = Hmac<Sha256>;

/// Prefixes of what each side's proof covers: a proof made by one side never checks as the
/// other's. The protocol version is part of them, so a proof of one version is not one of
/// another.
const SERVER_LABEL: &[u8] = b"accelerate-rs rendezvous store, server proof, protocol ";
const CLIENT_LABEL: &[u8] = b"accelerate-rs rendezvous store, client proof, protocol ";

/// A fresh nonce from the thread's cryptographically secure generator (seeded by the OS).
pub(crate) fn nonce() -> Nonce {
    rand::rng().random()
}

/// A fresh job token: 32 random bytes, in hex.
pub(crate) fn random_token() -> String {
    let bytes: [u8; 32] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn keyed(token: &str, label: &[u8], client: &Nonce, server: &Nonce) -> HmacSha256 {
    // HMAC takes a key of any length (a long one is hashed first): this cannot fail.
    let mut mac =
        HmacSha256::new_from_slice(token.as_bytes()).expect("HMAC accepts a key of every length");
    mac.update(label);
    mac.update(&PROTOCOL_VERSION.to_le_bytes());
    mac.update(client);
    mac.update(server);
    mac
}

/// The canonical bytes of what a client says it is, which its proof covers.
fn peer_bytes(peer: &Peer) -> Result<Vec<u8>, String> {
    super::wire::encode(peer)
}

/// The server's proof for the nonces of one handshake.
pub(crate) fn server_proof(token: &str, client: &Nonce, server: &Nonce) -> Proof {
    keyed(token, SERVER_LABEL, client, server)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `proof` is the server's proof for these nonces under `token`.
pub(crate) fn server_proof_holds(
    token: &str,
    client: &Nonce,
    server: &Nonce,
    proof: &Proof,
) -> bool {
    keyed(token, SERVER_LABEL, client, server)
        .verify_slice(proof)
        .is_ok()
}

/// The client's proof for the nonces of one handshake and what it says it is.
pub(crate) fn client_proof(
    token: &str,
    client: &Nonce,
    server: &Nonce,
    peer: &Peer,
) -> Result<Proof, String> {
    let mut mac = keyed(token, CLIENT_LABEL, client, server);
    mac.update(&peer_bytes(peer)?);
    Ok(mac.finalize().into_bytes().into())
}

/// Whether `proof` is the client's proof for these nonces and `peer` under `token`.
pub(crate) fn client_proof_holds(
    token: &str,
    client: &Nonce,
    server: &Nonce,
    peer: &Peer,
    proof: &Proof,
) -> bool {
    let Ok(bytes) = peer_bytes(peer) else {
        return false;
    };
    let mut mac = keyed(token, CLIENT_LABEL, client, server);
    mac.update(&bytes);
    mac.verify_slice(proof).is_ok()
}

/// A client's side of the handshake on a raw connection, for tests of the server: sends the
/// hello and, whatever the server proved, a proof made with `token`; returns the server's
/// answers to both.
#[cfg(test)]
pub(crate) fn raw_handshake(
    stream: &mut std::net::TcpStream,
    token: &str,
    peer: Peer,
) -> (Option<super::wire::Response>, Option<super::wire::Response>) {
    use super::wire::{
        decode, encode, read_frame, write_frame, Request, Response, HELLO_FRAME_LIMIT,
    };
    let mut ask = |request: &Request| -> Option<Response> {
        write_frame(stream, &encode(request).ok()?).ok()?;
        decode(&read_frame(stream, HELLO_FRAME_LIMIT).ok()?).ok()
    };
    let client = nonce();
    let challenge = ask(&Request::Hello {
        version: PROTOCOL_VERSION,
        nonce: client,
    });
    let Some(Response::Challenge { nonce: server, .. }) = challenge else {
        return (challenge, None);
    };
    let proof = client_proof(token, &client, &server, &peer).expect("a test peer encodes");
    let welcome = ask(&Request::Prove { proof, peer });
    (challenge, welcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HMAC-SHA256 test case 2 of RFC 4231 (key "Jefe"), computed by this module's primitive:
    /// the proofs are HMAC-SHA256 as published, not something of our own.
    #[test]
    fn the_mac_is_hmac_sha256_of_rfc_4231() {
        let mut mac = HmacSha256::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        let hex: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    fn worker() -> Peer {
        Peer::Worker {
            generation: 0,
            rank: 1,
        }
    }

    #[test]
    fn a_proof_holds_only_for_its_token_its_nonces_its_side_and_its_peer() {
        let (c, s) = (nonce(), nonce());
        assert_ne!(c, s, "two nonces drawn alike");
        let server = server_proof("t", &c, &s);
        assert!(server_proof_holds("t", &c, &s, &server));
        assert!(!server_proof_holds("u", &c, &s, &server));
        assert!(!server_proof_holds("t", &s, &c, &server));
        assert!(!server_proof_holds("t", &c, &nonce(), &server));
        let client = client_proof("t", &c, &s, &worker()).unwrap();
        assert!(client_proof_holds("t", &c, &s, &worker(), &client));
        assert!(!client_proof_holds("u", &c, &s, &worker(), &client));
        assert!(!client_proof_holds("t", &c, &nonce(), &worker(), &client));
        let other_rank = Peer::Worker {
            generation: 0,
            rank: 2,
        };
        assert!(!client_proof_holds("t", &c, &s, &other_rank, &client));
        // One side's proof never passes as the other's.
        assert_ne!(server, client);
        assert!(!server_proof_holds("t", &c, &s, &client));
    }

    #[test]
    fn a_random_token_is_64_hex_digits_and_new_each_time() {
        let (a, b) = (random_token(), random_token());
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
