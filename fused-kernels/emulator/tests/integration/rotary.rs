//! Rotary embeddings (`rotary.cu`), forward (`inverse` 0) and backward (`inverse` 1, the rotation
//! by −θ), against `fused_kernels::rotary` and its gradient through candle's `backward()`.
//!
//! Tolerance. Element-wise, the same two products and one sum or difference in the same order on
//! both sides: `rtol = 8·u` relative to the size of the terms, `|a·c| + |b·s|` (a difference of two
//! products can cancel). bf16/f16 results may also round to the neighbouring value.

use crate::common::{assert_close, flat, fused, in_both_orders, name, read, run, Dt, Input, Shape};
use candle_core::Var;
use fused_kernels_emulator::{Arg, Buffer};

/// (batch·heads, t, d): one pair, a head dimension of 2·33, and more pairs than one sweep of the
/// second launch shape.
const CASES: [(usize, usize, usize); 3] = [(1, 1, 2), (2, 5, 66), (3, 17, 64)];

fn check<T: Dt>(bh: usize, t: usize, d: usize) {
    let h = d / 2;
    let rows = bh * t;
    let x = Input::<T>::random(&[bh, t, d], 61, -2.0, 2.0);
    let angles: Vec<f64> = (0..t * h)
        .map(|i| (i / h) as f64 * 0.37 / (1.0 + (i % h) as f64))
        .collect();
    let cos = Input::<T>::new(angles.iter().map(|a| a.cos()).collect(), &[t, h]);
    let sin = Input::<T>::new(angles.iter().map(|a| a.sin()).collect(), &[t, h]);
    let dy = Input::<T>::random(&[bh, t, d], 62, -1.0, 1.0);

    let xv = Var::from_tensor(&x.tensor).unwrap();
    let y = fused_kernels::rotary(&xv, &cos.tensor, &sin.tensor).unwrap();
    let grads = (&y * &dy.tensor)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want_y = flat(&y);
    let want_dx = flat(grads.get(&xv).unwrap());

    let rtol = 8.0 * T::U;
    let terms = |v: &[f64], i: usize| {
        let (r, k) = (i / d, i % d);
        let (pos, kk) = (r % t, k % h);
        let (a, b) = (v[r * d + kk], v[r * d + kk + h]);
        let (c, s) = (
            cos.data[pos * h + kk].to_f64(),
            sin.data[pos * h + kk].to_f64(),
        );
        (a * c).abs() + (b * s).abs() + (b * c).abs() + (a * s).abs()
    };
    let (xs, gs) = (x.f64s(), dy.f64s());
    for shape in [
        fused::elements_config(rows * h),
        Shape { grid: 2, block: 50 },
    ] {
        let what = format!("rotary [{bh}, {t}, {d}] {shape:?}");
        let got = in_both_orders(&what, |order| {
            let (xb, cb, sb, gb) = (x.buffer(), cos.buffer(), sin.buffer(), dy.buffer());
            let mut outs = Vec::new();
            for (input, inverse) in [(&xb, 0), (&gb, 1)] {
                let mut yb = Buffer::<T>::poisoned(rows * d).unwrap();
                run(
                    &name::<T>("rotary"),
                    shape,
                    &[
                        Arg::ptr(input),
                        Arg::ptr(&cb),
                        Arg::ptr(&sb),
                        Arg::ptr_mut(&mut yb),
                        Arg::U64(rows as u64),
                        Arg::U64(t as u64),
                        Arg::U64(h as u64),
                        Arg::I32(inverse),
                    ],
                    order,
                );
                outs.push(read(&yb));
            }
            outs
        });
        assert_close::<T>(&format!("{what}: y"), &got[0], &want_y, rtol, |i| {
            terms(&xs, i)
        });
        assert_close::<T>(&format!("{what}: dx"), &got[1], &want_dx, rtol, |i| {
            terms(&gs, i)
        });
    }
}

macro_rules! tests {
    ($($test:ident: $t:ty;)*) => {$(
        #[test]
        fn $test() {
            for (bh, t, d) in CASES {
                check::<$t>(bh, t, d);
            }
        }
    )*};
}
tests! {
    rotary_f32: f32;
    rotary_f64: f64;
    rotary_bf16: half::bf16;
    rotary_f16: half::f16;
}
