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
            f,
            first_bias,
            first_state,
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
    /// The first product (GELU: before its bias; SwiGLU: `[gate | up]`).
    f: Tensor,
    first_bias: Option<Tensor>,
    first_state: PackedForward,
    second_state: PackedForward,
}

impl Backward for Saved {
    fn backward(
        &self,
        d: &[Tensor],
        grad: &Tensor,
        wanted: &[bool],
    ) -> Result<Vec<Option<Tensor>>> {
        let mut grads: Vec<Option<Tensor>> = vec![None; d.len()];
        let dz = grad.contiguous()?.reshape((self.rows, self.width))?;
        let d_act = self
            .second
            .backward(d, &self.second_state, &dz, wanted, true, &mut grads)?
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::projection::Lora;
    use crate::test_reference as r;
    use candle_core::{DType, Var};

    struct Built {
        x: Var,
        layer: Mlp,
        tracked: Vec<(&'static str, Tensor)>,
    }

    /// GPT-2's MLP (LayerNorm, GELU, biases) or Llama's (RMSNorm, SwiGLU, no biases), optionally
    /// with LoRA adapters over a frozen base.
    fn build(gpt: bool, lora: bool, dtype: DType) -> Built {
        let (b, t, width, inner) = (2, 5, 8, 12);
        let x = r::var(&[b, t, width], 1, 1.0, dtype);
        let mut tracked: Vec<(&'static str, Tensor)> = vec![("x", x.as_tensor().clone())];
        let mut param =
            |name: &'static str, shape: &[usize], seed: u64, scale: f64, frozen: bool| {
                let v = r::var(shape, seed, scale, dtype);
                if frozen {
                    v.as_tensor().detach()
                } else {
                    tracked.push((name, v.as_tensor().clone()));
                    v.as_tensor().clone()
                }
            };
        let frozen = lora;
        let norm = if gpt {
            Norm::Layer {
                weight: (param("ln.w", &[width], 2, 0.5, frozen) + 1.0).unwrap(),
                bias: param("ln.b", &[width], 3, 0.1, frozen),
                eps: 1e-5,
            }
        } else {
            Norm::Rms {
                weight: (param("rms.w", &[width], 2, 0.5, frozen) + 1.0).unwrap(),
                eps: 1e-6,
            }
        };
        let kind = if gpt {
            let fc = Projection::new(
                param("fc.w", &[inner, width], 4, 0.5, frozen),
                Some(param("fc.b", &[inner], 5, 0.2, frozen)),
            );
            let mut proj = Projection::new(
                param("proj.w", &[width, inner], 6, 0.4, frozen),
                Some(param("proj.b", &[width], 7, 0.1, frozen)),
            );
            if lora {
                proj.lora = Some(Lora {
                    a: param("proj.a", &[2, inner], 30, 0.5, false),
                    b: param("proj.bb", &[width, 2], 31, 0.5, false),
                    scale: 1.5,
                });
            }
            MlpKind::Gelu { fc, proj }
        } else {
            let mut gate = Projection::new(param("gate.w", &[inner, width], 4, 0.5, frozen), None);
            if lora {
                gate.lora = Some(Lora {
                    a: param("gate.a", &[2, width], 30, 0.5, false),
                    b: param("gate.bb", &[inner, 2], 31, 0.5, false),
                    scale: 0.5,
                });
            }
            MlpKind::SwiGlu {
                gate,
                up: Projection::new(param("up.w", &[inner, width], 5, 0.5, frozen), None),
                down: Projection::new(param("down.w", &[width, inner], 6, 0.4, frozen), None),
            }
        };
        Built {
            x,
            layer: Mlp { norm, kind },
            tracked,
        }
    }

    fn reference_layer(x: &Tensor, l: &Mlp) -> Tensor {
        let h = match &l.norm {
            Norm::Layer { weight, bias, eps } => r::layer_norm(x, weight, bias, *eps).unwrap(),
            Norm::Rms { weight, eps } => r::rms_norm(x, weight, *eps).unwrap(),
        };
        let proj = |p: &Projection, x: &Tensor| {
            r::project(
                x,
                &p.weight,
                p.bias.as_ref(),
                p.lora.as_ref().map(|l| (&l.a, &l.b, l.scale)),
            )
            .unwrap()
        };
        let z = match &l.kind {
            MlpKind::Gelu { fc, proj: p } => proj(p, &r::gelu(&proj(fc, &h)).unwrap()),
            MlpKind::SwiGlu { gate, up, down } => {
                let a = (r::silu(&proj(gate, &h)).unwrap() * proj(up, &h)).unwrap();
                proj(down, &a)
            }
        };
        (x + z).unwrap()
    }

    fn check(gpt: bool, lora: bool, dtype: DType, tol: f64) {
        let built = build(gpt, lora, dtype);
        let x = built.x.as_tensor();
        let fused = mlp_block(x, &built.layer).unwrap();
        let reference = reference_layer(x, &built.layer);
        let tracked: Vec<(&str, &Tensor)> = built.tracked.iter().map(|(n, t)| (*n, t)).collect();
        let what = format!("gpt {gpt}, lora {lora}, {dtype:?}");
        r::assert_same_values_and_gradients(&fused, &reference, &tracked, tol, &what);
    }

    #[test]
    fn gpt_mlp_equals_the_formula_with_every_gradient() {
        check(true, false, DType::F64, 1e-12);
        check(true, false, DType::F32, 1e-5);
    }

    #[test]
    fn llama_swiglu_mlp_equals_the_formula_with_every_gradient() {
        check(false, false, DType::F64, 1e-12);
        check(false, false, DType::F32, 1e-5);
    }

    #[test]
    fn lora_adapters_over_a_frozen_base_get_their_gradients() {
        check(true, true, DType::F64, 1e-12);
        check(false, true, DType::F64, 1e-12);
    }

    #[test]
    fn bf16_is_close_to_the_formula() {
        check(true, false, DType::BF16, 0.05);
        check(false, false, DType::BF16, 0.05);
    }

    #[test]
    fn projections_of_the_wrong_shape_are_refused_naming_them() {
        let mut built = build(false, false, DType::F32);
        if let MlpKind::SwiGlu { up, .. } = &mut built.layer.kind {
            up.weight = up.weight.narrow(0, 0, 4).unwrap();
        }
        let e = mlp_block(built.x.as_tensor(), &built.layer).unwrap_err();
        assert!(e.to_string().contains("input projections"), "{e}");
        let built = build(true, false, DType::F32);
        let e = mlp_block(
            &built.x.as_tensor().to_dtype(DType::F64).unwrap(),
            &built.layer,
        )
        .unwrap_err();
        assert!(e.to_string().contains("dtype"), "{e}");
    }
}
