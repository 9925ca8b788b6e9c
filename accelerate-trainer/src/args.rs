//! [`TrainingArguments`]: the Trainer's settings, with Hugging Face's names, defaults and
//! meanings, set from code, from the command line or from a JSON or YAML file.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use accelerate_core::optim::Schedule;
use accelerate_core::{parse_report_to, MixedPrecision, TrackerKind};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};

/// Everything that shapes a [`Trainer`](crate::Trainer) run, named as in Hugging Face's
/// `transformers.TrainingArguments` and with its defaults.
///
/// Three ways to set them:
///
/// - from code: `TrainingArguments { learning_rate: 1e-3, ..Default::default() }`;
/// - from the command line: `#[command(flatten)] args: TrainingArguments` in the program's own
///   `clap` parser gives `--output-dir`, `--learning-rate`, ... (Hugging Face's `--output_dir`
///   spellings are accepted too);
/// - from a file: [`TrainingArguments::from_file`] reads JSON (`.json`) or YAML (`.yaml`,
///   `.yml`) with Hugging Face's keys; a key missing from the file keeps its default, an unknown
///   key is an error that names it.
///
/// [`validate`](Self::validate) refuses combinations that cannot work before anything runs;
/// the Trainer calls it.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingArguments {
    /// Where checkpoints (`checkpoint-<step>`), the final model and `trainer_state.json` go.
    #[arg(long, alias = "output_dir", default_value = "trainer_output")]
    pub output_dir: PathBuf,

    /// Samples per micro-batch on each process during training.
    #[arg(long, alias = "per_device_train_batch_size", default_value_t = 8)]
    pub per_device_train_batch_size: usize,
    /// Samples per batch on each process during evaluation.
    #[arg(long, alias = "per_device_eval_batch_size", default_value_t = 8)]
    pub per_device_eval_batch_size: usize,
    /// Micro-batches whose gradients are accumulated before each optimizer step.
    #[arg(long, alias = "gradient_accumulation_steps", default_value_t = 1)]
    pub gradient_accumulation_steps: usize,

    /// Peak learning rate of AdamW.
    #[arg(long, alias = "learning_rate", default_value_t = 5e-5)]
    pub learning_rate: f64,
    /// Decoupled weight decay of AdamW, applied to every parameter except biases and
    /// normalization weights.
    #[arg(long, alias = "weight_decay", default_value_t = 0.0)]
    pub weight_decay: f64,
    /// AdamW's beta1.
    #[arg(long, alias = "adam_beta1", default_value_t = 0.9)]
    pub adam_beta1: f64,
    /// AdamW's beta2.
    #[arg(long, alias = "adam_beta2", default_value_t = 0.999)]
    pub adam_beta2: f64,
    /// AdamW's epsilon.
    #[arg(long, alias = "adam_epsilon", default_value_t = 1e-8)]
    pub adam_epsilon: f64,
    /// Clip the gradient's global L2 norm to this value before each optimizer step (0: no
    /// clipping).
    #[arg(long, alias = "max_grad_norm", default_value_t = 1.0)]
    pub max_grad_norm: f64,

    /// Passes over the training data; a fraction trains that share of the last epoch's steps.
    #[arg(long, alias = "num_train_epochs", default_value_t = 3.0)]
    pub num_train_epochs: f64,
    /// Optimizer steps to train for, overriding `num_train_epochs` (Hugging Face's -1 in a file
    /// means unset).
    #[arg(long, alias = "max_steps")]
    #[serde(
        serialize_with = "steps_or_minus_one",
        deserialize_with = "minus_one_or_steps"
    )]
    pub max_steps: Option<u64>,
    /// The learning-rate schedule over the optimizer steps.
    #[arg(long, alias = "lr_scheduler_type", value_enum, default_value_t = SchedulerType::Linear)]
    pub lr_scheduler_type: SchedulerType,
    /// Optimizer steps of linear warm-up (overrides `warmup_ratio` when above 0).
    #[arg(long, alias = "warmup_steps", default_value_t = 0)]
    #[serde(deserialize_with = "whole_warmup_steps")]
    pub warmup_steps: usize,
    /// The share of all optimizer steps spent warming up, rounded up to whole steps.
    #[arg(long, alias = "warmup_ratio", default_value_t = 0.0)]
    pub warmup_ratio: f64,

    /// Log the training loss, learning rate and gradient norm every this many optimizer steps.
    #[arg(long, alias = "logging_steps", default_value_t = 500)]
    pub logging_steps: u64,
    /// When to evaluate: `no`, every `eval_steps` optimizer steps (`steps`), or after each epoch.
    #[arg(long, alias = "eval_strategy", value_enum, default_value_t = IntervalStrategy::No)]
    #[serde(alias = "evaluation_strategy")]
    pub eval_strategy: IntervalStrategy,
    /// Optimizer steps between evaluations under `eval_strategy = steps` (default:
    /// `logging_steps`).
    #[arg(long, alias = "eval_steps")]
    pub eval_steps: Option<u64>,
    /// When to save a checkpoint: `no`, every `save_steps` optimizer steps (`steps`), after each
    /// epoch, or whenever an evaluation finds a new best model (`best`).
    #[arg(long, alias = "save_strategy", value_enum, default_value_t = SaveStrategy::Steps)]
    pub save_strategy: SaveStrategy,
    /// Optimizer steps between checkpoints under `save_strategy = steps`.
    #[arg(long, alias = "save_steps", default_value_t = 500)]
    pub save_steps: u64,
    /// Keep at most this many checkpoints in `output_dir`, deleting the oldest (the best one is
    /// kept as well under `load_best_model_at_end`).
    #[arg(long, alias = "save_total_limit")]
    pub save_total_limit: Option<usize>,

    /// At the end of training, load the checkpoint with the best `metric_for_best_model`.
    #[arg(long, alias = "load_best_model_at_end")]
    pub load_best_model_at_end: bool,
    /// The evaluation metric that ranks checkpoints, with or without its `eval_` prefix (default:
    /// `loss` under `load_best_model_at_end`).
    #[arg(long, alias = "metric_for_best_model")]
    pub metric_for_best_model: Option<String>,
    /// Whether a larger `metric_for_best_model` is better (default: false for a metric whose
    /// name ends in `loss`, true otherwise).
    #[arg(long, alias = "greater_is_better")]
    pub greater_is_better: Option<bool>,

    /// Seed of the initial weights, the shuffle and every rank's random numbers.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Forward and backward in `no`, `bf16` or `fp16` with f32 master weights (default:
    /// `$ACCELERATE_MIXED_PRECISION`, which `accelerate-launch --mixed-precision` sets, else no).
    #[arg(long, alias = "mixed_precision", value_name = "MODE")]
    #[serde(with = "optional_from_str_and_display")]
    pub mixed_precision: Option<MixedPrecision>,
    /// Trackers to log to: comma-separated `tensorboard`, `csv`, `jsonl`, or `all` or `none`.
    #[arg(long, alias = "report_to", default_value_t = ReportTo::default())]
    pub report_to: ReportTo,
    /// Where the trackers write (default: `<output_dir>/runs/<time>_<host>`).
    #[arg(long, alias = "logging_dir")]
    pub logging_dir: Option<PathBuf>,
    /// Resume from this checkpoint directory, or from the latest `checkpoint-<step>` in
    /// `output_dir` with `latest` (or the flag given without a value).
    #[arg(long, alias = "resume_from_checkpoint", num_args = 0..=1, default_missing_value = "latest")]
    pub resume_from_checkpoint: Option<ResumeFrom>,
    /// Hide the progress bar.
    #[arg(long, alias = "disable_tqdm")]
    pub disable_tqdm: bool,
}

impl Default for TrainingArguments {
    fn default() -> Self {
        Self {
            output_dir: PathBuf::from("trainer_output"),
            per_device_train_batch_size: 8,
            per_device_eval_batch_size: 8,
            gradient_accumulation_steps: 1,
            learning_rate: 5e-5,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: 1.0,
            num_train_epochs: 3.0,
            max_steps: None,
            lr_scheduler_type: SchedulerType::Linear,
            warmup_steps: 0,
            warmup_ratio: 0.0,
            logging_steps: 500,
            eval_strategy: IntervalStrategy::No,
            eval_steps: None,
            save_strategy: SaveStrategy::Steps,
            save_steps: 500,
            save_total_limit: None,
            load_best_model_at_end: false,
            metric_for_best_model: None,
            greater_is_better: None,
            seed: 42,
            mixed_precision: None,
            report_to: ReportTo::default(),
            logging_dir: None,
            resume_from_checkpoint: None,
            disable_tqdm: false,
        }
    }
}

/// `lr_scheduler_type`: Hugging Face's schedule names that the Trainer supports.
// The variants carry no doc comments on purpose: clap would print them in `--help`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
#[allow(missing_docs)]
pub enum SchedulerType {
    Linear,
    Cosine,
    Constant,
    ConstantWithWarmup,
}

/// `eval_strategy`: when the Trainer evaluates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[allow(missing_docs)]
pub enum IntervalStrategy {
    No,
    Steps,
    Epoch,
}

/// `save_strategy`: when the Trainer saves a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[allow(missing_docs)]
pub enum SaveStrategy {
    No,
    Steps,
    Epoch,
    Best,
}

/// `report_to`: the trackers the Trainer logs to (none by default, as in transformers 5).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReportTo(pub Vec<TrackerKind>);

impl FromStr for ReportTo {
    type Err = Error;

    /// `tensorboard,csv,jsonl`, `all` or `none`, as [`parse_report_to`] reads them.
    fn from_str(s: &str) -> Result<Self> {
        Ok(Self(parse_report_to(s)?))
    }
}

impl fmt::Display for ReportTo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        let names: Vec<&str> = self.0.iter().map(|k| k.name()).collect();
        f.write_str(&names.join(","))
    }
}

impl Serialize for ReportTo {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().map(|k| k.name()))
    }
}

impl<'de> Deserialize<'de> for ReportTo {
    /// A string (`"all"`, `"none"`, `"tensorboard,csv"`) or a list of names, as Hugging Face's
    /// files hold either.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        let text = match OneOrMany::deserialize(deserializer)? {
            OneOrMany::One(s) => s,
            OneOrMany::Many(v) if v.is_empty() => "none".to_string(),
            OneOrMany::Many(v) => v.join(","),
        };
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// `resume_from_checkpoint`: which checkpoint a run continues from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeFrom {
    /// The newest `checkpoint-<step>` in `output_dir`; a fresh start when there is none yet, so
    /// a restarted job can always pass it.
    Latest,
    /// This checkpoint directory.
    Checkpoint(PathBuf),
}

impl FromStr for ResumeFrom {
    type Err = std::convert::Infallible;

    /// `latest` (or `true`, as Hugging Face's `train(resume_from_checkpoint=True)`) or a path.
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(match s {
            "latest" | "true" | "True" => Self::Latest,
            path => Self::Checkpoint(PathBuf::from(path)),
        })
    }
}

impl Serialize for ResumeFrom {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Self::Latest => serializer.serialize_str("latest"),
            Self::Checkpoint(path) => path.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for ResumeFrom {
    /// `true`, `"latest"` or a path.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum FlagOrPath {
            Flag(bool),
            Path(String),
        }
        match FlagOrPath::deserialize(deserializer)? {
            FlagOrPath::Flag(true) => Ok(Self::Latest),
            FlagOrPath::Flag(false) => Err(serde::de::Error::custom(
                "resume_from_checkpoint: false is not a checkpoint; leave the key out (or null) \
                 to start over",
            )),
            FlagOrPath::Path(path) => Ok(path.parse().unwrap_or_else(|never| match never {})),
        }
    }
}

impl TrainingArguments {
    /// Reads arguments from a JSON (`.json`) or YAML (`.yaml`, `.yml`) file with Hugging Face's
    /// keys; keys left out keep their defaults. The result is [validated](Self::validate).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Args(format!("training arguments {}: {e}", path.display())))?;
        let extension = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        let args: Self = match extension.as_deref() {
            Some("json") => serde_json::from_str(&text)
                .map_err(|e| Error::Args(format!("training arguments {}: {e}", path.display())))?,
            Some("yaml" | "yml") => serde_yaml_ng::from_str(&text)
                .map_err(|e| Error::Args(format!("training arguments {}: {e}", path.display())))?,
            _ => {
                return Err(Error::Args(format!(
                    "training arguments {}: unknown file type; name the file *.json, *.yaml or \
                     *.yml",
                    path.display()
                )))
            }
        };
        args.validate()?;
        Ok(args)
    }

    /// The arguments as pretty-printed JSON, with Hugging Face's keys (what
    /// [`from_file`](Self::from_file) reads back).
    pub fn to_json_string(&self) -> String {
        serde_json::to_string_pretty(self).expect("TrainingArguments serialize to JSON")
    }

    /// Refuses arguments that cannot work, naming the argument and the fix.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Args(msg));
        for (name, value) in [
            (
                "per_device_train_batch_size",
                self.per_device_train_batch_size,
            ),
            (
                "per_device_eval_batch_size",
                self.per_device_eval_batch_size,
            ),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
        ] {
            if value == 0 {
                return bad(format!("{name} is 0; it must be at least 1"));
            }
        }
        for (name, value) in [
            ("logging_steps", Some(self.logging_steps)),
            ("eval_steps", self.eval_steps),
            ("save_steps", Some(self.save_steps)),
            ("max_steps", self.max_steps),
        ] {
            if value == Some(0) {
                return bad(format!(
                    "{name} is 0; give at least 1 optimizer step{}",
                    if name == "max_steps" {
                        " (or leave it out to train num_train_epochs epochs)"
                    } else {
                        ""
                    }
                ));
            }
        }
        if self.save_total_limit == Some(0) {
            return bad(
                "save_total_limit is 0, which would delete every checkpoint; give at least 1, or \
                 save_strategy = no to save none"
                    .into(),
            );
        }
        if !(self.learning_rate.is_finite() && self.learning_rate >= 0.0) {
            return bad(format!(
                "learning_rate is {}; it must be a finite number >= 0",
                self.learning_rate
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight_decay is {}; it must be a finite number >= 0",
                self.weight_decay
            ));
        }
        for (name, beta) in [
            ("adam_beta1", self.adam_beta1),
            ("adam_beta2", self.adam_beta2),
        ] {
            if !(0.0..1.0).contains(&beta) {
                return bad(format!("{name} is {beta}; it must be in [0, 1)"));
            }
        }
        if !(self.adam_epsilon.is_finite() && self.adam_epsilon > 0.0) {
            return bad(format!(
                "adam_epsilon is {}; it must be a finite number > 0",
                self.adam_epsilon
            ));
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return bad(format!(
                "max_grad_norm is {}; give a finite norm > 0, or 0 for no clipping",
                self.max_grad_norm
            ));
        }
        if self.max_steps.is_none()
            && !(self.num_train_epochs.is_finite() && self.num_train_epochs > 0.0)
        {
            return bad(format!(
                "num_train_epochs is {} and max_steps is unset, so there is nothing to train; \
                 give num_train_epochs > 0 or max_steps >= 1",
                self.num_train_epochs
            ));
        }
        if !(0.0..=1.0).contains(&self.warmup_ratio) {
            return bad(format!(
                "warmup_ratio is {}; it must be in [0, 1] (a share of all steps)",
                self.warmup_ratio
            ));
        }
        if self.lr_scheduler_type == SchedulerType::Constant
            && (self.warmup_steps > 0 || self.warmup_ratio > 0.0)
        {
            return bad(
                "lr_scheduler_type = constant has no warm-up, but warmup_steps or warmup_ratio \
                 is set; use constant_with_warmup"
                    .into(),
            );
        }
        if self.load_best_model_at_end {
            if self.eval_strategy == IntervalStrategy::No {
                return bad(
                    "load_best_model_at_end needs evaluations to rank checkpoints, but \
                     eval_strategy is no; set eval_strategy = steps or epoch"
                        .into(),
                );
            }
            match (self.save_strategy, self.eval_strategy) {
                (SaveStrategy::Best, _) => {}
                (SaveStrategy::No, _) => {
                    return bad(
                        "load_best_model_at_end needs checkpoints, but save_strategy is no; set \
                         it to the eval_strategy (or best)"
                            .into(),
                    )
                }
                (SaveStrategy::Steps, IntervalStrategy::Steps) => {
                    let eval = self.eval_interval();
                    if self.save_steps % eval != 0 {
                        return bad(format!(
                            "load_best_model_at_end: save_steps ({}) must be a multiple of \
                             eval_steps ({eval}), so that every checkpoint has an evaluation",
                            self.save_steps
                        ));
                    }
                }
                (SaveStrategy::Epoch, IntervalStrategy::Epoch) => {}
                (save, eval) => {
                    return bad(format!(
                        "load_best_model_at_end: save_strategy ({save:?}) must match \
                         eval_strategy ({eval:?}), so that every checkpoint has an evaluation"
                    ))
                }
            }
        }
        if (self.save_strategy == SaveStrategy::Best || self.metric_for_best_model.is_some())
            && self.eval_strategy == IntervalStrategy::No
        {
            return bad(
                "save_strategy = best and metric_for_best_model need evaluations, but \
                 eval_strategy is no; set eval_strategy = steps or epoch"
                    .into(),
            );
        }
        Ok(())
    }

    /// Optimizer steps between evaluations under `eval_strategy = steps`: `eval_steps`, else
    /// `logging_steps`, as in Hugging Face.
    pub fn eval_interval(&self) -> u64 {
        self.eval_steps.unwrap_or(self.logging_steps)
    }

    /// The metric that ranks checkpoints, with its `eval_` prefix: `eval_loss` unless
    /// `metric_for_best_model` names another.
    pub fn metric_for_best(&self) -> String {
        let name = self.metric_for_best_model.as_deref().unwrap_or("loss");
        if name.starts_with("eval_") {
            name.to_string()
        } else {
            format!("eval_{name}")
        }
    }

    /// Whether a larger [`metric_for_best`](Self::metric_for_best) is better: `greater_is_better`,
    /// else false for a loss and true for anything else.
    pub fn metric_greater_is_better(&self) -> bool {
        self.greater_is_better
            .unwrap_or_else(|| !self.metric_for_best().ends_with("loss"))
    }

    /// Warm-up steps for a run of `total_steps` optimizer steps: `warmup_steps` when above 0,
    /// else `ceil(warmup_ratio × total_steps)` (Hugging Face's `get_warmup_steps`).
    pub fn warmup_steps_for(&self, total_steps: usize) -> usize {
        if self.warmup_steps > 0 {
            self.warmup_steps
        } else {
            (self.warmup_ratio * total_steps as f64).ceil() as usize
        }
    }

    /// The learning-rate schedule of a run of `total_steps` optimizer steps.
    pub fn schedule(&self, total_steps: usize) -> Schedule {
        let warmup_steps = self.warmup_steps_for(total_steps);
        match self.lr_scheduler_type {
            SchedulerType::Linear => Schedule::LinearWarmupDecay {
                warmup_steps,
                total_steps,
            },
            SchedulerType::Cosine => Schedule::CosineWithWarmup {
                warmup_steps,
                total_steps,
            },
            SchedulerType::Constant => Schedule::Constant,
            SchedulerType::ConstantWithWarmup => Schedule::ConstantWithWarmup { warmup_steps },
        }
    }

    /// Optimizer steps of the whole run, given the optimizer steps of one epoch:
    /// `max_steps` when set, else `ceil(num_train_epochs × steps_per_epoch)` (Hugging Face's
    /// rule, which lets a fractional epoch count stop part-way through the last epoch).
    pub fn total_steps(&self, steps_per_epoch: u64) -> u64 {
        crate::steps::run_steps(self.max_steps, self.num_train_epochs, steps_per_epoch)
    }
}

/// Hugging Face writes `max_steps: -1` for "unset".
fn steps_or_minus_one<S: Serializer>(
    steps: &Option<u64>,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    match steps {
        Some(steps) => serializer.serialize_u64(*steps),
        None => serializer.serialize_i64(-1),
    }
}

/// Reads `max_steps`: a count, or -1 (or null) for unset.
fn minus_one_or_steps<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Option<u64>, D::Error> {
    match Option::<i64>::deserialize(deserializer)? {
        None | Some(-1) => Ok(None),
        Some(n) if n >= 0 => Ok(Some(n as u64)),
        Some(n) => Err(serde::de::Error::custom(format!(
            "max_steps is {n}; give a number of optimizer steps >= 1, or -1 for unset"
        ))),
    }
}

/// Reads `warmup_steps` as a whole number of steps. transformers 5 reads a fraction below 1 as a
/// ratio of all steps; here that is `warmup_ratio`, and a fraction is refused with that fix
/// rather than silently rounded.
fn whole_warmup_steps<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<usize, D::Error> {
    let steps = f64::deserialize(deserializer)?;
    if steps.fract() != 0.0 || steps < 0.0 || !steps.is_finite() {
        let fix = if (0.0..1.0).contains(&steps) {
            format!(
                "transformers 5 reads a fraction as a share of all steps; write \
                 warmup_ratio: {steps} instead"
            )
        } else {
            "give a whole number of optimizer steps >= 0".to_string()
        };
        return Err(serde::de::Error::custom(format!(
            "warmup_steps is {steps}: {fix}"
        )));
    }
    Ok(steps as usize)
}

/// (De)serializes an optional value through its `FromStr` and `Display` (the mixed-precision
/// mode): a string, or null for unset.
mod optional_from_str_and_display {
    use std::fmt::Display;
    use std::str::FromStr;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<T: Display, S: Serializer>(
        value: &Option<T>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(value) => serializer.collect_str(value),
            None => serializer.serialize_none(),
        }
    }

    pub fn deserialize<'de, T, D>(deserializer: D) -> Result<Option<T>, D::Error>
    where
        T: FromStr,
        T::Err: Display,
        D: Deserializer<'de>,
    {
        Option::<String>::deserialize(deserializer)?
            .map(|s| s.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}
