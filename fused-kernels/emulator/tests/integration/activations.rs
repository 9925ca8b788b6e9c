//! GELU, SiLU and SwiGLU (`activations.cu`), forward and backward, against `fused_kernels::gelu`,
//! `silu`, `swiglu` and their gradients through candle's `backward()`.
//!
//! Tolerance. Element-wise: both sides evaluate the same formula, operation by operation in the
//! same order, with the same C library's `expf`/`exp`; they may differ only by how each compiler
//! rounds intermediate results (a fused multiply-add where one contracts, none here), a few units
//! of the arithmetic type: `rtol = 8·u`. GELU's and SiLU's slopes are sums of terms of opposite
//! signs (gelu' crosses 0 near x = −0.75), so the backward's error is relative to the size of its
//! terms, `|dy| · (1 + |x|)`, not to the result. bf16/f16 results may also round to the
//! neighbouring value.

use crate::common::{assert_close, flat, fused, in_both_orders, name, read, run, Dt, Input, Shape};
use candle_core::{Tensor, Var};
use fused_kernels_emulator::{Arg, Buffer};

/// Element counts: fewer than a warp, not a multiple of a block, and more than one sweep of the
/// second launch shape (3 blocks of 100 threads: 300 elements per grid stride).
const SIZES: [usize; 3] = [1, 1000, 4099];

/// Which activation.
#[derive(Clone, Copy, Debug)]
enum Act {
    Gelu,
    Silu,
    Swiglu,
}

fn check<T: Dt>(act: Act, n: usize) {
    let x = Input::<T>::random(&[n], 51, -6.0, 6.0);
    let up = Input::<T>::random(&[n], 52, -2.0, 2.0);
    let dy = Input::<T>::random(&[n], 53, -1.0, 1.0);
    let xv = Var::from_tensor(&x.tensor).unwrap();
    let uv = Var::from_tensor(&up.tensor).unwrap();
    let y: Tensor = match act {
        Act::Gelu => fused_kernels::gelu(&xv).unwrap(),
        Act::Silu => fused_kernels::silu(&xv).unwrap(),
        Act::Swiglu => fused_kernels::swiglu(&xv, &uv).unwrap(),
    };
    let grads = (&y * &dy.tensor)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want_y = flat(&y);
    let want_dx = flat(grads.get(&xv).unwrap());
    let want_du = matches!(act, Act::Swiglu).then(|| flat(grads.get(&uv).unwrap()));

    let rtol = 8.0 * T::U;
    let (xs, us, gs) = (x.f64s(), up.f64s(), dy.f64s());
    let (fwd, bwd) = match act {
        Act::Gelu => ("gelu", "gelu_backward"),
        Act::Silu => ("silu", "silu_backward"),
        Act::Swiglu => ("swiglu", "swiglu_backward"),
    };
    for shape in [
        fused::elements_config(n),
        // Not a multiple of 32: element-wise kernels have no warp collective.
        Shape {
            grid: 3,
            block: 100,
        },
    ] {
        let what = format!("{fwd} [{n}] {shape:?}");
        let got = in_both_orders(&what, |order| {
            let (xb, ub, gb) = (x.buffer(), up.buffer(), dy.buffer());
            let mut yb = Buffer::<T>::poisoned(n).unwrap();
            let outs = if matches!(act, Act::Swiglu) { 2 } else { 1 };
            let mut db = Buffer::<T>::poisoned(outs * n).unwrap();
            let n64 = n as u64;
            let (fargs, bargs) = match act {
                Act::Swiglu => (
                    vec![
                        Arg::ptr(&xb),
                        Arg::ptr(&ub),
                        Arg::ptr_mut(&mut yb),
                        Arg::U64(n64),
                    ],
                    vec![
                        Arg::ptr(&xb),
                        Arg::ptr(&ub),
                        Arg::ptr(&gb),
                        Arg::ptr_mut(&mut db),
                        Arg::U64(n64),
                    ],
                ),
                _ => (
                    vec![Arg::ptr(&xb), Arg::ptr_mut(&mut yb), Arg::U64(n64)],
                    vec![
                        Arg::ptr(&xb),
                        Arg::ptr(&gb),
                        Arg::ptr_mut(&mut db),
                        Arg::U64(n64),
                    ],
                ),
            };
            run(&name::<T>(fwd), shape, &fargs, order);
            run(&name::<T>(bwd), shape, &bargs, order);
            drop((fargs, bargs));
            vec![read(&yb), read(&db)]
        });
        assert_close::<T>(&format!("{what}: y"), &got[0], &want_y, rtol, |_| 0.0);
        let terms = |i: usize| {
            gs[i].abs()
                * (1.0 + xs[i].abs())
                * if matches!(act, Act::Swiglu) {
                    us[i].abs()
                } else {
                    1.0
                }
        };
        assert_close::<T>(&format!("{what}: dx"), &got[1][..n], &want_dx, rtol, terms);
        if let Some(want_du) = &want_du {
            assert_close::<T>(
                &format!("{what}: d_up"),
                &got[1][n..],
                want_du,
                rtol,
                |_| 0.0,
            );
        }
    }
}

macro_rules! tests {
    ($($test:ident: $act:expr, $t:ty;)*) => {$(
        #[test]
        fn $test() {
            for n in SIZES {
                check::<$t>($act, n);
            }
        }
    )*};
}
tests! {
    gelu_f32: Act::Gelu, f32;
    gelu_f64: Act::Gelu, f64;
    gelu_bf16: Act::Gelu, half::bf16;
    gelu_f16: Act::Gelu, half::f16;
    silu_f32: Act::Silu, f32;
    silu_f64: Act::Silu, f64;
    silu_bf16: Act::Silu, half::bf16;
    silu_f16: Act::Silu, half::f16;
    swiglu_f32: Act::Swiglu, f32;
    swiglu_f64: Act::Swiglu, f64;
    swiglu_bf16: Act::Swiglu, half::bf16;
    swiglu_f16: Act::Swiglu, half::f16;
}
