//! The handle a model computes a unit through ([`ShardedUnit`]), and what the unit's code sees of
//! its parameters ([`UnitParams`]).
//!
//! A model written against these runs unchanged at every ZeRO stage: at stages 0 to 2 a unit's
//! forward is a plain call on the prepared parameters; at stage 3 it gathers the unit's
//! parameters, runs, and frees them (see the crate's `fsdp` module).

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::state::FsdpState;
use crate::error::{Error, Result};

/// A unit's computation: its input, its parameters, its output.
pub(crate) type Block =
    Arc<dyn Fn(&Tensor, &UnitParams) -> candle_core::Result<Tensor> + Send + Sync>;

/// A unit's parameters by their full names (the names the model was prepared with), as the
/// unit's code reads them: at stage 3 the gathered values, in the compute dtype; otherwise the
/// prepared parameters themselves (under mixed precision, their compute copies).
#[derive(Debug, Clone)]
pub struct UnitParams {
    tensors: HashMap<String, Tensor>,
    dtype: DType,
    device: Device,
}

impl UnitParams {
    pub(crate) fn new(tensors: HashMap<String, Tensor>, dtype: DType, device: Device) -> Self {
        Self {
            tensors,
            dtype,
            device,
        }
    }

    /// The parameter called `name` (its full name, e.g. `h.0.attn.c_attn.weight`); an error naming
    /// the unit's parameters if it has none of that name.
    pub fn get(&self, name: &str) -> candle_core::Result<Tensor> {
        self.tensors.get(name).cloned().ok_or_else(|| {
            let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
            names.sort_unstable();
            candle_core::Error::Msg(format!(
                "the unit has no parameter {name:?}; it holds {names:?}"
            ))
        })
    }

    /// A `VarBuilder` over the unit's parameters, so that a model's layers are built the way
    /// they are built from a checkpoint (`Linear` from `vb.pp("attn").pp("c_attn")`).
    pub fn var_builder(&self) -> candle_nn::VarBuilder<'static> {
        candle_nn::VarBuilder::from_tensors(self.tensors.clone(), self.dtype, &self.device)
    }
}

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

thread_local! {
    /// The unit whose code is running on this thread, if any.
    static RUNNING: Cell<bool> = const { Cell::new(false) };
}

/// Marks a unit's code as running on this thread for as long as it lives.
pub(crate) struct Running;

impl Running {
    /// Refuses a unit inside another unit: at stage 3 the inner one's gathers and reductions would
    /// run again, out of order, when the outer one is recomputed in the backward pass.
    pub(crate) fn enter(name: &str) -> Result<Self> {
        if RUNNING.with(|r| r.replace(true)) {
            return Err(Error::Config(format!(
                "unit {name:?} was run inside another unit's code; units do not nest: run each \
                 unit from the model's top-level forward"
            )));
        }
        Ok(Self)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING.with(|r| r.set(false));
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
