//! The read-only view of the window's gradients that [`Optimizer::step`](crate::optim::Optimizer)
//! reads: gradients by parameter name, and nothing that changes them or syncs them.

use std::ops::Range;

use candle_core::Tensor;

use super::GradientBuffers;
use crate::error::Result;

/// The gradients an optimizer steps with, by parameter name: read-only, so that an optimizer
/// cannot change what the runtime averaged across ranks. Cheap to copy (a reference).
#[derive(Debug, Clone, Copy)]
pub struct Gradients<'a> {
    buffers: &'a GradientBuffers,
}

impl<'a> Gradients<'a> {
    /// The gradient of parameter `name`, or `None` if it has none in this window (PyTorch's
    /// `grad is None`: optimizers skip such parameters). Under ZeRO stage 2 each rank holds only
    /// its pieces of the gradients: read them with [`piece`](Self::piece).
    pub fn get(&self, name: &str) -> Option<&'a Tensor> {
        self.buffers.get(name)
    }

    /// Whether parameter `name` has a gradient in this window, whole or (ZeRO stage 2) as this
    /// rank's pieces; false for an unknown name.
    pub fn has_gradient(&self, name: &str) -> bool {
        self.buffers.has_gradient(name)
    }

    /// Elements `piece` of the flattened gradient of `name` (1-D): what a ZeRO-sharded optimizer
    /// updates its piece of the parameter from. An error if `name` has no gradient or `piece` is
    /// out of its range.
    pub fn piece(&self, name: &str, piece: Range<usize>) -> Result<Tensor> {
        self.buffers.piece(name, piece)
    }

    /// Every parameter's name, sorted, with or without a gradient.
    pub fn names(&self) -> impl Iterator<Item = &'a str> {
        self.buffers.names()
    }

    /// `(name, gradient)` of every parameter that has a whole gradient in this window, sorted by
    /// name.
    pub fn iter(&self) -> impl Iterator<Item = (&'a str, &'a Tensor)> {
        let buffers = self.buffers;
        buffers
            .names()
            .filter_map(move |name| Some((name, buffers.get(name)?)))
    }
}

impl<'a> From<&'a GradientBuffers> for Gradients<'a> {
    fn from(buffers: &'a GradientBuffers) -> Self {
        Self { buffers }
    }
}

impl GradientBuffers {
    /// The read-only view an optimizer steps with.
    pub fn gradients(&self) -> Gradients<'_> {
        Gradients { buffers: self }
    }
}
