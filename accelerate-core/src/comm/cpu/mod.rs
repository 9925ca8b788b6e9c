//! The CPU communicator: collectives between the ranks of a job, over shared memory between
//! ranks of one machine and over a TCP ring otherwise.
//!
//! Ranks find each other through the rendezvous [`Store`]. When every rank runs on the same
//! machine (same hostname, boot id, pid and network namespace), they share a mapping in `/dev/shm` and
//! exchange data through it (see `shm`): several times the bandwidth of TCP over loopback.
//! Otherwise each rank keeps one TCP connection to its ring successor and one from its
//! predecessor. [`CpuCommOptions::transport`] (`ACCELERATE_CPU_TRANSPORT`) forces either.
//!
//! Over TCP, all-reduce is the bandwidth-optimal ring (reduce-scatter then all-gather),
//! broadcast a pipelined chain from the root, all-gather the ring all-gather, barrier a
//! one-element-per-rank all-reduce. Data moves in chunks, a sender thread per collective
//! overlapping sends with receives (see `transport`).
//!
//! Every wait is bounded: a peer without any sign of life by [`CpuCommOptions::timeout`], a live
//! but busy one by [`CpuCommOptions::busy_timeout`] (see `comm::liveness`). A peer that closes its
//! connection, dies or goes silent produces an error naming that rank, on every rank (an abort frame relayed
//! around the ring, or an abort record in the shared mapping). After a failure the communicator
//! refuses further collectives: the job has to be restarted, as with NCCL.

mod element;
pub(crate) mod frame;
mod options;
pub(crate) mod rendezvous;
mod ring;
pub(crate) mod shm;
mod transport;

#[cfg(test)]
mod tests;

use std::sync::{Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor};

pub use options::{CpuCommOptions, TransportChoice};

use self::element::Element;
use self::frame::OpCode;
use self::shm::{ShmLinks, ShmSession};
use self::transport::{run_collective, FramePool, RingLinks, RingPosition, Session, Tag};
use super::agreement::{Agree, Collective};
use super::contract::{check_dtype, check_in_place, gathered_dims, unsupported_dtype, IntoOutput};
use super::staging;
use super::store::Store;
use super::{CommStats, Communicator, ReduceOp};
use crate::error::{Error, Result};

/// Collectives between processes (or threads) on one or several machines, over shared memory or
/// TCP (see [`CpuCommunicator::transport`]).
///
/// Collectives from several threads are serialized; as with every backend, all ranks must issue
/// the same collectives in the same order with tensors of the same shape and dtype, and the
/// contract on [`Communicator`] holds: the dtypes it names travel (integer `Mean` truncates
/// toward zero, sums wrap on overflow), tensors on a GPU are staged through the host and updated
/// in place, user-facing collectives are preceded by the pre-flight agreement. Beyond it, the
/// transports check every frame or round against what this rank expects (operation, dtype,
/// sequence number, length), so even [`Communicator::all_reduce_agreed`] with a wrong size ends
/// in a protocol error naming the peer, not in corrupted data.
///
/// Every rank ends an all-reduce with the same bits; the order in which floats are added differs
/// between the transports (ring order over TCP, rank order over shared memory), so the last bits
/// of an inexact float sum may differ between a TCP job and a shared-memory one.
///
/// [`CommStats::bytes_sent`] counts, over TCP, the payload bytes written to the ring connection;
/// over shared memory, the payload bytes this rank copies into its staging slot for the others
/// to read (per all-reduce the whole tensor, per broadcast the tensor on the root only, per
/// all-gather its own block, per reduce-scatter the blocks of the others, nothing for a
/// barrier). A reduce-scatter sends `(W - 1) / W` of its input on either transport.
#[derive(Debug)]
pub struct CpuCommunicator {
    rank: usize,
    world_size: usize,
    options: CpuCommOptions,
    state: Mutex<State>,
}

/// The transport a [`CpuCommunicator`] of several ranks uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// A TCP ring.
    Tcp,
    /// A mapping in `/dev/shm` shared by all ranks (all on this machine).
    Shm,
}

#[derive(Debug)]
struct State {
    link: Link,
    /// Number of collectives run so far; stamped on every frame and round.
    seq: u64,
    stats: CommStats,
    /// Set by the first failed collective.
    broken: Option<Broken>,
}

/// How this rank reaches the others.
#[derive(Debug)]
enum Link {
    /// A world of one rank: nothing to reach.
    Alone,
    /// The TCP ring, with frame buffers reused from one collective to the next.
    Tcp { links: RingLinks, frames: FramePool },
    /// The shared mapping.
    Shm(ShmLinks),
}

/// The running collective's access to the transport, handed to the algorithms.
enum Channel<'s, 'a> {
    Tcp(&'s mut Session<'a>),
    Shm(&'s mut ShmSession<'a>),
}

#[derive(Debug)]
struct Broken {
    peer: Option<usize>,
    cause: String,
}

impl CpuCommunicator {
    /// Joins the job: decides the transport with the other ranks through `store` (shared memory
    /// when all run on this machine, unless `options.transport` says otherwise), then maps the
    /// shared memory or connects the TCP ring (listening on an ephemeral port of
    /// `options.bind_ip`). Every rank of the job must call this with the same `world_size` and
    /// transport choice; `options.timeout` bounds each step of the setup.
    ///
    /// With `world_size == 1` nothing is published, mapped or opened.
    pub fn connect(
        store: &dyn Store,
        rank: usize,
        world_size: usize,
        options: CpuCommOptions,
    ) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::Config(format!(
                "CpuCommunicator::connect with rank {rank} and world size {world_size}; the rank \
                 must be in 0..world_size (check RANK and WORLD_SIZE)"
            )));
        }
        options.validate()?;
        let link = if world_size > 1 {
            let instance = rendezvous::next_instance(store, rank)?;
            match shm::join(store, rank, world_size, instance, &options)? {
                shm::Joined::Shm(links) => Link::Shm(links),
                shm::Joined::Tcp => {
                    let links =
                        rendezvous::connect_ring(store, rank, world_size, instance, &options)?;
                    shm::confirm_tcp(store, rank, instance, &options)?;
                    Link::Tcp {
                        links,
                        frames: FramePool::new(),
                    }
                }
            }
        } else {
            Link::Alone
        };
        Ok(Self::over(link, rank, world_size, options))
    }

    fn over(link: Link, rank: usize, world_size: usize, options: CpuCommOptions) -> Self {
        Self {
            rank,
            world_size,
            options,
            state: Mutex::new(State {
                link,
                seq: 0,
                stats: CommStats::default(),
                broken: None,
            }),
        }
    }

    /// The transport in use; `None` for a world of one rank, which needs none.
    pub fn transport(&self) -> Option<Transport> {
        match self.lock().link {
            Link::Alone => None,
            Link::Tcp { .. } => Some(Transport::Tcp),
            Link::Shm(_) => Some(Transport::Shm),
        }
    }

    /// The options this communicator was created with.
    pub fn options(&self) -> &CpuCommOptions {
        &self.options
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic inside a collective leaves the ring in an unknown state; the `broken` flag set
        // on the way out (or the peers' errors) report it, so poisoning adds nothing.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one collective; `Ok(None)` for a world of one rank (nothing to do).
    fn collective<R>(
        &self,
        op: OpCode,
        dtype: u8,
        chunk_elems: usize,
        count: impl FnOnce(&mut CommStats),
        body: impl FnOnce(Channel<'_, '_>) -> Result<R>,
    ) -> Result<Option<R>> {
        let mut guard = self.lock();
        let state = &mut *guard;
        count(&mut state.stats);
        if let Some(broken) = &state.broken {
            return Err(Error::Collective {
                op: op.name(),
                peer: broken.peer,
                problem: format!(
                    "this communicator failed earlier ({}) and cannot be used again; the job \
                     must be restarted (accelerate-launch --max-restarts does it automatically)",
                    broken.cause
                ),
            });
        }
        if let Link::Alone = state.link {
            return Ok(None);
        }
        state.seq += 1;
        let tag = Tag {
            op,
            dtype,
            seq: state.seq,
        };
        let (result, bytes_sent) = match &mut state.link {
            Link::Alone => unreachable!("handled above"),
            Link::Tcp { links, frames } => {
                let pos = RingPosition {
                    rank: self.rank,
                    world_size: self.world_size,
                    chunk_elems,
                    timeout: self.options.timeout,
                };
                run_collective(links, frames, pos, tag, |s| body(Channel::Tcp(s)))
            }
            Link::Shm(links) => links.run(tag, self.options.timeout, |s| body(Channel::Shm(s))),
        };
        state.stats.bytes_sent += bytes_sent;
        match result {
            Ok(value) => Ok(Some(value)),
            Err(failure) => {
                state.broken = Some(Broken {
                    peer: failure.peer,
                    cause: failure.error.to_string(),
                });
                Err(failure.error)
            }
        }
    }

    fn chunk_elems<T: Element>(&self) -> usize {
        (self.options.chunk_bytes / T::SIZE).max(1)
    }

    fn all_reduce_as<T: Element>(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        let chunk = self.chunk_elems::<T>();
        self.collective(
            OpCode::AllReduce(op),
            T::CODE,
            chunk,
            |s| s.all_reduces += 1,
            |channel| {
                element::with_elements_mut::<T, _>(tensor, |data| match channel {
                    Channel::Tcp(s) => ring::all_reduce(s, data, op),
                    Channel::Shm(s) => shm::all_reduce(s, data, op),
                })
            },
        )?;
        Ok(())
    }

    fn broadcast_as<T: Element>(&self, tensor: &Tensor, root: usize) -> Result<()> {
        let chunk = self.chunk_elems::<T>();
        self.collective(
            OpCode::Broadcast,
            T::CODE,
            chunk,
            |s| s.broadcasts += 1,
            |channel| {
                element::with_elements_mut::<T, _>(tensor, |data| match channel {
                    Channel::Tcp(s) => ring::broadcast(s, data, root),
                    Channel::Shm(s) => shm::broadcast(s, data, root),
                })
            },
        )?;
        Ok(())
    }

    /// All-gather of a contiguous host tensor, tagged `op` on the wire (and so in errors);
    /// `count` records it in the stats.
    fn all_gather_as<T: Element>(
        &self,
        tensor: &Tensor,
        op: OpCode,
        count: impl FnOnce(&mut CommStats),
    ) -> Result<Tensor> {
        let n = tensor.elem_count();
        let mut out = vec![T::default(); n * self.world_size];
        element::read_elements(tensor, &mut out[self.rank * n..(self.rank + 1) * n])?;
        let chunk = self.chunk_elems::<T>();
        self.collective(op, T::CODE, chunk, count, |channel| match channel {
            Channel::Tcp(s) => ring::all_gather(s, &mut out),
            Channel::Shm(s) => shm::all_gather(s, &mut out),
        })?;
        let dims = gathered_dims(tensor.dims(), self.world_size);
        Ok(Tensor::from_vec(out, dims, &Device::Cpu)?)
    }

    /// Reduce-scatter of a contiguous host `input` into a contiguous host `output`, both of
    /// element type `T`, read and written in place.
    fn reduce_scatter_as<T: Element>(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let chunk = self.chunk_elems::<T>();
        self.collective(
            OpCode::ReduceScatter(op),
            T::CODE,
            chunk,
            |s| s.reduce_scatters += 1,
            |channel| {
                element::with_input_and_output::<T, _>(input, output, |input, out| match channel {
                    Channel::Tcp(s) => ring::reduce_scatter(s, input, out, op),
                    Channel::Shm(s) => shm::reduce_scatter(s, input, out, op),
                })
            },
        )?;
        Ok(())
    }

    /// All-gather of a contiguous host `input` into a contiguous host `output`, both of element
    /// type `T`: this rank's block is copied in, then the others gathered around it.
    fn all_gather_into_as<T: Element>(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        let chunk = self.chunk_elems::<T>();
        let r = self.rank;
        self.collective(
            OpCode::AllGatherInto,
            T::CODE,
            chunk,
            |s| s.all_gathers += 1,
            |channel| {
                element::with_input_and_output::<T, _>(input, output, |input, out| {
                    let n = input.len();
                    out[r * n..(r + 1) * n].copy_from_slice(input);
                    match channel {
                        Channel::Tcp(s) => ring::all_gather(s, out),
                        Channel::Shm(s) => shm::all_gather(s, out),
                    }
                })
            },
        )?;
        Ok(())
    }

    /// Runs `kind` on `input` and `output` (already checked against the contract) through the host: a
    /// GPU input is copied over, a GPU output staged and written back.
    fn run_with_output(&self, kind: IntoOutput, input: &Tensor, output: &Tensor) -> Result<()> {
        if self.world_size == 1 {
            // Over one rank both are a copy; counted as every backend counts them.
            staging::write_back(output, input)?;
            let mut state = self.lock();
            match kind {
                IntoOutput::ReduceScatter(_) => state.stats.reduce_scatters += 1,
                IntoOutput::AllGatherInto => state.stats.all_gathers += 1,
            }
            return Ok(());
        }
        let input = if input.device().is_cpu() {
            input.contiguous()?
        } else {
            staging::compact_copy(input, &Device::Cpu)?
        };
        staging::in_place_on(output, &Device::Cpu, |out| {
            macro_rules! by_dtype {
                ($t:ty) => {
                    match kind {
                        IntoOutput::ReduceScatter(op) => {
                            self.reduce_scatter_as::<$t>(&input, out, op)
                        }
                        IntoOutput::AllGatherInto => self.all_gather_into_as::<$t>(&input, out),
                    }
                };
            }
            match input.dtype() {
                DType::F32 => by_dtype!(f32),
                DType::F64 => by_dtype!(f64),
                DType::I64 => by_dtype!(i64),
                DType::BF16 => by_dtype!(half::bf16),
                DType::F16 => by_dtype!(half::f16),
                DType::U32 => by_dtype!(u32),
                DType::U8 => by_dtype!(u8),
                other => Err(unsupported_dtype(kind.name(), other)),
            }
        })
    }

    /// Every device is reachable: a GPU tensor goes through the host (see the contract on
    /// `Communicator`), so nothing to refuse before the agreement.
    fn check_pair_devices(&self, _input: &Tensor, _output: &Tensor, _op: &str) -> Result<()> {
        Ok(())
    }

    /// In-place all-reduce of a contiguous host tensor of a supported dtype.
    fn all_reduce_host(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        match tensor.dtype() {
            DType::F32 => self.all_reduce_as::<f32>(tensor, op),
            DType::F64 => self.all_reduce_as::<f64>(tensor, op),
            DType::I64 => self.all_reduce_as::<i64>(tensor, op),
            DType::BF16 => self.all_reduce_as::<half::bf16>(tensor, op),
            DType::F16 => self.all_reduce_as::<half::f16>(tensor, op),
            DType::U32 => self.all_reduce_as::<u32>(tensor, op),
            DType::U8 => self.all_reduce_as::<u8>(tensor, op),
            other => Err(unsupported_dtype("all_reduce", other)),
        }
    }

    /// In-place broadcast of a contiguous host tensor of a supported dtype.
    fn broadcast_host(&self, tensor: &Tensor, root: usize) -> Result<()> {
        match tensor.dtype() {
            DType::F32 => self.broadcast_as::<f32>(tensor, root),
            DType::F64 => self.broadcast_as::<f64>(tensor, root),
            DType::I64 => self.broadcast_as::<i64>(tensor, root),
            DType::BF16 => self.broadcast_as::<half::bf16>(tensor, root),
            DType::F16 => self.broadcast_as::<half::f16>(tensor, root),
            DType::U32 => self.broadcast_as::<u32>(tensor, root),
            DType::U8 => self.broadcast_as::<u8>(tensor, root),
            other => Err(unsupported_dtype("broadcast", other)),
        }
    }

    /// All-gather of a contiguous host tensor of a supported dtype.
    fn all_gather_host(&self, tensor: &Tensor) -> Result<Tensor> {
        let count = |s: &mut CommStats| s.all_gathers += 1;
        let op = OpCode::AllGather;
        match tensor.dtype() {
            DType::F32 => self.all_gather_as::<f32>(tensor, op, count),
            DType::F64 => self.all_gather_as::<f64>(tensor, op, count),
            DType::I64 => self.all_gather_as::<i64>(tensor, op, count),
            DType::BF16 => self.all_gather_as::<half::bf16>(tensor, op, count),
            DType::F16 => self.all_gather_as::<half::f16>(tensor, op, count),
            DType::U32 => self.all_gather_as::<u32>(tensor, op, count),
            DType::U8 => self.all_gather_as::<u8>(tensor, op, count),
            other => Err(unsupported_dtype("all_gather", other)),
        }
    }
}

impl Agree for CpuCommunicator {
    fn ranks(&self) -> usize {
        self.world_size
    }

    fn gather_signatures(&self, collective: Collective, words: &[i64]) -> Result<Vec<i64>> {
        let mine = Tensor::new(words, &Device::Cpu)?;
        // Tagged as the collective it prepares, so that a peer that never comes is reported as
        // missing from that collective (the one the user called).
        let op = match collective {
            Collective::AllReduce(op) => OpCode::AllReduce(op),
            Collective::Broadcast(_) => OpCode::Broadcast,
            Collective::AllGather => OpCode::AllGather,
            Collective::ReduceScatter(op) => OpCode::ReduceScatter(op),
            Collective::AllGatherInto => OpCode::AllGatherInto,
            Collective::Barrier => OpCode::Barrier,
        };
        let all = self.all_gather_as::<i64>(&mine, op, |s| s.agreements += 1)?;
        Ok(all.to_vec1::<i64>()?)
    }
}

impl Communicator for CpuCommunicator {
    crate::comm::ranked::ranked_methods!();

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        check_in_place("all_reduce", tensor)?;
        self.agree(Collective::AllReduce(op), tensor)?;
        self.all_reduce_agreed(tensor, op)
    }

    fn all_reduce_agreed(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        check_in_place("all_reduce", tensor)?;
        // A tensor on a GPU goes through the host (see the contract on `Communicator`).
        staging::in_place_on(tensor, &Device::Cpu, |host| self.all_reduce_host(host, op))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        if root >= self.world_size {
            return Err(Error::Config(format!(
                "broadcast from rank {root} in a job of {} processes; the root must be in 0..{}",
                self.world_size, self.world_size
            )));
        }
        check_in_place("broadcast", tensor)?;
        self.agree(Collective::Broadcast(root), tensor)?;
        staging::in_place_on(tensor, &Device::Cpu, |host| self.broadcast_host(host, root))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        check_dtype("all_gather", tensor.dtype())?;
        if self.world_size == 1 {
            // Same answer as the local backend: a copy of the tensor.
            self.lock().stats.all_gathers += 1;
            let copy = if tensor.is_contiguous() {
                tensor.copy()?
            } else {
                tensor.contiguous()?
            };
            return Ok(copy.reshape(gathered_dims(tensor.dims(), 1))?);
        }
        self.agree(Collective::AllGather, tensor)?;
        // The input is only read: any layout and device; the result goes back to its device.
        let host = if tensor.device().is_cpu() {
            tensor.contiguous()?
        } else {
            staging::compact_copy(tensor, &Device::Cpu)?
        };
        let gathered = self.all_gather_host(&host)?;
        Ok(gathered.to_device(tensor.device())?)
    }

    fn barrier(&self) -> Result<()> {
        let world = self.world_size as i64;
        self.collective(
            OpCode::Barrier,
            <i64 as Element>::CODE,
            self.chunk_elems::<i64>(),
            |s| s.barriers += 1,
            |channel| match channel {
                // Each rank contributes a 1 per rank; an all-reduce cannot complete anywhere
                // before every rank has contributed, so completing it means everyone arrived.
                Channel::Tcp(s) => {
                    let mut tokens = vec![1i64; self.world_size];
                    ring::all_reduce(s, &mut tokens, ReduceOp::Sum)?;
                    if tokens.iter().any(|&t| t != world) {
                        return Err(Error::Collective {
                            op: "barrier",
                            peer: None,
                            problem: format!(
                                "barrier tokens summed to {tokens:?} instead of {world} each; a \
                                 peer runs an incompatible version"
                            ),
                        });
                    }
                    Ok(())
                }
                Channel::Shm(s) => shm::barrier(s),
            },
        )?;
        Ok(())
    }

    fn stats(&self) -> CommStats {
        self.lock().stats
    }

    fn transport_name(&self) -> &'static str {
        match self.transport() {
            None => "local",
            Some(Transport::Tcp) => "tcp",
            Some(Transport::Shm) => "shm",
        }
    }

    fn connect_sibling(
        &self,
        store: Option<&dyn Store>,
    ) -> Result<Option<Box<dyn Communicator + Send>>> {
        // The same liveness monitor, so that a live peer busy elsewhere is waited for up to the
        // busy limit here too. It reports one collective at a time: a timeout's message may
        // name the other communicator's collective as what this rank was doing.
        let options = self.options.clone();
        let sibling = match store {
            Some(store) => Self::connect(store, self.rank, self.world_size, options)?,
            None if self.world_size == 1 => Self::over(Link::Alone, 0, 1, options),
            None => {
                return Err(Error::Config(
                    "a second communicator among several ranks needs the rendezvous store the \
                     ranks joined through; pass the one the job's membership gives"
                        .into(),
                ))
            }
        };
        Ok(Some(Box::new(sibling)))
    }
}
