//! The handle a model computes a unit through ([`ShardedUnit`]).
//!
//! A model written against these runs unchanged at every ZeRO stage: at stages 0 to 2 a unit's
//! forward is a plain call on the prepared parameters; at stage 3 it gathers the unit's
//! parameters, runs, and frees them (see the crate's `fsdp` module).

use std::sync::Arc;

use candle_core::Tensor;

use super::params::{Running, UnitParams};
use super::state::FsdpState;
use crate::error::Result;

/// One unit of a prepared model (see [`UnitSpec`](crate::UnitSpec)): run the model's code for it
/// through [`forward`](Self::forward).
#[derive(Clone)]
pub struct ShardedUnit {
    pub(crate) name: String,
    pub(crate) how: UnitAccess,
}

/// How a unit reaches its parameters.
#[derive(Clone)]
pub(crate) enum UnitAccess {
    /// Stages 0 to 2: the parameters themselves.
    Whole(UnitParams),
    /// Stage 3: gathered for each pass.
    Sharded { state: Arc<FsdpState>, unit: usize },
}

impl std::fmt::Debug for ShardedUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedUnit")
            .field("name", &self.name)
            .field("sharded", &matches!(self.how, UnitAccess::Sharded { .. }))
            .finish()
    }
}

impl ShardedUnit {
    /// The unit's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `block(x, params)`: the unit's forward, with its parameters.
    ///
    /// At stages 0 to 2 this is that call. At stage 3 the unit's parameters are all-gathered
    /// first (in the compute dtype), `block` runs outside candle's graph, and they are freed
    /// after; in the backward pass they are gathered again and `block` runs again (so `block`
    /// must compute the same function each time: no dropout drawing fresh randomness), and the
    /// unit's gradients go into this rank's shard. `block` must read only `x`, `params` and
    /// tensors that need no gradient (masks, positions, targets); `x` is the one input that
    /// receives a gradient.
    pub fn forward<F>(&self, x: &Tensor, block: F) -> Result<Tensor>
    where
        F: Fn(&Tensor, &UnitParams) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        match &self.how {
            UnitAccess::Whole(params) => {
                let _running = Running::enter(&self.name)?;
                Ok(block(x, params)?)
            }
            UnitAccess::Sharded { state, unit } => {
                state.clone().forward_unit(*unit, x, Arc::new(block))
            }
        }
    }
}
