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
    let tensors = parameter_tensors(acc);
    let written = match tensors {
        Ok(tensors) if acc.is_main_process() => accelerate_core::save_safetensors(path, &tensors),
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    };
    acc.agree_across_ranks(path, "writing the model", written)
        .with_context(|| format!("--save-model {}", path.display()))
}

/// The prepared parameters as tensors: sorted by name, and the f32 masters under mixed precision
/// (what a saved model holds), for the main process to write. Every rank calls it: under ZeRO
/// stage 3 it gathers the whole parameters, unit by unit, to the main process's host (a
/// collective; the other ranks get an empty list); otherwise it reads them.
pub fn parameter_tensors(acc: &Accelerator) -> accelerate_core::Result<Vec<(String, Tensor)>> {
    if acc.zero_stage() == 3 {
        return acc.model().whole_parameters_on_main();
    }
    Ok(acc
        .model()
        .parameters()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect())
}
