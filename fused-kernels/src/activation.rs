//! One trainable op for every element-wise activation: an [`Activation`] says what the function
//! and its derivative are and which CUDA kernels compute them; [`apply`] runs it as a candle node
//! whose backward pass is `dx = dy · f'(x)`, one pass over `x` and `dy`.

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

/// An element-wise function `f` with its derivative, in any float type (f32 for f32, bf16 and
/// f16; f64 for f64), and the names of its kernels.
pub(crate) trait Activation: Send + Sync + 'static {
    /// The forward op's name, as errors and candle's graph show it.
    const NAME: &'static str;
    /// The backward op's name.
    const BACKWARD_NAME: &'static str;
    /// The forward kernel in `src/cuda/activations.cu` (without its dtype suffix).
    #[cfg(feature = "cuda")]
    const KERNEL: &'static str;
    /// The backward kernel in `src/cuda/activations.cu` (without its dtype suffix).
    #[cfg(feature = "cuda")]
    const BACKWARD_KERNEL: &'static str;

    /// `f(x)`.
    fn value<A: Float>(x: A) -> A;

    /// `f'(x)`.
    fn slope<A: Float>(x: A) -> A;
}

/// `f(x)` element-wise as a candle node (its backward pass included), for a contiguous `x` of a
/// dtype with a kernel.
pub(crate) fn apply<F: Activation>(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?
        .apply_op1(Forward::<F>(std::marker::PhantomData))
}

/// The forward op of `F`.
struct Forward<F>(std::marker::PhantomData<F>);

impl<F: Activation> CustomOp1 for Forward<F> {
    fn name(&self) -> &'static str {
        F::NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(
            op: &'static str,
            s: &CpuStorage,
            l: &Layout,
            f: impl Fn(T::Acc) -> T::Acc + Send + Sync,
        ) -> Result<(CpuStorage, Shape)> {
            let x = contiguous::<T>(op, "x", s, l)?;
            let out = map_unary(x, f);
            Ok((T::storage(out), l.shape().clone()))
        }
        dispatch!(F::NAME, s, run(F::NAME, s, l, F::value))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(
            op: &'static str,
            kernel: &'static str,
            s: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let x = input::<T>(op, "x", s, l)?;
            let n = l.shape().elem_count();
            let dev = &s.device;
            let mut y = output::<T>(dev, n)?;
            let n64 = n as u64;
            launch!(dev, ACTIVATIONS, kernel, T, elements_config(n); &x, &mut y, &n64);
            Ok((storage(y, dev), l.shape().clone()))
        }
        cuda_dispatch!(F::NAME, s, run(F::NAME, F::KERNEL, s, l))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let backward = Backward::<F>(std::marker::PhantomData);
        Ok(Some(x.apply_op2_no_bwd(&dy.contiguous()?, &backward)?))
    }
}

/// The backward op of `F`: `(x, dy) → dx = dy · f'(x)`.
struct Backward<F>(std::marker::PhantomData<F>);

impl<F: Activation> CustomOp2 for Backward<F> {
    fn name(&self) -> &'static str {
        F::BACKWARD_NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(
            op: &'static str,
            (s1, l1): (&CpuStorage, &Layout),
            (s2, l2): (&CpuStorage, &Layout),
            f: impl Fn(T::Acc, T::Acc) -> T::Acc + Send + Sync,
        ) -> Result<(CpuStorage, Shape)> {
            let x = contiguous::<T>(op, "x", s1, l1)?;
            let dy = contiguous::<T>(op, "dy", s2, l2)?;
            let out = map_binary(x, dy, f);
            Ok((T::storage(out), l1.shape().clone()))
        }
        let op = F::BACKWARD_NAME;
        dispatch!(op, s1, run(op, (s1, l1), (s2, l2), |x, g| g * F::slope(x)))
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
            op: &'static str,
            kernel: &'static str,
            (s1, l1): (&CudaStorage, &Layout),
            (s2, l2): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let a = input::<T>(op, "x", s1, l1)?;
            let b = input::<T>(op, "dy", s2, l2)?;
            let n = l1.shape().elem_count();
            let dev = &s1.device;
            let mut y = output::<T>(dev, n)?;
            let n64 = n as u64;
            launch!(dev, ACTIVATIONS, kernel, T, elements_config(n); &a, &b, &mut y, &n64);
            Ok((storage(y, dev), l1.shape().clone()))
        }
        let op = F::BACKWARD_NAME;
        cuda_dispatch!(op, s1, run(op, F::BACKWARD_KERNEL, (s1, l1), (s2, l2)))
    }
}
