//! The emulator's own semantics, with the test kernels of `tests/cuda/emulator_tests.cu`: races
//! found by the two orders, barrier and warp-collective errors, CUDA's documented shuffle and vote
//! results, launch checks, memory checks, atomics, indices, and the half-type conversions.

use fused_kernels_emulator::{kernels, launch, signature, Arg, Buffer, Order};
use half::{bf16, f16};

/// The error of a launch that must fail.
fn error_of(result: Result<(), fused_kernels_emulator::Error>) -> String {
    match result {
        Ok(()) => panic!("the launch succeeded, but it must fail"),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(error: &str, parts: &[&str]) {
    for p in parts {
        assert!(
            error.contains(p),
            "the error does not mention {p:?}: {error}"
        );
    }
}

/// `out[t]` of `emu_test_neighbour`: thread t's neighbour's value, read with or without a
/// barrier after the write.
fn neighbour(sync: bool, order: Order) -> Vec<u32> {
    let mut out = Buffer::<u32>::poisoned(64).unwrap();
    launch(
        "emu_test_neighbour",
        1,
        64,
        0,
        &[Arg::ptr_mut(&mut out), Arg::I32(sync as i32)],
        order,
    )
    .unwrap();
    out.to_vec()
}

#[test]
fn a_missing_barrier_gives_different_results_in_the_two_orders() {
    let correct: Vec<u32> = (0..64).map(|t| (t + 1) % 64 + 1).collect();
    for order in Order::BOTH {
        assert_eq!(
            neighbour(true, order),
            correct,
            "with the barrier, {order:?}"
        );
    }
    let (up, down) = (
        neighbour(false, Order::Increasing),
        neighbour(false, Order::Decreasing),
    );
    assert_ne!(up, down, "the race went unnoticed");
    // Increasing: each thread reads its right neighbour before the neighbour wrote (still 0).
    assert_eq!(up[..63], [0; 63]);
    // Decreasing: the right neighbour ran first.
    assert_eq!(down[..63], correct[..63]);
}

/// `out` of `emu_test_reuse`: both block sums as every thread saw them.
fn reuse(sync: bool, order: Order) -> Vec<f32> {
    let mut out = Buffer::<f32>::poisoned(2 * 128).unwrap();
    launch(
        "emu_test_reuse",
        1,
        128,
        0,
        &[Arg::ptr_mut(&mut out), Arg::I32(sync as i32)],
        order,
    )
    .unwrap();
    out.to_vec()
}

#[test]
fn a_missing_barrier_between_warps_gives_wrong_results() {
    // Σ (t + 1) over 128 threads, then twice that.
    let correct: Vec<f32> = (0..128).flat_map(|_| [8256.0, 16512.0]).collect();
    for order in Order::BOTH {
        assert_eq!(reuse(true, order), correct, "with the barrier, {order:?}");
        // A warp runs on to its next write before the warps after it read: the later warps
        // read a second-sum value in their first sum.
        let racy = reuse(false, order);
        assert_ne!(racy, correct, "{order:?}: the race went unnoticed");
    }
    assert_ne!(
        reuse(false, Order::Increasing),
        reuse(false, Order::Decreasing)
    );
}

#[test]
fn a_divergent_syncthreads_is_an_error() {
    let mut out = Buffer::<u32>::poisoned(32).unwrap();
    for order in Order::BOTH {
        let e = error_of(launch(
            "emu_test_divergent_barrier",
            1,
            32,
            0,
            &[Arg::ptr_mut(&mut out)],
            order,
        ));
        assert_mentions(
            &e,
            &[
                "kernel 'emu_test_divergent_barrier'",
                "block (0, 0, 0)",
                "divergent __syncthreads",
                "threads 0-15 at",
                "threads 16-31 at",
                "emulator_tests.cu:",
            ],
        );
    }
}

#[test]
fn a_deadlock_is_an_error_not_a_hang() {
    let mut out = Buffer::<f32>::poisoned(32).unwrap();
    for order in Order::BOTH {
        let e = error_of(launch(
            "emu_test_deadlock",
            1,
            32,
            0,
            &[Arg::ptr_mut(&mut out)],
            order,
        ));
        assert_mentions(
            &e,
            &[
                "kernel 'emu_test_deadlock'",
                "deadlock",
                "threads 0-15 wait in __shfl_xor_sync",
                "threads 16-31 wait in __syncthreads",
            ],
        );
    }
}

/// The source lane of a shuffle as CUDA's programming guide defines it (the value of that lane
/// is returned; `None`: the lane's own value).
fn cuda_source(mode: usize, lane: usize, arg: usize, width: usize) -> usize {
    let group = lane / width * width;
    match mode {
        // __shfl_sync: lane srcLane % width of the caller's group.
        0 => group + arg % width,
        // __shfl_up_sync: lane − delta, unless that leaves the group (own value).
        1 if lane % width >= arg => lane - arg,
        // __shfl_down_sync: lane + delta, unless that leaves the group.
        2 if lane % width + arg < width => lane + arg,
        // __shfl_xor_sync: lane ^ laneMask; a later group cannot be read (own value).
        3 if (lane ^ arg) < group + width => lane ^ arg,
        _ => lane,
    }
}

#[test]
fn shuffles_and_votes_give_cudas_documented_results() {
    let n = 64;
    let input: Vec<i32> = (0..n as i32)
        .map(|t| t * 7 % 61 + (t % 5 == 0) as i32)
        .collect();
    for (width, arg) in [(32, 5), (32, 0), (8, 3), (16, 17), (4, 1), (2, 1), (32, 31)] {
        for order in Order::BOTH {
            let inb = Buffer::from_slice(&input).unwrap();
            let mut out = Buffer::<i32>::poisoned(9 * n).unwrap();
            launch(
                "emu_test_shuffles",
                1,
                n as u32,
                0,
                &[
                    Arg::ptr(&inb),
                    Arg::ptr_mut(&mut out),
                    Arg::I32(width as i32),
                    Arg::I32(arg as i32),
                ],
                order,
            )
            .unwrap();
            let out = out.to_vec();
            for t in 0..n {
                let (warp, lane) = (t / 32 * 32, t % 32);
                for mode in 0..4 {
                    let src = warp + cuda_source(mode, lane, arg, width);
                    assert_eq!(
                        out[mode * n + t],
                        input[src],
                        "shuffle mode {mode}, width {width}, arg {arg}, thread {t}"
                    );
                }
                let lanes = &input[warp..warp + 32];
                let ballot = lanes
                    .iter()
                    .enumerate()
                    .fold(0u32, |b, (i, v)| b | (((v & 1) as u32) << i));
                assert_eq!(out[4 * n + t] as u32, ballot, "ballot, thread {t}");
                assert_eq!(out[5 * n + t], lanes.iter().any(|&v| v > 1000) as i32);
                assert_eq!(out[6 * n + t], lanes.iter().all(|&v| v >= 0) as i32);
                let sum = lanes.iter().fold(0u32, |s, &v| s.wrapping_add(v as u32));
                assert_eq!(out[7 * n + t] as u32, sum, "__reduce_add_sync, thread {t}");
                assert_eq!(out[8 * n + t], input[warp + (lane ^ 1)], "double shuffle");
            }
        }
    }
}

#[test]
fn a_partial_mask_and_an_exited_lane_are_errors() {
    let mut out = Buffer::<i32>::poisoned(32).unwrap();
    let e = error_of(launch(
        "emu_test_partial_mask",
        1,
        32,
        0,
        &[Arg::ptr_mut(&mut out)],
        Order::Increasing,
    ));
    assert_mentions(
        &e,
        &[
            "kernel 'emu_test_partial_mask', block (0, 0, 0), thread (0, 0, 0)",
            "__shfl_sync",
            "mask 0x0000ffff",
        ],
    );
    for (order, thread) in [
        (Order::Increasing, "thread (1, 0, 0)"),
        (Order::Decreasing, "thread (30, 0, 0)"),
    ] {
        let e = error_of(launch(
            "emu_test_exited_lane",
            1,
            32,
            0,
            &[Arg::ptr_mut(&mut out)],
            order,
        ));
        assert_mentions(&e, &["kernel 'emu_test_exited_lane'", "exited", thread]);
    }
    // A warp collective in a partial warp (a block of 48 threads).
    let mut big = Buffer::<i32>::poisoned(64).unwrap();
    let e = error_of(launch(
        "emu_test_exited_lane",
        1,
        48,
        0,
        &[Arg::ptr_mut(&mut big)],
        Order::Decreasing,
    ));
    assert_mentions(&e, &["a warp of 16 threads", "multiple of 32"]);
}

#[test]
fn emu_warp_gather_gives_every_lane_every_value() {
    let (grid, block) = (2usize, 64usize);
    let threads = grid * block;
    let mut lanes = Buffer::<i32>::poisoned(threads * 32).unwrap();
    let mut values = Buffer::<f32>::poisoned(threads * 32).unwrap();
    launch(
        "emu_test_gather",
        grid as u32,
        block as u32,
        0,
        &[Arg::ptr_mut(&mut lanes), Arg::ptr_mut(&mut values)],
        Order::Decreasing,
    )
    .unwrap();
    let (lanes, values) = (lanes.to_vec(), values.to_vec());
    for t in 0..threads {
        let warp_start = t % block / 32 * 32;
        for i in 0..32 {
            assert_eq!(lanes[t * 32 + i], i as i32, "thread {t}, entry {i}");
            assert_eq!(values[t * 32 + i], 2.0 * (warp_start + i) as f32);
        }
    }
}

#[test]
fn threads_run_in_the_chosen_order() {
    for (order, first) in [(Order::Increasing, 0u32), (Order::Decreasing, 63)] {
        let mut counter = Buffer::<u32>::filled(1, 0).unwrap();
        let mut out = Buffer::<u32>::poisoned(64).unwrap();
        launch(
            "emu_test_ticket",
            1,
            64,
            0,
            &[Arg::ptr_mut(&mut counter), Arg::ptr_mut(&mut out)],
            order,
        )
        .unwrap();
        let tickets = out.to_vec();
        assert_eq!(tickets[first as usize], 0, "{order:?}");
        let expected: Vec<u32> = (0..64)
            .map(|t| if first == 0 { t } else { 63 - t })
            .collect();
        assert_eq!(tickets, expected, "{order:?}");
    }
}

#[test]
fn atomics_are_exact_across_blocks_running_in_parallel() {
    let (grid, block) = (64u32, 128u32);
    let threads = (grid * block) as usize;
    let mut count = Buffer::<u64>::filled(1, 0).unwrap();
    let mut fsum = Buffer::<f32>::filled(1, 0.0).unwrap();
    let mut dsum = Buffer::<f64>::filled(1, 0.0).unwrap();
    let mut imax = Buffer::<i32>::filled(1, -1).unwrap();
    let mut umin = Buffer::<u32>::filled(1, u32::MAX).unwrap();
    let mut winner = Buffer::<i32>::filled(1, -1).unwrap();
    launch(
        "emu_test_atomics",
        grid,
        block,
        0,
        &[
            Arg::ptr_mut(&mut count),
            Arg::ptr_mut(&mut fsum),
            Arg::ptr_mut(&mut dsum),
            Arg::ptr_mut(&mut imax),
            Arg::ptr_mut(&mut umin),
            Arg::ptr_mut(&mut winner),
        ],
        Order::Increasing,
    )
    .unwrap();
    assert_eq!(count.to_vec(), [threads as u64]);
    assert_eq!(fsum.to_vec(), [threads as f32]);
    assert_eq!(dsum.to_vec(), [threads as f64 * 0.5]);
    assert_eq!(imax.to_vec(), [threads as i32 - 1]);
    assert_eq!(umin.to_vec(), [7]);
    assert!((0..threads as i32).contains(&winner.to_vec()[0]));
}

#[test]
fn indices_warps_and_barrier_counts_of_a_3d_launch() {
    let block = (8u32, 4u32, 2u32);
    let grid = (3u32, 2u32, 2u32);
    let per_block = 64usize;
    let blocks = 12usize;
    let mut out = Buffer::<u32>::poisoned(4 * per_block * blocks).unwrap();
    launch(
        "emu_test_indices",
        grid,
        block,
        0,
        &[Arg::ptr_mut(&mut out)],
        Order::Decreasing,
    )
    .unwrap();
    let out = out.to_vec();
    let multiples_of_3 = (0..per_block).filter(|t| t % 3 == 0).count() as u32;
    for b in 0..blocks {
        for t in 0..per_block {
            let g = b * per_block + t;
            assert_eq!(out[4 * g], t as u32, "linear thread index");
            assert_eq!(out[4 * g + 1], b as u32, "linear block index");
            assert_eq!(out[4 * g + 2], (t / 32 * 32) as u32, "lane 0 of the warp");
            assert_eq!(out[4 * g + 3], multiples_of_3, "__syncthreads_count");
        }
    }
}

#[test]
fn dynamic_shared_memory_is_the_launchs() {
    let mut out = Buffer::<f32>::poisoned(64).unwrap();
    launch(
        "emu_test_dynamic_shared",
        1,
        64,
        64 * 4,
        &[Arg::ptr_mut(&mut out)],
        Order::Increasing,
    )
    .unwrap();
    let want: Vec<f32> = (0..64).map(|t| 10.0 * (63 - t) as f32).collect();
    assert_eq!(out.to_vec(), want);
}

#[test]
fn launches_that_cuda_would_refuse_are_refused() {
    let x = Buffer::from_slice(&[1.0f32; 4]).unwrap();
    let mut y = Buffer::<f32>::poisoned(4).unwrap();
    let xb = Buffer::from_slice(&[bf16::ONE; 4]).unwrap();
    let e = error_of(launch(
        "gelu_f32",
        1,
        32,
        0,
        &[Arg::ptr(&x), Arg::U64(4)],
        Order::Increasing,
    ));
    assert_mentions(
        &e,
        &[
            "gelu_f32(const float*, float*, long long unsigned int)",
            "takes 3",
            "2 were given",
        ],
    );
    let e = error_of(launch(
        "gelu_f32",
        1,
        32,
        0,
        &[Arg::ptr(&x), Arg::ptr_mut(&mut y), Arg::U32(4)],
        Order::Increasing,
    ));
    assert_mentions(
        &e,
        &[
            "argument 2",
            "long long unsigned int",
            "Arg::U64",
            "Arg::U32",
        ],
    );
    let e = error_of(launch(
        "gelu_f32",
        1,
        32,
        0,
        &[Arg::ptr(&xb), Arg::ptr_mut(&mut y), Arg::U64(4)],
        Order::Increasing,
    ));
    assert_mentions(
        &e,
        &["argument 0", "const float*", "bf16", "pass a buffer of f32"],
    );
    let y2 = Buffer::<f32>::poisoned(4).unwrap();
    let e = error_of(launch(
        "gelu_f32",
        1,
        32,
        0,
        &[Arg::ptr(&x), Arg::ptr(&y2), Arg::U64(4)],
        Order::Increasing,
    ));
    assert_mentions(&e, &["argument 1", "float*", "Arg::ptr_mut"]);
    let e = error_of(launch("gelu_f33", 1, 32, 0, &[], Order::Increasing));
    assert_mentions(
        &e,
        &[
            "no kernel named 'gelu_f33'",
            "gelu_f32",
            "gelu_backward_bf16",
        ],
    );
    let args = [Arg::ptr(&x), Arg::ptr_mut(&mut y), Arg::U64(4)];
    let e = error_of(launch("gelu_f32", 1, 2048, 0, &args, Order::Increasing));
    assert_mentions(&e, &["2048 x 1 x 1 threads", "at most 1024"]);
    let e = error_of(launch("gelu_f32", 0, 32, 0, &args, Order::Increasing));
    assert_mentions(&e, &["dimension is 0"]);
    let e = error_of(launch(
        "gelu_f32",
        1,
        32,
        49 * 1024,
        &args,
        Order::Increasing,
    ));
    assert_mentions(&e, &["48 KiB"]);
}

#[test]
fn a_write_just_past_a_buffer_is_an_error() {
    let mut out = Buffer::<f32>::poisoned(3).unwrap();
    let e = error_of(launch(
        "emu_test_write_past_end",
        1,
        32,
        0,
        &[Arg::ptr_mut(&mut out), Arg::U64(3)],
        Order::Increasing,
    ));
    assert_mentions(
        &e,
        &[
            "kernel 'emu_test_write_past_end', argument 0",
            "12-byte buffer",
            "after its end",
        ],
    );
}

/// Which fault the child process provokes (see `faults_name_the_kernel_and_thread`).
const FAULT_VAR: &str = "FUSED_KERNELS_EMULATOR_TEST_FAULT";

/// Run by `faults_name_the_kernel_and_thread` in a child process: a memory fault ends the
/// process. Does nothing when run directly.
#[test]
#[ignore = "run by faults_name_the_kernel_and_thread in a child process"]
fn fault_child() {
    match std::env::var(FAULT_VAR).as_deref() {
        Ok("read") => {
            let x = Buffer::<f32>::poisoned(4).unwrap();
            let mut y = Buffer::<f32>::poisoned(1).unwrap();
            let _ = launch(
                "emu_test_read_far",
                1,
                32,
                0,
                &[Arg::ptr(&x), Arg::ptr_mut(&mut y)],
                Order::Increasing,
            );
        }
        Ok("stack") => {
            let mut y = Buffer::<i32>::filled(1, 0).unwrap();
            let _ = launch(
                "emu_test_stack_overflow",
                1,
                32,
                0,
                &[Arg::ptr_mut(&mut y)],
                Order::Increasing,
            );
        }
        _ => {}
    }
}

#[test]
fn faults_name_the_kernel_and_thread() {
    for (fault, parts) in [
        (
            "read",
            [
                "kernel 'emu_test_read_far', block (0, 0, 0), thread (0, 0, 0)",
                "2032 bytes past the end of a 16-byte buffer",
            ],
        ),
        (
            "stack",
            [
                "kernel 'emu_test_stack_overflow', block (0, 0, 0), thread (0, 0, 0)",
                "fiber stack overflowed",
            ],
        ),
    ] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "emulator::fault_child",
                "--ignored",
                "--nocapture",
            ])
            .env(FAULT_VAR, fault)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "the {fault} fault did not end the process: {stderr}"
        );
        assert_mentions(&stderr, &parts);
    }
}

#[test]
fn math_functions_are_the_c_librarys() {
    let x: Vec<f32> = vec![-3.5, -1.0, -0.3, 0.0, 0.2, 0.5, 1.0, 2.75, 10.0];
    let n = x.len();
    let xb = Buffer::from_slice(&x).unwrap();
    let mut out = Buffer::<f32>::poisoned(16 * n).unwrap();
    launch(
        "emu_test_math",
        1,
        32,
        0,
        &[Arg::ptr(&xb), Arg::ptr_mut(&mut out), Arg::U64(n as u64)],
        Order::Increasing,
    )
    .unwrap();
    let out = out.to_vec();
    // erf has no Rust std function: its values (f64).
    let erf = |v: f32| -> f64 {
        let e: f64 = match v.abs() {
            3.5 => 0.999_999_256_901_627_6,
            1.0 => 0.842_700_792_949_714_9,
            0.3 => 0.328_626_759_459_131_2,
            0.0 => 0.0,
            0.2 => 0.222_702_589_210_478_45,
            0.5 => 0.520_499_877_813_046_5,
            2.75 => 0.999_899_378_077_880_3,
            _ => 1.0,
        };
        e.copysign(f64::from(v))
    };
    for (i, &v) in x.iter().enumerate() {
        let half_pair = f16::from_f32(v).to_f32() + f16::from_f32(-v).to_f32();
        let want = [
            v.exp(),
            v.exp2(),
            v.abs().ln(),
            v.abs().log2(),
            v.abs().sqrt(),
            1.0 / v.abs().sqrt(),
            v.tanh(),
            v.max(0.25),
            v.min(0.25),
            erf(v) as f32,
            v.exp(),
            v.abs().ln(),
            v / 3.0,
            v.max(-0.5) + 2.0,
            half_pair,
            v + v,
        ];
        for (k, w) in want.iter().enumerate() {
            let got = out[k * n + i];
            let close = if k == 9 {
                (f64::from(got) - erf(v)).abs() <= 2.0 * f64::from(f32::EPSILON)
            } else {
                got.to_bits() == w.to_bits() || (got.is_nan() && w.is_nan())
            };
            assert!(close, "function {k} of {v}: got {got:e}, want {w:e}");
        }
    }
}

/// Float bit patterns for the conversion test: every exponent with mantissas at and around the
/// rounding boundaries of bf16 (16 dropped bits) and f16 (13 dropped bits), a sweep of the whole
/// space, and the special values.
fn float_patterns() -> Vec<u32> {
    let mut v = Vec::new();
    for sign in [0u32, 0x8000_0000] {
        for exp in 0..=255u32 {
            for man in [
                0u32, 1, 0x7FFF, 0x8000, 0x8001, 0x1_8000, 0x1_7FFF, 0x0FFF, 0x1000, 0x1001,
                0x3000, 0x2FFF, 0x7F_FFFF, 0x7F_8000, 0x40_0000, 0x00_2000,
            ] {
                v.push(sign | exp << 23 | man);
            }
        }
    }
    v.extend((0..1u64 << 32).step_by(65_521).map(|b| b as u32));
    v
}

#[test]
fn conversions_match_the_half_crate_bit_for_bit() {
    let bits = float_patterns();
    let n = bits.len();
    let inb = Buffer::from_slice(&bits).unwrap();
    let mut bf = Buffer::<u16>::poisoned(n).unwrap();
    let mut h = Buffer::<u16>::poisoned(n).unwrap();
    launch(
        "emu_test_convert",
        16,
        256,
        0,
        &[
            Arg::ptr(&inb),
            Arg::ptr_mut(&mut bf),
            Arg::ptr_mut(&mut h),
            Arg::U64(n as u64),
        ],
        Order::Increasing,
    )
    .unwrap();
    for (i, &b) in bits.iter().enumerate() {
        let f = f32::from_bits(b);
        assert_eq!(
            bf.as_slice()[i],
            bf16::from_f32(f).to_bits(),
            "bf16 of {b:#010x}"
        );
        assert_eq!(
            h.as_slice()[i],
            f16::from_f32(f).to_bits(),
            "f16 of {b:#010x}"
        );
    }

    let all: Vec<u16> = (0..=u16::MAX).collect();
    let inb = Buffer::from_slice(&all).unwrap();
    let mut from_bf = Buffer::<u32>::poisoned(all.len()).unwrap();
    let mut from_h = Buffer::<u32>::poisoned(all.len()).unwrap();
    launch(
        "emu_test_widen",
        16,
        256,
        0,
        &[
            Arg::ptr(&inb),
            Arg::ptr_mut(&mut from_bf),
            Arg::ptr_mut(&mut from_h),
            Arg::U64(all.len() as u64),
        ],
        Order::Decreasing,
    )
    .unwrap();
    for &b in &all {
        let i = b as usize;
        assert_eq!(
            from_bf.as_slice()[i],
            bf16::from_bits(b).to_f32().to_bits(),
            "bf16 {b:#06x}"
        );
        assert_eq!(
            from_h.as_slice()[i],
            f16::from_bits(b).to_f32().to_bits(),
            "f16 {b:#06x}"
        );
    }
}

/// The kernels of fused-kernels' `src/cuda/*.cu` these tests compare with the CPU, without their
/// dtype suffix. A kernel added to a `.cu` without a test here fails
/// `every_cuda_kernel_has_a_test` (the README says how to add one).
const TESTED: [&str; 38] = [
    "add_bias",
    "add_bias_inplace",
    "add_into_columns",
    "bias_gelu",
    "bias_gelu_backward",
    "causal_softmax",
    "causal_softmax_backward",
    "cross_entropy_backward",
    "cross_entropy_rows",
    "cross_entropy_rows_grad",
    "cross_entropy_total",
    "embedding_backward_i64",
    "embedding_backward_u32",
    "embedding_i64",
    "embedding_u32",
    "flash_delta",
    "gelu",
    "gelu_backward",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_backward_residual",
    "layer_norm_sum",
    "residual_add",
    "residual_add_bias",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_backward_residual",
    "rms_norm_sum",
    "rotary",
    "rotary_heads",
    "scale",
    "scale_acc",
    "silu",
    "silu_backward",
    "swiglu",
    "swiglu_backward",
    "swiglu_packed",
    "swiglu_packed_backward",
];

/// Kernels instantiated for bf16 and f16 only (tensor-core kernels), tested like [`TESTED`].
const TESTED_HALF: [&str; 6] = [
    "flash_dkv_mma_d128",
    "flash_dkv_mma_d64",
    "flash_dq_mma_d128",
    "flash_dq_mma_d64",
    "flash_forward_mma_d128",
    "flash_forward_mma_d64",
];

#[test]
fn every_cuda_kernel_has_a_test() {
    let registered = kernels();
    let every = TESTED
        .iter()
        .map(|b| (b, &["f32", "f64", "bf16", "f16"][..]));
    let half = TESTED_HALF.iter().map(|b| (b, &["bf16", "f16"][..]));
    for (base, suffixes) in every.chain(half) {
        for suffix in suffixes {
            let k = format!("{base}_{suffix}");
            assert!(
                registered.contains(&k),
                "{k} is not registered: {registered:?}"
            );
        }
    }
    let untested: Vec<&String> = registered
        .iter()
        .filter(|k| !k.starts_with("emu_test_"))
        .filter(|k| {
            let base = ["_f32", "_f64", "_bf16", "_f16"]
                .iter()
                .find_map(|s| k.strip_suffix(s))
                .unwrap_or(k);
            !TESTED.contains(&base) && !TESTED_HALF.contains(&base)
        })
        .collect();
    assert!(
        untested.is_empty(),
        "kernels of fused-kernels/src/cuda without a test against the CPU in \
         fused-kernels/emulator/tests/integration: {untested:?} (see the emulator's README, \"Adding a \
         kernel's test\")"
    );
    assert_eq!(
        signature("rotary_bf16").as_deref(),
        Some(
            "rotary_bf16(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, \
             __nv_bfloat16*, long long unsigned int, long long unsigned int, long long unsigned \
             int, int)"
        )
    );
    assert_eq!(signature("no_such_kernel"), None);
}
