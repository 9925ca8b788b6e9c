//! Every op's output and gradients against PyTorch's (and transformers') values, written by
//! `fixtures/make_fixtures.py` into `fixtures/pytorch.safetensors` (float64; see the script for
//! the reference function of each op). The ops run in f64 and in f32.

use crate::common::flat;
use candle_core::{DType, Device, Result, Tensor, Var};
use std::collections::HashMap;

fn fixtures() -> HashMap<String, Tensor> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/pytorch.safetensors"
    );
    candle_core::safetensors::load(path, &Device::Cpu).expect("the committed fixture file")
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    for (i, (g, w)) in flat(got).iter().zip(flat(want)).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}[{i}]: ours {g} vs PyTorch {w}"
        );
    }
}

/// Runs `f` on the fixture inputs of `op` named `names` (as Vars in `dtype` for those in
/// `trainable`, plain tensors for the others, which keep their stored dtype) and compares the
/// output and the gradients of `Σ out · dy`.
fn compare(op: &str, names: &[&str], trainable: &[&str], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let fx = fixtures();
    let get = |k: &str| fx[&format!("{op}.{k}")].clone();
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 2e-5)] {
        let inputs: Vec<Tensor> = names
            .iter()
            .map(|n| {
                let t = get(n);
                if trainable.contains(n) {
                    Var::from_tensor(&t.to_dtype(dtype).unwrap())
                        .unwrap()
                        .as_tensor()
                        .clone()
                } else if t.dtype().is_float() {
                    t.to_dtype(dtype).unwrap()
                } else {
                    t
                }
            })
            .collect();
        let out = f(&inputs).unwrap();
        let what = format!("{op} ({dtype:?})");
        assert_close(&format!("{what} out"), &out, &get("out"), tol);
        let dy = get("dy").to_dtype(out.dtype()).unwrap();
        let grads = (out * dy).unwrap().sum_all().unwrap().backward().unwrap();
        for (n, t) in names.iter().zip(&inputs) {
            if trainable.contains(n) {
                let g = grads
                    .get(t)
                    .unwrap_or_else(|| panic!("{what}: no gradient for {n}"));
                assert_close(&format!("{what} d_{n}"), g, &get(&format!("d_{n}")), tol);
            }
        }
    }
}

#[test]
fn layer_norm_matches_f_layer_norm() {
    let n = ["x", "weight", "bias"];
    compare("layer_norm", &n, &n, |x| {
        fused_kernels::layer_norm(&x[0], &x[1], &x[2], 1e-5)
    });
}

#[test]
fn rms_norm_matches_f_rms_norm() {
    let n = ["x", "weight"];
    compare("rms_norm", &n, &n, |x| {
        fused_kernels::rms_norm(&x[0], &x[1], 1e-6)
    });
}

#[test]
fn causal_softmax_matches_masked_torch_softmax() {
    compare("causal_softmax", &["scores"], &["scores"], |x| {
        fused_kernels::causal_softmax(&x[0], 0.35)
    });
}

#[test]
fn cross_entropy_matches_weighted_f_cross_entropy() {
    compare(
        "cross_entropy",
        &["logits", "targets", "weights"],
        &["logits"],
        |x| fused_kernels::cross_entropy(&x[0], &x[1], &x[2]),
    );
}

#[test]
fn activations_match_f_gelu_tanh_and_f_silu() {
    compare("gelu", &["x"], &["x"], |x| fused_kernels::gelu(&x[0]));
    compare("silu", &["x"], &["x"], |x| fused_kernels::silu(&x[0]));
    let n = ["gate", "up"];
    compare("swiglu", &n, &n, |x| fused_kernels::swiglu(&x[0], &x[1]));
}

#[test]
fn rotary_matches_transformers_apply_rotary_pos_emb() {
    compare("rotary", &["x", "cos", "sin"], &["x"], |x| {
        fused_kernels::rotary(&x[0], &x[1], &x[2])
    });
}

#[test]
fn add_bias_and_linear_match_torch() {
    let n = ["x", "bias"];
    compare("add_bias", &n, &n, |x| {
        fused_kernels::add_bias(&x[0], &x[1])
    });
    let n = ["x", "weight", "bias"];
    compare("linear", &n, &n, |x| {
        fused_kernels::linear(&x[0], &x[1], Some(&x[2]))
    });
}
