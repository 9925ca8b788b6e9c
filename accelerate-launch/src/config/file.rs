//! An Accelerate config file read and checked: the keys we map, typed; the keys we do not support
//! named (never silently dropped); a bad value refused with the file, the key, the value and what
//! the key accepts.
//!
//! Accelerate writes many keys for features we lack (TPU, dynamo, Megatron-LM, ...). Where such a
//! key holds its neutral value (`debug: false`, `tpu_env: []`, `fsdp_config: {}`,
//! `downcast_bf16: 'no'`, `main_training_function: main`) it asks for nothing, and it is accepted
//! quietly: every file `accelerate config default` writes has a dozen of them. Any other value,
//! and any key we do not know, is named in [`ConfigFile::ignored`].
//!
//! `mpirun_config.mpirun_hostfile` (what `accelerate config` writes when Accelerate is to start
//! `mpirun` for a multi-CPU job) is `--mpirun-hostfile`; `mpirun_config.mpirun_ccl` (older
//! Accelerate's oneCCL worker count) has no counterpart and is named when set.
//!
//! `distributed_type: DEEPSPEED` with `deepspeed_config.zero_stage` 0 to 3 runs as our ZeRO of
//! that stage (the same sharding of optimizer state, gradients and, at stage 3, parameters).
//! `offload_optimizer_device` and `offload_param_device` other than `none` are refused: we do not
//! offload, and a job sized for offloading would run out of memory without it. DeepSpeed's other
//! options (`zero3_init_flag`, `zero3_save_16bit_model`, `gradient_clipping`, ...) are quiet when
//! off and named when on, as any feature we lack.
//!
//! `distributed_type: FSDP` runs as our ZeRO too, its `fsdp_config` read as Accelerate reads it
//! (see `config/file/fsdp.rs`):
//!
//! | `fsdp_config` key | ours |
//! |---|---|
//! | `fsdp_version` | 1 (default) or 2; others refused |
//! | `fsdp_sharding_strategy` (version 1; also `fsdp_reshard_after_forward`) | `FULL_SHARD`/1: stage 3, `SHARD_GRAD_OP`/2: stage 2, `NO_SHARD`/3: stage 0; `HYBRID_SHARD`, `HYBRID_SHARD_ZERO2` refused |
//! | `fsdp_reshard_after_forward` (version 2) | `true` (default): stage 3, `false`: stage 2 |
//! | `fsdp_auto_wrap_policy` | `TRANSFORMER_BASED_WRAP` with `fsdp_transformer_layer_cls_to_wrap`: `ACCELERATE_FSDP_LAYER_CLASSES`; at stage 3, no classes, `SIZE_BASED_WRAP` and `NO_WRAP` (the default) refused |
//! | `fsdp_state_dict_type` | `FULL_STATE_DICT`, `SHARDED_STATE_DICT`: `ACCELERATE_FSDP_STATE_DICT_TYPE`; `LOCAL_STATE_DICT` refused |
//! | `fsdp_forward_prefetch` | `true`/`false` (or what Accelerate's `str_to_bool` takes): `ACCELERATE_FSDP_FORWARD_PREFETCH` 1/0; absent or null: not set |
//! | `fsdp_backward_prefetch` | `BACKWARD_PRE`, `BACKWARD_POST` (or PyTorch's 1, 2): `ACCELERATE_FSDP_BACKWARD_PREFETCH` 1; `NO_PREFETCH`: 0; absent or null: not set |
//! | `fsdp_offload_params` | `false`; `true` refused |
//! | `fsdp_cpu_ram_efficient_loading`, `fsdp_sync_module_states`, `fsdp_use_orig_params`, `fsdp_activation_checkpointing`, `fsdp_min_num_params` | quiet: no effect on what training computes here |
//! | any other | named in [`ConfigFile::ignored`] as `fsdp_config.KEY` (quiet when neutral) |
//!
//! Mixed precision, process counts and the rest come from the top-level keys, as for any type.

use std::path::{Path, PathBuf};

use accelerate_core::MixedPrecision;
use serde_json::{Map, Value};

use crate::cli::{MAX_ZERO_STAGE, ZERO_STAGES};

mod fsdp;
mod prefetch;

pub use fsdp::{layer_classes, StateDictType};
pub use prefetch::{backward_prefetch_units, forward_prefetch_units};

/// Accelerate's `distributed_type`, the values we run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DistributedType {
    /// One process.
    No,
    /// `num_processes` processes on the CPU.
    MultiCpu,
    /// One process per GPU.
    MultiGpu,
    /// DeepSpeed ZeRO stage 0-3, run as our ZeRO (one process per GPU, or on the CPU with
    /// `use_cpu`).
    DeepSpeed,
    /// PyTorch FSDP (`fsdp_config`), run as our ZeRO of the stage its sharding asks for (one
    /// process per GPU, or on the CPU with `use_cpu`).
    Fsdp,
}

impl DistributedType {
    /// The value as Accelerate spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::No => "NO",
            Self::MultiCpu => "MULTI_CPU",
            Self::MultiGpu => "MULTI_GPU",
            Self::DeepSpeed => "DEEPSPEED",
            Self::Fsdp => "FSDP",
        }
    }

    /// The value for Accelerate's spelling (any case); `None` for the types we do not run.
    pub fn parse(value: &str) -> Option<Self> {
        match value.trim().to_ascii_uppercase().as_str() {
            "NO" => Some(Self::No),
            "MULTI_CPU" => Some(Self::MultiCpu),
            "MULTI_GPU" => Some(Self::MultiGpu),
            "DEEPSPEED" => Some(Self::DeepSpeed),
            "FSDP" => Some(Self::Fsdp),
            _ => None,
        }
    }
}

/// What `distributed_type` accepts, for error messages.
pub const VALID_DISTRIBUTED_TYPES: &str = "NO, MULTI_CPU or MULTI_GPU (or FSDP with fsdp_config, \
     or DEEPSPEED with deepspeed_config.zero_stage 0 to 3, run as our ZeRO)";

/// The keys of an Accelerate config file that we map to launcher flags.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigFile {
    /// The file read.
    pub path: PathBuf,
    /// `distributed_type` (`NO` when absent, as for a file without it we run one process).
    pub distributed_type: DistributedType,
    /// `num_processes` (total over the machines); `None` when absent or -1 (Accelerate's "unset").
    pub num_processes: Option<usize>,
    /// `num_machines`.
    pub num_machines: Option<usize>,
    /// `machine_rank`.
    pub machine_rank: Option<usize>,
    /// `main_process_ip`.
    pub main_process_ip: Option<String>,
    /// `main_process_port`.
    pub main_process_port: Option<u16>,
    /// `use_cpu`.
    pub use_cpu: bool,
    /// `mixed_precision` (or the old `fp16: true`).
    pub mixed_precision: Option<MixedPrecision>,
    /// `gradient_accumulation_steps`, at the top level or under `deepspeed_config`.
    pub gradient_accumulation_steps: Option<usize>,
    /// `gpu_ids` as a `CUDA_VISIBLE_DEVICES` list; `None` for `all` or absent.
    pub gpu_ids: Option<String>,
    /// `max_restarts`.
    pub max_restarts: Option<u32>,
    /// `deepspeed_config.zero_stage` under `distributed_type: DEEPSPEED`; under `FSDP`, the stage
    /// `fsdp_config`'s sharding asks for.
    pub zero_stage: Option<u8>,
    /// `fsdp_config.fsdp_transformer_layer_cls_to_wrap` under `TRANSFORMER_BASED_WRAP`: the
    /// classes of stage 3's units, separated by commas (`ACCELERATE_FSDP_LAYER_CLASSES`).
    pub fsdp_layer_classes: Option<String>,
    /// `fsdp_config.fsdp_state_dict_type` under `distributed_type: FSDP`, or Accelerate's default
    /// for the FSDP version (`ACCELERATE_FSDP_STATE_DICT_TYPE`).
    pub fsdp_state_dict_type: Option<StateDictType>,
    /// `fsdp_config.fsdp_forward_prefetch` under `distributed_type: FSDP`, as units all-gathered
    /// ahead in the forward pass (true 1, false 0); `None` when absent or null, leaving the
    /// workers' default (`ACCELERATE_FSDP_FORWARD_PREFETCH`).
    pub fsdp_forward_prefetch: Option<usize>,
    /// `fsdp_config.fsdp_backward_prefetch` under `distributed_type: FSDP`, as units all-gathered
    /// ahead in the backward pass (`BACKWARD_PRE`/`BACKWARD_POST` 1, `NO_PREFETCH` 0); `None` when
    /// absent or null, leaving the workers' default (`ACCELERATE_FSDP_BACKWARD_PREFETCH`).
    pub fsdp_backward_prefetch: Option<usize>,
    /// `mpirun_config.mpirun_hostfile` of a CPU job (`--mpirun-hostfile`).
    pub mpirun_hostfile: Option<PathBuf>,
    /// Keys we do not support that ask for something (an enabled feature, an unknown key),
    /// sorted; `deepspeed_config.X` for keys inside it.
    pub ignored: Vec<String>,
}

impl ConfigFile {
    /// Reads and checks the file at `path`: JSON if its name ends in `.json`, YAML otherwise (as
    /// Accelerate decides; YAML also reads the JSON `accelerate config default` writes).
    pub fn read(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => format!(
                "config file {}: no such file; check the path, or write one with `accelerate \
                 config`",
                path.display()
            ),
            _ => format!("config file {}: cannot read it ({e})", path.display()),
        })?;
        Self::parse(path, &text)
    }

    /// Checks `text`, the content of the file at `path` (named in the messages).
    pub fn parse(path: &Path, text: &str) -> Result<Self, String> {
        let shown = path.display();
        let value: Value = if path.extension().is_some_and(|e| e == "json") {
            serde_json::from_str(text)
                .map_err(|e| format!("config file {shown}: not valid JSON ({e})"))?
        } else {
            serde_yaml_ng::from_str(text)
                .map_err(|e| format!("config file {shown}: not valid YAML ({e})"))?
        };
        let map = match value {
            Value::Object(map) => map,
            Value::Null => Map::new(),
            other => {
                return Err(format!(
                    "config file {shown}: expected a mapping of keys to values, found {}",
                    short(&other)
                ))
            }
        };
        Reader {
            path,
            ignored: Vec::new(),
        }
        .read(&map)
    }
}

/// The keys Accelerate writes for features we lack, accepted quietly when they hold their neutral
/// value (see [`is_neutral`]).
const UNSUPPORTED_KEYS: &[&str] = &[
    "debug",
    "downcast_bf16",
    "enable_cpu_affinity",
    "main_training_function",
    "dynamo_backend",
    "dynamo_config",
    "megatron_lm_config",
    "ipex_config",
    "fp8_config",
    "tp_config",
    "tpu_name",
    "tpu_zone",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "tpu_vm",
    "tpu_env",
    "command_file",
    "commands",
];

/// Keys inside `deepspeed_config` that our ZeRO has no counterpart for, quiet when neutral (off)
/// and named when on. `zero3_init_flag` (building the model already partitioned) and
/// `zero3_save_16bit_model` (gathering 16-bit weights on save) are among them: our stage 3 shards
/// a model built whole when it is prepared, and saves what `fsdp_state_dict_type` says.
const UNSUPPORTED_DEEPSPEED_KEYS: &[&str] = &[
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "zero3_init_flag",
    "zero3_save_16bit_model",
    "deepspeed_multinode_launcher",
    "deepspeed_hostfile",
    "deepspeed_config_file",
    "gradient_clipping",
    "mixed_precision",
];

/// A value that asks for nothing: null, false, an empty string or list, `no`/`none`
/// (`downcast_bf16`, offload devices, `dynamo_backend`), `main` for `main_training_function`
/// (which only notebook and TPU launches use), or a mapping of such values.
fn is_neutral(key: &str, value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::String(s) => {
            let s = s.trim();
            s.is_empty()
                || s.eq_ignore_ascii_case("no")
                || s.eq_ignore_ascii_case("none")
                || (key == "main_training_function" && s == "main")
        }
        Value::Array(a) => a.is_empty(),
        // dynamo_config: {dynamo_backend: NO}, ipex_config: {ipex: false}: nothing enabled.
        Value::Object(o) => o.iter().all(|(k, v)| is_neutral(k, v)),
        Value::Number(_) | Value::Bool(true) => false,
    }
}

/// A value shown in a message: a scalar as written, anything longer abbreviated.
fn short(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "a mapping".into(),
        other => other.to_string(),
    }
}

struct Reader<'a> {
    path: &'a Path,
    ignored: Vec<String>,
}

impl Reader<'_> {
    /// The error for `key` holding `value`, saying what it accepts.
    fn bad(&self, key: &str, value: &Value, valid: &str) -> String {
        format!(
            "config file {}: {key}: {}: {valid}",
            self.path.display(),
            short(value)
        )
    }

    fn read(mut self, map: &Map<String, Value>) -> Result<ConfigFile, String> {
        let get = |k: &str| map.get(k).filter(|v| !v.is_null());
        if let Some(env) = get("compute_environment") {
            if env.as_str() != Some("LOCAL_MACHINE") {
                return Err(self.bad(
                    "compute_environment",
                    env,
                    "only LOCAL_MACHINE is supported (machines you start the launcher on); \
                     Amazon SageMaker jobs are not",
                ));
            }
        }
        let distributed_type = match get("distributed_type") {
            None => DistributedType::No,
            // PyYAML 1.1 reads an unquoted NO as false.
            Some(Value::Bool(false)) => DistributedType::No,
            Some(v) => match v.as_str().and_then(DistributedType::parse) {
                Some(t) => t,
                None => {
                    return Err(self.bad(
                        "distributed_type",
                        v,
                        &format!(
                            "not supported; give {VALID_DISTRIBUTED_TYPES} (FSDP, TPU/XLA, \
                             Megatron-LM and other accelerators are not implemented)"
                        ),
                    ))
                }
            },
        };
        let num_processes = match get("num_processes") {
            Some(Value::Number(n)) if n.as_i64() == Some(-1) => None,
            Some(v) => Some(self.count("num_processes", v, 1)?),
            None => None,
        };
        if distributed_type == DistributedType::No && num_processes.is_some_and(|n| n > 1) {
            return Err(self.bad(
                "num_processes",
                &get("num_processes").cloned().unwrap_or_default(),
                "distributed_type NO runs one process; use MULTI_CPU or MULTI_GPU for several",
            ));
        }
        let num_machines = get("num_machines")
            .map(|v| self.count("num_machines", v, 1))
            .transpose()?;
        let machine_rank = get("machine_rank")
            .map(|v| self.count("machine_rank", v, 0))
            .transpose()?;
        let main_process_ip = match get("main_process_ip") {
            Some(Value::String(s)) if !s.trim().is_empty() => Some(s.trim().to_string()),
            Some(Value::String(_)) | None => None,
            Some(v) => {
                return Err(self.bad(
                    "main_process_ip",
                    v,
                    "give the address of machine rank 0 as a string",
                ))
            }
        };
        let main_process_port = get("main_process_port")
            .map(|v| {
                self.count("main_process_port", v, 0).and_then(|p| {
                    u16::try_from(p).map_err(|_| {
                        self.bad(
                            "main_process_port",
                            v,
                            "give a TCP port from 1 to 65535, or 0 to pick a free one",
                        )
                    })
                })
            })
            .transpose()?;
        let use_cpu = match get("use_cpu") {
            None => false,
            Some(v) => self.switch("use_cpu", v)?,
        };
        let mut mixed_precision = match get("mixed_precision") {
            None | Some(Value::Bool(false)) => None,
            Some(v) => Some(self.precision("mixed_precision", v)?),
        };
        if mixed_precision.is_none() && get("fp16").is_some_and(|v| v == &Value::Bool(true)) {
            // Accelerate's old spelling, which it still converts.
            mixed_precision = Some(MixedPrecision::Fp16);
        }
        let mut gradient_accumulation_steps = get("gradient_accumulation_steps")
            .map(|v| self.count("gradient_accumulation_steps", v, 1))
            .transpose()?;
        let gpu_ids = get("gpu_ids")
            .map(|v| self.gpu_ids(v))
            .transpose()?
            .flatten();
        if let Some(v) = get("rdzv_backend") {
            match v.as_str().map(str::trim) {
                Some("static") | Some("c10d") => {}
                _ => {
                    return Err(self.bad(
                        "rdzv_backend",
                        v,
                        "give static (c10d is taken as the same thing): the rendezvous store \
                         runs on machine rank 0 at main_process_ip:main_process_port; etcd is \
                         not supported",
                    ))
                }
            }
        }
        if let Some(v) = get("same_network") {
            // Only Accelerate's multi-machine TPU launch reads it.
            self.switch("same_network", v)?;
        }
        let max_restarts = get("max_restarts")
            .map(|v| {
                self.count("max_restarts", v, 0)
                    .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
            })
            .transpose()?;

        let mut zero_stage = None;
        if let Some(ds) = get("deepspeed_config") {
            match (distributed_type, ds) {
                (DistributedType::DeepSpeed, Value::Object(ds)) => {
                    for (key, value) in ds {
                        let full = format!("deepspeed_config.{key}");
                        match key.as_str() {
                            "zero_stage" => zero_stage = Some(self.zero_stage(&full, value)?),
                            // A job sized for offloading would run out of memory without it.
                            "offload_optimizer_device" | "offload_param_device"
                                if !is_neutral(key, value) =>
                            {
                                return Err(self.bad(
                                    &full,
                                    value,
                                    "offloading to the CPU or NVMe is not implemented; set it to \
                                     none",
                                ))
                            }
                            "offload_optimizer_device" | "offload_param_device" => {}
                            "gradient_accumulation_steps" => {
                                gradient_accumulation_steps = Some(self.count(&full, value, 1)?);
                            }
                            // `standard`: torchrun on each machine, which is what our
                            // launcher on each machine is (`accelerate config` writes it).
                            "deepspeed_multinode_launcher"
                                if value.as_str().map(str::trim) == Some("standard") => {}
                            _ if UNSUPPORTED_DEEPSPEED_KEYS.contains(&key.as_str())
                                && is_neutral(key, value) => {}
                            _ => self.ignored.push(full),
                        }
                    }
                }
                (DistributedType::DeepSpeed, other) if !is_neutral("deepspeed_config", other) => {
                    return Err(self.bad(
                        "deepspeed_config",
                        other,
                        "expected a mapping (zero_stage: 0 to 3, ...)",
                    ))
                }
                (_, other) if !is_neutral("deepspeed_config", other) => {
                    // Accelerate reads it only under distributed_type DEEPSPEED.
                    self.ignored.push("deepspeed_config".into());
                }
                _ => {}
            }
        }

        let (mut fsdp_layer_classes, mut fsdp_state_dict_type) = (None, None);
        let (mut fsdp_forward_prefetch, mut fsdp_backward_prefetch) = (None, None);
        if distributed_type == DistributedType::Fsdp {
            let fsdp = self.fsdp(get("fsdp_config"))?;
            zero_stage = Some(fsdp.zero_stage);
            fsdp_layer_classes = fsdp.layer_classes;
            fsdp_state_dict_type = Some(fsdp.state_dict_type);
            fsdp_forward_prefetch = fsdp.forward_prefetch;
            fsdp_backward_prefetch = fsdp.backward_prefetch;
        } else if get("fsdp_config").is_some_and(|c| !is_neutral("fsdp_config", c)) {
            // Accelerate reads it only under distributed_type FSDP.
            self.ignored.push("fsdp_config".into());
        }

        let mut mpirun_hostfile = None;
        if let Some(mpi) = get("mpirun_config") {
            let cpu_job = use_cpu || distributed_type == DistributedType::MultiCpu;
            match mpi {
                Value::Object(mpi) => {
                    for (key, value) in mpi {
                        let full = format!("mpirun_config.{key}");
                        match (key.as_str(), value) {
                            ("mpirun_hostfile", Value::String(s)) if !s.trim().is_empty() => {
                                if cpu_job {
                                    mpirun_hostfile = Some(PathBuf::from(s.trim()));
                                } else {
                                    // Accelerate reads it only for a CPU job too.
                                    self.ignored.push(full);
                                }
                            }
                            ("mpirun_hostfile", v) if is_neutral(key, v) => {}
                            ("mpirun_hostfile", v) => {
                                return Err(self.bad(
                                    &full,
                                    v,
                                    "give the path of an Open MPI hostfile as a string",
                                ))
                            }
                            _ if is_neutral(key, value) => {}
                            _ => self.ignored.push(full),
                        }
                    }
                }
                other if is_neutral("mpirun_config", other) => {}
                other => {
                    return Err(self.bad(
                        "mpirun_config",
                        other,
                        "expected a mapping (mpirun_hostfile: /path/to/hostfile)",
                    ))
                }
            }
        }

        const MAPPED: &[&str] = &[
            "compute_environment",
            "distributed_type",
            "num_processes",
            "num_machines",
            "machine_rank",
            "main_process_ip",
            "main_process_port",
            "use_cpu",
            "mixed_precision",
            "fp16",
            "gradient_accumulation_steps",
            "gpu_ids",
            "rdzv_backend",
            "same_network",
            "max_restarts",
            "deepspeed_config",
            "fsdp_config",
            "mpirun_config",
        ];
        for (key, value) in map {
            let quiet = MAPPED.contains(&key.as_str())
                || (UNSUPPORTED_KEYS.contains(&key.as_str()) && is_neutral(key, value));
            if !quiet {
                self.ignored.push(key.clone());
            }
        }
        // One order whatever the map's: the warning line and the tests read it.
        self.ignored.sort();
        Ok(ConfigFile {
            path: self.path.to_path_buf(),
            distributed_type,
            num_processes,
            num_machines,
            machine_rank,
            main_process_ip,
            main_process_port,
            use_cpu,
            mixed_precision,
            gradient_accumulation_steps,
            gpu_ids,
            max_restarts,
            zero_stage,
            fsdp_layer_classes,
            fsdp_state_dict_type,
            fsdp_forward_prefetch,
            fsdp_backward_prefetch,
            mpirun_hostfile,
            ignored: self.ignored,
        })
    }

    /// A whole number at least `min` (a number, or a string of digits as hand-written files have).
    fn count(&self, key: &str, value: &Value, min: u64) -> Result<usize, String> {
        let n = match value {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.trim().parse::<u64>().ok(),
            _ => None,
        };
        match n {
            Some(n) if n >= min => Ok(n as usize),
            _ => Err(self.bad(
                key,
                value,
                &format!("give a whole number of at least {min}"),
            )),
        }
    }

    fn switch(&self, key: &str, value: &Value) -> Result<bool, String> {
        match value {
            Value::Bool(b) => Ok(*b),
            Value::String(s) if s.eq_ignore_ascii_case("true") => Ok(true),
            Value::String(s) if s.eq_ignore_ascii_case("false") => Ok(false),
            _ => Err(self.bad(key, value, "give true or false")),
        }
    }

    fn precision(&self, key: &str, value: &Value) -> Result<MixedPrecision, String> {
        let text = value.as_str().map(str::trim).unwrap_or_default();
        if text.eq_ignore_ascii_case("fp8") {
            return Err(self.bad(
                key,
                value,
                &format!(
                    "fp8 training is not supported; give {}",
                    MixedPrecision::VALID
                ),
            ));
        }
        text.parse::<MixedPrecision>()
            .map_err(|_| self.bad(key, value, &format!("give {}", MixedPrecision::VALID)))
    }

    fn zero_stage(&self, key: &str, value: &Value) -> Result<u8, String> {
        match value.as_u64() {
            Some(n) if n <= u64::from(MAX_ZERO_STAGE) => Ok(n as u8),
            _ => Err(self.bad(key, value, ZERO_STAGES)),
        }
    }

    /// `all` (`None`: every GPU) or a list of GPU indices, as `CUDA_VISIBLE_DEVICES` takes it.
    fn gpu_ids(&self, value: &Value) -> Result<Option<String>, String> {
        const VALID: &str = "give all, or GPU indices separated by commas (e.g. \"0,1\")";
        let text = match value {
            Value::Number(n) if n.is_u64() => n.to_string(),
            Value::String(s) => s.trim().to_string(),
            _ => return Err(self.bad("gpu_ids", value, VALID)),
        };
        if text.eq_ignore_ascii_case("all") {
            return Ok(None);
        }
        let ids: Vec<&str> = text.split(',').map(str::trim).collect();
        if ids
            .iter()
            .any(|id| id.is_empty() || id.parse::<u32>().is_err())
        {
            return Err(self.bad("gpu_ids", value, VALID));
        }
        Ok(Some(ids.join(",")))
    }
}
