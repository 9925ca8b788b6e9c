//! A bias added to every row, whose gradient is summed over rows in one contiguous pass (candle's
//! `broadcast_add` backward sums over the leading dimensions with strided reductions).

#[cfg(feature = "cuda")]
use crate::cuda::{
    blocks_over_rows, columns_config, cuda_dispatch, elements_config, input, launch, output,
    partial_blocks, storage, CudaElement, ADD_BIAS,
};
use crate::element::{contiguous, dispatch, Element};
use crate::rows::{for_each_row, rows_of, sum_over_rows};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

/// `x + bias` for `x` `[..., n]` and `bias` `[n]` (added to every row), in the dtype both share.
///
/// Gradients: `dx = dy` (the same tensor) and `d_bias = Σ_rows dy`, accumulated in f32 for
/// bf16/f16 and in row blocks (the same sum on any number of threads).
pub fn add_bias(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let (_, n) = rows_of("add_bias", "x", x.dims())?;
    if bias.dims() != [n] {
        candle_core::bail!(
            "add_bias: bias must have shape [{n}] (the last dimension of x {:?}), got {:?}",
            x.dims(),
            bias.dims()
        );
    }
    if !crate::element::has_kernel(x) {
        return x.broadcast_add(bias);
    }
    x.contiguous()?.apply_op2(&bias.contiguous()?, AddBias)
}

/// The forward op.
struct AddBias;

impl CustomOp2 for AddBias {
    fn name(&self) -> &'static str {
        "add_bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let x = contiguous::<T>("add_bias", "x", s1, l1)?;
            let b = contiguous::<T>("add_bias", "bias", s2, l2)?;
            let n = b.len();
            let mut out = vec![T::from_acc(num_traits::Zero::zero()); x.len()];
            for_each_row(&mut out, n, |r, y| {
                for ((y, x), b) in y.iter_mut().zip(&x[r * n..(r + 1) * n]).zip(b) {
                    *y = T::from_acc(x.to_acc() + b.to_acc());
                }
            });
            Ok((T::storage(out), l1.shape().clone()))
        }
        dispatch!("add_bias", s1, run(s1, l1, s2, l2))
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
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let x = input::<T>("add_bias", "x", s1, l1)?;
            let b = input::<T>("add_bias", "bias", s2, l2)?;
            let (total, n) = (l1.shape().elem_count(), l2.shape().elem_count());
            let dev = &s1.device;
            let mut y = output::<T>(dev, total)?;
            let (total64, n64) = (total as u64, n as u64);
            launch!(dev, ADD_BIAS, "add_bias", T, elements_config(total);
                &x, &b, &mut y, &total64, &n64);
            Ok((storage(y, dev), l1.shape().clone()))
        }
        cuda_dispatch!("add_bias", s1, run(s1, l1, s2, l2))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _bias: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let db = dy.contiguous()?.apply_op1_no_bwd(&SumRows)?;
        Ok((Some(dy.clone()), Some(db)))
    }
}

/// `[..., n] → [n]`, the sum of the rows.
struct SumRows;

impl CustomOp1 for SumRows {
    fn name(&self) -> &'static str {
        "add_bias-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
            let dy = contiguous::<T>("add_bias-backward", "dy", s, l)?;
            let (rows, n) = rows_of("add_bias-backward", "dy", l.dims())?;
            let sums = sum_over_rows(rows, n, n, |first, end, acc| {
                for row in dy[first * n..end * n].chunks_exact(n) {
                    for (a, v) in acc.iter_mut().zip(row) {
                        *a = *a + v.to_acc();
                    }
                }
            });
            let out = sums.into_iter().map(T::from_acc).collect();
            Ok((T::storage(out), Shape::from(n)))
        }
        dispatch!("add_bias-backward", s, run(s, l))
    }

    /// Two launches: per-block partial sums over at most 512 blocks of rows, then one
    /// thread per column adds them in block order (no atomics: the same result on every run).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let dy = input::<T>("add_bias-backward", "dy", s, l)?;
            let (rows, n) = rows_of("add_bias-backward", "dy", l.dims())?;
            let dev = &s.device;
            let blocks = partial_blocks(rows, n);
            let mut partial = output::<T::Acc>(dev, blocks * n)?;
            let mut db = output::<T>(dev, n)?;
            let (rows64, n64, blocks64) = (rows as u64, n as u64, blocks as u64);
            launch!(dev, ADD_BIAS, "add_bias_partial", T, blocks_over_rows(blocks, n);
                &dy, &mut partial, &rows64, &n64);
            launch!(dev, ADD_BIAS, "add_bias_sum", T, columns_config(n);
                &partial, &blocks64, &n64, &mut db);
            Ok((storage(db, dev), Shape::from(n)))
        }
        cuda_dispatch!("add_bias-backward", s, run(s, l))
    }
}
