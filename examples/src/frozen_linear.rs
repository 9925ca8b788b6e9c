//! `x · Wᵀ` for a weight that is not trained (a LoRA fine-tune's frozen base), as one op whose
//! backward pass computes the gradient of `x` only.
//!
//! candle's matrix product differentiates both operands whenever either is tracked: with a plain
//! (detached) weight it still computes `xᵀ · grad`, and for a batched input it computes it for the
//! weight broadcast over the batch and keeps that until the backward pass ends (a weight's size
//! per row of the batch). This op skips both: on the CPU it is a custom op of `x` alone, the
//! weight a constant of it. On other devices it falls back to candle's product.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// `x · Wᵀ` for `x` `[..., in]` and `weight` `[out, in]`, differentiated with respect to `x` only
/// (see the module docs).
pub fn frozen_linear(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return x.broadcast_matmul(&weight.detach().t()?);
    }
    let x = x.contiguous()?;
    x.apply_op1(FrozenLinear {
        weight: weight.detach(),
    })
}

/// The op: its weight is a constant, not an operand.
struct FrozenLinear {
    weight: Tensor,
}

/// `x` `[..., in]` times `w` viewed as `[in, out]` (`w` given as `[out, in]`, transposed when
/// `transpose`), as `[..., out]`, through one 2-D product.
fn rows_times(x: &Tensor, w: &Tensor, transpose: bool) -> Result<Tensor> {
    let w = if transpose { w.t()? } else { w.clone() };
    let (inp, out) = w.dims2()?;
    let mut dims = x.dims().to_vec();
    let rows = x.elem_count() / inp.max(1);
    let y = x.reshape((rows, inp))?.matmul(&w)?;
    *dims.last_mut().expect("x has a last dimension") = out;
    y.reshape(dims)
}

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("frozen-linear: the input must be contiguous");
        };
        let cpu = candle_core::Device::Cpu;
        let shape = layout.shape();
        // Tensors over copies of the input: a custom op sees raw storage, and candle's product
        // is reached through tensors. The copies are of the activations, the product's cost is
        // theirs times the weight's width.
        let x = match storage {
            CpuStorage::F32(v) => Tensor::from_slice(&v[start..end], shape, &cpu)?,
            CpuStorage::BF16(v) => Tensor::from_slice(&v[start..end], shape, &cpu)?,
            CpuStorage::F16(v) => Tensor::from_slice(&v[start..end], shape, &cpu)?,
            CpuStorage::F64(v) => Tensor::from_slice(&v[start..end], shape, &cpu)?,
            _ => candle_core::bail!("frozen-linear: the input must be f32, bf16, f16 or f64"),
        };
        let y = rows_times(&x, &self.weight, true)?;
        let flat = y.flatten_all()?;
        let out = match y.dtype() {
            DType::F32 => CpuStorage::F32(flat.to_vec1()?),
            DType::BF16 => CpuStorage::BF16(flat.to_vec1()?),
            DType::F16 => CpuStorage::F16(flat.to_vec1()?),
            DType::F64 => CpuStorage::F64(flat.to_vec1()?),
            other => candle_core::bail!("frozen-linear: {other:?} output"),
        };
        Ok((out, y.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        // d(x · Wᵀ)/dx: grad · W.
        Ok(Some(rows_times(grad_res, &self.weight, false)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn value_and_input_gradient_are_the_products_and_the_weight_gets_none() {
        let d = &Device::Cpu;
        let w = Var::new(&[[1f32, 2., 0.], [0., -1., 3.]], d).unwrap();
        let x = Var::new(&[[[1f32, 1., 2.], [0., 2., -1.]]], d).unwrap();
        let y = frozen_linear(x.as_tensor(), w.as_tensor()).unwrap();
        assert_eq!(y.to_vec3::<f32>().unwrap(), [[[3., 5.], [4., -5.]]]);
        // Loss = sum(y · c): dL/dx = c · W.
        let c = Tensor::new(&[[[1f32, 2.], [-1., 0.]]], d).unwrap();
        let grads = (y * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let gx = grads.get(x.as_tensor()).unwrap().to_vec3::<f32>().unwrap();
        assert_eq!(gx, [[[1., 0., 6.], [-1., -2., 0.]]]);
        assert!(grads.get(w.as_tensor()).is_none());
    }
}
