//! The communicator of a job with one rank: every collective is the identity.

use std::cell::Cell;

use candle_core::Tensor;

use super::contract::{check_dtype, check_in_place, check_into_output, gathered_dims, IntoOutput};
use super::staging;
use super::{CommStats, Communicator, ReduceOp};
use crate::error::Result;

/// Communicator for a single process. Collectives return at once and send nothing, but are still
/// counted, so code that checks how many all-reduces it issued behaves the same at any world size.
/// Tensors are checked as every backend checks them (dtype, contiguity of in-place tensors), so
/// a program that works alone does not fail only once it runs on several ranks. Any device is
/// the local backend's own: nothing moves.
#[derive(Debug, Default)]
pub struct LocalCommunicator {
    stats: Cell<CommStats>,
}

impl LocalCommunicator {
    /// A communicator for world size 1.
    pub fn new() -> Self {
        Self::default()
    }

    fn count(&self, f: impl FnOnce(&mut CommStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }
}

impl Communicator for LocalCommunicator {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        // Alone, there is nobody to disagree with: no pre-flight agreement.
        self.all_reduce_agreed(tensor, op)
    }

    fn all_reduce_agreed(&self, tensor: &Tensor, _op: ReduceOp) -> Result<()> {
        check_in_place("all_reduce", tensor)?;
        // Sum, mean and max over one rank are all the identity.
        self.count(|s| s.all_reduces += 1);
        Ok(())
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        if root != 0 {
            return Err(crate::Error::Config(format!(
                "broadcast from rank {root} in a job of 1 process; the only rank is 0"
            )));
        }
        check_in_place("broadcast", tensor)?;
        self.count(|s| s.broadcasts += 1);
        Ok(())
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        check_dtype("all_gather", tensor.dtype())?;
        self.count(|s| s.all_gathers += 1);
        // A new tensor, as on every backend (the caller may update its input in place later).
        let copy = if tensor.is_contiguous() {
            tensor.copy()?
        } else {
            tensor.contiguous()?
        };
        Ok(copy.reshape(gathered_dims(tensor.dims(), 1))?)
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_agreed(input, output, op)
    }

    fn reduce_scatter_agreed(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        check_into_output(IntoOutput::ReduceScatter(op), input, output, 1)?;
        // Over one rank the reduction is the identity and the only block is the whole input.
        staging::write_back(output, input)?;
        self.count(|s| s.reduce_scatters += 1);
        Ok(())
    }

    fn all_gather_into(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        self.all_gather_into_agreed(input, output)
    }

    fn all_gather_into_agreed(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        check_into_output(IntoOutput::AllGatherInto, input, output, 1)?;
        staging::write_back(output, input)?;
        self.count(|s| s.all_gathers += 1);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.count(|s| s.barriers += 1);
        Ok(())
    }

    fn stats(&self) -> CommStats {
        self.stats.get()
    }

    fn transport_name(&self) -> &'static str {
        "local"
    }

    fn connect_sibling(
        &self,
        _store: Option<&dyn super::store::Store>,
    ) -> Result<Option<Box<dyn Communicator + Send>>> {
        Ok(Some(Box::new(LocalCommunicator::new())))
    }
}
