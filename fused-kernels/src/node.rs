//! One candle node over any number of inputs, with a backward pass of our own.
//!
//! candle's custom ops take at most three inputs, and its backward pass creates every node's
//! gradient as zeros and adds into it, once per edge of the graph. A fused layer (a norm, its
//! projections, attention and the residual add) made of candle ops is ~20 nodes and as many
//! zero-then-add passes over activations; made with [`node`] it is one node whose backward computes
//! every input's gradient with a few kernels, and candle adds into each input once.
//!
//! How: the forward pass runs on the inputs *detached* (outside candle's graph) and returns what
//! the backward needs. The node is then a custom op over the first input and a chain of "link" ops,
//! each carrying up to two of the other inputs that need a gradient. candle reaches the node
//! before its links (they are its ancestors), so the node's backward computes all gradients, hands
//! the first input's to candle and leaves the others in slots that the links hand on.
//!
//! The node's own forward computes the output from tensors the forward pass prepared ([`Output`]),
//! so the result is written once into the node's storage, not computed and then copied.

use std::sync::{Arc, Mutex};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, MetalStorage, Result, Shape,
    Storage, Tensor,
};

/// The backward pass of a [`node`].
pub(crate) trait Backward: Send + Sync + 'static {
    /// The gradients of `inputs` (detached, in the order [`node`] was given them) for the
    /// gradient `grad_output` of the node's output: `Some` for every input with `wanted[i]`, each
    /// of that input's shape and dtype; `None` (or anything) for the others.
    fn backward(
        &self,
        inputs: &[Tensor],
        grad_output: &Tensor,
        wanted: &[bool],
    ) -> Result<Vec<Option<Tensor>>>;
}

/// How the node's forward computes its output from tensors the forward pass prepared.
pub(crate) enum Output {
    /// The tensor, copied into the node's storage (one pass over it): the output of a computation
    /// whose last step is not one of the others (a checkpointed block).
    Copy(Tensor),
    /// `x + z`, plus `bias` `[n]` added to every row when given (`x`, `z` `[..., n]`): the
    /// residual add after a layer's output projection.
    Residual {
        /// The residual stream.
        x: Tensor,
        /// The branch.
        z: Tensor,
        /// The output projection's bias.
        bias: Option<Tensor>,
    },
    /// `x · wᵀ`, plus `bias` `[n]` on every row when given, for `x` `[..., k]` and `w` `[n, k]`
    /// (both contiguous), of shape `[..., n]`: a linear layer, its product written straight into
    /// the node's storage.
    Product {
        /// The input rows.
        x: Tensor,
        /// The weight, `nn.Linear`'s layout.
        w: Tensor,
        /// The bias.
        bias: Option<Tensor>,
    },
}

impl Output {
    fn shape(&self) -> Result<Shape> {
        Ok(match self {
            Output::Copy(t) => t.shape().clone(),
            Output::Residual { x, .. } => x.shape().clone(),
            Output::Product { x, w, .. } => {
                let mut dims = x.dims().to_vec();
                *dims.last_mut().ok_or_else(|| {
                    candle_core::Error::Msg("node: a product's input is a scalar".into())
                })? = w.dim(0)?;
                Shape::from(dims)
            }
        })
    }
}

/// Makes one candle node over `inputs` (any number, any of them tracked or not): `forward` runs
/// on the inputs detached and returns the output (see [`Output`]) and the [`Backward`] that
/// computes the inputs' gradients. Inputs that candle does not track (plain tensors, frozen
/// weights) are not part of the graph and are not asked for a gradient.
///
/// Without any tracked input the output is returned as a plain tensor.
pub(crate) fn node<B: Backward>(
    name: &'static str,
    inputs: &[&Tensor],
    forward: impl FnOnce(&[Tensor]) -> Result<(Output, B)>,
) -> Result<Tensor> {
    let Some(first) = inputs.first() else {
        candle_core::bail!("{name}: a node needs at least one input");
    };
    let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let wanted: Vec<bool> = inputs.iter().map(|t| t.track_op()).collect();
    let (output, backward) = forward(&detached)?;
    if !wanted.iter().any(|&w| w) {
        return realize(output);
    }
    let linked: Vec<usize> = (1..inputs.len()).filter(|&i| wanted[i]).collect();
    let slots: Slots = Arc::new(Mutex::new(vec![None; inputs.len()]));
    let main = Main {
        name,
        inputs: detached,
        wanted,
        linked: linked.clone(),
        slots: slots.clone(),
        output: Mutex::new(Some(output)),
        backward,
    };
    // The chain: the first link carries one or two inputs and no token; each further link the
    // token of the previous one and one or two inputs.
    let mut token: Option<Tensor> = None;
    for pair in linked.chunks(2) {
        let link = Link {
            indices: pair.to_vec(),
            slots: slots.clone(),
        };
        token = Some(match (&token, pair) {
            (None, [a]) => inputs[*a].apply_op1(link)?,
            (None, [a, b]) => inputs[*a].apply_op2(inputs[*b], link)?,
            (Some(t), [a]) => t.apply_op2(inputs[*a], link)?,
            (Some(t), [a, b]) => t.apply_op3(inputs[*a], inputs[*b], link)?,
            _ => unreachable!("chunks(2) yields one or two indices"),
        });
    }
    match token {
        None => first.apply_op1(main),
        Some(token) => first.apply_op2(&token, main),
    }
}

/// Gradients of the linked inputs, by input index, handed from the node to its links.
type Slots = Arc<Mutex<Vec<Option<Tensor>>>>;

fn lock<'a>(
    slots: &'a Slots,
    name: &str,
) -> Result<std::sync::MutexGuard<'a, Vec<Option<Tensor>>>> {
    slots
        .lock()
        .map_err(|_| candle_core::Error::Msg(format!("{name}: a lock was poisoned")))
}

/// `output` as a plain tensor (no graph).
fn realize(output: Output) -> Result<Tensor> {
    // The same kernels as the node's forward, so a result does not depend on whether anything
    // was tracked.
    let device = match &output {
        Output::Copy(t) => return Ok(t.clone()),
        Output::Residual { x, .. } | Output::Product { x, .. } => x.device().clone(),
    };
    let shape = output.shape()?;
    match device {
        candle_core::Device::Cpu => Ok(crate::raw::cpu_tensor(cpu_output(output)?.0, shape)),
        candle_core::Device::Cuda(_) => Ok(crate::raw::wrap(
            Storage::Cuda(cuda_output(output)?.0),
            shape,
        )),
        candle_core::Device::Metal(_) => match output {
            Output::Residual { x, z, bias } => {
                let y = (x + z)?;
                match bias {
                    Some(b) => y.broadcast_add(&b),
                    None => Ok(y),
                }
            }
            Output::Product { x, w, bias } => {
                let y = x.broadcast_matmul(&w.t()?)?;
                match bias {
                    Some(b) => y.broadcast_add(&b),
                    None => Ok(y),
                }
            }
            Output::Copy(t) => Ok(t),
        },
    }
}

/// The storages and layouts of a [`Output::Product`]'s operands, the weight seen transposed,
/// and `(1, m, n, k)`, for the backend's matrix product.
macro_rules! product {
    ($variant:ident, $x:expr, $w:expr, $bias:expr, $add:ident, $shape:expr) => {{
        let (n, k) = $w.dims2()?;
        let m = $x.elem_count() / k.max(1);
        let x = $x.reshape((m, k))?;
        let wt = $w.t()?;
        let (sx, lx) = x.storage_and_layout();
        let (sw, lw) = wt.storage_and_layout();
        let (Storage::$variant(sx), Storage::$variant(sw)) = (&*sx, &*sw) else {
            candle_core::bail!("node: a product's operands are not on one device");
        };
        let mut y = sx.matmul(sw, (1, m, n, k), lx, lw)?;
        if let Some(b) = $bias {
            let (sb, lb) = b.storage_and_layout();
            let Storage::$variant(sb) = &*sb else {
                candle_core::bail!("node: a product's bias is not on its device");
            };
            crate::block_kernels::$add(&mut y, &Layout::contiguous((m, n)), sb, lb)?;
        }
        Ok((y, $shape))
    }};
}

/// The node itself: its forward writes the output, its backward runs [`Backward`].
struct Main<B> {
    name: &'static str,
    inputs: Vec<Tensor>,
    wanted: Vec<bool>,
    /// The inputs carried by links, in chain order.
    linked: Vec<usize>,
    slots: Slots,
    /// Taken by the forward, once.
    output: Mutex<Option<Output>>,
    backward: B,
}

impl<B: Backward> Main<B> {
    fn take_output(&self) -> Result<Output> {
        self.output
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{}: a lock was poisoned", self.name)))?
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg(format!("{}: the node's forward ran twice", self.name))
            })
    }

    /// Runs the backward pass, checks what it returned, keeps the linked inputs' gradients in
    /// the slots and returns the first input's.
    fn gradients(&self, grad_output: &Tensor) -> Result<Option<Tensor>> {
        let mut grads = self
            .backward
            .backward(&self.inputs, grad_output, &self.wanted)?;
        if grads.len() != self.inputs.len() {
            candle_core::bail!(
                "{}: the backward pass returned {} gradients for {} inputs",
                self.name,
                grads.len(),
                self.inputs.len()
            );
        }
        for (i, (g, input)) in grads.iter().zip(&self.inputs).enumerate() {
            if !self.wanted[i] {
                continue;
            }
            match g {
                None => candle_core::bail!(
                    "{}: the backward pass returned no gradient for input {i}",
                    self.name
                ),
                Some(g) if g.dims() != input.dims() || g.dtype() != input.dtype() => {
                    candle_core::bail!(
                        "{}: the gradient of input {i} is {:?} {:?}, the input {:?} {:?}",
                        self.name,
                        g.dims(),
                        g.dtype(),
                        input.dims(),
                        input.dtype()
                    )
                }
                Some(_) => {}
            }
        }
        let mut slots = lock(&self.slots, self.name)?;
        for &i in &self.linked {
            slots[i] = grads[i].take();
        }
        Ok(if self.wanted[0] {
            grads[0].take()
        } else {
            None
        })
    }
}

/// A contiguous copy of `t`'s elements in storage of its own (the bits unchanged): a custom op
/// must return an owned storage, and a tensor's storage cannot be moved out of it.
fn copy_of(t: &Tensor) -> Result<Storage> {
    fn copy<S: BackendStorage<Device = D>, D: BackendDevice<Storage = S>>(
        s: &S,
        layout: &Layout,
    ) -> Result<S> {
        // SAFETY: `copy_strided_src` writes every element of the new storage.
        let mut dst = unsafe { s.device().alloc_uninit(layout.shape(), s.dtype())? };
        s.copy_strided_src(&mut dst, 0, layout)?;
        Ok(dst)
    }
    let (storage, layout) = t.storage_and_layout();
    Ok(match &*storage {
        Storage::Cpu(s) => Storage::Cpu(copy(s, layout)?),
        Storage::Cuda(s) => Storage::Cuda(copy(s, layout)?),
        Storage::Metal(s) => Storage::Metal(copy(s, layout)?),
    })
}

fn wrong_device() -> candle_core::Error {
    candle_core::Error::Msg("node: the output is not on the device of the inputs".into())
}

/// The output on the CPU.
fn cpu_output(output: Output) -> Result<(CpuStorage, Shape)> {
    let shape = output.shape()?;
    match output {
        Output::Copy(t) => match copy_of(&t)? {
            Storage::Cpu(s) => Ok((s, shape)),
            _ => Err(wrong_device()),
        },
        Output::Residual { x, z, bias } => crate::residual::cpu(&x, &z, bias.as_ref()),
        Output::Product { x, w, bias } => product!(Cpu, x, w, bias.as_ref(), add_bias_cpu, shape),
    }
}

/// The output on a CUDA device.
#[cfg(feature = "cuda")]
fn cuda_output(output: Output) -> Result<(CudaStorage, Shape)> {
    let shape = output.shape()?;
    match output {
        Output::Copy(t) => match copy_of(&t)? {
            Storage::Cuda(s) => Ok((s, shape)),
            _ => Err(wrong_device()),
        },
        Output::Residual { x, z, bias } => crate::residual::cuda(&x, &z, bias.as_ref()),
        Output::Product { x, w, bias } => product!(Cuda, x, w, bias.as_ref(), add_bias_cuda, shape),
    }
}

/// The output on a CUDA device without the kernels: only a copy.
#[cfg(not(feature = "cuda"))]
fn cuda_output(output: Output) -> Result<(CudaStorage, Shape)> {
    let shape = output.shape()?;
    match output {
        Output::Copy(t) => match copy_of(&t)? {
            Storage::Cuda(s) => Ok((s, shape)),
            _ => Err(wrong_device()),
        },
        _ => candle_core::bail!("node: CUDA kernels need fused-kernels' `cuda` feature"),
    }
}

/// The output on a Metal device: only a copy (the fused layers fall back to candle's ops there).
fn metal_output(output: Output) -> Result<(MetalStorage, Shape)> {
    let shape = output.shape()?;
    match output {
        Output::Copy(t) => match copy_of(&t)? {
            Storage::Metal(s) => Ok((s, shape)),
            _ => Err(wrong_device()),
        },
        _ => candle_core::bail!("node: no Metal kernels; the public functions fall back"),
    }
}

impl<B: Backward> CustomOp1 for Main<B> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_output(self.take_output()?)
    }

    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda_output(self.take_output()?)
    }

    fn metal_fwd(&self, _: &MetalStorage, _: &Layout) -> Result<(MetalStorage, Shape)> {
        metal_output(self.take_output()?)
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        self.gradients(grad_res)
    }
}

impl<B: Backward> CustomOp2 for Main<B> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_output(self.take_output()?)
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        cuda_output(self.take_output()?)
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        metal_output(self.take_output()?)
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        token: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let first = self.gradients(grad_res)?;
        // The token is tracked (its links carry tracked inputs) and candle's backward needs a
        // gradient for every tracked node it reaches.
        Ok((first, Some(token.zeros_like()?)))
    }
}

/// A link of the chain: forward a 0-d zero, backward its inputs' gradients from the slots (and a
/// zero for the previous link's token).
struct Link {
    /// The input indices it carries (one or two), in argument order after the token.
    indices: Vec<usize>,
    slots: Slots,
}

impl Link {
    fn take(&self, k: usize) -> Result<Tensor> {
        let index = self.indices[k];
        lock(&self.slots, "node-link")?[index]
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg(format!(
                "node-link: no gradient was left for input {index} (the node's backward did not \
                 run before its link, or ran for another graph)"
            ))
            })
    }
}

/// A 0-d zero of `s`'s dtype on `s`'s device.
fn scalar_zero<S: BackendStorage<Device = D>, D: BackendDevice<Storage = S>>(
    s: &S,
) -> Result<(S, Shape)> {
    let shape = Shape::from(());
    Ok((s.device().zeros_impl(&shape, s.dtype())?, shape))
}

impl CustomOp1 for Link {
    fn name(&self) -> &'static str {
        "node-link"
    }
    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        scalar_zero(s)
    }
    fn cuda_fwd(&self, s: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        scalar_zero(s)
    }
    fn metal_fwd(&self, s: &MetalStorage, _: &Layout) -> Result<(MetalStorage, Shape)> {
        scalar_zero(s)
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.take(0)?))
    }
}

impl CustomOp2 for Link {
    fn name(&self) -> &'static str {
        "node-link"
    }
    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        scalar_zero(s)
    }
    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        scalar_zero(s)
    }
    fn metal_fwd(
        &self,
        s: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        scalar_zero(s)
    }
    fn bwd(
        &self,
        first: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if self.indices.len() == 2 {
            // The first link: both arguments are inputs.
            Ok((Some(self.take(0)?), Some(self.take(1)?)))
        } else {
            // (token, input)
            Ok((Some(first.zeros_like()?), Some(self.take(0)?)))
        }
    }
}

impl CustomOp3 for Link {
    fn name(&self) -> &'static str {
        "node-link"
    }
    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        scalar_zero(s)
    }
    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        scalar_zero(s)
    }
    fn metal_fwd(
        &self,
        s: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        scalar_zero(s)
    }
    fn bwd(
        &self,
        token: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((
            Some(token.zeros_like()?),
            Some(self.take(0)?),
            Some(self.take(1)?),
        ))
    }
}
