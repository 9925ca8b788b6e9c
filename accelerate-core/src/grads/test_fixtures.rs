//! Parameters and gradients shared by the tests of the buffers and of the overlap thread.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::{sorted_named_vars, GradientBuffers};

pub(crate) fn vars() -> Vec<(String, Var)> {
    vec![
        (
            "a".into(),
            Var::zeros((2, 3), DType::F32, &Device::Cpu).unwrap(),
        ),
        ("b".into(), Var::zeros(4, DType::F32, &Device::Cpu).unwrap()),
        (
            "c".into(),
            Var::zeros((3, 2), DType::F32, &Device::Cpu).unwrap(),
        ),
    ]
}

pub(crate) fn value(i: usize, seed: u64) -> f32 {
    ((i as u64 * 7919 + seed * 104_729) % 1000) as f32 / 500.0 - 1.0
}

/// Layer sizes of `model()`: large enough that filling a bucket takes the worker thread a
/// while, so that a reduction not waiting for it would see an incomplete bucket.
pub(crate) const LAYERS: [(usize, usize); 4] = [(384, 320), (320, 256), (256, 192), (192, 128)];

/// Parameters of several shapes: four linear layers and one parameter no loss uses.
pub(crate) fn model() -> Vec<(String, Var)> {
    let dev = &Device::Cpu;
    let mut params = Vec::new();
    for (i, (rows, cols)) in LAYERS.iter().enumerate() {
        let gain = 1.0 / (*cols as f32).sqrt();
        let w: Vec<f32> = (0..rows * cols).map(|k| value(k + i, 0) * gain).collect();
        let b: Vec<f32> = (0..*rows).map(|k| value(k * 3 + i, 0)).collect();
        let w = Tensor::from_vec(w, (*rows, *cols), dev).unwrap();
        let b = Tensor::from_vec(b, *rows, dev).unwrap();
        params.push((format!("l{i}.bias"), Var::from_tensor(&b).unwrap()));
        params.push((format!("l{i}.weight"), Var::from_tensor(&w).unwrap()));
    }
    params.push(("unused".into(), Var::zeros(5, DType::F32, dev).unwrap()));
    sorted_named_vars(params).unwrap()
}

/// The gradients of one backward pass of `model()` on a batch that `seed` picks. The weight
/// gradients come back as transposed views, as from every `Linear`.
pub(crate) fn grads(params: &[(String, Var)], seed: u64) -> GradStore {
    let var = |name: &str| params.iter().find(|(n, _)| n == name).unwrap().1.clone();
    let inputs = LAYERS[3].1;
    let x: Vec<f32> = (0..8 * inputs).map(|k| value(k * 5, seed)).collect();
    let mut h = Tensor::from_vec(x, (8, inputs), &Device::Cpu).unwrap();
    for i in (0..4).rev() {
        let w = var(&format!("l{i}.weight"));
        let b = var(&format!("l{i}.bias"));
        h = h.matmul(&w.as_tensor().t().unwrap()).unwrap();
        h = h.broadcast_add(b.as_tensor()).unwrap().tanh().unwrap();
    }
    h.sqr().unwrap().sum_all().unwrap().backward().unwrap()
}

/// A bucket's values as bits, to compare bitwise.
pub(crate) type BucketBits = Vec<u32>;

pub(crate) fn flats(g: &GradientBuffers) -> Vec<BucketBits> {
    g.buckets()
        .iter()
        .map(|b| {
            let v = b.flat().to_vec1::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        })
        .collect()
}

/// A cap that splits `model()` into six buckets: [l0.bias], [l0.weight], [l1.bias],
/// [l1.weight], [l2.bias, l2.weight, l3.bias], [l3.weight, unused].
pub(crate) const SMALL_CAP: usize = 256 * 1024;
