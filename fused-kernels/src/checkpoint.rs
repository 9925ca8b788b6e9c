//! Activation checkpointing: run a block without keeping its intermediate tensors, and run it
//! again during the backward pass (PyTorch's `torch.utils.checkpoint`).
//!
//! [`checkpoint`] returns the block's output as a node of candle's ordinary graph, so a plain
//! `loss.backward()` reaches the block's input and every variable the block reads. The graph
//! keeps only the block's input (and the variables themselves, which the model holds anyway):
//!
//! - Forward: the block runs on its input detached (the same storage, outside the graph); its
//!   variables are found in the graph it built (`Tensor::sorted_nodes`), so the caller lists
//!   nothing. The output becomes one node over the input and the variables (the crate's
//!   many-input node: a custom op and a chain of links), and the block's graph is dropped with
//!   every intermediate tensor.
//! - Backward: the node runs the block again on its input made a fresh variable, seeds the
//!   recomputed output with the incoming gradient, and runs a nested `backward()` on that small
//!   graph. The input's gradient is returned to candle directly, each variable's through its
//!   link.
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
use std::sync::Arc;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, Layout, MetalStorage, Result, Shape, Tensor, TensorId, Var,
};

use crate::node::{node, Backward, Output};

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

fn run(x: &Tensor, block: Block, random_state: Option<Arc<dyn RandomState>>) -> Result<Tensor> {
    let before = random_state.as_ref().map(|r| r.snapshot());
    let y = block(&x.detach())?;
    let variables: Vec<Tensor> = y
        .sorted_nodes()
        .into_iter()
        .filter(|n| n.is_variable())
        .cloned()
        .collect();
    let mut inputs = vec![x];
    inputs.extend(&variables);
    // The node copies the output into its storage; the block's intermediate tensors go with `y`
    // right after.
    node("checkpoint", &inputs, |_| {
        Ok((
            Output::Copy(y),
            Recompute {
                block,
                random_state,
                before,
                variables: variables.iter().map(Tensor::id).collect(),
            },
        ))
    })
}

/// The checkpointed block's backward pass: it runs the block again and differentiates it.
struct Recompute {
    block: Block,
    random_state: Option<Arc<dyn RandomState>>,
    /// The random state when the forward pass started.
    before: Option<Box<dyn Any + Send + Sync>>,
    /// The block's variables, in the node's input order after the block's input.
    variables: Vec<TensorId>,
}

impl Backward for Recompute {
    /// Runs the block again on its input (a fresh variable when the input needs a gradient), seeds
    /// the recomputed output with the incoming gradient and runs a nested `backward()`.
    fn backward(
        &self,
        inputs: &[Tensor],
        grad_output: &Tensor,
        wanted: &[bool],
    ) -> Result<Vec<Option<Tensor>>> {
        let input = if wanted[0] {
            Var::from_tensor(&inputs[0])?.as_tensor().clone()
        } else {
            inputs[0].clone()
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
        let mut out = Vec::with_capacity(inputs.len());
        out.push(if wanted[0] {
            // A block whose output does not depend on its input still owes the input a gradient.
            Some(match grads.get(&input) {
                Some(g) => g.clone(),
                None => inputs[0].zeros_like()?,
            })
        } else {
            None
        });
        for &id in &self.variables {
            let Some(g) = grads.get_id(id) else {
                candle_core::bail!(
                    "checkpoint: running the block again did not reach one of its variables; the \
                     block must build the same graph on every call and read the variables it \
                     captures"
                );
            };
            out.push(Some(g.clone()));
        }
        Ok(out)
    }
}

/// A 0-d zero of `s`'s dtype on `s`'s device.
fn scalar_zero<S: BackendStorage<Device = D>, D: BackendDevice<Storage = S>>(
    s: &S,
) -> Result<(S, Shape)> {
    let shape = Shape::from(());
    Ok((s.device().zeros_impl(&shape, s.dtype())?, shape))
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
