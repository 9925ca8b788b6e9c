//! The savable state of an optimizer, and the checks that make loading it all-or-nothing.

use std::collections::{BTreeMap, BTreeSet};

use candle_core::{DType, Device, Tensor, Var};

use crate::error::{Error, Result};

/// Savable optimizer state: tensors by key, plus scalars (step counts, hyper-parameters).
///
/// Keys are `"<what>.<parameter name>"` for per-parameter entries (`"exp_avg.l1.weight"`,
/// `"step.l1.weight"`, `"momentum_buffer.l1.weight"`) and bare names for hyper-parameters (`"lr"`,
/// `"beta1"`, ...). A parameter that has never received a gradient has no entries, as in PyTorch.
#[derive(Debug, Clone)]
pub struct OptimizerState {
    /// Which optimizer wrote it: `"sgd"` or `"adamw"`.
    pub kind: String,
    /// Per-parameter tensors (moments, momentum buffers), deep copies on the CPU.
    pub tensors: BTreeMap<String, Tensor>,
    /// Step counts and hyper-parameters.
    pub scalars: BTreeMap<String, f64>,
}

impl OptimizerState {
    /// An empty state of the given kind.
    pub fn new(kind: impl Into<String>) -> Self {
        Self {
            kind: kind.into(),
            tensors: BTreeMap::new(),
            scalars: BTreeMap::new(),
        }
    }
}

/// `"<what>.<name>"`.
pub(crate) fn key(what: &str, name: &str) -> String {
    format!("{what}.{name}")
}

/// A deep copy of `t` on the CPU, so that later in-place updates do not reach the saved state.
pub(crate) fn snapshot(t: &Tensor) -> Result<Tensor> {
    Ok(if t.device().is_cpu() {
        t.force_contiguous()?
    } else {
        t.to_device(&Device::Cpu)?
    })
}

/// Reads a state being loaded, remembering which keys were used so that leftovers (a state saved from
/// a model with other parameter names) are reported instead of silently dropped.
pub(crate) struct StateReader<'a> {
    state: &'a OptimizerState,
    used_tensors: BTreeSet<&'a str>,
    used_scalars: BTreeSet<&'a str>,
}

impl<'a> StateReader<'a> {
    /// Checks the kind and starts reading.
    pub fn new(state: &'a OptimizerState, kind: &str) -> Result<Self> {
        if state.kind != kind {
            return Err(Error::Optimizer(format!(
                "the state was saved by a {:?} optimizer but is being loaded into {kind:?}; \
                 create the same optimizer kind that saved it",
                state.kind
            )));
        }
        Ok(Self {
            state,
            used_tensors: BTreeSet::new(),
            used_scalars: BTreeSet::new(),
        })
    }

    /// A required scalar (a hyper-parameter).
    pub fn scalar(&mut self, name: &str) -> Result<f64> {
        self.optional_scalar(name)?.ok_or_else(|| {
            Error::Optimizer(format!(
                "{:?} state lacks the scalar {name:?}; it was not written by this optimizer's \
                 state() (a truncated or hand-edited checkpoint?)",
                self.state.kind
            ))
        })
    }

    /// A scalar that may be absent.
    pub fn optional_scalar(&mut self, name: &str) -> Result<Option<f64>> {
        match self.state.scalars.get_key_value(name) {
            Some((k, &v)) => {
                self.used_scalars.insert(k.as_str());
                Ok(Some(v))
            }
            None => Ok(None),
        }
    }

    /// A per-parameter step count: absent, or a whole number that fits a `u64`.
    pub fn step(&mut self, param: &str) -> Result<Option<u64>> {
        let k = key("step", param);
        let Some(v) = self.optional_scalar(&k)? else {
            return Ok(None);
        };
        if !(v >= 0.0 && v.fract() == 0.0 && v < u64::MAX as f64) {
            return Err(Error::Optimizer(format!(
                "state scalar {k:?} is {v}, but a step count must be a whole number >= 0"
            )));
        }
        Ok(Some(v as u64))
    }

    /// The tensor `"<what>.<name>"` of parameter `var` (or, under ZeRO, of its `piece`: a 1-D
    /// tensor of the piece's length), if present, checked for shape and copied into fresh storage
    /// of `dtype` on the parameter's device.
    pub fn tensor(
        &mut self,
        what: &str,
        name: &str,
        var: &Var,
        piece: Option<std::ops::Range<usize>>,
        dtype: DType,
    ) -> Result<Option<Tensor>> {
        let k = key(what, name);
        let Some((k, t)) = self.state.tensors.get_key_value(&k) else {
            return Ok(None);
        };
        match &piece {
            None if t.shape() != var.shape() => {
                return Err(Error::Optimizer(format!(
                    "state tensor {k:?} has shape {:?} but parameter {name:?} has shape {:?}; \
                     the state was saved from a model with different layer sizes",
                    t.dims(),
                    var.dims()
                )));
            }
            Some(piece) if t.dims() != [piece.len()] => {
                return Err(Error::Optimizer(format!(
                    "state tensor {k:?} has shape {:?} but this rank's ZeRO piece of parameter \
                     {name:?} is elements {piece:?} (shape [{}]); a sharded optimizer loads the \
                     pieces of its own partition (checkpoints re-cut them)",
                    t.dims(),
                    piece.len()
                )));
            }
            _ => {}
        }
        self.used_tensors.insert(k.as_str());
        // `force_contiguous` always copies: the loaded state must not alias the caller's tensors,
        // which the fused update would otherwise modify in place.
        let t = t
            .to_dtype(dtype)?
            .to_device(var.device())?
            .force_contiguous()?;
        Ok(Some(t))
    }

    /// Fails if some keys of the state were not read: they name parameters this optimizer lacks.
    pub fn finish(self) -> Result<()> {
        let unknown_tensors: Vec<&str> = self
            .state
            .tensors
            .keys()
            .map(String::as_str)
            .filter(|k| !self.used_tensors.contains(k))
            .collect();
        let unknown_scalars: Vec<&str> = self
            .state
            .scalars
            .keys()
            .map(String::as_str)
            .filter(|k| !self.used_scalars.contains(k))
            .collect();
        if unknown_tensors.is_empty() && unknown_scalars.is_empty() {
            return Ok(());
        }
        Err(Error::Optimizer(format!(
            "{:?} state has entries for parameters this optimizer does not have (tensors {:?}, \
             scalars {:?}); the state was saved from a model with different parameter names, or \
             the optimizer was given a different set of parameters",
            self.state.kind, unknown_tensors, unknown_scalars
        )))
    }
}

/// Dtype of optimizer state for a parameter of `dtype`: f64 stays f64, everything else (f32, and the
/// half types of mixed precision) keeps its state in f32.
pub(crate) fn state_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}
