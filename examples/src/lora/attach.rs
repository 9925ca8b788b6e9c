//! Turning a Llama model into its LoRA fine-tune: the base detached (frozen, plain tensors) and an
//! adapter per layer and target projection, whose parameters join the model's `VarMap` under
//! PEFT's module paths.

use candle_core::{Result, Tensor, Var};
use candle_nn::VarMap;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::adapter::{kaiming_uniform, LoraAdapter};
use super::config::LoraConfig;
use super::target::LoraTarget;
use crate::llama::Llama;

/// The name of adapter `matrix` (`"lora_A"` or `"lora_B"`) of projection `target` in decoder
/// layer `layer`: `model.layers.{layer}.self_attn.q_proj.lora_A.weight`, PEFT's name without its
/// `base_model.model.` prefix.
pub fn adapter_parameter_name(layer: usize, target: LoraTarget, matrix: &str) -> String {
    format!(
        "model.layers.{layer}.{}.{}.{matrix}.weight",
        target.block(),
        target.name()
    )
}

/// Whether parameter `name` is an adapter's (trained) rather than the base model's (frozen).
pub fn is_adapter_parameter(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// `base` with an adapter on every projection of `lora.targets` in every layer, over a detached
/// copy of the base (see [`Llama::detached`]): only the adapters are differentiated. The adapters'
/// parameters are created in `base`'s `varmap`, in `dtype`, `lora_A` seeded with `seed` (layer by
/// layer, targets in layer order) and `lora_B` zero, so the result computes what `base` does until
/// they are trained.
pub fn with_adapters(base: &Llama, lora: &LoraConfig, varmap: &VarMap, seed: u64) -> Result<Llama> {
    let mut model = base.detached();
    let (device, dtype) = {
        let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
        let any = data
            .values()
            .next()
            .ok_or_else(|| candle_core::Error::Msg("the base model has no parameters".into()))?;
        (any.device().clone(), any.dtype())
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x10_4A);
    for layer in 0..base.config().num_hidden_layers {
        for &target in &lora.targets {
            let (out, inp) = base.projection_shape(target);
            let a = Tensor::from_vec(
                kaiming_uniform(lora.r, inp, &mut rng),
                (lora.r, inp),
                &device,
            )?
            .to_dtype(dtype)?;
            let a = Var::from_tensor(&a)?;
            let b = Var::zeros((out, lora.r), dtype, &device)?;
            let adapter =
                LoraAdapter::new(a.as_tensor().clone(), b.as_tensor().clone(), lora.alpha)?;
            model.attach_adapter(layer, target, adapter)?;
            let mut data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
            data.insert(adapter_parameter_name(layer, target, "lora_A"), a);
            data.insert(adapter_parameter_name(layer, target, "lora_B"), b);
        }
    }
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llama::{build_in, causal_lm_loss_sum, LlamaConfig};
    use candle_core::{DType, Device};

    fn lora() -> LoraConfig {
        LoraConfig {
            r: 4,
            alpha: 8.0,
            targets: vec![LoraTarget::QProj, LoraTarget::VProj, LoraTarget::DownProj],
            ..LoraConfig::default()
        }
    }

    fn base() -> (VarMap, Llama) {
        let config = LlamaConfig::from_flags(11, 2, 16, 4, 2, 24, 8).unwrap();
        build_in(config, 1, &Device::Cpu, DType::F32).unwrap()
    }

    fn tokens() -> Tensor {
        Tensor::new(&[[1u32, 5, 2, 9, 3, 3], [0, 10, 4, 4, 7, 1]], &Device::Cpu).unwrap()
    }

    #[test]
    fn fresh_adapters_leave_the_base_models_logits_bitwise_unchanged() {
        let (varmap, base) = base();
        let before = base.forward(&tokens()).unwrap();
        let model = with_adapters(&base, &lora(), &varmap, 7).unwrap();
        let after = model.forward(&tokens()).unwrap();
        let (a, b) = (
            before.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            after.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }

    #[test]
    fn adapters_have_peft_shapes_and_only_they_get_gradients() {
        let (varmap, base) = base();
        let model = with_adapters(&base, &lora(), &varmap, 7).unwrap();
        let data = varmap.data().lock().unwrap().clone();
        // 21 base parameters, 2 layers x 3 targets x (A, B).
        assert_eq!(data.len(), 21 + 12);
        let shape = |n: &str| data[n].dims().to_vec();
        // q_proj 16 -> 16, v_proj 16 -> 8 (2 key/value heads of 4), down_proj 24 -> 16.
        assert_eq!(
            shape("model.layers.0.self_attn.q_proj.lora_A.weight"),
            [4, 16]
        );
        assert_eq!(
            shape("model.layers.0.self_attn.q_proj.lora_B.weight"),
            [16, 4]
        );
        assert_eq!(
            shape("model.layers.1.self_attn.v_proj.lora_B.weight"),
            [8, 4]
        );
        assert_eq!(shape("model.layers.1.mlp.down_proj.lora_A.weight"), [4, 24]);
        let b = data["model.layers.1.mlp.down_proj.lora_B.weight"].as_tensor();
        assert_eq!(
            b.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );

        let t = tokens();
        let loss = causal_lm_loss_sum(&model.forward(&t).unwrap(), &t).unwrap();
        let grads = loss.backward().unwrap();
        for (name, var) in &data {
            let g = grads.get(var.as_tensor());
            assert_eq!(g.is_some(), is_adapter_parameter(name), "{name}");
        }
        // B is zero, so A's gradient is too; B's is not.
        let gb = grads
            .get(data["model.layers.0.self_attn.q_proj.lora_B.weight"].as_tensor())
            .unwrap();
        assert!(
            gb.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0
        );
    }
}
