//! The linear projections of the fused layers: `x · Wᵀ (+ b)` in PyTorch's `nn.Linear` layout,
//! with an optional LoRA adapter, and groups of them computed as one packed product (Llama's
//! q/k/v, or gate/up: one matrix product over the concatenated weights instead of three).

use candle_core::{Result, Tensor};

/// A linear projection `x · weightᵀ + bias` (`weight` `[out, in]`, `bias` `[out]`), plus the
/// low-rank update of a LoRA adapter when one is attached. A weight that candle does not track
/// (a plain tensor, e.g. a frozen base model's) gets no gradient, and costs no product for one.
#[derive(Debug, Clone)]
pub struct Projection {
    /// `[out, in]`.
    pub weight: Tensor,
    /// `[out]`, or none.
    pub bias: Option<Tensor>,
    /// A LoRA adapter on this projection, or none.
    pub lora: Option<Lora>,
}

/// A LoRA adapter (Hu et al. 2021, as Hugging Face PEFT computes it): the projection's output
/// gains `scale · (x · aᵀ) · bᵀ`.
#[derive(Debug, Clone)]
pub struct Lora {
    /// `lora_A` `[r, in]`.
    pub a: Tensor,
    /// `lora_B` `[out, r]`.
    pub b: Tensor,
    /// `alpha / r`.
    pub scale: f64,
}

impl Projection {
    /// A projection of `weight` `[out, in]` and an optional `bias` `[out]`, without an adapter.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight,
            bias,
            lora: None,
        }
    }

    /// `x · weightᵀ + bias + update` with candle's differentiable ops, for `x` `[..., in]` (the
    /// fused layers' computation on devices without the kernels).
    pub(crate) fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.broadcast_matmul(&self.weight.t()?)?;
        if let Some(bias) = &self.bias {
            y = y.broadcast_add(bias)?;
        }
        if let Some(l) = &self.lora {
            y = (y + (x.broadcast_matmul(&l.a.t()?)?.broadcast_matmul(&l.b.t()?)? * l.scale)?)?;
        }
        Ok(y)
    }

    /// `(out, in)`, checking the bias and the adapter against them.
    pub(crate) fn dims(&self, op: &str) -> Result<(usize, usize)> {
        let (out, inp) = self.weight.dims2().map_err(|_| {
            candle_core::Error::Msg(format!(
                "{op}: a projection weight must be [out, in], got {:?}",
                self.weight.dims()
            ))
        })?;
        if let Some(b) = &self.bias {
            if b.dims() != [out] {
                candle_core::bail!(
                    "{op}: a bias of a [{out}, {inp}] weight must be [{out}], got {:?}",
                    b.dims()
                );
            }
        }
        if let Some(l) = &self.lora {
            let (r, a_in) = l.a.dims2()?;
            if a_in != inp || l.b.dims() != [out, r] {
                candle_core::bail!(
                    "{op}: a LoRA adapter of a [{out}, {inp}] weight needs a [r, {inp}] and b \
                     [{out}, r], got a {:?} and b {:?}",
                    l.a.dims(),
                    l.b.dims()
                );
            }
        }
        Ok((out, inp))
    }
}

/// Where one projection's tensors sit among a node's inputs.
#[derive(Debug, Clone)]
struct Slots {
    weight: usize,
    bias: Option<usize>,
    /// `(a, b, scale)`.
    lora: Option<(usize, usize, f64)>,
    out: usize,
}

/// A group of projections of one input, computed as one packed product: the outputs side by
/// side, `[rows, Σ out]`, in the group's order.
#[derive(Debug, Clone)]
pub(crate) struct Packed {
    parts: Vec<Slots>,
}

/// What [`Packed::forward`] keeps for the backward pass.
pub(crate) struct PackedForward {
    /// The input `[rows, in]`.
    x: Tensor,
    /// The weights side by side `[Σ out, in]` (the weight itself for one part).
    weight: Tensor,
    /// `x · aᵀ` `[rows, r]` of each part with an adapter.
    lora_x: Vec<Option<Tensor>>,
}

impl Packed {
    /// Registers the tensors of `projections` (one input width) as inputs of a node.
    pub(crate) fn register(
        op: &str,
        projections: &[&Projection],
        inputs: &mut Vec<Tensor>,
    ) -> Result<Self> {
        let mut parts = Vec::with_capacity(projections.len());
        let mut width = None;
        for p in projections {
            let (out, inp) = p.dims(op)?;
            if *width.get_or_insert(inp) != inp {
                candle_core::bail!("{op}: the packed projections read inputs of different widths");
            }
            let mut push = |t: &Tensor| {
                inputs.push(t.clone());
                inputs.len() - 1
            };
            parts.push(Slots {
                weight: push(&p.weight),
                bias: p.bias.as_ref().map(&mut push),
                lora: p.lora.as_ref().map(|l| (push(&l.a), push(&l.b), l.scale)),
                out,
            });
        }
        Ok(Self { parts })
    }

    /// The biases side by side `[Σ out]`, when every part has one; an error when some have one
    /// and others not (a packed bias add needs all of them).
    pub(crate) fn bias(&self, d: &[Tensor]) -> Result<Option<Tensor>> {
        let biases: Vec<&Tensor> = self
            .parts
            .iter()
            .filter_map(|p| p.bias.map(|i| &d[i]))
            .collect();
        if biases.is_empty() {
            return Ok(None);
        }
        if biases.len() != self.parts.len() {
            candle_core::bail!("packed projections: either every part has a bias or none has");
        }
        if biases.len() == 1 {
            return Ok(Some(biases[0].clone()));
        }
        Ok(Some(Tensor::cat(&biases, 0)?))
    }

    /// The packed output `x · Wᵀ` `[rows, Σ out]` of every part side by side, plus each adapter's
    /// update, and what the backward pass needs; the biases are added
    /// when `add_bias` (otherwise the caller adds them in a later fused pass). `x` is `[rows, in]`
    /// contiguous, `d` the node's detached inputs.
    pub(crate) fn forward(
        &self,
        d: &[Tensor],
        x: &Tensor,
        add_bias: bool,
    ) -> Result<(Tensor, PackedForward)> {
        let weight = if self.parts.len() == 1 {
            d[self.parts[0].weight].clone()
        } else {
            let ws: Vec<&Tensor> = self.parts.iter().map(|p| &d[p.weight]).collect();
            Tensor::cat(&ws, 0)?
        };
        // The packed product, then each adapter's update added into its part's columns (so a
        // fresh adapter, whose update is zero, leaves the product bitwise as it is).
        let y = x.matmul(&weight.t()?)?;
        let mut lora_x = vec![None; self.parts.len()];
        let mut col = 0;
        for (i, p) in self.parts.iter().enumerate() {
            if let Some((a, b, scale)) = p.lora {
                let u = x.matmul(&d[a].t()?)?;
                let delta = (u.matmul(&d[b].t()?)? * scale)?;
                crate::block_kernels::add_into_columns(&y, &delta, col)?;
                lora_x[i] = Some(u);
            }
            col += p.out;
        }
        if add_bias {
            if let Some(b) = self.bias(d)? {
                crate::block_kernels::add_bias_inplace(&y, &b)?;
            }
        }
        Ok((
            y,
            PackedForward {
                x: x.clone(),
                weight,
                lora_x,
            },
        ))
    }

    /// The backward pass for the packed output's gradient `dy` `[rows, Σ out]` (contiguous): puts every wanted parameter's gradient into `grads` and returns the
    /// gradient of `x` when `need_dx` (the biases' gradients are the column sums of `dy`, which
    /// is also right when the caller added them in a later pass, as a sum).
    pub(crate) fn backward(
        &self,
        d: &[Tensor],
        saved: &PackedForward,
        dy: &Tensor,
        wanted: &[bool],
        need_dx: bool,
        grads: &mut [Option<Tensor>],
    ) -> Result<Option<Tensor>> {
        let x = &saved.x;
        // Biases: one column sum over the whole packed gradient.
        if self.parts.iter().any(|p| p.bias.is_some_and(|i| wanted[i])) {
            let sums = crate::add_bias::column_sums(dy)?;
            let mut col = 0;
            for p in &self.parts {
                if let Some(i) = p.bias.filter(|&i| wanted[i]) {
                    grads[i] = Some(sums.narrow(0, col, p.out)?);
                }
                col += p.out;
            }
        }
        // Weights: one product when every part wants its weight's gradient.
        let weights_wanted: Vec<bool> = self.parts.iter().map(|p| wanted[p.weight]).collect();
        let mut part_dy: Vec<Option<Tensor>> = vec![None; self.parts.len()];
        let part = |i: usize, col: usize, cache: &mut Vec<Option<Tensor>>| -> Result<Tensor> {
            if self.parts.len() == 1 {
                return Ok(dy.clone());
            }
            if cache[i].is_none() {
                cache[i] = Some(dy.narrow(1, col, self.parts[i].out)?.contiguous()?);
            }
            Ok(cache[i].clone().expect("filled above"))
        };
        if weights_wanted.iter().all(|&w| w) {
            let dw = dy.t()?.matmul(x)?;
            let mut row = 0;
            for p in &self.parts {
                grads[p.weight] = Some(if self.parts.len() == 1 {
                    dw.clone()
                } else {
                    dw.narrow(0, row, p.out)?
                });
                row += p.out;
            }
        } else {
            let mut col = 0;
            for (i, p) in self.parts.iter().enumerate() {
                if wanted[p.weight] {
                    grads[p.weight] = Some(part(i, col, &mut part_dy)?.t()?.matmul(x)?);
                }
                col += p.out;
            }
        }
        let mut dx = if need_dx {
            Some(dy.matmul(&saved.weight)?)
        } else {
            None
        };
        // Adapters.
        let mut col = 0;
        for (i, p) in self.parts.iter().enumerate() {
            if let Some((a, b, scale)) = p.lora {
                let dyi = part(i, col, &mut part_dy)?;
                let u = saved.lora_x[i]
                    .as_ref()
                    .expect("the forward keeps x · aᵀ of every adapter");
                if wanted[b] {
                    grads[b] = Some((dyi.t()?.matmul(u)? * scale)?);
                }
                if wanted[a] || need_dx {
                    let du = (dyi.matmul(&d[b])? * scale)?;
                    if wanted[a] {
                        grads[a] = Some(du.t()?.matmul(x)?);
                    }
                    if let Some(dx) = dx.as_mut() {
                        *dx = (&*dx + du.matmul(&d[a])?)?;
                    }
                }
            }
            col += p.out;
        }
        Ok(dx)
    }
}
