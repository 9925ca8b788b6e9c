//! RMSNorm over the last dimension (Llama's `LlamaRMSNorm`).

#[cfg(feature = "cuda")]
use crate::cuda::{
    blocks_over_rows, columns_config, cuda_dispatch, input, launch, output, partial_blocks,
    rows_config, storage, CudaElement, RMS_NORM,
};
use crate::element::{constant, contiguous, dispatch, Element};
use crate::row_norm::{self, RowNorm};
use crate::rows::{for_each_row, for_each_row_summing, rows_of};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use num_traits::{Float, Zero};

/// RMSNorm over the last dimension `d` of `x` `[..., d]` with `weight` `[d]`:
/// `y = x · r · weight` with `r = 1 / √(mean(x²) + eps)` per row, in f32 for bf16/f16 inputs (as
/// Llama's, except that Hugging Face rounds `x · r` to the input dtype before the product with
/// the weight and this rounds once, at the end).
///
/// Gradients from one pass: with `x̂ = x · r` and `ĝ = dy · weight`,
/// `dx = r · (ĝ − x̂ · mean(ĝ · x̂))` and `d_weight = Σ_rows dy · x̂`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let (_, d) = rows_of("rms_norm", "x", x.dims())?;
    if weight.dims() != [d] {
        candle_core::bail!(
            "rms_norm: weight must have shape [{d}] (the last dimension of x {:?}), got {:?}",
            x.dims(),
            weight.dims()
        );
    }
    if !crate::element::has_kernel(x) {
        return crate::fallback::rms_norm(x, weight, eps);
    }
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps })
}

/// `r` of one row.
#[inline(always)]
fn rstd<T: Element>(x: &[T], eps: T::Acc) -> T::Acc {
    let n = constant::<T::Acc>(x.len() as f64);
    let ms = x
        .iter()
        .map(|v| {
            let v = v.to_acc();
            v * v
        })
        .sum::<T::Acc>()
        / n;
    (ms + eps).sqrt().recip()
}

/// The forward op.
struct RmsNorm {
    eps: f64,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(
            eps: f64,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let x = contiguous::<T>("rms_norm", "x", s1, l1)?;
            let w = contiguous::<T>("rms_norm", "weight", s2, l2)?;
            let (_, d) = rows_of("rms_norm", "x", l1.dims())?;
            let eps = constant::<T::Acc>(eps);
            let mut out = vec![T::from_acc(<T::Acc>::zero()); x.len()];
            for_each_row(&mut out, d, |r, y| {
                let x = &x[r * d..(r + 1) * d];
                let rstd = rstd(x, eps);
                for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                    *y = T::from_acc(x.to_acc() * rstd * w.to_acc());
                }
            });
            Ok((T::storage(out), l1.shape().clone()))
        }
        dispatch!("rms_norm", s1, run(self.eps, s1, l1, s2, l2))
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
            eps: f64,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let x = input::<T>("rms_norm", "x", s1, l1)?;
            let w = input::<T>("rms_norm", "weight", s2, l2)?;
            let (rows, d) = rows_of("rms_norm", "x", l1.dims())?;
            let dev = &s1.device;
            let mut y = output::<T>(dev, rows * d)?;
            let (rows64, d64) = (rows as u64, d as u64);
            launch!(dev, RMS_NORM, "rms_norm", T, rows_config(rows, d);
                &x, &w, &mut y, &rows64, &d64, &eps);
            Ok((storage(y, dev), l1.shape().clone()))
        }
        cuda_dispatch!("rms_norm", s1, run(self.eps, s1, l1, s2, l2))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, params) = row_norm::backward::<Self>(x, weight, dy, self.eps)?;
        Ok((Some(dx), Some(params.get(0)?)))
    }
}

impl RowNorm for RmsNorm {
    const NAME: &'static str = "rms_norm";
    const BACKWARD_NAME: &'static str = "rms_norm-backward";
    /// `d_weight`.
    const PARAMS: usize = 1;

    /// The backward pass on the CPU: `[rows + 1, d]`, the rows of `dx` (plus `dres`, the gradient
    /// reaching `x` along a residual path, when given), then `d_weight`.
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
        let mut out = vec![T::from_acc(<T::Acc>::zero()); (rows + 1) * d];
        let (dx, dw) = out.split_at_mut(rows * d);
        let sums = for_each_row_summing(dx, d, d, |r, dx, pw| {
            let x = &x[r * d..(r + 1) * d];
            let g = &dy[r * d..(r + 1) * d];
            let rstd = rstd(x, eps);
            let mean_gx = x
                .iter()
                .zip(g)
                .zip(w)
                .map(|((x, g), w)| g.to_acc() * w.to_acc() * x.to_acc() * rstd)
                .sum::<T::Acc>()
                / n;
            let res = dres.map(|v| &v[r * d..(r + 1) * d]);
            for (j, dx) in dx.iter_mut().enumerate() {
                let xhat = x[j].to_acc() * rstd;
                let g = g[j].to_acc();
                let value = rstd * (g * w[j].to_acc() - xhat * mean_gx);
                *dx = T::from_acc(match res {
                    Some(res) => value + res[j].to_acc(),
                    None => value,
                });
                pw[j] = pw[j] + g * xhat;
            }
        });
        for (p, s) in dw.iter_mut().zip(sums) {
            *p = T::from_acc(s);
        }
        out
    }

    /// The backward pass on a CUDA device for `[(x), (weight), (dy), (dres)?]`, laid out as
    /// [`backward_cpu`](Self::backward_cpu)'s. Two launches, as LayerNorm's backward: dx and
    /// per-block partial sums of d_weight, then the partial sums added in block order (no atomics:
    /// the same result on every run).
    #[cfg(feature = "cuda")]
    fn backward_cuda<T: CudaElement>(
        s: &[(&CudaStorage, &Layout)],
        eps: f64,
    ) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<T>> {
        let op = "rms_norm-backward";
        let x = input::<T>(op, "x", s[0].0, s[0].1)?;
        let w = input::<T>(op, "weight", s[1].0, s[1].1)?;
        let dy = input::<T>(op, "dy", s[2].0, s[2].1)?;
        let (rows, d) = rows_of(op, "x", s[0].1.dims())?;
        let dev = &s[0].0.device;
        let mut out = output::<T>(dev, (rows + 1) * d)?;
        let blocks = partial_blocks(rows, d);
        let mut partial = output::<T::Acc>(dev, blocks * d)?;
        let (rows64, d64, blocks64) = (rows as u64, d as u64, blocks as u64);
        match s.get(3) {
            None => launch!(dev, RMS_NORM, "rms_norm_backward", T, blocks_over_rows(blocks, d);
                &x, &w, &dy, &mut out, &mut partial, &rows64, &d64, &eps),
            Some((sr, lr)) => {
                let dres = input::<T>(op, "dres", sr, lr)?;
                launch!(dev, RMS_NORM, "rms_norm_backward_residual", T, blocks_over_rows(blocks, d);
                    &x, &w, &dy, &dres, &mut out, &mut partial, &rows64, &d64, &eps)
            }
        }
        let mut dw = out.slice_mut(rows * d..);
        launch!(dev, RMS_NORM, "rms_norm_sum", T, columns_config(d);
            &partial, &blocks64, &d64, &mut dw);
        Ok(out)
    }
}

/// RMSNorm's forward outside candle's graph (for the fused layers).
pub(crate) fn forward_raw(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(weight, &RmsNorm { eps })
}

/// RMSNorm's backward outside candle's graph: `(dx + dres, d_weight)` for a contiguous `x`
/// `[..., d]`, where `dres` is the gradient reaching `x` along the residual path that skips the
/// norm (added in the same pass).
pub(crate) fn backward_raw(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    dres: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (dx, params) = row_norm::backward_raw::<RmsNorm>(x, weight, dy, dres, eps)?;
    Ok((dx, params.get(0)?))
}
