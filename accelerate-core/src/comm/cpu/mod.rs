//! The CPU communicator: ring collectives over TCP between the ranks of a job.
//!
//! Ranks find each other through the rendezvous [`Store`], then each keeps one connection to its
//! ring successor and one from its predecessor. All-reduce is the
//! bandwidth-optimal ring (reduce-scatter then all-gather), broadcast a pipelined chain from the
//! root, all-gather the ring all-gather, barrier a one-element-per-rank all-reduce. Data moves in
//! chunks, a sender thread per collective overlapping sends with receives (see `transport`).
//!
//! Every wait is bounded by [`CpuCommOptions::timeout`]. A peer that closes its connection or
//! goes silent produces an error naming that rank, on its neighbour directly and on every other
//! rank through an abort frame relayed around the ring. After a failure the communicator refuses
//! further collectives: the job has to be restarted, as with NCCL.

mod element;
mod frame;
mod options;
mod rendezvous;
mod ring;
mod transport;

#[cfg(test)]
mod tests;

use std::sync::{Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor};

pub use options::{
    parse_timeout, CpuCommOptions, COLLECTIVE_TIMEOUT_ENV, DEFAULT_CHUNK_BYTES,
    DEFAULT_COLLECTIVE_TIMEOUT,
};

use self::element::{check_cpu_contiguous, unsupported_dtype, Element};
use self::frame::OpCode;
use self::transport::{run_collective, FramePool, RingLinks, RingPosition, Session, Tag};
use super::store::Store;
use super::{CommStats, Communicator, ReduceOp};
use crate::error::{Error, Result};

/// Collectives over TCP between processes (or threads) on one or several machines.
///
/// Collectives from several threads are serialized; as with every backend, all ranks must issue
/// the same collectives in the same order with tensors of the same shape and dtype. Supported
/// element types: f32, f64, i64. For i64, `Mean` truncates toward zero and sums wrap on overflow.
#[derive(Debug)]
pub struct CpuCommunicator {
    rank: usize,
    world_size: usize,
    options: CpuCommOptions,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// `None` for a world of one rank.
    links: Option<RingLinks>,
    /// Number of collectives run so far; stamped on every frame.
    seq: u64,
    stats: CommStats,
    /// Set by the first failed collective.
    broken: Option<Broken>,
    /// Frame buffers reused from one collective to the next.
    frames: FramePool,
}

#[derive(Debug)]
struct Broken {
    peer: Option<usize>,
    cause: String,
}

impl CpuCommunicator {
    /// Joins the ring: listens on an ephemeral port of `options.bind_ip`, publishes the address in
    /// `store`, and connects to the ring neighbours. Every rank of the job must call this with the
    /// same `world_size`; `options.timeout` bounds the whole setup.
    ///
    /// With `world_size == 1` nothing is published and no socket is opened.
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
        let links = if world_size > 1 {
            Some(rendezvous::connect_ring(store, rank, world_size, &options)?)
        } else {
            None
        };
        Ok(Self {
            rank,
            world_size,
            options,
            state: Mutex::new(State {
                links,
                seq: 0,
                stats: CommStats::default(),
                broken: None,
                frames: FramePool::new(),
            }),
        })
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

    /// Runs one collective on the ring; `Ok(None)` for a world of one rank (nothing to do).
    fn collective<R>(
        &self,
        op: OpCode,
        dtype: u8,
        chunk_elems: usize,
        count: impl FnOnce(&mut CommStats),
        body: impl FnOnce(&mut Session<'_>) -> Result<R>,
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
        let Some(links) = state.links.as_mut() else {
            return Ok(None);
        };
        state.seq += 1;
        let pos = RingPosition {
            rank: self.rank,
            world_size: self.world_size,
            chunk_elems,
            timeout: self.options.timeout,
        };
        let tag = Tag {
            op,
            dtype,
            seq: state.seq,
        };
        let (result, bytes_sent) = run_collective(links, &mut state.frames, pos, tag, body);
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
            |session| {
                element::with_elements_mut::<T, _>(tensor, |data| {
                    ring::all_reduce(session, data, op)
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
            |session| {
                element::with_elements_mut::<T, _>(tensor, |data| {
                    ring::broadcast(session, data, root)
                })
            },
        )?;
        Ok(())
    }

    fn all_gather_as<T: Element>(&self, tensor: &Tensor) -> Result<Tensor> {
        let n = tensor.elem_count();
        let mut out = vec![T::default(); n * self.world_size];
        element::read_elements(tensor, &mut out[self.rank * n..(self.rank + 1) * n])?;
        let chunk = self.chunk_elems::<T>();
        self.collective(
            OpCode::AllGather,
            T::CODE,
            chunk,
            |s| s.all_gathers += 1,
            |session| ring::all_gather(session, &mut out),
        )?;
        let mut dims = tensor.dims().to_vec();
        match dims.first_mut() {
            Some(first) => *first *= self.world_size,
            None => dims.push(self.world_size), // scalars gather into a vector
        }
        Ok(Tensor::from_vec(out, dims, &Device::Cpu)?)
    }
}

impl Communicator for CpuCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        check_cpu_contiguous(tensor, "all_reduce")?;
        match tensor.dtype() {
            DType::F32 => self.all_reduce_as::<f32>(tensor, op),
            DType::F64 => self.all_reduce_as::<f64>(tensor, op),
            DType::I64 => self.all_reduce_as::<i64>(tensor, op),
            other => Err(unsupported_dtype("all_reduce", other)),
        }
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        if root >= self.world_size {
            return Err(Error::Config(format!(
                "broadcast from rank {root} in a job of {} processes; the root must be in 0..{}",
                self.world_size, self.world_size
            )));
        }
        check_cpu_contiguous(tensor, "broadcast")?;
        match tensor.dtype() {
            DType::F32 => self.broadcast_as::<f32>(tensor, root),
            DType::F64 => self.broadcast_as::<f64>(tensor, root),
            DType::I64 => self.broadcast_as::<i64>(tensor, root),
            other => Err(unsupported_dtype("broadcast", other)),
        }
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        if self.world_size == 1 {
            // Same answer as the local backend: the tensor itself.
            self.lock().stats.all_gathers += 1;
            return Ok(tensor.clone());
        }
        // The input is only read, so a non-contiguous one is simply copied first.
        let tensor = tensor.contiguous()?;
        check_cpu_contiguous(&tensor, "all_gather")?;
        match tensor.dtype() {
            DType::F32 => self.all_gather_as::<f32>(&tensor),
            DType::F64 => self.all_gather_as::<f64>(&tensor),
            DType::I64 => self.all_gather_as::<i64>(&tensor),
            other => Err(unsupported_dtype("all_gather", other)),
        }
    }

    fn barrier(&self) -> Result<()> {
        // Each rank contributes a 1 per rank; an all-reduce cannot complete anywhere before every
        // rank has contributed, so completing it means everyone has arrived.
        let world = self.world_size as i64;
        let mut tokens = vec![1i64; self.world_size];
        self.collective(
            OpCode::Barrier,
            <i64 as Element>::CODE,
            self.chunk_elems::<i64>(),
            |s| s.barriers += 1,
            |session| ring::all_reduce(session, &mut tokens, ReduceOp::Sum),
        )?;
        if self.world_size > 1 && tokens.iter().any(|&t| t != world) {
            return Err(Error::Collective {
                op: "barrier",
                peer: None,
                problem: format!(
                    "barrier tokens summed to {tokens:?} instead of {world} each; a peer runs an \
                     incompatible version"
                ),
            });
        }
        Ok(())
    }

    fn stats(&self) -> CommStats {
        self.lock().stats
    }
}
