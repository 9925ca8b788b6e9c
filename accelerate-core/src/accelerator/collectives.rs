//! Collectives for the loop's own tensors and values: reduce, gather (for metrics too), padding,
//! splitting work between processes and waiting for everyone.

use candle_core::{DType, Device, Tensor};

use super::Accelerator;
use crate::comm::ReduceOp;
use crate::error::Result;

impl Accelerator {
    /// Reduces a tensor over all ranks (a copy; the argument is untouched). Like
    /// [`gather`](Self::gather), any dtype and layout works, on the host or on the accelerator's
    /// device (the result is on the tensor's device). Ranks passing different sizes or dtypes
    /// get an error naming each rank and its tensor, on every rank.
    pub fn reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (wire, original) = wire_dtype(tensor)?;
        let out = if original.is_none() && wire.is_contiguous() {
            wire.copy()?
        } else {
            wire
        };
        self.comm.all_reduce(&out, op)?;
        Ok(match original {
            Some(dtype) => out.to_dtype(dtype)?,
            None => out,
        })
    }

    /// Reduces a tensor over all ranks in place (every rank ends with the result). The tensor
    /// must be contiguous (a view with an offset is fine) and of a dtype the communicators carry
    /// (see [`Communicator`](crate::Communicator)); on the host or on the accelerator's device.
    pub fn reduce_in_place(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.comm.all_reduce(tensor, op)
    }

    /// Reduces one number over all ranks. The tensor is built on the host whatever the device:
    /// the communicator stages it (NCCL through its GPU), and the value is read back on the
    /// host anyway.
    pub(super) fn reduce_scalar(&self, value: f64, op: ReduceOp) -> Result<f64> {
        if self.state.world_size == 1 {
            return Ok(value);
        }
        let t = Tensor::new(&[value], &Device::Cpu)?;
        self.comm.all_reduce(&t, op)?;
        Ok(t.to_vec1::<f64>()?[0])
    }

    /// Concatenates `tensor` of every rank along dimension 0, in rank order. Any dtype and layout
    /// works, on one process as on many, on the host or on the accelerator's device (the result
    /// is on the tensor's device; integer tensors such as `argmax` predictions travel as i64,
    /// half floats as f32, and come back in their own dtype). Ranks passing different shapes get
    /// an error naming each rank's; pad ragged tensors first with
    /// [`pad_across_processes`](Self::pad_across_processes).
    pub fn gather(&self, tensor: &Tensor) -> Result<Tensor> {
        let (wire, original) = wire_dtype(tensor)?;
        let gathered = self.comm.all_gather(&wire)?;
        Ok(match original {
            Some(dtype) => gathered.to_dtype(dtype)?,
            None => gathered,
        })
    }

    /// [`gather`](Self::gather) for evaluation metrics: inside the loop over a prepared loader, at
    /// its last batch, the rows of the wrap-around samples (which complete the last round so that
    /// every rank steps equally) are dropped, so an epoch gathers exactly the dataset's samples.
    /// Pass one row per sample of the current batch, iterating the loader with `iter()`, or with
    /// `windows()` and one [`accumulate`](Self::accumulate) per batch. Once the loop has ended (the
    /// iterator returned its end), nothing is dropped, as in Accelerate: a gather after the loop
    /// (per-rank totals, say) keeps every row.
    pub fn gather_for_metrics(&self, tensor: &Tensor) -> Result<Tensor> {
        let gathered = self.gather(tensor)?;
        let Some(loader) = self.loaders.innermost() else {
            return Ok(gathered);
        };
        if !loader.in_last_batch_of_loop() {
            return Ok(gathered);
        }
        let Some(plan) = loader.plan() else {
            return Ok(gathered);
        };
        let remainder = plan.real_rows_of_last_round();
        let rows = gathered.dim(0)?;
        if remainder < rows {
            Ok(gathered.narrow(0, 0, remainder)?)
        } else {
            Ok(gathered)
        }
    }

    /// Pads `tensor` along `dim` with `value` up to the largest size any rank has there, so that
    /// ragged tensors can be gathered.
    pub fn pad_across_processes(&self, tensor: &Tensor, dim: usize, value: f64) -> Result<Tensor> {
        let size = tensor.dim(dim)?;
        let max = self.reduce_scalar(size as f64, ReduceOp::Max)? as usize;
        if max == size {
            return Ok(tensor.clone());
        }
        let mut pad_shape = tensor.dims().to_vec();
        pad_shape[dim] = max - size;
        let pad = (Tensor::ones(pad_shape, tensor.dtype(), tensor.device())? * value)?;
        Ok(Tensor::cat(&[tensor, &pad], dim)?)
    }

    /// This rank's contiguous share of `items`: the shares are as equal as possible, the first
    /// ranks getting one more when the length does not divide.
    pub fn split_between_processes<'a, T>(&self, items: &'a [T]) -> &'a [T] {
        let (n, r) = (self.state.world_size, self.state.rank);
        let (base, extra) = (items.len() / n, items.len() % n);
        let start = r * base + r.min(extra);
        let len = base + usize::from(r < extra);
        &items[start..start + len]
    }

    /// Runs `f` on the main process first, then on the others (e.g. to download or preprocess
    /// once and read from cache afterwards).
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        if !self.is_main_process() {
            self.wait_for_everyone()?;
        }
        let result = f();
        if self.is_main_process() {
            self.wait_for_everyone()?;
        }
        Ok(result)
    }

    /// For a step done on some ranks only (typically writing a file on the main process): every
    /// rank calls it with its outcome, and all return `Ok` only if every rank succeeded; otherwise
    /// each returns an error naming the rank that failed and why (the failed rank returns its own
    /// error). `path` is what the step wrote, `what` says what it was (`"writing the model"`). It
    /// is a collective: call it on every rank at the same point.
    pub fn agree_across_ranks(
        &self,
        path: &std::path::Path,
        what: &str,
        local: Result<()>,
    ) -> Result<()> {
        crate::checkpoint::agree_with(|t| self.gather(t), self.num_processes(), path, what, local)
    }

    /// Waits until every rank has reached this point.
    pub fn wait_for_everyone(&self) -> Result<()> {
        self.comm.barrier()
    }
}

/// A contiguous tensor of a dtype that reduces without loss or overflow (f32, f64, i64), and the dtype to
/// convert the result back to, if it differs.
fn wire_dtype(tensor: &Tensor) -> Result<(Tensor, Option<DType>)> {
    let wire = match tensor.dtype() {
        DType::F32 | DType::F64 | DType::I64 => None,
        // Every integer travels as i64: exact, and a sum over ranks does not overflow.
        DType::U8 | DType::U32 | DType::I16 | DType::I32 => Some(DType::I64),
        // Half and smaller floats as f32: a metric summed over ranks keeps its precision.
        _ => Some(DType::F32),
    };
    let t = match wire {
        Some(w) => tensor.to_dtype(w)?,
        None => tensor.contiguous()?,
    };
    Ok((t.contiguous()?, wire.map(|_| tensor.dtype())))
}
