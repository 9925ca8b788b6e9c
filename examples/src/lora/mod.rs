//! LoRA fine-tuning of the `llama` workload, as Hugging Face PEFT does it: the base model frozen,
//! a trained low-rank update `(alpha / r) · B (A x)` beside chosen projections, and the adapters
//! saved and loaded in PEFT's files.
//!
//! - [`target`]: which projections get adapters (`q_proj`, ..., `down_proj`).
//! - [`adapter`]: one adapter's update and its initialization.
//! - [`config`]: rank, alpha and targets, and their `adapter_config.json`.
//! - [`attach`]: a Llama model with its base detached and adapters attached.
//! - [`peft`]: `adapter_model.safetensors` and `adapter_config.json`, written and read.
//! - [`resume`]: what a checkpoint must agree with to be resumed (settings, base fingerprint).

pub mod adapter;
pub mod attach;
pub mod config;
pub mod peft;
pub mod resume;
pub mod target;

pub use adapter::LoraAdapter;
pub use attach::{adapter_parameter_name, is_adapter_parameter, with_adapters};
pub use config::LoraConfig;
pub use peft::{
    base_model_name_or_path, load_adapter, prepare_adapter_dir, read_adapter_config, save_adapter,
    ADAPTER_CONFIG, ADAPTER_WEIGHTS,
};
pub use resume::LoraRunIdentity;
pub use target::LoraTarget;
