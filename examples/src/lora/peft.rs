//! Adapters in Hugging Face PEFT's files: `adapter_model.safetensors` (the `lora_A` `[r, in]` and
//! `lora_B` `[out, r]` of every adapted projection, named
//! `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, no adapter name) and
//! `adapter_config.json` beside it, so that `PeftModel.from_pretrained(base, dir)` loads them.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{Tensor, Var};

use super::config::LoraConfig;

/// The weights file of an adapter directory.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The settings file of an adapter directory.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// What PEFT's saved names put before the base model's module path.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// Writes the adapter `params` (named as [`super::adapter_parameter_name`]) and `lora`'s settings
/// into `dir` (created if missing), each file atomically.
///
/// The pair is kept consistent by order: an earlier config is deleted first, then the weights are
/// written, then the config. A crash in between leaves weights without a config, which PEFT and
/// `--load-adapter` refuse, never new weights beside an old config (another r or alpha, read
/// silently). Simpler than replacing the whole directory, which would lose other files in it
/// (PEFT's README.md), and keeps `adapter_config.json` free of keys PEFT does not know.
pub fn save_adapter(
    dir: &Path,
    lora: &LoraConfig,
    base_model: Option<&str>,
    params: &[(String, Var)],
) -> accelerate_core::Result<()> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| accelerate_core::Error::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let config = dir.join(ADAPTER_CONFIG);
    match std::fs::remove_file(&config) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&config)(e)),
        _ => {}
    }
    // The deletion reaches the disk before the new weights do.
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))?;
    let tensors: Vec<(String, Tensor)> = params
        .iter()
        .map(|(n, v)| (format!("{PEFT_PREFIX}{n}"), v.as_tensor().clone()))
        .collect();
    accelerate_core::save_safetensors(dir.join(ADAPTER_WEIGHTS), &tensors)?;
    let json =
        serde_json::to_vec_pretty(&lora.to_peft_json(base_model)).expect("a JSON value serializes");
    accelerate_core::write_atomic(config, &json)
}

/// Creates `dir` for a later [`save_adapter`] and checks that a file can be written in it, so
/// that an unwritable --save-adapter fails before training rather than after.
pub fn prepare_adapter_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let probe = tempfile_in(dir)?;
    std::fs::remove_file(&probe).with_context(|| format!("removing {}", probe.display()))
}

/// An empty file created in `dir` (a write test), its path.
fn tempfile_in(dir: &Path) -> Result<PathBuf> {
    let path = dir.join(format!(".write-test-{}", std::process::id()));
    std::fs::write(&path, b"").with_context(|| format!("writing in {}", dir.display()))?;
    Ok(path)
}

/// `base_model_name_or_path` for a saved adapter: `explicit` if given, else the base's `model`
/// directory (`--model`), else the directory of its `init_weights` file, else of its `config`
/// file, as an absolute path (a relative one would later be read against another working
/// directory), else none.
pub fn base_model_name_or_path(
    explicit: Option<&str>,
    model: Option<&Path>,
    init_weights: Option<&Path>,
    config: Option<&Path>,
) -> Option<String> {
    if let Some(name) = explicit {
        return Some(name.to_string());
    }
    let absolute = |p: &Path| {
        std::fs::canonicalize(p)
            .or_else(|_| std::path::absolute(p))
            .ok()
    };
    if let Some(dir) = model {
        return Some(absolute(dir)?.display().to_string());
    }
    let file = absolute(init_weights.or(config)?)?;
    Some(file.parent()?.display().to_string())
}

/// The settings of the adapter in `dir` (its `adapter_config.json`).
pub fn read_adapter_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join(ADAPTER_CONFIG);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    LoraConfig::from_peft_json(&value).with_context(|| path.display().to_string())
}

/// Sets the adapter `params` to the weights in `dir`'s `adapter_model.safetensors`; a missing,
/// unexpected or wrongly shaped tensor is an error listing each.
pub fn load_adapter(dir: &Path, params: &[(String, Var)]) -> Result<()> {
    if !dir.join(ADAPTER_WEIGHTS).exists() && dir.join("adapter_model.bin").exists() {
        anyhow::bail!(
            "{} holds adapter_model.bin (PyTorch's pickle format) but no {ADAPTER_WEIGHTS}: only \
             safetensors is read; save it again with PEFT's \
             save_pretrained(dir, safe_serialization=True)",
            dir.display()
        );
    }
    let peft_named: Vec<(String, Var)> = params
        .iter()
        .map(|(n, v)| (format!("{PEFT_PREFIX}{n}"), v.clone()))
        .collect();
    accelerate_core::load_into_vars(dir.join(ADAPTER_WEIGHTS), &peft_named)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn params(value: f32) -> Vec<(String, Var)> {
        let v = Var::new(&[[value]], &Device::Cpu).unwrap();
        vec![(
            super::super::adapter_parameter_name(0, super::super::LoraTarget::QProj, "lora_A"),
            v,
        )]
    }

    #[test]
    fn a_failed_save_never_leaves_new_weights_beside_an_old_config() {
        let dir = tempfile::tempdir().unwrap();
        let lora = LoraConfig::default();
        save_adapter(dir.path(), &lora, None, &params(1.0)).unwrap();
        let weights = std::fs::read(dir.path().join(ADAPTER_WEIGHTS)).unwrap();
        // The config cannot be replaced (a directory holding a file stands in its place): the
        // save fails, and the weights are still those the directory had.
        let config = dir.path().join(ADAPTER_CONFIG);
        std::fs::remove_file(&config).unwrap();
        std::fs::create_dir(&config).unwrap();
        std::fs::write(config.join("x"), b"").unwrap();
        assert!(save_adapter(dir.path(), &lora, None, &params(2.0)).is_err());
        assert_eq!(
            std::fs::read(dir.path().join(ADAPTER_WEIGHTS)).unwrap(),
            weights
        );
    }

    #[test]
    fn a_pickled_adapter_is_refused_saying_only_safetensors_is_read() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("adapter_model.bin"), b"pickle").unwrap();
        let e = format!("{:#}", load_adapter(dir.path(), &params(1.0)).unwrap_err());
        assert!(
            e.contains("adapter_model.bin") && e.contains("only safetensors is read"),
            "{e}"
        );
    }

    #[test]
    fn the_base_model_path_is_absolute_and_falls_back_to_the_config() {
        let cwd = std::env::current_dir().unwrap();
        let name = base_model_name_or_path(None, None, Some(Path::new("model.safetensors")), None);
        assert_eq!(name, Some(cwd.display().to_string()));
        let name = base_model_name_or_path(None, None, None, Some(Path::new("sub/config.json")));
        assert_eq!(name, Some(cwd.join("sub").display().to_string()));
        let name = base_model_name_or_path(Some("org/m"), None, Some(Path::new("x")), None);
        assert_eq!(name.as_deref(), Some("org/m"));
        // --model names the directory itself.
        let name = base_model_name_or_path(None, Some(Path::new("tiny")), None, None);
        assert_eq!(name, Some(cwd.join("tiny").display().to_string()));
        assert_eq!(base_model_name_or_path(None, None, None, None), None);
    }
}
