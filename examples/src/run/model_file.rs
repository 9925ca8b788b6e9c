//! `--save-model`: writing the trained weights.

use std::path::Path;

use accelerate_core::Accelerator;
use anyhow::{Context, Result};
use candle_core::Tensor;

/// Writes the prepared parameters to `path` as safetensors (main process); every rank then agrees
/// on the outcome, so none exits before the file is complete, and if writing failed every rank ends
/// with an error naming rank 0's cause. Does nothing without a path.
pub fn save_model(acc: &Accelerator, path: Option<&Path>) -> Result<()> {
    let Some(path) = path else {
        return Ok(());
    };
    let written = if acc.is_main_process() {
        accelerate_core::save_safetensors(path, &parameter_tensors(acc))
    } else {
        Ok(())
    };
    acc.agree_across_ranks(path, "writing the model", written)
        .with_context(|| format!("--save-model {}", path.display()))
}

/// The prepared parameters as tensors: sorted by name, and the f32 masters under mixed precision
/// (what a saved model holds).
pub fn parameter_tensors(acc: &Accelerator) -> Vec<(String, Tensor)> {
    acc.model()
        .parameters()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect()
}
