//! One LoRA adapter (Hu et al. 2021, as Hugging Face PEFT computes it): beside a frozen
//! projection `W x`, the trained low-rank update `(alpha / r) · B (A x)`, with `A` `[r, in]`
//! drawn Kaiming-uniform and `B` `[out, r]` zero, so that a fresh adapter changes nothing.

use candle_core::{Module, Result, Tensor};
use candle_nn::Linear;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// The low-rank update of one projection (see the module docs).
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    a: Linear,
    b: Linear,
    scale: f64,
}

impl LoraAdapter {
    /// An adapter of `a` `[r, in]` and `b` `[out, r]` (parameters, or any tensors) scaled by
    /// `alpha / r`.
    pub fn new(a: Tensor, b: Tensor, alpha: f64) -> Result<Self> {
        let (r, _) = a.dims2()?;
        let (_, r_b) = b.dims2()?;
        if r != r_b || r == 0 {
            candle_core::bail!(
                "lora_A {:?} and lora_B {:?} do not share a rank r >= 1",
                a.dims(),
                b.dims()
            );
        }
        Ok(Self {
            a: Linear::new(a, None),
            b: Linear::new(b, None),
            scale: alpha / r as f64,
        })
    }

    /// `lora_A` `[r, in]`.
    pub fn a(&self) -> &Tensor {
        self.a.weight()
    }

    /// `lora_B` `[out, r]`.
    pub fn b(&self) -> &Tensor {
        self.b.weight()
    }

    /// `alpha / r`.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// `(alpha / r) · B (A x)` for `x` `[..., in]`: what the adapter adds to the projection.
    pub fn update(&self, x: &Tensor) -> Result<Tensor> {
        self.b.forward(&self.a.forward(x)?)? * self.scale
    }
}

/// `r · fan_in` values of `lora_A` `[r, fan_in]`: PyTorch's `kaiming_uniform_(a = sqrt(5))`, as
/// PEFT initializes it, uniform in `±gain · sqrt(3 / fan_in)` with `gain = sqrt(2 / (1 + 5))`,
/// that is `±1 / sqrt(fan_in)`.
pub fn kaiming_uniform(r: usize, fan_in: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    (0..r * fan_in)
        .map(|_| rng.random_range(-bound..bound) as f32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use rand::SeedableRng;

    #[test]
    fn update_is_scaled_b_times_a_times_x() {
        let d = &Device::Cpu;
        // r = 2, in = 3, out = 2; alpha 4 -> scale 2.
        let a = Tensor::new(&[[1f32, 0., 2.], [0., 1., -1.]], d).unwrap();
        let b = Tensor::new(&[[1f32, 1.], [0., 3.]], d).unwrap();
        let x = Tensor::new(&[[[1f32, 2., 3.]]], d).unwrap();
        let y = LoraAdapter::new(a, b, 4.0).unwrap().update(&x).unwrap();
        // A x = [7, -1]; B (A x) = [6, -3]; times 2.
        assert_eq!(
            y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [12., -6.]
        );
    }

    #[test]
    fn kaiming_uniform_fills_plus_minus_one_over_root_fan_in() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let v = kaiming_uniform(8, 64, &mut rng);
        assert_eq!(v.len(), 512);
        let bound = 1.0f64 / 8.0;
        assert!(v.iter().all(|x| (x.abs() as f64) < bound));
        // Uniform on ±b has variance b²/3.
        let var = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(
            (var - bound * bound / 3.0).abs() < 0.15 * bound * bound / 3.0,
            "{var}"
        );
    }
}
