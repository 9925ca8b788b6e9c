//! The scalars of a fully sharded model's optimizers (ZeRO stage 3). Each rank's optimizer steps
//! only its own pieces, so it keeps a parameter's step count (`"step.<param>"`, see
//! [`OptimizerState`]) only where it holds a piece of that parameter: a rank that holds none
//! never steps it. The main process writes the scalars once for all, so it first receives every
//! rank's and keeps each key from the first rank that has it (hyper-parameters are the same on
//! every rank, and a step count on every rank that holds a piece). A rank that loads keeps only the
//! step counts of the parameters it holds a piece of, as the optimizer that saved them had.

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::{Device, Tensor};

use super::layout::ModelLayout;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::optim::OptimizerState;
use crate::training::TrainingSnapshot;

/// One rank's scalars of every optimizer of every fully sharded model: per model (in order,
/// empty for a model below stage 3), per optimizer, each key with its value's bits.
type RankScalars = Vec<Vec<Vec<(String, u64)>>>;

/// Every rank's `bytes`, in rank order (an all-gather of their lengths, then of the bytes padded
/// to the longest).
fn all_gather_bytes(comm: &dyn Communicator, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
    let lengths = comm
        .all_gather(&Tensor::new(&[bytes.len() as i64], &Device::Cpu)?)?
        .flatten_all()?
        .to_vec1::<i64>()?;
    let longest = lengths.iter().copied().max().unwrap_or(0).max(1) as usize;
    let mut padded = bytes;
    padded.resize(longest, 0);
    let all = comm.all_gather(&Tensor::from_vec(padded, (1, longest), &Device::Cpu)?)?;
    lengths
        .iter()
        .enumerate()
        .map(|(rank, &len)| Ok(all.get(rank)?.narrow(0, 0, len as usize)?.to_vec1::<u8>()?))
        .collect()
}

/// Replaces, on the main process, the scalars of every fully sharded model's optimizers in
/// `snapshots` with the union of every rank's (each key from the first rank that has it). A
/// collective over the ranks when some model is fully sharded (the same on every rank); nothing
/// otherwise.
pub(crate) fn merge_on_main(
    comm: &dyn Communicator,
    rank: usize,
    layouts: &[ModelLayout],
    snapshots: &mut [TrainingSnapshot],
) -> Result<()> {
    if comm.world_size() == 1 || !layouts.iter().any(ModelLayout::shards_parameters) {
        return Ok(());
    }
    let ours: RankScalars = layouts
        .iter()
        .zip(snapshots.iter())
        .map(|(layout, snapshot)| {
            if !layout.shards_parameters() {
                return Vec::new();
            }
            snapshot
                .optimizers
                .iter()
                .map(|state| {
                    state
                        .scalars
                        .iter()
                        .map(|(k, v)| (k.clone(), v.to_bits()))
                        .collect()
                })
                .collect()
        })
        .collect();
    let bytes = serde_json::to_vec(&ours)
        .map_err(|e| Error::Optimizer(format!("cannot encode the optimizers' scalars: {e}")))?;
    let all = all_gather_bytes(comm, bytes)?;
    if rank != 0 {
        return Ok(());
    }
    let all: Vec<RankScalars> = all
        .iter()
        .enumerate()
        .map(|(r, bytes)| {
            serde_json::from_slice(bytes).map_err(|e| {
                Error::Optimizer(format!(
                    "rank {r}'s optimizer scalars did not arrive whole: {e}"
                ))
            })
        })
        .collect::<Result<_>>()?;
    for (m, snapshot) in snapshots.iter_mut().enumerate() {
        if !layouts[m].shards_parameters() {
            continue;
        }
        for (i, state) in snapshot.optimizers.iter_mut().enumerate() {
            let mut merged = BTreeMap::new();
            for rank in &all {
                let Some(scalars) = rank.get(m).and_then(|opts| opts.get(i)) else {
                    return Err(Error::Optimizer(format!(
                        "the ranks prepared different optimizers for model {m}; prepare the \
                         same ones on every rank"
                    )));
                };
                for (k, bits) in scalars {
                    merged.entry(k.clone()).or_insert(f64::from_bits(*bits));
                }
            }
            state.scalars = merged;
        }
    }
    Ok(())
}

/// Drops from `state` the step counts of the parameters (`names`, sorted) of which this rank
/// holds no piece (`pieces[p]` is `None`): under ZeRO stage 3 its optimizer never steps them, and
/// holds no state for them.
pub(crate) fn keep_held_step_counts(
    state: &mut OptimizerState,
    names: &[(String, candle_core::Shape)],
    pieces: &[Option<Range<usize>>],
) {
    for ((name, _), piece) in names.iter().zip(pieces) {
        if piece.is_none() {
            state.scalars.remove(&format!("step.{name}"));
        }
    }
}
