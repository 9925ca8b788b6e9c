//! Causal softmax (`causal_softmax.cu`): forward and backward against
//! `fused_kernels::causal_softmax` and its gradient through candle's `backward()`.
//!
//! Tolerances. The maximum of a row is exact in any order, so both sides exponentiate the same
//! arguments with the same `expf`/`exp`; they differ only in the order of the row's sum of
//! exponentials (forward) or of Σ p·dp (backward), at most about 2·t_k·u of the sum's terms:
//! - p: `rtol = 4·t_k·u` relative to p itself (the sum's relative error scales every element);
//! - d_scores = scale·p·(dp − Σ p·dp): `rtol = 4·t_k·u` relative to
//!   `scale · p · (|dp| + Σ|p·dp|)`, the size of its terms.
//!
//! bf16/f16 results may also round to the neighbouring value (one step of the type).

use crate::common::{assert_close, flat, fused, in_both_orders, name, read, run, Dt, Input, Shape};
use candle_core::Var;
use fused_kernels_emulator::{Arg, Buffer};

/// (batch·heads, t_q, t_k, scale): square masks, fewer queries than keys (a cache), rows wider
/// than a block, one row, and more rows than the 3 blocks of the second launch shape.
const CASES: [(usize, usize, usize, f64); 5] = [
    (1, 1, 1, 1.0),
    (2, 5, 5, 0.5),
    (3, 4, 37, 0.125),
    (1, 3, 300, 1.0),
    (4, 9, 9, 2.0),
];

fn check<T: Dt>(bh: usize, t_q: usize, t_k: usize, scale: f64) {
    let shape = [bh, t_q, t_k];
    let rows = bh * t_q;
    let x = Input::<T>::random(&shape, 21, -3.0, 3.0);
    let dp = Input::<T>::random(&shape, 22, -1.0, 1.0);

    let xv = Var::from_tensor(&x.tensor).unwrap();
    let p = fused_kernels::causal_softmax(&xv, scale).unwrap();
    let grads = (&p * &dp.tensor)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want_p = flat(&p);
    let want_ds = flat(grads.get(&xv).unwrap());
    // The backward kernel reads the forward's output: give it the CPU's, as candle does.
    let p_data = p.flatten_all().unwrap().to_vec1::<T>().unwrap();

    let rtol = 4.0 * t_k as f64 * T::U;
    let (ps, gs) = (want_p.clone(), dp.f64s());
    let dot_mag: Vec<f64> = (0..rows)
        .map(|r| {
            (0..t_k)
                .map(|j| (ps[r * t_k + j] * gs[r * t_k + j]).abs())
                .sum()
        })
        .collect();
    let ds_floor = |i: usize| scale * ps[i].abs() * (gs[i].abs() + dot_mag[i / t_k]);

    for launch in [
        fused::rows_config(rows, t_k),
        Shape {
            grid: 3.min(rows as u32),
            block: 64,
        },
    ] {
        let what = format!("causal_softmax {shape:?} scale {scale} {launch:?}");
        let got = in_both_orders(&what, |order| {
            let xb = x.buffer();
            let mut pb = Buffer::<T>::poisoned(rows * t_k).unwrap();
            run(
                &name::<T>("causal_softmax"),
                launch,
                &[
                    Arg::ptr(&xb),
                    Arg::ptr_mut(&mut pb),
                    Arg::U64(rows as u64),
                    Arg::U64(t_q as u64),
                    Arg::U64(t_k as u64),
                    Arg::F64(scale),
                ],
                order,
            );
            let pin = Buffer::from_slice(&p_data).unwrap();
            let gb = dp.buffer();
            let mut ds = Buffer::<T>::poisoned(rows * t_k).unwrap();
            run(
                &name::<T>("causal_softmax_backward"),
                launch,
                &[
                    Arg::ptr(&pin),
                    Arg::ptr(&gb),
                    Arg::ptr_mut(&mut ds),
                    Arg::U64(rows as u64),
                    Arg::U64(t_q as u64),
                    Arg::U64(t_k as u64),
                    Arg::F64(scale),
                ],
                order,
            );
            vec![read(&pb), read(&ds)]
        });
        assert_close::<T>(&format!("{what}: p"), &got[0], &want_p, rtol, |_| 0.0);
        assert_close::<T>(
            &format!("{what}: d_scores"),
            &got[1],
            &want_ds,
            rtol,
            ds_floor,
        );
    }
}

macro_rules! tests {
    ($($test:ident: $t:ty;)*) => {$(
        #[test]
        fn $test() {
            for (bh, t_q, t_k, scale) in CASES {
                check::<$t>(bh, t_q, t_k, scale);
            }
        }
    )*};
}
tests! {
    causal_softmax_f32: f32;
    causal_softmax_f64: f64;
    causal_softmax_bf16: half::bf16;
    causal_softmax_f16: half::f16;
}
