//! Flash attention against an independent naive reference: full `T × T` scores in f64 with an
//! explicit `repeat_kv`, its gradients from the softmax Jacobian (no log-sum-exp, no `Δ` trick).

use super::cpu::{exp_f32, BLOCK_K, BLOCK_Q};
use super::{flash_backward, flash_forward, Dims, HeadsView};
use candle_core::{DType, Device, Result, Tensor, Var};

/// `n` deterministic values in `[-1, 1)` (xorshift from `seed`).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

fn tensor(shape: &[usize], seed: u64, scale: f64) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = values(n, seed).into_iter().map(|x| x * scale).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The reference's results, all contiguous: `o`, `dq` `[B, T, H, D]`, `dk`, `dv` `[B, T, Hkv, D]`.
struct Reference {
    o: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

/// Naive causal attention and its gradients for `loss = Σ o ∘ d_o`, in f64, from contiguous
/// `q`, `d_o` `[B, T, H, D]` and `k`, `v` `[B, T, Hkv, D]`.
fn reference(q: &[f64], k: &[f64], v: &[f64], d_o: &[f64], dims: Dims, scale: f64) -> Reference {
    let Dims {
        batch,
        tokens: t_n,
        heads,
        kv_heads,
        head_dim: d,
    } = dims;
    let group = heads / kv_heads;
    let qi = |b: usize, t: usize, h: usize| ((b * t_n + t) * heads + h) * d;
    let ki = |b: usize, t: usize, h: usize| ((b * t_n + t) * kv_heads + h) * d;
    let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f64>();
    let mut r = Reference {
        o: vec![0.0; q.len()],
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; v.len()],
    };
    for b in 0..batch {
        for h in 0..heads {
            // repeat_kv: query head h reads key/value head h / group.
            let hk = h / group;
            for i in 0..t_n {
                let qrow = &q[qi(b, i, h)..qi(b, i, h) + d];
                let g = &d_o[qi(b, i, h)..qi(b, i, h) + d];
                // Full row of scores with the mask as −∞, then softmax.
                let s: Vec<f64> = (0..t_n)
                    .map(|j| {
                        if j > i {
                            f64::NEG_INFINITY
                        } else {
                            scale * dot(qrow, &k[ki(b, j, hk)..ki(b, j, hk) + d])
                        }
                    })
                    .collect();
                let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                let p: Vec<f64> = e.iter().map(|x| x / sum).collect();
                for j in 0..t_n {
                    for c in 0..d {
                        r.o[qi(b, i, h) + c] += p[j] * v[ki(b, j, hk) + c];
                    }
                }
                // dp_j = dO_i · v_j; ds = softmax Jacobian applied to dp.
                let dp: Vec<f64> = (0..t_n)
                    .map(|j| dot(g, &v[ki(b, j, hk)..ki(b, j, hk) + d]))
                    .collect();
                let jac: f64 = (0..t_n).map(|j| p[j] * dp[j]).sum();
                for j in 0..t_n {
                    let ds = p[j] * (dp[j] - jac);
                    for c in 0..d {
                        r.dq[qi(b, i, h) + c] += scale * ds * k[ki(b, j, hk) + c];
                        r.dk[ki(b, j, hk) + c] += scale * ds * qrow[c];
                        r.dv[ki(b, j, hk) + c] += p[j] * g[c];
                    }
                }
            }
        }
    }
    r
}

/// The largest difference between `a` and `b`, relative to the largest magnitude of `b` (at
/// least 0.1: at T = 1 the exact `dq` and `dk` are 0, and f32 leaves rounding noise there).
fn error(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.1f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0.0,
            |m: f64, e| if e.is_nan() { f64::INFINITY } else { m.max(e) },
        )
        / scale
}

fn dims(batch: usize, tokens: usize, heads: usize, kv_heads: usize, head_dim: usize) -> Dims {
    Dims {
        batch,
        tokens,
        heads,
        kv_heads,
        head_dim,
    }
}

/// The shapes every check runs: one tile, T = 1, T not a multiple of either tile, several query
/// tiles per key tile, grouped-query heads with groups of 2 and 3, and head dims 64 and 128.
fn shapes() -> Vec<Dims> {
    vec![
        dims(2, 7, 2, 2, 8),
        dims(2, 1, 3, 1, 5),
        dims(1, BLOCK_Q, 2, 1, 16),
        dims(1, 2 * BLOCK_Q + 22, 4, 2, 16),
        dims(2, BLOCK_K + 1, 6, 2, 64),
        dims(1, 100, 2, 2, 128),
    ]
}

/// Random inputs for `dims`: `q` `[B, T, H, D]`, `k`, `v` `[B, T, Hkv, D]`, the loss weights `r`
/// (the gradient of `o`), in f64. `k` is scaled up so that the softmax is far from uniform.
fn inputs(dims: Dims, seed: u64) -> [Tensor; 4] {
    let (b, t, h, hkv, d) = (
        dims.batch,
        dims.tokens,
        dims.heads,
        dims.kv_heads,
        dims.head_dim,
    );
    [
        tensor(&[b, t, h, d], seed, 1.0),
        tensor(&[b, t, hkv, d], seed + 1, 3.0),
        tensor(&[b, t, hkv, d], seed + 2, 1.0),
        tensor(&[b, t, h, d], seed + 3, 1.0),
    ]
}

/// `(o, dq, dk, dv)` of the public op for `loss = Σ o ∘ r`, with `q`, `k`, `v` made from the
/// variables by `view` (the gradients are with respect to the views' sources).
fn op_results(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    r: &Tensor,
    scale: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (q, k, v) = (
        Var::from_tensor(q).unwrap(),
        Var::from_tensor(k).unwrap(),
        Var::from_tensor(v).unwrap(),
    );
    let o = super::flash_attention(&q, &k, &v, scale).unwrap();
    assert!(o.is_contiguous());
    assert_eq!(o.dtype(), q.dtype());
    let grads = (&o * r.to_dtype(o.dtype()).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = |x: &Var| flat(grads.get(x).expect("a gradient"));
    (flat(&o), g(&q), g(&k), g(&v))
}

fn reference_of(ins: &[Tensor; 4], dims: Dims, scale: f64) -> Reference {
    reference(
        &flat(&ins[0]),
        &flat(&ins[1]),
        &flat(&ins[2]),
        &flat(&ins[3]),
        dims,
        scale,
    )
}

fn assert_matches(
    what: &str,
    got: (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>),
    want: &Reference,
    tol: f64,
) {
    for (name, g, w) in [
        ("o", &got.0, &want.o),
        ("dq", &got.1, &want.dq),
        ("dk", &got.2, &want.dk),
        ("dv", &got.3, &want.dv),
    ] {
        let e = error(g, w);
        assert!(
            e < tol,
            "{what}: {name} differs from the reference by {e:e}"
        );
    }
}

#[test]
fn forward_and_gradients_equal_the_naive_reference_in_f64_and_f32() {
    for (n, dims) in shapes().into_iter().enumerate() {
        let ins = inputs(dims, 10 * n as u64);
        let scale = 1.0 / (dims.head_dim as f64).sqrt();
        let want = reference_of(&ins, dims, scale);
        let got = op_results(&ins[0], &ins[1], &ins[2], &ins[3], scale);
        assert_matches(&format!("f64 {dims:?}"), got, &want, 1e-12);
        let f32s: Vec<Tensor> = ins[..3]
            .iter()
            .map(|t| t.to_dtype(DType::F32).unwrap())
            .collect();
        let got = op_results(&f32s[0], &f32s[1], &f32s[2], &ins[3], scale);
        assert_matches(&format!("f32 {dims:?}"), got, &want, 2e-5);
    }
}

#[test]
fn bf16_and_f16_are_computed_in_f32_and_rounded_once() {
    for dims in [dims(2, 2 * BLOCK_Q + 5, 4, 2, 32), dims(1, 9, 2, 1, 64)] {
        let ins = inputs(dims, 3);
        let scale = 1.0 / (dims.head_dim as f64).sqrt();
        for (dtype, tol) in [(DType::BF16, 3e-2), (DType::F16, 4e-3)] {
            // The reference sees the inputs rounded to the dtype, as the op does.
            let rounded: Vec<Tensor> = ins
                .iter()
                .map(|t| t.to_dtype(dtype).unwrap().to_dtype(DType::F64).unwrap())
                .collect();
            let rounded: [Tensor; 4] = rounded.try_into().unwrap();
            let want = reference_of(&rounded, dims, scale);
            let half: Vec<Tensor> = ins[..3]
                .iter()
                .map(|t| t.to_dtype(dtype).unwrap())
                .collect();
            let got = op_results(&half[0], &half[1], &half[2], &rounded[3], scale);
            assert_matches(&format!("{dtype:?} {dims:?}"), got, &want, tol);
        }
    }
}

/// A packed projection output `[B, T, H + 2·Hkv, D]` split into its heads by `narrow`, a
/// `[B, T, 3, H, D]` one, a head-major `[B, H, T, D]` tensor transposed, and views at an element
/// offset: each gives the reference's output, and the gradients reach the packed tensor.
#[test]
fn strided_views_are_read_in_place_with_their_gradients() {
    let dm = dims(2, BLOCK_Q + 9, 4, 2, 16);
    let (b, t, h, hkv, d) = (dm.batch, dm.tokens, dm.heads, dm.kv_heads, dm.head_dim);
    let scale = 0.3;
    let ins = inputs(dm, 40);
    let want = reference_of(&ins, dm, scale);
    let r = &ins[3];

    // [B, T, H + 2·Hkv, D], with the gradient of the packed variable.
    let packed = Var::from_tensor(&Tensor::cat(&ins[..3], 2).unwrap()).unwrap();
    let (q, k, v) = (
        packed.narrow(2, 0, h).unwrap(),
        packed.narrow(2, h, hkv).unwrap(),
        packed.narrow(2, h + hkv, hkv).unwrap(),
    );
    assert!(!q.is_contiguous() && !k.is_contiguous() && !v.is_contiguous());
    let o = super::flash_attention(&q, &k, &v, scale).unwrap();
    let grads = (&o * r).unwrap().sum_all().unwrap().backward().unwrap();
    let g = grads.get(&packed).unwrap();
    let got = (
        flat(&o),
        flat(&g.narrow(2, 0, h).unwrap()),
        flat(&g.narrow(2, h, hkv).unwrap()),
        flat(&g.narrow(2, h + hkv, hkv).unwrap()),
    );
    assert_matches("packed [B, T, H + 2Hkv, D]", got, &want, 1e-12);

    // The views themselves: a head-major tensor transposed (token stride D, head stride T·D) and
    // a slice of a larger batch (an element offset), MHA through [B, T, 3, H, D].
    let mha = dims(b, t, h, h, d);
    let ins = inputs(mha, 50);
    let want = reference_of(&ins, mha, scale);
    let head_major = ins[0].transpose(1, 2).unwrap().contiguous().unwrap();
    let q = head_major.transpose(1, 2).unwrap();
    let bigger = Tensor::cat(&[&ins[1], &ins[1], &ins[1]], 0).unwrap();
    let k = bigger.narrow(0, b, b).unwrap();
    assert!(k.layout().start_offset() > 0);
    let stacked = Tensor::stack(&[&ins[0], &ins[1], &ins[2]], 2).unwrap();
    let v = stacked.narrow(2, 2, 1).unwrap().squeeze(2).unwrap();
    assert!(!v.is_contiguous());
    let got = op_results(&q, &k, &v, &ins[3], scale);
    assert_matches(
        "transposed q, offset k, [B, T, 3, H, D] v",
        got,
        &want,
        1e-12,
    );

    // A last dimension that is not contiguous is copied, and still right.
    let q = ins[0]
        .transpose(2, 3)
        .unwrap()
        .contiguous()
        .unwrap()
        .transpose(2, 3)
        .unwrap();
    assert_ne!(q.layout().stride()[3], 1);
    let got = op_results(&q, &ins[1], &ins[2], &ins[3], scale);
    assert_matches("q with a strided head dim", got, &want, 1e-12);
}

/// The crate-internal functions on views with explicit offsets and strides into one flat
/// storage (no tensor view of the heads exists to be copied): the output, the log-sum-exp and
/// the packed `[B, T, H + 2·Hkv, D]` gradient.
#[test]
fn heads_views_into_a_flat_storage_and_the_packed_gradient() {
    let dm = dims(2, 2 * BLOCK_Q + 3, 6, 2, 8);
    let (b, t, h, hkv, d) = (dm.batch, dm.tokens, dm.heads, dm.kv_heads, dm.head_dim);
    let scale = 0.4;
    let ins = inputs(dm, 60);
    let want = reference_of(&ins, dm, scale);
    for dtype in [DType::F64, DType::F32] {
        // 5 elements of padding, then [B, T, H + 2·Hkv, D], flattened.
        let pad = Tensor::zeros(5, DType::F64, &Device::Cpu).unwrap();
        let packed = Tensor::cat(&ins[..3], 2).unwrap();
        let storage = Tensor::cat(&[pad, packed.flatten_all().unwrap()], 0)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let width = h + 2 * hkv;
        let view = |first: usize, heads: usize| HeadsView {
            tensor: storage.clone(),
            offset: 5 + first * d,
            batch_stride: t * width * d,
            token_stride: width * d,
            head_stride: d,
            batch: b,
            tokens: t,
            heads,
            head_dim: d,
        };
        let (q, k, v) = (view(0, h), view(h, hkv), view(h + hkv, hkv));
        let (o, lse) = flash_forward(&q, &k, &v, scale).unwrap();
        assert_eq!(o.dims(), [b, t, h, d]);
        assert_eq!(lse.dims(), [b, h, t]);
        assert_eq!(lse.dtype(), super::lse_dtype(dtype));
        let tol = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
        let e = error(&flat(&o), &want.o);
        assert!(e < tol, "{dtype:?}: o differs by {e:e}");
        // lse against its definition, log Σ_{j ≤ i} e^{s_ij}.
        let (qf, kf) = (flat(&ins[0]), flat(&ins[1]));
        let lse = flat(&lse);
        for (row, got) in lse.iter().enumerate() {
            let (bh, i) = (row / t, row % t);
            let (bb, hh) = (bh / h, bh % h);
            let hk = hh / (h / hkv);
            let qs = &qf[((bb * t + i) * h + hh) * d..][..d];
            let sum: f64 = (0..=i)
                .map(|j| {
                    let ks = &kf[((bb * t + j) * hkv + hk) * d..][..d];
                    (scale * qs.iter().zip(ks).map(|(x, y)| x * y).sum::<f64>()).exp()
                })
                .sum();
            assert!(
                (got - sum.ln()).abs() < tol * 10.0,
                "{dtype:?}: lse[{row}] = {got}, expected {}",
                sum.ln()
            );
        }
        let d_o = ins[3].to_dtype(dtype).unwrap();
        let dqkv =
            flash_backward(&q, &k, &v, &o, &d_o, &lse_tensor(&lse, dm, dtype), scale).unwrap();
        assert_eq!(dqkv.dims(), [b, t, width, d]);
        let got = (
            flat(&o),
            flat(&dqkv.narrow(2, 0, h).unwrap()),
            flat(&dqkv.narrow(2, h, hkv).unwrap()),
            flat(&dqkv.narrow(2, h + hkv, hkv).unwrap()),
        );
        assert_matches(&format!("{dtype:?} heads views"), got, &want, tol);
    }
}

fn lse_tensor(lse: &[f64], dm: Dims, dtype: DType) -> Tensor {
    Tensor::from_vec(lse.to_vec(), (dm.batch, dm.heads, dm.tokens), &Device::Cpu)
        .unwrap()
        .to_dtype(super::lse_dtype(dtype))
        .unwrap()
}

#[test]
fn the_results_do_not_depend_on_the_number_of_threads() {
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    let dm = dims(2, 3 * BLOCK_Q + 17, 4, 2, 32);
    let ins = inputs(dm, 70);
    for dtype in [DType::F32, DType::BF16] {
        let cast: Vec<Tensor> = ins.iter().map(|t| t.to_dtype(dtype).unwrap()).collect();
        let run = || op_results(&cast[0], &cast[1], &cast[2], &cast[3], 0.2);
        let one = pool(1).install(run);
        let two = pool(2).install(run);
        let three = pool(3).install(run);
        // Bitwise: f64 holds every f32/bf16 value exactly.
        assert!(
            one == two && one == three,
            "{dtype:?}: 1, 2, 3 threads differ"
        );
    }
}

#[test]
fn the_fallback_computes_the_same_formula() {
    let dm = dims(2, 11, 4, 2, 8);
    let ins = inputs(dm, 80);
    let want = reference_of(&ins, dm, 0.5);
    let (q, k, v) = (
        Var::from_tensor(&ins[0]).unwrap(),
        Var::from_tensor(&ins[1]).unwrap(),
        Var::from_tensor(&ins[2]).unwrap(),
    );
    let o = super::fallback(&q, &k, &v, dm, 0.5).unwrap();
    let grads = (&o * &ins[3])
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = |x: &Var| flat(grads.get(x).unwrap());
    assert_matches("fallback", (flat(&o), g(&q), g(&k), g(&v)), &want, 1e-12);
}

#[test]
fn empty_batches_and_sequences_give_empty_results() {
    for (b, t) in [(0, 5), (2, 0)] {
        let q = Tensor::zeros((b, t, 2, 4), DType::F32, &Device::Cpu).unwrap();
        let k = Tensor::zeros((b, t, 1, 4), DType::F32, &Device::Cpu).unwrap();
        let o = super::flash_attention(&q, &k, &k, 1.0).unwrap();
        assert_eq!(o.dims(), [b, t, 2, 4]);
    }
}

#[test]
fn the_fast_exponential_is_within_two_ulp() -> Result<()> {
    let mut worst = 0f64;
    let mut x = -87.0f32;
    while x <= 88.0 {
        let want = (x as f64).exp();
        let got = exp_f32(x) as f64;
        // In units of the last place of the f32 result.
        let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
        worst = worst.max((got - want).abs() / ulp);
        x += 0.000_77;
    }
    assert!(worst <= 2.0, "exp_f32 is off by {worst} ulp");
    assert_eq!(exp_f32(0.0), 1.0);
    assert!(exp_f32(f32::NAN).is_nan());
    Ok(())
}
