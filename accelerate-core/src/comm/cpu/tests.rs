//! Communicator tests: each rank is a thread with its own store client and communicator. Tests of
//! behaviour common to both transports run once over TCP and once over shared memory (a module
//! per test with a `tcp` and an `shm` case); tests of one transport's specifics force it.
//! Expected values are computed directly from the inputs (plain sums, maxima, concatenations).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};

use super::options::DEFAULT_CHUNK_BYTES;
use super::*;
use crate::comm::store::{on_store_clients, StoreServer, TcpStoreClient};

const TOKEN: &str = "ring-test-token";

fn options(transport: TransportChoice, timeout: Duration, chunk_bytes: usize) -> CpuCommOptions {
    CpuCommOptions {
        timeout,
        chunk_bytes,
        transport,
        ..Default::default()
    }
}

/// Runs the test function `$name(transport)` over TCP and over shared memory.
macro_rules! over_both_transports {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn tcp() {
                    super::$name(super::TransportChoice::Tcp)
                }
                #[test]
                fn shm() {
                    super::$name(super::TransportChoice::Shm)
                }
            }
        )*
    };
}

over_both_transports!(
    all_reduce_matches_the_direct_reduction_for_every_world_size_dtype_and_op,
    all_reduce_of_inexact_floats_is_close_to_the_sum_and_identical_on_every_rank,
    a_large_all_reduce_streams_through_bounded_buffers,
    all_reduce_works_in_place_on_a_view_of_a_larger_buffer,
    broadcast_copies_the_root_everywhere,
    all_gather_concatenates_in_rank_order,
    nobody_leaves_a_barrier_before_everyone_entered,
    a_rank_that_drops_out_is_named_on_every_other_rank,
    a_rank_that_stops_answering_is_named_on_every_other_rank,
    ranks_disagreeing_on_the_shape_are_refused_by_the_agreement,
    ranks_disagreeing_on_an_agreed_size_still_get_a_protocol_error,
    a_rank_in_another_collective_is_a_protocol_error_naming_it,
    unusable_tensors_are_refused_before_any_traffic,
    communicators_created_one_after_another_on_one_store_do_not_mix,
    a_world_size_disagreement_is_a_configuration_error,
);

/// Runs `f(rank, communicator)` on `world` threads joined in one ring; returns results by rank.
fn on_ring<R: Send>(
    world: usize,
    opts: CpuCommOptions,
    f: impl Fn(usize, CpuCommunicator) -> R + Sync,
) -> Vec<R> {
    on_store_clients(world, TOKEN, |rank, store| {
        let opts = opts.clone();
        let forced = opts.transport;
        let comm = CpuCommunicator::connect(store, rank, world, opts).unwrap();
        let want = match forced {
            _ if world == 1 => None,
            TransportChoice::Tcp => Some(Transport::Tcp),
            TransportChoice::Shm | TransportChoice::Auto => Some(Transport::Shm),
        };
        assert_eq!(comm.transport(), want, "rank {rank} of {world}");
        f(rank, comm)
    })
}

/// Runs `f(world, rank, communicator)` on rings of every size from 1 to 5 ranks over
/// `transport`, with 16-byte chunks (many chunks per collective).
fn on_rings_of_1_to_5(
    transport: TransportChoice,
    f: impl Fn(usize, usize, CpuCommunicator) + Sync,
) {
    for world in 1..=5 {
        on_ring(
            world,
            options(transport, Duration::from_secs(20), 16),
            |rank, comm| f(world, rank, comm),
        );
    }
}

/// Input of `rank` at index `i`: quarter-integers of small magnitude, so float sums are exact.
fn value(rank: usize, i: usize) -> f64 {
    ((rank * 31 + i * 7) % 23) as f64 - 11.0 + 0.25 * rank as f64
}

fn int_value(rank: usize, i: usize) -> i64 {
    ((rank * 31 + i * 7) % 23) as i64 - 11 + 1000 * rank as i64
}

fn input(rank: usize, len: usize, dtype: DType) -> Tensor {
    let dev = &Device::Cpu;
    match dtype {
        DType::F32 => Tensor::from_vec(
            (0..len).map(|i| value(rank, i) as f32).collect::<Vec<_>>(),
            len,
            dev,
        ),
        DType::F64 => Tensor::from_vec(
            (0..len).map(|i| value(rank, i)).collect::<Vec<_>>(),
            len,
            dev,
        ),
        DType::I64 => Tensor::from_vec(
            (0..len).map(|i| int_value(rank, i)).collect::<Vec<_>>(),
            len,
            dev,
        ),
        other => panic!("no test input for {other:?}"),
    }
    .unwrap()
}

/// The reduction over ranks computed directly, element by element, as f64 / i64 lists.
fn expected_floats(world: usize, len: usize, op: ReduceOp, as_f32: bool) -> Vec<f64> {
    (0..len)
        .map(|i| {
            let column = (0..world).map(|r| value(r, i));
            match op {
                ReduceOp::Sum => column.sum(),
                // The sum is exact; the one rounding is the division, done in the tensor's type.
                ReduceOp::Mean if as_f32 => (column.sum::<f64>() as f32 / world as f32) as f64,
                ReduceOp::Mean => column.sum::<f64>() / world as f64,
                ReduceOp::Max => column.fold(f64::NEG_INFINITY, f64::max),
            }
        })
        .collect()
}

fn expected_ints(world: usize, len: usize, op: ReduceOp) -> Vec<i64> {
    (0..len)
        .map(|i| {
            let column = (0..world).map(|r| int_value(r, i));
            match op {
                ReduceOp::Sum => column.sum(),
                ReduceOp::Mean => column.sum::<i64>() / world as i64,
                ReduceOp::Max => column.max().unwrap(),
            }
        })
        .collect()
}

fn as_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

/// Whether `err` names `rank` as the culprit.
fn names_rank(err: &Error, rank: usize) -> bool {
    match err {
        Error::Collective { peer, .. } => *peer == Some(rank),
        Error::Timeout { what, .. } => what.contains(&format!("rank {rank} ")),
        _ => false,
    }
}

fn all_reduce_matches_the_direct_reduction_for_every_world_size_dtype_and_op(
    transport: TransportChoice,
) {
    // 16-byte chunks (64-byte pieces over shm): the 40-element case spans several chunks per
    // segment at every world size; 301 elements (not divisible by 2 to 5) outgrow a whole
    // shared-memory staging slot (two halves of one 64-byte piece per rank).
    let lengths = [0usize, 1, 7, 40, 301];
    on_rings_of_1_to_5(transport, |world, rank, comm| {
        for &len in &lengths {
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                for dtype in [DType::F32, DType::F64] {
                    let t = input(rank, len, dtype);
                    comm.all_reduce(&t, op).unwrap();
                    let expected = expected_floats(world, len, op, dtype == DType::F32);
                    assert_eq!(
                        as_f64(&t),
                        expected,
                        "{world} ranks, {len} {dtype:?} {op:?}"
                    );
                }
                let t = input(rank, len, DType::I64);
                comm.all_reduce(&t, op).unwrap();
                assert_eq!(
                    t.to_vec1::<i64>().unwrap(),
                    expected_ints(world, len, op),
                    "{world} ranks, {len} i64 {op:?}"
                );
            }
        }
    });
}

fn all_reduce_of_inexact_floats_is_close_to_the_sum_and_identical_on_every_rank(
    transport: TransportChoice,
) {
    let world = 4;
    let len = 1001;
    let data = |rank: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((rank * len + i) as f32 * 0.37).sin() * 1e3)
            .collect()
    };
    let results = on_ring(
        world,
        options(transport, Duration::from_secs(20), 256),
        |rank, comm| {
            let t = Tensor::from_vec(data(rank), len, &Device::Cpu).unwrap();
            comm.all_reduce(&t, ReduceOp::Sum).unwrap();
            t.to_vec1::<f32>().unwrap()
        },
    );
    let inputs: Vec<Vec<f32>> = (0..world).map(data).collect();
    for (i, &got) in results[0].iter().enumerate() {
        let direct: f64 = inputs.iter().map(|x| x[i] as f64).sum();
        // Each of the W - 1 f32 additions rounds by at most eps times the magnitude involved.
        let magnitude: f64 = inputs.iter().map(|x| (x[i] as f64).abs()).sum();
        let bound = world as f64 * f32::EPSILON as f64 * magnitude;
        assert!((got as f64 - direct).abs() <= bound, "element {i}");
    }
    for r in 1..world {
        let same = results[r]
            .iter()
            .zip(&results[0])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "rank {r} differs from rank 0");
    }
}

fn a_large_all_reduce_streams_through_bounded_buffers(transport: TransportChoice) {
    // 8 MiB per rank, far beyond what socket buffers or a shared-memory staging slot hold:
    // without concurrent sending and receiving (TCP) or the reuse of staging halves (shm) this
    // would deadlock (and then time out).
    let world = 3;
    let len = 2 * 1024 * 1024;
    let results = on_ring(
        world,
        options(transport, Duration::from_secs(60), DEFAULT_CHUNK_BYTES),
        |rank, comm| {
            let t = Tensor::from_vec(
                (0..len)
                    .map(|i| (i % 1000) as f32 + rank as f32)
                    .collect::<Vec<_>>(),
                len,
                &Device::Cpu,
            )
            .unwrap();
            comm.all_reduce(&t, ReduceOp::Sum).unwrap();
            let v = t.to_vec1::<f32>().unwrap();
            // Rank sum 0+1+2 = 3 on top of 3 copies of (i % 1000).
            (0..len).all(|i| v[i] == 3.0 * (i % 1000) as f32 + 3.0)
        },
    );
    assert_eq!(results, vec![true; world]);
}

fn all_reduce_works_in_place_on_a_view_of_a_larger_buffer(transport: TransportChoice) {
    let results = on_ring(
        2,
        options(transport, Duration::from_secs(10), 64),
        |rank, comm| {
            let flat = Tensor::from_vec(vec![rank as f32 + 1.0; 6], 6, &Device::Cpu).unwrap();
            let view = flat.narrow(0, 2, 3).unwrap();
            comm.all_reduce(&view, ReduceOp::Sum).unwrap();
            flat.to_vec1::<f32>().unwrap()
        },
    );
    // Ranks hold 1s and 2s; only elements 2..5 are reduced (1 + 2 = 3).
    assert_eq!(results[0], vec![1.0, 1.0, 3.0, 3.0, 3.0, 1.0]);
    assert_eq!(results[1], vec![2.0, 2.0, 3.0, 3.0, 3.0, 2.0]);
}

fn broadcast_copies_the_root_everywhere(transport: TransportChoice) {
    on_rings_of_1_to_5(transport, |world, rank, comm| {
        for root in 0..world {
            for len in [0usize, 1, 7, 40] {
                for dtype in [DType::F32, DType::F64, DType::I64] {
                    let t = input(rank, len, dtype);
                    comm.broadcast(&t, root).unwrap();
                    let want = input(root, len, dtype);
                    assert_eq!(as_f64(&t), as_f64(&want), "{world} ranks, root {root}");
                }
            }
        }
        assert!(comm.broadcast(&input(rank, 1, DType::F32), world).is_err());
    });
}

fn all_gather_concatenates_in_rank_order(transport: TransportChoice) {
    on_rings_of_1_to_5(transport, |world, rank, comm| {
        // A 2-D f32 tensor of 3 x 5 = 15 elements per rank (several chunks).
        let rows = |r: usize| -> Vec<f32> { (0..15).map(|i| (100 * r + i) as f32).collect() };
        let t = Tensor::from_vec(rows(rank), (3, 5), &Device::Cpu).unwrap();
        let gathered = comm.all_gather(&t).unwrap();
        assert_eq!(gathered.dims(), &[3 * world, 5]);
        let want: Vec<f32> = (0..world).flat_map(rows).collect();
        assert_eq!(
            gathered.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            want
        );

        let ints = Tensor::new(&[rank as i64, -(rank as i64)], &Device::Cpu).unwrap();
        let gathered = comm.all_gather(&ints).unwrap().to_vec1::<i64>().unwrap();
        let want: Vec<i64> = (0..world as i64).flat_map(|r| [r, -r]).collect();
        assert_eq!(gathered, want);

        let empty = Tensor::zeros((0, 4), DType::F64, &Device::Cpu).unwrap();
        assert_eq!(comm.all_gather(&empty).unwrap().dims(), &[0, 4]);

        if world > 1 {
            // Scalars gather into a vector of one value per rank.
            let scalar = Tensor::new(rank as f64 * 0.5, &Device::Cpu).unwrap();
            let gathered = comm.all_gather(&scalar).unwrap();
            let want: Vec<f64> = (0..world).map(|r| r as f64 * 0.5).collect();
            assert_eq!(gathered.to_vec1::<f64>().unwrap(), want);
            // A transposed (non-contiguous) input is gathered by value.
            let m = Tensor::from_vec(vec![rank as f32; 6], (2, 3), &Device::Cpu).unwrap();
            assert_eq!(
                comm.all_gather(&m.t().unwrap()).unwrap().dims(),
                &[3 * world, 2]
            );
        }
    });
}

fn nobody_leaves_a_barrier_before_everyone_entered(transport: TransportChoice) {
    for world in 1..=4 {
        let entered = AtomicUsize::new(0);
        let seen = on_ring(
            world,
            options(transport, Duration::from_secs(20), 64),
            |rank, comm| {
                let mut seen = Vec::new();
                for round in 1..=3 {
                    if rank == world - 1 {
                        // The last rank is late, so a barrier that does not wait would be caught.
                        std::thread::sleep(Duration::from_millis(30));
                    }
                    entered.fetch_add(1, Ordering::SeqCst);
                    comm.barrier().unwrap();
                    seen.push((round, entered.load(Ordering::SeqCst)));
                    comm.barrier().unwrap(); // keep rounds apart
                }
                seen
            },
        );
        for per_rank in seen {
            for (round, count) in per_rank {
                assert!(
                    count >= round * world,
                    "{world} ranks: saw {count} in round {round}"
                );
            }
        }
    }
}

/// Each rank's stats over `transport` on 3 ranks after an all-reduce of 12 f32, and after that
/// all-reduce, a broadcast from rank 0 and an all-gather of the same tensor and a barrier.
fn stats_after_each_kind_of_collective(transport: TransportChoice) -> Vec<(CommStats, CommStats)> {
    on_ring(
        3,
        options(transport, Duration::from_secs(10), 1 << 20),
        |rank, comm| {
            let t = input(rank, 12, DType::F32);
            comm.all_reduce(&t, ReduceOp::Sum).unwrap();
            let after_all_reduce = comm.stats();
            comm.broadcast(&t, 0).unwrap();
            comm.all_gather(&t).unwrap();
            comm.barrier().unwrap();
            (after_all_reduce, comm.stats())
        },
    )
}

/// The calls `stats` counts: all-reduces, broadcasts, all-gathers, barriers, agreements.
fn calls(stats: &CommStats) -> (u64, u64, u64, u64, u64) {
    (
        stats.all_reduces,
        stats.broadcasts,
        stats.all_gathers,
        stats.barriers,
        stats.agreements,
    )
}

#[test]
fn stats_count_calls_and_the_ring_traffic() {
    let stats = stats_after_each_kind_of_collective(TransportChoice::Tcp);
    for (rank, (after_all_reduce, total)) in stats.into_iter().enumerate() {
        // Each agreement is a ring all-gather of 4 i64 per rank: W - 1 blocks of 32 bytes.
        let agreement = 2 * 32;
        // Ring all-reduce: every rank sends 2 (W - 1) segments of 12 / 3 = 4 f32 = 64 bytes.
        assert_eq!(
            after_all_reduce.bytes_sent,
            agreement + 2 * 2 * 4 * 4,
            "rank {rank}"
        );
        assert_eq!(calls(&total), (1, 1, 1, 1, 3));
        // Broadcast from 0 along 0 -> 1 -> 2: ranks 0 and 1 send the 48 bytes, rank 2 nothing.
        // All-gather: W - 1 blocks of 48 bytes. Barrier: 2 (W - 1) one-element i64 segments.
        let broadcast = if rank < 2 { 48 } else { 0 };
        assert_eq!(
            total.bytes_sent,
            3 * agreement + 64 + broadcast + 2 * 48 + 4 * 8,
            "rank {rank}"
        );
    }
}

#[test]
fn stats_count_calls_and_the_bytes_staged_in_shared_memory() {
    let stats = stats_after_each_kind_of_collective(TransportChoice::Shm);
    for (rank, (after_all_reduce, total)) in stats.into_iter().enumerate() {
        // Each agreement stages this rank's 4 i64 (32 bytes).
        let agreement = 32;
        // All-reduce: each rank stages the 2 segments of 4 f32 it does not own (32 bytes), then
        // its reduced segment (16 bytes): the whole 48-byte tensor.
        assert_eq!(after_all_reduce.bytes_sent, agreement + 48, "rank {rank}");
        assert_eq!(calls(&total), (1, 1, 1, 1, 3));
        // Broadcast: only the root stages its 48 bytes. All-gather: each its own 48-byte block.
        // Barrier: no payload.
        let broadcast = if rank == 0 { 48 } else { 0 };
        assert_eq!(
            total.bytes_sent,
            3 * agreement + 48 + broadcast + 48,
            "rank {rank}"
        );
    }
}

#[test]
fn a_world_of_one_opens_no_socket_and_changes_nothing() {
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 0).unwrap();
    let store =
        TcpStoreClient::connect(server.local_addr(), TOKEN, 0, 0, Duration::from_secs(5)).unwrap();
    let comm = CpuCommunicator::connect(&store, 0, 1, CpuCommOptions::default()).unwrap();
    assert_eq!(comm.transport(), None);
    let t = Tensor::new(&[1.5f32, -2.0], &Device::Cpu).unwrap();
    comm.all_reduce(&t, ReduceOp::Mean).unwrap();
    comm.broadcast(&t, 0).unwrap();
    comm.barrier().unwrap();
    assert_eq!(t.to_vec1::<f32>().unwrap(), vec![1.5, -2.0]);
    assert_eq!(comm.stats().bytes_sent, 0);
    // Nothing was published for a one-rank job.
    assert!(store.get("cpu_comm/1/rank0", Duration::ZERO).is_err());
    assert!(store.get("cpu_comm/1/host0", Duration::ZERO).is_err());
    assert!(store
        .get("cpu_comm/rank0/instances", Duration::ZERO)
        .is_err());
}

fn a_rank_that_drops_out_is_named_on_every_other_rank(transport: TransportChoice) {
    for world in [2usize, 3, 5] {
        let dropped = world / 2;
        let errors = on_ring(
            world,
            options(transport, Duration::from_secs(5), 64),
            |rank, comm| {
                let t = input(rank, 30, DType::F32);
                comm.all_reduce(&t, ReduceOp::Sum).unwrap();
                if rank == dropped {
                    drop(comm);
                    return None;
                }
                let first = comm.all_reduce(&t, ReduceOp::Sum).unwrap_err();
                // The communicator stays failed and keeps naming the culprit.
                let second = comm.barrier().unwrap_err();
                Some((first, second))
            },
        );
        for (rank, outcome) in errors.into_iter().enumerate() {
            let Some((first, second)) = outcome else {
                continue;
            };
            assert!(
                names_rank(&first, dropped),
                "{world} ranks, rank {rank}: {first}"
            );
            assert!(
                names_rank(&second, dropped),
                "{world} ranks, rank {rank}: {second}"
            );
            assert!(
                second.to_string().contains("cannot be used again"),
                "{second}"
            );
        }
    }
}

fn a_rank_that_stops_answering_is_named_on_every_other_rank(transport: TransportChoice) {
    // Rank 1 keeps its communicator but never joins the collective. Over TCP only rank 2 (its
    // successor) can see the silence, and ranks 3 and 0 must learn the culprit from the abort;
    // over shared memory every rank waits on rank 1's data directly.
    let world = 4;
    let silent = 1;
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_tx = std::sync::Mutex::new(done_tx);
    let done_rx = std::sync::Mutex::new(done_rx);
    // The silent rank is alive (a thread of this process), so over shared memory it is waited
    // for up to the busy limit.
    let errors = on_ring(
        world,
        CpuCommOptions {
            busy_timeout: Duration::from_millis(800),
            ..options(transport, Duration::from_millis(800), 64)
        },
        |rank, comm| {
            if rank == silent {
                // Hold the communicator until the others are done (bounded by the channel timeout).
                let rx = done_rx.lock().unwrap();
                for _ in 0..world - 1 {
                    let _ = rx.recv_timeout(Duration::from_secs(30));
                }
                drop(comm);
                return None;
            }
            let t = input(rank, 30, DType::F64);
            let err = comm.all_reduce(&t, ReduceOp::Max).unwrap_err();
            done_tx.lock().unwrap().send(()).unwrap();
            Some(err)
        },
    );
    for (rank, err) in errors.into_iter().enumerate() {
        if let Some(err) = err {
            assert!(names_rank(&err, silent), "rank {rank}: {err}");
        }
    }
}

fn ranks_disagreeing_on_the_shape_are_refused_by_the_agreement(transport: TransportChoice) {
    // Rank 0 passes an empty tensor: without the agreement it would return at once, believing
    // the all-reduce done, while the others wait for it.
    for lens in [[8usize, 9, 8], [0, 5, 5]] {
        let errors = on_ring(
            3,
            options(transport, Duration::from_secs(5), 64),
            |rank, comm| {
                let t = input(rank, lens[rank], DType::F32);
                let err = comm.all_reduce(&t, ReduceOp::Sum).unwrap_err().to_string();
                // Refused before any data moved: the communicator is still in step.
                let ok = input(rank, 4, DType::I64);
                comm.all_reduce(&ok, ReduceOp::Sum).unwrap();
                assert_eq!(
                    ok.to_vec1::<i64>().unwrap(),
                    expected_ints(3, 4, ReduceOp::Sum)
                );
                err
            },
        );
        for (rank, err) in errors.iter().enumerate() {
            // Every rank names every rank's size.
            for (r, len) in lens.iter().enumerate() {
                assert!(
                    err.contains(&format!("{r}")) && err.contains(&format!("of {len} f32")),
                    "rank {rank}: {err}"
                );
            }
            assert!(
                err.contains("same number of elements"),
                "rank {rank}: {err}"
            );
        }
    }
}

fn ranks_disagreeing_on_an_agreed_size_still_get_a_protocol_error(transport: TransportChoice) {
    // `all_reduce_agreed` skips the agreement; the transport's own checks still catch it.
    let errors = on_ring(
        2,
        options(transport, Duration::from_secs(5), 64),
        |rank, comm| {
            let t = input(rank, 8 + rank, DType::F32);
            comm.all_reduce_agreed(&t, ReduceOp::Sum)
                .unwrap_err()
                .to_string()
        },
    );
    assert!(errors[0].contains("protocol mismatch"), "{}", errors[0]);
    assert!(errors[0].contains("same shape and dtype"), "{}", errors[0]);
    // Rank 1 learns it from rank 0's abort.
    assert!(errors[1].contains("protocol mismatch"), "{}", errors[1]);
}

fn a_rank_in_another_collective_is_a_protocol_error_naming_it(transport: TransportChoice) {
    // The `_agreed` forms skip the pre-flight agreement, so the frames (TCP) and round tags
    // (shared memory) are what tell the collectives apart. Rank 0 reduce-scatters 16 elements
    // into 8; rank 1 runs another collective on tensors of the same sizes.
    const BLOCK: usize = 8;
    let others = [
        ("all_gather_into", "reduce_scatter(Sum)"),
        ("reduce_scatter(Max)", "reduce_scatter(Sum)"),
        ("all_reduce(Sum)", "reduce_scatter(Sum)"),
    ];
    for (theirs, ours) in others {
        let errors = on_ring(
            2,
            options(transport, Duration::from_secs(5), 64),
            |rank, comm| {
                let scattered = Tensor::zeros(BLOCK, DType::F32, &Device::Cpu).unwrap();
                let whole = input(rank, 2 * BLOCK, DType::F32);
                let result = match (rank, theirs) {
                    (0, _) => comm.reduce_scatter_agreed(&whole, &scattered, ReduceOp::Sum),
                    (_, "all_gather_into") => {
                        comm.all_gather_into_agreed(&input(rank, BLOCK, DType::F32), &whole)
                    }
                    (_, "reduce_scatter(Max)") => {
                        comm.reduce_scatter_agreed(&whole, &scattered, ReduceOp::Max)
                    }
                    _ => comm.all_reduce_agreed(&whole, ReduceOp::Sum),
                };
                result.unwrap_err().to_string()
            },
        );
        for (rank, err) in errors.iter().enumerate() {
            assert!(err.contains("protocol mismatch"), "rank {rank}: {err}");
        }
        // Whoever detects it names both collectives, with their reductions; the other learns it
        // from its abort.
        let named = |err: &str| err.contains(theirs) && err.contains(ours);
        assert!(
            errors.iter().all(|e| named(e)),
            "{ours} against {theirs}: {errors:#?}"
        );
    }
}

fn unusable_tensors_are_refused_before_any_traffic(transport: TransportChoice) {
    on_ring(
        2,
        options(transport, Duration::from_secs(5), 64),
        |rank, comm| {
            let m = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
            let err = comm.all_reduce(&m.t().unwrap(), ReduceOp::Sum).unwrap_err();
            assert!(err.to_string().contains("not contiguous"), "{err}");
            let u = Tensor::zeros(3, DType::I32, &Device::Cpu).unwrap();
            let err = comm.all_reduce(&u, ReduceOp::Sum).unwrap_err();
            assert!(err.to_string().contains("I32"), "{err}");
            // Nothing was sent, so the ring is still in step.
            let t = input(rank, 5, DType::I64);
            comm.all_reduce(&t, ReduceOp::Sum).unwrap();
            assert_eq!(
                t.to_vec1::<i64>().unwrap(),
                expected_ints(2, 5, ReduceOp::Sum)
            );
        },
    );
}

fn communicators_created_one_after_another_on_one_store_do_not_mix(transport: TransportChoice) {
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 0).unwrap();
    let addr = server.local_addr();
    let sums: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                scope.spawn(move || {
                    let store =
                        TcpStoreClient::connect(addr, TOKEN, 0, rank, Duration::from_secs(10))
                            .unwrap();
                    let opts = options(transport, Duration::from_secs(10), 64);
                    let first = CpuCommunicator::connect(&store, rank, 3, opts.clone()).unwrap();
                    drop(first);
                    let second = CpuCommunicator::connect(&store, rank, 3, opts).unwrap();
                    let t = Tensor::new(&[rank as f32], &Device::Cpu).unwrap();
                    second.all_reduce(&t, ReduceOp::Sum).unwrap();
                    t.to_vec1::<f32>().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(sums, vec![vec![3.0]; 3]);
}

fn a_world_size_disagreement_is_a_configuration_error(transport: TransportChoice) {
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 0).unwrap();
    let addr = server.local_addr();
    let results: Vec<Result<CpuCommunicator>> = std::thread::scope(|scope| {
        let handles: Vec<_> = [(0usize, 2usize), (1, 3)]
            .into_iter()
            .map(|(rank, world)| {
                scope.spawn(move || {
                    let store =
                        TcpStoreClient::connect(addr, TOKEN, 0, rank, Duration::from_secs(10))
                            .unwrap();
                    CpuCommunicator::connect(
                        &store,
                        rank,
                        world,
                        options(transport, Duration::from_millis(500), 64),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Rank 0 compares the world sizes before choosing the transport.
    let err = results[0].as_ref().unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    let reason = "rank 1 was started with world size 3 but rank 0 with 2";
    assert!(err.to_string().contains(reason), "{err}");
    let err = results[1].as_ref().unwrap_err().to_string();
    if transport == TransportChoice::Tcp {
        // A TCP rank connects its ring without waiting for rank 0's verdict: it waits for a
        // rank 2 that does not exist, and says so.
        assert!(err.contains("rank 2"), "{err}");
    } else {
        // Rank 1 waits for rank 0's plan, which carries the reason.
        assert!(err.contains(reason), "{err}");
    }
}

#[test]
fn a_rank_outside_the_world_is_a_configuration_error() {
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 0).unwrap();
    let store =
        TcpStoreClient::connect(server.local_addr(), TOKEN, 0, 5, Duration::from_secs(5)).unwrap();
    let err = CpuCommunicator::connect(&store, 5, 3, CpuCommOptions::default()).unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(err.to_string().contains("rank 5"), "{err}");
}

#[test]
fn a_stranger_connecting_to_a_ring_port_is_dropped_and_the_ring_still_forms() {
    use std::io::Write;
    use std::net::{SocketAddr, TcpStream};

    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 0).unwrap();
    let addr = server.local_addr();
    let connect = move |rank: usize| {
        let store = TcpStoreClient::connect(addr, TOKEN, 0, rank, Duration::from_secs(10)).unwrap();
        let comm = CpuCommunicator::connect(
            &store,
            rank,
            2,
            options(TransportChoice::Tcp, Duration::from_secs(10), 64),
        )
        .unwrap();
        let t = Tensor::new(&[rank as f32 + 1.0], &Device::Cpu).unwrap();
        comm.all_reduce(&t, ReduceOp::Sum).unwrap();
        t.to_vec1::<f32>().unwrap()
    };
    let sums = std::thread::scope(|scope| {
        // Rank 1 publishes its address, then waits for rank 0's.
        let rank1 = scope.spawn(move || connect(1));
        let spy = TcpStoreClient::connect(addr, TOKEN, 0, 9, Duration::from_secs(10)).unwrap();
        let card = spy
            .get("cpu_comm/1/rank1", Duration::from_secs(10))
            .unwrap();
        let (ring_addr, _nonce, _world): (SocketAddr, u128, u64) =
            bincode::deserialize(&card).unwrap();
        // Two strangers reach rank 1's port before rank 0 exists: one speaks garbage, one a
        // well-formed hello with a guessed nonce.
        let mut garbage = TcpStream::connect(ring_addr).unwrap();
        garbage.write_all(&[0xAB; 44]).unwrap();
        let mut guess = TcpStream::connect(ring_addr).unwrap();
        let mut hello = b"ACR1".to_vec();
        for field in [0u64, 2, 1] {
            hello.extend_from_slice(&field.to_le_bytes());
        }
        hello.extend_from_slice(&12345u128.to_le_bytes());
        guess.write_all(&hello).unwrap();
        let rank0 = scope.spawn(move || connect(0));
        [rank0.join().unwrap(), rank1.join().unwrap()]
    });
    assert_eq!(sums, [vec![3.0], vec![3.0]]);
}

/// Bytes sent by one rank in an agreed all-reduce, reduce-scatter and all-gather-into, each of a
/// `24 × world`-element f32 tensor (the all-gather's output), and its counters after them.
struct Traffic {
    /// Where the figures come from, for messages: "rank r of w".
    at: String,
    /// Bytes of the full tensor.
    bytes: u64,
    /// The number of ranks.
    w: u64,
    all_reduce: u64,
    reduce_scatter: u64,
    all_gather: u64,
    stats: CommStats,
}

/// The [`Traffic`] of every rank over `transport`, for each world size of `worlds`.
fn traffic_of_each_collective(transport: TransportChoice, worlds: &[usize]) -> Vec<Traffic> {
    let mut traffic = Vec::new();
    for &world in worlds {
        let len = 24 * world;
        let per_rank = on_ring(
            world,
            options(transport, Duration::from_secs(10), 64),
            |rank, comm| {
                let sent = |comm: &CpuCommunicator| comm.stats().bytes_sent;
                let start = sent(&comm);
                comm.all_reduce_agreed(&input(rank, len, DType::F32), ReduceOp::Sum)
                    .unwrap();
                let after_all_reduce = sent(&comm);
                let out = Tensor::zeros(len / world, DType::F32, &Device::Cpu).unwrap();
                comm.reduce_scatter_agreed(&input(rank, len, DType::F32), &out, ReduceOp::Sum)
                    .unwrap();
                let after_reduce_scatter = sent(&comm);
                let out = Tensor::zeros(len, DType::F32, &Device::Cpu).unwrap();
                comm.all_gather_into_agreed(&input(rank, len / world, DType::F32), &out)
                    .unwrap();
                Traffic {
                    at: format!("rank {rank} of {world}"),
                    bytes: (len * 4) as u64,
                    w: world as u64,
                    all_reduce: after_all_reduce - start,
                    reduce_scatter: after_reduce_scatter - after_all_reduce,
                    all_gather: sent(&comm) - after_reduce_scatter,
                    stats: comm.stats(),
                }
            },
        );
        traffic.extend(per_rank);
    }
    traffic
}

#[test]
fn a_ring_reduce_scatter_sends_half_of_an_all_reduce() {
    for t in traffic_of_each_collective(TransportChoice::Tcp, &[2, 3, 4]) {
        let (at, bytes, w) = (&t.at, t.bytes, t.w);
        // Ring reduce-scatter: W - 1 blocks of len / W elements, (W - 1) / W of the input;
        // the all-reduce sends as much again in its all-gather half.
        assert_eq!(t.reduce_scatter, bytes * (w - 1) / w, "{at}");
        assert_eq!(t.all_reduce, 2 * t.reduce_scatter, "{at}");
        // Ring all-gather: W - 1 blocks of the input's len / W elements.
        assert_eq!(t.all_gather, bytes * (w - 1) / w, "{at}");
        assert_eq!(
            (
                t.stats.all_reduces,
                t.stats.reduce_scatters,
                t.stats.all_gathers
            ),
            (1, 1, 1),
            "{at}"
        );
        assert_eq!(t.stats.agreements, 0, "{at}");
    }
}

#[test]
fn a_shared_memory_reduce_scatter_stages_the_blocks_of_the_others_only() {
    for t in traffic_of_each_collective(TransportChoice::Shm, &[2, 3]) {
        let (at, bytes, w) = (&t.at, t.bytes, t.w);
        // The W - 1 blocks this rank does not own; the all-reduce also stages its reduced
        // block for the others (the whole tensor); the all-gather stages its own block.
        assert_eq!(t.reduce_scatter, bytes * (w - 1) / w, "{at}");
        assert_eq!(t.all_reduce, bytes, "{at}");
        assert_eq!(t.all_gather, bytes / w, "{at}");
        assert_eq!(t.stats.reduce_scatters, 1, "{at}");
    }
}

/// Reduce-scatter and all-reduce of the same inexact f32 data on `world` ranks: this rank's
/// block of each, as bits.
fn reduce_scatter_and_all_reduce_blocks(
    transport: TransportChoice,
    world: usize,
) -> Vec<(Vec<u32>, Vec<u32>)> {
    let block = 301;
    let len = block * world;
    let data = |rank: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((rank * len + i) as f32 * 0.37).sin() * 1e3)
            .collect()
    };
    on_ring(
        world,
        options(transport, Duration::from_secs(20), 256),
        |rank, comm| {
            let bits = |t: &Tensor| -> Vec<u32> {
                t.to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            let input = Tensor::from_vec(data(rank), len, &Device::Cpu).unwrap();
            let out = Tensor::zeros(block, DType::F32, &Device::Cpu).unwrap();
            comm.reduce_scatter(&input, &out, ReduceOp::Sum).unwrap();
            comm.all_reduce(&input, ReduceOp::Sum).unwrap();
            let whole = input.narrow(0, rank * block, block).unwrap();
            (bits(&out), bits(&whole))
        },
    )
}

#[test]
fn a_shared_memory_reduce_scatter_has_the_bits_of_the_all_reduce() {
    // Same owner, same pieces, same rank order: the same additions.
    for world in [2, 3] {
        for (rank, (scattered, reduced)) in
            reduce_scatter_and_all_reduce_blocks(TransportChoice::Shm, world)
                .into_iter()
                .enumerate()
        {
            assert!(scattered == reduced, "rank {rank} of {world}");
        }
    }
}

#[test]
fn a_two_rank_ring_reduce_scatter_has_the_bits_of_the_all_reduce() {
    // With two ranks each sum has two terms, and float addition is commutative. (With more, the
    // chain starts at another rank than the all-reduce's, so only the tolerance holds.)
    for (rank, (scattered, reduced)) in
        reduce_scatter_and_all_reduce_blocks(TransportChoice::Tcp, 2)
            .into_iter()
            .enumerate()
    {
        assert!(scattered == reduced, "rank {rank}");
    }
}

/// The address of `t`'s storage. candle keeps each storage alone in its own heap-allocated
/// `RwLock`, so these addresses order the locks as candle's `inplace_op2` orders them.
fn storage_address(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    &*storage as *const candle_core::Storage as usize
}

/// Another thread holds the output's storage and then waits to write the input's, as candle's
/// own in-place ops do when the output's storage comes first in their lock order, while
/// `reduce_scatter` and `all_gather_into` run on the two: the collective must wait for the
/// output without holding the input, so that the thread goes on and both finish. (Taking the
/// input's lock first, because it is the input, deadlocks here; the wait for the thread is
/// bounded so that the test reports it instead of hanging.)
#[test]
fn a_collective_does_not_hold_its_input_while_it_waits_for_its_output() {
    const BLOCK: usize = 8;
    const WORLD: usize = 2;
    let opts = options(TransportChoice::Shm, Duration::from_secs(30), 64);
    on_ring(WORLD, opts, |rank, comm| {
        let comm = std::sync::Arc::new(comm);
        for gather in [false, true] {
            let what = if gather {
                "all_gather_into"
            } else {
                "reduce_scatter"
            };
            let (in_len, out_len) = if gather {
                (BLOCK, WORLD * BLOCK)
            } else {
                (WORLD * BLOCK, BLOCK)
            };
            let run = move |comm: &CpuCommunicator, input: &Tensor, output: &Tensor| {
                if gather {
                    comm.all_gather_into_agreed(input, output)
                } else {
                    comm.reduce_scatter_agreed(input, output, ReduceOp::Sum)
                }
            };
            let values = input(rank, in_len, DType::F32);
            if rank != 0 {
                let output = Tensor::zeros(out_len, DType::F32, &Device::Cpu).unwrap();
                run(&comm, &values, &output).unwrap();
                continue;
            }
            // Rank 0: the output in the storage of lower address, so that it comes first in
            // candle's lock order; the input in the other.
            let buffers = [0, 1].map(|_| Tensor::zeros(WORLD * BLOCK, DType::F32, &Device::Cpu));
            let [a, b] = buffers.map(|t| t.unwrap());
            let (low, high) = if storage_address(&a) < storage_address(&b) {
                (a, b)
            } else {
                (b, a)
            };
            let output = low.narrow(0, 0, out_len).unwrap();
            let source = high.narrow(0, 0, in_len).unwrap();
            source.slice_set(&values, 0, 0).unwrap();
            let held = output.storage_and_layout();
            let collective = {
                let (comm, source, output) = (comm.clone(), source.clone(), output.clone());
                std::thread::spawn(move || run(&comm, &source, &output))
            };
            // Gives the collective time to take whatever lock it takes before the output's (the
            // test passes without it; it makes the deadlock it looks for likely).
            std::thread::sleep(Duration::from_millis(300));
            let (wrote, written) = mpsc::channel();
            let writer = {
                let source = source.clone();
                std::thread::spawn(move || {
                    element::with_elements_mut::<f32, _>(&source, |_| Ok(())).unwrap();
                    let _ = wrote.send(());
                })
            };
            let writer_went_on = written.recv_timeout(Duration::from_secs(20)).is_ok();
            // Either way the collective and the writer can finish now.
            drop(held);
            collective.join().unwrap().unwrap();
            writer.join().unwrap();
            assert!(
                writer_went_on,
                "{what}: deadlock: the collective held its input's storage while it waited for \
                 its output's, which another thread held while waiting to write the input"
            );
            let want: Vec<f64> = if gather {
                (0..WORLD)
                    .flat_map(|r| as_f64(&input(r, BLOCK, DType::F32)))
                    .collect()
            } else {
                expected_floats(WORLD, WORLD * BLOCK, ReduceOp::Sum, true)[..BLOCK].to_vec()
            };
            assert_eq!(as_f64(&output), want, "{what} on rank 0");
        }
    });
}
