//! GELU, tanh approximation (GPT-2's `gelu_new`, candle's `Tensor::gelu`, PyTorch's
//! `F.gelu(x, approximate="tanh")`).

#[cfg(feature = "cuda")]
use crate::cuda::{
    cuda_dispatch, elements_config, input, launch, output, storage, CudaElement, ACTIVATIONS,
};
use crate::element::{constant, contiguous, dispatch, Element};
use crate::elementwise::{map_binary, map_unary};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
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
    x.contiguous()?.apply_op1(Gelu)
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

/// The forward op.
struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
            let x = contiguous::<T>("gelu", "x", s, l)?;
            let out = map_unary(x, |x| gelu_and_slope(x).0);
            Ok((T::storage(out), l.shape().clone()))
        }
        dispatch!("gelu", s, run(s, l))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let x = input::<T>("gelu", "x", s, l)?;
            let n = l.shape().elem_count();
            let dev = &s.device;
            let mut y = output::<T>(dev, n)?;
            let n64 = n as u64;
            launch!(dev, ACTIVATIONS, "gelu", T, elements_config(n); &x, &mut y, &n64);
            Ok((storage(y, dev), l.shape().clone()))
        }
        cuda_dispatch!("gelu", s, run(s, l))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&dy.contiguous()?, &GeluBackward)?))
    }
}

/// The backward op: `(x, dy) → dx`.
struct GeluBackward;

impl CustomOp2 for GeluBackward {
    fn name(&self) -> &'static str {
        "gelu-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let x = contiguous::<T>("gelu-backward", "x", s1, l1)?;
            let dy = contiguous::<T>("gelu-backward", "dy", s2, l2)?;
            let out = map_binary(x, dy, |x, g| g * gelu_and_slope(x).1);
            Ok((T::storage(out), l1.shape().clone()))
        }
        dispatch!("gelu-backward", s1, run(s1, l1, s2, l2))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let a = input::<T>("gelu-backward", "x", s1, l1)?;
            let b = input::<T>("gelu-backward", "dy", s2, l2)?;
            let n = l1.shape().elem_count();
            let dev = &s1.device;
            let mut y = output::<T>(dev, n)?;
            let n64 = n as u64;
            launch!(dev, ACTIVATIONS, "gelu_backward", T, elements_config(n); &a, &b, &mut y, &n64);
            Ok((storage(y, dev), l1.shape().clone()))
        }
        cuda_dispatch!("gelu-backward", s1, run(s1, l1, s2, l2))
    }
}
