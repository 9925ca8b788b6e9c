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
//! Needs a GPU: `cargo test --release -p fused-kernels --features cuda --test cuda -- --ignored`
//! (or the binary `scripts/gpu-build.sh build` leaves in `target/cuda/release/deps/cuda-*`).

#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::{flat, tensor};

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
        let tol = tolerance(dtype);
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
    common::values(n, seed)
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
