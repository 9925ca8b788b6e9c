//! Tests specific to the shared-memory transport (the collectives themselves run over both
//! transports in `comm/cpu/tests.rs`): choosing it, cleaning up the file, detecting dead peers.

use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

use candle_core::{Device, Tensor};

use super::Plan;
use crate::comm::cpu::options::CpuCommOptions;
use crate::comm::cpu::{CpuCommunicator, Link, Transport};
use crate::comm::store::{on_store_clients, Store, TcpStoreClient};
use crate::comm::{Communicator, ReduceOp};
use crate::env::CPU_TRANSPORT;
use crate::error::{Error, Result};

const TOKEN: &str = "shm-test-token";

/// Runs `f(rank, store, connect result)` on `world` threads, each with its own store client and
/// options `opts(rank)`; returns the results by rank.
fn on_job<R: Send>(
    world: usize,
    opts: impl Fn(usize) -> CpuCommOptions + Sync,
    f: impl Fn(usize, &TcpStoreClient, Result<CpuCommunicator>) -> R + Sync,
) -> Vec<R> {
    on_store_clients(world, TOKEN, |rank, store| {
        let comm = CpuCommunicator::connect(store, rank, world, opts(rank));
        f(rank, store, comm)
    })
}

/// Options as `CpuCommOptions::from_env` makes them with `ACCELERATE_CPU_TRANSPORT` at `value`
/// (or unset), without touching the environment that concurrent tests read.
fn options_with_variable(value: Option<&'static str>) -> CpuCommOptions {
    let mut options = CpuCommOptions::from_lookup(|name| match (name, value) {
        (CPU_TRANSPORT, Some(v)) => Some(v.to_string()),
        _ => None,
    })
    .unwrap();
    options.timeout = Duration::from_secs(20);
    options
}

fn sum_of_ranks(comm: &CpuCommunicator) -> Vec<f32> {
    let t = Tensor::new(&[comm.rank() as f32, 1.0], &Device::Cpu).unwrap();
    comm.all_reduce(&t, ReduceOp::Sum).unwrap();
    t.to_vec1::<f32>().unwrap()
}

#[test]
fn auto_uses_shared_memory_on_one_machine_and_the_variable_forces_tcp() {
    for (value, want) in [
        (None, Transport::Shm),
        (Some("auto"), Transport::Shm),
        (Some("tcp"), Transport::Tcp),
        (Some("shm"), Transport::Shm),
    ] {
        let results = on_job(
            3,
            |_| options_with_variable(value),
            |_, _, comm| {
                let comm = comm.unwrap();
                (comm.transport(), sum_of_ranks(&comm))
            },
        );
        for (transport, sum) in results {
            assert_eq!(transport, Some(want), "{CPU_TRANSPORT}={value:?}");
            assert_eq!(sum, vec![3.0, 3.0]);
        }
    }
}

#[test]
fn the_file_is_gone_once_every_rank_has_mapped_it() {
    let paths = on_job(
        3,
        |_| options_with_variable(Some("shm")),
        |rank, store, comm| {
            let comm = comm.unwrap();
            let plan = store.get("cpu_comm/1/plan", Duration::ZERO).unwrap();
            let Plan::Shm { path, .. } = bincode::deserialize(&plan).unwrap() else {
                panic!("rank {rank}: the plan is not shared memory");
            };
            // Every rank returns from connect only after rank 0 unlinked the file; the mapping
            // itself keeps working.
            let gone = !path.exists();
            assert_eq!(sum_of_ranks(&comm), vec![3.0, 3.0]);
            comm.barrier().unwrap();
            (path, gone)
        },
    );
    for (path, gone) in &paths {
        assert!(gone, "{} still exists", path.display());
        assert_eq!(path, &paths[0].0, "all ranks mapped the same file");
    }
}

#[test]
fn ranks_disagreeing_on_the_transport_are_refused_everywhere() {
    // Rank 0 on tcp and rank 1 on auto: rank 0 refuses, and rank 1, which waits for rank 0's
    // plan, gets the same reason. (The other way round rank 1 would be connecting its TCP ring
    // and only time out.)
    let results = on_job(
        2,
        |rank| options_with_variable(if rank == 0 { Some("tcp") } else { Some("auto") }),
        |_, _, comm| comm.map(|_| ()),
    );
    for result in results {
        let err = result.unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
        let text = err.to_string();
        assert!(
            text.contains(CPU_TRANSPORT) && text.contains("rank 1 with auto"),
            "{text}"
        );
    }
}

/// The shared region behind a communicator.
fn with_region<R>(comm: &CpuCommunicator, f: impl FnOnce(&super::region::Region) -> R) -> R {
    match &comm.lock().link {
        Link::Shm(links) => f(links.region()),
        other => panic!("not shared memory: {other:?}"),
    }
}

#[test]
fn a_rank_whose_process_died_is_named_on_every_other_rank() {
    // Rank 1's control block is made to point at a process that has exited: the others, waiting
    // for its data, find it gone at their next liveness check, long before the 60 s timeout.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = child.id();
    child.wait().unwrap();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = (Mutex::new(done_tx), Mutex::new(done_rx));
    let results = on_job(
        3,
        |_| {
            let mut options = options_with_variable(Some("shm"));
            options.timeout = Duration::from_secs(60);
            options
        },
        |rank, _, comm| {
            let comm = comm.unwrap();
            if rank == 1 {
                with_region(&comm, |region| {
                    region
                        .pid(1)
                        .store(dead_pid, std::sync::atomic::Ordering::SeqCst)
                });
            }
            // After the barrier every rank sees the dead pid.
            comm.barrier().unwrap();
            if rank == 1 {
                // Stay (without dropping the communicator) until the others have failed.
                let rx = done_rx.lock().unwrap();
                for _ in 0..2 {
                    let _ = rx.recv_timeout(Duration::from_secs(60));
                }
                return None;
            }
            let t = Tensor::new(&[1f64, 2.0, 3.0], &Device::Cpu).unwrap();
            let err = comm.all_reduce(&t, ReduceOp::Max).unwrap_err();
            done_tx.lock().unwrap().send(()).unwrap();
            Some(err)
        },
    );
    for (rank, err) in results.into_iter().enumerate() {
        let Some(err) = err else { continue };
        assert!(
            matches!(err, Error::Collective { peer: Some(1), .. }),
            "rank {rank}: {err}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&format!("process {dead_pid} is gone")),
            "{text}"
        );
    }
}
