//! The attention half of a pre-norm transformer block as one trainable candle node:
//! `x + out(attention(rotary(qkv(norm(x)))))`.
//!
//! GPT-2's block (LayerNorm, one packed `c_attn` projection with a bias, `c_proj` with a bias)
//! and Llama's (RMSNorm, `q_proj`/`k_proj`/`v_proj` computed as one packed product, rotary
//! embeddings, grouped-query heads, `o_proj`) are both this function. Attention is causal flash
//! attention reading q, k and v where the projection wrote them (no transposed copies, no `T × T`
//! scores). The backward pass computes every gradient in a few kernels and matrix products, and the
//! residual path's gradient is added inside the norm's backward kernel.

use candle_core::{DType, Result, Tensor};

use crate::flash_attention::{fast_on, flash_backward, flash_forward, HeadsView};
use crate::node::{node, Backward, Output};
use crate::norm::Norm;
use crate::projection::{Packed, PackedForward, Projection};

/// How the layer projects the normed input to queries, keys and values.
#[derive(Debug, Clone)]
pub enum Qkv {
    /// One projection whose output holds the query heads, then the key heads, then the value
    /// heads (GPT-2's `c_attn`, `[(heads + 2 · kv_heads) · head_dim, width]`).
    Packed(Projection),
    /// Three projections (Llama's `q_proj`, `k_proj`, `v_proj`), computed as one packed product.
    Separate {
        /// `[heads · head_dim, width]`.
        q: Projection,
        /// `[kv_heads · head_dim, width]`.
        k: Projection,
        /// `[kv_heads · head_dim, width]`.
        v: Projection,
    },
}

/// Rotary position embeddings applied to the queries and keys (see [`crate::rotary`]):
/// `cos` and `sin` `[positions, head_dim / 2]`, in Hugging Face Llama's `rotate_half` convention.
/// Constants: they get no gradient.
#[derive(Debug, Clone)]
pub struct Rotary {
    /// Cosines of position × inverse frequency.
    pub cos: Tensor,
    /// Sines of position × inverse frequency.
    pub sin: Tensor,
}

/// The parameters of [`attention_block`].
#[derive(Debug, Clone)]
pub struct Attention {
    /// The norm of the input.
    pub norm: Norm,
    /// The query, key and value projections.
    pub qkv: Qkv,
    /// The output projection `[width, heads · head_dim]`; its bias, if any, is added with the
    /// residual.
    pub out: Projection,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention); `heads` must be a multiple.
    pub kv_heads: usize,
    /// Rotary embeddings of queries and keys, or none (GPT-2 has learned positions instead).
    pub rotary: Option<Rotary>,
}

/// `x + out(attention(q, k, v))` with `q, k, v` the projections of `norm(x)` (rotated when the
/// layer has rotary embeddings), attention causal with `softmax_scale = 1 / √head_dim`, for `x`
/// `[batch, tokens, width]`. One candle node: gradients reach `x` and every parameter candle
/// tracks.
///
/// On the CPU and CUDA devices this is the fused layer; elsewhere (Metal) it is computed with
/// candle's ops, with the same result.
pub fn attention_block(x: &Tensor, layer: &Attention) -> Result<Tensor> {
    let op = "attention_block";
    let (b, t, width) = x.dims3()?;
    let Shape {
        heads,
        kv_heads,
        head_dim,
    } = layer.shape(op, width, x.dtype())?;
    if let Some(r) = &layer.rotary {
        for (what, table) in [("cos", &r.cos), ("sin", &r.sin)] {
            let (positions, half) = table.dims2()?;
            if positions < t || 2 * half != head_dim {
                candle_core::bail!(
                    "{op}: rotary {what} {:?} must be [positions >= {t}, {}]",
                    table.dims(),
                    head_dim / 2
                );
            }
        }
    }
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
    let qkv = match &layer.qkv {
        Qkv::Packed(p) => Packed::register(op, &[p], &mut inputs)?,
        Qkv::Separate { q, k, v } => Packed::register(op, &[q, k, v], &mut inputs)?,
    };
    let out = Packed::register(op, &[&layer.out], &mut inputs)?;
    let rotary = match &layer.rotary {
        Some(r) => Some((
            r.cos.narrow(0, 0, t)?.to_dtype(x.dtype())?.contiguous()?,
            r.sin.narrow(0, 0, t)?.to_dtype(x.dtype())?.contiguous()?,
        )),
        None => None,
    };
    let geometry = Geometry {
        b,
        t,
        width,
        heads,
        kv_heads,
        head_dim,
    };
    let refs: Vec<&Tensor> = inputs.iter().collect();
    node(op, &refs, |d| {
        let x = d[0].contiguous()?.reshape((b * t, width))?;
        let norm_params: Vec<Tensor> = norm_at.iter().map(|&i| d[i].clone()).collect();
        let h = layer.norm.forward(&x, &norm_params)?;
        let (y, projected) = qkv.forward(d, &h, true)?;
        let total_heads = heads + 2 * kv_heads;
        let packed = y.reshape((b, t, total_heads, head_dim))?;
        if let Some((cos, sin)) = &rotary {
            // Queries and keys are the first heads + kv_heads heads: one launch for both.
            crate::block_kernels::rotary_heads_inplace(
                &packed,
                0,
                heads + kv_heads,
                cos,
                sin,
                false,
            )?;
        }
        let (o, lse) = attention_forward(&packed, &geometry)?;
        let o = o.reshape((b * t, heads * head_dim))?;
        let (z_y, z) = out.forward(d, &o, false)?;
        let output = Output::Residual {
            x: d[0].contiguous()?,
            z: z_y.reshape((b, t, width))?,
            bias: out.bias(d)?,
        };
        let saved = Saved {
            norm: layer.norm.clone(),
            norm_at: norm_at.clone(),
            qkv: qkv.clone(),
            out: out.clone(),
            geometry,
            rotary: rotary.clone(),
            x,
            packed,
            projected,
            o,
            lse,
            z,
        };
        Ok((output, saved))
    })
}

/// The sizes of one call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) width: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
}

struct Shape {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    /// Checks the layer against an input of `width` and `dtype`.
    fn shape(&self, op: &str, width: usize, dtype: DType) -> Result<Shape> {
        let (heads, kv_heads) = (self.heads, self.kv_heads);
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            candle_core::bail!(
                "{op}: heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})"
            );
        }
        self.norm.check(op, width, dtype)?;
        let (out_w, out_in) = self.out.dims(op)?;
        if out_w != width || out_in % heads != 0 {
            candle_core::bail!(
                "{op}: the output projection {:?} must be [{width}, heads · head_dim]",
                self.out.weight.dims()
            );
        }
        let head_dim = out_in / heads;
        let (q, kv) = (heads * head_dim, kv_heads * head_dim);
        let want: Vec<(usize, &Projection)> = match &self.qkv {
            Qkv::Packed(p) => vec![(q + 2 * kv, p)],
            Qkv::Separate { q: pq, k, v } => vec![(q, pq), (kv, k), (kv, v)],
        };
        for (rows, p) in want {
            let (o, i) = p.dims(op)?;
            if o != rows || i != width {
                candle_core::bail!(
                    "{op}: a query/key/value projection is {:?}, expected [{rows}, {width}] for \
                     {heads} heads, {kv_heads} kv heads of {head_dim}",
                    p.weight.dims()
                );
            }
        }
        for t in self.all_tensors() {
            if t.dtype() != dtype {
                candle_core::bail!(
                    "{op}: every parameter must have the input's dtype {dtype:?}, got {:?}",
                    t.dtype()
                );
            }
        }
        Ok(Shape {
            heads,
            kv_heads,
            head_dim,
        })
    }

    fn all_tensors(&self) -> Vec<&Tensor> {
        let mut all = self.norm.parameters();
        let projections: Vec<&Projection> = match &self.qkv {
            Qkv::Packed(p) => vec![p, &self.out],
            Qkv::Separate { q, k, v } => vec![q, k, v, &self.out],
        };
        for p in projections {
            all.push(&p.weight);
            all.extend(p.bias.as_ref());
            if let Some(l) = &p.lora {
                all.push(&l.a);
                all.push(&l.b);
            }
        }
        all
    }
}

/// What the backward pass reads.
struct Saved {
    norm: Norm,
    norm_at: Vec<usize>,
    qkv: Packed,
    out: Packed,
    geometry: Geometry,
    rotary: Option<(Tensor, Tensor)>,
    /// The input `[rows, width]`.
    x: Tensor,
    /// The rotated projections `[b, t, heads + 2 · kv_heads, head_dim]`.
    packed: Tensor,
    projected: PackedForward,
    /// Attention's output `[rows, heads · head_dim]`.
    o: Tensor,
    /// Attention's log-sum-exp per query row.
    lse: Tensor,
    z: PackedForward,
}

impl Backward for Saved {
    fn backward(
        &self,
        d: &[Tensor],
        grad: &Tensor,
        wanted: &[bool],
    ) -> Result<Vec<Option<Tensor>>> {
        let g = self.geometry;
        let rows = g.b * g.t;
        let mut grads: Vec<Option<Tensor>> = vec![None; d.len()];
        let dz = grad.contiguous()?.reshape((rows, g.width))?;
        // The output projection and its bias (added with the residual: its gradient is dz's
        // column sum as well).
        let d_o = self
            .out
            .backward(d, &self.z, &dz, wanted, true, &mut grads)?
            .expect("need_dx");
        let d_o = d_o.reshape((g.b, g.t, g.heads, g.head_dim))?;
        let o = self.o.reshape((g.b, g.t, g.heads, g.head_dim))?;
        let dqkv = attention_backward(&self.packed, &o, &d_o, &self.lse, &g)?;
        if let Some((cos, sin)) = &self.rotary {
            crate::block_kernels::rotary_heads_inplace(
                &dqkv,
                0,
                g.heads + g.kv_heads,
                cos,
                sin,
                true,
            )?;
        }
        let total = (g.heads + 2 * g.kv_heads) * g.head_dim;
        let dqkv = dqkv.reshape((rows, total))?;
        let norm_wanted = self.norm_at.iter().any(|&i| wanted[i]);
        let dh = self.qkv.backward(
            d,
            &self.projected,
            &dqkv,
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

/// The query, key and value heads of the packed projections `[b, t, heads + 2 · kv_heads, d]`,
/// as flash attention reads them: in place.
fn heads(packed: &Tensor, g: &Geometry) -> Result<(HeadsView, HeadsView, HeadsView)> {
    Ok((
        HeadsView::new(&packed.narrow(2, 0, g.heads)?)?,
        HeadsView::new(&packed.narrow(2, g.heads, g.kv_heads)?)?,
        HeadsView::new(&packed.narrow(2, g.heads + g.kv_heads, g.kv_heads)?)?,
    ))
}

/// Causal flash attention over the packed, rotated projections `[b, t, heads + 2 · kv_heads, d]`:
/// the output `[b, t, heads, d]` and the log-sum-exp of every query row `[b, heads, t]`.
fn attention_forward(packed: &Tensor, g: &Geometry) -> Result<(Tensor, Tensor)> {
    if !fast_on(packed, g.head_dim) {
        return crate::attention_reference::forward(packed, g);
    }
    let (q, k, v) = heads(packed, g)?;
    flash_forward(&q, &k, &v, 1.0 / (g.head_dim as f64).sqrt())
}

/// The gradient of the packed projections `[b, t, heads + 2 · kv_heads, d]` for attention's output
/// gradient `d_o` `[b, t, heads, d]`.
fn attention_backward(
    packed: &Tensor,
    o: &Tensor,
    d_o: &Tensor,
    lse: &Tensor,
    g: &Geometry,
) -> Result<Tensor> {
    if !fast_on(packed, g.head_dim) {
        return crate::attention_reference::backward(packed, o, d_o, lse, g);
    }
    let (q, k, v) = heads(packed, g)?;
    flash_backward(&q, &k, &v, o, d_o, lse, 1.0 / (g.head_dim as f64).sqrt())
}

/// The layer with candle's differentiable ops (devices without the kernels).
fn reference(x: &Tensor, layer: &Attention) -> Result<Tensor> {
    let (b, t, _) = x.dims3()?;
    let h = layer.norm.apply(x)?;
    let project = |p: &Projection, x: &Tensor| p.apply(x);
    let (heads, kv) = (layer.heads, layer.kv_heads);
    let hd = layer.out.weight.dim(1)? / heads;
    let (q, k, v) = match &layer.qkv {
        Qkv::Packed(p) => {
            let y = project(p, &h)?;
            (
                y.narrow(2, 0, heads * hd)?,
                y.narrow(2, heads * hd, kv * hd)?,
                y.narrow(2, (heads + kv) * hd, kv * hd)?,
            )
        }
        Qkv::Separate { q, k, v } => (project(q, &h)?, project(k, &h)?, project(v, &h)?),
    };
    let split = |y: Tensor, n: usize| y.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous();
    let (mut q, mut k, v) = (split(q, heads)?, split(k, kv)?, split(v, kv)?);
    if let Some(r) = &layer.rotary {
        let (cos, sin) = (r.cos.narrow(0, 0, t)?, r.sin.narrow(0, 0, t)?);
        q = crate::rotary(&q, &cos, &sin)?;
        k = crate::rotary(&k, &cos, &sin)?;
    }
    let repeat = |x: Tensor| -> Result<Tensor> {
        let groups = heads / kv;
        if groups == 1 {
            return Ok(x);
        }
        x.unsqueeze(2)?
            .broadcast_as((b, kv, groups, t, hd))?
            .reshape((b, heads, t, hd))
    };
    let (k, v) = (repeat(k)?, repeat(v)?);
    let scores = q.matmul(&k.t()?)?;
    let probs = crate::causal_softmax(&scores, 1.0 / (hd as f64).sqrt())?;
    let y = probs
        .matmul(&v)?
        .transpose(1, 2)?
        .reshape((b, t, heads * hd))?;
    x + project(&layer.out, &y)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::projection::Lora;
    use crate::test_reference as r;
    use candle_core::{DType, Var};

    /// Makes one parameter: `(name, shape, seed, scale, frozen)`.
    type Param<'a> = dyn FnMut(&'static str, &[usize], u64, f64, bool) -> Tensor + 'a;

    /// A layer's tensors: `(name, tensor, tracked)`.
    struct Built {
        x: Var,
        layer: Attention,
        tracked: Vec<(&'static str, Tensor)>,
    }

    /// GPT-2's layer (LayerNorm, packed qkv with a bias, output bias) or Llama's (RMSNorm,
    /// separate q/k/v, rotary, grouped-query heads), optionally with LoRA adapters on q and v
    /// over a frozen base.
    fn build(gpt: bool, lora: bool, dtype: DType) -> Built {
        let (b, t, width, heads, kv) = if gpt {
            (2, 5, 8, 2, 2)
        } else {
            (2, 6, 8, 4, 2)
        };
        let hd = width / heads;
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
        let adapter =
            |param: &mut Param<'_>, a: &'static str, bn: &'static str, out: usize, seed: u64| {
                Lora {
                    a: param(a, &[3, width], seed, 0.5, false),
                    b: param(bn, &[out, 3], seed + 1, 0.5, false),
                    scale: 0.75,
                }
            };
        let norm = if gpt {
            Norm::Layer {
                weight: (param("ln.w", &[width], 2, 0.5, frozen) + 1.0).unwrap(),
                bias: param("ln.b", &[width], 3, 0.1, frozen),
                eps: 1e-5,
            }
        } else {
            Norm::Rms {
                weight: (param("rms.w", &[width], 2, 0.5, frozen) + 1.0).unwrap(),
                eps: 1e-5,
            }
        };
        let qkv = if gpt {
            Qkv::Packed(Projection {
                weight: param("c_attn.w", &[(heads + 2 * kv) * hd, width], 4, 0.4, frozen),
                bias: Some(param("c_attn.b", &[(heads + 2 * kv) * hd], 5, 0.1, frozen)),
                lora: lora
                    .then(|| adapter(&mut param, "qkv.a", "qkv.b", (heads + 2 * kv) * hd, 20)),
            })
        } else {
            Qkv::Separate {
                q: Projection {
                    weight: param("q.w", &[heads * hd, width], 4, 0.4, frozen),
                    bias: None,
                    lora: lora.then(|| adapter(&mut param, "q.a", "q.b", heads * hd, 20)),
                },
                k: Projection::new(param("k.w", &[kv * hd, width], 6, 0.4, frozen), None),
                v: Projection {
                    weight: param("v.w", &[kv * hd, width], 7, 0.4, frozen),
                    bias: None,
                    lora: lora.then(|| adapter(&mut param, "v.a", "v.b", kv * hd, 22)),
                },
            }
        };
        let out = Projection {
            weight: param("o.w", &[width, heads * hd], 8, 0.4, frozen),
            bias: gpt.then(|| param("o.b", &[width], 9, 0.1, frozen)),
            lora: None,
        };
        let rotary = (!gpt).then(|| {
            let angles: Vec<f64> = (0..8)
                .flat_map(|p| {
                    (0..hd / 2).map(move |i| p as f64 / 10f64.powf(2.0 * i as f64 / hd as f64))
                })
                .collect();
            let a = Tensor::from_vec(angles, (8, hd / 2), &candle_core::Device::Cpu).unwrap();
            Rotary {
                cos: a.cos().unwrap().to_dtype(dtype).unwrap(),
                sin: a.sin().unwrap().to_dtype(dtype).unwrap(),
            }
        });
        let layer = Attention {
            norm,
            qkv,
            out,
            heads,
            kv_heads: kv,
            rotary,
        };
        Built { x, layer, tracked }
    }

    /// The layer with plain candle ops.
    fn reference_layer(x: &Tensor, l: &Attention) -> Tensor {
        let (b, t, _) = x.dims3().unwrap();
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
        let hd = l.out.weight.dim(1).unwrap() / l.heads;
        let (q, k, v) = match &l.qkv {
            Qkv::Packed(p) => {
                let y = proj(p, &h);
                (
                    y.narrow(2, 0, l.heads * hd).unwrap(),
                    y.narrow(2, l.heads * hd, l.kv_heads * hd).unwrap(),
                    y.narrow(2, (l.heads + l.kv_heads) * hd, l.kv_heads * hd)
                        .unwrap(),
                )
            }
            Qkv::Separate { q, k, v } => (proj(q, &h), proj(k, &h), proj(v, &h)),
        };
        let split = |y: Tensor, n: usize| {
            y.reshape((b, t, n, hd))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (mut q, mut k, v) = (
            split(q, l.heads),
            split(k, l.kv_heads),
            split(v, l.kv_heads),
        );
        if let Some(rot) = &l.rotary {
            let (c, s) = (
                rot.cos.narrow(0, 0, t).unwrap(),
                rot.sin.narrow(0, 0, t).unwrap(),
            );
            q = r::rotary(&q, &c, &s).unwrap();
            k = r::rotary(&k, &c, &s).unwrap();
        }
        let y = r::causal_attention(&q, &k, &v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, t, l.heads * hd))
            .unwrap();
        (x + proj(&l.out, &y)).unwrap()
    }

    /// Values and every tracked tensor's gradient of the fused layer against the reference.
    fn check(gpt: bool, lora: bool, dtype: DType, tol: f64) {
        let built = build(gpt, lora, dtype);
        let x = built.x.as_tensor();
        let fused = attention_block(x, &built.layer).unwrap();
        let reference = reference_layer(x, &built.layer);
        let tracked: Vec<(&str, &Tensor)> = built.tracked.iter().map(|(n, t)| (*n, t)).collect();
        let what = format!("gpt {gpt}, lora {lora}, {dtype:?}");
        r::assert_same_values_and_gradients(&fused, &reference, &tracked, tol, &what);
    }

    #[test]
    fn gpt_attention_equals_the_formula_with_every_gradient() {
        check(true, false, DType::F64, 1e-12);
        check(true, false, DType::F32, 1e-5);
    }

    #[test]
    fn llama_attention_with_rotary_and_grouped_heads_equals_the_formula() {
        check(false, false, DType::F64, 1e-12);
        check(false, false, DType::F32, 1e-5);
    }

    #[test]
    fn lora_adapters_over_a_frozen_base_get_their_gradients_and_the_base_none() {
        check(true, true, DType::F32, 1e-5);
        check(false, true, DType::F32, 1e-5);
        let built = build(false, true, DType::F32);
        let y = attention_block(built.x.as_tensor(), &built.layer).unwrap();
        let grads = y.sum_all().unwrap().backward().unwrap();
        let Qkv::Separate { k, .. } = &built.layer.qkv else {
            unreachable!()
        };
        assert!(
            grads.get(&k.weight).is_none(),
            "a frozen weight got a gradient"
        );
    }

    #[test]
    fn the_materialized_path_equals_flash_attention() {
        // On a GPU, f32, f64 and head dims without tensor-core kernels take the materialized
        // path (cuBLAS products); on the CPU both paths run, so they are compared here.
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let g = Geometry {
                b: 2,
                t: 37,
                width: 72,
                heads: 3,
                kv_heads: 1,
                head_dim: 24,
            };
            let packed = r::var(&[2, 37, 5, 24], 91, 1.0, dtype).as_tensor().detach();
            let d_o = r::var(&[2, 37, 3, 24], 92, 1.0, dtype).as_tensor().detach();
            let (q, k, v) = heads(&packed, &g).unwrap();
            let scale = 1.0 / (24f64).sqrt();
            let (o, lse) = flash_forward(&q, &k, &v, scale).unwrap();
            let (o_m, lse_m) = crate::attention_reference::forward(&packed, &g).unwrap();
            assert!(r::rel_diff(&o_m, &o) < tol, "{dtype:?} o");
            assert!(r::rel_diff(&lse_m, &lse) < tol, "{dtype:?} lse");
            let d = flash_backward(&q, &k, &v, &o, &d_o, &lse, scale).unwrap();
            let d_m = crate::attention_reference::backward(&packed, &o, &d_o, &lse, &g).unwrap();
            assert!(r::rel_diff(&d_m, &d) < tol, "{dtype:?} dqkv");
        }
    }

    #[test]
    fn bf16_is_close_to_f32() {
        check(true, false, DType::BF16, 0.05);
        check(false, false, DType::BF16, 0.05);
    }

    #[test]
    fn a_layer_of_the_wrong_shape_is_refused_naming_it() {
        let mut built = build(true, false, DType::F32);
        built.layer.heads = 3;
        let e = attention_block(built.x.as_tensor(), &built.layer).unwrap_err();
        assert!(e.to_string().contains("multiple of kv_heads"), "{e}");
        let mut built = build(false, false, DType::F32);
        built.layer.out.weight = built.layer.out.weight.narrow(0, 0, 4).unwrap();
        let e = attention_block(built.x.as_tensor(), &built.layer).unwrap_err();
        assert!(e.to_string().contains("output projection"), "{e}");
    }

    #[test]
    fn without_tracked_inputs_the_result_carries_no_graph_and_the_same_values() {
        let built = build(true, false, DType::F32);
        let p = |p: &Projection| Projection {
            weight: p.weight.detach(),
            bias: p.bias.as_ref().map(Tensor::detach),
            lora: None,
        };
        let Qkv::Packed(qkv) = &built.layer.qkv else {
            unreachable!()
        };
        let Norm::Layer { weight, bias, eps } = &built.layer.norm else {
            unreachable!()
        };
        let frozen = Attention {
            norm: Norm::Layer {
                weight: weight.detach(),
                bias: bias.detach(),
                eps: *eps,
            },
            qkv: Qkv::Packed(p(qkv)),
            out: p(&built.layer.out),
            ..built.layer.clone()
        };
        let x = built.x.as_tensor();
        let y = attention_block(&x.detach(), &frozen).unwrap();
        assert!(
            !y.track_op(),
            "a result over untracked inputs is a graph node"
        );
        let tracked = attention_block(x, &built.layer).unwrap();
        assert!(tracked.track_op());
        assert_eq!(r::rel_diff(&y, &tracked), 0.0);
    }
}
