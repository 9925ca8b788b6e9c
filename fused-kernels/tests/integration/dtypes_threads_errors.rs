//! bf16/f16 inputs (computed in f32), the row-parallel paths on large tensors, and the errors for
//! wrong shapes.

use crate::common::{flat, tensor};
use candle_core::{DType, Device, Result, Tensor, Var};

/// The output and gradients of `Σ f(inputs) · r` for `inputs` cast to `dtype`.
fn run(
    inputs: &[Tensor],
    dtype: DType,
    f: &(dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync),
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let vars: Vec<Tensor> = inputs
        .iter()
        .map(|t| {
            Var::from_tensor(&t.to_dtype(dtype).unwrap())
                .unwrap()
                .as_tensor()
                .clone()
        })
        .collect();
    let out = f(&vars).unwrap();
    let r = tensor(out.dims(), 77, 1.0).to_dtype(out.dtype()).unwrap();
    let grads = (&out * r).unwrap().sum_all().unwrap().backward().unwrap();
    let g = vars.iter().map(|v| flat(grads.get(v).unwrap())).collect();
    (flat(&out), g)
}

type Op = (
    &'static str,
    Vec<Tensor>,
    Box<dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync>,
);

/// Every op with a gradient for each input, on inputs large enough for the parallel paths
/// (`rows` rows of `d`).
fn ops(rows: usize, d: usize) -> Vec<Op> {
    let x = || tensor(&[rows, d], 1, 2.0);
    let w = || (tensor(&[d], 2, 0.5) + 1.0).unwrap();
    let angles = tensor(&[rows / 4, d / 2], 3, 2.0);
    vec![
        ("gelu", vec![x()], Box::new(|x| fused_kernels::gelu(&x[0]))),
        ("silu", vec![x()], Box::new(|x| fused_kernels::silu(&x[0]))),
        (
            "swiglu",
            vec![x(), tensor(&[rows, d], 4, 1.0)],
            Box::new(|x| fused_kernels::swiglu(&x[0], &x[1])),
        ),
        (
            "layer_norm",
            vec![x(), w(), tensor(&[d], 5, 1.0)],
            Box::new(|x| fused_kernels::layer_norm(&x[0], &x[1], &x[2], 1e-5)),
        ),
        (
            "rms_norm",
            vec![x(), w()],
            Box::new(|x| fused_kernels::rms_norm(&x[0], &x[1], 1e-6)),
        ),
        (
            "causal_softmax",
            vec![tensor(&[rows / d, d, d], 6, 3.0)],
            Box::new(|x| fused_kernels::causal_softmax(&x[0], 0.5)),
        ),
        (
            "add_bias",
            vec![x(), w()],
            Box::new(|x| fused_kernels::add_bias(&x[0], &x[1])),
        ),
        (
            "rotary",
            vec![tensor(&[2, 2, rows / 4, d], 7, 1.0)],
            Box::new(move |x| {
                let dt = x[0].dtype();
                fused_kernels::rotary(
                    &x[0],
                    &angles.cos()?.to_dtype(dt)?,
                    &angles.sin()?.to_dtype(dt)?,
                )
            }),
        ),
        (
            "embedding",
            // A table of `rows` rows; twice as many ids, every row named about twice.
            vec![x()],
            Box::new(move |x| {
                let ids: Vec<u32> = (0..2 * rows as u32)
                    .map(|i| (i * 7 + i / 3) % rows as u32)
                    .collect();
                let ids = Tensor::from_vec(ids, (2, rows), &Device::Cpu)?;
                fused_kernels::embedding(&ids, &x[0])
            }),
        ),
        (
            "linear_cross_entropy",
            // 67 classes; chunks of rows / 3 + 1 rows (three chunks, the last one short).
            vec![x(), tensor(&[67, d], 8, 0.5)],
            Box::new(move |x| {
                let n = x[0].dim(0)?;
                let targets: Vec<u32> = (0..n as u32).map(|i| (i * 13) % 67).collect();
                let targets = Tensor::new(targets, &Device::Cpu)?;
                let weights = Tensor::ones(n, DType::F32, &Device::Cpu)?;
                fused_kernels::linear_cross_entropy_in_chunks(
                    &x[0],
                    &x[1],
                    &targets,
                    &weights,
                    n / 3 + 1,
                )
            }),
        ),
        (
            "cross_entropy",
            vec![x()],
            Box::new(move |x| {
                let n = x[0].dim(0)?;
                let targets: Vec<u32> = (0..n as u32).map(|i| (i * 7) % d as u32).collect();
                let targets = Tensor::new(targets, &Device::Cpu)?;
                let weights = Tensor::ones(n, DType::F32, &Device::Cpu)?;
                fused_kernels::cross_entropy(&x[0], &targets, &weights)
            }),
        ),
    ]
}

fn max_relative_error(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
}

#[test]
fn bf16_and_f16_are_computed_in_f32_and_rounded_once() {
    for (name, inputs, f) in ops(64, 32) {
        let (out64, grads64) = run(&inputs, DType::F64, f.as_ref());
        for (dtype, tol) in [(DType::BF16, 2e-2), (DType::F16, 4e-3)] {
            let (out, grads) = run(&inputs, dtype, f.as_ref());
            let e = max_relative_error(&out, &out64);
            assert!(e < tol, "{name} {dtype:?}: output error {e}");
            for (i, (g, g64)) in grads.iter().zip(&grads64).enumerate() {
                let e = max_relative_error(g, g64);
                assert!(e < tol, "{name} {dtype:?}: gradient {i} error {e}");
            }
        }
    }
}

#[test]
fn the_parallel_paths_give_the_single_thread_results_exactly() {
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    // 2048 rows × 64: 128 Ki elements, past every op's threshold for splitting.
    for (name, inputs, f) in ops(2048, 64) {
        let one = pool(1).install(|| run(&inputs, DType::F32, f.as_ref()));
        let four = pool(4).install(|| run(&inputs, DType::F32, f.as_ref()));
        assert_eq!(one, four, "{name}: 1 thread vs 4 threads");
        // And both are right: within f32 rounding of the f64 result.
        // Outputs and gradients: the parameter gradients are sums over the rows of every block.
        let (out64, grads64) = run(&inputs, DType::F64, f.as_ref());
        let e = max_relative_error(&one.0, &out64);
        assert!(e < 1e-5, "{name}: f32 vs f64 {e}");
        for (i, (g, g64)) in one.1.iter().zip(&grads64).enumerate() {
            let e = max_relative_error(g, g64);
            assert!(e < 1e-4, "{name}: gradient {i}, f32 vs f64 {e}");
        }
    }
}

fn error_of(r: Result<Tensor>) -> String {
    match r {
        Ok(t) => panic!("accepted, gave shape {:?}", t.dims()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn wrong_shapes_are_refused_with_the_op_and_both_shapes() {
    let x = Tensor::zeros((2, 3, 8), DType::F32, &Device::Cpu).unwrap();
    let v7 = Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap();
    let v8 = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
    let e = error_of(fused_kernels::layer_norm(&x, &v7, &v8, 1e-5));
    assert!(
        e.contains("layer_norm") && e.contains("[8]") && e.contains("[7]"),
        "{e}"
    );
    let e = error_of(fused_kernels::rms_norm(&x, &v7, 1e-5));
    assert!(e.contains("rms_norm") && e.contains("[7]"), "{e}");
    let e = error_of(fused_kernels::add_bias(&x, &v7));
    assert!(e.contains("add_bias") && e.contains("[2, 3, 8]"), "{e}");
    let wide = Tensor::zeros((2, 5, 3), DType::F32, &Device::Cpu).unwrap();
    let e = error_of(fused_kernels::causal_softmax(&wide, 1.0));
    assert!(e.contains("causal_softmax") && e.contains("t_q = 5"), "{e}");
    let cos = Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap();
    let e = error_of(fused_kernels::rotary(&x, &cos, &cos));
    assert!(
        e.contains("rotary") && e.contains("[3, 4]") && e.contains("[3, 3]"),
        "{e}"
    );
    let e = error_of(fused_kernels::swiglu(&x, &v8));
    assert!(e.contains("swiglu") && e.contains("[8]"), "{e}");
    let logits = Tensor::zeros((4, 5), DType::F32, &Device::Cpu).unwrap();
    let w = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
    let t = Tensor::new(&[0u32, 1, 2], &Device::Cpu).unwrap();
    let e = error_of(fused_kernels::cross_entropy(&logits, &t, &w));
    assert!(
        e.contains("cross_entropy") && e.contains("targets") && e.contains("[3]"),
        "{e}"
    );
    let t = Tensor::new(&[0u32, 1, 5, 2], &Device::Cpu).unwrap();
    let e = error_of(fused_kernels::cross_entropy(&logits, &t, &w));
    assert!(e.contains("targets[2] = 5"), "{e}");
    let e = error_of(fused_kernels::gelu(
        &Tensor::new(&[1u32], &Device::Cpu).unwrap(),
    ));
    assert!(e.contains("gelu") && e.contains("U32"), "{e}");
}

#[test]
fn flash_attention_refuses_bad_shapes_dtypes_and_scales() {
    let z = |shape: &[usize], dtype: DType| Tensor::zeros(shape, dtype, &Device::Cpu).unwrap();
    let f32s = |shape: &[usize]| z(shape, DType::F32);
    let (q, kv) = (f32s(&[2, 5, 4, 8]), f32s(&[2, 5, 2, 8]));
    let e = error_of(fused_kernels::flash_attention(
        &f32s(&[5, 4, 8]),
        &kv,
        &kv,
        1.0,
    ));
    assert!(
        e.contains("flash_attention") && e.contains("q must have shape [B, T, H, D]"),
        "{e}"
    );
    let e = error_of(fused_kernels::flash_attention(
        &q,
        &f32s(&[2, 5, 2, 7]),
        &kv,
        1.0,
    ));
    assert!(e.contains("[2, 5, 2, 7]") && e.contains("D = 8"), "{e}");
    let e = error_of(fused_kernels::flash_attention(
        &q,
        &kv,
        &f32s(&[2, 6, 2, 8]),
        1.0,
    ));
    assert!(e.contains("[2, 6, 2, 8]") && e.contains("T = 5"), "{e}");
    let k3 = f32s(&[2, 5, 3, 8]);
    let e = error_of(fused_kernels::flash_attention(&q, &k3, &k3, 1.0));
    assert!(
        e.contains("4 query heads") && e.contains("3 key/value heads"),
        "{e}"
    );
    let e = error_of(fused_kernels::flash_attention(
        &q,
        &z(&[2, 5, 2, 8], DType::BF16),
        &kv,
        1.0,
    ));
    assert!(e.contains("one dtype") && e.contains("BF16"), "{e}");
    let u = z(&[2, 5, 2, 8], DType::U32);
    let e = error_of(fused_kernels::flash_attention(
        &z(&[2, 5, 4, 8], DType::U32),
        &u,
        &u,
        1.0,
    ));
    assert!(e.contains("U32") && e.contains("not supported"), "{e}");
    let e = error_of(fused_kernels::flash_attention(&q, &kv, &kv, f64::NAN));
    assert!(e.contains("softmax_scale must be finite"), "{e}");
    let e = error_of(fused_kernels::flash_attention(
        &f32s(&[2, 5, 4, 0]),
        &f32s(&[2, 5, 2, 0]),
        &f32s(&[2, 5, 2, 0]),
        1.0,
    ));
    assert!(e.contains("head dimension D is 0"), "{e}");
}
