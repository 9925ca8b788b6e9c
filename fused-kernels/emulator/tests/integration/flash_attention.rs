//! Flash attention (`flash_attention.cu`): the tensor-core kernels (bf16/f16, head dims 64 and
//! 128) with the Δ kernel, forward and backward, against
//! `fused_kernels::flash_attention` on the CPU and its gradients through candle's `backward()`.
//! The launches restate `fused-kernels/src/flash_attention/cuda.rs`.
//!
//! The inputs are the query, key and value heads of one packed `[B, T, H + 2·Hkv, D]` buffer
//! read in place (strided views, the first at an element offset that leaves the rows unaligned,
//! or at 0 so that the 16-byte tile loads run), grouped-query heads, and `T` no multiple of the
//! tiles.
//!
//! Tolerances, relative to the largest magnitude `M` of each CPU result (the results are sums
//! whose terms can cancel, so an element's error is bounded by the size of its terms, not its
//! own): the tensor-core kernels round the probabilities and the score gradients to bf16/f16 as
//! the A operand of the second product (a relative error of the type's unit roundoff `u_T` per
//! term, ~`2·u_T` after the sums) and read the rounded output `o` in `Δ`; `4·u_T·M` covers both.

use crate::common::{assert_close, flat, in_both_orders, name, read, Dt, Input};
use candle_core::{Tensor, Var};
use fused_kernels_emulator::{launch, Arg, Buffer, Order};

/// `B, T, H, Hkv, D`, the scale, and the element offset of the packed buffer's first head.
#[derive(Debug, Clone, Copy)]
struct Case {
    batch: usize,
    tokens: usize,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    scale: f64,
    pad: usize,
}

impl Case {
    fn width(&self) -> usize {
        self.heads + 2 * self.kv_heads
    }
}

const THREADS: u32 = 128;
const ROWS: usize = 64;

/// The packed input, `d_o`, and everything the CPU computes from them.
struct Reference<T: Dt> {
    /// `pad` elements, then `[B, T, H + 2·Hkv, D]`.
    packed: Vec<T>,
    d_o: Input<T>,
    o: Vec<f64>,
    /// The CPU's `o` as `T`, the backward kernels' input.
    o_data: Vec<T>,
    /// `[B, H, T]` from its definition, in f64.
    lse: Vec<f64>,
    /// `[B, T, H + 2·Hkv, D]`: dq, dk, dv packed.
    dqkv: Vec<f64>,
}

fn reference<T: Dt>(c: Case, seed: u64) -> Reference<T> {
    let (b, t, h, hkv, d, w) = (c.batch, c.tokens, c.heads, c.kv_heads, c.dim, c.width());
    let qkv = Input::<T>::random(&[b, t, w, d], seed, -1.5, 1.5);
    let d_o = Input::<T>::random(&[b, t, h, d], seed + 1, -1.0, 1.0);
    let var = Var::from_tensor(&qkv.tensor).unwrap();
    let (q, k, v) = (
        var.narrow(2, 0, h).unwrap(),
        var.narrow(2, h, hkv).unwrap(),
        var.narrow(2, h + hkv, hkv).unwrap(),
    );
    let o = fused_kernels::flash_attention(&q, &k, &v, c.scale).unwrap();
    let grads = (&o * &d_o.tensor)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let x = qkv.f64s();
    let at = |bb: usize, tt: usize, hh: usize| ((bb * t + tt) * w + hh) * d;
    let mut lse = vec![0.0; b * h * t];
    for bb in 0..b {
        for hh in 0..h {
            let hk = h + hh / (h / hkv);
            for i in 0..t {
                let qs = &x[at(bb, i, hh)..][..d];
                let sum: f64 = (0..=i)
                    .map(|j| {
                        let ks = &x[at(bb, j, hk)..][..d];
                        (c.scale * qs.iter().zip(ks).map(|(p, q)| p * q).sum::<f64>()).exp()
                    })
                    .sum();
                lse[(bb * h + hh) * t + i] = sum.ln();
            }
        }
    }
    let mut packed = vec![qkv.data[0]; c.pad];
    packed.extend_from_slice(&qkv.data);
    Reference {
        packed,
        o: flat(&o),
        o_data: o.flatten_all().unwrap().to_vec1::<T>().unwrap(),
        d_o,
        lse,
        dqkv: flat(grads.get(&var).unwrap()),
    }
}

/// The arguments shared by every q/k/v kernel: each view's pointer and its batch, token and
/// head strides.
fn qkv_args<T: Dt>(c: Case, packed: &Buffer<T>) -> Vec<Arg<'_>> {
    let (t, w, d) = (c.tokens as u64, c.width() as u64, c.dim as u64);
    let mut args = Vec::new();
    for first in [0, c.heads, c.heads + c.kv_heads] {
        args.push(Arg::ptr_at(packed, c.pad + first * c.dim).unwrap());
        args.extend([Arg::U64(t * w * d), Arg::U64(w * d), Arg::U64(d)]);
    }
    args
}

fn run(kernel: &str, grid: (usize, usize), shared: usize, args: &[Arg<'_>], order: Order) {
    run_with(kernel, grid, THREADS, shared, args, order)
}

fn run_with(
    kernel: &str,
    grid: (usize, usize),
    threads: u32,
    shared: usize,
    args: &[Arg<'_>],
    order: Order,
) {
    let grid = (grid.0 as u32, grid.1 as u32, 1);
    if let Err(e) = launch(kernel, grid, threads, shared, args, order) {
        panic!("{kernel} with grid {grid:?}: {e}");
    }
}

/// Runs the forward and backward kernels as `cuda.rs` launches them and compares `o`, `lse` and
/// `dqkv` with the CPU.
fn check<T: Dt>(c: Case, seed: u64) {
    let r = reference::<T>(c, seed);
    let (b, t, h, hkv, d) = (c.batch, c.tokens, c.heads, c.kv_heads, c.dim);
    let (t64, h64, hkv64, d64) = (t as u64, h as u64, hkv as u64, d as u64);
    let what = format!("flash_attention {c:?}");
    let got = in_both_orders(&what, |order| {
        let packed = Buffer::from_slice(&r.packed).unwrap();
        // Forward.
        let mut o = Buffer::<T>::poisoned(b * t * h * d).unwrap();
        let mut lse = Buffer::<T::Acc>::poisoned(b * h * t).unwrap();
        {
            let mut args = qkv_args(c, &packed);
            args.extend([Arg::ptr_mut(&mut o), Arg::ptr_mut(&mut lse)]);
            args.extend([Arg::U64(t64), Arg::U64(h64), Arg::U64(hkv64)]);
            args.push(Arg::F64(c.scale));
            let kernel = name::<T>(&format!("flash_forward_mma_d{d}"));
            run(&kernel, (t.div_ceil(ROWS), b * h), 0, &args, order);
        }
        // Backward, from the CPU's o (candle passes the forward's output) and the exact lse.
        let o_cpu = Buffer::from_slice(&r.o_data).unwrap();
        let g = r.d_o.buffer();
        let lse_exact: Vec<T::Acc> = r.lse.iter().map(|&x| num_from_f64::<T::Acc>(x)).collect();
        let lse_in = Buffer::from_slice(&lse_exact).unwrap();
        let rows = b * h * t;
        let mut delta = Buffer::<T::Acc>::poisoned(rows).unwrap();
        // One warp per row, 8 warps per block.
        run_with(
            &name::<T>("flash_delta"),
            (rows.div_ceil(8).clamp(1, 4096), 1),
            256,
            0,
            &[
                Arg::ptr(&o_cpu),
                Arg::ptr(&g),
                Arg::ptr_mut(&mut delta),
                Arg::U64(rows as u64),
                Arg::U64(t64),
                Arg::U64(h64),
                Arg::U64(d64),
            ],
            order,
        );
        let mut dqkv = Buffer::<T>::poisoned(b * t * c.width() * d).unwrap();
        for (kernel, grid) in [
            (format!("flash_dq_mma_d{d}"), (t.div_ceil(ROWS), b * h)),
            (format!("flash_dkv_mma_d{d}"), (t.div_ceil(ROWS), b * hkv)),
        ] {
            let mut args = qkv_args(c, &packed);
            args.extend([
                Arg::ptr(&g),
                Arg::ptr(&lse_in),
                Arg::ptr(&delta),
                Arg::ptr_mut(&mut dqkv),
                Arg::U64(t64),
                Arg::U64(h64),
                Arg::U64(hkv64),
            ]);
            args.push(Arg::F64(c.scale));
            run(&name::<T>(&kernel), grid, 0, &args, order);
        }
        vec![read(&o), read(&lse), read(&dqkv)]
    });
    let u = if T::step(1.0) > 0.0 {
        T::step(1.0) / 2.0
    } else {
        T::U
    };
    let rtol = 4.0 * u;
    let magnitude = |x: &[f64]| x.iter().fold(0f64, |m, v| m.max(v.abs()));
    let (mo, md) = (magnitude(&r.o), magnitude(&r.dqkv));
    assert_close::<T>(&format!("{what}: o"), &got[0], &r.o, rtol, |_| mo);
    // lse is f32 (f64 for f64): its own type's rounding plus the sum's.
    let lse_tol = if T::U < 1e-10 { 1e-13 } else { 1e-6 };
    assert_close::<T::Acc>(&format!("{what}: lse"), &got[1], &r.lse, lse_tol, |_| 1.0);
    assert_close::<T>(&format!("{what}: dqkv"), &got[2], &r.dqkv, rtol, |_| md);
}

/// `x` as the arithmetic type (f32 rounds to nearest).
fn num_from_f64<A: Dt>(x: f64) -> A {
    let t = Tensor::new(&[x], &candle_core::Device::Cpu)
        .unwrap()
        .to_dtype(A::DTYPE)
        .unwrap();
    t.to_vec1::<A>().unwrap()[0]
}

/// Grouped-query heads (groups of 2), T = 70: two query tiles, the second partial; the views at
/// an odd offset (2-byte tile loads).
fn mma_case(dim: usize) -> Case {
    Case {
        batch: 1,
        tokens: 70,
        heads: 4,
        kv_heads: 2,
        dim,
        scale: 1.0 / (dim as f64).sqrt(),
        pad: 3,
    }
}

/// Two batch entries, multi-head (Hkv = H), T = 64 exactly, the views 16-byte aligned (the
/// packed rows are H + 2·Hkv = 6 heads of 64 elements).
fn aligned_case() -> Case {
    Case {
        batch: 2,
        tokens: 64,
        heads: 2,
        kv_heads: 2,
        dim: 64,
        scale: 0.125,
        pad: 0,
    }
}

#[test]
fn flash_attention_mma_bf16_d64() {
    check::<half::bf16>(mma_case(64), 1);
    check::<half::bf16>(aligned_case(), 2);
}

#[test]
fn flash_attention_mma_f16_d64() {
    check::<half::f16>(mma_case(64), 3);
    check::<half::f16>(aligned_case(), 4);
}

#[test]
fn flash_attention_mma_bf16_d128() {
    check::<half::bf16>(mma_case(128), 5);
}

#[test]
fn flash_attention_mma_f16_d128() {
    check::<half::f16>(mma_case(128), 6);
}

/// Δ = Σ_d dO·O per row of the contiguous `[B, T, H, D]` o and dO, into `[B, H, T]`: in every
/// dtype (the tensor-core kernels use it in bf16/f16; it is instantiated for all four), against
/// the sum in f64. A head dim wider than a warp and one narrower.
fn check_delta<T: Dt>(seed: u64) {
    for (b, t, h, d) in [(2, 5, 3, 40), (1, 70, 2, 24)] {
        let o = Input::<T>::random(&[b, t, h, d], seed, -2.0, 2.0);
        let g = Input::<T>::random(&[b, t, h, d], seed + 1, -1.0, 1.0);
        let (os, gs) = (o.f64s(), g.f64s());
        let rows = b * t * h;
        let mut want = vec![0.0; rows];
        let mut size = vec![0.0; rows];
        for r in 0..rows {
            let (bb, tt, hh) = (r / (t * h), (r / h) % t, r % h);
            let at = (bb * h + hh) * t + tt;
            for k in 0..d {
                want[at] += os[r * d + k] * gs[r * d + k];
                size[at] += (os[r * d + k] * gs[r * d + k]).abs();
            }
        }
        let what = format!("flash_delta [{b}, {t}, {h}, {d}]");
        let got = in_both_orders(&what, |order| {
            let (ob, gb) = (o.buffer(), g.buffer());
            // As cuda.rs launches it (one warp per row, 8 warps per block), and in 2 blocks of
            // 2 warps (a grid-stride loop over the rows).
            [((rows.div_ceil(8), 1), 256), ((2, 1), 64)]
                .into_iter()
                .map(|(grid, threads)| {
                    let mut delta = Buffer::<T::Acc>::poisoned(rows).unwrap();
                    let args = [
                        Arg::ptr(&ob),
                        Arg::ptr(&gb),
                        Arg::ptr_mut(&mut delta),
                        Arg::U64(rows as u64),
                        Arg::U64(t as u64),
                        Arg::U64(h as u64),
                        Arg::U64(d as u64),
                    ];
                    run_with(&name::<T>("flash_delta"), grid, threads, 0, &args, order);
                    read(&delta)
                })
                .collect()
        });
        let rtol = 4.0 * d as f64 * T::Acc::U;
        for out in &got {
            assert_close::<T::Acc>(&what, out, &want, rtol, |i| size[i]);
        }
    }
}

#[test]
fn flash_delta_every_dtype() {
    check_delta::<f32>(7);
    check_delta::<f64>(8);
    check_delta::<half::bf16>(9);
    check_delta::<half::f16>(10);
}

/// mma.cuh's product (the emulated `mma.sync` and the shuffle variant for GPUs before sm_80) on
/// fragments loaded by the PTX ISA's layout formulas (`tests/cuda/mma_tests.cu`), against
/// `D = A·B + C` in f64. Both sum 16 exact products (bf16 and f16 products fit f32) in f32.
fn check_mma<T: Dt>(kernel: &str) {
    let a = Input::<T>::random(&[16, 16], 31, -2.0, 2.0);
    let b = Input::<T>::random(&[16, 8], 32, -2.0, 2.0);
    let c = Input::<f32>::random(&[16, 8], 33, -1.0, 1.0);
    let (af, bf, cf) = (a.f64s(), b.f64s(), c.f64s());
    let mut want = vec![0.0; 128];
    let mut size = vec![0.0; 128];
    for i in 0..16 {
        for j in 0..8 {
            want[i * 8 + j] = cf[i * 8 + j];
            size[i * 8 + j] = cf[i * 8 + j].abs();
            for k in 0..16 {
                want[i * 8 + j] += af[i * 16 + k] * bf[k * 8 + j];
                size[i * 8 + j] += (af[i * 16 + k] * bf[k * 8 + j]).abs();
            }
        }
    }
    let got = in_both_orders(kernel, |order| {
        let (ab, bb, cb) = (a.buffer(), b.buffer(), c.buffer());
        let mut d = Buffer::<f32>::poisoned(128).unwrap();
        let mut d2 = Buffer::<f32>::poisoned(128).unwrap();
        let args = [
            Arg::ptr(&ab),
            Arg::ptr(&bb),
            Arg::ptr(&cb),
            Arg::ptr_mut(&mut d),
            Arg::ptr_mut(&mut d2),
        ];
        run_with(kernel, (1, 1), 32, 0, &args, order);
        vec![read(&d), read(&d2)]
    });
    let rtol = 17.0 * f32::EPSILON as f64;
    assert_close::<f32>(&format!("{kernel}: mma"), &got[0], &want, rtol, |i| size[i]);
    assert_close::<f32>(&format!("{kernel}: shuffled"), &got[1], &want, rtol, |i| {
        size[i]
    });
}

#[test]
fn mma_fragments_follow_the_ptx_layouts() {
    check_mma::<half::bf16>("emu_test_mma_bf16");
    check_mma::<half::f16>("emu_test_mma_f16");
}
