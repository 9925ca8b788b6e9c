//! `--optimizer`: which optimizer a run trains with.

use clap::ValueEnum;

/// The optimizer a run picks with `--optimizer`: `sgd` (PyTorch's SGD, with `--momentum`) or
/// `adamw` (PyTorch's AdamW).
// The variants carry no doc comments on purpose: clap would print them, changing `--help`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerKind {
    Sgd,
    Adamw,
}
