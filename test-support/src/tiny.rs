//! A tiny seeded model, the same in every crate's tests: a two-layer tanh MLP with PyTorch's
//! parameter names.

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{Linear, Module, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Inputs of the tiny model.
pub const TINY_IN: usize = 6;
/// Classes of the tiny model.
pub const TINY_CLASSES: usize = 3;

/// A two-layer tanh MLP, 6 → 8 → 3, parameters `l1.weight`, `l1.bias`, `l2.weight`, `l2.bias`.
#[derive(Debug)]
pub struct TinyMlp {
    l1: Linear,
    l2: Linear,
}

impl TinyMlp {
    /// Logits.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.tanh()?)
    }
}

/// The tiny model with seeded weights in U(-0.5, 0.5) (same seed, same weights).
pub fn tiny_mlp(seed: u64) -> Result<(VarMap, TinyMlp)> {
    tiny_mlp_on(seed, &Device::Cpu)
}

/// [`tiny_mlp`] with its parameters on `device` (the same values on every device).
pub fn tiny_mlp_on(seed: u64, device: &Device) -> Result<(VarMap, TinyMlp)> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
    let model = TinyMlp {
        l1: candle_nn::linear(TINY_IN, 8, vb.pp("l1"))?,
        l2: candle_nn::linear(8, TINY_CLASSES, vb.pp("l2"))?,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for (_, var) in named_vars(&varmap) {
        let v: Vec<f32> = (0..var.elem_count())
            .map(|_| rng.random_range(-0.5f32..0.5))
            .collect();
        var.set(&Tensor::from_vec(v, var.dims(), device)?)?;
    }
    Ok((varmap, model))
}

/// The parameters of a `VarMap`, sorted by name.
pub fn named_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let mut v: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}
