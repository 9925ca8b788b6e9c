//! The bias add (`add_bias.cu`), against `fused_kernels::add_bias`. Its gradient, the column
//! sums of dy, is one cuBLAS product on CUDA (`column_sums` in `add_bias.rs`), not a kernel.
//!
//! Tolerance. The add is one rounding on both sides (`rtol = 2·u` relative to `|x| + |b|`, the
//! terms of a sum that can cancel); bf16/f16 results may also round to the neighbouring value.

use crate::common::{assert_close, flat, fused, in_both_orders, name, read, run, Dt, Input, Shape};
use fused_kernels_emulator::{Arg, Buffer};

/// (rows, n): one element, rows wider than a block, many rows of a few columns.
const CASES: [(usize, usize); 4] = [(1, 1), (3, 300), (600, 7), (9, 64)];

fn check<T: Dt>(rows: usize, n: usize) {
    let x = Input::<T>::random(&[rows, n], 71, -3.0, 3.0);
    let b = Input::<T>::random(&[n], 72, -1.0, 1.0);
    let want_y = flat(&fused_kernels::add_bias(&x.tensor, &b.tensor).unwrap());
    let (xs, bs) = (x.f64s(), b.f64s());
    let total = rows * n;
    for add in [fused::elements_config(total), Shape { grid: 2, block: 70 }] {
        let what = format!("add_bias [{rows}, {n}] {add:?}");
        let got = in_both_orders(&what, |order| {
            let (xb, bb) = (x.buffer(), b.buffer());
            let mut yb = Buffer::<T>::poisoned(total).unwrap();
            run(
                &name::<T>("add_bias"),
                add,
                &[
                    Arg::ptr(&xb),
                    Arg::ptr(&bb),
                    Arg::ptr_mut(&mut yb),
                    Arg::U64(total as u64),
                    Arg::U64(n as u64),
                ],
                order,
            );
            vec![read(&yb)]
        });
        assert_close::<T>(&format!("{what}: y"), &got[0], &want_y, 2.0 * T::U, |i| {
            xs[i].abs() + bs[i % n].abs()
        });
    }
}

macro_rules! tests {
    ($($test:ident: $t:ty;)*) => {$(
        #[test]
        fn $test() {
            for (rows, n) in CASES {
                check::<$t>(rows, n);
            }
        }
    )*};
}
tests! {
    add_bias_f32: f32;
    add_bias_f64: f64;
    add_bias_bf16: half::bf16;
    add_bias_f16: half::f16;
}
