//! Independent references for the fused layers' tests: each layer written out with candle's plain
//! differentiable ops (no kernel of this crate), in the dtype of its inputs, and helpers to
//! compare values and gradients.

use candle_core::{DType, Device, Result, Tensor, Var, D};

/// `n` deterministic values in `[-1, 1)` (xorshift from `seed`).
pub(crate) fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

/// A variable of `shape` filled with scaled [`values`], in `dtype`.
pub(crate) fn var(shape: &[usize], seed: u64, scale: f64, dtype: DType) -> Var {
    let n = shape.iter().product();
    let v: Vec<f64> = values(n, seed).into_iter().map(|x| x * scale).collect();
    let t = Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    Var::from_tensor(&t).unwrap()
}

/// The largest absolute difference between `a` and `b`, relative to `b`'s largest magnitude
/// (with an absolute floor of 1).
pub(crate) fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let a: Vec<f64> = a
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let b: Vec<f64> = b
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let scale = b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(&b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Asserts that `fused` and `reference` (the same layer's output from the fused op and from
/// the plain-ops reference) agree within `tol` ([`rel_diff`]), and so do the gradients of every
/// `tracked` tensor under the same weighted-sum loss; `what` names the case in a failure.
pub(crate) fn assert_same_values_and_gradients(
    fused: &Tensor,
    reference: &Tensor,
    tracked: &[(&str, &Tensor)],
    tol: f64,
    what: &str,
) {
    let d = rel_diff(fused, reference);
    assert!(d < tol, "values differ by {d} ({what})");
    let weights = var(fused.dims(), 77, 1.0, fused.dtype());
    let loss = |y: &Tensor| (y * weights.as_tensor()).unwrap().sum_all().unwrap();
    let g_fused = loss(fused).backward().unwrap();
    let g_ref = loss(reference).backward().unwrap();
    for (name, t) in tracked {
        let a = g_fused
            .get(t)
            .unwrap_or_else(|| panic!("no fused gradient for {name} ({what})"));
        let b = g_ref
            .get(t)
            .unwrap_or_else(|| panic!("no reference gradient for {name} ({what})"));
        let d = rel_diff(a, b);
        assert!(d < tol, "{name}: gradients differ by {d} ({what})");
    }
}

/// LayerNorm over the last dimension.
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let c = x.broadcast_sub(&mean)?;
    let var = c.sqr()?.mean_keepdim(D::Minus1)?;
    c.broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(w)?
        .broadcast_add(b)
}

/// RMSNorm over the last dimension.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

/// GELU, tanh approximation.
pub(crate) fn gelu(x: &Tensor) -> Result<Tensor> {
    let k = (2.0f64 / std::f64::consts::PI).sqrt();
    let inner = ((x + (x.powf(3.0)? * 0.044715)?)? * k)?;
    (x * 0.5)? * (inner.tanh()? + 1.0)?
}

/// SiLU.
pub(crate) fn silu(x: &Tensor) -> Result<Tensor> {
    x * candle_nn_free_sigmoid(x)?
}

fn candle_nn_free_sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// `x · wᵀ + b + scale · (x · aᵀ) · bᵀ` for `x` `[..., in]`.
pub(crate) fn project(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    lora: Option<(&Tensor, &Tensor, f64)>,
) -> Result<Tensor> {
    let mut y = x.broadcast_matmul(&w.t()?)?;
    if let Some(b) = b {
        y = y.broadcast_add(b)?;
    }
    if let Some((a, bb, s)) = lora {
        y = (y + (x.broadcast_matmul(&a.t()?)?.broadcast_matmul(&bb.t()?)? * s)?)?;
    }
    Ok(y)
}

/// Rotates `x` `[b, h, t, d]` by the angles of `cos`, `sin` `[t, d/2]` (`rotate_half`).
pub(crate) fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, d / 2)?,
        x.narrow(D::Minus1, d / 2, d / 2)?,
    );
    let (c, s) = (
        cos.unsqueeze(0)?.unsqueeze(0)?,
        sin.unsqueeze(0)?.unsqueeze(0)?,
    );
    let y1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
    let y2 = (x2.broadcast_mul(&c)? + x1.broadcast_mul(&s)?)?;
    Tensor::cat(&[y1, y2], D::Minus1)
}

/// Causal attention of `q` `[b, h, t, d]`, `k`, `v` `[b, kv, t, d]` (grouped), full scores.
pub(crate) fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let kv = k.dim(1)?;
    let repeat = |x: &Tensor| -> Result<Tensor> {
        x.unsqueeze(2)?
            .broadcast_as((b, kv, h / kv, t, d))?
            .reshape((b, h, t, d))
    };
    let (k, v) = (repeat(k)?, repeat(v)?);
    let s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    let mask: Vec<f64> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j > i { -1e30 } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), q.device())?.to_dtype(q.dtype())?;
    let s = s.broadcast_add(&mask)?;
    let m = s.max_keepdim(D::Minus1)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)
}
