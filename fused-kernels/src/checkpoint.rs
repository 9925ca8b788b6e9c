//! Activation checkpointing: run a block without keeping its intermediate tensors, and run it
//! again during the backward pass (PyTorch's `torch.utils.checkpoint`).
//!
//! [`checkpoint`] returns the block's output as a node of candle's ordinary graph, so a plain
//! `loss.backward()` reaches the block's input and every variable the block reads. The graph
//! keeps only the block's input (and the variables themselves, which the model holds anyway):
//!
//! - Forward: the block runs on its input detached (the same storage, outside the graph); its
//!   variables are found in the graph it built (`Tensor::sorted_nodes`), so the caller lists
//!   nothing. That graph is then dropped with every intermediate tensor, and the output becomes
//!   the result of one custom op over the input and a chain of scalar "link" ops, one per
//!   variable.
//! - Backward: candle reaches the custom op before the links (they are its ancestors). The op
//!   runs the block again on its input made a fresh variable, seeds the recomputed output with
//!   the incoming gradient, and runs a nested `backward()` on that small graph. The input's
//!   gradient is returned to candle directly, each variable's through its link.
//!
//! On the CPU the gradients are bitwise those of the model without checkpointing when the block
//! is a whole unit: its variables are read only inside it (once per checkpointed call) and its
//! input is used only by it. The nested pass then visits the block's nodes in the same relative
//! order and adds the same terms in the same order; each result enters the outer pass as
//! `0 + g`, which is `g` (a sum that starts at `+0` is never `-0`). A variable also read
//! elsewhere (tied weights, or a block checkpointed twice) gets its parts summed in another order:
//! equal within rounding.
//!
//! The block must compute the same function when it runs again. Randomness it draws (dropout)
//! must come from a generator that [`checkpoint_with_random_state`] rewinds to where the forward
//! pass started.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use fused_kernels::checkpoint::checkpoint;
//!
//! let w = Var::ones((4, 4), DType::F32, &Device::Cpu)?;
//! let x = Var::ones((2, 4), DType::F32, &Device::Cpu)?;
//! let block = {
//!     let w = w.as_tensor().clone();
//!     move |x: &Tensor| x + fused_kernels::gelu(&x.matmul(&w)?)?
//! };
//! let y = checkpoint(x.as_tensor(), block)?;
//! let grads = y.sum_all()?.backward()?;
//! assert!(grads.get(w.as_tensor()).is_some() && grads.get(x.as_tensor()).is_some());
//! # Ok::<(), candle_core::Error>(())
//! ```

use std::any::Any;
use std::sync::{Arc, Mutex};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, MetalStorage, Result, Shape,
    Storage, Tensor, TensorId, Var,
};

/// A source of randomness a checkpointed block draws from, which must repeat its draws when the
/// block runs again in the backward pass (dropout masks).
pub trait RandomState: Send + Sync {
    /// The generator's current state.
    fn snapshot(&self) -> Box<dyn Any + Send + Sync>;
    /// Puts the generator back to a state [`RandomState::snapshot`] returned.
    fn restore(&self, state: &(dyn Any + Send + Sync)) -> Result<()>;
}

/// Runs `block(x)` without keeping its intermediate tensors; the backward pass runs it again.
///
/// Gradients reach `x` and every variable `block` reads, as without checkpointing (bitwise on
/// the CPU, under the conditions in the [module docs](self)). `block` must build the same graph
/// each time it runs, read its variables from what it captures (not create them), and draw no
/// randomness: use [`checkpoint_with_random_state`] for a block with dropout.
pub fn checkpoint<F>(x: &Tensor, block: F) -> Result<Tensor>
where
    F: Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
{
    run(x, Arc::new(block), None)
}

/// [`checkpoint`] for a block that draws from `random_state`: the backward pass rewinds it to
/// where this forward pass started before running the block again, and puts it back afterwards,
/// so the recomputed block sees the same masks and later draws are unaffected.
pub fn checkpoint_with_random_state<F>(
    x: &Tensor,
    block: F,
    random_state: Arc<dyn RandomState>,
) -> Result<Tensor>
where
    F: Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
{
    run(x, Arc::new(block), Some(random_state))
}

type Block = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// Gradients of the block's variables, handed from the recomputing op to the links.
type GradientSlots = Arc<Mutex<Vec<Option<Tensor>>>>;

fn run(x: &Tensor, block: Block, random_state: Option<Arc<dyn RandomState>>) -> Result<Tensor> {
    let before = random_state.as_ref().map(|r| r.snapshot());
    let y = block(&x.detach())?;
    let variables: Vec<Tensor> = y
        .sorted_nodes()
        .into_iter()
        .filter(|n| n.is_variable())
        .cloned()
        .collect();
    let output = contiguous_copy(&y)?;
    let shape = y.shape().clone();
    // The block's intermediate tensors go here: nothing below refers to them.
    drop(y);

    let slots: GradientSlots = Arc::new(Mutex::new(vec![None; variables.len()]));
    let mut token = Tensor::zeros((), DType::F32, x.device())?;
    for (index, variable) in variables.iter().enumerate() {
        token = token.apply_op2(
            variable,
            Link {
                index,
                slots: slots.clone(),
            },
        )?;
    }
    x.apply_op2(
        &token,
        Recompute {
            block,
            random_state,
            before,
            variables: variables.iter().map(Tensor::id).collect(),
            slots,
            output: Mutex::new(Some((output, shape))),
        },
    )
}

/// A contiguous copy of `t`'s elements in storage of its own (the bits unchanged). The custom op
/// must return an owned storage, and a tensor's storage cannot be moved out of it: this copy of
/// the block's output is the one extra allocation the forward pass makes.
fn contiguous_copy(t: &Tensor) -> Result<Storage> {
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

/// A 0-d zero of `s`'s dtype on `s`'s device.
fn scalar_zero<S: BackendStorage<Device = D>, D: BackendDevice<Storage = S>>(
    s: &S,
) -> Result<(S, Shape)> {
    let shape = Shape::from(());
    Ok((s.device().zeros_impl(&shape, s.dtype())?, shape))
}

/// The checkpointed block's output (forward) and its recomputation (backward). Its arguments
/// are the block's input and the last link, so the graph holds only those.
struct Recompute {
    block: Block,
    random_state: Option<Arc<dyn RandomState>>,
    /// The random state when the forward pass started.
    before: Option<Box<dyn Any + Send + Sync>>,
    /// The block's variables, in the links' order.
    variables: Vec<TensorId>,
    slots: GradientSlots,
    /// The output computed before the op was applied, taken by the forward once.
    output: Mutex<Option<(Storage, Shape)>>,
}

impl Recompute {
    fn take_output(&self) -> Result<(Storage, Shape)> {
        self.output
            .lock()
            .map_err(|_| candle_core::Error::Msg("checkpoint: a lock was poisoned".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("checkpoint: output taken twice".into()))
    }

    /// Runs the block again on `x` and returns the gradient of `x` (when `x` is tracked), after
    /// putting the variables' gradients in the slots.
    fn gradients(&self, x: &Tensor, grad_output: &Tensor) -> Result<Option<Tensor>> {
        let x_tracked = x.track_op();
        let input = if x_tracked {
            Var::from_tensor(&x.detach())?.as_tensor().clone()
        } else {
            x.detach()
        };
        let y = match (&self.random_state, &self.before) {
            (Some(random_state), Some(before)) => {
                let now = random_state.snapshot();
                random_state.restore(before.as_ref())?;
                let y = (self.block)(&input);
                random_state.restore(now.as_ref())?;
                y?
            }
            _ => (self.block)(&input)?,
        };
        let grads = y
            .apply_op1(SeedGradient {
                gradient: grad_output.clone(),
            })?
            .backward()?;
        let mut slots = self
            .slots
            .lock()
            .map_err(|_| candle_core::Error::Msg("checkpoint: a lock was poisoned".into()))?;
        for (slot, &id) in slots.iter_mut().zip(&self.variables) {
            *slot = grads.get_id(id).cloned();
        }
        if !x_tracked {
            return Ok(None);
        }
        // A block whose output does not depend on its input still owes the input a gradient.
        match grads.get(&input) {
            Some(g) => Ok(Some(g.clone())),
            None => Ok(Some(x.zeros_like()?)),
        }
    }
}

impl CustomOp2 for Recompute {
    fn name(&self) -> &'static str {
        "checkpoint"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match self.take_output()? {
            (Storage::Cpu(s), shape) => Ok((s, shape)),
            _ => candle_core::bail!("checkpoint: the block's output is not on the input's device"),
        }
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        match self.take_output()? {
            (Storage::Cuda(s), shape) => Ok((s, shape)),
            _ => candle_core::bail!("checkpoint: the block's output is not on the input's device"),
        }
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        match self.take_output()? {
            (Storage::Metal(s), shape) => Ok((s, shape)),
            _ => candle_core::bail!("checkpoint: the block's output is not on the input's device"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        token: &Tensor,
        _output: &Tensor,
        grad_output: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_x = self.gradients(x, grad_output)?;
        // Every tracked argument needs a gradient, or candle's backward stops ("grad not
        // populated") when it reaches it.
        let grad_token = if token.track_op() {
            Some(token.zeros_like()?)
        } else {
            None
        };
        Ok((grad_x, grad_token))
    }
}

/// One variable's link to the block: forward a 0-d zero, backward the variable's gradient from
/// the recomputation.
struct Link {
    index: usize,
    slots: GradientSlots,
}

impl CustomOp2 for Link {
    fn name(&self) -> &'static str {
        "checkpoint-link"
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
        token: &Tensor,
        _variable: &Tensor,
        _output: &Tensor,
        _grad_output: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let gradient = self
            .slots
            .lock()
            .map_err(|_| candle_core::Error::Msg("checkpoint: a lock was poisoned".into()))?
            [self.index]
            .take();
        let Some(gradient) = gradient else {
            candle_core::bail!(
                "checkpoint: running the block again did not reach one of its variables; the \
                 block must build the same graph on every call and read the variables it captures"
            );
        };
        let grad_token = if token.track_op() {
            Some(token.zeros_like()?)
        } else {
            None
        };
        Ok((grad_token, Some(gradient)))
    }
}

/// Seeds the nested backward pass: a 0-d result whose backward hands `gradient` to its argument,
/// so the recomputed output's gradient is `0 + gradient` as in the outer pass.
struct SeedGradient {
    gradient: Tensor,
}

impl CustomOp1 for SeedGradient {
    fn name(&self) -> &'static str {
        "checkpoint-seed"
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

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, _grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.gradient.clone()))
    }
}
