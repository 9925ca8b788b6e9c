//! The fused layers' element-wise kernels (`residual.cu`, `block_kernels.cu`): the residual add,
//! the in-place bias add and column-range add, bias + GELU and its backward, SwiGLU over a packed
//! `[gate | up]` and its backward, rotary embeddings on a range of heads in place; against the
//! formulas in f64 (the activations through `fused_kernels::gelu` / `swiglu` on f64 tensors, which
//! the activation tests check in turn).
//!
//! Tolerance. Element-wise: each output is one formula of a few operations in the arithmetic type,
//! rounded once to `T`: `rtol = 8·u` relative to the size of the terms (a sum of terms of opposite
//! signs can be much smaller than they are), plus one step of `T`.

use crate::common::{assert_close, flat, fused, in_both_orders, name, read, run, Dt, Input, Shape};
use candle_core::{Tensor, Var};
use fused_kernels_emulator::{Arg, Buffer};

/// `(rows, n)`: one element; a row narrower than a warp; more elements than one grid sweep of the
/// second launch shape.
const CASES: [(usize, usize); 3] = [(1, 1), (3, 7), (61, 67)];

/// fused-kernels' shape and a shape that is not a multiple of a warp.
fn shapes(n: usize) -> [Shape; 2] {
    [
        fused::elements_config(n),
        Shape {
            grid: 3,
            block: 100,
        },
    ]
}

fn residual<T: Dt>(rows: usize, n: usize) {
    let x = Input::<T>::random(&[rows, n], 1, -2.0, 2.0);
    let z = Input::<T>::random(&[rows, n], 2, -2.0, 2.0);
    let b = Input::<T>::random(&[n], 3, -1.0, 1.0);
    let (xs, zs, bs) = (x.f64s(), z.f64s(), b.f64s());
    let total = rows * n;
    for with_bias in [false, true] {
        let want: Vec<f64> = (0..total)
            .map(|i| xs[i] + zs[i] + if with_bias { bs[i % n] } else { 0.0 })
            .collect();
        let floor = |i: usize| xs[i].abs() + zs[i].abs() + bs[i % n].abs();
        let kernel = if with_bias {
            "residual_add_bias"
        } else {
            "residual_add"
        };
        for shape in shapes(total) {
            let what = format!("{kernel} [{rows}, {n}] {shape:?}");
            let got = in_both_orders(&what, |order| {
                let (xb, zb, bb) = (x.buffer(), z.buffer(), b.buffer());
                let mut yb = Buffer::<T>::poisoned(total).unwrap();
                let mut args = vec![Arg::ptr(&xb), Arg::ptr(&zb)];
                if with_bias {
                    args.push(Arg::ptr(&bb));
                }
                args.push(Arg::ptr_mut(&mut yb));
                args.push(Arg::U64(total as u64));
                if with_bias {
                    args.push(Arg::U64(n as u64));
                }
                run(&name::<T>(kernel), shape, &args, order);
                drop(args);
                vec![read(&yb)]
            });
            assert_close::<T>(&what, &got[0], &want, 8.0 * T::U, floor);
        }
    }
}

fn add_bias_inplace<T: Dt>(rows: usize, n: usize) {
    let y = Input::<T>::random(&[rows, n], 4, -2.0, 2.0);
    let b = Input::<T>::random(&[n], 5, -1.0, 1.0);
    let (ys, bs) = (y.f64s(), b.f64s());
    let total = rows * n;
    let want: Vec<f64> = (0..total).map(|i| ys[i] + bs[i % n]).collect();
    for shape in shapes(total) {
        let what = format!("add_bias_inplace [{rows}, {n}] {shape:?}");
        let got = in_both_orders(&what, |order| {
            let (mut yb, bb) = (y.buffer(), b.buffer());
            let args = [
                Arg::ptr_mut(&mut yb),
                Arg::ptr(&bb),
                Arg::U64(total as u64),
                Arg::U64(n as u64),
            ];
            run(&name::<T>("add_bias_inplace"), shape, &args, order);
            vec![read(&yb)]
        });
        assert_close::<T>(&what, &got[0], &want, 8.0 * T::U, |i| {
            ys[i].abs() + bs[i % n].abs()
        });
    }
}

fn add_into_columns<T: Dt>(rows: usize, n: usize) {
    // y [rows, n + 5]; delta [rows, n] into columns 3..3 + n.
    let (total, offset) = (n + 5, 3);
    let y = Input::<T>::random(&[rows, total], 6, -2.0, 2.0);
    let delta = Input::<T>::random(&[rows, n], 7, -1.0, 1.0);
    let (ys, ds) = (y.f64s(), delta.f64s());
    let want: Vec<f64> = (0..rows * total)
        .map(|i| {
            let (r, c) = (i / total, i % total);
            if (offset..offset + n).contains(&c) {
                ys[i] + ds[r * n + c - offset]
            } else {
                ys[i]
            }
        })
        .collect();
    for shape in shapes(rows * n) {
        let what = format!("add_into_columns [{rows}, {total}] += [{rows}, {n}] {shape:?}");
        let got = in_both_orders(&what, |order| {
            let (mut yb, db) = (y.buffer(), delta.buffer());
            let args = [
                Arg::ptr_mut(&mut yb),
                Arg::ptr(&db),
                Arg::U64(rows as u64),
                Arg::U64(total as u64),
                Arg::U64(n as u64),
                Arg::U64(offset as u64),
            ];
            run(&name::<T>("add_into_columns"), shape, &args, order);
            vec![read(&yb)]
        });
        assert_close::<T>(&what, &got[0], &want, 8.0 * T::U, |i| ys[i].abs() + 1.0);
    }
}

fn bias_gelu<T: Dt>(rows: usize, n: usize) {
    let f = Input::<T>::random(&[rows, n], 8, -5.0, 5.0);
    let b = Input::<T>::random(&[n], 9, -1.0, 1.0);
    let dg = Input::<T>::random(&[rows, n], 10, -1.0, 1.0);
    let (fs, bs, gs) = (f.f64s(), b.f64s(), dg.f64s());
    let total = rows * n;
    for with_bias in [false, true] {
        // The formula in f64 through the public op (and its backward) on x = f + b.
        let xs: Vec<f64> = (0..total)
            .map(|i| fs[i] + if with_bias { bs[i % n] } else { 0.0 })
            .collect();
        let xv = Var::from_vec(xs.clone(), (rows, n), &candle_core::Device::Cpu).unwrap();
        let y = fused_kernels::gelu(&xv).unwrap();
        let grads = (&y
            * Tensor::from_vec(gs.clone(), (rows, n), &candle_core::Device::Cpu).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
        let (want_y, want_df) = (flat(&y), flat(grads.get(&xv).unwrap()));
        for shape in shapes(total) {
            let what = format!("bias_gelu (bias {with_bias}) [{rows}, {n}] {shape:?}");
            let got = in_both_orders(&what, |order| {
                let (fb, bb, gb) = (f.buffer(), b.buffer(), dg.buffer());
                let mut act = Buffer::<T>::poisoned(total).unwrap();
                let mut df = Buffer::<T>::poisoned(total).unwrap();
                let (t64, n64, hb) = (total as u64, n as u64, with_bias as i32);
                run(
                    &name::<T>("bias_gelu"),
                    shape,
                    &[
                        Arg::ptr(&fb),
                        Arg::ptr(&bb),
                        Arg::ptr_mut(&mut act),
                        Arg::U64(t64),
                        Arg::U64(n64),
                        Arg::I32(hb),
                    ],
                    order,
                );
                run(
                    &name::<T>("bias_gelu_backward"),
                    shape,
                    &[
                        Arg::ptr(&fb),
                        Arg::ptr(&bb),
                        Arg::ptr(&gb),
                        Arg::ptr_mut(&mut df),
                        Arg::U64(t64),
                        Arg::U64(n64),
                        Arg::I32(hb),
                    ],
                    order,
                );
                vec![read(&act), read(&df)]
            });
            // f + b is rounded in the arithmetic type first: its error, u·|x|, moves gelu by at
            // most |x| times that (gelu' ≤ 1.13).
            assert_close::<T>(&format!("{what}: act"), &got[0], &want_y, 8.0 * T::U, |i| {
                2.0 * xs[i].abs()
            });
            assert_close::<T>(&format!("{what}: df"), &got[1], &want_df, 8.0 * T::U, |i| {
                gs[i].abs() * (1.0 + xs[i].abs()).powi(2)
            });
        }
    }
}

fn swiglu_packed<T: Dt>(rows: usize, inner: usize) {
    let gu = Input::<T>::random(&[rows, 2 * inner], 11, -4.0, 4.0);
    let da = Input::<T>::random(&[rows, inner], 12, -1.0, 1.0);
    let (gus, das) = (gu.f64s(), da.f64s());
    let dev = candle_core::Device::Cpu;
    let g: Vec<f64> = (0..rows * inner)
        .map(|i| gus[(i / inner) * 2 * inner + i % inner])
        .collect();
    let u: Vec<f64> = (0..rows * inner)
        .map(|i| gus[(i / inner) * 2 * inner + inner + i % inner])
        .collect();
    let gv = Var::from_vec(g.clone(), (rows, inner), &dev).unwrap();
    let uv = Var::from_vec(u.clone(), (rows, inner), &dev).unwrap();
    let y = fused_kernels::swiglu(&gv, &uv).unwrap();
    let grads = (&y * Tensor::from_vec(das.clone(), (rows, inner), &dev).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want_y = flat(&y);
    let (dgw, duw) = (flat(grads.get(&gv).unwrap()), flat(grads.get(&uv).unwrap()));
    // The packed gradient: [d_gate | d_up] per row.
    let want_d: Vec<f64> = (0..rows * 2 * inner)
        .map(|i| {
            let (r, c) = (i / (2 * inner), i % (2 * inner));
            if c < inner {
                dgw[r * inner + c]
            } else {
                duw[r * inner + c - inner]
            }
        })
        .collect();
    for shape in shapes(rows * inner) {
        let what = format!("swiglu_packed [{rows}, 2·{inner}] {shape:?}");
        let got = in_both_orders(&what, |order| {
            let (gb, db) = (gu.buffer(), da.buffer());
            let mut act = Buffer::<T>::poisoned(rows * inner).unwrap();
            let mut dgu = Buffer::<T>::poisoned(rows * 2 * inner).unwrap();
            let (r64, i64_) = (rows as u64, inner as u64);
            run(
                &name::<T>("swiglu_packed"),
                shape,
                &[
                    Arg::ptr(&gb),
                    Arg::ptr_mut(&mut act),
                    Arg::U64(r64),
                    Arg::U64(i64_),
                ],
                order,
            );
            run(
                &name::<T>("swiglu_packed_backward"),
                shape,
                &[
                    Arg::ptr(&gb),
                    Arg::ptr(&db),
                    Arg::ptr_mut(&mut dgu),
                    Arg::U64(r64),
                    Arg::U64(i64_),
                ],
                order,
            );
            vec![read(&act), read(&dgu)]
        });
        assert_close::<T>(&format!("{what}: act"), &got[0], &want_y, 8.0 * T::U, |i| {
            g[i].abs() * u[i].abs()
        });
        assert_close::<T>(&format!("{what}: d"), &got[1], &want_d, 8.0 * T::U, |i| {
            let (r, c) = (i / (2 * inner), i % (2 * inner) % inner);
            let k = r * inner + c;
            das[k].abs() * (1.0 + g[k].abs()) * (1.0 + u[k].abs())
        });
    }
}

fn rotary_heads<T: Dt>(b: usize, t: usize, heads: usize, half: usize) {
    let d = 2 * half;
    let x = Input::<T>::random(&[b, t, heads, d], 13, -2.0, 2.0);
    let angles: Vec<f64> = (0..t * half)
        .map(|i| (i / half) as f64 * 0.3 / (1.0 + (i % half) as f64))
        .collect();
    let cos = Input::<T>::new(angles.iter().map(|a| a.cos()).collect(), &[t, half]);
    let sin = Input::<T>::new(angles.iter().map(|a| a.sin()).collect(), &[t, half]);
    let (xs, cs, ss) = (x.f64s(), cos.f64s(), sin.f64s());
    // Heads 1..heads (all but the first), forward then, separately, inverse.
    let (first, count) = (1, heads - 1);
    let n = b * t * count * half;
    for inverse in [false, true] {
        let mut want = xs.clone();
        for row in 0..b * t {
            let pos = row % t;
            for head in first..first + count {
                let base = (row * heads + head) * d;
                for k in 0..half {
                    let (a, bb) = (xs[base + k], xs[base + k + half]);
                    let c = cs[pos * half + k];
                    let s = if inverse {
                        -ss[pos * half + k]
                    } else {
                        ss[pos * half + k]
                    };
                    want[base + k] = a * c - bb * s;
                    want[base + k + half] = bb * c + a * s;
                }
            }
        }
        for shape in shapes(n) {
            let what =
                format!("rotary_heads (inverse {inverse}) [{b}, {t}, {heads}, {d}] {shape:?}");
            let got = in_both_orders(&what, |order| {
                let (mut xb, cb, sb) = (x.buffer(), cos.buffer(), sin.buffer());
                let args = [
                    Arg::ptr_mut(&mut xb),
                    Arg::ptr(&cb),
                    Arg::ptr(&sb),
                    Arg::U64((b * t) as u64),
                    Arg::U64(t as u64),
                    Arg::U64(heads as u64),
                    Arg::U64(first as u64),
                    Arg::U64(count as u64),
                    Arg::U64(half as u64),
                    Arg::I32(inverse as i32),
                ];
                run(&name::<T>("rotary_heads"), shape, &args, order);
                vec![read(&xb)]
            });
            assert_close::<T>(&what, &got[0], &want, 8.0 * T::U, |i| {
                let row = i / d;
                let base = row * d;
                xs[base + i % half].abs() + xs[base + half + i % half].abs()
            });
        }
    }
}

macro_rules! block_tests {
    ($($test:ident: $t:ty;)*) => {$(
        #[test]
        fn $test() {
            for (rows, n) in CASES {
                residual::<$t>(rows, n);
                add_bias_inplace::<$t>(rows, n);
                add_into_columns::<$t>(rows, n);
                bias_gelu::<$t>(rows, n);
                swiglu_packed::<$t>(rows, n);
            }
            rotary_heads::<$t>(1, 1, 2, 1);
            rotary_heads::<$t>(2, 5, 4, 8);
            rotary_heads::<$t>(3, 17, 5, 32);
        }
    )*};
}
block_tests! {
    blocks_f32: f32;
    blocks_f64: f64;
    blocks_bf16: half::bf16;
    blocks_f16: half::f16;
}
