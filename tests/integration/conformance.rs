//! The conformance suite of the `Communicator` contract (`conformance_suite` in the test
//! library) against every backend: the local one; the CPU one over TCP and over shared memory,
//! with 2 and 3 ranks as threads of this process; and NCCL with 2 ranks on one GPU, as worker
//! processes under the launcher (the `nccl` feature; without a GPU it prints `skipped: ...`).

#![cfg_attr(not(feature = "nccl"), allow(dead_code, unused_imports))]

use std::time::Duration;

use accelerate_core::comm::{
    CpuCommOptions, CpuCommunicator, LocalCommunicator, StoreServer, TcpStoreClient,
};
use accelerate_core::comm::{Transport, TransportChoice};
use accelerate_tests::conformance_suite::check_communicator;
use candle_core::Device;

const TOKEN: &str = "conformance";

/// Runs the suite on `world` ranks (threads) joined by a CPU communicator forced onto
/// `transport`, with tensors for `device`; panics with every rank's failure.
fn suite_on_cpu_ranks(
    world: usize,
    transport: TransportChoice,
    device: impl Fn() -> Device + Sync,
) {
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 0).unwrap();
    let addr = server.local_addr();
    let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let device = &device;
                scope.spawn(move || {
                    let timeout = Duration::from_secs(60);
                    let store = TcpStoreClient::connect(addr, TOKEN, 0, rank, timeout).unwrap();
                    let options = CpuCommOptions {
                        timeout,
                        transport,
                        // Small chunks, so that even these short tensors travel in several.
                        chunk_bytes: 16,
                        ..CpuCommOptions::default()
                    };
                    let comm = CpuCommunicator::connect(&store, rank, world, options).unwrap();
                    let want = match transport {
                        TransportChoice::Tcp => Transport::Tcp,
                        _ => Transport::Shm,
                    };
                    assert_eq!(comm.transport(), Some(want), "rank {rank}");
                    check_communicator(&comm, &device())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_local_backend_keeps_the_contract() {
    check_communicator(&LocalCommunicator::new(), &Device::Cpu).unwrap();
}

#[test]
fn the_tcp_ring_keeps_the_contract_with_2_ranks() {
    suite_on_cpu_ranks(2, TransportChoice::Tcp, || Device::Cpu);
}

#[test]
fn the_tcp_ring_keeps_the_contract_with_3_ranks() {
    suite_on_cpu_ranks(3, TransportChoice::Tcp, || Device::Cpu);
}

#[test]
fn shared_memory_keeps_the_contract_with_2_ranks() {
    suite_on_cpu_ranks(2, TransportChoice::Shm, || Device::Cpu);
}

#[test]
fn shared_memory_keeps_the_contract_with_3_ranks() {
    suite_on_cpu_ranks(3, TransportChoice::Shm, || Device::Cpu);
}

const NEEDS: &str = "needs a GPU and --features nccl (docs/src/gpus.md, GPU tests)";

#[cfg(feature = "nccl")]
fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            accelerate_tests::skip(format_args!("no usable GPU ({e}); this test {NEEDS}"));
            None
        }
    }
}

/// The CPU backends stage GPU tensors through the host: the suite with the GPU as the device.
#[test]
#[cfg_attr(not(feature = "nccl"), ignore = "needs a GPU and --features nccl")]
fn the_cpu_backends_keep_the_contract_for_gpu_tensors() {
    #[cfg(feature = "nccl")]
    {
        if gpu().is_none() {
            return;
        }
        for transport in [TransportChoice::Tcp, TransportChoice::Shm] {
            suite_on_cpu_ranks(2, transport, || Device::new_cuda(0).unwrap());
        }
    }
}

/// NCCL with two ranks on one GPU (each its own NCCL host, through the launcher's
/// `--ranks-per-gpu`): the suite on the host and on the GPU.
#[test]
#[cfg_attr(not(feature = "nccl"), ignore = "needs a GPU and --features nccl")]
fn nccl_keeps_the_contract_with_2_ranks_on_one_gpu() {
    #[cfg(feature = "nccl")]
    {
        use accelerate_tests::Job;
        if gpu().is_none() {
            return;
        }
        let out = Job::worker()
            .launcher_flags(["--num-gpus", "1", "--ranks-per-gpu", "2"])
            .arg("conformance")
            .limit(Duration::from_secs(300))
            .run();
        let text = out.text();
        assert!(
            out.status.success() && text.contains("result: ok"),
            "{text}"
        );
    }
}

/// `Accelerator::gather` and `reduce` send every integer dtype as i64, so large i32 values stay
/// exact (they once travelled as f32, which rounds above 2^24).
#[test]
fn accelerator_gather_and_reduce_keep_large_i32_exact() {
    use accelerate_core::{Accelerator, ProcessState, ReduceOp};
    use candle_core::{DType, Tensor};
    let acc = Accelerator::builder()
        .device(Device::Cpu)
        .process_state(ProcessState::single())
        .build()
        .unwrap();
    let big = (1i64 << 24) + 1;
    let t = Tensor::new(&[big, -3], &Device::Cpu)
        .unwrap()
        .to_dtype(DType::I32)
        .unwrap();
    let gathered = acc.gather(&t).unwrap();
    assert_eq!(gathered.dtype(), DType::I32);
    let as_i64 = |t: &Tensor| t.to_dtype(DType::I64).unwrap().to_vec1::<i64>().unwrap();
    assert_eq!(as_i64(&gathered), vec![big, -3]);
    assert_eq!(
        as_i64(&acc.reduce(&t, ReduceOp::Sum).unwrap()),
        vec![big, -3]
    );
}
