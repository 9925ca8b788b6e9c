//! Agreement on the outcome of a step that ranks do apart (rank 0 creating a directory, every rank
//! writing its file): after it, every rank joins one small all-gather of its outcome, so that all
//! return `Ok` only if every rank succeeded, and otherwise all return an error naming the ranks
//! that failed and why. Without it, a rank that failed alone would return at once while the others
//! waited for it at the next barrier, and the job would end in "rank 0 left the job during barrier"
//! instead of the cause.

use std::path::Path;

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

/// How much of a failed rank's error message travels to the other ranks (the rest is cut; the
/// failed rank itself returns its whole error).
const REASON_BYTES: usize = 480;

/// One row to exchange: `[flag, text bytes..., 0 padding]`, in i64 (a dtype every communicator
/// carries); the text is cut to [`REASON_BYTES`] on a character boundary.
fn row(flag: i64, text: &str) -> Result<Tensor> {
    let mut row = vec![0i64; 1 + REASON_BYTES];
    row[0] = flag;
    let mut end = text.len().min(REASON_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    for (slot, byte) in row[1..].iter_mut().zip(text[..end].bytes()) {
        *slot = i64::from(byte);
    }
    Ok(Tensor::from_vec(row, (1, 1 + REASON_BYTES), &Device::Cpu)?)
}

/// The text of a row made by [`row`].
fn row_text(row: &[i64]) -> String {
    let bytes: Vec<u8> = row[1..]
        .iter()
        .take_while(|&&b| b != 0)
        .map(|&b| b as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// This rank's outcome as one row: failed (0/1), then the error's message.
fn outcome_row<T>(local: &Result<T>) -> Result<Tensor> {
    match local {
        Ok(_) => row(0, ""),
        Err(e) => row(1, &e.to_string()),
    }
}

/// The ranks that failed and their messages, from the gathered rows `[world, 1 + REASON_BYTES]`.
fn failures(gathered: &Tensor) -> Result<Vec<(usize, String)>> {
    let rows = gathered.to_vec2::<i64>()?;
    Ok(rows
        .iter()
        .enumerate()
        .filter(|(_, row)| row[0] != 0)
        .map(|(rank, row)| (rank, row_text(row)))
        .collect())
}

/// Exchanges `local` (this rank's outcome of `what`, done on `path`) with every rank through
/// `all_gather` and returns it (`Ok`) on every rank only if all succeeded. A rank that failed returns its
/// own error; the others return an error naming each failed rank and its message. Alone, `local` is
/// returned as it is, with no collective.
pub(crate) fn agree_with<T>(
    all_gather: impl FnOnce(&Tensor) -> Result<Tensor>,
    world_size: usize,
    path: &Path,
    what: &str,
    local: Result<T>,
) -> Result<T> {
    if world_size == 1 {
        return local;
    }
    let gathered = all_gather(&outcome_row(&local)?)?;
    let failed = failures(&gathered)?;
    if failed.is_empty() {
        return local;
    }
    local?;
    let causes: Vec<String> = failed
        .iter()
        .map(|(rank, why)| format!("rank {rank} failed: {why}"))
        .collect();
    Err(Error::Checkpoint {
        path: path.to_path_buf(),
        problem: format!(
            "{what} did not succeed on every rank ({}); this rank stopped as well, so no rank is \
             left waiting for the others. Fix the cause on the rank named and run again",
            causes.join("; ")
        ),
    })
}

/// Exchanges what this rank picked for `what` under `path` (such as the checkpoint it found
/// latest) with every rank through `all_gather`: `key`, which must be equal on every rank, and
/// `shown`, how the pick reads in the error. `Ok` on every rank only if all keys are equal,
/// otherwise an error on every rank naming each rank's pick. Keys compare in full up to
/// [`REASON_BYTES`] bytes together with what is shown (keep them short: they travel first).
pub(crate) fn agree_on_choice(
    all_gather: impl FnOnce(&Tensor) -> Result<Tensor>,
    world_size: usize,
    path: &Path,
    what: &str,
    key: &str,
    shown: &str,
) -> Result<()> {
    if world_size == 1 {
        return Ok(());
    }
    // The key cannot hold a newline: it ends at the first one.
    let gathered = all_gather(&row(0, &format!("{}\n{shown}", key.replace('\n', " ")))?)?;
    let picks: Vec<(String, String)> = gathered
        .to_vec2::<i64>()?
        .iter()
        .map(|r| {
            let text = row_text(r);
            let (key, shown) = text.split_once('\n').unwrap_or((&text, ""));
            (key.to_string(), shown.to_string())
        })
        .collect();
    if picks.iter().all(|(k, _)| k == &picks[0].0) {
        return Ok(());
    }
    let named: Vec<String> = picks
        .iter()
        .enumerate()
        .map(|(rank, (_, shown))| format!("rank {rank}: {shown}"))
        .collect();
    Err(Error::Checkpoint {
        path: path.to_path_buf(),
        problem: format!(
            "the ranks found different {what} ({}); every rank must load the same checkpoint: \
             put the directory on a file system that every machine shares, or copy the same \
             checkpoint to each machine. Nothing was loaded",
            named.join("; ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::store::on_store_clients;
    use crate::comm::Communicator;
    use crate::comm::{CpuCommOptions, CpuCommunicator};

    /// Runs `f(rank, communicator)` on `world` threads joined in one ring.
    fn on_ring<R: Send>(world: usize, f: impl Fn(usize, CpuCommunicator) -> R + Sync) -> Vec<R> {
        on_store_clients(world, "t", |rank, store| {
            let options = CpuCommOptions::default();
            f(
                rank,
                CpuCommunicator::connect(store, rank, world, options).unwrap(),
            )
        })
    }

    #[test]
    fn one_failed_rank_makes_every_rank_fail_with_its_name_and_reason() {
        let path = Path::new("out/checkpoint_3");
        let results = on_ring(3, |rank, comm| {
            let local = if rank == 1 {
                Err(Error::Config("disk full on node b".into()))
            } else {
                Ok(())
            };
            agree_with(
                |t| comm.all_gather(t),
                3,
                path,
                "writing the checkpoint",
                local,
            )
            .map_err(|e| e.to_string())
        });
        assert_eq!(
            results[1].as_ref().unwrap_err(),
            "invalid configuration: disk full on node b"
        );
        for rank in [0, 2] {
            let e = results[rank].as_ref().unwrap_err();
            assert!(
                e.contains("out/checkpoint_3")
                    && e.contains("writing the checkpoint")
                    && e.contains("rank 1 failed: invalid configuration: disk full on node b"),
                "rank {rank}: {e}"
            );
        }
        // And all succeed when all did; a long multi-byte message is cut on a character boundary.
        let ok = on_ring(2, |_, comm| {
            agree_with(|t| comm.all_gather(t), 2, path, "x", Ok(())).is_ok()
        });
        assert_eq!(ok, [true, true]);
        let long = "é".repeat(REASON_BYTES);
        let cut = on_ring(2, |rank, comm| {
            let local = if rank == 0 {
                Err(Error::Config(long.clone()))
            } else {
                Ok(())
            };
            agree_with(|t| comm.all_gather(t), 2, path, "x", local).map_err(|e| e.to_string())
        });
        let e = cut[1].as_ref().unwrap_err();
        assert!(
            e.contains("rank 0 failed: invalid configuration: é") && !e.contains('\u{fffd}'),
            "{e}"
        );
    }

    #[test]
    fn picks_compare_by_key_and_are_named_by_what_is_shown() {
        let path = Path::new("out");
        let agree = |keys: [&'static str; 2]| {
            on_ring(2, move |rank, comm| {
                let shown = format!("/machine_{rank}/checkpoint_7");
                agree_on_choice(
                    |t| comm.all_gather(t),
                    2,
                    path,
                    "checkpoints",
                    keys[rank],
                    &shown,
                )
                .map_err(|e| e.to_string())
            })
        };
        // The same checkpoint at each machine's own path: one pick.
        assert_eq!(
            agree(["step 7 manifest 0a", "step 7 manifest 0a"]),
            [Ok(()), Ok(())]
        );
        for e in agree(["step 7 manifest 0a", "none"]) {
            let e = e.unwrap_err();
            assert!(
                e.contains("rank 0: /machine_0/checkpoint_7; rank 1: /machine_1/checkpoint_7")
                    && !e.contains("manifest 0a"),
                "{e}"
            );
        }
    }
}
