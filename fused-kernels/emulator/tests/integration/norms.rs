//! LayerNorm and RMSNorm (`layer_norm.cu`, `rms_norm.cu`): forward, backward (dx and per-block
//! partial sums) and the sum of the partials, against `fused_kernels::layer_norm` / `rms_norm` and
//! their gradients through candle's `backward()`.
//!
//! Tolerances. Both sides compute the same formulas in the arithmetic type; they differ in the
//! order of the sums (the kernels reduce strided per-thread sums in a tree, the CPU adds in row
//! order). Two orders of a sum of n terms differ by at most about 2·n·u·Σ|terms|, so each result
//! gets `rtol = 4·n·u` relative to the magnitude of what it is computed from:
//! - y: n = d, relative to `rstd · max|x| · max|w|` (+ `max|b|`), the size of the normalized terms
//!   (an error in the mean or variance moves y by that much times its relative size);
//! - dx: n = d, relative to `rstd · max|dy · w| · (1 + max|x̂|)`, the size of the three terms of
//!   `rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ x̂))`; this floor is what keeps a [1, 1] input (dx exactly 0
//!   on the CPU) from demanding exact cancellation, the failure the GPU run showed;
//! - d_weight, d_bias: n = rows + d (the x̂ of each row, then the sum over rows), relative to
//!   `Σ_rows |dy · x̂|` and `Σ_rows |dy|` of the column.
//!
//! bf16/f16 results may also round to the neighbouring value (one step of the type).

use crate::common::{assert_close, flat, fused, in_both_orders, name, read, run, Dt, Input, Shape};
use candle_core::{Tensor, Var};
use fused_kernels_emulator::{Arg, Buffer};

const EPS: f64 = 1e-5;

/// (rows, d): one element; one row narrower than a warp and one wider; rows wider than the 256
/// threads of a block (each thread strides); more rows than the 512 blocks of the backward's
/// first pass (its grid-stride loop).
const CASES: [(usize, usize); 5] = [(1, 1), (1, 33), (7, 300), (600, 40), (5, 64)];

/// Per row: (mean, rstd) in f64, for LayerNorm (`centred`) or RMSNorm.
fn row_stats(x: &[f64], d: usize, centred: bool) -> Vec<(f64, f64)> {
    x.chunks(d)
        .map(|r| {
            let mean = if centred {
                r.iter().sum::<f64>() / d as f64
            } else {
                0.0
            };
            let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
            (mean, 1.0 / (var + EPS).sqrt())
        })
        .collect()
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// The column sums of |f(row, column)|.
fn column_magnitudes(rows: usize, d: usize, f: impl Fn(usize, usize) -> f64) -> Vec<f64> {
    (0..d)
        .map(|j| (0..rows).map(|r| f(r, j).abs()).sum())
        .collect()
}

/// Which norm: LayerNorm has a bias and subtracts the mean.
#[derive(Clone, Copy, PartialEq)]
enum Norm {
    Layer,
    Rms,
}

fn check<T: Dt>(norm: Norm, rows: usize, d: usize) {
    let x = Input::<T>::random(&[rows, d], 11, -0.5, 2.5);
    let w = Input::<T>::random(&[d], 12, 0.5, 1.5);
    let b = Input::<T>::random(&[d], 13, -0.5, 0.5);
    let dy = Input::<T>::random(&[rows, d], 14, -1.0, 1.0);
    let dres = Input::<T>::random(&[rows, d], 97, -1.0, 1.0);

    // The CPU reference: the op, and the gradients of Σ y · dy.
    let xv = Var::from_tensor(&x.tensor).unwrap();
    let wv = Var::from_tensor(&w.tensor).unwrap();
    let bv = Var::from_tensor(&b.tensor).unwrap();
    let y: Tensor = match norm {
        Norm::Layer => fused_kernels::layer_norm(&xv, &wv, &bv, EPS).unwrap(),
        Norm::Rms => fused_kernels::rms_norm(&xv, &wv, EPS).unwrap(),
    };
    let grads = (&y * &dy.tensor)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want_y = flat(&y);
    let want_dx = flat(grads.get(&xv).unwrap());
    let want_dw = flat(grads.get(&wv).unwrap());
    let want_db = (norm == Norm::Layer).then(|| flat(grads.get(&bv).unwrap()));

    // Tolerances (see the module's documentation).
    let (xs, ws, bs, gs) = (x.f64s(), w.f64s(), b.f64s(), dy.f64s());
    let stats = row_stats(&xs, d, norm == Norm::Layer);
    let max_w = max_abs(&ws);
    let xhat = |r: usize, j: usize| (xs[r * d + j] - stats[r].0) * stats[r].1;
    let y_floor = stats
        .iter()
        .enumerate()
        .map(|(r, s)| s.1 * max_abs(&xs[r * d..(r + 1) * d]))
        .fold(0.0, f64::max)
        * max_w
        + max_abs(&bs);
    let max_xhat = (0..rows * d)
        .map(|i| xhat(i / d, i % d).abs())
        .fold(0.0, f64::max);
    let dx_floor: Vec<f64> = (0..rows)
        .map(|r| {
            let g = (0..d)
                .map(|j| (gs[r * d + j] * ws[j]).abs())
                .fold(0.0, f64::max);
            stats[r].1 * g * (1.0 + max_xhat)
        })
        .collect();
    let dw_floor = column_magnitudes(rows, d, |r, j| gs[r * d + j] * xhat(r, j));
    let db_floor = column_magnitudes(rows, d, |r, j| gs[r * d + j]);
    let rtol_row = 4.0 * d as f64 * T::U;
    let rtol_col = 4.0 * (rows + d) as f64 * T::U;

    let (fwd, bwd, sum) = match norm {
        Norm::Layer => ("layer_norm", "layer_norm_backward", "layer_norm_sum"),
        Norm::Rms => ("rms_norm", "rms_norm_backward", "rms_norm_sum"),
    };
    // Forward: fused-kernels' shape (one block per row), and 3 blocks of 64 threads (each thread
    // strides over wide rows, each block over several rows).
    for shape in [
        fused::rows_config(rows, d),
        Shape {
            grid: 3.min(rows as u32),
            block: 64,
        },
    ] {
        let what = format!("{fwd} [{rows}, {d}] {shape:?}");
        let got = in_both_orders(&what, |order| {
            let (xb, wb, bb) = (x.buffer(), w.buffer(), b.buffer());
            let mut yb = Buffer::<T>::poisoned(rows * d).unwrap();
            let (rows64, d64) = (rows as u64, d as u64);
            let args = match norm {
                Norm::Layer => vec![
                    Arg::ptr(&xb),
                    Arg::ptr(&wb),
                    Arg::ptr(&bb),
                    Arg::ptr_mut(&mut yb),
                    Arg::U64(rows64),
                    Arg::U64(d64),
                    Arg::F64(EPS),
                ],
                Norm::Rms => vec![
                    Arg::ptr(&xb),
                    Arg::ptr(&wb),
                    Arg::ptr_mut(&mut yb),
                    Arg::U64(rows64),
                    Arg::U64(d64),
                    Arg::F64(EPS),
                ],
            };
            run(&name::<T>(fwd), shape, &args, order);
            drop(args);
            vec![read(&yb)]
        });
        assert_close::<T>(&what, &got[0], &want_y, rtol_row, |_| y_floor);
    }

    // Backward: fused-kernels' two launches (partial sums over at most 512 blocks, then one
    // thread per column), and 2 blocks of 128 threads then one block of 32.
    let width = if norm == Norm::Layer { 2 * d } else { d };
    let ours = fused::partial_blocks(rows, width);
    for (first, second) in [
        (
            fused::blocks_over_rows(ours, d),
            fused::columns_config(width),
        ),
        (
            Shape {
                grid: 2.min(rows as u32),
                block: 128,
            },
            Shape { grid: 1, block: 32 },
        ),
    ] {
        // The residual variant adds dres, the gradient reaching x along the residual path, to dx.
        for residual in [false, true] {
            let kernel = if residual {
                format!("{bwd}_residual")
            } else {
                bwd.to_string()
            };
            let what = format!("{kernel} + {sum} [{rows}, {d}] {first:?} then {second:?}");
            let blocks = first.grid as usize;
            let params = if norm == Norm::Layer { 2 } else { 1 };
            let got = in_both_orders(&what, |order| {
                let (xb, wb, gb, rb) = (x.buffer(), w.buffer(), dy.buffer(), dres.buffer());
                let mut out = Buffer::<T>::poisoned((rows + params) * d).unwrap();
                let mut partial = Buffer::<T::Acc>::poisoned(blocks * width).unwrap();
                let mut args = vec![Arg::ptr(&xb), Arg::ptr(&wb), Arg::ptr(&gb)];
                if residual {
                    args.push(Arg::ptr(&rb));
                }
                args.extend([
                    Arg::ptr_mut(&mut out),
                    Arg::ptr_mut(&mut partial),
                    Arg::U64(rows as u64),
                    Arg::U64(d as u64),
                    Arg::F64(EPS),
                ]);
                run(&name::<T>(&kernel), first, &args, order);
                drop(args);
                run(
                    &name::<T>(sum),
                    second,
                    &[
                        Arg::ptr(&partial),
                        Arg::U64(blocks as u64),
                        Arg::U64(width as u64),
                        Arg::ptr_mut_at(&mut out, rows * d).unwrap(),
                    ],
                    order,
                );
                vec![read(&out)]
            });
            let all = &got[0];
            let res = dres.f64s();
            let want: Vec<f64> = if residual {
                want_dx.iter().zip(&res).map(|(a, b)| a + b).collect()
            } else {
                want_dx.clone()
            };
            // The reference's dx is rounded to T before dres is added (the kernel rounds the
            // sum once): one more step of T at dx's magnitude.
            assert_close::<T>(
                &format!("{what}: dx"),
                &all[..rows * d],
                &want,
                rtol_row,
                |i| {
                    dx_floor[i / d]
                        + if residual {
                            res[i].abs() + T::step(want_dx[i]) / rtol_row
                        } else {
                            0.0
                        }
                },
            );
            assert_close::<T>(
                &format!("{what}: d_weight"),
                &all[rows * d..(rows + 1) * d],
                &want_dw,
                rtol_col,
                |j| dw_floor[j],
            );
            if let Some(want_db) = &want_db {
                assert_close::<T>(
                    &format!("{what}: d_bias"),
                    &all[(rows + 1) * d..],
                    want_db,
                    rtol_col,
                    |j| db_floor[j],
                );
            }
        }
    }
}

macro_rules! norm_tests {
    ($($test:ident: $norm:expr, $t:ty;)*) => {$(
        #[test]
        fn $test() {
            for (rows, d) in CASES {
                check::<$t>($norm, rows, d);
            }
        }
    )*};
}
norm_tests! {
    layer_norm_f32: Norm::Layer, f32;
    layer_norm_f64: Norm::Layer, f64;
    layer_norm_bf16: Norm::Layer, half::bf16;
    layer_norm_f16: Norm::Layer, half::f16;
    rms_norm_f32: Norm::Rms, f32;
    rms_norm_f64: Norm::Rms, f64;
    rms_norm_bf16: Norm::Rms, half::bf16;
    rms_norm_f16: Norm::Rms, half::f16;
}

/// LayerNorm over rows of one element: x − mean is exactly 0, so y is exactly b and the input
/// gradient exactly 0 (the CPU kernel's result), whatever the values, in the kernel's arithmetic
/// as in exact arithmetic: `mean(ĝ)` of one ĝ is that ĝ, and the kernel must compute ĝ = dy · w the
/// same way both times it uses it (a multiply-add that fuses one of them, as nvcc's contraction
/// does, leaves that product's rounding error times rstd ≈ 316).
fn one_element_rows_are_exact<T: Dt>() {
    let rows = 300;
    let x = Input::<T>::random(&[rows, 1], 21, -3.0, 3.0);
    let w = Input::<T>::random(&[1], 22, 0.5, 1.5);
    let b = Input::<T>::random(&[1], 23, -0.5, 0.5);
    let dy = Input::<T>::random(&[rows, 1], 24, -1.0, 1.0);
    let what = format!("layer_norm over [{rows}, 1] in {}", T::SUFFIX);
    let got = in_both_orders(&what, |order| {
        let (xb, wb, bb, gb) = (x.buffer(), w.buffer(), b.buffer(), dy.buffer());
        let mut yb = Buffer::<T>::poisoned(rows).unwrap();
        run(
            &name::<T>("layer_norm"),
            fused::rows_config(rows, 1),
            &[
                Arg::ptr(&xb),
                Arg::ptr(&wb),
                Arg::ptr(&bb),
                Arg::ptr_mut(&mut yb),
                Arg::U64(rows as u64),
                Arg::U64(1),
                Arg::F64(EPS),
            ],
            order,
        );
        let blocks = fused::partial_blocks(rows, 2);
        let mut dx = Buffer::<T>::poisoned(rows + 2).unwrap();
        let mut partial = Buffer::<T::Acc>::poisoned(blocks * 2).unwrap();
        run(
            &name::<T>("layer_norm_backward"),
            fused::blocks_over_rows(blocks, 1),
            &[
                Arg::ptr(&xb),
                Arg::ptr(&wb),
                Arg::ptr(&gb),
                Arg::ptr_mut(&mut dx),
                Arg::ptr_mut(&mut partial),
                Arg::U64(rows as u64),
                Arg::U64(1),
                Arg::F64(EPS),
            ],
            order,
        );
        vec![read(&yb), read(&dx)[..rows].to_vec()]
    });
    let bias = b.f64s()[0];
    for (r, y) in got[0].iter().enumerate() {
        assert_eq!(*y, bias, "{what}: y[{r}] is not b");
    }
    for (r, dx) in got[1].iter().enumerate() {
        assert_eq!(*dx, 0.0, "{what}: dx[{r}] is not 0");
    }
}

#[test]
fn layer_norm_over_one_element_is_b_with_a_zero_input_gradient_exactly() {
    one_element_rows_are_exact::<f32>();
    one_element_rows_are_exact::<f64>();
    one_element_rows_are_exact::<half::bf16>();
    one_element_rows_are_exact::<half::f16>();
}
