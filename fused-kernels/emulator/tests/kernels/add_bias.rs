//! The bias add and its gradient (`add_bias.cu`: the add, per-block partial column sums, their
//! sum), against `fused_kernels::add_bias` and its gradient through candle's `backward()`.
//!
//! Tolerances. The add is one rounding on both sides (`rtol = 2·u` relative to `|x| + |b|`, the
//! terms of a sum that can cancel). The bias gradient is a column sum over the rows in different
//! orders (the kernels: per-block strided sums, then the blocks in order; the CPU: blocks of rows):
//! `rtol = 4·rows·u` relative to the column's Σ|dy|. bf16/f16 results may also round to the
//! neighbouring value.

use crate::common::{assert_close, flat, fused, in_both_orders, name, read, run, Dt, Input, Shape};
use candle_core::Var;
use fused_kernels_emulator::{Arg, Buffer};

/// (rows, n): one element, rows wider than a block, and more rows than the 512 blocks of the
/// partial sums (their grid-stride loop).
const CASES: [(usize, usize); 4] = [(1, 1), (3, 300), (600, 7), (9, 64)];

fn check<T: Dt>(rows: usize, n: usize) {
    let x = Input::<T>::random(&[rows, n], 71, -3.0, 3.0);
    let b = Input::<T>::random(&[n], 72, -1.0, 1.0);
    let dy = Input::<T>::random(&[rows, n], 73, -1.0, 1.0);
    let xv = Var::from_tensor(&x.tensor).unwrap();
    let bv = Var::from_tensor(&b.tensor).unwrap();
    let y = fused_kernels::add_bias(&xv, &bv).unwrap();
    let grads = (&y * &dy.tensor)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want_y = flat(&y);
    let want_db = flat(grads.get(&bv).unwrap());
    let (xs, bs, gs) = (x.f64s(), b.f64s(), dy.f64s());
    let col_mag: Vec<f64> = (0..n)
        .map(|j| (0..rows).map(|r| gs[r * n + j].abs()).sum())
        .collect();

    let total = rows * n;
    let ours = fused::partial_blocks(rows, n);
    for (add, first, second) in [
        (
            fused::elements_config(total),
            fused::blocks_over_rows(ours, n),
            fused::columns_config(n),
        ),
        (
            Shape { grid: 2, block: 70 },
            Shape {
                grid: 3.min(rows as u32),
                block: 64,
            },
            Shape { grid: 1, block: 32 },
        ),
    ] {
        let what = format!("add_bias [{rows}, {n}] {add:?}, partial {first:?}, sum {second:?}");
        let blocks = first.grid as usize;
        let got = in_both_orders(&what, |order| {
            let (xb, bb, gb) = (x.buffer(), b.buffer(), dy.buffer());
            let mut yb = Buffer::<T>::poisoned(total).unwrap();
            let mut partial = Buffer::<T::Acc>::poisoned(blocks * n).unwrap();
            let mut db = Buffer::<T>::poisoned(n).unwrap();
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
            run(
                &name::<T>("add_bias_partial"),
                first,
                &[
                    Arg::ptr(&gb),
                    Arg::ptr_mut(&mut partial),
                    Arg::U64(rows as u64),
                    Arg::U64(n as u64),
                ],
                order,
            );
            run(
                &name::<T>("add_bias_sum"),
                second,
                &[
                    Arg::ptr(&partial),
                    Arg::U64(blocks as u64),
                    Arg::U64(n as u64),
                    Arg::ptr_mut(&mut db),
                ],
                order,
            );
            vec![read(&yb), read(&db)]
        });
        assert_close::<T>(&format!("{what}: y"), &got[0], &want_y, 2.0 * T::U, |i| {
            xs[i].abs() + bs[i % n].abs()
        });
        assert_close::<T>(
            &format!("{what}: d_bias"),
            &got[1],
            &want_db,
            4.0 * rows as f64 * T::U,
            |j| col_mag[j],
        );
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
