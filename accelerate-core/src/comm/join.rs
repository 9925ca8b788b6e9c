//! How a process joins its job: find the rendezvous store (hosting it on rank 0 when no
//! `accelerate-launch` did), then build the communicator over it.
//!
//! - Under `accelerate-launch` the launcher hosts the store at `MASTER_ADDR:MASTER_PORT` and gives
//!   every worker the job token and the restart generation.
//! - Under torchrun, torchrun's own store already listens on `MASTER_PORT`, so rank 0 hosts ours
//!   on `MASTER_PORT + 1`; under SLURM and MPI (`mpirun`, which has no store of its own) rank 0
//!   hosts it on `MASTER_PORT`. None gives a token: on one machine rank 0 makes one in a file
//!   only this user can read, where every rank finds it; on several machines every rank needs
//!   `ACCELERATE_JOB_TOKEN` (`mpirun -x ACCELERATE_JOB_TOKEN=...`), or the job is refused unless
//!   `ACCELERATE_ALLOW_OPEN_STORE=1` (see `store::host_for_job`).
//!
//! Every rank also starts its heartbeat (`comm::liveness`) on a second store connection, so
//! that collectives can tell a dead peer from a busy one.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use candle_core::Device;

use super::cpu::{CpuCommOptions, CpuCommunicator};
use super::keys::{KeySpace, PrefixStore, MEMBERSHIP};
use super::liveness::Liveness;
use super::store::{RedialingClient, Store, StoreDial, StoreServer};
use super::{Communicator, LocalCommunicator};
use crate::error::{Error, Result};
use crate::process::{Launcher, ProcessState};

/// What joining produced.
pub struct Membership {
    /// The communicator of this process.
    pub comm: Box<dyn Communicator>,
    /// The store, seen through this membership's own namespace of keys (none for a single
    /// process): what the accelerator agrees on there (parameter signatures, loader settings)
    /// cannot meet the keys an earlier accelerator on the same store left.
    pub store: Option<Arc<dyn Store>>,
    /// The store this process hosts (rank 0 without our launcher), kept alive for the job.
    pub hosted: Option<StoreServer>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("hosts_store", &self.hosted.is_some())
            .finish()
    }
}

/// Joins the job described by `state`, for tensors on `device`. A single process gets the local
/// communicator and opens no socket. Ranks on GPUs talk through NCCL (the `nccl` feature), ranks on
/// the CPU through the CPU communicator; the store serves both for the rendezvous.
pub fn join(state: &ProcessState, device: &Device) -> Result<Membership> {
    if state.world_size == 1 {
        return Ok(Membership {
            comm: Box::new(LocalCommunicator::new()),
            store: None,
            hosted: None,
        });
    }
    let mut options = CpuCommOptions::from_env()?;
    let port = match state.launcher {
        Launcher::Torchrun => state.master_port.checked_add(1).ok_or_else(|| Error::Env {
            name: "MASTER_PORT".into(),
            value: state.master_port.to_string(),
            problem: "under torchrun our store listens on MASTER_PORT + 1; pick a lower port"
                .into(),
        })?,
        _ => state.master_port,
    };
    let addr = resolve(&state.master_addr, port)?;
    super::store::check_master_addr(state, addr)?;
    let hosted = if state.rank == 0 && state.launcher != Launcher::Accelerate {
        Some(super::store::host_for_job(state, addr)?)
    } else {
        None
    };
    let token = if state.launcher == Launcher::Accelerate {
        state.job_token.clone()
    } else {
        super::store::job_token(state, addr, options.timeout)?
    };
    let dial = StoreDial {
        addr,
        token,
        generation: state.restart_count as u64,
        rank: state.rank,
    };
    let client = dial.connect(options.timeout)?;
    // Ring peers must reach this rank at an address of the interface that reaches the store
    // (loopback for one machine), unless the user chose one.
    options.bind_ip = crate::env::read(
        crate::env::BIND_IP,
        "expected this machine's IP address that the other ranks can reach",
        |v| v.parse().ok(),
    )?
    .unwrap_or_else(|| client.local_addr().ip());
    // Its own connection: the heartbeat must not queue behind a long `get` on the main one. It
    // dials again when that connection fails, so a network blip does not silence it for good.
    let heartbeat_client = RedialingClient::connect(dial, options.timeout)?;
    let liveness = Liveness::start(
        Arc::new(heartbeat_client),
        state.rank,
        state.world_size,
        state.restart_count as u64,
        options.timeout,
    )?;
    options.liveness = Some(liveness);
    let store: Arc<dyn Store> = Arc::new(client);
    let keys = KeySpace::next(store.as_ref(), MEMBERSHIP, state.rank)?;
    let comm: Box<dyn Communicator> = if device.is_cpu() {
        Box::new(CpuCommunicator::connect(
            store.as_ref(),
            state.rank,
            state.world_size,
            options,
        )?)
    } else {
        gpu_communicator(store.clone(), state, device, &options)?
    };
    Ok(Membership {
        comm,
        store: Some(Arc::new(PrefixStore::new(store, keys))),
        hosted,
    })
}

#[cfg(feature = "nccl")]
fn gpu_communicator(
    store: Arc<dyn Store>,
    state: &ProcessState,
    device: &Device,
    options: &CpuCommOptions,
) -> Result<Box<dyn Communicator>> {
    let comm = super::nccl::NcclCommunicator::connect(
        store,
        device,
        state.rank,
        state.world_size,
        options.timeout,
    )?;
    // The watchdog ends the job when a peer is gone, and waits on live ones up to the busy limit.
    if let Some(liveness) = &options.liveness {
        comm.watch_liveness(liveness.clone(), options.busy_limit());
    }
    Ok(Box::new(comm))
}

#[cfg(not(feature = "nccl"))]
fn gpu_communicator(
    _store: Arc<dyn Store>,
    state: &ProcessState,
    device: &Device,
    _options: &CpuCommOptions,
) -> Result<Box<dyn Communicator>> {
    Err(Error::Device(format!(
        "{} processes compute on {:?}, but this program was built without the `nccl` feature, \
         which GPUs need to talk to each other; rebuild with `--features nccl`",
        state.world_size,
        device.location()
    )))
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::Env {
            name: "MASTER_ADDR".into(),
            value: host.into(),
            problem: format!("cannot resolve it ({e}); give an IP address or a resolvable host"),
        })?
        .next()
        .ok_or_else(|| Error::Env {
            name: "MASTER_ADDR".into(),
            value: host.into(),
            problem: "resolves to no address".into(),
        })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_second_accelerator_on_the_same_store_never_reads_the_first_ones_keys() {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t".into(), 0).unwrap();
        let port = server.local_addr().port();
        // What a finished `prepare` leaves: its verdict, which a later one must not take for its
        // own (rank 1 would pass a check rank 0 is still making).
        let verdict = "accelerate/parameters/verdict";
        let set = std::sync::Barrier::new(2);
        let reads: Vec<Result<Vec<u8>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let set = &set;
                    scope.spawn(move || {
                        let state = ProcessState {
                            rank,
                            world_size: 2,
                            local_rank: rank,
                            local_world_size: 2,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            job_token: "t".into(),
                            restart_count: 0,
                            launcher: Launcher::Accelerate,
                        };
                        let first = join(&state, &Device::Cpu).unwrap();
                        if rank == 0 {
                            first.store.as_ref().unwrap().set(verdict, b"=").unwrap();
                        }
                        set.wait();
                        drop(first);
                        let second = join(&state, &Device::Cpu).unwrap();
                        let read = second.store.as_ref().unwrap().get(verdict, Duration::ZERO);
                        read
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, read) in reads.iter().enumerate() {
            assert!(
                read.is_err(),
                "rank {rank} of the second accelerator read the first one's {verdict}: {read:?}"
            );
        }
    }
}
