//! LayerNorm over the last dimension (PyTorch's `F.layer_norm(x, (d,), weight, bias, eps)`).

#[cfg(feature = "cuda")]
use crate::cuda::{
    blocks_over_rows, columns_config, cuda_dispatch, input, launch, output, partial_blocks,
    rows_config, storage, CudaElement, LAYER_NORM,
};
use crate::element::{constant, contiguous, dispatch, Element};
use crate::row_norm::{self, RowNorm};
use crate::rows::{for_each_row, for_each_row_summing, rows_of};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
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
    if !crate::element::has_kernel(x) {
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
            eps: f64,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let x = input::<T>("layer_norm", "x", s1, l1)?;
            let w = input::<T>("layer_norm", "weight", s2, l2)?;
            let b = input::<T>("layer_norm", "bias", s3, l3)?;
            let (rows, d) = rows_of("layer_norm", "x", l1.dims())?;
            let dev = &s1.device;
            let mut y = output::<T>(dev, rows * d)?;
            let (rows64, d64) = (rows as u64, d as u64);
            launch!(dev, LAYER_NORM, "layer_norm", T, rows_config(rows, d);
                &x, &w, &b, &mut y, &rows64, &d64, &eps);
            Ok((storage(y, dev), l1.shape().clone()))
        }
        cuda_dispatch!("layer_norm", s1, run(self.eps, s1, l1, s2, l2, s3, l3))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, params) = row_norm::backward::<Self>(x, weight, dy, self.eps)?;
        Ok((Some(dx), Some(params.get(0)?), Some(params.get(1)?)))
    }
}

impl RowNorm for LayerNorm {
    const NAME: &'static str = "layer_norm";
    const BACKWARD_NAME: &'static str = "layer_norm-backward";
    /// `d_weight`, `d_bias`.
    const PARAMS: usize = 2;

    /// The backward pass on the CPU: `[rows + 2, d]`, the rows of `dx` (plus `dres`, the gradient
    /// reaching `x` along a residual path, when given), then `d_weight` and `d_bias`.
    fn backward_cpu<T: Element>(
        x: &[T],
        w: &[T],
        dy: &[T],
        dres: Option<&[T]>,
        d: usize,
        eps: f64,
    ) -> Vec<T> {
        let rows = x.len() / d.max(1);
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
            let res = dres.map(|v| &v[r * d..(r + 1) * d]);
            let (pw, pb) = partial.split_at_mut(d);
            for (j, dx) in dx.iter_mut().enumerate() {
                let xhat = (x[j].to_acc() - mean) * rstd;
                let g = g[j].to_acc();
                let ghat = g * w[j].to_acc();
                let value = rstd * (ghat - mean_g - xhat * mean_gx);
                *dx = T::from_acc(match res {
                    Some(res) => value + res[j].to_acc(),
                    None => value,
                });
                pw[j] = pw[j] + g * xhat;
                pb[j] = pb[j] + g;
            }
        });
        for (p, s) in params.iter_mut().zip(sums) {
            *p = T::from_acc(s);
        }
        out
    }

    /// The backward pass on a CUDA device for `[(x), (weight), (dy), (dres)?]`, laid out as
    /// [`backward_cpu`](Self::backward_cpu)'s. Two launches: dx and per-block partial sums of
    /// d_weight and d_bias over at most 512 blocks of rows, then one thread per column adds the
    /// partial sums in block order. No atomics: the sums come out the same on every run, as on the
    /// CPU.
    #[cfg(feature = "cuda")]
    fn backward_cuda<T: CudaElement>(
        s: &[(&CudaStorage, &Layout)],
        eps: f64,
    ) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<T>> {
        let op = "layer_norm-backward";
        let x = input::<T>(op, "x", s[0].0, s[0].1)?;
        let w = input::<T>(op, "weight", s[1].0, s[1].1)?;
        let dy = input::<T>(op, "dy", s[2].0, s[2].1)?;
        let (rows, d) = rows_of(op, "x", s[0].1.dims())?;
        let dev = &s[0].0.device;
        let mut out = output::<T>(dev, (rows + 2) * d)?;
        let blocks = partial_blocks(rows, 2 * d);
        let mut partial = output::<T::Acc>(dev, blocks * 2 * d)?;
        let (rows64, d64, blocks64, len64) = (rows as u64, d as u64, blocks as u64, 2 * d as u64);
        match s.get(3) {
            None => launch!(dev, LAYER_NORM, "layer_norm_backward", T, blocks_over_rows(blocks, d);
                &x, &w, &dy, &mut out, &mut partial, &rows64, &d64, &eps),
            Some((sr, lr)) => {
                let dres = input::<T>(op, "dres", sr, lr)?;
                launch!(dev, LAYER_NORM, "layer_norm_backward_residual", T, blocks_over_rows(blocks, d);
                    &x, &w, &dy, &dres, &mut out, &mut partial, &rows64, &d64, &eps)
            }
        }
        let mut params = out.slice_mut(rows * d..);
        launch!(dev, LAYER_NORM, "layer_norm_sum", T, columns_config(2 * d);
            &partial, &blocks64, &len64, &mut params);
        Ok(out)
    }
}

/// LayerNorm's forward outside candle's graph (for the fused layers).
pub(crate) fn forward_raw(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?
        .apply_op3_no_bwd(weight, bias, &LayerNorm { eps })
}

/// LayerNorm's backward outside candle's graph: `(dx + dres, d_weight, d_bias)` for a contiguous
/// `x` `[..., d]`, where `dres` is the gradient reaching `x` along the residual path that skips
/// the norm (added in the same pass).
pub(crate) fn backward_raw(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    dres: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (dx, params) = row_norm::backward_raw::<LayerNorm>(x, weight, dy, dres, eps)?;
    Ok((dx, params.get(0)?, params.get(1)?))
}
