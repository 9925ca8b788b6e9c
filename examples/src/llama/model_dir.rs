//! Hugging Face model directories, read (`--model DIR`) and written (`--output-dir DIR`), as
//! transformers' `save_pretrained` and `from_pretrained` lay them out:
//!
//! - `config.json`: the model's size ([`LlamaConfig`]) and the special token ids;
//! - the weights: `model.safetensors`, or shards `model-00001-of-0000N.safetensors` named by
//!   `model.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map": {tensor:
//!   file}}`) when they exceed the largest shard size;
//! - beside them, files this program does not read but carries along: the tokenizer's
//!   ([`TOKENIZER_FILES`]) and `generation_config.json`.
//!
//! Reading never leaves the directory: an index entry that is not a plain file name is refused.
//! Every problem is found before a weight is changed (the shards' headers are read first).
//!
//! Writing is atomic: everything goes into a temporary sibling directory, which is renamed into
//! place when the target does not exist or is empty. A non-empty target is refused unless
//! overwriting is asked for (transformers' `overwrite_output_dir`); then the target's other files
//! stay, the files being replaced and the previous weights (another shard count) are deleted
//! first, and the new files are moved in with `config.json` (or `adapter_config.json`) last, so an
//! interruption leaves a directory that loaders refuse rather than one that mixes two saves.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
use serde_json::Value;

use super::config::LlamaConfig;

/// The config file of a model directory.
pub const CONFIG: &str = "config.json";
/// The weights file of an unsharded model directory.
pub const WEIGHTS: &str = "model.safetensors";
/// The index of a sharded model directory.
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";
/// Generation settings, carried from `--model` to `--output-dir` unread.
pub const GENERATION_CONFIG: &str = "generation_config.json";
/// The tokenizer's files, carried from `--model` to `--output-dir` (those present) so that
/// `AutoTokenizer.from_pretrained` loads the output directory.
pub const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
];
/// `--max-shard-size`'s default.
pub const DEFAULT_MAX_SHARD_SIZE: &str = "5GB";
/// The settings file of a PEFT adapter directory: like `config.json`, moved in last.
const ADAPTER_CONFIG: &str = "adapter_config.json";
/// A safetensors header larger than this is refused (the format's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// The special token ids a `config.json` names, kept as found (`eos_token_id` may be a list, as
/// in Llama 3's instruct models).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenIds {
    /// `bos_token_id`.
    pub bos: Option<Value>,
    /// `eos_token_id`.
    pub eos: Option<Value>,
    /// `pad_token_id`.
    pub pad: Option<Value>,
}

impl TokenIds {
    /// Ids given as numbers (from a tokenizer).
    pub fn from_ids(bos: Option<u32>, eos: Option<u32>, pad: Option<u32>) -> Self {
        Self {
            bos: bos.map(Value::from),
            eos: eos.map(Value::from),
            pad: pad.map(Value::from),
        }
    }

    /// These ids, each missing one taken from `other`.
    pub fn or(self, other: TokenIds) -> Self {
        Self {
            bos: self.bos.or(other.bos),
            eos: self.eos.or(other.eos),
            pad: self.pad.or(other.pad),
        }
    }

    fn fields(&self) -> [(&'static str, &Option<Value>); 3] {
        [
            ("bos_token_id", &self.bos),
            ("eos_token_id", &self.eos),
            ("pad_token_id", &self.pad),
        ]
    }

    /// The ids of a config.json's fields; a value that is not an id (or a list of ids) is an
    /// error naming the field.
    fn from_json(json: &Value, file: &Path) -> Result<Self> {
        let get = |field: &str| -> Result<Option<Value>> {
            match json.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(v @ Value::Number(n)) if n.is_u64() => Ok(Some(v.clone())),
                Some(v @ Value::Array(a)) if a.iter().all(Value::is_u64) => Ok(Some(v.clone())),
                Some(v) => bail!(
                    "{}: {field} is {v}; expected a token id or a list of token ids",
                    file.display()
                ),
            }
        };
        Ok(Self {
            bos: get("bos_token_id")?,
            eos: get("eos_token_id")?,
            pad: get("pad_token_id")?,
        })
    }
}

/// A model directory as `--model` reads it: its config and where each weight is (see the
/// module docs). [`open`](Self::open) checks everything that can be checked without the
/// model's parameters; [`load_into`](Self::load_into) the rest, then loads.
#[derive(Debug, Clone)]
pub struct ModelDir {
    dir: PathBuf,
    config: LlamaConfig,
    token_ids: TokenIds,
    /// Weight file name -> the tensors to read from it, with the shapes its header gives.
    files: BTreeMap<String, BTreeMap<String, Vec<usize>>>,
    /// Where the weights were listed: `model.safetensors` or the index.
    listing: PathBuf,
}

impl ModelDir {
    /// Reads `dir`'s `config.json` and the list of its weights (`model.safetensors`, else
    /// `model.safetensors.index.json` and the headers of the shards it names). Errors name the
    /// file, the problem and the fix.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!(
                "{} is not a directory; give the directory holding config.json and the weights \
                 (model.safetensors, or model.safetensors.index.json and its shards)",
                dir.display()
            );
        }
        let config_path = dir.join(CONFIG);
        let text = std::fs::read_to_string(&config_path).with_context(|| {
            format!(
                "reading {}: a model directory holds its config.json (save it with \
                 save_pretrained)",
                config_path.display()
            )
        })?;
        let config =
            LlamaConfig::from_hf_json(&text).with_context(|| config_path.display().to_string())?;
        let json: Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", config_path.display()))?;
        let token_ids = TokenIds::from_json(&json, &config_path)?;
        let single = dir.join(WEIGHTS);
        let index = dir.join(WEIGHTS_INDEX);
        let (files, listing) = if single.exists() {
            let header = read_header(&single)?;
            (BTreeMap::from([(WEIGHTS.to_string(), header)]), single)
        } else if index.exists() {
            (read_index(dir, &index)?, index)
        } else {
            let pickled = ["pytorch_model.bin", "pytorch_model.bin.index.json"]
                .iter()
                .any(|f| dir.join(f).exists());
            bail!(
                "{} holds neither {WEIGHTS} nor {WEIGHTS_INDEX}{}; save the model with \
                 save_pretrained(dir, safe_serialization=True)",
                dir.display(),
                if pickled {
                    " (only PyTorch's pickled pytorch_model.bin, which is not read)"
                } else {
                    ""
                }
            );
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            token_ids,
            files,
            listing,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The model's size, from `config.json`.
    pub fn config(&self) -> LlamaConfig {
        self.config
    }

    /// The special token ids `config.json` names.
    pub fn token_ids(&self) -> &TokenIds {
        &self.token_ids
    }

    /// The weight files, in name order.
    pub fn weight_files(&self) -> impl Iterator<Item = &str> {
        self.files.keys().map(String::as_str)
    }

    /// Sets `params` to the directory's weights (converted to each parameter's dtype). The
    /// directory must hold exactly these names with these shapes (old checkpoints'
    /// `rotary_emb.inv_freq` buffers aside, which transformers ignores too); any difference is an
    /// error listing every one, and nothing is changed unless everything matches. One weight file
    /// is in memory at a time.
    pub fn load_into(&self, params: &[(String, Var)]) -> Result<()> {
        let Some((_, first)) = params.first() else {
            return Ok(());
        };
        let mut location: BTreeMap<&str, (&str, &Vec<usize>)> = BTreeMap::new();
        for (file, tensors) in &self.files {
            for (name, shape) in tensors {
                location.insert(name, (file, shape));
            }
        }
        let mut problems = Vec::new();
        for (name, var) in params {
            match location.get(name.as_str()) {
                None => problems.push(format!(
                    "missing {name:?} (shape {:?}): {} names no file holding it",
                    var.dims(),
                    self.listing.display()
                )),
                Some((file, shape)) if shape.as_slice() != var.dims() => problems.push(format!(
                    "{name:?} in {file} has shape {shape:?}, the model expects {:?}",
                    var.dims()
                )),
                Some(_) => {}
            }
        }
        let wanted: BTreeSet<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
        for name in location.keys() {
            if !wanted.contains(name) && !name.ends_with("rotary_emb.inv_freq") {
                problems.push(format!(
                    "unexpected tensor {name:?} (not a parameter of this model)"
                ));
            }
        }
        if !problems.is_empty() {
            bail!(
                "{} does not fit this model: {}; give a directory saved from this architecture \
                 with this config.json",
                self.dir.display(),
                problems.join("; ")
            );
        }
        let by_name: BTreeMap<&str, &Var> = params.iter().map(|(n, v)| (n.as_str(), v)).collect();
        for file in self.files.keys() {
            let path = self.dir.join(file);
            let tensors = accelerate_core::load_safetensors(&path, first.device())?;
            for (name, var) in &by_name {
                if location[name].0 != file {
                    continue;
                }
                let t = tensors.get(*name).with_context(|| {
                    format!(
                        "{} no longer holds {name:?} (it changed while being read); load again",
                        path.display()
                    )
                })?;
                var.set(&t.to_dtype(var.dtype())?)?;
            }
        }
        Ok(())
    }
}

/// The shards `index` names, each with the tensors the index maps to it and their shapes.
fn read_index(dir: &Path, index: &Path) -> Result<BTreeMap<String, BTreeMap<String, Vec<usize>>>> {
    let text =
        std::fs::read_to_string(index).with_context(|| format!("reading {}", index.display()))?;
    let json: Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not JSON; save the model again with save_pretrained",
            index.display()
        )
    })?;
    let Some(map) = json.get("weight_map").and_then(Value::as_object) else {
        bail!(
            "{} has no \"weight_map\" object (tensor name -> shard file); save the model again \
             with save_pretrained",
            index.display()
        );
    };
    let mut shards: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, file) in map {
        let Some(file) = file.as_str() else {
            bail!(
                "{}: weight_map maps {name:?} to {file}, not a file name",
                index.display()
            );
        };
        check_file_name(file).with_context(|| {
            format!("{}: weight_map maps {name:?} to {file:?}", index.display())
        })?;
        shards
            .entry(file.to_string())
            .or_default()
            .insert(name.clone());
    }
    let mut files = BTreeMap::new();
    for (file, names) in shards {
        let path = dir.join(&file);
        if !path.exists() {
            bail!(
                "{} is missing: {} maps {} tensor(s) to it ({}); download or copy every shard \
                 the index names into {}",
                path.display(),
                index.display(),
                names.len(),
                first_names(&names),
                dir.display()
            );
        }
        let header = read_header(&path)?;
        let absent: BTreeSet<String> = names
            .iter()
            .filter(|n| !header.contains_key(*n))
            .cloned()
            .collect();
        if !absent.is_empty() {
            bail!(
                "{} maps {} tensor(s) to {file}, which does not hold them ({}); the index and \
                 the shards are from different saves: download or save them again together",
                index.display(),
                absent.len(),
                first_names(&absent)
            );
        }
        let tensors = header
            .into_iter()
            .filter(|(n, _)| names.contains(n))
            .collect();
        files.insert(file, tensors);
    }
    Ok(files)
}

/// Up to three of `names`, for a message.
fn first_names(names: &BTreeSet<String>) -> String {
    let mut shown: Vec<String> = names.iter().take(3).map(|n| format!("{n:?}")).collect();
    if names.len() > 3 {
        shown.push("...".into());
    }
    shown.join(", ")
}

/// Refuses a shard name that is not a plain file name in the directory: a path (`/`, `\`), `.`,
/// `..`, or empty.
fn check_file_name(file: &str) -> Result<()> {
    let plain = !file.is_empty()
        && file != "."
        && file != ".."
        && !file.contains(['/', '\\', '\0'])
        && !Path::new(file).is_absolute();
    if !plain {
        bail!(
            "not a file name in the model directory (shards are read from the directory only); \
             name each shard by its file name, e.g. \"model-00001-of-00002.safetensors\""
        );
    }
    Ok(())
}

/// The tensors a safetensors file holds and their shapes, from its header alone.
fn read_header(path: &Path) -> Result<BTreeMap<String, Vec<usize>>> {
    let bad = |why: String| {
        anyhow::anyhow!(
            "{}: not a readable safetensors file ({why}); write it with safetensors' save_file \
             or save_pretrained",
            path.display()
        )
    };
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|e| bad(format!("no header: {e}")))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER {
        return Err(bad(format!("a header of {len} bytes")));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header)
        .map_err(|e| bad(format!("the header is cut short: {e}")))?;
    let json: BTreeMap<String, Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("its header: {e}")))?;
    let mut tensors = BTreeMap::new();
    for (name, info) in json {
        if name == "__metadata__" {
            continue;
        }
        let shape = info
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|s| {
                s.iter()
                    .map(|d| d.as_u64().map(|d| d as usize))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| bad(format!("{name:?} has no shape")))?;
        tensors.insert(name, shape);
    }
    Ok(tensors)
}

/// The bytes of a size as transformers' `max_shard_size` takes it: a number of bytes (`1000000`)
/// or a number with a unit, `KB`, `MB`, `GB`, `TB` (powers of 1000) or `KiB`, `MiB`, `GiB`
/// (powers of 1024), in any case (`"500MB"`, `"2GB"`, `"2.5GB"`).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let fail = || {
        format!(
            "{text:?} is not a size; give bytes (e.g. 1000000) or a number with a unit: KB, MB, \
             GB, TB (powers of 1000) or KiB, MiB, GiB (powers of 1024), e.g. 500MB"
        )
    };
    let upper = s.to_ascii_uppercase();
    let units: [(&str, f64); 7] = [
        ("KIB", 1024.0),
        ("MIB", 1024.0 * 1024.0),
        ("GIB", 1024.0 * 1024.0 * 1024.0),
        ("KB", 1e3),
        ("MB", 1e6),
        ("GB", 1e9),
        ("TB", 1e12),
    ];
    let (number, multiplier) = match units.iter().find(|(u, _)| upper.ends_with(u)) {
        Some((unit, m)) => (&s[..s.len() - unit.len()], *m),
        None => (s, 1.0),
    };
    let value: f64 = number.trim().parse().map_err(|_| fail())?;
    let bytes = value * multiplier;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!("{text:?} must be at least one byte"));
    }
    Ok(bytes as u64)
}

/// The shards of `tensors` (indices) for files of at most `max_bytes`, as transformers
/// (huggingface_hub's `split_state_dict_into_shards_factory`) splits a state dict: in the given
/// order, a tensor joins the open shard unless that would exceed the limit, which closes it; a
/// tensor larger than the limit is a shard of its own at once, and the open shard goes on.
pub fn plan_shards(tensors: &[(String, Tensor)], max_bytes: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut size = 0u64;
    for (i, (_, t)) in tensors.iter().enumerate() {
        let bytes = tensor_bytes(t);
        if bytes > max_bytes {
            shards.push(vec![i]);
            continue;
        }
        if size + bytes > max_bytes && !current.is_empty() {
            shards.push(std::mem::take(&mut current));
            size = 0;
        }
        current.push(i);
        size += bytes;
    }
    if !current.is_empty() {
        shards.push(current);
    }
    shards
}

fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// The name transformers writes in `config.json`'s `dtype` for weights of `dtype`.
fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    }
}

/// What [`write_model_dir`] writes.
#[derive(Debug, Clone, Copy)]
pub struct ModelOutput<'a> {
    /// The model's size, written as `config.json`.
    pub config: &'a LlamaConfig,
    /// The special token ids written into `config.json`.
    pub token_ids: &'a TokenIds,
    /// The weights under Hugging Face's names (one dtype), in the order they are sharded.
    pub tensors: &'a [(String, Tensor)],
    /// The largest weight file before the weights are split into shards, in bytes.
    pub max_shard_size: u64,
    /// The directory whose tokenizer files and `generation_config.json` are copied along
    /// (`--model`'s), if any.
    pub carry_from: Option<&'a Path>,
    /// The directory of the tokenizer the model was trained with, when it is not `carry_from`'s
    /// (`--tokenizer`): its files are copied instead of `carry_from`'s.
    pub tokenizer_from: Option<&'a Path>,
}

/// Writes a model directory that `LlamaForCausalLM.from_pretrained` (and, with tokenizer files
/// carried along, `AutoTokenizer.from_pretrained`) loads: `config.json`, the weights
/// (`model.safetensors`, or shards and `model.safetensors.index.json`), and the carried files.
/// Atomic, refusing a non-empty `dir` unless `overwrite` (see the module docs).
pub fn write_model_dir(dir: &Path, overwrite: bool, out: &ModelOutput) -> Result<()> {
    let dtype = out.tensors.first().map_or(DType::F32, |(_, t)| t.dtype());
    if let Some((name, t)) = out.tensors.iter().find(|(_, t)| t.dtype() != dtype) {
        bail!(
            "{name} is {:?} where the other weights are {dtype:?}; a model directory holds one \
             dtype",
            t.dtype()
        );
    }
    write_dir_atomically(dir, overwrite, is_weight_file, |tmp| {
        let shards = plan_shards(out.tensors, out.max_shard_size);
        if shards.len() <= 1 {
            accelerate_core::save_safetensors(tmp.join(WEIGHTS), out.tensors)?;
        } else {
            let n = shards.len();
            let mut weight_map = BTreeMap::new();
            for (k, shard) in shards.iter().enumerate() {
                let file = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
                let tensors: Vec<(String, Tensor)> =
                    shard.iter().map(|&i| out.tensors[i].clone()).collect();
                for (name, _) in &tensors {
                    weight_map.insert(name.clone(), Value::from(file.clone()));
                }
                accelerate_core::save_safetensors(tmp.join(&file), &tensors)?;
            }
            let total_size: u64 = out.tensors.iter().map(|(_, t)| tensor_bytes(t)).sum();
            let total_parameters: usize = out.tensors.iter().map(|(_, t)| t.elem_count()).sum();
            let index = serde_json::json!({
                "metadata": {"total_parameters": total_parameters, "total_size": total_size},
                "weight_map": weight_map,
            });
            write_json(&tmp.join(WEIGHTS_INDEX), &index)?;
        }
        let mut config = out.config.to_hf_json();
        let fields = config
            .as_object_mut()
            .expect("LlamaConfig::to_hf_json is an object");
        fields.insert("dtype".into(), dtype_name(dtype).into());
        // transformers 4.x reads `torch_dtype`; 5.x reads either.
        fields.insert("torch_dtype".into(), dtype_name(dtype).into());
        for (field, id) in out.token_ids.fields() {
            if let Some(id) = id {
                fields.insert(field.into(), id.clone());
            }
        }
        write_json(&tmp.join(CONFIG), &config)?;
        if let Some(from) = out.tokenizer_from.or(out.carry_from) {
            copy_carried_files(from, tmp, false)?;
        }
        if let Some(from) = out.carry_from {
            copy_files(from, tmp, &[GENERATION_CONFIG])?;
        }
        Ok(())
    })
}

/// Copies the tokenizer files present in `from` into `to` byte for byte (and, with
/// `generation`, `generation_config.json`); returns the names copied.
pub fn copy_carried_files(from: &Path, to: &Path, generation: bool) -> Result<Vec<&'static str>> {
    let mut names: Vec<&'static str> = TOKENIZER_FILES.to_vec();
    if generation {
        names.push(GENERATION_CONFIG);
    }
    copy_files(from, to, &names)
}

/// Copies those of `names` that exist in `from` into `to`, each atomically; returns them.
fn copy_files(from: &Path, to: &Path, names: &[&'static str]) -> Result<Vec<&'static str>> {
    let mut copied = Vec::new();
    for &name in names {
        let src = from.join(name);
        if !src.exists() {
            continue;
        }
        let bytes = std::fs::read(&src).with_context(|| format!("reading {}", src.display()))?;
        accelerate_core::write_atomic(to.join(name), &bytes)?;
        copied.push(name);
    }
    Ok(copied)
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let mut bytes = serde_json::to_vec_pretty(value).expect("a JSON value serializes");
    bytes.push(b'\n');
    Ok(accelerate_core::write_atomic(path, &bytes)?)
}

/// Whether `name` is a model directory's weights (`model.safetensors`, its index, or a shard
/// `model-NNNNN-of-NNNNN.safetensors`): what a save with another shard count leaves behind.
pub fn is_weight_file(name: &str) -> bool {
    if name == WEIGHTS || name == WEIGHTS_INDEX {
        return true;
    }
    let Some(middle) = name
        .strip_prefix("model-")
        .and_then(|n| n.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    matches!(middle.split_once("-of-"), Some((a, b)) if digits(a) && digits(b))
}

/// Refuses `dir` as an output directory when it is not a directory, or holds files and
/// `overwrite` is not set (naming what it holds and the ways out). Checked before training so
/// that a run does not end unable to save.
pub fn check_output_dir(dir: &Path, overwrite: bool) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        bail!(
            "{} is a file; --output-dir names a directory to create (or an empty one)",
            dir.display()
        );
    }
    if !dir.exists() || overwrite {
        return Ok(());
    }
    let mut entries: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("listing {}", dir.display()))?;
    if entries.is_empty() {
        return Ok(());
    }
    entries.sort();
    let shown: Vec<&str> = entries.iter().take(3).map(String::as_str).collect();
    bail!(
        "{} is not empty (it holds {} entries: {}{}); choose a new or empty --output-dir, or \
         pass --overwrite-output-dir to replace the model's files in it (other files are kept)",
        dir.display(),
        entries.len(),
        shown.join(", "),
        if entries.len() > 3 { ", ..." } else { "" }
    )
}

/// Fills a fresh temporary sibling of `dir` with `fill`, then puts its files in place (see the
/// module docs): the whole directory renamed when `dir` is absent or empty; otherwise, with
/// `overwrite`, the files being replaced and those `stale` names (the previous weights) deleted,
/// then the new files moved in, `config.json` and `adapter_config.json` last. The temporary
/// directory is removed whatever happens.
pub fn write_dir_atomically(
    dir: &Path,
    overwrite: bool,
    stale: impl Fn(&str) -> bool,
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    check_output_dir(dir, overwrite)?;
    let name = dir
        .file_name()
        .with_context(|| format!("{} does not name a directory", dir.display()))?
        .to_string_lossy()
        .into_owned();
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).with_context(|| format!("creating {}", parent.display()))?;
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    }
    std::fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let result = fill(&tmp).and_then(|()| {
        sync_dir(&tmp)?;
        put_in_place(&tmp, dir, &parent, &stale)
    });
    if tmp.exists() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// The second half of [`write_dir_atomically`].
fn put_in_place(tmp: &Path, dir: &Path, parent: &Path, stale: &dyn Fn(&str) -> bool) -> Result<()> {
    let empty = !dir.exists()
        || std::fs::read_dir(dir)
            .with_context(|| format!("listing {}", dir.display()))?
            .next()
            .is_none();
    if empty {
        // rename(2) replaces an empty directory.
        std::fs::rename(tmp, dir)
            .with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
        return sync_dir(parent);
    }
    let mut ours: Vec<String> = std::fs::read_dir(tmp)
        .with_context(|| format!("listing {}", tmp.display()))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    // The files loaders start from go in last.
    ours.sort_by_key(|n| (n == CONFIG || n == ADAPTER_CONFIG, n.clone()));
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry?;
        let file = entry.file_name().to_string_lossy().into_owned();
        if ours.contains(&file) || stale(&file) {
            let path = entry.path();
            if path.is_dir() {
                bail!(
                    "{} is a directory where a file of the model goes; move it away",
                    path.display()
                );
            }
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    sync_dir(dir)?;
    for file in &ours {
        let (from, to) = (tmp.join(file), dir.join(file));
        std::fs::rename(&from, &to)
            .with_context(|| format!("moving {} to {}", from.display(), to.display()))?;
    }
    sync_dir(dir)
}

/// Makes the directory's entries (renames, removals) durable.
fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing {}", dir.display()))
}

/// `dir`'s weights by name, read on the CPU from the files a [`ModelDir`] lists (what tests
/// compare a written directory with).
pub fn read_all_weights(dir: &Path) -> Result<BTreeMap<String, Tensor>> {
    let model = ModelDir::open(dir)?;
    let mut all = BTreeMap::new();
    for (file, names) in &model.files {
        let tensors = accelerate_core::load_safetensors(dir.join(file), &candle_core::Device::Cpu)?;
        for name in names.keys() {
            all.insert(name.clone(), tensors[name].clone());
        }
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use serde_json::Map;

    fn config() -> LlamaConfig {
        LlamaConfig::from_flags(11, 2, 16, 4, 2, 24, 8).unwrap()
    }

    /// The parameters of `config()`'s model, seeded, in name order.
    fn params(seed: u64) -> Vec<(String, Var)> {
        let (varmap, _) = crate::llama::build_in(config(), seed, &Device::Cpu, DType::F32).unwrap();
        crate::layers::named_vars(&varmap)
    }

    fn tensors(params: &[(String, Var)]) -> Vec<(String, Tensor)> {
        params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    fn write(dir: &Path, params: &[(String, Var)], max: u64, overwrite: bool) -> Result<()> {
        write_model_dir(
            dir,
            overwrite,
            &ModelOutput {
                config: &config(),
                token_ids: &TokenIds::from_ids(Some(1), Some(2), None),
                tensors: &tensors(params),
                max_shard_size: max,
                carry_from: None,
                tokenizer_from: None,
            },
        )
    }

    fn read_config_json(dir: &Path) -> Map<String, Value> {
        let text = std::fs::read_to_string(dir.join(CONFIG)).unwrap();
        match serde_json::from_str(&text).unwrap() {
            Value::Object(map) => map,
            _ => panic!("config.json is not an object"),
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    }

    #[test]
    fn sizes_parse_as_transformers_reads_them() {
        assert_eq!(parse_size("500MB"), Ok(500_000_000));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size("5gb"), Ok(5_000_000_000));
        assert_eq!(parse_size("2.5GB"), Ok(2_500_000_000));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("3KiB"), Ok(3 << 10));
        assert_eq!(parse_size("1TB"), Ok(1_000_000_000_000));
        assert_eq!(parse_size("123456"), Ok(123_456));
        assert_eq!(parse_size(DEFAULT_MAX_SHARD_SIZE), Ok(5_000_000_000));
        for bad in ["", "GB", "5XB", "-1MB", "0"] {
            assert!(parse_size(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_size("5XB").unwrap_err().contains("500MB"));
    }

    #[test]
    fn shards_fill_in_order_up_to_the_limit_and_a_large_tensor_stands_alone() {
        let t = |n: usize| {
            (
                "x".to_string(),
                Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap(),
            )
        };
        // 4-byte elements: 40, 40, 40, 200, 8 bytes; limit 100. As huggingface_hub splits: the
        // tensor over the limit is a shard at once, and the open shard goes on filling.
        let ts = [t(10), t(10), t(10), t(50), t(2)];
        assert_eq!(plan_shards(&ts, 100), [vec![0, 1], vec![3], vec![2, 4]]);
        assert_eq!(plan_shards(&ts, 1000), [vec![0, 1, 2, 3, 4]]);
    }

    #[test]
    fn weight_files_are_recognised_by_transformers_names() {
        for yes in [
            "model.safetensors",
            "model.safetensors.index.json",
            "model-00001-of-00003.safetensors",
        ] {
            assert!(is_weight_file(yes), "{yes}");
        }
        for no in [
            "config.json",
            "model-1-of-3.safetensors",
            "model-00001-of-00003.bin",
            "tokenizer.json",
        ] {
            assert!(!is_weight_file(no), "{no}");
        }
    }

    #[test]
    fn a_sharded_directory_round_trips_with_a_consistent_index() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("out");
        let saved = params(3);
        // The embedding and head are 11 x 16 x 4 = 704 bytes: a limit of 1000 makes several
        // shards.
        write(&dir, &saved, 1000, false).unwrap();
        let index: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(WEIGHTS_INDEX)).unwrap())
                .unwrap();
        let map = index["weight_map"].as_object().unwrap();
        assert_eq!(map.len(), saved.len());
        let files: BTreeSet<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
        assert!(files.len() >= 2, "{files:?}");
        let mut total = 0u64;
        for file in &files {
            let held = accelerate_core::load_safetensors(dir.join(file), &Device::Cpu).unwrap();
            let mapped: BTreeSet<&String> = map
                .iter()
                .filter(|(_, f)| f == file)
                .map(|(n, _)| n)
                .collect();
            assert_eq!(held.keys().collect::<BTreeSet<_>>(), mapped, "{file}");
            let bytes: u64 = held.values().map(tensor_bytes).sum();
            assert!(bytes <= 1000 || held.len() == 1, "{file}: {bytes} bytes");
            total += bytes;
        }
        assert_eq!(index["metadata"]["total_size"], total);
        assert!(!dir.join(WEIGHTS).exists());
        // Nothing but the model's files, and no temporary directory beside it.
        assert_eq!(names(root.path()), ["out"]);

        // Read back into another model's parameters: the same values.
        let loaded = params(4);
        let model = ModelDir::open(&dir).unwrap();
        assert_eq!(model.config(), config());
        assert_eq!(
            model.token_ids(),
            &TokenIds::from_ids(Some(1), Some(2), None)
        );
        model.load_into(&loaded).unwrap();
        for ((n, a), (_, b)) in saved.iter().zip(&loaded) {
            assert_eq!(values(a.as_tensor()), values(b.as_tensor()), "{n}");
        }
        let json = read_config_json(&dir);
        assert_eq!(json["dtype"], "float32");
        assert_eq!(json["torch_dtype"], "float32");
        assert_eq!(json["bos_token_id"], 1);
        assert!(!json.contains_key("pad_token_id"));
    }

    #[test]
    fn a_non_empty_directory_is_refused_unless_overwriting_which_keeps_other_files() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("out");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
        let e = format!("{:#}", write(&dir, &params(1), 1000, false).unwrap_err());
        assert!(
            e.contains("not empty")
                && e.contains("notes.txt")
                && e.contains("--overwrite-output-dir"),
            "{e}"
        );
        assert_eq!(names(&dir), ["notes.txt"]);
        assert_eq!(
            names(root.path()),
            ["out"],
            "no temporary directory is left"
        );

        // Sharded first, then one file: the old shards and index go, notes.txt stays.
        write(&dir, &params(1), 1000, true).unwrap();
        assert!(dir.join(WEIGHTS_INDEX).exists());
        write(&dir, &params(2), 1 << 30, true).unwrap();
        assert_eq!(
            names(&dir),
            ["config.json", "model.safetensors", "notes.txt"]
        );
        assert_eq!(std::fs::read(dir.join("notes.txt")).unwrap(), b"mine");
        let loaded = params(5);
        ModelDir::open(&dir).unwrap().load_into(&loaded).unwrap();
        assert_eq!(
            values(loaded[0].1.as_tensor()),
            values(params(2)[0].1.as_tensor())
        );
        // An empty existing directory is written without the flag.
        let empty = root.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        write(&empty, &params(1), 1 << 30, false).unwrap();
        assert_eq!(names(&empty), ["config.json", "model.safetensors"]);
    }

    #[test]
    fn tokenizer_and_generation_files_are_carried_byte_for_byte() {
        let root = tempfile::tempdir().unwrap();
        let from = root.path().join("from");
        std::fs::create_dir(&from).unwrap();
        std::fs::write(from.join("tokenizer.json"), b"{\"tok\": 1}").unwrap();
        std::fs::write(from.join("chat_template.jinja"), b"{{ x }}").unwrap();
        std::fs::write(from.join(GENERATION_CONFIG), b"{\"g\": 2}").unwrap();
        std::fs::write(from.join("unrelated.txt"), b"no").unwrap();
        let dir = root.path().join("out");
        write_model_dir(
            &dir,
            false,
            &ModelOutput {
                config: &config(),
                token_ids: &TokenIds::default(),
                tensors: &tensors(&params(1)),
                max_shard_size: 1 << 30,
                carry_from: Some(&from),
                tokenizer_from: None,
            },
        )
        .unwrap();
        assert_eq!(
            names(&dir),
            [
                "chat_template.jinja",
                "config.json",
                GENERATION_CONFIG,
                "model.safetensors",
                "tokenizer.json"
            ]
        );
        for f in ["tokenizer.json", "chat_template.jinja", GENERATION_CONFIG] {
            assert_eq!(
                std::fs::read(dir.join(f)).unwrap(),
                std::fs::read(from.join(f)).unwrap()
            );
        }
    }

    /// A sharded directory of `params(1)` whose index is then edited by `edit`.
    fn with_index(edit: impl FnOnce(&mut Map<String, Value>)) -> (tempfile::TempDir, PathBuf) {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("m");
        write(&dir, &params(1), 1000, false).unwrap();
        let path = dir.join(WEIGHTS_INDEX);
        let mut index: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(index["weight_map"].as_object_mut().unwrap());
        std::fs::write(&path, index.to_string()).unwrap();
        (root, dir)
    }

    fn refusal(dir: &Path) -> String {
        match ModelDir::open(dir).and_then(|m| m.load_into(&params(9))) {
            Ok(()) => panic!("{} accepted", dir.display()),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn index_entries_outside_the_directory_are_refused() {
        for bad in [
            "../model-00001-of-00002.safetensors",
            "sub/model.safetensors",
            "/etc/passwd",
            "..",
            "",
            "a\\b.safetensors",
        ] {
            let (_root, dir) = with_index(|m| {
                m.insert("lm_head.weight".into(), bad.into());
            });
            let e = refusal(&dir);
            assert!(
                e.contains("\"lm_head.weight\"") && e.contains("not a file name"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn a_missing_shard_weight_or_misplaced_name_is_refused_naming_file_and_fix() {
        let (_root, dir) = with_index(|m| {
            m.insert(
                "lm_head.weight".into(),
                "model-00009-of-00009.safetensors".into(),
            );
        });
        let e = refusal(&dir);
        assert!(
            e.contains("model-00009-of-00009.safetensors is missing")
                && e.contains("\"lm_head.weight\"")
                && e.contains("download or copy every shard"),
            "{e}"
        );

        let (_root, dir) = with_index(|m| {
            m.remove("model.norm.weight");
        });
        let e = refusal(&dir);
        assert!(
            e.contains("missing \"model.norm.weight\"") && e.contains(WEIGHTS_INDEX),
            "{e}"
        );

        // The head mapped to a shard that holds other tensors.
        let mut other = String::new();
        let (_root, dir) = with_index(|m| {
            let head = m["lm_head.weight"].clone();
            other = m
                .values()
                .find(|f| **f != head)
                .unwrap()
                .as_str()
                .unwrap()
                .to_string();
            m.insert("lm_head.weight".into(), other.clone().into());
        });
        let e = refusal(&dir);
        assert!(
            e.contains(&format!("to {other}, which does not hold them"))
                && e.contains("\"lm_head.weight\"")
                && e.contains("save them again together"),
            "{e}"
        );

        // A directory without weights, and a shape the model does not have.
        let root = tempfile::tempdir().unwrap();
        std::fs::write(
            root.path().join(CONFIG),
            serde_json::to_vec(&config().to_hf_json()).unwrap(),
        )
        .unwrap();
        let e = refusal(root.path());
        assert!(e.contains("neither model.safetensors"), "{e}");
        let mut wrong = params(1);
        wrong[0] = (
            wrong[0].0.clone(),
            Var::zeros((3, 3), DType::F32, &Device::Cpu).unwrap(),
        );
        let dir = root.path().join("w");
        write(&dir, &wrong, 1 << 30, false).unwrap();
        let e = refusal(&dir);
        assert!(e.contains("has shape [3, 3]"), "{e}");
    }

    #[test]
    fn nothing_is_changed_when_a_weight_does_not_fit() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("m");
        let mut saved = params(1);
        saved.pop();
        write(&dir, &saved, 1000, false).unwrap();
        let target = params(2);
        let before: Vec<Vec<f32>> = target.iter().map(|(_, v)| values(v.as_tensor())).collect();
        assert!(ModelDir::open(&dir).unwrap().load_into(&target).is_err());
        let after: Vec<Vec<f32>> = target.iter().map(|(_, v)| values(v.as_tensor())).collect();
        assert_eq!(before, after);
    }
}
