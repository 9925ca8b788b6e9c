//! The normalization at the start of a pre-norm layer ([`crate::attention_block`],
//! [`crate::mlp_block`]): LayerNorm (GPT-2) or RMSNorm (Llama).

use candle_core::{Result, Tensor};

/// The norm a fused layer applies to its input before its projections.
#[derive(Debug, Clone)]
pub enum Norm {
    /// LayerNorm with `weight` and `bias` `[width]` (see [`crate::layer_norm`]).
    Layer {
        /// The scale `[width]`.
        weight: Tensor,
        /// The shift `[width]`.
        bias: Tensor,
        /// Added to the variance.
        eps: f64,
    },
    /// RMSNorm with `weight` `[width]` (see [`crate::rms_norm`]).
    Rms {
        /// The scale `[width]`.
        weight: Tensor,
        /// Added to the mean square.
        eps: f64,
    },
}

impl Norm {
    /// The norm's parameters, in the order [`Norm::backward`] returns their gradients.
    pub(crate) fn parameters(&self) -> Vec<&Tensor> {
        match self {
            Norm::Layer { weight, bias, .. } => vec![weight, bias],
            Norm::Rms { weight, .. } => vec![weight],
        }
    }

    /// Checks the parameters' shapes against the layer's `width` and `dtype`.
    pub(crate) fn check(&self, op: &str, width: usize, dtype: candle_core::DType) -> Result<()> {
        for p in self.parameters() {
            if p.dims() != [width] || p.dtype() != dtype {
                candle_core::bail!(
                    "{op}: the norm's parameters must be [{width}] (the input's last dimension) \
                     in the input's dtype {dtype:?}, got {:?} {:?}",
                    p.dims(),
                    p.dtype()
                );
            }
        }
        Ok(())
    }

    /// The norm of `x` with candle's differentiable ops (devices without the kernels).
    pub(crate) fn apply(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Norm::Layer { weight, bias, eps } => crate::fallback::layer_norm(x, weight, bias, *eps),
            Norm::Rms { weight, eps } => crate::fallback::rms_norm(x, weight, *eps),
        }
    }

    /// The norm of `x` `[rows, width]` (detached), with `params` the detached parameters.
    pub(crate) fn forward(&self, x: &Tensor, params: &[Tensor]) -> Result<Tensor> {
        match self {
            Norm::Layer { eps, .. } => {
                crate::layer_norm::forward_raw(x, &params[0], &params[1], *eps)
            }
            Norm::Rms { eps, .. } => crate::rms_norm::forward_raw(x, &params[0], *eps),
        }
    }

    /// `(dx + dres, parameters' gradients)` for the norm's output gradient `dy`, where `dres` is
    /// the gradient reaching `x` along the residual path (added in the same pass).
    pub(crate) fn backward(
        &self,
        x: &Tensor,
        params: &[Tensor],
        dy: &Tensor,
        dres: &Tensor,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        match self {
            Norm::Layer { eps, .. } => {
                let (dx, dw, db) =
                    crate::layer_norm::backward_raw(x, &params[0], dy, Some(dres), *eps)?;
                Ok((dx, vec![dw, db]))
            }
            Norm::Rms { eps, .. } => {
                let (dx, dw) = crate::rms_norm::backward_raw(x, &params[0], dy, Some(dres), *eps)?;
                Ok((dx, vec![dw]))
            }
        }
    }
}
