//! Element-wise kernels of the fused layers ([`crate::attention_block`], [`crate::mlp_block`]),
//! outside candle's graph: the bias add after a projection (in place), bias + GELU and its
//! backward, SwiGLU over a packed `[gate | up]` projection and its backward, and rotary embeddings
//! applied in place to a range of heads of a packed `[B, T, heads, D]` projection.
//!
//! Each reads its operands once and writes its result once; bf16/f16 are computed in f32 and
//! rounded once per element, with the formulas of the standalone ops ([`crate::gelu`],
//! [`crate::swiglu`], [`crate::rotary`]).

#[cfg(feature = "cuda")]
use crate::cuda::{
    cuda_dispatch, elements_config, input, launch, output, CudaElement, BLOCK_KERNELS,
};
use crate::element::{contiguous, dispatch, Element};
use crate::elementwise::map_unary;
use crate::gelu::gelu_and_slope;
use crate::raw::{cpu_tensor, on_cuda, with_cpu};
#[cfg(feature = "cuda")]
use crate::raw::{cuda_tensor, with_cuda};
use crate::rows::for_each_row;
use crate::silu::{sigmoid, silu_slope};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, InplaceOp2, InplaceOp3, Layout, Result, Tensor};
use num_traits::Zero;

/// `(rows, n)` of a contiguous `[..., n]` tensor, or an error naming `op`.
fn rows(op: &str, t: &Tensor) -> Result<(usize, usize)> {
    if !t.is_contiguous() {
        candle_core::bail!(
            "{op}: expected a contiguous tensor, got strides {:?}",
            t.stride()
        );
    }
    crate::rows::rows_of(op, "x", t.dims())
}

fn check_bias(op: &str, bias: Option<&Tensor>, n: usize, x: &Tensor) -> Result<()> {
    if let Some(b) = bias {
        if b.dims() != [n] || b.dtype() != x.dtype() || !b.is_contiguous() {
            candle_core::bail!(
                "{op}: bias must be a contiguous [{n}] {:?} tensor, got {:?} {:?}",
                x.dtype(),
                b.dims(),
                b.dtype()
            );
        }
    }
    Ok(())
}

// ---- bias add, in place ----

/// `y += bias` on every row of a contiguous `y` `[..., n]` that nothing else reads yet (a
/// projection's fresh output).
pub(crate) fn add_bias_inplace(y: &Tensor, bias: &Tensor) -> Result<()> {
    let (_, n) = rows("add_bias_inplace", y)?;
    check_bias("add_bias_inplace", Some(bias), n, y)?;
    y.inplace_op2(bias, &AddBiasInPlace)
}

struct AddBiasInPlace;

/// The in-place bias add on a CPU storage the caller owns (a product's fresh result).
pub(crate) fn add_bias_cpu(
    y: &mut CpuStorage,
    ly: &Layout,
    bias: &CpuStorage,
    lb: &Layout,
) -> Result<()> {
    AddBiasInPlace.cpu_fwd(y, ly, bias, lb)
}

/// The in-place bias add on a CUDA storage the caller owns (a product's fresh result).
#[cfg(feature = "cuda")]
pub(crate) fn add_bias_cuda(
    y: &mut CudaStorage,
    ly: &Layout,
    bias: &CudaStorage,
    lb: &Layout,
) -> Result<()> {
    AddBiasInPlace.cuda_fwd(y, ly, bias, lb)
}

impl InplaceOp2 for AddBiasInPlace {
    fn name(&self) -> &'static str {
        "add_bias_inplace"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        fn run<T: Element>(
            s1: &mut CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<()> {
            let b = contiguous::<T>("add_bias_inplace", "bias", s2, l2)?;
            let n = b.len();
            let Some((start, end)) = l1.contiguous_offsets() else {
                candle_core::bail!("add_bias_inplace: y is not contiguous");
            };
            let y = T::slice_mut(s1).ok_or_else(|| {
                candle_core::Error::Msg("add_bias_inplace: y and bias dtypes differ".into())
            })?;
            for_each_row(&mut y[start..end], n, |_, row| {
                for (y, b) in row.iter_mut().zip(b) {
                    *y = T::from_acc(y.to_acc() + b.to_acc());
                }
            });
            Ok(())
        }
        dispatch!("add_bias_inplace", s2, run(s1, l1, s2, l2))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        fn run<T: CudaElement>(
            s1: &mut CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<()> {
            let b = input::<T>("add_bias_inplace", "bias", s2, l2)?;
            let n = l2.shape().elem_count();
            let Some((start, end)) = l1.contiguous_offsets() else {
                candle_core::bail!("add_bias_inplace: y is not contiguous");
            };
            let dev = s1.device.clone();
            let mut y = s1.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
            let (total, n64) = ((end - start) as u64, n as u64);
            launch!(&dev, BLOCK_KERNELS, "add_bias_inplace", T, elements_config(end - start);
                &mut y, &b, &total, &n64);
            Ok(())
        }
        cuda_dispatch!("add_bias_inplace", s2, run(s1, l1, s2, l2))
    }
}

// ---- add into a range of columns, in place ----

/// `y[:, offset..offset + w] += delta` for a contiguous `y` `[rows, total]` that nothing else reads
/// yet and `delta` `[rows, w]`: an adapter's update added to its part of a packed projection.
pub(crate) fn add_into_columns(y: &Tensor, delta: &Tensor, offset: usize) -> Result<()> {
    let (rows, total) = y.dims2()?;
    let delta = delta.contiguous()?;
    let (delta_rows, width) = delta.dims2()?;
    if !y.is_contiguous()
        || delta_rows != rows
        || offset + width > total
        || delta.dtype() != y.dtype()
    {
        candle_core::bail!(
            "add_into_columns: delta {:?} {:?} does not fit columns {offset}.. of y {:?} {:?}",
            delta.dims(),
            delta.dtype(),
            y.dims(),
            y.dtype()
        );
    }
    y.inplace_op2(&delta, &AddIntoColumns { offset })
}

struct AddIntoColumns {
    offset: usize,
}

impl InplaceOp2 for AddIntoColumns {
    fn name(&self) -> &'static str {
        "add_into_columns"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        fn run<T: Element>(
            offset: usize,
            s1: &mut CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<()> {
            let delta = contiguous::<T>("add_into_columns", "delta", s2, l2)?;
            let (total, width) = (l1.dims()[1], l2.dims()[1]);
            let Some((start, end)) = l1.contiguous_offsets() else {
                candle_core::bail!("add_into_columns: y is not contiguous");
            };
            let y = T::slice_mut(s1).ok_or_else(|| {
                candle_core::Error::Msg("add_into_columns: y and delta dtypes differ".into())
            })?;
            for_each_row(&mut y[start..end], total.max(1), |r, row| {
                let d = &delta[r * width..(r + 1) * width];
                for (y, d) in row[offset..offset + width].iter_mut().zip(d) {
                    *y = T::from_acc(y.to_acc() + d.to_acc());
                }
            });
            Ok(())
        }
        dispatch!("add_into_columns", s2, run(self.offset, s1, l1, s2, l2))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        fn run<T: CudaElement>(
            offset: usize,
            s1: &mut CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<()> {
            let delta = input::<T>("add_into_columns", "delta", s2, l2)?;
            let (rows, total, width) = (l1.dims()[0], l1.dims()[1], l2.dims()[1]);
            let Some((start, end)) = l1.contiguous_offsets() else {
                candle_core::bail!("add_into_columns: y is not contiguous");
            };
            let dev = s1.device.clone();
            let mut y = s1.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
            let args = [rows, total, width, offset].map(|v| v as u64);
            launch!(&dev, BLOCK_KERNELS, "add_into_columns", T, elements_config(rows * width);
                &mut y, &delta, &args[0], &args[1], &args[2], &args[3]);
            Ok(())
        }
        cuda_dispatch!("add_into_columns", s2, run(self.offset, s1, l1, s2, l2))
    }
}

// ---- bias + GELU ----

/// `gelu(f + bias)` for a projection's output `f` `[..., n]` and its bias `[n]` (or none).
pub(crate) fn bias_gelu(f: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (_, n) = rows("bias_gelu", f)?;
    check_bias("bias_gelu", bias, n, f)?;
    let shape = f.shape().clone();
    if on_cuda(f) {
        #[cfg(feature = "cuda")]
        return cuda_bias_gelu(f, bias, None, n);
    }
    let mut args = vec![f];
    args.extend(bias);
    with_cpu("bias_gelu", &args, |s| {
        fn run<T: Element>(s: &[(&CpuStorage, &Layout)], n: usize) -> Result<CpuStorage> {
            let f = contiguous::<T>("bias_gelu", "f", s[0].0, s[0].1)?;
            let b = s
                .get(1)
                .map(|(s, l)| contiguous::<T>("bias_gelu", "bias", s, l))
                .transpose()?;
            Ok(T::storage(match b {
                None => map_unary(f, |x| gelu_and_slope(x).0),
                Some(b) => {
                    let mut out = vec![T::from_acc(Zero::zero()); f.len()];
                    for_each_row(&mut out, n, |r, y| {
                        for ((y, x), b) in y.iter_mut().zip(&f[r * n..(r + 1) * n]).zip(b) {
                            *y = T::from_acc(gelu_and_slope(x.to_acc() + b.to_acc()).0);
                        }
                    });
                    out
                }
            }))
        }
        dispatch!("bias_gelu", s[0].0, run(s, n))
    })
    .map(|s| cpu_tensor(s, shape))
}

/// `dg · gelu'(f + bias)`: the gradient of [`bias_gelu`]'s input (and, summed over rows, of its
/// bias).
pub(crate) fn bias_gelu_backward(f: &Tensor, bias: Option<&Tensor>, dg: &Tensor) -> Result<Tensor> {
    let (_, n) = rows("bias_gelu_backward", f)?;
    check_bias("bias_gelu_backward", bias, n, f)?;
    let dg = dg.contiguous()?;
    if dg.dims() != f.dims() {
        candle_core::bail!(
            "bias_gelu_backward: dg {:?} and f {:?} differ",
            dg.dims(),
            f.dims()
        );
    }
    let shape = f.shape().clone();
    if on_cuda(f) {
        #[cfg(feature = "cuda")]
        return cuda_bias_gelu(f, bias, Some(&dg), n);
    }
    let mut args = vec![f, &dg];
    args.extend(bias);
    with_cpu("bias_gelu_backward", &args, |s| {
        fn run<T: Element>(s: &[(&CpuStorage, &Layout)], n: usize) -> Result<CpuStorage> {
            let op = "bias_gelu_backward";
            let f = contiguous::<T>(op, "f", s[0].0, s[0].1)?;
            let dg = contiguous::<T>(op, "dg", s[1].0, s[1].1)?;
            let b = s
                .get(2)
                .map(|(s, l)| contiguous::<T>(op, "bias", s, l))
                .transpose()?;
            let mut out = vec![T::from_acc(Zero::zero()); f.len()];
            for_each_row(&mut out, n, |r, y| {
                let (f, dg) = (&f[r * n..(r + 1) * n], &dg[r * n..(r + 1) * n]);
                match b {
                    Some(b) => {
                        for (((y, f), g), b) in y.iter_mut().zip(f).zip(dg).zip(b) {
                            let slope = gelu_and_slope(f.to_acc() + b.to_acc()).1;
                            *y = T::from_acc(g.to_acc() * slope);
                        }
                    }
                    None => {
                        for ((y, f), g) in y.iter_mut().zip(f).zip(dg) {
                            *y = T::from_acc(g.to_acc() * gelu_and_slope(f.to_acc()).1);
                        }
                    }
                }
            });
            Ok(T::storage(out))
        }
        dispatch!("bias_gelu_backward", s[0].0, run(s, n))
    })
    .map(|s| cpu_tensor(s, shape))
}

/// [`bias_gelu`] (`dg` none) or [`bias_gelu_backward`] on a CUDA device.
#[cfg(feature = "cuda")]
fn cuda_bias_gelu(
    f: &Tensor,
    bias: Option<&Tensor>,
    dg: Option<&Tensor>,
    n: usize,
) -> Result<Tensor> {
    let shape = f.shape().clone();
    // Without a bias the kernel is given `f` in its place and told not to read it.
    let b = bias.unwrap_or(f);
    let mut args = vec![f, b];
    args.extend(dg);
    with_cuda("bias_gelu", &args, |s| {
        fn run<T: CudaElement>(
            s: &[(&CudaStorage, &Layout)],
            n: usize,
            has_bias: i32,
        ) -> Result<CudaStorage> {
            let f = input::<T>("bias_gelu", "f", s[0].0, s[0].1)?;
            let b = input::<T>("bias_gelu", "bias", s[1].0, s[1].1)?;
            let total = s[0].1.shape().elem_count();
            let dev = &s[0].0.device;
            let mut y = output::<T>(dev, total)?;
            let (total64, n64) = (total as u64, n as u64);
            match s.get(2) {
                None => launch!(dev, BLOCK_KERNELS, "bias_gelu", T, elements_config(total);
                    &f, &b, &mut y, &total64, &n64, &has_bias),
                Some((sg, lg)) => {
                    let dg = input::<T>("bias_gelu_backward", "dg", sg, lg)?;
                    launch!(dev, BLOCK_KERNELS, "bias_gelu_backward", T, elements_config(total);
                        &f, &b, &dg, &mut y, &total64, &n64, &has_bias)
                }
            }
            Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
        }
        cuda_dispatch!("bias_gelu", s[0].0, run(s, n, bias.is_some() as i32))
    })
    .map(|s| cuda_tensor(s, shape))
}

// ---- SwiGLU over a packed [gate | up] ----

/// `silu(gate) · up` for `gu` `[..., 2·inner]` holding `[gate | up]` per row: `[..., inner]`.
pub(crate) fn swiglu_packed(gu: &Tensor) -> Result<Tensor> {
    swiglu_packed_impl(gu, None)
}

/// The gradient of [`swiglu_packed`]'s packed input for the output's gradient `da`
/// `[..., inner]`: `[d_gate | d_up]` per row, `[..., 2·inner]`.
pub(crate) fn swiglu_packed_backward(gu: &Tensor, da: &Tensor) -> Result<Tensor> {
    swiglu_packed_impl(gu, Some(&da.contiguous()?))
}

fn swiglu_packed_impl(gu: &Tensor, da: Option<&Tensor>) -> Result<Tensor> {
    let op = if da.is_some() {
        "swiglu_packed_backward"
    } else {
        "swiglu_packed"
    };
    let (_rows, width) = rows(op, gu)?;
    if width % 2 != 0 {
        candle_core::bail!("{op}: the packed [gate | up] width {width} is odd");
    }
    let inner = width / 2;
    let mut out_dims = gu.dims().to_vec();
    if let Some(da) = da {
        let mut want = out_dims.clone();
        *want.last_mut().expect("rows() checked a last dimension") = inner;
        if da.dims() != want.as_slice() {
            candle_core::bail!("{op}: da {:?} must be {want:?}", da.dims());
        }
    } else {
        *out_dims
            .last_mut()
            .expect("rows() checked a last dimension") = inner;
    }
    let mut args = vec![gu];
    args.extend(da);
    if on_cuda(gu) {
        #[cfg(feature = "cuda")]
        return with_cuda(op, &args, |s| {
            fn run<T: CudaElement>(
                s: &[(&CudaStorage, &Layout)],
                rows: usize,
                inner: usize,
            ) -> Result<CudaStorage> {
                let gu = input::<T>("swiglu_packed", "gu", s[0].0, s[0].1)?;
                let dev = &s[0].0.device;
                let (rows64, inner64) = (rows as u64, inner as u64);
                let cfg = elements_config(rows * inner);
                let y = match s.get(1) {
                    None => {
                        let mut y = output::<T>(dev, rows * inner)?;
                        launch!(dev, BLOCK_KERNELS, "swiglu_packed", T, cfg;
                            &gu, &mut y, &rows64, &inner64);
                        y
                    }
                    Some((sd, ld)) => {
                        let da = input::<T>("swiglu_packed_backward", "da", sd, ld)?;
                        let mut y = output::<T>(dev, rows * 2 * inner)?;
                        launch!(dev, BLOCK_KERNELS, "swiglu_packed_backward", T, cfg;
                            &gu, &da, &mut y, &rows64, &inner64);
                        y
                    }
                };
                Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
            }
            cuda_dispatch!("swiglu_packed", s[0].0, run(s, _rows, inner))
        })
        .map(|s| cuda_tensor(s, out_dims));
    }
    with_cpu(op, &args, |s| {
        fn run<T: Element>(s: &[(&CpuStorage, &Layout)], inner: usize) -> Result<CpuStorage> {
            let gu = contiguous::<T>("swiglu_packed", "gu", s[0].0, s[0].1)?;
            match s.get(1) {
                None => {
                    let mut out = vec![T::from_acc(Zero::zero()); gu.len() / 2];
                    for_each_row(&mut out, inner.max(1), |r, y| {
                        let (g, u) = gu[r * 2 * inner..(r + 1) * 2 * inner].split_at(inner);
                        for ((y, g), u) in y.iter_mut().zip(g).zip(u) {
                            let g = g.to_acc();
                            *y = T::from_acc(g * sigmoid(g) * u.to_acc());
                        }
                    });
                    Ok(T::storage(out))
                }
                Some((sd, ld)) => {
                    let da = contiguous::<T>("swiglu_packed_backward", "da", sd, ld)?;
                    let mut out = vec![T::from_acc(Zero::zero()); gu.len()];
                    for_each_row(&mut out, (2 * inner).max(1), |r, y| {
                        let (g, u) = gu[r * 2 * inner..(r + 1) * 2 * inner].split_at(inner);
                        let d = &da[r * inner..(r + 1) * inner];
                        let (dg, du) = y.split_at_mut(inner);
                        for j in 0..inner {
                            let (g, u, d) = (g[j].to_acc(), u[j].to_acc(), d[j].to_acc());
                            dg[j] = T::from_acc(d * u * silu_slope(g));
                            du[j] = T::from_acc(d * g * sigmoid(g));
                        }
                    });
                    Ok(T::storage(out))
                }
            }
        }
        dispatch!("swiglu_packed", s[0].0, run(s, inner))
    })
    .map(|s| cpu_tensor(s, out_dims))
}

// ---- rotary embeddings on a range of heads, in place ----

/// Rotates heads `first..first + count` of `x` `[B, T, heads, D]` (contiguous, a projection's
/// fresh output) in place by the angles of `cos`, `sin` `[T, D/2]` (in `x`'s dtype), in the
/// convention of [`crate::rotary`]; `inverse` rotates by `−θ`, which is the backward pass.
pub(crate) fn rotary_heads_inplace(
    x: &Tensor,
    first: usize,
    count: usize,
    cos: &Tensor,
    sin: &Tensor,
    inverse: bool,
) -> Result<()> {
    let (_, t, heads, d) = x.dims4()?;
    if !x.is_contiguous() || d % 2 != 0 || first + count > heads {
        candle_core::bail!(
            "rotary_heads: x {:?} must be contiguous with an even head dimension, heads \
             {first}..{} within {heads}",
            x.dims(),
            first + count
        );
    }
    for (what, a) in [("cos", cos), ("sin", sin)] {
        if a.dims() != [t, d / 2] || a.dtype() != x.dtype() || !a.is_contiguous() {
            candle_core::bail!(
                "rotary_heads: {what} must be a contiguous [{t}, {}] {:?} tensor, got {:?} {:?}",
                d / 2,
                x.dtype(),
                a.dims(),
                a.dtype()
            );
        }
    }
    x.inplace_op3(
        cos,
        sin,
        &RotaryHeads {
            first,
            count,
            inverse,
        },
    )
}

struct RotaryHeads {
    first: usize,
    count: usize,
    inverse: bool,
}

impl RotaryHeads {
    /// `(rows, t, heads, half)` of the in-place tensor.
    fn shape(l: &Layout) -> (usize, usize, usize, usize) {
        let d = l.dims();
        (d[0] * d[1], d[1], d[2], d[3] / 2)
    }
}

impl InplaceOp3 for RotaryHeads {
    fn name(&self) -> &'static str {
        "rotary_heads"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        fn run<T: Element>(
            op: &RotaryHeads,
            s1: &mut CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            s3: &CpuStorage,
            l3: &Layout,
        ) -> Result<()> {
            let cos = contiguous::<T>("rotary_heads", "cos", s2, l2)?;
            let sin = contiguous::<T>("rotary_heads", "sin", s3, l3)?;
            let (_, t, heads, h) = RotaryHeads::shape(l1);
            let Some((start, end)) = l1.contiguous_offsets() else {
                candle_core::bail!("rotary_heads: x is not contiguous");
            };
            let x = T::slice_mut(s1).ok_or_else(|| {
                candle_core::Error::Msg("rotary_heads: x and cos dtypes differ".into())
            })?;
            let row = heads * 2 * h;
            for_each_row(&mut x[start..end], row.max(1), |r, xr| {
                let pos = r % t;
                let (c, s) = (&cos[pos * h..(pos + 1) * h], &sin[pos * h..(pos + 1) * h]);
                for head in op.first..op.first + op.count {
                    let v = &mut xr[head * 2 * h..(head + 1) * 2 * h];
                    let (lo, hi) = v.split_at_mut(h);
                    for k in 0..h {
                        let (a, b) = (lo[k].to_acc(), hi[k].to_acc());
                        let cosv = c[k].to_acc();
                        let sinv = if op.inverse {
                            -s[k].to_acc()
                        } else {
                            s[k].to_acc()
                        };
                        lo[k] = T::from_acc(a * cosv - b * sinv);
                        hi[k] = T::from_acc(b * cosv + a * sinv);
                    }
                }
            });
            Ok(())
        }
        dispatch!("rotary_heads", s2, run(self, s1, l1, s2, l2, s3, l3))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        fn run<T: CudaElement>(
            op: &RotaryHeads,
            s1: &mut CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> Result<()> {
            let cos = input::<T>("rotary_heads", "cos", s2, l2)?;
            let sin = input::<T>("rotary_heads", "sin", s3, l3)?;
            let (rows, t, heads, h) = RotaryHeads::shape(l1);
            let Some((start, end)) = l1.contiguous_offsets() else {
                candle_core::bail!("rotary_heads: x is not contiguous");
            };
            let dev = s1.device.clone();
            let mut x = s1.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
            let args = [rows, t, heads, op.first, op.count, h].map(|v| v as u64);
            let inverse = op.inverse as i32;
            launch!(&dev, BLOCK_KERNELS, "rotary_heads", T, elements_config(rows * op.count * h);
                &mut x, &cos, &sin, &args[0], &args[1], &args[2], &args[3], &args[4], &args[5],
                &inverse);
            Ok(())
        }
        cuda_dispatch!("rotary_heads", s2, run(self, s1, l1, s2, l2, s3, l3))
    }
}
