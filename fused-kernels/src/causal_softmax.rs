//! Softmax over the last dimension under a causal mask, the attention probabilities of a
//! decoder (PyTorch: `softmax(scale · scores + mask)` with `-inf` above the shifted diagonal).

#[cfg(feature = "cuda")]
use crate::cuda::{
    cuda_dispatch, input, launch, output, rows_config, storage, CudaElement, CAUSAL_SOFTMAX,
};
use crate::element::{constant, contiguous, dispatch, Element};
use crate::rows::for_each_row;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use num_traits::{Float, Zero};

/// The causal softmax of `scores` `[..., t_q, t_k]` (`t_q ≤ t_k`): for query `i` and key `j`,
/// `p_ij = exp(scale·s_ij − m_i) / Σ_{j' ≤ i + t_k − t_q} exp(scale·s_ij' − m_i)` where
/// `j ≤ i + (t_k − t_q)` (the last query sees every key), and exactly 0 for the masked keys
/// after it. `m_i` is the row's largest unmasked `scale·s`.
///
/// Gradient from the output alone: `ds_ij = scale · p_ij · (dp_ij − Σ_j' dp_ij' p_ij')`, 0 where
/// masked. f32, f64, or bf16/f16 (computed in f32, as autocast computes softmax); the result has
/// the dtype of `scores`.
pub fn causal_softmax(scores: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = scores.dims();
    let [.., t_q, t_k] = dims else {
        candle_core::bail!(
            "causal_softmax: scores must have shape [..., t_q, t_k] (at least two dimensions), \
             got {dims:?}"
        );
    };
    if t_q > t_k {
        candle_core::bail!(
            "causal_softmax: t_q = {t_q} queries but only t_k = {t_k} keys in scores {dims:?}; \
             the first queries would see no key (expected t_q <= t_k)"
        );
    }
    if !crate::element::has_kernel(scores) {
        return crate::fallback::causal_softmax(scores, scale);
    }
    scores.contiguous()?.apply_op1(CausalSoftmax { scale })
}

/// `(t_q, t_k)` of a layout the public function checked.
fn query_and_key_len(l: &Layout) -> (usize, usize) {
    let dims = l.dims();
    (dims[dims.len() - 2], dims[dims.len() - 1])
}

/// The forward op.
struct CausalSoftmax {
    scale: f64,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal_softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(scale: f64, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
            let x = contiguous::<T>("causal_softmax", "scores", s, l)?;
            let (t_q, t_k) = query_and_key_len(l);
            let scale = constant::<T::Acc>(scale);
            let mut out = vec![T::from_acc(<T::Acc>::zero()); x.len()];
            for_each_row(&mut out, t_k, |r, p| {
                let seen = r % t_q + (t_k - t_q) + 1;
                let x = &x[r * t_k..r * t_k + seen];
                let max = x
                    .iter()
                    .map(|v| scale * v.to_acc())
                    .fold(<T::Acc>::neg_infinity(), Float::max);
                // Exponentials into the output row (in T) would round them for bf16 before the
                // division; keep them in the arithmetic type.
                let mut sum = <T::Acc>::zero();
                let e: Vec<T::Acc> = x
                    .iter()
                    .map(|v| {
                        let e = (scale * v.to_acc() - max).exp();
                        sum = sum + e;
                        e
                    })
                    .collect();
                let inv = sum.recip();
                for (p, e) in p.iter_mut().zip(e) {
                    *p = T::from_acc(e * inv);
                }
            });
            Ok((T::storage(out), l.shape().clone()))
        }
        dispatch!("causal_softmax", s, run(self.scale, s, l))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(
            scale: f64,
            s: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let x = input::<T>("causal_softmax", "scores", s, l)?;
            let (t_q, t_k) = query_and_key_len(l);
            let rows = l.shape().elem_count() / t_k;
            let dev = &s.device;
            let mut p = output::<T>(dev, rows * t_k)?;
            let (rows64, t_q64, t_k64) = (rows as u64, t_q as u64, t_k as u64);
            launch!(dev, CAUSAL_SOFTMAX, "causal_softmax", T, rows_config(rows, t_k);
                &x, &mut p, &rows64, &t_q64, &t_k64, &scale);
            Ok((storage(p, dev), l.shape().clone()))
        }
        cuda_dispatch!("causal_softmax", s, run(self.scale, s, l))
    }

    fn bwd(&self, _scores: &Tensor, p: &Tensor, dp: &Tensor) -> Result<Option<Tensor>> {
        let grad = p.apply_op2_no_bwd(
            &dp.contiguous()?,
            &CausalSoftmaxBackward { scale: self.scale },
        )?;
        Ok(Some(grad))
    }
}

/// The backward op: `(p, dp) → d_scores`.
struct CausalSoftmaxBackward {
    scale: f64,
}

impl CustomOp2 for CausalSoftmaxBackward {
    fn name(&self) -> &'static str {
        "causal_softmax-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(
            scale: f64,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let p = contiguous::<T>("causal_softmax-backward", "p", s1, l1)?;
            let dp = contiguous::<T>("causal_softmax-backward", "dp", s2, l2)?;
            let (t_q, t_k) = query_and_key_len(l1);
            let scale = constant::<T::Acc>(scale);
            let mut out = vec![T::from_acc(<T::Acc>::zero()); p.len()];
            for_each_row(&mut out, t_k, |r, ds| {
                let seen = r % t_q + (t_k - t_q) + 1;
                let p = &p[r * t_k..r * t_k + seen];
                let dp = &dp[r * t_k..r * t_k + seen];
                let dot = p
                    .iter()
                    .zip(dp)
                    .map(|(p, g)| p.to_acc() * g.to_acc())
                    .sum::<T::Acc>();
                for ((ds, p), g) in ds.iter_mut().zip(p).zip(dp) {
                    *ds = T::from_acc(scale * p.to_acc() * (g.to_acc() - dot));
                }
            });
            Ok((T::storage(out), l1.shape().clone()))
        }
        dispatch!(
            "causal_softmax-backward",
            s1,
            run(self.scale, s1, l1, s2, l2)
        )
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
            scale: f64,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let p = input::<T>("causal_softmax-backward", "p", s1, l1)?;
            let dp = input::<T>("causal_softmax-backward", "dp", s2, l2)?;
            let (t_q, t_k) = query_and_key_len(l1);
            let rows = l1.shape().elem_count() / t_k;
            let dev = &s1.device;
            let mut ds = output::<T>(dev, rows * t_k)?;
            let (rows64, t_q64, t_k64) = (rows as u64, t_q as u64, t_k as u64);
            launch!(dev, CAUSAL_SOFTMAX, "causal_softmax_backward", T, rows_config(rows, t_k);
                &p, &dp, &mut ds, &rows64, &t_q64, &t_k64, &scale);
            Ok((storage(ds, dev), l1.shape().clone()))
        }
        cuda_dispatch!(
            "causal_softmax-backward",
            s1,
            run(self.scale, s1, l1, s2, l2)
        )
    }
}
