//! Rotary position embeddings in Hugging Face Llama's `rotate_half` convention (the two halves of
//! the head dimension are the pairs, not interleaved neighbours).

#[cfg(feature = "cuda")]
use crate::cuda::{
    cuda_dispatch, elements_config, input, launch, output, storage, CudaElement, ROTARY,
};
use crate::element::{contiguous, dispatch, Element};
use crate::rows::for_each_row;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

/// Rotates `x` `[b, h, t, d]` (any leading dimensions before `[t, d]`; `d` even) by the angles
/// whose cosines and sines are `cos`, `sin` `[t, d/2]`: with `h = d/2`, for `i < h`,
/// `y_i = x_i · cos_ti − x_{i+h} · sin_ti` and `y_{i+h} = x_{i+h} · cos_ti + x_i · sin_ti`. This is
/// transformers' `apply_rotary_pos_emb`, `x · cos + rotate_half(x) · sin`, with its `cos`, `sin`
/// `[t, d]` being these halves repeated twice.
///
/// The gradient goes to `x` only (the angles are constants): the rotation by `−θ`,
/// `dx_i = dy_i · cos + dy_{i+h} · sin`, `dx_{i+h} = dy_{i+h} · cos − dy_i · sin`. `cos` and `sin`
/// are converted to the dtype of `x` (as transformers does); bf16/f16 are computed in f32.
pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let [.., t, d] = dims else {
        candle_core::bail!("rotary: x must have shape [..., t, d], got {dims:?}");
    };
    let (t, d) = (*t, *d);
    if d % 2 != 0 {
        candle_core::bail!("rotary: the last dimension of x {dims:?} must be even (two halves)");
    }
    for (what, a) in [("cos", cos), ("sin", sin)] {
        if a.dims() != [t, d / 2] {
            candle_core::bail!(
                "rotary: {what} must have shape [{t}, {}] (positions × half the head dimension of \
                 x {dims:?}), got {:?}",
                d / 2,
                a.dims()
            );
        }
    }
    let (cos, sin) = (
        cos.to_dtype(x.dtype())?.contiguous()?,
        sin.to_dtype(x.dtype())?.contiguous()?,
    );
    if !crate::element::has_kernel(x) {
        return crate::fallback::rotary(x, &cos, &sin);
    }
    x.contiguous()?
        .apply_op3(&cos, &sin, Rotary { inverse: false })
}

/// The op, forward (`inverse: false`) or its own backward (`inverse: true`, the rotation by `−θ`).
struct Rotary {
    inverse: bool,
}

impl CustomOp3 for Rotary {
    fn name(&self) -> &'static str {
        if self.inverse {
            "rotary-backward"
        } else {
            "rotary"
        }
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
            rotary: &Rotary,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            s3: &CpuStorage,
            l3: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let (op, inverse) = (rotary.name(), rotary.inverse);
            let x = contiguous::<T>(op, "x", s1, l1)?;
            let cos = contiguous::<T>(op, "cos", s2, l2)?;
            let sin = contiguous::<T>(op, "sin", s3, l3)?;
            let dims = l1.dims();
            let (t, d) = (dims[dims.len() - 2], dims[dims.len() - 1]);
            let h = d / 2;
            let mut out = vec![T::from_acc(num_traits::Zero::zero()); x.len()];
            for_each_row(&mut out, d, |r, y| {
                let x = &x[r * d..(r + 1) * d];
                let pos = r % t;
                let (c, s) = (&cos[pos * h..(pos + 1) * h], &sin[pos * h..(pos + 1) * h]);
                let (y1, y2) = y.split_at_mut(h);
                for i in 0..h {
                    let (a, b) = (x[i].to_acc(), x[i + h].to_acc());
                    let (c, s) = (c[i].to_acc(), s[i].to_acc());
                    let s = if inverse { -s } else { s };
                    y1[i] = T::from_acc(a * c - b * s);
                    y2[i] = T::from_acc(b * c + a * s);
                }
            });
            Ok((T::storage(out), l1.shape().clone()))
        }
        let op = self.name();
        dispatch!(op, s1, run(self, s1, l1, s2, l2, s3, l3))
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
            rotary: &Rotary,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let op = rotary.name();
            let x = input::<T>(op, "x", s1, l1)?;
            let cos = input::<T>(op, "cos", s2, l2)?;
            let sin = input::<T>(op, "sin", s3, l3)?;
            let dims = l1.dims();
            let (t, d) = (dims[dims.len() - 2], dims[dims.len() - 1]);
            let rows = l1.shape().elem_count() / d;
            let h = d / 2;
            let dev = &s1.device;
            let mut y = output::<T>(dev, rows * d)?;
            let (rows64, t64, h64) = (rows as u64, t as u64, h as u64);
            let inverse = i32::from(rotary.inverse);
            launch!(dev, ROTARY, "rotary", T, elements_config(rows * h);
                &x, &cos, &sin, &mut y, &rows64, &t64, &h64, &inverse);
            Ok((storage(y, dev), l1.shape().clone()))
        }
        let op = self.name();
        cuda_dispatch!(op, s1, run(self, s1, l1, s2, l2, s3, l3))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = dy.contiguous()?.apply_op3_no_bwd(
            cos,
            sin,
            &Rotary {
                inverse: !self.inverse,
            },
        )?;
        Ok((Some(dx), None, None))
    }
}
