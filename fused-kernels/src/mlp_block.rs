//! The MLP half of a pre-norm transformer block as one trainable candle node:
//! `x + down(act(up(norm(x))))`.
//!
//! GPT-2's (LayerNorm, `c_fc` with a bias, GELU with the tanh approximation, `c_proj` with a bias)
//! and Llama's (RMSNorm, SwiGLU over `gate_proj` and `up_proj` computed as one packed product,
//! `down_proj`) are both this function. The bias before the activation is added inside the
//! activation's kernel, the one after the output projection with the residual, and the residual
//! path's gradient inside the norm's backward kernel.

use candle_core::{DType, Result, Tensor};

use crate::node::{node, Backward, Output};
use crate::norm::Norm;
use crate::projection::{Packed, PackedForward, Projection};

/// The MLP's shape.
#[derive(Debug, Clone)]
pub enum MlpKind {
    /// `proj(gelu(fc(x)))` with GELU's tanh approximation (GPT-2).
    Gelu {
        /// `[inner, width]`.
        fc: Projection,
        /// `[width, inner]`.
        proj: Projection,
    },
    /// `down(silu(gate(x)) · up(x))` (Llama).
    SwiGlu {
        /// `[inner, width]`.
        gate: Projection,
        /// `[inner, width]`.
        up: Projection,
        /// `[width, inner]`.
        down: Projection,
    },
}

/// The parameters of [`mlp_block`].
#[derive(Debug, Clone)]
pub struct Mlp {
    /// The norm of the input.
    pub norm: Norm,
    /// The MLP.
    pub kind: MlpKind,
}

/// `x + mlp(norm(x))` for `x` `[batch, tokens, width]`. One candle node: gradients reach `x` and
/// every parameter candle tracks.
///
/// On the CPU and CUDA devices this is the fused layer; elsewhere (Metal) it is computed with
/// candle's ops, with the same result.
pub fn mlp_block(x: &Tensor, layer: &Mlp) -> Result<Tensor> {
    let op = "mlp_block";
    let (b, t, width) = x.dims3()?;
    layer.check(op, width, x.dtype())?;
    if !crate::element::has_kernel(x) {
        return reference(x, layer);
    }
    let mut inputs = vec![x.clone()];
    let norm_at: Vec<usize> = layer
        .norm
        .parameters()
        .into_iter()
        .map(|p| {
            inputs.push(p.clone());
            inputs.len() - 1
        })
        .collect();
    let (first, second, gelu) = match &layer.kind {
        MlpKind::Gelu { fc, proj } => (
            Packed::register(op, &[fc], &mut inputs)?,
            Packed::register(op, &[proj], &mut inputs)?,
            true,
        ),
        MlpKind::SwiGlu { gate, up, down } => (
            Packed::register(op, &[gate, up], &mut inputs)?,
            Packed::register(op, &[down], &mut inputs)?,
            false,
        ),
    };
    let refs: Vec<&Tensor> = inputs.iter().collect();
    node(op, &refs, |d| {
        let rows = b * t;
        let x = d[0].contiguous()?.reshape((rows, width))?;
        let norm_params: Vec<Tensor> = norm_at.iter().map(|&i| d[i].clone()).collect();
        let h = layer.norm.forward(&x, &norm_params)?;
        // GELU's bias goes into the activation's kernel; SwiGLU's (if any) into the product.
        let (f, first_state) = first.forward(d, &h, !gelu)?;
        let (first_bias, act) = if gelu {
            let bias = first.bias(d)?;
            let act = crate::block_kernels::bias_gelu(&f, bias.as_ref())?;
            (bias, act)
        } else {
            (None, crate::block_kernels::swiglu_packed(&f)?)
        };
        let (z, second_state) = second.forward(d, &act, false)?;
        let output = Output::Residual {
            x: d[0].contiguous()?,
            z: z.reshape((b, t, width))?,
            bias: second.bias(d)?,
        };
        let saved = Saved {
            norm: layer.norm.clone(),
            norm_at: norm_at.clone(),
            first: first.clone(),
            second: second.clone(),
            gelu,
            rows,
            width,
            x,
            h,
            f,
            first_bias,
            first_state,
            act,
            second_state,
        };
        Ok((output, saved))
    })
}

impl Mlp {
    /// Checks the layer against an input of `width` and `dtype`.
    fn check(&self, op: &str, width: usize, dtype: DType) -> Result<()> {
        self.norm.check(op, width, dtype)?;
        let (ins, outs): (Vec<&Projection>, &Projection) = match &self.kind {
            MlpKind::Gelu { fc, proj } => (vec![fc], proj),
            MlpKind::SwiGlu { gate, up, down } => (vec![gate, up], down),
        };
        let mut inner = None;
        for p in &ins {
            let (o, i) = p.dims(op)?;
            if i != width || *inner.get_or_insert(o) != o {
                candle_core::bail!(
                    "{op}: the input projections must be [inner, {width}] alike, got {:?}",
                    p.weight.dims()
                );
            }
        }
        let (o, i) = outs.dims(op)?;
        if o != width || Some(i) != inner {
            candle_core::bail!(
                "{op}: the output projection must be [{width}, {}], got {:?}",
                inner.unwrap_or(0),
                outs.weight.dims()
            );
        }
        let mut all: Vec<&Tensor> = self.norm.parameters();
        for p in ins.into_iter().chain([outs]) {
            all.push(&p.weight);
            all.extend(p.bias.as_ref());
            if let Some(l) = &p.lora {
                all.push(&l.a);
                all.push(&l.b);
            }
        }
        if let Some(t) = all.iter().find(|t| t.dtype() != dtype) {
            candle_core::bail!(
                "{op}: every parameter must have the input's dtype {dtype:?}, got {:?}",
                t.dtype()
            );
        }
        Ok(())
    }
}

/// What the backward pass reads.
struct Saved {
    norm: Norm,
    norm_at: Vec<usize>,
    first: Packed,
    second: Packed,
    gelu: bool,
    rows: usize,
    width: usize,
    /// The input `[rows, width]`.
    x: Tensor,
    /// The normed input.
    h: Tensor,
    /// The first product (GELU: before its bias; SwiGLU: `[gate | up]`).
    f: Tensor,
    first_bias: Option<Tensor>,
    first_state: PackedForward,
    /// The activation, the second product's input.
    act: Tensor,
    second_state: PackedForward,
}

impl Backward for Saved {
    fn backward(&self, d: &[Tensor], grad: &Tensor, wanted: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let mut grads: Vec<Option<Tensor>> = vec![None; d.len()];
        let dz = grad.contiguous()?.reshape((self.rows, self.width))?;
        let d_act = self
            .second
            .backward(d, &self.second_state, &self.act, &dz, wanted, true, &mut grads)?
            .expect("need_dx");
        let df = if self.gelu {
            crate::block_kernels::bias_gelu_backward(&self.f, self.first_bias.as_ref(), &d_act)?
        } else {
            crate::block_kernels::swiglu_packed_backward(&self.f, &d_act)?
        };
        let norm_wanted = self.norm_at.iter().any(|&i| wanted[i]);
        let dh = self.first.backward(
            d,
            &self.first_state,
            &self.h,
            &df,
            wanted,
            wanted[0] || norm_wanted,
            &mut grads,
        )?;
        if let Some(dh) = dh {
            let params: Vec<Tensor> = self.norm_at.iter().map(|&i| d[i].clone()).collect();
            let (dx, dparams) = self.norm.backward(&self.x, &params, &dh, &dz)?;
            for (&i, dp) in self.norm_at.iter().zip(dparams) {
                grads[i] = Some(dp);
            }
            grads[0] = Some(dx.reshape(d[0].shape())?);
        }
        Ok(grads)
    }
}

/// The layer with candle's differentiable ops (devices without the kernels).
fn reference(x: &Tensor, layer: &Mlp) -> Result<Tensor> {
    let h = layer.norm.apply(x)?;
    let project = |p: &Projection, x: &Tensor| p.apply(x);
    let z = match &layer.kind {
        MlpKind::Gelu { fc, proj } => project(proj, &project(fc, &h)?.gelu()?)?,
        MlpKind::SwiGlu { gate, up, down } => {
            project(down, &(project(gate, &h)?.silu()? * project(up, &h)?)?)?
        }
    };
    x + z
}
