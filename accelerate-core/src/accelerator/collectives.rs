//! Collectives for the loop's own tensors and values: reduce, gather (for metrics too), padding,
//! splitting work between processes and waiting for everyone.

use candle_core::{DType, Device, Tensor};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::Accelerator;
use crate::comm::contract::SUPPORTED_DTYPES;
use crate::comm::encoding::{dtype_index, dtype_name, from_cbor, not_encoded, to_cbor, wire_dtype};
use crate::comm::staging::compact_copy;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};

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
    /// (see [`Communicator`](crate::comm::Communicator)); on the host or on the accelerator's device.
    pub fn reduce_in_place(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.comm.all_reduce(tensor, op)
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
        let max =
            crate::comm::reduce_scalar(self.comm.as_ref(), size as f64, ReduceOp::Max)? as usize;
        if max == size {
            return Ok(tensor.clone());
        }
        let mut pad_shape = tensor.dims().to_vec();
        pad_shape[dim] = max - size;
        let pad = (Tensor::ones(pad_shape, tensor.dtype(), tensor.device())? * value)?;
        Ok(Tensor::cat(&[tensor, &pad], dim)?)
    }

    /// This rank's contiguous share of `items` (any slice: prompts, file names, rows): the shares
    /// are as equal as possible, the first ranks getting one more when the length does not
    /// divide, and a rank beyond the items (more ranks than items) gets an empty slice, as
    /// Accelerate's `split_between_processes` cuts them. For shares of equal length see
    /// [`split_between_processes_padded`](Self::split_between_processes_padded).
    pub fn split_between_processes<'a, T>(&self, items: &'a [T]) -> &'a [T] {
        let range = share_of(items.len(), self.state.world_size, self.state.rank);
        &items[range]
    }

    /// This rank's share of `items` as [`split_between_processes`](Self::split_between_processes)
    /// cuts it, padded with the last item of `items` up to the longest share, so that every rank
    /// holds the same number and a [`gather`](Self::gather) of per-item results lines up; drop the
    /// padded results after gathering (Accelerate's `apply_padding=True`, which pads with the
    /// same item). `items` empty gives empty shares.
    pub fn split_between_processes_padded<T: Clone>(&self, items: &[T]) -> Vec<T> {
        let longest = items.len().div_ceil(self.state.world_size);
        let mut share = self.split_between_processes(items).to_vec();
        if let Some(last) = items.last() {
            share.resize(longest, last.clone());
        }
        share
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

    /// Runs `f` on the local main process of each machine first, then on the other processes
    /// of that machine (e.g. to fill a cache on a disk each machine has of its own). The other
    /// processes wait at a barrier of the whole job, as Accelerate's does: they go once every
    /// machine's local main process has finished `f`.
    pub fn local_main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        let first = self.is_local_main_process();
        if !first {
            self.wait_for_everyone()?;
        }
        let result = f();
        if first {
            self.wait_for_everyone()?;
        }
        Ok(result)
    }

    /// Runs `f` on the main process only and returns its result there; `None` on every other
    /// rank (Accelerate's `@on_main_process`, as a closure). Not a collective: nothing waits.
    pub fn on_main_process<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.is_main_process().then(f)
    }

    /// Runs `f` on the local main process of each machine only; `None` elsewhere.
    pub fn on_local_main_process<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.is_local_main_process().then(f)
    }

    /// `tensor` as rank `from` has it, on every rank (Accelerate's `broadcast(tensor,
    /// from_process)`): a new tensor holding exactly the tensor's elements (of a view, only the
    /// view's), not tracked for gradients (its values are rank `from`'s, so no gradient flows
    /// back into the argument, which is untouched). Every rank passes a tensor of the same
    /// shape and dtype (the others' values are ignored); any dtype and layout, on the host or on
    /// the accelerator's device. The tensor travels in its own dtype where the communicators
    /// carry it (see [`Communicator`](crate::comm::Communicator)); i16 and i32 travel as i64, smaller
    /// floats as f32, and come back in their own dtype. Ranks passing different dtypes or sizes
    /// get an error naming each rank's, and a rank that never calls it is a timeout naming it.
    pub fn broadcast(&self, tensor: &Tensor, from: usize) -> Result<Tensor> {
        self.check_root("broadcast", from)?;
        if self.state.world_size > 1 {
            self.check_same_dtype("broadcast", tensor.dtype())?;
        }
        let carried = SUPPORTED_DTYPES.contains(&tensor.dtype());
        // A compact copy: the in-place broadcast must not write into the caller's storage, and a
        // narrow view of a large buffer must not drag the whole buffer along.
        let out = if carried {
            compact_copy(tensor, tensor.device())?
        } else {
            wire_dtype(tensor)?.0
        };
        self.comm.broadcast(&out, from)?;
        let out = if carried {
            out
        } else {
            out.to_dtype(tensor.dtype())?
        };
        Ok(out.detach())
    }

    /// Refuses, on every rank alike, a collective where the ranks passed tensors of different
    /// dtypes: the communicators' own agreement compares the dtype on the wire, which for the
    /// dtypes converted before travelling (i32 as i64, f8 as f32) does not tell them apart.
    fn check_same_dtype(&self, op: &'static str, dtype: DType) -> Result<()> {
        let code = Tensor::new(&[dtype_index(dtype)], &Device::Cpu)?;
        let codes = self.comm.all_gather(&code)?.to_vec1::<i64>()?;
        let Some(peer) = codes.iter().position(|&c| c != codes[0]) else {
            return Ok(());
        };
        let each: Vec<String> = codes
            .iter()
            .enumerate()
            .map(|(rank, &c)| format!("rank {rank}: {}", dtype_name(c)))
            .collect();
        Err(Error::Collective {
            op,
            peer: Some(peer),
            problem: format!(
                "the ranks passed tensors of different dtypes ({}); pass the same dtype on every \
                 rank (convert with to_dtype first). Nothing was exchanged",
                each.join(", ")
            ),
        })
    }

    /// Every rank's `value`, in rank order, on every rank (Accelerate's `gather_object`): any
    /// serde value (CBOR on the wire, which keeps infinities and NaN and takes maps with keys of
    /// any type), of any size per rank. A collective: call it on every rank at the same point.
    /// A rank passing a value of another type, or one that cannot be serialized, makes every
    /// rank return an error naming it.
    pub fn gather_object<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        const OP: &str = "gather_object";
        let encoded = to_cbor(OP, self.state.rank, value);
        // A length of -1 tells the others this rank's value could not be encoded, so that every
        // rank takes part in both collectives and all of them refuse together.
        let my_len = encoded.as_ref().map_or(-1, |bytes| bytes.len() as i64);
        let lengths = self
            .comm
            .all_gather(&Tensor::new(&[my_len], &Device::Cpu)?)?
            .to_vec1::<i64>()?;
        if let Some(failed) = lengths.iter().position(|&l| l < 0) {
            return Err(match encoded {
                Err(own) => own,
                Ok(_) => not_encoded(OP, failed),
            });
        }
        let bytes = encoded?;
        let lengths: Vec<usize> = lengths.into_iter().map(|l| l as usize).collect();
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let mut padded = bytes;
        padded.resize(longest.max(1), 0);
        let rows = Tensor::from_vec(padded, (1, longest.max(1)), &Device::Cpu)?;
        let all = self.comm.all_gather(&rows)?;
        lengths
            .iter()
            .enumerate()
            .map(|(rank, &len)| {
                let row = all.get(rank)?.narrow(0, 0, len)?.to_vec1::<u8>()?;
                from_cbor(OP, rank, &row)
            })
            .collect()
    }

    /// Rank `from`'s `value` on every rank (Accelerate's `broadcast_object_list`, for one
    /// object): any serde value, CBOR on the wire as for
    /// [`gather_object`](Self::gather_object). Every rank passes a value (the others' are
    /// ignored, and dropped); a collective. When rank `from`'s value cannot be serialized, every
    /// rank returns an error naming it.
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        value: T,
        from: usize,
    ) -> Result<T> {
        const OP: &str = "broadcast_object";
        self.check_root(OP, from)?;
        if self.state.world_size == 1 {
            return Ok(value);
        }
        let encoded = if self.state.rank == from {
            to_cbor(OP, from, &value)
        } else {
            Ok(Vec::new())
        };
        // -1: rank `from` could not encode its value; every rank learns it from this broadcast.
        let len = encoded.as_ref().map_or(-1, |bytes| bytes.len() as i64);
        let len = Tensor::new(&[len], &Device::Cpu)?;
        self.comm.broadcast(&len, from)?;
        let len = len.to_vec1::<i64>()?[0];
        if len < 0 {
            return Err(match encoded {
                Err(own) => own,
                Ok(_) => not_encoded(OP, from),
            });
        }
        let len = len as usize;
        let mut padded = encoded?;
        padded.resize(len.max(1), 0);
        let wire = Tensor::from_vec(padded, len.max(1), &Device::Cpu)?;
        self.comm.broadcast(&wire, from)?;
        let received = wire.narrow(0, 0, len)?.to_vec1::<u8>()?;
        from_cbor(OP, from, &received)
    }

    fn check_root(&self, op: &str, from: usize) -> Result<()> {
        if from >= self.state.world_size {
            return Err(Error::Config(format!(
                "{op} from rank {from}, but the job has ranks 0..{}; pass a rank below the \
                 number of processes",
                self.state.world_size
            )));
        }
        Ok(())
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

/// The range of the `rank`-th of `ranks` contiguous shares of `len` items: as equal as possible,
/// the first `len % ranks` one longer (Accelerate's layout).
fn share_of(len: usize, ranks: usize, rank: usize) -> std::ops::Range<usize> {
    let (base, extra) = (len / ranks, len % ranks);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

#[cfg(test)]
mod tests {
    use super::share_of;

    /// Accelerate's layout, written out: 10 items on 3 ranks are 4, 3, 3; 2 items on 3 ranks are
    /// 1, 1, 0.
    #[test]
    fn shares_give_the_first_ranks_one_more() {
        let shares: Vec<_> = (0..3).map(|r| share_of(10, 3, r)).collect();
        assert_eq!(shares, vec![0..4, 4..7, 7..10]);
        let shares: Vec<_> = (0..3).map(|r| share_of(2, 3, r)).collect();
        assert_eq!(shares, vec![0..1, 1..2, 2..2]);
    }
}
