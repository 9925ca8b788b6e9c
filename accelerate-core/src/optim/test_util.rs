//! Helpers shared by the optimizer tests.

use candle_core::{DType, Device, Tensor, Var};

use crate::grads::{GradientBuffers, DEFAULT_BUCKET_CAP_BYTES};

/// What an update rule's test module needs, in one import.
pub(crate) mod prelude {
    pub(crate) use super::{assert_close, buffers, named, values};
    pub(crate) use crate::optim::conformance::Reference;
    pub(crate) use crate::optim::Optimizer;
    pub(crate) use candle_core::DType;
}

/// Reproducible values in [-1, 1) from a fixed LCG, without a dependency.
pub(crate) fn pseudo_random(n: usize, seed: u32) -> Vec<f64> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
            (x >> 8) as f64 / (1u32 << 23) as f64 - 1.0
        })
        .collect()
}

/// A 1-D CPU parameter of `dtype` holding `values`.
pub(crate) fn var(values: &[f64], dtype: DType) -> Var {
    let t = Tensor::new(values, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    Var::from_tensor(&t).unwrap()
}

/// Named 1-D f32 parameters.
pub(crate) fn named(params: &[(&str, &[f64])], dtype: DType) -> Vec<(String, Var)> {
    params
        .iter()
        .map(|(n, v)| (n.to_string(), var(v, dtype)))
        .collect()
}

/// The values of a parameter, widened to f64.
pub(crate) fn values(var: &Var) -> Vec<f64> {
    var.as_tensor()
        .flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Gradient buffers over `params` (one bucket, so every parameter after the first is a view at an
/// offset) holding `grads` by name; parameters not named get no gradient.
pub(crate) fn buffers(params: &[(String, Var)], grads: &[(&str, &[f64])]) -> GradientBuffers {
    let mut b = GradientBuffers::new(params, DEFAULT_BUCKET_CAP_BYTES).unwrap();
    for (name, g) in grads {
        let t = Tensor::new(*g, &Device::Cpu).unwrap();
        b.accumulate_one(name, &t, 1.0).unwrap();
    }
    b
}

/// Asserts `|a - b| <= tol · max(1, |b|)` elementwise.
pub(crate) fn assert_close(actual: &[f64], expected: &[f64], tol: f64, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            (a - e).abs() <= tol * e.abs().max(1.0),
            "{what}[{i}]: got {a}, expected {e} (tolerance {tol})"
        );
    }
}

/// The first GPU, once per test: candle gives every `Device::new_cuda` its own device id, and
/// tensors made through two of them sit on two devices as far as `same_device` can tell (the
/// optimizer then batches them into a launch per device, and the gradient kernel refuses them).
#[cfg(feature = "cuda")]
pub(crate) fn cuda_device() -> Device {
    Device::new_cuda(0).expect("a GPU (these tests are ignored without one)")
}

/// Copies of `params` on `device`.
#[cfg(feature = "cuda")]
pub(crate) fn on_cuda(params: &[(String, Var)], device: &Device) -> Vec<(String, Var)> {
    params
        .iter()
        .map(|(n, v)| {
            let t = v.as_tensor().to_device(device).unwrap();
            (n.clone(), Var::from_tensor(&t).unwrap())
        })
        .collect()
}

/// Gradient buffers for parameters on a GPU, to be built once and filled by [`cuda_refill`] at
/// every step, as the runtime keeps its buffers (their addresses stay put, so the optimizer's
/// tensor table need not be uploaded again).
#[cfg(feature = "cuda")]
pub(crate) fn cuda_buffers(params: &[(String, Var)]) -> GradientBuffers {
    GradientBuffers::new(params, DEFAULT_BUCKET_CAP_BYTES).unwrap()
}

/// Zeroes `buffers` (as the runtime does after a step) and accumulates `grads` into them, made on
/// the parameters' GPU; parameters not named get no gradient.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_refill(
    buffers: &mut GradientBuffers,
    params: &[(String, Var)],
    grads: &[(&str, &[f64])],
) {
    let device = params[0].1.device();
    buffers.zero();
    for (name, g) in grads {
        let t = Tensor::new(*g, device).unwrap();
        buffers.accumulate_one(name, &t, 1.0).unwrap();
    }
}
