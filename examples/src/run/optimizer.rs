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

/// `--lr`, `--optimizer`, `--momentum` and `--weight-decay`: how a run's optimizer is picked and
/// set (`#[command(flatten)]` into an example's flags).
#[derive(Debug, Clone, clap::Args)]
pub struct OptimizerArgs {
    /// Peak learning rate (default: the example's for the optimizer: mlp 1e-3 for AdamW and 0.05
    /// for SGD, gpt and llama 3e-3 and 0.1).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw)]
    pub optimizer: OptimizerKind,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Weight decay (decoupled for AdamW).
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
}

impl OptimizerArgs {
    /// The run's peak learning rate: `--lr` when given, else the example's default for the
    /// optimizer, `(adamw, sgd)`; a rate that is not a positive number is refused.
    pub fn lr(&self, (adamw, sgd): (f64, f64)) -> Result<f64> {
        let lr = self.optimizer.lr_or(self.lr, adamw, sgd);
        if !(lr.is_finite() && lr > 0.0) {
            anyhow::bail!("--lr must be a positive number, got {lr}");
        }
        Ok(lr)
    }

    /// The optimizer over `params`, at [`lr`](Self::lr) with the example's `defaults`.
    pub fn build(
        &self,
        params: Vec<(String, Var)>,
        defaults: (f64, f64),
    ) -> Result<Box<dyn Optimizer + Send>> {
        let lr = self.lr(defaults)?;
        self.optimizer
            .build(params, lr, self.momentum, self.weight_decay)
    }
}

impl OptimizerKind {
    /// The learning rate of the run: `lr` (--lr) when given, else this optimizer's default for
    /// the workload, `adamw` or `sgd`.
    pub fn lr_or(self, lr: Option<f64>, adamw: f64, sgd: f64) -> f64 {
        lr.unwrap_or(match self {
            Self::Adamw => adamw,
            Self::Sgd => sgd,
        })
    }

    /// This optimizer over `params` with peak learning rate `lr`, SGD's `momentum` (AdamW
    /// ignores it) and `weight_decay` (decoupled for AdamW), boxed so that the run's loop is the
    /// same whichever the flag picked.
    pub fn build(
        self,
        params: Vec<(String, Var)>,
        lr: f64,
        momentum: f64,
        weight_decay: f64,
    ) -> Result<Box<dyn Optimizer + Send>> {
        Ok(match self {
            Self::Adamw => Box::new(AdamW::new(
                params,
                AdamWConfig {
                    lr,
                    weight_decay,
                    ..AdamWConfig::default()
                },
            )?),
            Self::Sgd => Box::new(Sgd::new(
                params,
                SgdConfig {
                    lr,
                    momentum,
                    weight_decay,
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
        for (kind, name) in [(OptimizerKind::Adamw, "adamw"), (OptimizerKind::Sgd, "sgd")] {
            let mut boxed = kind.build(params(), 0.25, 0.5, 0.0).unwrap();
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

    #[test]
    fn the_lr_flag_wins_over_the_optimizers_default() {
        assert_eq!(OptimizerKind::Adamw.lr_or(None, 1e-3, 0.05), 1e-3);
        assert_eq!(OptimizerKind::Sgd.lr_or(None, 1e-3, 0.05), 0.05);
        assert_eq!(OptimizerKind::Sgd.lr_or(Some(0.5), 1e-3, 0.05), 0.5);
    }
}
