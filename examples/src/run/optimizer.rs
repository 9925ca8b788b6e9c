//! `--optimizer`: which optimizer a run trains with.

use accelerate_core::optim::{AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use anyhow::Result;
use candle_core::Var;
use clap::ValueEnum;

/// The optimizer a run picks with `--optimizer`: `sgd` (PyTorch's SGD, with `--momentum`) or
/// `adamw` (PyTorch's AdamW).
// The variants carry no doc comments on purpose: clap would print them, changing `--help`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerKind {
    Sgd,
    Adamw,
}

/// The hyper-parameters of the flags, for whichever optimizer `--optimizer` picks.
#[derive(Debug, Clone, Copy)]
pub struct OptimizerFlags {
    /// The peak learning rate.
    pub lr: f64,
    /// SGD's momentum (AdamW ignores it).
    pub momentum: f64,
    /// Weight decay (decoupled for AdamW).
    pub weight_decay: f64,
}

impl OptimizerKind {
    /// This optimizer over `params`, boxed so that the run's loop is the same whichever the
    /// flag picked.
    pub fn build(
        self,
        params: Vec<(String, Var)>,
        flags: OptimizerFlags,
    ) -> Result<Box<dyn Optimizer + Send>> {
        Ok(match self {
            Self::Adamw => Box::new(AdamW::new(
                params,
                AdamWConfig {
                    lr: flags.lr,
                    weight_decay: flags.weight_decay,
                    ..AdamWConfig::default()
                },
            )?),
            Self::Sgd => Box::new(Sgd::new(
                params,
                SgdConfig {
                    lr: flags.lr,
                    momentum: flags.momentum,
                    weight_decay: flags.weight_decay,
                    ..SgdConfig::default()
                },
            )?),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use candle_core::{DType, Device};

    use super::*;

    fn params() -> Vec<(String, Var)> {
        ["a", "b"]
            .iter()
            .map(|n| {
                let v = Var::zeros(6, DType::F32, &Device::Cpu).unwrap();
                (n.to_string(), v)
            })
            .collect()
    }

    /// The boxed optimizer answers as the one inside it, the trait's overridable methods
    /// included: a method the box did not forward would fall back to the trait's default, which
    /// refuses to shard.
    #[test]
    fn a_boxed_optimizer_forwards_to_the_one_it_holds() {
        let flags = OptimizerFlags {
            lr: 0.25,
            momentum: 0.5,
            weight_decay: 0.0,
        };
        for (kind, name) in [(OptimizerKind::Adamw, "adamw"), (OptimizerKind::Sgd, "sgd")] {
            let mut boxed = kind.build(params(), flags).unwrap();
            assert_eq!(boxed.learning_rate().get(), 0.25);
            let names: Vec<&str> = boxed.params().iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["a", "b"]);
            let state = boxed.state().unwrap();
            assert_eq!(state.kind, name);
            boxed.load_state(&state).unwrap();
            let pieces = BTreeMap::from([("a".to_string(), 0..3)]);
            boxed.shard(&pieces).unwrap();
            assert!(!boxed.wrote_compute_copy("a"));
        }
    }
}
