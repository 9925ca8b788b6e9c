//! The same computations as chains of candle's differentiable ops, for tensors on a device the
//! kernels have no code for yet (CUDA, Metal): slower, but a model built on this crate still runs
//! and trains there. Half-precision inputs are computed in f32, as by the kernels.

use candle_core::{DType, Result, Tensor, D};

/// `x` in f32 when it is half precision, else unchanged.
fn widened(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// [`crate::layer_norm`]'s formula in candle ops.
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = widened(x)?;
    let centred = xf.broadcast_sub(&xf.mean_keepdim(D::Minus1)?)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let xhat = centred.broadcast_div(&(var + eps)?.sqrt()?)?;
    xhat.broadcast_mul(&widened(w)?)?
        .broadcast_add(&widened(b)?)?
        .to_dtype(x.dtype())
}

/// [`crate::rms_norm`]'s formula in candle ops.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = widened(x)?;
    let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
    xf.broadcast_div(&(ms + eps)?.sqrt()?)?
        .broadcast_mul(&widened(w)?)?
        .to_dtype(x.dtype())
}

/// [`crate::causal_softmax`]'s formula in candle ops.
pub(crate) fn causal_softmax(scores: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = scores.dims();
    let (t_q, t_k) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let mask: Vec<f32> = (0..t_q * t_k)
        .map(|i| {
            if i % t_k > i / t_k + (t_k - t_q) {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let z = (widened(scores)? * scale)?;
    let mask = Tensor::from_vec(mask, (t_q, t_k), scores.device())?.to_dtype(z.dtype())?;
    let z = z.broadcast_add(&mask)?;
    let e = z.broadcast_sub(&z.max_keepdim(D::Minus1)?)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?
        .to_dtype(scores.dtype())
}

/// [`crate::cross_entropy`]'s formula in candle ops.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor, weights: &Tensor) -> Result<Tensor> {
    let out = if logits.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let z = logits.to_dtype(out)?;
    let max = z.max_keepdim(D::Minus1)?;
    let lse = (z
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + &max)?;
    let picked = z.gather(&targets.unsqueeze(1)?, 1)?;
    let weights = weights.to_dtype(out)?;
    let rows = ((lse - picked)?.squeeze(1)? * &weights)?;
    // A row of weight 0 contributes exactly 0, whatever its logits hold (0 · inf is NaN).
    let zeros = rows.zeros_like()?;
    weights.ne(0.0)?.where_cond(&rows, &zeros)?.sum_all()
}

/// [`crate::rotary`]'s formula in candle ops.
pub(crate) fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let h = x.dim(D::Minus1)? / 2;
    let (x1, x2) = (x.narrow(D::Minus1, 0, h)?, x.narrow(D::Minus1, h, h)?);
    let y1 = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let y2 = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    Tensor::cat(&[y1, y2], D::Minus1)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    /// Values and gradients of `Σ f(x) · r` for the fused op and its fallback, on the CPU.
    fn same(
        name: &str,
        shape: &[usize],
        fused: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
        fallback: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) {
        let x = Var::from_tensor(
            &(Tensor::randn(0f64, 1.0, shape, &Device::Cpu).unwrap() * 2.0).unwrap(),
        )
        .unwrap();
        let (a, b) = (fused(&x).unwrap(), fallback(&x).unwrap());
        let r = Tensor::randn(0f64, 1.0, a.dims(), &Device::Cpu)
            .unwrap()
            .to_dtype(a.dtype())
            .unwrap();
        let ga = (&a * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (&b * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let diff = |p: &Tensor, q: &Tensor| {
            (p.to_dtype(DType::F64).unwrap() - q.to_dtype(DType::F64).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        assert!(
            diff(&a, &b) < 1e-12,
            "{name}: values differ by {}",
            diff(&a, &b)
        );
        let d = diff(ga.get(&x).unwrap(), gb.get(&x).unwrap());
        // 1e-6: candle's own GELU backward uses constants rounded to about 7 digits.
        assert!(d < 1e-6, "{name}: gradients differ by {d}");
    }

    #[test]
    fn a_row_of_weight_zero_adds_exactly_zero_to_the_fallback_loss() {
        let dev = Device::Cpu;
        let logits = Tensor::new(&[[1f32, 2.0, 3.0], [f32::INFINITY, 0.0, 0.0]], &dev).unwrap();
        let targets = Tensor::new(&[2u32, 0], &dev).unwrap();
        let weights = Tensor::new(&[1f32, 0.0], &dev).unwrap();
        let loss = super::cross_entropy(&logits, &targets, &weights)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let lse = (1f32.exp() + 2f32.exp() + 3f32.exp()).ln();
        assert!((loss - (lse - 3.0)).abs() < 1e-6, "{loss}");
    }

    #[test]
    fn every_fallback_matches_its_kernel() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f64, 1.0, 6, &dev).unwrap();
        let b = Tensor::randn(0f64, 1.0, 6, &dev).unwrap();
        same(
            "layer_norm",
            &[3, 4, 6],
            |x| crate::layer_norm(x, &w, &b, 1e-5),
            |x| super::layer_norm(x, &w, &b, 1e-5),
        );
        same(
            "rms_norm",
            &[3, 4, 6],
            |x| crate::rms_norm(x, &w, 1e-6),
            |x| super::rms_norm(x, &w, 1e-6),
        );
        same(
            "causal_softmax",
            &[2, 3, 5],
            |x| crate::causal_softmax(x, 0.6),
            |x| super::causal_softmax(x, 0.6),
        );
        let t = Tensor::new(&[1u32, 5, 0], &dev).unwrap();
        let wt = Tensor::new(&[1.0f64, 0.5, 2.0], &dev).unwrap();
        same(
            "cross_entropy",
            &[3, 6],
            |x| crate::cross_entropy(x, &t, &wt),
            |x| super::cross_entropy(x, &t, &wt),
        );
        let angles = Tensor::randn(0f64, 1.0, (4, 3), &dev).unwrap();
        let (c, s) = (angles.cos().unwrap(), angles.sin().unwrap());
        same(
            "rotary",
            &[2, 4, 6],
            |x| crate::rotary(x, &c, &s),
            |x| super::rotary(x, &c, &s),
        );
        same("gelu", &[4, 6], crate::gelu, |x| x.gelu());
        same("silu", &[4, 6], crate::silu, |x| x.silu());
    }
}
