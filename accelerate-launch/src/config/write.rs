//! The config file `accelerate config` writes: the keys and value spellings of Accelerate's own
//! `ClusterConfig`, as JSON with sorted keys and two-space indent, exactly as Accelerate's
//! `accelerate config default` writes it (JSON is YAML too, so Accelerate's YAML reader and ours
//! read it; and JSON quotes `"NO"` and `"no"`, which PyYAML would read as `false` unquoted).
//! Only keys Accelerate's reader knows are written: it refuses a file with any other (so no
//! `max_restarts`: Accelerate's `ClusterConfig` has no such field, it is a `launch` flag only).
//!
//! A ZeRO stage is written as Accelerate's `accelerate config` writes a DeepSpeed answer:
//! `distributed_type: DEEPSPEED` and `deepspeed_config` with `zero_stage`,
//! `gradient_accumulation_steps` (Accelerate keeps it only there), `zero3_init_flag: false`,
//! `offload_optimizer_device`/`offload_param_device: none` from stage 2,
//! `zero3_save_16bit_model: false` at stage 3, and `deepspeed_multinode_launcher: standard` (a
//! launcher on each machine) on several machines.

use std::collections::BTreeMap;
use std::path::Path;

use accelerate_core::MixedPrecision;
use serde_json::{json, Value};

use crate::config::file::DistributedType;

/// The answers a config file records.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigAnswers {
    /// `distributed_type`.
    pub distributed_type: DistributedType,
    /// `num_processes` (total over the machines).
    pub num_processes: usize,
    /// `num_machines`.
    pub num_machines: usize,
    /// `machine_rank`.
    pub machine_rank: usize,
    /// `main_process_ip` (several machines).
    pub main_process_ip: Option<String>,
    /// `main_process_port` (several machines).
    pub main_process_port: Option<u16>,
    /// `mixed_precision`.
    pub mixed_precision: MixedPrecision,
    /// `gpu_ids` (`None` writes no key: every GPU).
    pub gpu_ids: Option<String>,
    /// `use_cpu`.
    pub use_cpu: bool,
    /// `rdzv_backend`: `static` or `c10d` (the same thing for us: the store on machine rank 0).
    pub rdzv_backend: String,
    /// `same_network`.
    pub same_network: bool,
    /// `deepspeed_config`, written with `distributed_type: DEEPSPEED`; `None` writes none.
    pub deepspeed: Option<DeepSpeedAnswers>,
}

/// The `deepspeed_config` answers our ZeRO runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeepSpeedAnswers {
    /// `zero_stage`: 0 to 3.
    pub zero_stage: u8,
    /// `gradient_accumulation_steps` (Accelerate's default 1).
    pub gradient_accumulation_steps: usize,
}

impl ConfigAnswers {
    /// What `accelerate config default` writes on a machine with `gpus` visible GPUs, as
    /// Accelerate's `write_basic_config` decides: several GPUs `MULTI_GPU` with one process each,
    /// one GPU `NO`, none `NO` with `use_cpu: true`.
    pub fn default_for(gpus: usize, mixed_precision: MixedPrecision) -> Self {
        Self {
            distributed_type: if gpus > 1 {
                DistributedType::MultiGpu
            } else {
                DistributedType::No
            },
            num_processes: gpus.max(1),
            num_machines: 1,
            machine_rank: 0,
            main_process_ip: None,
            main_process_port: None,
            mixed_precision,
            gpu_ids: None,
            use_cpu: gpus == 0,
            rdzv_backend: "static".into(),
            same_network: false,
            deepspeed: None,
        }
    }

    /// The file's text: JSON, keys sorted, two-space indent, a final newline.
    pub fn to_text(&self) -> String {
        let mut map: BTreeMap<&str, Value> = BTreeMap::new();
        map.insert("compute_environment", json!("LOCAL_MACHINE"));
        map.insert("debug", json!(false));
        map.insert("distributed_type", json!(self.distributed_type.as_str()));
        map.insert("downcast_bf16", json!(false));
        map.insert("enable_cpu_affinity", json!(false));
        map.insert("machine_rank", json!(self.machine_rank));
        map.insert("main_training_function", json!("main"));
        map.insert("mixed_precision", json!(self.mixed_precision.as_str()));
        map.insert("num_machines", json!(self.num_machines));
        map.insert("num_processes", json!(self.num_processes));
        map.insert("rdzv_backend", json!(self.rdzv_backend));
        map.insert("same_network", json!(self.same_network));
        map.insert("tpu_use_cluster", json!(false));
        map.insert("tpu_use_sudo", json!(false));
        map.insert("use_cpu", json!(self.use_cpu));
        if let Some(ds) = &self.deepspeed {
            let mut config: BTreeMap<&str, Value> = BTreeMap::new();
            config.insert("zero_stage", json!(ds.zero_stage));
            config.insert(
                "gradient_accumulation_steps",
                json!(ds.gradient_accumulation_steps),
            );
            config.insert("zero3_init_flag", json!(false));
            if ds.zero_stage >= 2 {
                config.insert("offload_optimizer_device", json!("none"));
                config.insert("offload_param_device", json!("none"));
            }
            if ds.zero_stage == 3 {
                // Accelerate asks it at stage 3 only (default no).
                config.insert("zero3_save_16bit_model", json!(false));
            }
            if self.num_machines > 1 {
                config.insert("deepspeed_multinode_launcher", json!("standard"));
            }
            map.insert("deepspeed_config", json!(config));
        }
        if let Some(ids) = &self.gpu_ids {
            map.insert("gpu_ids", json!(ids));
        }
        if let Some(ip) = &self.main_process_ip {
            map.insert("main_process_ip", json!(ip));
        }
        if let Some(port) = self.main_process_port {
            map.insert("main_process_port", json!(port));
        }
        let mut text = serde_json::to_string_pretty(&map).expect("a map of JSON values");
        text.push('\n');
        text
    }

    /// Writes the file at `path` atomically (temporary file, fsync, rename), creating its
    /// directory.
    pub fn write(&self, path: &Path) -> Result<(), String> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                format!(
                    "cannot create the directory {} for the config file ({e}); pick another \
                     path with --config-file",
                    dir.display()
                )
            })?;
        }
        accelerate_core::write_atomic(path, self.to_text().as_bytes())
            .map_err(|e| format!("cannot write the config file {}: {e}", path.display()))
    }
}
