//! A linear layer as one trainable candle node: `x · weightᵀ + bias`.
//!
//! candle-nn's `Linear` is three nodes (a transpose, a product, a broadcast add); the transpose's
//! backward adds the weight's gradient into zeros with strided reads, and the broadcast's sums
//! over the leading dimensions with strided reductions. Here the product and the bias add are
//! written once into the node's storage, and the backward is two matrix products and one column
//! sum.

use candle_core::{Result, Tensor};

use crate::node::{node, Backward, Output};

/// A linear layer, `x · weightᵀ + bias`, for `x` `[..., in]`, `weight` `[out, in]` (PyTorch's
/// `nn.Linear` layout) and `bias` `[out]`, all of one dtype.
///
/// Gradients: `dx = dy · weight`, `d_weight = dyᵀ · x` (over all rows), `d_bias = Σ_rows dy`, each
/// computed only when candle tracks that input (a frozen weight costs no product).
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (out, inp) = weight.dims2().map_err(|_| {
        candle_core::Error::Msg(format!(
            "linear: weight must have shape [out, in], got {:?}",
            weight.dims()
        ))
    })?;
    if x.dims().last() != Some(&inp) {
        candle_core::bail!(
            "linear: the last dimension of x {:?} must be weight's in = {inp} (weight {:?})",
            x.dims(),
            weight.dims()
        );
    }
    if let Some(b) = bias {
        if b.dims() != [out] {
            candle_core::bail!("linear: bias must have shape [{out}], got {:?}", b.dims());
        }
    }
    for (what, t) in [("weight", Some(weight)), ("bias", bias)] {
        if let Some(t) = t {
            if t.dtype() != x.dtype() {
                candle_core::bail!(
                    "linear: {what} has dtype {:?}, x {:?}; convert one of them",
                    t.dtype(),
                    x.dtype()
                );
            }
        }
    }
    if !crate::element::has_kernel(x) {
        let y = x.broadcast_matmul(&weight.t()?)?;
        return match bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        };
    }
    let mut inputs = vec![x, weight];
    inputs.extend(bias);
    node("linear", &inputs, |d| {
        let x = d[0].contiguous()?;
        let w = d[1].contiguous()?;
        let output = Output::Product {
            x: x.clone(),
            w: w.clone(),
            bias: d.get(2).cloned(),
        };
        Ok((output, LinearBackward { x, w }))
    })
}

/// What the backward pass reads: the input and the weight (contiguous).
struct LinearBackward {
    x: Tensor,
    w: Tensor,
}

impl Backward for LinearBackward {
    fn backward(
        &self,
        d: &[Tensor],
        grad: &Tensor,
        wanted: &[bool],
    ) -> Result<Vec<Option<Tensor>>> {
        let (out, inp) = self.w.dims2()?;
        let rows = self.x.elem_count() / inp.max(1);
        let dy = grad.contiguous()?.reshape((rows, out))?;
        let x = self.x.reshape((rows, inp))?;
        let mut grads = vec![None; d.len()];
        if wanted[0] {
            grads[0] = Some(dy.matmul(&self.w)?.reshape(d[0].shape())?);
        }
        if wanted[1] {
            grads[1] = Some(dy.t()?.matmul(&x)?);
        }
        if wanted.get(2) == Some(&true) {
            grads[2] = Some(crate::add_bias::column_sums(&dy)?);
        }
        Ok(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_reference as r;
    use candle_core::DType;

    #[test]
    fn values_and_gradients_equal_the_formula() {
        for (dims, bias) in [
            (vec![2, 3, 5], true),
            (vec![4, 5], false),
            (vec![1, 5], true),
        ] {
            let x = r::var(&dims, 1, 1.0, DType::F64);
            let w = r::var(&[6, 5], 2, 0.5, DType::F64);
            let b = r::var(&[6], 3, 0.5, DType::F64);
            let b = bias.then(|| b.as_tensor().clone());
            let fused = linear(x.as_tensor(), w.as_tensor(), b.as_ref()).unwrap();
            let reference = r::project(x.as_tensor(), w.as_tensor(), b.as_ref(), None).unwrap();
            assert_eq!(fused.dims(), reference.dims());
            assert!(r::rel_diff(&fused, &reference) < 1e-14);
            let weights = r::var(fused.dims(), 9, 1.0, DType::F64);
            let gf = (&fused * weights.as_tensor())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let gr = (&reference * weights.as_tensor())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let mut all = vec![x.as_tensor().clone(), w.as_tensor().clone()];
            all.extend(b);
            for t in &all {
                let d = r::rel_diff(gf.get(t).unwrap(), gr.get(t).unwrap());
                assert!(d < 1e-14, "gradient differs by {d} for {:?}", t.dims());
            }
        }
    }

    #[test]
    fn a_frozen_weight_gets_no_gradient_and_the_input_still_does() {
        let x = r::var(&[3, 4], 1, 1.0, DType::F32);
        let w = r::var(&[2, 4], 2, 1.0, DType::F32).as_tensor().detach();
        let y = linear(x.as_tensor(), &w, None).unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        assert!(g.get(&w).is_none());
        // d(sum(x wᵀ))/dx = column sums of w, on every row.
        let want: Vec<f32> = w.sum(0).unwrap().to_vec1().unwrap();
        for row in g.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap() {
            for (a, b) in row.iter().zip(&want) {
                assert!((a - b).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn mismatched_shapes_and_dtypes_are_refused_naming_them() {
        let x = r::var(&[3, 4], 1, 1.0, DType::F32);
        let w = r::var(&[2, 5], 2, 1.0, DType::F32);
        let e = linear(x.as_tensor(), w.as_tensor(), None).unwrap_err();
        assert!(e.to_string().contains("weight's in = 5"), "{e}");
        let w = r::var(&[2, 4], 2, 1.0, DType::F64);
        let e = linear(x.as_tensor(), w.as_tensor(), None).unwrap_err();
        assert!(e.to_string().contains("dtype"), "{e}");
    }
}
