//! The files of a checkpoint other than the manifest: names, JSON layouts, and safetensors to and
//! from bytes.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::exact::ExactF64;
use crate::error::{Error, Result};

/// The parameters.
pub(crate) const PARAMETERS_FILE: &str = "model.safetensors";
/// The accumulation counters.
pub(crate) const ACCUMULATION_FILE: &str = "accumulation.json";
/// The fp16 loss scaler's state (only under fp16).
pub(crate) const LOSS_SCALER_FILE: &str = "loss_scaler.json";

pub(crate) fn optimizer_tensors_file(i: usize) -> String {
    format!("optimizer_{i}.safetensors")
}
pub(crate) fn optimizer_json_file(i: usize) -> String {
    format!("optimizer_{i}.json")
}
pub(crate) fn scheduler_file(i: usize) -> String {
    format!("scheduler_{i}.json")
}
pub(crate) fn rank_file(rank: usize) -> String {
    format!("rank_{rank}.json")
}
pub(crate) fn rank_gradients_file(rank: usize) -> String {
    format!("rank_{rank}_gradients.safetensors")
}
pub(crate) fn rng_file(rank: usize) -> String {
    format!("rng_{rank}.json")
}

/// `optimizer_<i>.json`: what is not a tensor of an `OptimizerState`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct OptimizerScalars {
    pub kind: String,
    pub scalars: BTreeMap<String, ExactF64>,
}

/// `scheduler_<i>.json`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct SchedulerFile {
    pub steps: usize,
    pub base_lr: ExactF64,
    /// The base rates of parameter groups after the first; absent with one group.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub group_base_lrs: Vec<ExactF64>,
}

/// `accumulation.json`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct AccumulationFile {
    pub gradient_accumulation_steps: usize,
    pub micro_steps_taken_in_window: usize,
    pub window_len: usize,
    pub item_scale: Option<ExactF64>,
    pub optimizer_steps: u64,
}

/// `loss_scaler.json`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct LossScalerFile {
    pub scale: ExactF64,
    pub growth_tracker: u64,
}

pub(crate) use crate::training::LoaderPosition;

/// `rank_<r>.json`: this rank's own part.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RankFile {
    pub rank: usize,
    /// Loader positions, in preparation order.
    pub loaders: Vec<LoaderPosition>,
    /// Whether `rank_<r>_gradients.safetensors` holds a partial window's gradient sums.
    pub has_gradients: bool,
}

/// Named tensors as safetensors bytes (copied to the CPU, contiguous).
pub(crate) fn safetensors_bytes(path: &Path, tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let cpu: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.to_device(&Device::Cpu)?.contiguous()?)))
        .collect::<Result<_>>()?;
    safetensors::tensor::serialize(cpu.iter().map(|(n, t)| (n.as_str(), t)), None).map_err(|e| {
        Error::Checkpoint {
            path: path.to_path_buf(),
            problem: format!("cannot serialize tensors: {e}"),
        }
    })
}

/// Parses safetensors bytes read from `path` into CPU tensors.
pub(crate) fn parse_safetensors(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, Tensor>> {
    let map = candle_core::safetensors::load_buffer(bytes, &Device::Cpu).map_err(|e| {
        Error::Checkpoint {
            path: path.to_path_buf(),
            problem: format!("not a readable safetensors file ({e}); the checkpoint is corrupt"),
        }
    })?;
    Ok(map.into_iter().collect())
}

/// Parses JSON read from `path`.
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(path: &Path, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| Error::Checkpoint {
        path: path.to_path_buf(),
        problem: format!("not valid for this file ({e}); the checkpoint is corrupt"),
    })
}

/// Pretty JSON bytes.
pub(crate) fn json_bytes<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec_pretty(value).map_err(|e| Error::Config(format!("cannot encode JSON: {e}")))
}
