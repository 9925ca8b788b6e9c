//! LayerNorm over the last dimension (PyTorch's `F.layer_norm(x, (d,), weight, bias, eps)`).

use crate::element::{constant, contiguous, dispatch, Element};
use crate::rows::{for_each_row, for_each_row_summing, rows_of};
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use num_traits::{Float, Zero};

/// LayerNorm over the last dimension `d` of `x` `[..., d]`, with `weight` and `bias` `[d]`:
/// `y = (x − μ) · r · weight + bias`, with `μ = mean(x)`, `σ² = mean((x − μ)²)` (biased, as
/// PyTorch) and `r = 1 / √(σ² + eps)`, per row.
///
/// Gradients, all three from one pass over the rows (μ and r recomputed): with `x̂ = (x − μ)·r`
/// and `ĝ = dy · weight`, `dx = r · (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂))`, `d_weight = Σ_rows dy · x̂`,
/// `d_bias = Σ_rows dy`. The three tensors share one dtype: f32, f64, or bf16/f16 (computed in
/// f32).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let (_, d) = rows_of("layer_norm", "x", x.dims())?;
    for (what, t) in [("weight", weight), ("bias", bias)] {
        if t.dims() != [d] {
            candle_core::bail!(
                "layer_norm: {what} must have shape [{d}] (the last dimension of x {:?}), got {:?}",
                x.dims(),
                t.dims()
            );
        }
    }
    if !x.device().is_cpu() {
        return crate::fallback::layer_norm(x, weight, bias, eps);
    }
    x.contiguous()?.apply_op3(
        &weight.contiguous()?,
        &bias.contiguous()?,
        LayerNorm { eps },
    )
}

/// `(μ, r)` of one row.
#[inline(always)]
fn moments<T: Element>(x: &[T], eps: T::Acc) -> (T::Acc, T::Acc) {
    let n = constant::<T::Acc>(x.len() as f64);
    let mean = x.iter().map(|v| v.to_acc()).sum::<T::Acc>() / n;
    let var = x
        .iter()
        .map(|v| {
            let c = v.to_acc() - mean;
            c * c
        })
        .sum::<T::Acc>()
        / n;
    (mean, (var + eps).sqrt().recip())
}

/// The forward op.
struct LayerNorm {
    eps: f64,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
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
            eps: f64,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            s3: &CpuStorage,
            l3: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let x = contiguous::<T>("layer_norm", "x", s1, l1)?;
            let w = contiguous::<T>("layer_norm", "weight", s2, l2)?;
            let b = contiguous::<T>("layer_norm", "bias", s3, l3)?;
            let (_, d) = rows_of("layer_norm", "x", l1.dims())?;
            let eps = constant::<T::Acc>(eps);
            let mut out = vec![T::from_acc(<T::Acc>::zero()); x.len()];
            for_each_row(&mut out, d, |r, y| {
                let x = &x[r * d..(r + 1) * d];
                let (mean, rstd) = moments(x, eps);
                for (((y, x), w), b) in y.iter_mut().zip(x).zip(w).zip(b) {
                    *y = T::from_acc((x.to_acc() - mean) * rstd * w.to_acc() + b.to_acc());
                }
            });
            Ok((T::storage(out), l1.shape().clone()))
        }
        dispatch!("layer_norm", s1, run(self.eps, s1, l1, s2, l2, s3, l3))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (rows, d) = rows_of("layer_norm", "x", x.dims())?;
        let all = x.apply_op3_no_bwd(
            weight,
            &dy.contiguous()?,
            &LayerNormBackward { eps: self.eps },
        )?;
        let dx = all.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dw = all.get(rows)?;
        let db = all.get(rows + 1)?;
        debug_assert_eq!(dw.dims(), [d]);
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// The backward op: `(x, weight, dy) → [rows + 2, d]`, the rows of `dx` then `d_weight` and
/// `d_bias`.
struct LayerNormBackward {
    eps: f64,
}

impl CustomOp3 for LayerNormBackward {
    fn name(&self) -> &'static str {
        "layer_norm-backward"
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
            eps: f64,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            s3: &CpuStorage,
            l3: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let x = contiguous::<T>("layer_norm-backward", "x", s1, l1)?;
            let w = contiguous::<T>("layer_norm-backward", "weight", s2, l2)?;
            let dy = contiguous::<T>("layer_norm-backward", "dy", s3, l3)?;
            let (rows, d) = rows_of("layer_norm-backward", "x", l1.dims())?;
            let eps = constant::<T::Acc>(eps);
            let n = constant::<T::Acc>(d as f64);
            let mut out = vec![T::from_acc(<T::Acc>::zero()); (rows + 2) * d];
            let (dx, params) = out.split_at_mut(rows * d);
            // partial = [d_weight (d), d_bias (d)]
            let sums = for_each_row_summing(dx, d, 2 * d, |r, dx, partial| {
                let x = &x[r * d..(r + 1) * d];
                let g = &dy[r * d..(r + 1) * d];
                let (mean, rstd) = moments(x, eps);
                let (mut mean_g, mut mean_gx) = (<T::Acc>::zero(), <T::Acc>::zero());
                for ((x, g), w) in x.iter().zip(g).zip(w) {
                    let xhat = (x.to_acc() - mean) * rstd;
                    let ghat = g.to_acc() * w.to_acc();
                    mean_g = mean_g + ghat;
                    mean_gx = mean_gx + ghat * xhat;
                }
                mean_g = mean_g / n;
                mean_gx = mean_gx / n;
                let (pw, pb) = partial.split_at_mut(d);
                for (j, dx) in dx.iter_mut().enumerate() {
                    let xhat = (x[j].to_acc() - mean) * rstd;
                    let g = g[j].to_acc();
                    let ghat = g * w[j].to_acc();
                    *dx = T::from_acc(rstd * (ghat - mean_g - xhat * mean_gx));
                    pw[j] = pw[j] + g * xhat;
                    pb[j] = pb[j] + g;
                }
            });
            for (p, s) in params.iter_mut().zip(sums) {
                *p = T::from_acc(s);
            }
            Ok((T::storage(out), Shape::from((rows + 2, d))))
        }
        dispatch!(
            "layer_norm-backward",
            s1,
            run(self.eps, s1, l1, s2, l2, s3, l3)
        )
    }
}
