//! `x · Wᵀ` for a weight that is not trained (a LoRA fine-tune's frozen base), as one op whose
//! backward pass computes the gradient of `x` only.
//!
//! candle's matrix product differentiates both operands whenever either is tracked: with a plain
//! (detached) weight it still computes `xᵀ · grad`, and for a batched input it computes it for the
//! weight broadcast over the batch and keeps that until the backward pass ends (a weight's size
//! per row of the batch). On the CPU this op skips both: it is a custom op of `x` alone, the
//! weight a constant of it. On other devices (no custom-op kernel there) it falls back to
//! [`frozen_linear_by_matmul`], candle's 2-D product over the rows of `x`: no batch-sized weight
//! gradient, but candle still computes one weight-sized gradient (`xᵀ · grad`) during the backward
//! pass and keeps it until the pass ends.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// `x · Wᵀ` for `x` `[..., in]` and `weight` `[out, in]`, differentiated with respect to `x` only
/// (see the module docs).
pub fn frozen_linear(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return frozen_linear_by_matmul(x, weight);
    }
    let x = x.contiguous()?;
    x.apply_op1(FrozenLinear {
        weight: weight.detach(),
    })
}

/// [`frozen_linear`]'s path off the CPU (any device): `x` `[..., in]` viewed as `[rows, in]`
/// times the detached `Wᵀ` through one 2-D product, reshaped back. Its backward pass computes the
/// gradient of `x` and one weight-sized gradient that nothing reads, never one per row of the
/// batch.
pub fn frozen_linear_by_matmul(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    rows_times(x, &weight.detach(), true)
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

    /// Deterministic values in about ±1 (no generator needed).
    fn ramp(n: usize, step: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * step).sin()).collect()
    }

    /// `max |a - b|` of two tensors of one shape, in f32.
    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        assert_eq!(a.dims(), b.dims());
        let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap();
        d.abs().unwrap().max_all().unwrap().to_scalar().unwrap()
    }

    /// For batch 3 of 4 rows of 5 features and a weight of 6 outputs, the input either as built or
    /// a transposed (non-contiguous) view, in `dtype`: `f`'s value and input gradient against
    /// candle's plain product of the same tensors (`x.broadcast_matmul(Wᵀ)`, both tracked), and
    /// the sizes of what `f`'s backward pass leaves in the gradient store besides the gradients of
    /// the input and of the loss's constant factor.
    fn check_against_candles_product(
        f: fn(&Tensor, &Tensor) -> Result<Tensor>,
        dtype: DType,
        transposed: bool,
        tolerance: f32,
    ) -> Vec<usize> {
        let d = &Device::Cpu;
        let (batch, rows, inp, out) = (3, 4, 5, 6);
        let w = Tensor::from_vec(ramp(out * inp, 0.7), (out, inp), d).unwrap();
        let w = w.to_dtype(dtype).unwrap();
        // Built as [batch, in, rows] and viewed transposed, or built as [batch, rows, in].
        let built = if transposed {
            (batch, inp, rows)
        } else {
            (batch, rows, inp)
        };
        let x = Tensor::from_vec(ramp(batch * rows * inp, 0.3), built, d)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let view = |x: &Tensor| {
            let v = if transposed {
                x.transpose(1, 2).unwrap()
            } else {
                x.clone()
            };
            assert_eq!(v.dims(), [batch, rows, inp]);
            assert_eq!(v.is_contiguous(), !transposed);
            v
        };
        let c = Tensor::from_vec(ramp(batch * rows * out, 1.1), (batch, rows, out), d)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        // Tracked copies for `f`, tracked copies for the reference.
        let (xv, wv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
        let (xr, wr) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
        let y = f(&view(xv.as_tensor()), wv.as_tensor()).unwrap();
        let reference = view(xr.as_tensor())
            .broadcast_matmul(&wr.as_tensor().t().unwrap())
            .unwrap();
        assert_eq!(y.dtype(), dtype);
        let dy = max_diff(&y, &reference);
        assert!(
            dy <= tolerance,
            "{dtype:?} transposed {transposed}: value off by {dy}"
        );
        let loss = |y: &Tensor| (y * &c).unwrap().sum_all().unwrap();
        let grads = loss(&y).backward().unwrap();
        let reference_grads = loss(&reference).backward().unwrap();
        let gx = grads.get(xv.as_tensor()).unwrap();
        let dg = max_diff(gx, reference_grads.get(xr.as_tensor()).unwrap());
        assert!(
            dg <= tolerance,
            "{dtype:?} transposed {transposed}: gradient off by {dg}"
        );
        assert!(
            grads.get(wv.as_tensor()).is_none(),
            "the weight got a gradient"
        );
        // The reference could have failed the comparison: its gradient is not zero.
        let scale = max_diff(gx, &gx.zeros_like().unwrap());
        assert!(scale > 0.5, "{scale}");
        grads
            .get_ids()
            .filter(|id| **id != xv.as_tensor().id() && **id != c.id())
            .map(|id| grads.get_id(*id).unwrap().elem_count())
            .collect()
    }

    #[test]
    fn batched_transposed_and_bf16_inputs_match_candles_product_on_both_paths() {
        for transposed in [false, true] {
            for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 0.05)] {
                // The CPU op: nothing but the input's gradient is computed.
                let rest =
                    check_against_candles_product(frozen_linear, dtype, transposed, tolerance);
                assert_eq!(rest, Vec::<usize>::new(), "{dtype:?}");
                // The path off the CPU: at most one weight-sized gradient (6 x 5), never one
                // per row of the batch (3 x 6 x 5).
                let rest = check_against_candles_product(
                    frozen_linear_by_matmul,
                    dtype,
                    transposed,
                    tolerance,
                );
                assert!(rest.iter().all(|&n| n <= 30), "{dtype:?}: {rest:?}");
            }
        }
    }
}
