//! ZeRO stage 3, fully sharded data parallel (PyTorch FSDP, DeepSpeed stage 3): the parameters
//! themselves are sharded, so each rank holds 1/N of the model between its uses.
//!
//! - **Units.** A model declares its units ([`UnitSpec`]: a transformer block, the embeddings,
//!   the head) and computes each through [`ShardedUnit::forward`]. Each unit's parameters are one
//!   flat buffer cut into N blocks (`layout`); each rank keeps its block as one 1-D piece per
//!   parameter, which is what `prepare` returns and the optimizer updates, unsharded.
//! - **Forward.** A unit's parameters are all-gathered (in the compute dtype), the unit runs
//!   outside candle's graph, and the gathered buffer is freed; its output enters the graph as one
//!   node (`node`) that holds only the unit's input.
//! - **Backward.** candle has no module hooks, so the node's backward does the unit's: gather
//!   again, recompute the unit on its input, differentiate it (a nested backward pass), add the
//!   parameters' gradients into the unit's window sum, and on the micro-step that syncs
//!   reduce-scatter that sum (mean, in the reduce dtype) into this rank's block at once. Recompute
//!   is how the gathered parameters get freed between forward and backward: candle cannot shrink
//!   a tensor the graph holds.
//! - **Prefetch.** A thread with a communicator of its own gathers the units expected next (in
//!   the order they ran before) while the training thread computes (`prefetch`); the result is
//!   the same with any depth.
//! - **Accumulation.** Non-sync micro-steps make no gradient traffic: each unit's whole window sum
//!   lives from the window's first backward through the unit until the sync (4 bytes per
//!   parameter of that unit, as stage 2's buckets). Each micro-step gathers every unit twice.
//! - **The step.** After the sync, one all-reduce agrees on which parameters got a gradient on
//!   some rank and whether any rank's is not finite (fp16), this rank's pieces of the averaged
//!   gradients are handed to the optimizer, and the optimizer updates the pieces in place: no
//!   gather after the step, since the next forward gathers.
//!
//! The result equals stage 0's within float rounding: the same per-micro-step gradients (on the
//! CPU the recomputed unit is bitwise the original), the same scaled sums, and a mean
//! reduce-scatter in place of a mean all-reduce.

mod layout;
mod node;
mod params;
mod prefetch;
mod state;
mod unit;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Var;

pub(crate) use layout::UnitLayout;
pub use layout::UnitSpec;
pub use params::UnitParams;
pub(crate) use prefetch::Prefetcher;
pub(crate) use state::FsdpState;
pub use unit::ShardedUnit;

use crate::error::Result;
use unit::UnitAccess;

/// A prepared model's units.
#[derive(Debug)]
pub(crate) enum ModelUnits {
    /// Stages 0 to 2: each unit reads the parameters the model computes with (sorted by name).
    Whole {
        layout: UnitLayout,
        compute: Vec<(String, Var)>,
    },
    /// Stage 3.
    Sharded(Arc<FsdpState>),
}

impl ModelUnits {
    /// The handle of the unit called `name`.
    pub fn unit(&self, name: &str) -> Result<ShardedUnit> {
        match self {
            Self::Whole { layout, compute } => {
                let u = layout.find(name)?;
                let tensors: HashMap<String, candle_core::Tensor> = layout.units()[u]
                    .params
                    .iter()
                    .map(|&p| (compute[p].0.clone(), compute[p].1.as_tensor().clone()))
                    .collect();
                let (_, first) = &compute[layout.units()[u].params[0]];
                Ok(ShardedUnit {
                    name: name.to_string(),
                    how: UnitAccess::Whole(UnitParams::new(
                        tensors,
                        first.dtype(),
                        first.device().clone(),
                    )),
                })
            }
            Self::Sharded(state) => Ok(ShardedUnit {
                name: name.to_string(),
                how: UnitAccess::Sharded {
                    state: state.clone(),
                    unit: state.layout().find(name)?,
                },
            }),
        }
    }
}
