//! What a unit's code sees: its parameters ([`UnitParams`]), the type of that code ([`Block`]),
//! and the mark that a unit's code is running ([`Running`]), which refuses units inside units.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

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
