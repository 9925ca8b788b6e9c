//! Layer helpers shared by the workloads.

use std::any::Any;

use accelerate_core::RankRng;
use candle_core::{Result, Tensor, Var};
use candle_nn::{Linear, VarMap};
use fused_kernels::checkpoint::RandomState;
use rand_chacha::ChaCha8Rng;

/// The variables of `varmap` sorted by name: the order `Accelerator::prepare` gives them, and the
/// one weights are loaded and compared in.
pub fn named_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = varmap
        .data()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut vars: Vec<(String, Var)> = data.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// A [`RankRng`] as the random state of a checkpointed block ([`fused_kernels::checkpoint`]): the
/// block's recomputation in the backward pass rewinds the generator to where its forward pass
/// started, so dropout draws the same masks, and moves it back afterwards.
#[derive(Debug, Clone)]
pub struct RankRngState(pub RankRng);

impl RandomState for RankRngState {
    fn snapshot(&self) -> Box<dyn Any + Send + Sync> {
        Box::new(self.0.snapshot())
    }

    fn restore(&self, state: &(dyn Any + Send + Sync)) -> Result<()> {
        match state.downcast_ref::<ChaCha8Rng>() {
            Some(rng) => {
                self.0.restore(rng.clone());
                Ok(())
            }
            None => candle_core::bail!(
                "RankRngState::restore was given a state that RankRngState::snapshot did not make"
            ),
        }
    }
}

/// `x · Wᵀ + b` for `x` of shape `[..., in]`, computed as `(W · xᵀ)ᵀ + b` over the rows of `x`.
///
/// The same products as candle-nn's `Linear::forward`, arranged so that candle's backward pass
/// produces the weight's gradient in the weight's own layout. With `x.matmul(&w.t())` a transpose
/// sits between the weight and the product, and candle adds the transposed gradient into a zero
/// tensor element by element with strided reads, a large share of a small model's step.
///
/// The `gpt` workload keeps candle-nn's `Linear`: there the output of `(W · xᵀ)ᵀ` has to be copied
/// back into `[batch, tokens, out]` for attention, and that copy costs more than the add it saves.
/// BENCHMARKS.md has the figures for both.
pub fn linear(layer: &Linear, x: &Tensor) -> Result<Tensor> {
    let w = layer.weight();
    let (out, inp) = w.dims2()?;
    let mut dims = x.dims().to_vec();
    let rows = x.elem_count() / inp.max(1);
    let y = w.matmul(&x.reshape((rows, inp))?.t()?)?.t()?;
    let y = match layer.bias() {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    if dims.len() == 2 {
        return Ok(y);
    }
    *dims.last_mut().expect("x has a last dimension") = out;
    y.reshape(dims)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Module, Var};

    #[test]
    fn matches_candle_nns_linear_values_and_gradients() {
        let dev = Device::Cpu;
        let w = Var::from_tensor(
            &Tensor::arange(0f32, 12., &dev)
                .unwrap()
                .reshape((3, 4))
                .unwrap(),
        )
        .unwrap();
        let b = Var::from_tensor(&Tensor::new(&[0.5f32, -1.0, 2.0], &dev).unwrap()).unwrap();
        let layer = Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
        let x = Tensor::arange(0f32, 24., &dev)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        let x = (x * 0.25).unwrap();
        let ours = linear(&layer, &x).unwrap();
        let theirs = layer.forward(&x).unwrap();
        assert_eq!(ours.dims(), &[2, 3, 3]);
        assert_eq!(
            ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        let g_ours = ours.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let g_theirs = theirs.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&w, &b] {
            let a = g_ours.get(v.as_tensor()).unwrap().flatten_all().unwrap();
            let c = g_theirs.get(v.as_tensor()).unwrap().flatten_all().unwrap();
            assert_eq!(a.to_vec1::<f32>().unwrap(), c.to_vec1::<f32>().unwrap());
            assert!(g_ours.get(v.as_tensor()).unwrap().is_contiguous());
        }
    }
}
