//! The residual add that ends a fused layer: `x + z`, plus the output projection's bias on every
//! row, in one pass written straight into the layer node's storage ([`crate::node::Output`]).
//! bf16/f16 are added in f32 and rounded once.

#[cfg(feature = "cuda")]
use crate::cuda::{
    cuda_dispatch, elements_config, input, launch, output, storage, CudaElement, RESIDUAL,
};
use crate::element::{contiguous, dispatch, Element};
use crate::rows::for_each_row;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, Result, Shape, Storage, Tensor};

/// Checks the shapes: `x` and `z` equal, `bias` `[n]` for rows of `n`; returns `n`.
fn width(x: &Tensor, z: &Tensor, bias: Option<&Tensor>) -> Result<usize> {
    if x.dims() != z.dims() || x.dtype() != z.dtype() {
        candle_core::bail!(
            "residual: x {:?} {:?} and z {:?} {:?} must have one shape and dtype",
            x.dims(),
            x.dtype(),
            z.dims(),
            z.dtype()
        );
    }
    let n = *x.dims().last().unwrap_or(&1);
    if let Some(b) = bias {
        if b.dims() != [n] || b.dtype() != x.dtype() {
            candle_core::bail!(
                "residual: bias {:?} {:?} must be [{n}] {:?}",
                b.dims(),
                b.dtype(),
                x.dtype()
            );
        }
    }
    Ok(n)
}

/// `x + z (+ bias)` on the CPU, as a new storage.
pub(crate) fn cpu(x: &Tensor, z: &Tensor, bias: Option<&Tensor>) -> Result<(CpuStorage, Shape)> {
    let n = width(x, z, bias)?;
    let (sx, lx) = x.storage_and_layout();
    let (sz, lz) = z.storage_and_layout();
    let sb = bias.map(|b| b.storage_and_layout());
    let (Storage::Cpu(sx), Storage::Cpu(sz)) = (&*sx, &*sz) else {
        candle_core::bail!("residual: x and z must be on the CPU");
    };
    let b = match &sb {
        Some((s, l)) => match &**s {
            Storage::Cpu(s) => Some((s, *l)),
            _ => candle_core::bail!("residual: bias must be on the CPU"),
        },
        None => None,
    };
    fn run<T: Element>(
        sx: &CpuStorage,
        lx: &candle_core::Layout,
        sz: &CpuStorage,
        lz: &candle_core::Layout,
        b: Option<(&CpuStorage, &candle_core::Layout)>,
        n: usize,
    ) -> Result<(CpuStorage, Shape)> {
        let x = contiguous::<T>("residual", "x", sx, lx)?;
        let z = contiguous::<T>("residual", "z", sz, lz)?;
        let b = match b {
            Some((s, l)) => Some(contiguous::<T>("residual", "bias", s, l)?),
            None => None,
        };
        let mut out = vec![T::from_acc(num_traits::Zero::zero()); x.len()];
        for_each_row(&mut out, n.max(1), |r, y| {
            let (x, z) = (&x[r * n..(r + 1) * n], &z[r * n..(r + 1) * n]);
            match b {
                Some(b) => {
                    for (((y, x), z), b) in y.iter_mut().zip(x).zip(z).zip(b) {
                        *y = T::from_acc(x.to_acc() + z.to_acc() + b.to_acc());
                    }
                }
                None => {
                    for ((y, x), z) in y.iter_mut().zip(x).zip(z) {
                        *y = T::from_acc(x.to_acc() + z.to_acc());
                    }
                }
            }
        });
        Ok((T::storage(out), lx.shape().clone()))
    }
    dispatch!("residual", sx, run(sx, lx, sz, lz, b, n))
}

/// `x + z (+ bias)` on a CUDA device, as a new storage: one launch.
#[cfg(feature = "cuda")]
pub(crate) fn cuda(x: &Tensor, z: &Tensor, bias: Option<&Tensor>) -> Result<(CudaStorage, Shape)> {
    let n = width(x, z, bias)?;
    let (sx, lx) = x.storage_and_layout();
    let (sz, lz) = z.storage_and_layout();
    let sb = bias.map(|b| b.storage_and_layout());
    let (Storage::Cuda(sx), Storage::Cuda(sz)) = (&*sx, &*sz) else {
        candle_core::bail!("residual: x and z must be on a CUDA device");
    };
    let b = match &sb {
        Some((s, l)) => match &**s {
            Storage::Cuda(s) => Some((s, *l)),
            _ => candle_core::bail!("residual: bias must be on the CUDA device"),
        },
        None => None,
    };
    fn run<T: CudaElement>(
        sx: &CudaStorage,
        lx: &candle_core::Layout,
        sz: &CudaStorage,
        lz: &candle_core::Layout,
        b: Option<(&CudaStorage, &candle_core::Layout)>,
        n: usize,
    ) -> Result<(CudaStorage, Shape)> {
        let xs = input::<T>("residual", "x", sx, lx)?;
        let zs = input::<T>("residual", "z", sz, lz)?;
        let total = lx.shape().elem_count();
        let dev = &sx.device;
        let mut y = output::<T>(dev, total)?;
        let (total64, n64) = (total as u64, n as u64);
        match b {
            Some((sb, lb)) => {
                let bs = input::<T>("residual", "bias", sb, lb)?;
                launch!(dev, RESIDUAL, "residual_add_bias", T, elements_config(total);
                    &xs, &zs, &bs, &mut y, &total64, &n64);
            }
            None => {
                launch!(dev, RESIDUAL, "residual_add", T, elements_config(total);
                    &xs, &zs, &mut y, &total64);
            }
        }
        Ok((storage(y, dev), lx.shape().clone()))
    }
    cuda_dispatch!("residual", sx, run(sx, lx, sz, lz, b, n))
}
