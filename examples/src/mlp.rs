//! The MLP workload: 784 → H → H → 10 with ReLU, trained with cross-entropy on a synthetic
//! classification task whose labels are `argmax(x · W)` for a fixed random `W`.
//!
//! Parameter names and layouts are PyTorch's `nn.Sequential`-of-`nn.Linear` ones (`l1.weight` is
//! `[H, 784]`), so weights move between this model and PyTorch unchanged.
//!
//! Under mixed precision the model is built in the accelerator's compute dtype (bf16 or f16): its
//! forward pass casts the inputs to that dtype and returns f32 logits, so the loss is computed in
//! f32 (as autocast does for losses).
//!
//! A prepared model computes through its units ([`units`], [`forward`]): one unit per layer, so
//! that the same code trains at every ZeRO stage, stage 3 (fully sharded) included.

use accelerate_core::{PreparedModel, UnitParams, UnitSpec};
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Linear, VarBuilder, VarMap};

use crate::layers::linear;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Input features.
pub const INPUTS: usize = 784;
/// Classes.
pub const CLASSES: usize = 10;

/// The model.
#[derive(Debug, Clone)]
pub struct Mlp {
    l1: Linear,
    l2: Linear,
    l3: Linear,
    /// The dtype of the parameters, which the forward pass computes in.
    dtype: DType,
}

impl Mlp {
    /// Creates the three layers under `vb` (names `l1`, `l2`, `l3`), in `vb`'s dtype.
    pub fn new(vb: VarBuilder, hidden: usize) -> Result<Self> {
        Ok(Self {
            dtype: vb.dtype(),
            l1: candle_nn::linear(INPUTS, hidden, vb.pp("l1"))?,
            l2: candle_nn::linear(hidden, hidden, vb.pp("l2"))?,
            l3: candle_nn::linear(hidden, CLASSES, vb.pp("l3"))?,
        })
    }

    /// Logits `[batch, 10]`, in f32 whatever the model's dtype (`x` is cast to it first).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = linear(&self.l1, &x.to_dtype(self.dtype)?)?.relu()?;
        let h = linear(&self.l2, &h)?.relu()?;
        linear(&self.l3, &h)?.to_dtype(DType::F32)
    }
}

/// The layers, in order: each is one unit of a prepared model, named as its parameters' prefix.
pub const LAYERS: [&str; 3] = ["l1", "l2", "l3"];

/// The model's units (`Model::new(params).units(mlp::units())`): one per layer, `l1` holding
/// `l1.weight` and `l1.bias`, and so on. Under ZeRO stage 3 each is gathered, computed and freed
/// as one; at the other stages they only name the parameters [`forward`] reads.
pub fn units() -> Vec<UnitSpec> {
    LAYERS
        .iter()
        .map(|l| UnitSpec::new(*l, [format!("{l}.")]))
        .collect()
}

/// Layer `name` of [`Mlp`] on `x`, from the unit's parameters: the same ops as [`Mlp::forward`]'s
/// for that layer (the input cast to the parameters' dtype, the product, ReLU on the hidden
/// layers), so that on the same parameters the two are the same computation.
fn layer(name: &str, x: &Tensor, p: &UnitParams) -> Result<Tensor> {
    let w = p.get(&format!("{name}.weight"))?;
    let b = p.get(&format!("{name}.bias"))?;
    let x = x.to_dtype(w.dtype())?;
    let y = linear(&Linear::new(w, Some(b)), &x)?;
    match name {
        "l3" => Ok(y),
        _ => y.relu(),
    }
}

/// Logits `[batch, 10]`, in f32, of a model prepared with [`units`]: each layer runs through its
/// unit (`model.unit(name)?.forward`), which at ZeRO stages 0 to 2 is a plain call on the prepared
/// parameters (under mixed precision their compute copies) and at stage 3 gathers the layer's
/// parameters for the call. The result is [`Mlp::forward`]'s on the same parameters.
pub fn forward(model: &PreparedModel, x: &Tensor) -> accelerate_core::Result<Tensor> {
    let mut h = x.clone();
    for name in LAYERS {
        h = model
            .unit(name)?
            .forward(&h, move |x, p| layer(name, x, p))?;
    }
    Ok(h.to_dtype(DType::F32)?)
}

/// Builds the model in f32 (see [`build_in`]).
pub fn build(hidden: usize, seed: u64, device: &Device) -> Result<(VarMap, Mlp)> {
    build_in(hidden, seed, device, DType::F32)
}

/// Builds the model in `dtype` (the accelerator's compute dtype) in a fresh `VarMap`, with seeded
/// PyTorch-default initial weights (`U(-1/sqrt(fan_in), 1/sqrt(fan_in))` for weights and biases,
/// as `nn.Linear`; drawn in f32, then rounded to `dtype`).
pub fn build_in(hidden: usize, seed: u64, device: &Device, dtype: DType) -> Result<(VarMap, Mlp)> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, device);
    let model = Mlp::new(vb, hidden)?;
    init_weights(&varmap, seed)?;
    Ok((varmap, model))
}

/// Overwrites every parameter of `varmap` with seeded `U(-1/sqrt(fan_in), 1/sqrt(fan_in))` values,
/// visiting parameters in sorted-name order (so the result does not depend on hash-map order).
pub fn init_weights(varmap: &VarMap, seed: u64) -> Result<()> {
    let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x1417);
    for name in names {
        let var = &data[name];
        let dims = var.dims().to_vec();
        // A weight is [out, in]; its bias [out] shares the layer's fan-in, found from the weight.
        let fan_in = if dims.len() == 2 {
            dims[1]
        } else {
            let weight = name.replace(".bias", ".weight");
            data.get(&weight).map(|w| w.dims()[1]).unwrap_or(dims[0])
        };
        let bound = 1.0 / (fan_in as f32).sqrt();
        let values: Vec<f32> = (0..var.elem_count())
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        let values = Tensor::from_vec(values, dims.as_slice(), var.device())?;
        var.set(&values.to_dtype(var.dtype())?)?;
    }
    Ok(())
}

/// The synthetic dataset: `x` `[samples, 784]` uniform in [-1, 1), `y` `[samples]` (u32) the
/// argmax of `x · W` for a fixed seeded `W` `[784, 10]`.
pub fn synthetic_data(samples: usize, seed: u64) -> Result<(Tensor, Tensor)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xDA7A);
    let w: Vec<f32> = (0..INPUTS * CLASSES)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let mut x = Vec::with_capacity(samples * INPUTS);
    let mut y = Vec::with_capacity(samples);
    for _ in 0..samples {
        let row: Vec<f32> = (0..INPUTS)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut scores = [0f32; CLASSES];
        for (i, &xi) in row.iter().enumerate() {
            for (c, s) in scores.iter_mut().enumerate() {
                *s += xi * w[i * CLASSES + c];
            }
        }
        let label = (0..CLASSES)
            .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
            .unwrap_or(0);
        y.push(label as u32);
        x.extend_from_slice(&row);
    }
    Ok((
        Tensor::from_vec(x, (samples, INPUTS), &Device::Cpu)?,
        Tensor::from_vec(y, samples, &Device::Cpu)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_argmax_of_a_linear_map_and_use_every_class() {
        let (x, y) = synthetic_data(2000, 3).unwrap();
        assert_eq!(x.dims(), &[2000, INPUTS]);
        let y = y.to_vec1::<u32>().unwrap();
        let mut counts = [0usize; CLASSES];
        for &l in &y {
            counts[l as usize] += 1;
        }
        assert!(counts.iter().all(|&c| c > 50), "{counts:?}");
        let (x2, y2) = synthetic_data(2000, 3).unwrap();
        assert_eq!(y, y2.to_vec1::<u32>().unwrap());
        assert_eq!(x.to_vec2::<f32>().unwrap(), x2.to_vec2::<f32>().unwrap());
    }

    #[test]
    fn init_is_seeded_and_bounded_like_torch_linear() {
        let (a, _) = build(16, 7, &Device::Cpu).unwrap();
        let (b, _) = build(16, 7, &Device::Cpu).unwrap();
        let get = |m: &VarMap, n: &str| {
            m.data().lock().unwrap()[n]
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(get(&a, "l1.weight"), get(&b, "l1.weight"));
        let bound = 1.0 / (INPUTS as f32).sqrt();
        assert!(get(&a, "l1.bias").iter().all(|v| v.abs() <= bound));
        let l3 = get(&a, "l3.weight");
        assert!(l3.iter().all(|v| v.abs() <= 0.25) && l3.iter().any(|v| v.abs() > 0.2));
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// The units path on a model prepared at `stage` (below 3: the units compute on the Vars the
    /// model was built from) against [`Mlp::forward`] on those Vars: logits and gradients bit for
    /// bit.
    fn units_path_is_the_plain_model(stage: u8, mode: accelerate_core::MixedPrecision) {
        use accelerate_core::{Accelerator, Model};
        let dtype = match mode {
            accelerate_core::MixedPrecision::Bf16 => DType::BF16,
            _ => DType::F32,
        };
        let (varmap, plain) = build_in(24, 5, &Device::Cpu, dtype).unwrap();
        let mut acc = Accelerator::builder()
            .mixed_precision(mode)
            .zero_stage(stage)
            .build()
            .unwrap();
        let model = acc
            .prepare_model(Model::from_varmap(&varmap).units(units()))
            .unwrap();
        let (x, y) = synthetic_data(12, 2).unwrap();
        let ours = forward(&model, &x).unwrap();
        let theirs = plain.forward(&x).unwrap();
        assert_eq!(ours.dtype(), DType::F32);
        assert_eq!(bits(&ours), bits(&theirs), "stage {stage} {mode}: logits");
        let g_ours = candle_nn::loss::cross_entropy(&ours, &y)
            .unwrap()
            .backward()
            .unwrap();
        let g_theirs = candle_nn::loss::cross_entropy(&theirs, &y)
            .unwrap()
            .backward()
            .unwrap();
        let vars = crate::layers::named_vars(&varmap);
        assert_eq!(vars.len(), 6);
        for (name, var) in vars {
            let a = g_ours
                .get(var.as_tensor())
                .expect("a gradient through the units");
            let b = g_theirs
                .get(var.as_tensor())
                .expect("a gradient through the plain model");
            assert_eq!(bits(a), bits(b), "stage {stage} {mode}: gradient of {name}");
        }
    }

    /// Stages 0 to 2 in one process, where candle's own backward pass reaches the parameters.
    /// At stage 3 the gradients reach only this rank's pieces, through `backward`: its training
    /// is compared with stage 0's in `tests/integration/fsdp_memory.rs`.
    #[test]
    fn the_units_path_computes_what_the_plain_model_does() {
        use accelerate_core::MixedPrecision;
        for stage in 0..=2 {
            units_path_is_the_plain_model(stage, MixedPrecision::No);
        }
        units_path_is_the_plain_model(0, MixedPrecision::Bf16);
    }

    #[test]
    fn every_parameter_is_in_one_unit_named_by_its_layer() {
        let (varmap, _) = build(8, 1, &Device::Cpu).unwrap();
        let specs = units();
        for (name, _) in crate::layers::named_vars(&varmap) {
            let holders: Vec<&str> = specs
                .iter()
                .filter(|u| u.holds(&name))
                .map(|u| u.name())
                .collect();
            assert_eq!(holders.len(), 1, "{name}: {holders:?}");
            assert!(name.starts_with(&format!("{}.", holders[0])), "{name}");
        }
    }

    #[test]
    fn a_bf16_model_holds_the_f32_initial_weights_rounded_and_returns_f32_logits() {
        let (f, model32) = build(16, 7, &Device::Cpu).unwrap();
        let (h, model16) = build_in(16, 7, &Device::Cpu, DType::BF16).unwrap();
        let w32 = f.data().lock().unwrap()["l1.weight"].as_tensor().clone();
        let w16 = h.data().lock().unwrap()["l1.weight"].as_tensor().clone();
        assert_eq!(w16.dtype(), DType::BF16);
        let rounded = w32
            .to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let back = w16.to_dtype(DType::F32).unwrap();
        assert_eq!(
            back.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            rounded.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        let (x, _) = synthetic_data(8, 1).unwrap();
        let l16 = model16.forward(&x).unwrap();
        let l32 = model32.forward(&x).unwrap();
        assert_eq!(l16.dtype(), DType::F32);
        // bf16 keeps 8 significant bits: the logits agree to about 1%, not exactly.
        let diff = (l16 - &l32).unwrap().abs().unwrap().max_all().unwrap();
        let diff = diff.to_scalar::<f32>().unwrap();
        let scale = l32
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff > 0.0 && diff < 0.05 * scale, "{diff} vs {scale}");
    }
}
