//! Kernels outside candle's graph: the pieces the fused layers' forward and backward passes are
//! made of. They read any number of tensors' storage and return any number of new tensors, which a
//! custom op (three inputs, one output) cannot; the results carry no graph, as everything computed
//! inside a node's backward must.

use candle_core::op::BackpropOp;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, Device, Layout, Result, Shape, Storage, Tensor};

/// A new tensor over `storage` (contiguous, of `shape`), outside candle's graph.
pub(crate) fn wrap(storage: Storage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// A CPU result as a tensor.
pub(crate) fn cpu_tensor(storage: CpuStorage, shape: impl Into<Shape>) -> Tensor {
    wrap(Storage::Cpu(storage), shape)
}

/// A CUDA result as a tensor.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_tensor(storage: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    wrap(Storage::Cuda(storage), shape)
}

/// Calls `f` with the CPU storage and layout of each of `tensors` (in order), or fails naming
/// `op` when one is not on the CPU.
pub(crate) fn with_cpu<R>(
    op: &str,
    tensors: &[&Tensor],
    f: impl FnOnce(&[(&CpuStorage, &Layout)]) -> Result<R>,
) -> Result<R> {
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let mut refs = Vec::with_capacity(guards.len());
    for (i, (s, l)) in guards.iter().enumerate() {
        match &**s {
            Storage::Cpu(s) => refs.push((s, *l)),
            _ => candle_core::bail!("{op}: input {i} is not on the CPU like the first"),
        }
    }
    f(&refs)
}

/// Calls `f` with the CUDA storage and layout of each of `tensors` (in order), or fails naming
/// `op` when one is not on a CUDA device.
#[cfg(feature = "cuda")]
pub(crate) fn with_cuda<R>(
    op: &str,
    tensors: &[&Tensor],
    f: impl FnOnce(&[(&CudaStorage, &Layout)]) -> Result<R>,
) -> Result<R> {
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let mut refs = Vec::with_capacity(guards.len());
    for (i, (s, l)) in guards.iter().enumerate() {
        match &**s {
            Storage::Cuda(s) => refs.push((s, *l)),
            _ => candle_core::bail!("{op}: input {i} is not on the CUDA device like the first"),
        }
    }
    f(&refs)
}

/// Whether `t` lives on a CUDA device (the kernels' other home besides the CPU).
pub(crate) fn on_cuda(t: &Tensor) -> bool {
    matches!(t.device(), Device::Cuda(_))
}
