//! Helpers shared by the test modules.

use candle_core::{DType, Device, Result, Tensor, Var};

/// `n` deterministic values in `[-1, 1)` (xorshift from `seed`).
pub fn values(n: usize, seed: u64) -> Vec<f64> {
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

/// A tensor of `shape` with [`values`] scaled by `scale`, in f64.
pub fn tensor(shape: &[usize], seed: u64, scale: f64) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = values(n, seed).into_iter().map(|x| x * scale).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The elements of `t` as f64.
pub fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Checks the analytic gradient of `loss = Σ f(inputs) · r` (`r` fixed pseudo-random) with
/// respect to `inputs[i]` for every `i` in `wrt` against central differences, in f64.
pub fn check_gradients(
    name: &str,
    inputs: &[Tensor],
    wrt: &[usize],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let out_shape = f(inputs).unwrap().dims().to_vec();
    let r = tensor(&out_shape, 99, 1.0);
    let loss = |xs: &[Tensor]| -> f64 {
        (f(xs).unwrap() * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let vars: Vec<Tensor> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if wrt.contains(&i) {
                Var::from_tensor(t).unwrap().as_tensor().clone()
            } else {
                t.clone()
            }
        })
        .collect();
    let l = (f(&vars).unwrap() * &r).unwrap().sum_all().unwrap();
    let grads = l.backward().unwrap();
    let h = 1e-6;
    for &i in wrt {
        let analytic = flat(
            grads
                .get(&vars[i])
                .unwrap_or_else(|| panic!("{name}: no gradient for input {i}")),
        );
        let base = flat(&inputs[i]);
        assert_eq!(
            analytic.len(),
            base.len(),
            "{name}: input {i} gradient size"
        );
        for k in 0..base.len() {
            let at = |delta: f64| {
                let mut v = base.clone();
                v[k] += delta;
                let mut xs = inputs.to_vec();
                xs[i] = Tensor::from_vec(v, inputs[i].dims(), &Device::Cpu).unwrap();
                loss(&xs)
            };
            let numeric = (at(h) - at(-h)) / (2.0 * h);
            let tol = 1e-6 * numeric.abs().max(1.0);
            assert!(
                (analytic[k] - numeric).abs() < tol,
                "{name}: d input {i} [{k}]: analytic {} vs finite differences {numeric}",
                analytic[k]
            );
        }
    }
}
