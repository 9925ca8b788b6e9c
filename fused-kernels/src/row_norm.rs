//! The plumbing LayerNorm and RMSNorm share: their backward op, which computes `[rows + k, d]` (the
//! rows of `dx`, then the `k` parameter gradients summed over the rows) in one pass, inside
//! candle's graph and outside it. Each norm says, as a [`RowNorm`], how its rows are computed.

#[cfg(feature = "cuda")]
use crate::cuda::{cuda_dispatch, CudaElement};
use crate::element::{contiguous, dispatch, Element};
use crate::rows::rows_of;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

/// A normalization over the last dimension whose backward pass takes `(x, weight, dy)` and, in
/// the same pass, `dres` (the gradient reaching `x` along a residual path, added to `dx`).
pub(crate) trait RowNorm: Send + Sync + 'static {
    /// The forward op's name.
    const NAME: &'static str;
    /// The backward op's name, as errors and candle's graph show it.
    const BACKWARD_NAME: &'static str;
    /// The parameters' count: the rows after `dx`'s in the backward pass's result.
    const PARAMS: usize;

    /// The backward pass on the CPU: `[rows + PARAMS, d]`, the rows of `dx` (plus `dres` when
    /// given), then the gradient of each parameter.
    fn backward_cpu<T: Element>(
        x: &[T],
        w: &[T],
        dy: &[T],
        dres: Option<&[T]>,
        d: usize,
        eps: f64,
    ) -> Vec<T>;

    /// The backward pass on a CUDA device for `[(x), (weight), (dy), (dres)?]`, laid out as
    /// [`backward_cpu`](Self::backward_cpu)'s.
    #[cfg(feature = "cuda")]
    fn backward_cuda<T: CudaElement>(
        s: &[(&CudaStorage, &Layout)],
        eps: f64,
    ) -> Result<CudaSlice<T>>;
}

/// The backward op of `N`: `(x, weight, dy) → [rows + N::PARAMS, d]`.
struct Backward<N> {
    eps: f64,
    norm: std::marker::PhantomData<N>,
}

impl<N: RowNorm> CustomOp3 for Backward<N> {
    fn name(&self) -> &'static str {
        N::BACKWARD_NAME
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
        let s = [(s1, l1), (s2, l2), (s3, l3)];
        let op = N::BACKWARD_NAME;
        let (rows, d) = rows_of(op, "x", l1.dims())?;
        let out = dispatch!(
            op,
            s1,
            backward_storage(op, &s, d, self.eps, N::backward_cpu)
        )?;
        Ok((out, Shape::from((rows + N::PARAMS, d))))
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
        let s = [(s1, l1), (s2, l2), (s3, l3)];
        let op = N::BACKWARD_NAME;
        let (rows, d) = rows_of(op, "x", l1.dims())?;
        let out = cuda_dispatch!(
            op,
            s1,
            backward_cuda_storage(&s, self.eps, N::backward_cuda)
        )?;
        Ok((out, Shape::from((rows + N::PARAMS, d))))
    }
}

/// `backward` run on the CPU storages `[(x), (weight), (dy), (dres)?]`.
fn backward_storage<T: Element>(
    op: &str,
    s: &[(&CpuStorage, &Layout)],
    d: usize,
    eps: f64,
    backward: impl Fn(&[T], &[T], &[T], Option<&[T]>, usize, f64) -> Vec<T>,
) -> Result<CpuStorage> {
    let x = contiguous::<T>(op, "x", s[0].0, s[0].1)?;
    let w = contiguous::<T>(op, "weight", s[1].0, s[1].1)?;
    let dy = contiguous::<T>(op, "dy", s[2].0, s[2].1)?;
    let dres = s
        .get(3)
        .map(|(s, l)| contiguous::<T>(op, "dres", s, l))
        .transpose()?;
    Ok(T::storage(backward(x, w, dy, dres, d, eps)))
}

/// `backward` run on CUDA storages, wrapped as storage.
#[cfg(feature = "cuda")]
fn backward_cuda_storage<T: CudaElement>(
    s: &[(&CudaStorage, &Layout)],
    eps: f64,
    backward: impl Fn(&[(&CudaStorage, &Layout)], f64) -> Result<CudaSlice<T>>,
) -> Result<CudaStorage> {
    Ok(crate::cuda::storage(backward(s, eps)?, &s[0].0.device))
}

/// `[rows + k, d]` split into `dx` (of `x`'s shape) and the `[k, d]` parameter gradients.
fn split(all: &Tensor, x: &Tensor, rows: usize) -> Result<(Tensor, Tensor)> {
    let dx = all.narrow(0, 0, rows)?.reshape(x.shape())?;
    Ok((dx, all.narrow(0, rows, all.dim(0)? - rows)?))
}

/// `N`'s backward pass inside a node's `bwd`: `dx` and the `[N::PARAMS, d]` parameter gradients.
pub(crate) fn backward<N: RowNorm>(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (rows, _) = rows_of(N::NAME, "x", x.dims())?;
    let op = Backward::<N> {
        eps,
        norm: std::marker::PhantomData,
    };
    let all = x.apply_op3_no_bwd(weight, &dy.contiguous()?, &op)?;
    split(&all, x, rows)
}

/// `N`'s backward pass outside candle's graph: `(dx + dres, [N::PARAMS, d] parameter gradients)`
/// for a contiguous `x` `[..., d]`, where `dres` is the gradient reaching `x` along the residual
/// path that skips the norm (added in the same pass).
pub(crate) fn backward_raw<N: RowNorm>(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    dres: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let op = N::BACKWARD_NAME;
    let (rows, d) = rows_of(op, "x", x.dims())?;
    let dy = dy.contiguous()?;
    let dres = dres.map(|t| t.contiguous()).transpose()?;
    let mut args = vec![x, weight, &dy];
    args.extend(dres.as_ref());
    let shape = (rows + N::PARAMS, d);
    let all = if crate::raw::on_cuda(x) {
        #[cfg(feature = "cuda")]
        {
            crate::raw::with_cuda(op, &args, |s| {
                cuda_dispatch!(op, s[0].0, backward_cuda_storage(s, eps, N::backward_cuda))
            })
            .map(|s| crate::raw::cuda_tensor(s, shape))?
        }
        #[cfg(not(feature = "cuda"))]
        candle_core::bail!("{op}: CUDA tensors need the `cuda` feature")
    } else {
        crate::raw::with_cpu(op, &args, |s| {
            dispatch!(op, s[0].0, backward_storage(op, s, d, eps, N::backward_cpu))
        })
        .map(|s| crate::raw::cpu_tensor(s, shape))?
    };
    split(&all, x, rows)
}
