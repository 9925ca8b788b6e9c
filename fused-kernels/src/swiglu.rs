//! SwiGLU's gate, `silu(gate) · up` (Llama's MLP: `down_proj(act_fn(gate_proj(x)) * up_proj(x))`).

#[cfg(feature = "cuda")]
use crate::cuda::{
    cuda_dispatch, elements_config, input, launch, output, storage, CudaElement, ACTIVATIONS,
};
use crate::element::{contiguous, dispatch, Element};
use crate::elementwise::{map_binary, map_ternary_to_pair};
use crate::silu::{sigmoid, silu_slope};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

/// SwiGLU, element-wise: `swiglu(gate, up) = silu(gate) · up = gate · σ(gate) · up`.
///
/// Gradients, both from one pass: `d_gate = dy · up · σ(g)(1 + g(1 − σ(g)))`,
/// `d_up = dy · silu(gate)`. `gate` and `up` have one shape and dtype (f32, f64, bf16/f16 computed
/// in f32).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        candle_core::bail!(
            "swiglu: gate and up must have one shape, got gate {:?} and up {:?}",
            gate.dims(),
            up.dims()
        );
    }
    if !crate::element::has_kernel(gate) {
        return gate.silu()? * up;
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, Swiglu)
}

/// The forward op.
struct Swiglu;

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        "swiglu"
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
            let gate = contiguous::<T>("swiglu", "gate", s1, l1)?;
            let up = contiguous::<T>("swiglu", "up", s2, l2)?;
            let out = map_binary(gate, up, |g, u| g * sigmoid(g) * u);
            Ok((T::storage(out), l1.shape().clone()))
        }
        dispatch!("swiglu", s1, run(s1, l1, s2, l2))
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
            let a = input::<T>("swiglu", "gate", s1, l1)?;
            let b = input::<T>("swiglu", "up", s2, l2)?;
            let n = l1.shape().elem_count();
            let dev = &s1.device;
            let mut y = output::<T>(dev, n)?;
            let n64 = n as u64;
            launch!(dev, ACTIVATIONS, "swiglu", T, elements_config(n); &a, &b, &mut y, &n64);
            Ok((storage(y, dev), l1.shape().clone()))
        }
        cuda_dispatch!("swiglu", s1, run(s1, l1, s2, l2))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let both = gate.apply_op3_no_bwd(up, &dy.contiguous()?, &SwigluBackward)?;
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

/// The backward op: `(gate, up, dy) → [d_gate, d_up]` stacked on a new first dimension.
struct SwigluBackward;

impl candle_core::CustomOp3 for SwigluBackward {
    fn name(&self) -> &'static str {
        "swiglu-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            s3: &CpuStorage,
            l3: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let gate = contiguous::<T>("swiglu-backward", "gate", s1, l1)?;
            let up = contiguous::<T>("swiglu-backward", "up", s2, l2)?;
            let dy = contiguous::<T>("swiglu-backward", "dy", s3, l3)?;
            let out = map_ternary_to_pair(gate, up, dy, |g, u, d| {
                (d * u * silu_slope(g), d * g * sigmoid(g))
            });
            let mut dims = vec![2];
            dims.extend_from_slice(l1.dims());
            Ok((T::storage(out), Shape::from(dims)))
        }
        dispatch!("swiglu-backward", s1, run(s1, l1, s2, l2, s3, l3))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let gate = input::<T>("swiglu-backward", "gate", s1, l1)?;
            let up = input::<T>("swiglu-backward", "up", s2, l2)?;
            let dy = input::<T>("swiglu-backward", "dy", s3, l3)?;
            let n = l1.shape().elem_count();
            let dev = &s1.device;
            let mut out = output::<T>(dev, 2 * n)?;
            let n64 = n as u64;
            launch!(dev, ACTIVATIONS, "swiglu_backward", T, elements_config(n);
                &gate, &up, &dy, &mut out, &n64);
            let mut dims = vec![2];
            dims.extend_from_slice(l1.dims());
            Ok((storage(out, dev), Shape::from(dims)))
        }
        cuda_dispatch!("swiglu-backward", s1, run(s1, l1, s2, l2, s3, l3))
    }
}
