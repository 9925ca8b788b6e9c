//! SiLU (swish), PyTorch's `F.silu`.

use crate::activation::Activation;
use candle_core::{Result, Tensor};
use num_traits::Float;

/// SiLU, element-wise: `silu(x) = x · σ(x)` with `σ(x) = 1 / (1 + e^{−x})`.
///
/// Gradient: `dx = dy · σ(x) · (1 + x · (1 − σ(x)))`. f32, f64, and bf16/f16 (computed in f32);
/// the result has the dtype of `x`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    if !crate::element::has_kernel(x) {
        return x.silu();
    }
    crate::activation::apply::<Silu>(x)
}

/// `σ(x)`.
#[inline(always)]
pub(crate) fn sigmoid<A: Float>(x: A) -> A {
    A::one() / (A::one() + (-x).exp())
}

/// `silu'(x)`.
#[inline(always)]
pub(crate) fn silu_slope<A: Float>(x: A) -> A {
    let s = sigmoid(x);
    s * (A::one() + x * (A::one() - s))
}

/// SiLU as an [`Activation`].
struct Silu;

impl Activation for Silu {
    const NAME: &'static str = "silu";
    const BACKWARD_NAME: &'static str = "silu-backward";
    #[cfg(feature = "cuda")]
    const KERNEL: &'static str = "silu";
    #[cfg(feature = "cuda")]
    const BACKWARD_KERNEL: &'static str = "silu_backward";

    fn value<A: Float>(x: A) -> A {
        x * sigmoid(x)
    }

    fn slope<A: Float>(x: A) -> A {
        silu_slope(x)
    }
}
