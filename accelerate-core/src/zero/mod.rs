//! ZeRO stages 1 and 2: each rank keeps the optimizer state (stage 1), and the averaged gradient
//! (stage 2), of its own 1/N of the flat parameter space only.
//!
//! - The partition ([`ShardPlan`]) follows the gradient buckets, so it is agreed by every rank at
//!   `prepare` without traffic.
//! - Stage 1: backward is unchanged (every bucket all-reduced); the optimizer updates only this
//!   rank's pieces, then [`ZeroState::gather_parameters`] all-gathers the updated parameters.
//! - Stage 2: the sync micro-step reduce-scatters each bucket instead of all-reducing it, so each
//!   rank keeps only its block of the averaged gradient (see `grads` and `sync`); the gradient
//!   norm and the fp16 overflow check then combine every rank's shard.

mod grad_shard;
mod link;
mod plan;
mod prefetch_depth;

use std::sync::Arc;

use candle_core::{Tensor, Var};

pub(crate) use grad_shard::GradientShard;
pub(crate) use link::CommLink;
pub(crate) use plan::ShardPlan;
pub(crate) use prefetch_depth::PrefetchDepth;

use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};

/// The ZeRO stages this runtime implements: 0 (plain data parallel), 1, 2 and 3 (fully
/// sharded, in `fsdp`).
pub(crate) const MAX_ZERO_STAGE: u8 = 3;

/// Checks a ZeRO stage number.
pub(crate) fn check_stage(stage: u8) -> Result<u8> {
    match stage {
        0..=MAX_ZERO_STAGE => Ok(stage),
        n => Err(Error::Config(format!(
            "ZeRO stage {n} does not exist; use 0 (plain data parallel), 1 (optimizer state \
             sharded), 2 (optimizer state and gradients sharded) or 3 (parameters sharded too)"
        ))),
    }
}

/// The configured stage and the way to the communicator, given to each model's training state.
#[derive(Debug, Clone)]
pub(crate) struct ZeroConfig {
    /// 0 to 3.
    pub stage: u8,
    /// The communicator (used only under stages 1 to 3).
    pub link: CommLink,
    /// Stage 3: whether a unit gathered in a window stays gathered until the window's sync
    /// (see `AcceleratorBuilder::keep_gathered_in_window`).
    pub keep_gathered: bool,
    /// Stage 3: how many units are gathered ahead (see `AcceleratorBuilder::fsdp_prefetch`).
    pub prefetch: PrefetchDepth,
}

impl ZeroConfig {
    /// Stage `stage` (checked) over `comm`.
    pub fn new(stage: u8, comm: &Arc<dyn Communicator>) -> Self {
        Self {
            stage,
            link: CommLink::new(comm),
            keep_gathered: false,
            prefetch: PrefetchDepth::DEFAULT,
        }
    }
}

/// What a model's training state knows of ZeRO once its parameters are prepared.
#[derive(Debug)]
pub(crate) struct ZeroState {
    stage: u8,
    rank: usize,
    plan: Arc<ShardPlan>,
    link: CommLink,
}

impl ZeroState {
    /// The state of stage `stage` (1 or 2) for this `rank` over `plan`.
    pub fn new(stage: u8, rank: usize, plan: ShardPlan, link: CommLink) -> Self {
        Self {
            stage,
            rank,
            plan: Arc::new(plan),
            link,
        }
    }

    /// The stage: 1 or 2.
    pub fn stage(&self) -> u8 {
        self.stage
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The partition.
    pub fn plan(&self) -> &Arc<ShardPlan> {
        &self.plan
    }

    /// Runs `f` with the communicator (see [`CommLink`]).
    pub fn with_comm<R>(
        &self,
        what: &str,
        f: impl FnOnce(&dyn Communicator) -> Result<R>,
    ) -> Result<R> {
        self.link.with(what, f)
    }

    /// After the optimizer updated this rank's pieces: every rank's pieces, all-gathered bucket
    /// by bucket, into every rank's parameters (`params`: the sorted list the plan was made
    /// from).
    pub fn gather_parameters(&self, params: &[(String, Var)]) -> Result<()> {
        let plan = &self.plan;
        self.link.with("optimizer.step()", |comm| {
            for b in 0..plan.buckets() {
                let block = plan.block(b);
                if block == 0 {
                    continue;
                }
                let range = plan.bucket_params(b);
                let first = params[range.start].1.as_tensor();
                let (dtype, device) = (first.dtype(), first.device().clone());
                let mut parts = Vec::new();
                let mut filled = 0;
                for p in range.clone() {
                    if let Some(piece) = plan.piece(p, self.rank) {
                        let flat = params[p].1.as_tensor().flatten_all()?;
                        parts.push(flat.narrow(0, piece.start, piece.len())?);
                        filled += piece.len();
                    }
                }
                if filled < block {
                    parts.push(Tensor::zeros(block - filled, dtype, &device)?);
                }
                let send = Tensor::cat(&parts, 0)?;
                drop(parts);
                let gathered = Tensor::zeros(plan.padded_len(b), dtype, &device)?;
                comm.all_gather_into_agreed(&send, &gathered)?;
                for p in range {
                    let (_, offset) = plan.position(p);
                    let var = params[p].1.as_tensor();
                    let value = gathered.narrow(0, offset, var.elem_count())?;
                    var.flatten_all()?.slice_set(&value, 0, 0)?;
                }
            }
            Ok(())
        })
    }

    /// One all-reduce (max) of what every rank must decide alike after a stage-2 reduce-scatter:
    /// whether some rank missed a parameter's gradient, and whether some rank's shard holds a
    /// non-finite value. Returns `(missing_somewhere, nonfinite_somewhere)`.
    pub fn agree_on_verdict(
        comm: &dyn Communicator,
        missing_here: bool,
        nonfinite_here: bool,
        device: &candle_core::Device,
    ) -> Result<(bool, bool)> {
        let flags = Tensor::new(
            &[
                f32::from(u8::from(missing_here)),
                f32::from(u8::from(nonfinite_here)),
            ],
            device,
        )?;
        comm.all_reduce_agreed(&flags, ReduceOp::Max)?;
        let v = flags.to_vec1::<f32>()?;
        Ok((v[0] > 0.0, v[1] > 0.0))
    }
}
