//! A bias added to every row, whose gradient is summed over rows in one contiguous pass (candle's
//! `broadcast_add` backward sums over the leading dimensions with strided reductions).

#[cfg(feature = "cuda")]
use crate::cuda::{
    cuda_dispatch, elements_config, input, launch, output, storage, CudaElement, ADD_BIAS,
};
use crate::element::{contiguous, dispatch, Element};
use crate::rows::{for_each_row, rows_of, sum_over_rows};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

/// `x + bias` for `x` `[..., n]` and `bias` `[n]` (added to every row), in the dtype both share.
///
/// Gradients: `dx = dy` (the same tensor) and `d_bias = Σ_rows dy`, accumulated in f32 for
/// bf16/f16 in one deterministic pass (row blocks on the CPU, the same sum on any number of
/// threads; one matrix product with a row of ones on CUDA).
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
        Ok((Some(dy.clone()), Some(column_sums(dy)?)))
    }
}

/// `[..., m] → [m]`: the sum of the rows of `dy` (a bias's gradient), in one deterministic pass
/// and without autograd. bf16/f16 are summed in f32 and rounded once.
///
/// On the CPU the rows are summed in row blocks whose partial sums are added in block order
/// (the same result on any number of threads). On other devices it is one matrix product,
/// `ones[1, rows] · dy[rows, m]` through candle's `matmul`: cuBLAS accumulates bf16/f16 in f32
/// (unless candle's reduced-precision switches for half-precision products are turned on) and
/// gives the same bits on every run on one GPU model.
pub(crate) fn column_sums(dy: &Tensor) -> Result<Tensor> {
    let (rows, m) = rows_of("column_sums", "dy", dy.dims())?;
    if dy.device().is_cpu() {
        return dy.contiguous()?.apply_op1_no_bwd(&SumRows);
    }
    if rows == 0 || m == 0 {
        return Tensor::zeros(m, dy.dtype(), dy.device());
    }
    let ones = Tensor::ones((1, rows), dy.dtype(), dy.device())?;
    ones.matmul(&dy.reshape((rows, m))?)?.reshape(m)
}

/// `[..., n] → [n]`, the sum of the rows on the CPU ([`column_sums`] takes a matrix product on
/// other devices).
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
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    #[test]
    fn column_sums_equal_naive_sums_and_bf16_is_summed_in_f32() {
        // 3 · 333 rows of 5 (past the threshold of the threaded row blocks).
        let (rows, m) = (999, 5);
        let v: Vec<f64> = (0..rows * m)
            .map(|i| ((i * 7919) % 1000) as f64 / 100.0 - 4.0)
            .collect();
        let dy = Tensor::from_vec(v, (3, 333, m), &Device::Cpu).unwrap();
        // Absolute and relative tolerances: f32 sums of 200 terms reaching ~1000 (half an ulp,
        // 3e-5, per add); bf16's one final rounding (2⁻⁹ relative, 2 at ~1000; a bf16 running
        // sum would round to 4 at every add past 512, tens of units in all).
        for (dtype, abs, rel) in [
            (DType::F64, 1e-9, 0.0),
            (DType::F32, 1e-2, 0.0),
            (DType::BF16, 1e-2, 1.0 / 256.0),
        ] {
            let dy = dy.to_dtype(dtype).unwrap();
            // The reference: f64 sums of the values as the dtype holds them.
            let held: Vec<f64> = dy
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let mut want = vec![0f64; m];
            for (i, x) in held.iter().enumerate() {
                want[i % m] += x;
            }
            let got: Vec<f64> = super::column_sums(&dy)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= abs + rel * w.abs(),
                    "{dtype:?}: {got:?} vs {want:?}"
                );
            }
        }
    }
}
