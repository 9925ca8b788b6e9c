//! The files of a checkpoint other than the manifest: names, JSON layouts, and safetensors to and
//! from bytes.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::exact::ExactF64;
use crate::error::{Error, Result};

/// The names of one prepared model's files. The first model's keep the names of a checkpoint of
/// one model (`model.safetensors`, `optimizer_<i>.json`, ...); model `m` of several has
/// `model_<m>.safetensors` and `model_<m>.`-prefixed names for the rest.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ModelFiles(pub usize);

impl ModelFiles {
    fn prefixed(self, name: String) -> String {
        match self.0 {
            0 => name,
            m => format!("model_{m}.{name}"),
        }
    }

    /// The parameters.
    pub fn parameters(self) -> String {
        match self.0 {
            0 => "model.safetensors".into(),
            m => format!("model_{m}.safetensors"),
        }
    }
    /// Rank `rank`'s pieces of the parameters, under ZeRO stage 3 with sharded parameters
    /// (`model.rank_<r>.safetensors`; `model_<m>.rank_<r>.safetensors` for model `m`).
    pub fn parameter_shard(self, rank: usize) -> String {
        match self.0 {
            0 => format!("model.rank_{rank}.safetensors"),
            m => format!("model_{m}.rank_{rank}.safetensors"),
        }
    }
    /// The accumulation counters.
    pub fn accumulation(self) -> String {
        self.prefixed("accumulation.json".into())
    }
    /// The fp16 loss scaler's state (only under fp16).
    pub fn loss_scaler(self) -> String {
        self.prefixed("loss_scaler.json".into())
    }
    /// Optimizer `i`'s tensors.
    pub fn optimizer_tensors(self, i: usize) -> String {
        self.prefixed(format!("optimizer_{i}.safetensors"))
    }
    /// Rank `rank`'s pieces of optimizer `i`'s tensors, under ZeRO.
    pub fn optimizer_shard(self, i: usize, rank: usize) -> String {
        self.prefixed(format!("optimizer_{i}.rank_{rank}.safetensors"))
    }
    /// Optimizer `i`'s kind and scalars.
    pub fn optimizer_json(self, i: usize) -> String {
        self.prefixed(format!("optimizer_{i}.json"))
    }
    /// Scheduler `i`.
    pub fn scheduler(self, i: usize) -> String {
        self.prefixed(format!("scheduler_{i}.json"))
    }
    /// Rank `rank`'s partial window gradients.
    pub fn rank_gradients(self, rank: usize) -> String {
        self.prefixed(format!("rank_{rank}_gradients.safetensors"))
    }
}

pub(crate) fn rank_file(rank: usize) -> String {
    format!("rank_{rank}.json")
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

pub(crate) use crate::data::LoaderPosition;

/// `rank_<r>.json`: this rank's own part.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RankFile {
    pub rank: usize,
    /// Loader positions, in preparation order.
    pub loaders: Vec<LoaderPosition>,
    /// Whether `rank_<r>_gradients.safetensors` holds a partial window's gradient sums.
    pub has_gradients: bool,
    /// The same for each further prepared model (`model_<m>.rank_<r>_gradients.safetensors`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub further_models_have_gradients: Vec<bool>,
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
