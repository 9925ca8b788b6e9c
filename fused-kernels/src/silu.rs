//! SiLU (swish), PyTorch's `F.silu`.

#[cfg(feature = "cuda")]
use crate::cuda::{
    cuda_dispatch, elements_config, input, launch, output, storage, CudaElement, ACTIVATIONS,
};
use crate::element::{contiguous, dispatch, Element};
use crate::elementwise::{map_binary, map_unary};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use num_traits::Float;

/// SiLU, element-wise: `silu(x) = x · σ(x)` with `σ(x) = 1 / (1 + e^{−x})`.
///
/// Gradient: `dx = dy · σ(x) · (1 + x · (1 − σ(x)))`. f32, f64, and bf16/f16 (computed in f32);
/// the result has the dtype of `x`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    if !crate::element::has_kernel(x) {
        return x.silu();
    }
    x.contiguous()?.apply_op1(Silu)
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

/// The forward op.
struct Silu;

impl CustomOp1 for Silu {
    fn name(&self) -> &'static str {
        "silu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
            let x = contiguous::<T>("silu", "x", s, l)?;
            let out = map_unary(x, |x| x * sigmoid(x));
            Ok((T::storage(out), l.shape().clone()))
        }
        dispatch!("silu", s, run(s, l))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let x = input::<T>("silu", "x", s, l)?;
            let n = l.shape().elem_count();
            let dev = &s.device;
            let mut y = output::<T>(dev, n)?;
            let n64 = n as u64;
            launch!(dev, ACTIVATIONS, "silu", T, elements_config(n); &x, &mut y, &n64);
            Ok((storage(y, dev), l.shape().clone()))
        }
        cuda_dispatch!("silu", s, run(s, l))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&dy.contiguous()?, &SiluBackward)?))
    }
}

/// The backward op: `(x, dy) → dx`.
struct SiluBackward;

impl CustomOp2 for SiluBackward {
    fn name(&self) -> &'static str {
        "silu-backward"
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
            let x = contiguous::<T>("silu-backward", "x", s1, l1)?;
            let dy = contiguous::<T>("silu-backward", "dy", s2, l2)?;
            let out = map_binary(x, dy, |x, g| g * silu_slope(x));
            Ok((T::storage(out), l1.shape().clone()))
        }
        dispatch!("silu-backward", s1, run(s1, l1, s2, l2))
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
            let a = input::<T>("silu-backward", "x", s1, l1)?;
            let b = input::<T>("silu-backward", "dy", s2, l2)?;
            let n = l1.shape().elem_count();
            let dev = &s1.device;
            let mut y = output::<T>(dev, n)?;
            let n64 = n as u64;
            launch!(dev, ACTIVATIONS, "silu_backward", T, elements_config(n); &a, &b, &mut y, &n64);
            Ok((storage(y, dev), l1.shape().clone()))
        }
        cuda_dispatch!("silu-backward", s1, run(s1, l1, s2, l2))
    }
}
