//! The fused linear cross-entropy's kernels (`linear_cross_entropy.cu`):
//! - `cross_entropy_rows_grad` (each row's weighted loss, and the logits overwritten in place by
//!   their gradient) against `fused_kernels::cross_entropy` of each row (its loss) and the
//!   gradient of the whole batch's loss through candle's `backward()`;
//! - `scale` and `scale_acc` (a kept gradient times the loss's gradient, read on the device)
//!   against `x · s` computed in f64 and rounded to the dtype.
//!
//! Tolerances (as in `cross_entropy.rs`, the same arithmetic): the sum of exponentials is
//! reordered (about 2·v·u relative), so a row's loss `w·(lse − x_t)` gets `rtol = 4·v·u` relative
//! to `|w|·(1 + |lse| + |x_t|)`, and the gradient `w·(softmax − [j = t])` `rtol = 4·v·u` relative
//! to `|w|`; bf16/f16 gradients may round to the neighbouring value. The scaling rounds the
//! product once in the arithmetic type and once to the dtype: `rtol = 2·u` of `|x·s|` and one
//! rounding step of the dtype.

use crate::common::{assert_close, flat, fused, in_both_orders, name, read, run, Dt, Input, Shape};
use candle_core::{Device, Tensor, Var};
use fused_kernels_emulator::{Arg, Buffer, Order};

/// (rows, classes): one row of one class, rows narrower and wider than a block, and more rows
/// than the 3 blocks of the second launch shape.
const CASES: [(usize, usize); 4] = [(1, 1), (5, 17), (3, 700), (40, 33)];

/// The targets and weights of `n` rows: weight 0 on every seventh row, whose target is out of
/// range on purpose (a zero-weight row is not read past its weight); the last class on others.
fn targets_and_weights(n: usize, v: usize) -> (Vec<u32>, Vec<f64>) {
    let t = (0..n)
        .map(|r| match r % 7 {
            3 => v as u32 + 5,
            5 => v as u32 - 1,
            _ => ((r * 37 + 11) % v) as u32,
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

/// `v` as the arithmetic type of `T` (the CUDA path converts the weights to it).
fn acc_values<T: Dt>(v: &[f64]) -> Vec<T::Acc> {
    Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu)
        .unwrap()
        .to_dtype(<T::Acc as candle_core::WithDType>::DTYPE)
        .unwrap()
        .to_vec1::<T::Acc>()
        .unwrap()
}

/// Runs `cross_entropy_rows_grad` on a copy of `logits`: (row losses, the overwritten logits).
fn rows_grad<T: Dt>(
    logits: &Input<T>,
    targets: &[u32],
    weights: &[T::Acc],
    shape: Shape,
    order: Order,
) -> Vec<Vec<f64>> {
    let (n, v) = (targets.len(), logits.data.len() / targets.len().max(1));
    let mut lb = logits.buffer();
    let tb = Buffer::from_slice(targets).unwrap();
    let wb = Buffer::from_slice(weights).unwrap();
    let mut row_loss = Buffer::<T::Acc>::poisoned(n).unwrap();
    run(
        &name::<T>("cross_entropy_rows_grad"),
        shape,
        &[
            Arg::ptr_mut(&mut lb),
            Arg::ptr(&tb),
            Arg::ptr(&wb),
            Arg::ptr_mut(&mut row_loss),
            Arg::U64(n as u64),
            Arg::U64(v as u64),
        ],
        order,
    );
    vec![read(&row_loss), read(&lb)]
}

fn check<T: Dt>(n: usize, v: usize) {
    let logits = Input::<T>::random(&[n, v], 51, -4.0, 4.0);
    let (targets, weights) = targets_and_weights(n, v);
    // The CPU refuses an out-of-range target even at weight 0: give it class 0 there, which
    // changes nothing for a zero weight.
    let cpu_targets: Vec<u32> = targets
        .iter()
        .map(|&t| if t as usize >= v { 0 } else { t })
        .collect();
    let t_cpu = Tensor::from_vec(cpu_targets.clone(), n, &Device::Cpu).unwrap();
    let w_cpu = Tensor::from_vec(weights.clone(), n, &Device::Cpu).unwrap();
    let lv = Var::from_tensor(&logits.tensor).unwrap();
    let loss = fused_kernels::cross_entropy(&lv, &t_cpu, &w_cpu).unwrap();
    let want_grad = flat(loss.backward().unwrap().get(&lv).unwrap());
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
    let weights_acc = acc_values::<T>(&weights);
    for shape in [
        fused::rows_config(n, v),
        Shape {
            grid: 3.min(n as u32),
            block: 96,
        },
    ] {
        let what = format!("cross_entropy_rows_grad [{n}, {v}] {shape:?}");
        let got = in_both_orders(&what, |order| {
            rows_grad(&logits, &targets, &weights_acc, shape, order)
        });
        assert_close::<T::Acc>(
            &format!("{what}: row losses"),
            &got[0],
            &want_rows,
            rtol,
            |r| row_mag[r],
        );
        assert_close::<T>(
            &format!("{what}: d_logits"),
            &got[1],
            &want_grad,
            rtol,
            |i| weights[i / v].abs(),
        );
    }
}

/// A target outside the classes with a nonzero weight: that row's loss and gradient are NaN,
/// the other rows untouched by it.
fn out_of_range_target<T: Dt>() {
    let (n, v) = (3, 10);
    let logits = Input::<T>::random(&[n, v], 52, -2.0, 2.0);
    let got = rows_grad(
        &logits,
        &[2, 10, 7],
        &acc_values::<T>(&[1.0, 1.0, 1.0]),
        fused::rows_config(n, v),
        Order::Increasing,
    );
    let (losses, g) = (&got[0], &got[1]);
    assert!(losses[1].is_nan(), "row 1's loss {} is not NaN", losses[1]);
    assert!(g[v..2 * v].iter().all(|x| x.is_nan()), "row 1's gradient");
    assert!(losses[0].is_finite() && losses[2].is_finite(), "{losses:?}");
    assert!(g[..v].iter().chain(&g[2 * v..]).all(|x| x.is_finite()));
}

/// `scale` (x in T) and `scale_acc` (x in the arithmetic type) against x · s in f64, rounded.
fn scaling<T: Dt>() {
    let n = 5000;
    let s = acc_values::<T>(&[-0.37])[0];
    let s64 = flat(&Tensor::new(&[s], &Device::Cpu).unwrap())[0];
    let x = Input::<T>::random(&[n], 53, -3.0, 3.0);
    let xa = Input::<T::Acc>::random(&[n], 54, -3.0, 3.0);
    for (kernel, xs) in [("scale", x.f64s()), ("scale_acc", xa.f64s())] {
        let want: Vec<f64> = flat(
            &Tensor::from_vec(
                xs.iter().map(|v| v * s64).collect::<Vec<_>>(),
                n,
                &Device::Cpu,
            )
            .unwrap()
            .to_dtype(T::DTYPE)
            .unwrap(),
        );
        for shape in [fused::elements_config(n), Shape { grid: 2, block: 64 }] {
            let what = format!("{kernel} of {n} {shape:?}");
            let got = in_both_orders(&what, |order| {
                let sb = Buffer::from_slice(&[s]).unwrap();
                let (xb, xab) = (x.buffer(), xa.buffer());
                let input = if kernel == "scale" {
                    Arg::ptr(&xb)
                } else {
                    Arg::ptr(&xab)
                };
                let mut y = Buffer::<T>::poisoned(n).unwrap();
                run(
                    &name::<T>(kernel),
                    shape,
                    &[
                        input,
                        Arg::ptr(&sb),
                        Arg::ptr_mut(&mut y),
                        Arg::U64(n as u64),
                    ],
                    order,
                );
                vec![read(&y)]
            });
            assert_close::<T>(&what, &got[0], &want, 2.0 * T::U, |_| 0.0);
        }
    }
}

macro_rules! tests {
    ($($test:ident, $bad:ident, $scale:ident: $t:ty;)*) => {$(
        #[test]
        fn $test() {
            for (n, v) in CASES {
                check::<$t>(n, v);
            }
        }

        #[test]
        fn $bad() {
            out_of_range_target::<$t>();
        }

        #[test]
        fn $scale() {
            scaling::<$t>();
        }
    )*};
}
tests! {
    rows_grad_f32, rows_grad_out_of_range_f32, scale_f32: f32;
    rows_grad_f64, rows_grad_out_of_range_f64, scale_f64: f64;
    rows_grad_bf16, rows_grad_out_of_range_bf16, scale_bf16: half::bf16;
    rows_grad_f16, rows_grad_out_of_range_f16, scale_f16: half::f16;
}
