//! Weighted cross-entropy (`cross_entropy.cu`): the per-row losses, their total, and the gradient,
//! against `fused_kernels::cross_entropy` (per row and in total) and its gradient through
//! candle's `backward()`; and the CUDA-only behaviour for a target outside the classes (NaN).
//!
//! Tolerances. The row maximum is exact in any order; the sum of exponentials is reordered
//! (at most about 2·v·u relative), so logsumexp moves by about that much, absolutely:
//! - a row's loss w·(lse − x_t): `rtol = 4·v·u` relative to `|w|·(1 + |lse| + |x_t|)`;
//! - the total, a sum of n row losses in f64 rounded once: the rows' tolerances added, relative to
//!   Σ of the rows' magnitudes;
//! - the gradient w·(softmax − [j = t]): `rtol = 4·v·u` relative to `|w|` (softmax's relative
//!   error, and the cancellation of p − 1 at the target).
//!
//! The losses are in f32 (f64 for f64 logits), so no extra rounding step; the bf16/f16 gradient may
//! round to the neighbouring value.

use crate::common::{assert_close, flat, fused, in_both_orders, name, read, run, Dt, Input, Shape};
use candle_core::{Device, Tensor, Var};
use fused_kernels_emulator::{Arg, Buffer};

/// (rows, classes): one row of one class, rows narrower and wider than a block, and more rows
/// than the 3 blocks of the second launch shape.
const CASES: [(usize, usize); 4] = [(1, 1), (5, 17), (3, 700), (40, 33)];

/// The targets and weights of `n` rows: weight 0 on every seventh row (its target is then
/// arbitrary, here out of range on purpose: a zero-weight row is not read past its weight).
fn targets_and_weights(n: usize, v: usize) -> (Vec<u32>, Vec<f64>) {
    let t = (0..n)
        .map(|r| {
            if r % 7 == 3 {
                v as u32 + 5
            } else {
                ((r * 37 + 11) % v) as u32
            }
        })
        .collect();
    let w = (0..n)
        .map(|r| {
            if r % 7 == 3 {
                0.0
            } else {
                0.25 + (r % 5) as f64 * 0.3
            }
        })
        .collect();
    (t, w)
}

/// The weights in the loss dtype (the CUDA path converts them to it).
fn acc_values<T: Dt>(v: &[f64]) -> Vec<T::Acc> {
    let t = Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu)
        .unwrap()
        .to_dtype(<T::Acc as candle_core::WithDType>::DTYPE)
        .unwrap();
    t.to_vec1::<T::Acc>().unwrap()
}

fn check<T: Dt>(n: usize, v: usize) {
    let logits = Input::<T>::random(&[n, v], 31, -4.0, 4.0);
    let (targets, weights) = targets_and_weights(n, v);
    let dloss = 0.75;
    // The CPU checks the targets (an out-of-range one is an error even at weight 0): give it a
    // valid class on the zero-weight rows, which changes nothing for a zero weight.
    let cpu_targets: Vec<u32> = targets
        .iter()
        .map(|&t| if t as usize >= v { 0 } else { t })
        .collect();
    let t_cpu = Tensor::from_vec(cpu_targets.clone(), n, &Device::Cpu).unwrap();
    let w_cpu = Tensor::from_vec(weights.clone(), n, &Device::Cpu).unwrap();

    let lv = Var::from_tensor(&logits.tensor).unwrap();
    let loss = fused_kernels::cross_entropy(&lv, &t_cpu, &w_cpu).unwrap();
    let grads = (&loss * dloss).unwrap().backward().unwrap();
    let want_total = flat(&loss);
    let want_grad = flat(grads.get(&lv).unwrap());
    let want_rows: Vec<f64> = (0..n)
        .map(|r| {
            let l = fused_kernels::cross_entropy(
                &logits.tensor.narrow(0, r, 1).unwrap(),
                &t_cpu.narrow(0, r, 1).unwrap(),
                &w_cpu.narrow(0, r, 1).unwrap(),
            )
            .unwrap();
            flat(&l)[0]
        })
        .collect();

    let rtol = 4.0 * v as f64 * T::U;
    let ls = logits.f64s();
    let row_mag: Vec<f64> = (0..n)
        .map(|r| {
            let row = &ls[r * v..(r + 1) * v];
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            weights[r].abs() * (1.0 + lse.abs() + row[cpu_targets[r] as usize].abs())
        })
        .collect();
    let total_mag: f64 = row_mag.iter().sum();

    let weights_acc = acc_values::<T>(&weights);
    let scaled_acc = acc_values::<T>(&weights.iter().map(|w| w * dloss).collect::<Vec<_>>());
    for (rows_launch, total_launch) in [
        (fused::rows_config(n, v), fused::one_block()),
        (
            Shape {
                grid: 3.min(n as u32),
                block: 96,
            },
            Shape { grid: 1, block: 64 },
        ),
    ] {
        let what = format!("cross_entropy [{n}, {v}] {rows_launch:?}, total {total_launch:?}");
        let got = in_both_orders(&what, |order| {
            let lb = logits.buffer();
            let tb = Buffer::from_slice(&targets).unwrap();
            let wb = Buffer::from_slice(&weights_acc).unwrap();
            let sb = Buffer::from_slice(&scaled_acc).unwrap();
            let mut row_loss = Buffer::<T::Acc>::poisoned(n).unwrap();
            let mut total = Buffer::<T::Acc>::poisoned(1).unwrap();
            let mut grad = Buffer::<T>::poisoned(n * v).unwrap();
            run(
                &name::<T>("cross_entropy_rows"),
                rows_launch,
                &[
                    Arg::ptr(&lb),
                    Arg::ptr(&tb),
                    Arg::ptr(&wb),
                    Arg::ptr_mut(&mut row_loss),
                    Arg::U64(n as u64),
                    Arg::U64(v as u64),
                ],
                order,
            );
            run(
                &name::<T>("cross_entropy_total"),
                total_launch,
                &[
                    Arg::ptr(&row_loss),
                    Arg::U64(n as u64),
                    Arg::ptr_mut(&mut total),
                ],
                order,
            );
            run(
                &name::<T>("cross_entropy_backward"),
                rows_launch,
                &[
                    Arg::ptr(&lb),
                    Arg::ptr(&tb),
                    Arg::ptr(&sb),
                    Arg::ptr_mut(&mut grad),
                    Arg::U64(n as u64),
                    Arg::U64(v as u64),
                ],
                order,
            );
            vec![read(&row_loss), read(&total), read(&grad)]
        });
        assert_close::<T::Acc>(
            &format!("{what}: row losses"),
            &got[0],
            &want_rows,
            rtol,
            |r| row_mag[r],
        );
        assert_close::<T::Acc>(
            &format!("{what}: total"),
            &got[1],
            &want_total,
            rtol,
            |_| total_mag,
        );
        assert_close::<T>(
            &format!("{what}: d_logits"),
            &got[2],
            &want_grad,
            rtol,
            |i| weights[i / v].abs() * dloss,
        );
    }
}

/// A target outside the row's classes makes that row's loss and gradient NaN on CUDA (the CPU op
/// refuses it instead; the kernel cannot report it without a synchronization), and leaves the other
/// rows alone.
fn out_of_range_target<T: Dt>() {
    let (n, v) = (3, 10);
    let logits = Input::<T>::random(&[n, v], 41, -2.0, 2.0);
    let targets = [2u32, 10, 7];
    let weights = acc_values::<T>(&[1.0, 1.0, 1.0]);
    let lb = logits.buffer();
    let tb = Buffer::from_slice(&targets).unwrap();
    let wb = Buffer::from_slice(&weights).unwrap();
    let mut row_loss = Buffer::<T::Acc>::poisoned(n).unwrap();
    let mut grad = Buffer::<T>::poisoned(n * v).unwrap();
    let shape = fused::rows_config(n, v);
    run(
        &name::<T>("cross_entropy_rows"),
        shape,
        &[
            Arg::ptr(&lb),
            Arg::ptr(&tb),
            Arg::ptr(&wb),
            Arg::ptr_mut(&mut row_loss),
            Arg::U64(n as u64),
            Arg::U64(v as u64),
        ],
        fused_kernels_emulator::Order::Increasing,
    );
    run(
        &name::<T>("cross_entropy_backward"),
        shape,
        &[
            Arg::ptr(&lb),
            Arg::ptr(&tb),
            Arg::ptr(&wb),
            Arg::ptr_mut(&mut grad),
            Arg::U64(n as u64),
            Arg::U64(v as u64),
        ],
        fused_kernels_emulator::Order::Increasing,
    );
    let losses = read(&row_loss);
    let g = read(&grad);
    assert!(losses[1].is_nan(), "row 1's loss {} is not NaN", losses[1]);
    assert!(
        g[v..2 * v].iter().all(|x| x.is_nan()),
        "row 1's gradient is not NaN"
    );
    assert!(losses[0].is_finite() && losses[2].is_finite(), "{losses:?}");
    assert!(g[..v].iter().chain(&g[2 * v..]).all(|x| x.is_finite()));
}

macro_rules! tests {
    ($($test:ident, $nan:ident: $t:ty;)*) => {$(
        #[test]
        fn $test() {
            for (n, v) in CASES {
                check::<$t>(n, v);
            }
        }
        #[test]
        fn $nan() {
            out_of_range_target::<$t>();
        }
    )*};
}
tests! {
    cross_entropy_f32, cross_entropy_target_out_of_range_f32: f32;
    cross_entropy_f64, cross_entropy_target_out_of_range_f64: f64;
    cross_entropy_bf16, cross_entropy_target_out_of_range_bf16: half::bf16;
    cross_entropy_f16, cross_entropy_target_out_of_range_f16: half::f16;
}
