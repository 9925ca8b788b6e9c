//! Collective communication between the ranks of a job, and how the ranks find each other: the
//! launcher's plumbing, which a training loop does not need (the `Accelerator` joins the job and
//! owns its communicator).
//!
//! - [`join`] reads this process's place in the job and connects it to the others through the
//!   rendezvous [`Store`] ([`StoreServer`] hosts it, [`TcpStoreClient`] reaches it), returning
//!   a [`Membership`];
//! - [`Communicator`] runs the collectives, one backend per [`Transport`] (chosen by
//!   [`TransportChoice`], tuned by [`CpuCommOptions`]).
//!
//! One trait, [`Communicator`], with one backend per transport: [`LocalCommunicator`] for a single
//! process (every collective is the identity, nothing touches the network). The CPU (TCP and shared
//! memory) and NCCL backends implement the same trait.
//!
//! Collectives work in place on candle tensors, so that a tensor on the backend's own device never
//! goes through another. Every rank must call the same collectives in the same order with tensors
//! of the same shape and dtype, as with torch.distributed; the contract every backend keeps is
//! written on [`Communicator`].

pub(crate) mod agreement;
pub(crate) mod contract;
pub(crate) mod cpu;
pub(crate) mod encoding;
pub(crate) mod host_identity;
pub(crate) mod join;
pub(crate) mod keys;
pub(crate) mod liveness;
mod local;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
mod ranked;
pub(crate) mod staging;
pub(crate) mod store;
#[cfg(test)]
mod wire_properties;

pub use cpu::{CpuCommOptions, CpuCommunicator};
pub use cpu::{Transport, TransportChoice};
pub use join::{join, Membership};
pub use local::LocalCommunicator;
#[cfg(feature = "nccl")]
pub use nccl::NcclCommunicator;
pub use store::{Store, StoreServer, TcpStoreClient};

use candle_core::Tensor;

use crate::error::Result;

/// How the values of the ranks are combined by [`Communicator::all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    /// Elementwise sum over ranks.
    Sum,
    /// Elementwise sum divided by the world size.
    Mean,
    /// Elementwise maximum over ranks.
    Max,
}

/// Reduces one number over all ranks of `comm`. The tensor is built on the host whatever the
/// device: the communicator stages it (NCCL through its GPU), and the value is read back on the
/// host anyway.
pub(crate) fn reduce_scalar(comm: &dyn Communicator, value: f64, op: ReduceOp) -> Result<f64> {
    if comm.world_size() == 1 {
        return Ok(value);
    }
    let t = Tensor::new(&[value], &candle_core::Device::Cpu)?;
    comm.all_reduce(&t, op)?;
    Ok(t.to_vec1::<f64>()?[0])
}

/// Traffic counters of a communicator, cumulative since it was created.
///
/// Tests read them to prove that non-sync micro-steps send nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Number of `all_reduce` calls issued.
    pub all_reduces: u64,
    /// Number of `broadcast` calls issued.
    pub broadcasts: u64,
    /// Number of `all_gather` and `all_gather_into` calls issued.
    pub all_gathers: u64,
    /// Number of `reduce_scatter` calls issued.
    pub reduce_scatters: u64,
    /// Number of `barrier` calls issued.
    pub barriers: u64,
    /// Number of pre-flight agreements run (one per `all_reduce`, `broadcast`, `all_gather`,
    /// `reduce_scatter` and `all_gather_into` of a world of several ranks; see
    /// [`Communicator`]; on NCCL also one per `barrier`, which is how it waits). Their bytes
    /// count in `bytes_sent`.
    pub agreements: u64,
    /// Payload bytes this rank has sent to its peers.
    pub bytes_sent: u64,
}

/// Collectives over the ranks of one job.
///
/// # The contract, the same on every backend
///
/// ([`LocalCommunicator`] for one process, [`CpuCommunicator`] over TCP or shared memory, and
/// `NcclCommunicator` between GPUs.)
///
/// **Devices.** A tensor may be on the host or on the backend's own device (NCCL: this rank's
/// GPU; the CPU backends: the host), whatever the backend:
/// - on the backend's device it is used where it lies, in place, without a copy;
/// - elsewhere it is *staged*: copied to the backend's device, the collective runs on the copy,
///   and the result is copied back into the tensor's own storage. So `all_reduce` and
///   `broadcast` leave the result in the tensor, in place, as they do on the backend's device,
///   and `all_gather` returns its result on the device of its input. NCCL stages host tensors
///   through its GPU (so `Accelerator::reduce` of a host scalar works on GPUs, as Accelerate's
///   users expect); the CPU backends stage GPU tensors through the host. Staging costs two copies
///   and, on a GPU, a synchronization: the runtime's hot path (gradient buckets) keeps its
///   tensors on the backend's device.
/// - NCCL refuses a tensor on a GPU other than this rank's, naming both.
///
/// **Dtypes.** Every backend carries f32, f64, bf16, f16, i64, u32 and u8 (other dtypes are
/// refused with an error naming them and the supported ones). `Sum` of integers wraps on
/// overflow; `Mean` of integers is the sum divided by the world size, truncated toward zero; `Max`
/// is the elementwise maximum. bf16 and f16 sums are rounded to the dtype as they go, so a sum of
/// values whose partial sums are exact in the dtype is exact; the order of additions differs
/// between backends, and a `Mean` of floats may differ in its last bit (NCCL scales each input
/// by 1/world before summing). Every rank ends a reduction with the same bits.
///
/// **Views.** `all_reduce` and `broadcast` work in place, so the tensor must be contiguous; a
/// contiguous view with an offset (e.g. `narrow` of a flat buffer, as a gradient bucket is) is
/// updated exactly over its own elements, its neighbours untouched. A non-contiguous tensor (e.g.
/// a transpose) is refused before any traffic, with a hint to call `.contiguous()` and use the
/// copy. `all_gather` only reads its input, so any layout works; its result is a new contiguous
/// tensor, the inputs concatenated along dimension 0 in rank order (a 0-dimensional input gathers
/// into a vector of `world_size` elements).
///
/// **Empty tensors** are valid everywhere: the agreement runs, nothing moves, and `all_gather`
/// returns an empty tensor of the gathered shape. (CUDA refuses empty allocations, so an empty
/// tensor exists only on the host; NCCL never stages one.)
///
/// **Into preallocated buffers.** [`reduce_scatter`](Self::reduce_scatter) and
/// [`all_gather_into`](Self::all_gather_into) read an `input` and write an `output` the caller
/// allocated (ZeRO's gradient and parameter shards). The blocks are flat, in rank order: a
/// reduce-scatter's input holds `world_size` blocks of `output.elem_count()` elements, an
/// all-gather's output `world_size` blocks of `input.elem_count()`. The input is only read (any
/// layout); the output is written in place, so it must be contiguous (a view with an offset is
/// fine, its neighbours untouched), of the input's dtype, and must not share storage with the
/// input. Other sizes, dtypes or layouts are refused before any data moves, with an error naming
/// both counts and the world size; the agreement compares both tensors' sizes, dtypes and layouts,
/// so ranks that pass different ones all refuse instead of waiting for each other.
///
/// **Agreement.** Every rank must issue the same collectives in the same order. Before moving
/// any data, `all_reduce`, `broadcast` and `all_gather` exchange each rank's signature (the
/// operation, element count, dtype, broadcast root, gathered rows) in one tiny all-gather; when
/// the ranks differ, every rank refuses with the same error naming each rank and what it passed,
/// and the communicator stays usable. [`all_reduce_agreed`](Self::all_reduce_agreed) skips that
/// exchange, for the runtime's gradient buckets, whose sizes every rank agreed on at `prepare`
/// (where the parameters' names, shapes and dtypes are compared across ranks). A collective that
/// one rank never enters is a timeout naming the ranks that were waited for.
pub trait Communicator {
    /// This process's rank, `0..world_size`.
    fn rank(&self) -> usize;

    /// Number of ranks in the job.
    fn world_size(&self) -> usize;

    /// Combines `tensor` over all ranks with `op`, in place; every rank ends with the result.
    /// Runs the pre-flight agreement first (see the contract above).
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()>;

    /// [`all_reduce`](Self::all_reduce) without the pre-flight agreement, for tensors whose
    /// element count and dtype every rank is known to share (the gradient buckets, agreed at
    /// `prepare`). A rank passing another size here is undefined behaviour on NCCL (it reads or
    /// writes past the smaller buffer, or waits forever); on the CPU backends the transports'
    /// frame checks usually turn it into a protocol error naming the peer, but a rank with an
    /// empty tensor returns at once and leaves the others to time out.
    fn all_reduce_agreed(&self, tensor: &Tensor, op: ReduceOp) -> Result<()>;

    /// Overwrites `tensor` on every rank with its value on rank `root`, in place.
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()>;

    /// Concatenates `tensor` of every rank along dimension 0, in rank order. All ranks must pass
    /// the same shape; see `Accelerator::pad_across_processes` for ragged tensors.
    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor>;

    /// Reduces `input` over the ranks with `op` and writes this rank's block of the result into
    /// `output`: `output[j] = op over ranks of input[rank * output.elem_count() + j]`. `input`
    /// holds `world_size` blocks of `output.elem_count()` elements (flattened, rank order) and is
    /// left unchanged. A ring reduce-scatter sends `(world_size - 1) / world_size` of `input` per
    /// rank, half of an all-reduce of it. Runs the pre-flight agreement first.
    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()>;

    /// [`reduce_scatter`](Self::reduce_scatter) without the pre-flight agreement, for sizes every
    /// rank agreed on beforehand (see [`all_reduce_agreed`](Self::all_reduce_agreed) for what a
    /// rank passing another size does).
    fn reduce_scatter_agreed(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()>;

    /// Writes rank `k`'s `input` into block `k` of `output`, on every rank: `output` holds
    /// `world_size` blocks of `input.elem_count()` elements (flattened, rank order). The
    /// preallocated form of [`all_gather`](Self::all_gather). Runs the pre-flight agreement first.
    fn all_gather_into(&self, input: &Tensor, output: &Tensor) -> Result<()>;

    /// [`all_gather_into`](Self::all_gather_into) without the pre-flight agreement, for sizes
    /// every rank agreed on beforehand.
    fn all_gather_into_agreed(&self, input: &Tensor, output: &Tensor) -> Result<()>;

    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;

    /// Traffic counters so far.
    fn stats(&self) -> CommStats;

    /// How the data moves, for logs and bug reports: `local` (a world of one rank), `tcp` (the
    /// TCP ring), `shm` (shared memory inside one machine) or `nccl`.
    fn transport_name(&self) -> &'static str;

    /// Connects a second communicator among the same ranks, with this one's options, whose
    /// collectives run in an order of their own: ZeRO stage 3 gathers the next units on it, from
    /// a thread of their own, while this one serves the training thread. A collective of every
    /// rank (the rendezvous goes through `store`, which a world of several ranks needs).
    /// `Ok(None)` where the backend offers none: NCCL, whose collectives would need a CUDA
    /// stream of their own, ordered with the compute stream by events.
    fn connect_sibling(
        &self,
        store: Option<&dyn store::Store>,
    ) -> Result<Option<Box<dyn Communicator + Send>>> {
        let _ = store;
        Ok(None)
    }
}
