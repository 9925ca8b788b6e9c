//! The CUDA kernels against the CPU kernels: for every op and dtype (f32, bf16, f16, f64), the
//! forward output and every gradient of `Σ f(inputs) · r` (`r` fixed pseudo-random) computed on
//! the GPU equal those computed on the CPU from the same inputs, within the dtype's rounding.
//!
//! The shapes make the kernels take every path: rows wider than a block's 256 threads
//! (d = 4099, a vocabulary of 50 257), row counts that are no multiple of a block size and more
//! rows than the 512 blocks of the reductions over rows, element counts beyond one grid-stride
//! sweep (4096 blocks × 256 threads), a causal mask with fewer queries than keys, and
//! non-contiguous inputs.
//!
//! Needs a GPU: `cargo test --release -p fused-kernels --features cuda --test integration cuda::
//! -- --ignored` (or the binary `scripts/gpu-build.sh build` leaves in
//! `target/cuda/release/deps/integration-*`, the one built from fused-kernels).

#![cfg(feature = "cuda")]

use crate::common::{flat, tensor};
use candle_core::{DType, Device, Result, Tensor, Var};

/// The dtypes every op is checked in.
const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

/// The largest difference allowed between the GPU's and the CPU's results, relative to the
/// largest magnitude of the CPU's, or absolute below magnitude 1 (see [`assert_close`]). Both
/// compute bf16/f16 in f32 and round once; their sums run in
/// different orders, so f32 results differ by a few units in the last place of the largest
/// element, and half-precision ones by one rounding step of the stored result (2⁻⁸ relative for
/// bf16, 2⁻¹¹ for f16), twice where a backward reads the rounded forward output.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F64 => 1e-10,
        DType::BF16 => 3e-2,
        DType::F16 => 4e-3,
        other => panic!("no tolerance for {other:?}"),
    }
}

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device: these tests need a GPU")
}

/// The op under test: `f(trainable, constants)`.
type Op<'a> = &'a dyn Fn(&[Tensor], &[Tensor]) -> Result<Tensor>;

/// The output and the gradients of the trainable inputs of `Σ op(..) · r` on `device`, as f64.
fn run_on(
    device: &Device,
    trainable: &[Tensor],
    constants: &[Tensor],
    op: Op<'_>,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let vars: Vec<Var> = trainable
        .iter()
        .map(|t| Var::from_tensor(&t.to_device(device).unwrap()).unwrap())
        .collect();
    let xs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let cs: Vec<Tensor> = constants
        .iter()
        .map(|t| t.to_device(device).unwrap())
        .collect();
    let out = op(&xs, &cs).unwrap();
    assert!(
        out.device().same_device(device),
        "the output is on {:?}, not on {device:?}",
        out.device()
    );
    let r = tensor(out.dims(), 77, 1.0)
        .to_dtype(out.dtype())
        .unwrap()
        .to_device(device)
        .unwrap();
    let grads = (&out * r).unwrap().sum_all().unwrap().backward().unwrap();
    let g = xs
        .iter()
        .map(|x| {
            flat(
                &grads
                    .get(x)
                    .expect("a gradient")
                    .to_device(&Device::Cpu)
                    .unwrap(),
            )
        })
        .collect();
    (flat(&out.to_device(&Device::Cpu).unwrap()), g)
}

/// Asserts that `gpu` equals `cpu` within `tol` of the largest magnitude of `cpu`, and within
/// `tol` absolutely when that magnitude is below 1: a result that is exactly 0 on the CPU by
/// cancellation (LayerNorm's gradients over one element) is the difference of terms of order 1
/// on the GPU too, which keeps their rounding (a few 1e-6 in f32), so a purely relative
/// tolerance of a zero result would demand bit-exact cancellation.
fn assert_close(what: &str, gpu: &[f64], cpu: &[f64], tol: f64) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths differ");
    let scale = cpu.iter().fold(1f64, |m, v| m.max(v.abs()));
    let (worst, diff) = gpu
        .iter()
        .zip(cpu)
        .map(|(g, c)| (g - c).abs())
        .enumerate()
        .fold((0, 0f64), |(wi, wd), (i, d)| {
            // A NaN on either side counts as the worst difference.
            if d.is_nan() || d > wd {
                (i, if d.is_nan() { f64::INFINITY } else { d })
            } else {
                (wi, wd)
            }
        });
    assert!(
        diff <= tol * scale,
        "{what}: GPU and CPU differ by {diff:e} at [{worst}] (GPU {}, CPU {}), more than \
         {tol:e} × max(1, the largest magnitude) = {tol:e} × {scale:e}",
        gpu[worst],
        cpu[worst]
    );
}

/// Checks `op` on the GPU against the CPU in every dtype: `trainable` and `constants` are f64
/// CPU tensors, cast to the dtype when `cast` says so for that position (constants such as
/// class indices keep theirs).
fn check(name: &str, trainable: &[Tensor], constants: &[(Tensor, bool)], op: Op<'_>) {
    check_within(name, trainable, constants, op, 1.0);
}

/// [`check`] with the tolerance multiplied by `factor`: for the fused layers, chains of several
/// products and kernels, each rounding bf16/f16 results once on either side.
fn check_within(
    name: &str,
    trainable: &[Tensor],
    constants: &[(Tensor, bool)],
    op: Op<'_>,
    factor: f64,
) {
    let gpu = gpu();
    for dtype in DTYPES {
        let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
        let xs: Vec<Tensor> = trainable.iter().map(cast).collect();
        let cs: Vec<Tensor> = constants
            .iter()
            .map(|(t, c)| if *c { cast(t) } else { t.clone() })
            .collect();
        let (cpu_out, cpu_grads) = run_on(&Device::Cpu, &xs, &cs, op);
        let (gpu_out, gpu_grads) = run_on(&gpu, &xs, &cs, op);
        let tol = tolerance(dtype) * factor;
        assert_close(&format!("{name} {dtype:?} output"), &gpu_out, &cpu_out, tol);
        for (i, (g, c)) in gpu_grads.iter().zip(&cpu_grads).enumerate() {
            assert_close(&format!("{name} {dtype:?} gradient {i}"), g, c, tol);
        }
    }
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn layer_norm_on_cuda_equals_the_cpu_kernel() {
    for (rows, d) in [(37, 4099), (993, 64), (1, 1)] {
        let x = tensor(&[rows, d], 1, 3.0);
        let w = (tensor(&[d], 2, 0.5) + 1.0).unwrap();
        let b = tensor(&[d], 3, 0.5);
        check(
            &format!("layer_norm [{rows}, {d}]"),
            &[x, w, b],
            &[],
            &|v, _| fused_kernels::layer_norm(&v[0], &v[1], &v[2], 1e-5),
        );
    }
    // A transposed (non-contiguous) input, 3 · 331 rows of 67.
    let x = tensor(&[67, 3, 331], 4, 2.0);
    let w = tensor(&[67], 5, 1.0);
    let b = tensor(&[67], 6, 1.0);
    check("layer_norm transposed", &[x, w, b], &[], &|v, _| {
        fused_kernels::layer_norm(&v[0].permute((1, 2, 0))?, &v[1], &v[2], 1e-5)
    });
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn rms_norm_on_cuda_equals_the_cpu_kernel() {
    for (shape, d) in [
        (vec![37, 4099], 4099),
        (vec![3, 331, 64], 64),
        (vec![5, 1], 1),
    ] {
        let x = tensor(&shape, 7, 3.0);
        let w = (tensor(&[d], 8, 0.5) + 1.0).unwrap();
        check(&format!("rms_norm {shape:?}"), &[x, w], &[], &|v, _| {
            fused_kernels::rms_norm(&v[0], &v[1], 1e-6)
        });
    }
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn causal_softmax_on_cuda_equals_the_cpu_kernel() {
    // Fewer queries than keys (the mask's diagonal shifted by 1063), rows wider than a block.
    for (shape, scale) in [
        (vec![2, 3, 37, 1100], 0.125),
        (vec![5, 67, 67], 0.3),
        (vec![1, 1], 1.0),
    ] {
        let s = tensor(&shape, 9, 8.0);
        check(&format!("causal_softmax {shape:?}"), &[s], &[], &|v, _| {
            fused_kernels::causal_softmax(&v[0], scale)
        });
    }
    // Scores as attention produces them: a transposed view.
    let s = tensor(&[2, 67, 4, 67], 10, 4.0);
    check("causal_softmax transposed", &[s], &[], &|v, _| {
        fused_kernels::causal_softmax(&v[0].transpose(1, 2)?, 0.5)
    });
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn cross_entropy_on_cuda_equals_the_cpu_kernel() {
    for (n, v) in [(37, 50_257), (1000, 67), (1, 1)] {
        let logits = tensor(&[n, v], 11, 6.0);
        // Targets spread over the classes, the first and the last among them.
        let targets: Vec<u32> = (0..n)
            .map(|i| match i % 5 {
                0 => 0,
                1 => (v - 1) as u32,
                _ => ((i * 7919) % v) as u32,
            })
            .collect();
        let targets = Tensor::new(targets, &Device::Cpu).unwrap();
        // Weights of 0 (padding), fractions and > 1; f64 on purpose (converted on CUDA).
        let weights: Vec<f64> = (0..n).map(|i| [0.25, 0.0, 1.0, 1.5][i % 4]).collect();
        let weights = Tensor::new(weights, &Device::Cpu).unwrap();
        check(
            &format!("cross_entropy [{n}, {v}]"),
            &[logits],
            &[(targets, false), (weights, false)],
            &|x, c| fused_kernels::cross_entropy(&x[0], &c[0], &c[1]),
        );
    }
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn an_out_of_range_target_makes_the_cuda_loss_and_its_rows_gradient_nan() {
    let gpu = gpu();
    let logits = Var::from_tensor(
        &tensor(&[3, 5], 12, 1.0)
            .to_dtype(DType::F32)
            .unwrap()
            .to_device(&gpu)
            .unwrap(),
    )
    .unwrap();
    let targets = Tensor::new(&[1u32, 5, 2], &gpu).unwrap();
    let weights = Tensor::new(&[1f32, 1.0, 1.0], &gpu).unwrap();
    let loss = fused_kernels::cross_entropy(logits.as_tensor(), &targets, &weights).unwrap();
    assert!(loss.to_scalar::<f32>().unwrap().is_nan(), "loss {loss}");
    let grads = loss.backward().unwrap();
    let g: Vec<Vec<f32>> = grads.get(logits.as_tensor()).unwrap().to_vec2().unwrap();
    assert!(
        g[1].iter().all(|v| v.is_nan()),
        "row 1 (target 5 of 5 classes): {:?}",
        g[1]
    );
    assert!(
        g[0].iter().chain(&g[2]).all(|v| v.is_finite()),
        "rows 0 and 2: {g:?}"
    );
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn activations_on_cuda_equal_the_cpu_kernels() {
    // 4 099 000 elements: more than one sweep of the 4096 × 256 grid-stride threads.
    for shape in [vec![1000, 4099], vec![7]] {
        let x = tensor(&shape, 13, 6.0);
        let y = tensor(&shape, 14, 3.0);
        check(
            &format!("gelu {shape:?}"),
            std::slice::from_ref(&x),
            &[],
            &|v, _| fused_kernels::gelu(&v[0]),
        );
        check(
            &format!("silu {shape:?}"),
            std::slice::from_ref(&x),
            &[],
            &|v, _| fused_kernels::silu(&v[0]),
        );
        check(&format!("swiglu {shape:?}"), &[x, y], &[], &|v, _| {
            fused_kernels::swiglu(&v[0], &v[1])
        });
    }
    // A transposed gate.
    let g = tensor(&[64, 33], 15, 4.0);
    let u = tensor(&[33, 64], 16, 2.0);
    check("swiglu transposed", &[g, u], &[], &|v, _| {
        fused_kernels::swiglu(&v[0].t()?, &v[1])
    });
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn rotary_on_cuda_equals_the_cpu_kernel() {
    for (shape, t, h) in [(vec![2, 3, 37, 130], 37, 65), (vec![4, 1000, 64], 1000, 32)] {
        let x = tensor(&shape, 17, 2.0);
        let angles = tensor(&[t, h], 18, 3.0);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        check(
            &format!("rotary {shape:?}"),
            &[x],
            &[(cos, true), (sin, true)],
            &|v, c| fused_kernels::rotary(&v[0], &c[0], &c[1]),
        );
    }
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn add_bias_on_cuda_equals_the_cpu_kernel() {
    // 993 rows (more than the 512 blocks of the row sum) of 4099.
    for (shape, n) in [(vec![3, 331, 4099], 4099), (vec![37, 64], 64), (vec![1], 1)] {
        let x = tensor(&shape, 19, 2.0);
        let b = tensor(&[n], 20, 1.0);
        check(&format!("add_bias {shape:?}"), &[x, b], &[], &|v, _| {
            fused_kernels::add_bias(&v[0], &v[1])
        });
    }
}

/// The output and the table's gradient of `Σ embedding(ids, table) · r` on `device`, as f64.
fn embedding_on(device: &Device, ids: &Tensor, table: &Tensor) -> (Vec<f64>, Vec<f64>) {
    let table = Var::from_tensor(&table.to_device(device).unwrap()).unwrap();
    let out = fused_kernels::embedding(&ids.to_device(device).unwrap(), table.as_tensor()).unwrap();
    let r = tensor(out.dims(), 21, 1.0)
        .to_dtype(out.dtype())
        .unwrap()
        .to_device(device)
        .unwrap();
    let grads = (&out * r).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = grads.get(table.as_tensor()).expect("a gradient");
    (
        flat(&out.to_device(&Device::Cpu).unwrap()),
        flat(&grad.to_device(&Device::Cpu).unwrap()),
    )
}

/// `n` ids below `v` in which a few ids recur very often (as common tokens do): every fourth
/// position is one of three hot ids, among them 0 and `v − 1`.
fn skewed_ids(n: usize, v: usize, seed: u64) -> Vec<u32> {
    crate::common::values(n, seed)
        .iter()
        .enumerate()
        .map(|(p, x)| match p % 4 {
            0 => [0, v - 1, v / 2][p % 3] as u32,
            _ => (((x + 1.0) * 0.5 * v as f64) as usize).min(v - 1) as u32,
        })
        .collect()
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn embedding_on_cuda_equals_the_cpu_kernel_bit_for_bit() {
    // GPT-2's table (3866 blocks of 13 rows); a 59-row vocabulary whose 8192 ids all fall in
    // five blocks (many chunks of ids per block); rows wider than the accumulators (column
    // tiles); i64 and u8 ids.
    let gpu = gpu();
    for (v, c, dims) in [
        (50_257, 768, vec![4, 512]),
        (59, 768, vec![8, 1024]),
        (3, 20_000, vec![7]),
        (200, 33, vec![3, 5, 67]),
    ] {
        let n: usize = dims.iter().product();
        let ids = Tensor::from_vec(skewed_ids(n, v, 22), dims.as_slice(), &Device::Cpu).unwrap();
        let mut id_kinds = vec![ids.clone(), ids.to_dtype(DType::I64).unwrap()];
        if v <= 256 {
            id_kinds.push(ids.to_dtype(DType::U8).unwrap());
        }
        for dtype in DTYPES {
            let table = tensor(&[v, c], 23, 1.0).to_dtype(dtype).unwrap();
            for ids in &id_kinds {
                let what = format!(
                    "embedding [{v}, {c}] {dtype:?}, {:?} ids {dims:?}",
                    ids.dtype()
                );
                let cpu = embedding_on(&Device::Cpu, ids, &table);
                let first = embedding_on(&gpu, ids, &table);
                let again = embedding_on(&gpu, ids, &table);
                // Both sum each gradient element over its positions in increasing order, from
                // 0, in f32 (f64), and round once: the same bits.
                assert!(first.0 == cpu.0, "{what}: the rows differ");
                let diff = first.1.iter().zip(&cpu.1).position(|(g, c)| g != c);
                assert!(
                    diff.is_none(),
                    "{what}: gradient [{}] GPU {} CPU {}",
                    diff.unwrap(),
                    first.1[diff.unwrap()],
                    cpu.1[diff.unwrap()]
                );
                assert!(first == again, "{what}: two GPU runs differ");
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn an_out_of_range_id_gives_a_nan_row_on_cuda_and_no_gradient() {
    let gpu = gpu();
    let table = Var::from_tensor(
        &tensor(&[5, 3], 24, 1.0)
            .to_dtype(DType::F32)
            .unwrap()
            .to_device(&gpu)
            .unwrap(),
    )
    .unwrap();
    let ids = Tensor::new(&[1i64, 5, -1, 1], &gpu).unwrap();
    let out = fused_kernels::embedding(&ids, table.as_tensor()).unwrap();
    let rows: Vec<Vec<f32>> = out.to_vec2().unwrap();
    assert!(
        rows[1].iter().chain(&rows[2]).all(|v| v.is_nan()),
        "{rows:?}"
    );
    assert!(
        rows[0].iter().chain(&rows[3]).all(|v| v.is_finite()),
        "{rows:?}"
    );
    let grads = out
        .narrow(0, 0, 1)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g: Vec<Vec<f32>> = grads.get(table.as_tensor()).unwrap().to_vec2().unwrap();
    // Only position 0 (id 1) has a gradient of 1; the others' dy is 0 and ids 5 and −1 add nothing.
    let want: Vec<Vec<f32>> = (0..5)
        .map(|r| vec![if r == 1 { 1.0 } else { 0.0 }; 3])
        .collect();
    assert_eq!(g, want);
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn linear_cross_entropy_on_cuda_equals_the_cpu_op() {
    // GPT-2's vocabulary in chunks of 8 rows (5 chunks, the last short) and in one chunk; a
    // small vocabulary with more rows than the 65 535 blocks of a row kernel's grid.
    for (n, c, v, chunk) in [
        (37, 64, 50_257, Some(8)),
        (37, 64, 50_257, None),
        (70_000, 16, 67, Some(30_000)),
    ] {
        let x = tensor(&[n, c], 25, 1.0);
        let w = tensor(&[v, c], 26, 0.5);
        let targets: Vec<u32> = (0..n)
            .map(|i| match i % 5 {
                0 => 0,
                1 => (v - 1) as u32,
                _ => ((i * 7919) % v) as u32,
            })
            .collect();
        let targets = Tensor::new(targets, &Device::Cpu).unwrap();
        let weights: Vec<f32> = (0..n).map(|i| [0.25, 0.0, 1.0, 1.5][i % 4]).collect();
        let weights = Tensor::new(weights, &Device::Cpu).unwrap();
        check(
            &format!("linear_cross_entropy [{n}, {c}] x [{v}, {c}], chunks {chunk:?}"),
            &[x, w],
            &[(targets, false), (weights, false)],
            &|p, k| match chunk {
                Some(rows) => {
                    fused_kernels::linear_cross_entropy_in_chunks(&p[0], &p[1], &k[0], &k[1], rows)
                }
                None => fused_kernels::linear_cross_entropy(&p[0], &p[1], &k[0], &k[1]),
            },
        );
    }
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn the_bias_gradient_is_the_same_on_every_cuda_run() {
    // The column sums are one cuBLAS product: deterministic on one GPU.
    let gpu = gpu();
    for dtype in DTYPES {
        let run = || {
            let b = Var::from_tensor(
                &tensor(&[768], 27, 1.0)
                    .to_dtype(dtype)
                    .unwrap()
                    .to_device(&gpu)
                    .unwrap(),
            )
            .unwrap();
            let x = tensor(&[8, 1024, 768], 28, 1.0)
                .to_dtype(dtype)
                .unwrap()
                .to_device(&gpu)
                .unwrap();
            let r = tensor(&[8, 1024, 768], 29, 1.0)
                .to_dtype(dtype)
                .unwrap()
                .to_device(&gpu)
                .unwrap();
            let y = fused_kernels::add_bias(&x, b.as_tensor()).unwrap();
            let g = (y * r).unwrap().sum_all().unwrap().backward().unwrap();
            flat(
                &g.get(b.as_tensor())
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap(),
            )
        };
        assert!(run() == run(), "{dtype:?}");
    }
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn flash_attention_on_cuda_equals_the_cpu_kernel() {
    // (B, T, H, Hkv, D): head dims 64 and 128 (tensor cores in bf16/f16, the simple kernel in
    // f32/f64) with grouped-query heads and T no multiple of the 64-row tiles; head dim 24 (the
    // simple kernel in every dtype); one token.
    for (b, t, h, hkv, d) in [
        (2, 200, 4, 2, 64),
        (1, 130, 2, 1, 128),
        (2, 37, 3, 1, 24),
        (1, 1, 2, 2, 64),
    ] {
        let q = tensor(&[b, t, h, d], 21, 1.0);
        let k = tensor(&[b, t, hkv, d], 22, 2.0);
        let v = tensor(&[b, t, hkv, d], 23, 1.0);
        let scale = 1.0 / (d as f64).sqrt();
        check(
            &format!("flash_attention [{b}, {t}, {h}/{hkv}, {d}]"),
            &[q, k, v],
            &[],
            &|x, _| fused_kernels::flash_attention(&x[0], &x[1], &x[2], scale),
        );
    }
    // The heads of one packed [B, T, H + 2·Hkv, D] projection, read in place (the gradient
    // reaches the packed tensor through the three views), at head dims 64 and 128.
    for d in [64, 128] {
        let packed = tensor(&[2, 100, 8, d], 24, 1.5);
        check(
            &format!("flash_attention packed, D = {d}"),
            &[packed],
            &[],
            &|x, _| {
                let p = &x[0];
                let (q, k, v) = (p.narrow(2, 0, 4)?, p.narrow(2, 4, 2)?, p.narrow(2, 6, 2)?);
                fused_kernels::flash_attention(&q, &k, &v, 0.125)
            },
        );
    }
    // A head-major [B, H, T, D] query transposed (token stride D, head stride T·D).
    let q = tensor(&[2, 4, 90, 64], 25, 1.0);
    let kv = tensor(&[2, 90, 4, 64], 26, 1.0);
    check("flash_attention transposed q", &[q, kv], &[], &|x, _| {
        fused_kernels::flash_attention(&x[0].transpose(1, 2)?, &x[1], &x[1], 0.125)
    });
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn linear_on_cuda_equals_the_cpu_layer() {
    // A 3-d input with a bias (the product and the bias written by the node's forward), and a
    // 2-d one without.
    let x = tensor(&[3, 70, 96], 40, 1.0);
    let w = tensor(&[200, 96], 41, 0.2);
    let b = tensor(&[200], 42, 0.5);
    check("linear with bias", &[x, w, b], &[], &|v, _| {
        fused_kernels::linear(&v[0], &v[1], Some(&v[2]))
    });
    let x = tensor(&[130, 64], 43, 1.0);
    let w = tensor(&[33, 64], 44, 0.2);
    check("linear", &[x, w], &[], &|v, _| {
        fused_kernels::linear(&v[0], &v[1], None)
    });
}

/// The rotary tables `[positions, head_dim / 2]` of `head_dim` (θ = 10 000).
fn rotary_tables(positions: usize, head_dim: usize) -> (Tensor, Tensor) {
    let half = head_dim / 2;
    let angles: Vec<f64> = (0..positions)
        .flat_map(|p| {
            (0..half).map(move |i| p as f64 / 10_000f64.powf(2.0 * i as f64 / head_dim as f64))
        })
        .collect();
    let a = Tensor::from_vec(angles, (positions, half), &Device::Cpu).unwrap();
    (a.cos().unwrap(), a.sin().unwrap())
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn the_fused_attention_layers_on_cuda_equal_the_cpu_layers() {
    use fused_kernels::{attention_block, Attention, Lora, Norm, Projection, Qkv, Rotary};
    // GPT-2's: LayerNorm, a packed c_attn with a bias, the output bias; head dim 64 (tensor
    // cores in bf16/f16, cuBLAS products in f32/f64), T no multiple of the 64-row tiles.
    let (t, w, heads) = (70, 128, 2);
    let x = tensor(&[2, t, w], 45, 1.0);
    let ln_w = (tensor(&[w], 46, 0.3) + 1.0).unwrap();
    let ln_b = tensor(&[w], 47, 0.1);
    let c_attn = tensor(&[3 * w, w], 48, 0.1);
    let c_attn_b = tensor(&[3 * w], 49, 0.1);
    let proj = tensor(&[w, w], 50, 0.1);
    let proj_b = tensor(&[w], 51, 0.1);
    check_within(
        "attention_block (GPT-2)",
        &[x, ln_w, ln_b, c_attn, c_attn_b, proj, proj_b],
        &[],
        &|v, _| {
            let layer = Attention {
                norm: Norm::Layer {
                    weight: v[1].clone(),
                    bias: v[2].clone(),
                    eps: 1e-5,
                },
                qkv: Qkv::Packed(Projection::new(v[3].clone(), Some(v[4].clone()))),
                out: Projection::new(v[5].clone(), Some(v[6].clone())),
                heads,
                kv_heads: heads,
                rotary: None,
            };
            attention_block(&v[0], &layer)
        },
        2.0,
    );
    // Llama's: RMSNorm, q/k/v of 3 query heads over 1 key/value head of 64, rotary embeddings,
    // LoRA adapters on q and v over frozen (constant) weights.
    let (heads, kv, d) = (3, 1, 64);
    let w = heads * d;
    let x = tensor(&[2, t, w], 52, 1.0);
    let rms_w = (tensor(&[w], 53, 0.3) + 1.0).unwrap();
    let (cos, sin) = rotary_tables(96, d);
    let frozen = [
        tensor(&[heads * d, w], 54, 0.1),
        tensor(&[kv * d, w], 55, 0.1),
        tensor(&[kv * d, w], 56, 0.1),
        tensor(&[w, heads * d], 57, 0.1),
    ];
    let adapters = [
        tensor(&[4, w], 58, 0.2),
        tensor(&[heads * d, 4], 59, 0.2),
        tensor(&[4, w], 60, 0.2),
        tensor(&[kv * d, 4], 61, 0.2),
    ];
    let mut constants: Vec<(Tensor, bool)> = frozen.into_iter().map(|t| (t, true)).collect();
    constants.push((cos, true));
    constants.push((sin, true));
    let mut trainable = vec![x, rms_w];
    trainable.extend(adapters);
    check_within(
        "attention_block (Llama, LoRA on q and v)",
        &trainable,
        &constants,
        &|v, c| {
            let lora = |a: &Tensor, b: &Tensor| Lora {
                a: a.clone(),
                b: b.clone(),
                scale: 2.0,
            };
            let layer = Attention {
                norm: Norm::Rms {
                    weight: v[1].clone(),
                    eps: 1e-5,
                },
                qkv: Qkv::Separate {
                    q: Projection {
                        weight: c[0].clone(),
                        bias: None,
                        lora: Some(lora(&v[2], &v[3])),
                    },
                    k: Projection::new(c[1].clone(), None),
                    v: Projection {
                        weight: c[2].clone(),
                        bias: None,
                        lora: Some(lora(&v[4], &v[5])),
                    },
                },
                out: Projection::new(c[3].clone(), None),
                heads,
                kv_heads: kv,
                rotary: Some(Rotary {
                    cos: c[4].clone(),
                    sin: c[5].clone(),
                }),
            };
            attention_block(&v[0], &layer)
        },
        2.0,
    );
}

#[test]
#[ignore = "needs a GPU and --features cuda"]
fn the_fused_mlp_layers_on_cuda_equal_the_cpu_layers() {
    use fused_kernels::{mlp_block, Mlp, MlpKind, Norm, Projection};
    let (t, w, inner) = (70, 96, 300);
    let x = tensor(&[2, t, w], 62, 1.0);
    let norm_w = (tensor(&[w], 63, 0.3) + 1.0).unwrap();
    let norm_b = tensor(&[w], 64, 0.1);
    let fc = tensor(&[inner, w], 65, 0.1);
    let fc_b = tensor(&[inner], 66, 0.1);
    let proj = tensor(&[w, inner], 67, 0.1);
    let proj_b = tensor(&[w], 68, 0.1);
    check_within(
        "mlp_block (GELU)",
        &[x.clone(), norm_w.clone(), norm_b, fc, fc_b, proj, proj_b],
        &[],
        &|v, _| {
            let layer = Mlp {
                norm: Norm::Layer {
                    weight: v[1].clone(),
                    bias: v[2].clone(),
                    eps: 1e-5,
                },
                kind: MlpKind::Gelu {
                    fc: Projection::new(v[3].clone(), Some(v[4].clone())),
                    proj: Projection::new(v[5].clone(), Some(v[6].clone())),
                },
            };
            mlp_block(&v[0], &layer)
        },
        2.0,
    );
    let gate = tensor(&[inner, w], 69, 0.1);
    let up = tensor(&[inner, w], 70, 0.1);
    let down = tensor(&[w, inner], 71, 0.1);
    check_within(
        "mlp_block (SwiGLU)",
        &[x, norm_w, gate, up, down],
        &[],
        &|v, _| {
            let layer = Mlp {
                norm: Norm::Rms {
                    weight: v[1].clone(),
                    eps: 1e-5,
                },
                kind: MlpKind::SwiGlu {
                    gate: Projection::new(v[2].clone(), None),
                    up: Projection::new(v[3].clone(), None),
                    down: Projection::new(v[4].clone(), None),
                },
            };
            mlp_block(&v[0], &layer)
        },
        2.0,
    );
}
