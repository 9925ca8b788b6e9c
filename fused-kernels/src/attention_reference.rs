//! Causal attention over packed projections with candle's ops, materializing the `T × T` scores
//! in f32 (f64 for f64): what the fused attention layer computes on a GPU where flash attention has no
//! tensor-core kernel (f32, f64, head dims other than 64 and 128), through cuBLAS products. The same
//! inputs and outputs as flash attention's.

use candle_core::{Result, Tensor, D};

use crate::attention_block::Geometry;
use crate::flash_attention::lse_dtype;

/// `(q, k, v)` as `[b, heads, t, d]` in the arithmetic type (f32, f64 for f64), keys and values
/// repeated for their query heads.
fn split(packed: &Tensor, g: &Geometry) -> Result<(Tensor, Tensor, Tensor)> {
    let p = packed.to_dtype(lse_dtype(packed.dtype()))?;
    let part = |first: usize, n: usize| -> Result<Tensor> {
        p.narrow(2, first, n)?.transpose(1, 2)?.contiguous()
    };
    let repeat = |x: Tensor| -> Result<Tensor> {
        let groups = g.heads / g.kv_heads;
        if groups == 1 {
            return Ok(x);
        }
        x.unsqueeze(2)?
            .broadcast_as((g.b, g.kv_heads, groups, g.t, g.head_dim))?
            .reshape((g.b, g.heads, g.t, g.head_dim))
    };
    Ok((
        part(0, g.heads)?,
        repeat(part(g.heads, g.kv_heads)?)?,
        repeat(part(g.heads + g.kv_heads, g.kv_heads)?)?,
    ))
}

/// `(scores · scale masked, scale)`: `[b, heads, t, t]` with `-inf` above the diagonal. The mask
/// is made on the scores' device (no host copy).
fn masked_scores(q: &Tensor, k: &Tensor, g: &Geometry) -> Result<(Tensor, f64)> {
    let scale = 1.0 / (g.head_dim as f64).sqrt();
    let s = (q.matmul(&k.t()?)? * scale)?;
    let positions = Tensor::arange(0u32, g.t as u32, q.device())?;
    // later[i, j] = j > i: the keys query i must not see.
    let later = positions
        .unsqueeze(0)?
        .broadcast_gt(&positions.unsqueeze(1)?)?
        .broadcast_as(s.shape())?;
    let minus_inf = Tensor::full(f32::NEG_INFINITY, (), q.device())?
        .to_dtype(s.dtype())?
        .broadcast_as(s.shape())?;
    Ok((later.where_cond(&minus_inf, &s)?, scale))
}

/// The output `[b, t, heads, d]` (the packed dtype) and the log-sum-exp `[b, heads, t]` (f32).
pub(crate) fn forward(packed: &Tensor, g: &Geometry) -> Result<(Tensor, Tensor)> {
    let (q, k, v) = split(packed, g)?;
    let (s, _) = masked_scores(&q, &k, g)?;
    let max = s.max_keepdim(D::Minus1)?;
    let lse = (s
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + &max)?;
    let p = s.broadcast_sub(&lse)?.exp()?;
    let o = p
        .matmul(&v)?
        .transpose(1, 2)?
        .contiguous()?
        .to_dtype(packed.dtype())?;
    Ok((o, lse.squeeze(D::Minus1)?))
}

/// The gradient of the packed projections `[b, t, heads + 2 · kv_heads, d]`.
pub(crate) fn backward(
    packed: &Tensor,
    o: &Tensor,
    d_o: &Tensor,
    lse: &Tensor,
    g: &Geometry,
) -> Result<Tensor> {
    let (q, k, v) = split(packed, g)?;
    let (s, scale) = masked_scores(&q, &k, g)?;
    let p = s.broadcast_sub(&lse.unsqueeze(D::Minus1)?)?.exp()?;
    let acc = lse_dtype(packed.dtype());
    let d_o = d_o.to_dtype(acc)?.transpose(1, 2)?.contiguous()?;
    let o = o.to_dtype(acc)?.transpose(1, 2)?.contiguous()?;
    let dv = p.t()?.matmul(&d_o)?;
    let dp = d_o.matmul(&v.t()?)?;
    let delta = (&d_o * &o)?.sum_keepdim(D::Minus1)?;
    let ds = (&p * dp.broadcast_sub(&delta)?)?;
    let dq = (ds.matmul(&k)? * scale)?;
    let dk = (ds.t()?.matmul(&q)? * scale)?;
    // Sum the query heads of each group back onto their key/value head.
    let fold = |x: Tensor| -> Result<Tensor> {
        let groups = g.heads / g.kv_heads;
        x.reshape((g.b, g.kv_heads, groups, g.t, g.head_dim))?
            .sum(2)
    };
    let parts = [dq, fold(dk)?, fold(dv)?]
        .into_iter()
        .map(|x| x.transpose(1, 2)?.contiguous())
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 2)?.to_dtype(packed.dtype())
}
