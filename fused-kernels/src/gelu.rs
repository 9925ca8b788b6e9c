//! GELU, tanh approximation (GPT-2's `gelu_new`, candle's `Tensor::gelu`, PyTorch's
//! `F.gelu(x, approximate="tanh")`).

use crate::activation::Activation;
use crate::element::constant;
use candle_core::{Result, Tensor};
use num_traits::Float;

/// `sqrt(2 / π)`.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the approximation.
const CUBIC: f64 = 0.044_715;

/// GELU with the tanh approximation, element-wise:
/// `gelu(x) = x/2 · (1 + tanh(√(2/π) · (x + 0.044715·x³)))`.
///
/// Its gradient, `dx = dy · (½(1 + t) + ½x(1 − t²)·√(2/π)·(1 + 3·0.044715·x²))` with `t` the
/// tanh above, is one pass over `x` and `dy`. f32, f64, and bf16/f16 (computed in f32); the
/// result has the dtype of `x`.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if !crate::element::has_kernel(x) {
        return x.gelu();
    }
    crate::activation::apply::<Gelu>(x)
}

/// `tanh(u)` through one `exp`: `1 − 2 / (1 + e^{2u})`, ±1 at the extremes (no NaN).
#[inline(always)]
pub(crate) fn tanh<A: Float>(u: A) -> A {
    let one = A::one();
    one - (one + one) / (one + (u + u).exp())
}

/// `(gelu(x), gelu'(x))`.
#[inline(always)]
pub(crate) fn gelu_and_slope<A: Float>(x: A) -> (A, A) {
    let half = constant::<A>(0.5);
    let k = constant::<A>(SQRT_2_OVER_PI);
    let c = constant::<A>(CUBIC);
    let x2 = x * x;
    let t = tanh(k * x * (A::one() + c * x2));
    let value = half * x * (A::one() + t);
    let slope = half * (A::one() + t)
        + half * x * (A::one() - t * t) * k * (A::one() + constant::<A>(3.0) * c * x2);
    (value, slope)
}

/// GELU as an [`Activation`].
struct Gelu;

impl Activation for Gelu {
    const NAME: &'static str = "gelu";
    const BACKWARD_NAME: &'static str = "gelu-backward";
    #[cfg(feature = "cuda")]
    const KERNEL: &'static str = "gelu";
    #[cfg(feature = "cuda")]
    const BACKWARD_KERNEL: &'static str = "gelu_backward";

    fn value<A: Float>(x: A) -> A {
        gelu_and_slope(x).0
    }

    fn slope<A: Float>(x: A) -> A {
        gelu_and_slope(x).1
    }
}
