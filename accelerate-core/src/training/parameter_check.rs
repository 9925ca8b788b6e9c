//! The check at `prepare` that every rank built the same model: each rank's signature (the
//! gradient bucket configuration, then one line per parameter: name, shape, dtype) is compared
//! with rank 0's through the store, and every rank reports the same first difference.
//!
//! The ranks compare SHA-256 digests, not the signatures: a signature holds a line per parameter,
//! and every rank reading every rank's would move O(W² · P) bytes through the one store. Instead
//! every rank publishes its digest, rank 0 reads them all and publishes its verdict, which every
//! rank reads: O(W) small reads in all. Only where digests differ do signatures travel: each
//! differing rank publishes its own, and rank 0 reads the first one's to name the first
//! differing line.

use std::time::Duration;

use candle_core::Var;
use sha2::{Digest, Sha256};

use crate::comm::store::Store;
use crate::error::{Error, Result};

/// The verdict's first byte: agreed, or which error the rest of it describes.
const AGREED: u8 = b'=';
const PARAMETERS_DIFFER: u8 = b'P';
const CONFIGURATION_DIFFERS: u8 = b'C';

/// Compares this rank's parameter names, shapes and dtypes of model number `model` (trained
/// `vars`, `frozen` ones) and its `bucket_config` with every other rank's, through the store;
/// every rank reports the same first difference.
pub(crate) fn check_same_parameters_everywhere(
    store: &dyn Store,
    (rank, world_size): (usize, usize),
    model: usize,
    bucket_config: &str,
    vars: &[(String, Var)],
    frozen: &[(String, Var)],
) -> Result<()> {
    // The gradient buckets are reduced without a per-call size check (their layout is agreed
    // here), so everything that shapes them or their wire dtype is compared too.
    let signature: String = std::iter::once(format!("{bucket_config}\n"))
        .chain(
            vars.iter()
                .map(|(n, v)| format!("{n} {:?} {:?}\n", v.dims(), v.dtype()))
                .chain(
                    frozen
                        .iter()
                        .map(|(n, v)| format!("{n} {:?} {:?} frozen\n", v.dims(), v.dtype())),
                ),
        )
        .collect();
    let base = match model {
        0 => "accelerate/parameters".to_string(),
        m => format!("accelerate/parameters/model_{m}"),
    };
    let timeout = crate::comm::cpu::CpuCommOptions::from_env()?.timeout;
    check_same_signature_everywhere(store, &base, rank, world_size, &signature, timeout)
}

/// Checks that `signature`, this rank's, equals every other rank's, through the keys under
/// `base` in `store`; every rank returns the same error, naming the first differing rank and
/// line, when one differs.
pub(crate) fn check_same_signature_everywhere(
    store: &dyn Store,
    base: &str,
    rank: usize,
    world_size: usize,
    signature: &str,
    timeout: Duration,
) -> Result<()> {
    let digest_key = |r: usize| format!("{base}/digest/{r}");
    let signature_key = |r: usize| format!("{base}/signature/{r}");
    let verdict_key = format!("{base}/verdict");
    let mine = digest(signature);
    store.set(&digest_key(rank), &mine)?;
    let verdict = if rank == 0 {
        let mut first_differing = None;
        for r in 1..world_size {
            if store.get(&digest_key(r), timeout)? != mine {
                first_differing = Some(r);
                break;
            }
        }
        let verdict = match first_differing {
            None => vec![AGREED],
            Some(r) => {
                let theirs = store.get(&signature_key(r), timeout)?;
                let error = difference(signature, r, &String::from_utf8_lossy(&theirs));
                let (tag, message) = match error {
                    Error::Config(m) => (CONFIGURATION_DIFFERS, m),
                    Error::Parameters(m) => (PARAMETERS_DIFFER, m),
                    other => (PARAMETERS_DIFFER, other.to_string()),
                };
                let mut verdict = vec![tag];
                verdict.extend_from_slice(message.as_bytes());
                verdict
            }
        };
        store.set(&verdict_key, &verdict)?;
        verdict
    } else {
        // A rank that differs from rank 0 publishes its signature, for rank 0 to name the
        // difference (only the first differing rank's is read).
        if store.get(&digest_key(0), timeout)? != mine {
            store.set(&signature_key(rank), signature.as_bytes())?;
        }
        store.get(&verdict_key, timeout)?
    };
    let message = String::from_utf8_lossy(verdict.get(1..).unwrap_or_default()).into_owned();
    match verdict.first() {
        Some(&AGREED) => Ok(()),
        Some(&CONFIGURATION_DIFFERS) => Err(Error::Config(message)),
        _ => Err(Error::Parameters(message)),
    }
}

/// The SHA-256 digest of a signature.
fn digest(signature: &str) -> Vec<u8> {
    Sha256::digest(signature.as_bytes()).to_vec()
}

/// The error for rank `r`'s signature `theirs` differing from rank 0's `reference`: the first
/// line is the configuration of the gradient buckets, the others are the parameters.
fn difference(reference: &str, r: usize, theirs: &str) -> Error {
    let ours_lines: Vec<&str> = reference.lines().collect();
    let their_lines: Vec<&str> = theirs.lines().collect();
    let first = (0..ours_lines.len().max(their_lines.len()))
        .find(|&i| ours_lines.get(i) != their_lines.get(i))
        .unwrap_or(0);
    if first == 0 {
        return Error::Config(format!(
            "rank {r} is configured differently from rank 0: rank 0 has {:?}, rank {r} has {:?}; \
             give every rank the same ACCELERATE_BUCKET_CAP_MB, ACCELERATE_MIXED_PRECISION, \
             ACCELERATE_OVERLAP_GRADIENT_REDUCTION, ACCELERATE_ZERO_STAGE and builder options",
            ours_lines.first().unwrap_or(&"nothing"),
            their_lines.first().unwrap_or(&"nothing")
        ));
    }
    Error::Parameters(format!(
        "rank {r} has different parameters than rank 0 (first difference: rank 0 has {:?}, rank \
         {r} has {:?}; {} vs {} parameters); every rank must build the same model",
        ours_lines.get(first).unwrap_or(&"nothing"),
        their_lines.get(first).unwrap_or(&"nothing"),
        ours_lines.len().saturating_sub(1),
        their_lines.len().saturating_sub(1)
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::comm::store::{StoreServer, TcpStoreClient};

    const WAIT: Duration = Duration::from_secs(20);

    /// A rank's connection to the store that counts what it reads.
    struct Counted {
        inner: TcpStoreClient,
        gets: Arc<AtomicUsize>,
        bytes: Arc<AtomicUsize>,
    }

    impl Store for Counted {
        fn set(&self, key: &str, value: &[u8]) -> Result<()> {
            self.inner.set(key, value)
        }
        fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
            let value = self.inner.get(key, timeout)?;
            self.gets.fetch_add(1, Ordering::SeqCst);
            self.bytes.fetch_add(value.len(), Ordering::SeqCst);
            Ok(value)
        }
        fn add(&self, key: &str, delta: i64) -> Result<i64> {
            self.inner.add(key, delta)
        }
        fn barrier(&self, name: &str, world_size: usize, timeout: Duration) -> Result<()> {
            self.inner.barrier(name, world_size, timeout)
        }
    }

    /// A signature of `params` parameters, the one at `odd` (if any) with another shape.
    fn signature(params: usize, odd: Option<usize>) -> String {
        let mut s = String::from("gradient buckets: cap 26214400 bytes\n");
        for p in 0..params {
            let shape = if Some(p) == odd { "[3, 5]" } else { "[5, 3]" };
            s.push_str(&format!("layers.{p}.weight {shape} F32\n"));
        }
        s
    }

    /// Runs the check on `world` ranks (threads), rank `r` with `signatures(r)`; returns each
    /// rank's result, the `get`s made and the bytes they returned.
    fn run(
        world: usize,
        signatures: impl Fn(usize) -> String + Sync,
    ) -> (Vec<Result<()>>, usize, usize) {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t".into(), 0).unwrap();
        let gets = Arc::new(AtomicUsize::new(0));
        let bytes = Arc::new(AtomicUsize::new(0));
        let results = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let store = Counted {
                        inner: TcpStoreClient::connect(server.local_addr(), "t", 0, rank, WAIT)
                            .unwrap(),
                        gets: gets.clone(),
                        bytes: bytes.clone(),
                    };
                    let signatures = &signatures;
                    scope.spawn(move || {
                        check_same_signature_everywhere(
                            &store,
                            "accelerate/parameters",
                            rank,
                            world,
                            &signatures(rank),
                            WAIT,
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        (
            results,
            gets.load(Ordering::SeqCst),
            bytes.load(Ordering::SeqCst),
        )
    }

    #[test]
    fn agreeing_ranks_read_hashes_not_each_others_signatures() {
        let (world, params) = (8, 300);
        let (results, gets, bytes) = run(world, |_| signature(params, None));
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        // Each rank reads a constant number of small values (rank 0 one per rank): O(W) reads
        // in all, none of them a signature. Reading every rank's signature on every rank is W²
        // reads of ~30 bytes per parameter.
        let one_signature = signature(params, None).len();
        assert!(gets <= 3 * world, "{gets} reads for {world} ranks");
        assert!(
            bytes < one_signature,
            "{bytes} bytes read in all, more than one signature ({one_signature} bytes)"
        );
    }

    #[test]
    fn a_differing_rank_is_named_with_the_first_differing_parameter_on_every_rank() {
        let (world, params) = (6, 50);
        // Ranks 3 and 5 differ, at parameters 17 and 2: rank 3 is the first differing rank.
        let (results, _, bytes) = run(world, |r| match r {
            3 => signature(params, Some(17)),
            5 => signature(params, Some(2)),
            _ => signature(params, None),
        });
        for (rank, result) in results.iter().enumerate() {
            let Err(Error::Parameters(message)) = result else {
                panic!("rank {rank}: {result:?}")
            };
            assert!(
                message.contains("rank 3 has different parameters than rank 0")
                    && message.contains("rank 0 has \"layers.17.weight [5, 3] F32\"")
                    && message.contains("rank 3 has \"layers.17.weight [3, 5] F32\""),
                "rank {rank}: {message}"
            );
        }
        // Only the differing ranks' and rank 0's signatures travel, and each only to rank 0.
        let one_signature = signature(params, None).len();
        assert!(
            bytes < 4 * one_signature,
            "{bytes} bytes read, signatures of {one_signature} bytes"
        );
    }

    #[test]
    fn a_different_bucket_configuration_is_named_as_such() {
        let (results, _, _) = run(2, |r| {
            let s = signature(3, None);
            if r == 1 {
                s.replacen("26214400", "1048576", 1)
            } else {
                s
            }
        });
        for result in &results {
            let Err(Error::Config(message)) = result else {
                panic!("{result:?}")
            };
            assert!(
                message.contains("rank 1 is configured differently from rank 0")
                    && message.contains("1048576"),
                "{message}"
            );
        }
    }
}
