//! The flags every training run takes, whatever it trains.

use std::path::PathBuf;

use accelerate_core::optim::Schedule;
use accelerate_core::{parse_report_to, Accelerator, MixedPrecision, TrackerKind};
use anyhow::{bail, Context, Result};
use clap::ValueEnum;

/// The learning-rate schedule a run picks with `--schedule`: `constant` (the peak rate after the
/// warmup, if any), `linear` or `cosine` (warmup, then decay to zero at the last step).
// The variants carry no doc comments on purpose: clap would print them, changing `--help`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ScheduleKind {
    Constant,
    Linear,
    Cosine,
}

/// Flags shared by the training examples; use with `#[command(flatten)]`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Micro-batches per optimizer step (default: $ACCELERATE_GRADIENT_ACCUMULATION_STEPS, else 1).
    #[arg(long)]
    pub grad_accum: Option<usize>,
    /// Optimizer steps to train for, overriding the epochs (as transformers' max_steps): the run
    /// goes through as many epochs as they take, and the schedule spans them (default: the steps
    /// of all epochs). A step skipped for an fp16 overflow counts, as in transformers.
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Learning-rate schedule, counted in optimizer steps.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Constant)]
    pub schedule: ScheduleKind,
    /// Warmup steps of the schedule.
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: usize,
    /// Clip the gradient's global L2 norm to this value.
    #[arg(long)]
    pub max_grad_norm: Option<f64>,
    /// Save the training state every N optimizer steps, as CHECKPOINT_DIR/checkpoint_STEP.
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Where checkpoints go (and where --resume looks).
    #[arg(long, default_value = "checkpoints")]
    pub checkpoint_dir: PathBuf,
    /// Keep only the newest N checkpoints.
    #[arg(long)]
    pub checkpoints_keep: Option<usize>,
    /// Continue from the latest checkpoint in --checkpoint-dir (from the start if there is none
    /// yet, so a restarted job can always pass it).
    #[arg(long)]
    pub resume: bool,
    /// Start over in a --checkpoint-dir that holds another run's checkpoints, deleting them
    /// (without it, such a run is refused).
    #[arg(long, conflicts_with = "resume")]
    pub overwrite_checkpoints: bool,
    /// Forward and backward in no|bf16|fp16 with f32 master weights (default:
    /// $ACCELERATE_MIXED_PRECISION, which `accelerate-launch --mixed-precision` sets, else no).
    #[arg(long, value_name = "MODE")]
    pub mixed_precision: Option<MixedPrecision>,
    /// ZeRO stage: 0 (plain data parallel), 1 (optimizer state sharded across the ranks), 2
    /// (optimizer state and gradients sharded) or 3 (parameters sharded too: fully sharded,
    /// for a model computed through its units) (default: $ACCELERATE_ZERO_STAGE, which
    /// `accelerate-launch --zero-stage` sets, else 0).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero_stage: Option<u8>,
    /// Report the global loss every N optimizer steps (mean over those steps) and at the end, to
    /// --metrics, --report-to and the progress bar (default 1). Reading the loss is the only host
    /// synchronization of a step on a GPU, so N > 1 keeps the device busy. --log-every is an
    /// alias.
    #[arg(long, value_name = "N")]
    pub logging_steps: Option<u64>,
    /// The former name of --logging-steps, kept for existing scripts.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        hide = true,
        conflicts_with = "logging_steps"
    )]
    pub log_every: u64,
    /// Log train/loss, train/learning_rate, train/grad_norm (with --max-grad-norm) and eval/loss
    /// to these trackers, from the main process: a comma-separated list of tensorboard, csv and
    /// jsonl, or all, or none (default none).
    #[arg(long, value_name = "LIST", value_parser = parse_report_to_flag)]
    pub report_to: Option<ReportTo>,
    /// Where --report-to's files go (default: runs/DATE-TIME_HOST, one directory per run; a
    /// resumed run continues a directory's files).
    #[arg(long, value_name = "DIR")]
    pub logging_dir: Option<PathBuf>,
    /// Evaluate on the held-out split every N optimizer steps, as well as at the end.
    #[arg(long, value_name = "N")]
    pub eval_steps: Option<u64>,
    /// Share of the data held out for evaluation, picked by a permutation seeded with --seed (the
    /// same split on every rank) and never trained on; evaluated at the end of the run, and every
    /// --eval-steps (default 0.1 with --eval-steps, else 0: no split).
    #[arg(long, value_name = "F")]
    pub eval_fraction: Option<f64>,
}

/// The trackers of `--report-to` (a newtype: clap takes a `Vec` field as a repeated flag).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportTo(pub Vec<TrackerKind>);

/// `--report-to`'s parser: [`parse_report_to`], whose error names the valid trackers.
fn parse_report_to_flag(value: &str) -> accelerate_core::Result<ReportTo> {
    parse_report_to(value).map(ReportTo)
}

/// The share of the data `--eval-fraction` holds out when `--eval-steps` is given without it.
pub const DEFAULT_EVAL_FRACTION: f64 = 0.1;

impl RunArgs {
    /// Refuses checkpoint flags that cannot work, before anything is built or written.
    pub fn check(&self) -> Result<()> {
        if self.checkpoint_every == Some(0) {
            bail!("--checkpoint-every must be at least 1 (optimizer steps between checkpoints)");
        }
        if self.checkpoints_keep == Some(0) {
            bail!("--checkpoints-keep must be at least 1 (0 would delete the newest checkpoint)");
        }
        if self.log_every == 0 {
            bail!("--log-every must be at least 1 (optimizer steps between loss reports)");
        }
        if self.logging_steps == Some(0) {
            bail!("--logging-steps must be at least 1 (optimizer steps between loss reports)");
        }
        if self.eval_steps == Some(0) {
            bail!("--eval-steps must be at least 1 (optimizer steps between evaluations)");
        }
        if let Some(f) = self.eval_fraction {
            if !(0.0..1.0).contains(&f) {
                bail!(
                    "--eval-fraction must be in [0, 1) (the share of the data held out for \
                     evaluation; 0 holds out none), got {f}"
                );
            }
            if f == 0.0 && self.eval_steps.is_some() {
                bail!(
                    "--eval-steps needs an evaluation split, and --eval-fraction 0 holds out \
                     none: give --eval-fraction above 0 (default {DEFAULT_EVAL_FRACTION}) or \
                     drop --eval-steps"
                );
            }
        }
        if self.logging_dir.is_some() && self.trackers().is_empty() {
            bail!(
                "--logging-dir is where --report-to's files go, and no tracker is chosen: add \
                 --report-to tensorboard,csv,jsonl (or all), or drop --logging-dir"
            );
        }
        Ok(())
    }

    /// Optimizer steps between loss reports: --logging-steps, else --log-every (default 1).
    pub fn logging_steps(&self) -> u64 {
        self.logging_steps.unwrap_or(self.log_every)
    }

    /// The trackers --report-to chose (none by default).
    pub fn trackers(&self) -> Vec<TrackerKind> {
        self.report_to
            .as_ref()
            .map_or_else(Vec::new, |r| r.0.clone())
    }

    /// The share of the data held out for evaluation: --eval-fraction, else
    /// [`DEFAULT_EVAL_FRACTION`] with --eval-steps, else 0.
    pub fn eval_fraction(&self) -> f64 {
        self.eval_fraction.unwrap_or(if self.eval_steps.is_some() {
            DEFAULT_EVAL_FRACTION
        } else {
            0.0
        })
    }

    /// Whether the evaluation is due after optimizer step `step` (a multiple of --eval-steps).
    pub fn eval_due(&self, step: u64) -> bool {
        self.eval_steps
            .is_some_and(|every| step.is_multiple_of(every))
    }

    /// The accelerator these flags ask for, seeded with `seed`.
    pub fn accelerator(&self, seed: u64) -> Result<Accelerator> {
        let mut builder = Accelerator::builder().seed(seed);
        if let Some(k) = self.grad_accum {
            builder = builder.gradient_accumulation_steps(k);
        }
        if let Some(mode) = self.mixed_precision {
            builder = builder.mixed_precision(mode);
        }
        if let Some(stage) = self.zero_stage {
            builder = builder.zero_stage(stage);
        }
        builder = builder.report_to(self.trackers());
        if let Some(dir) = &self.logging_dir {
            builder = builder.logging_dir(dir);
        }
        Ok(builder.build()?)
    }

    /// Optimizer steps of the whole run, given `per_epoch` optimizer steps in one pass over the
    /// data: --max-steps when given, whatever `epochs` says (transformers' `max_steps` overrides
    /// its epochs), else those of `epochs` passes.
    pub fn total_steps(&self, per_epoch: u64, epochs: usize) -> u64 {
        accelerate_trainer::run_steps(self.max_steps, epochs as f64, per_epoch)
    }

    /// The schedule of --schedule and --warmup-steps over a run of `total_steps` optimizer steps.
    pub fn schedule(&self, total_steps: u64) -> Schedule {
        let (warmup_steps, total_steps) = (self.warmup_steps, total_steps as usize);
        match self.schedule {
            ScheduleKind::Constant if warmup_steps == 0 => Schedule::Constant,
            ScheduleKind::Constant => Schedule::ConstantWithWarmup { warmup_steps },
            ScheduleKind::Linear => Schedule::LinearWarmupDecay {
                warmup_steps,
                total_steps,
            },
            ScheduleKind::Cosine => Schedule::CosineWithWarmup {
                warmup_steps,
                total_steps,
            },
        }
    }

    /// Whether the run has taken all the optimizer steps --max-steps allows.
    pub fn reached_max_steps(&self, steps: u64) -> bool {
        self.max_steps.is_some_and(|m| steps >= m)
    }

    /// Closes optimizer step `step`: saves a checkpoint when --checkpoint-every is due, and says
    /// whether the run should stop here (--max-steps reached).
    pub fn end_of_step(&self, acc: &Accelerator, step: u64) -> Result<bool> {
        if self
            .checkpoint_every
            .is_some_and(|every| step.is_multiple_of(every))
        {
            acc.save_checkpoint(&self.checkpoint_dir, self.checkpoints_keep)
                .with_context(|| format!("--checkpoint-dir {}", self.checkpoint_dir.display()))?;
        }
        Ok(self.reached_max_steps(step))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// A program that takes nothing but the shared flags.
    #[derive(Debug, Parser)]
    struct Only {
        #[command(flatten)]
        run: RunArgs,
    }

    fn parse(flags: &[&str]) -> RunArgs {
        Only::try_parse_from(std::iter::once("prog").chain(flags.iter().copied()))
            .expect("valid flags")
            .run
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let run = parse(&[]);
        assert_eq!(run.grad_accum, None);
        assert_eq!(run.max_steps, None);
        assert_eq!(run.warmup_steps, 0);
        assert_eq!(run.checkpoint_dir, PathBuf::from("checkpoints"));
        assert!(!run.resume);
        assert_eq!(run.log_every, 1);
        assert_eq!(run.zero_stage, None);
        assert_eq!(run.schedule(10), Schedule::Constant);
    }

    #[test]
    fn schedule_flags_pick_the_schedule_over_the_whole_run() {
        let warm = ["--warmup-steps", "3"];
        let with = |kind: &str| parse(&[&["--schedule", kind][..], &warm[..]].concat());
        assert_eq!(
            with("constant").schedule(40),
            Schedule::ConstantWithWarmup { warmup_steps: 3 }
        );
        assert_eq!(
            with("linear").schedule(40),
            Schedule::LinearWarmupDecay {
                warmup_steps: 3,
                total_steps: 40
            }
        );
        assert_eq!(
            with("cosine").schedule(40),
            Schedule::CosineWithWarmup {
                warmup_steps: 3,
                total_steps: 40
            }
        );
    }

    #[test]
    fn zero_checkpoint_flags_are_refused_by_name() {
        let every = parse(&["--checkpoint-every", "0"]).check().unwrap_err();
        assert!(every
            .to_string()
            .starts_with("--checkpoint-every must be at least 1"));
        let keep = parse(&["--checkpoints-keep", "0"]).check().unwrap_err();
        assert!(keep
            .to_string()
            .starts_with("--checkpoints-keep must be at least 1"));
        let log = parse(&["--log-every", "0"]).check().unwrap_err();
        assert!(log
            .to_string()
            .starts_with("--log-every must be at least 1"));
        assert!(
            parse(&["--checkpoint-every", "1", "--checkpoints-keep", "1"])
                .check()
                .is_ok()
        );
    }

    #[test]
    fn logging_and_evaluation_flags_take_hugging_face_names_and_defaults() {
        assert_eq!(parse(&[]).logging_steps(), 1);
        assert_eq!(parse(&["--logging-steps", "4"]).logging_steps(), 4);
        assert_eq!(parse(&["--log-every", "3"]).logging_steps(), 3);
        assert_eq!(parse(&[]).eval_fraction(), 0.0);
        assert_eq!(parse(&["--eval-steps", "5"]).eval_fraction(), 0.1);
        assert_eq!(
            parse(&["--eval-steps", "5", "--eval-fraction", "0.25"]).eval_fraction(),
            0.25
        );
        assert_eq!(parse(&["--eval-fraction", "0.2"]).eval_fraction(), 0.2);
        let every = parse(&["--eval-steps", "5"]);
        assert!(every.eval_due(10) && !every.eval_due(7));
        assert!(!parse(&[]).eval_due(10));
        assert!(parse(&[]).trackers().is_empty());
        assert_eq!(
            parse(&["--report-to", "csv,jsonl"]).trackers(),
            [TrackerKind::Csv, TrackerKind::Jsonl]
        );
        assert_eq!(parse(&["--report-to", "all"]).trackers(), TrackerKind::ALL);
        assert!(parse(&["--report-to", "none"]).trackers().is_empty());
    }

    #[test]
    fn zero_stage_takes_the_implemented_stages_and_refuses_others_by_name() {
        for stage in 0..=3u8 {
            let run = parse(&["--zero-stage", &stage.to_string()]);
            assert_eq!(run.zero_stage, Some(stage));
        }
        for bad in ["4", "x"] {
            let e = Only::try_parse_from(["prog", "--zero-stage", bad])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("--zero-stage") && e.contains(&format!("'{bad}'")),
                "{e}"
            );
        }
    }

    #[test]
    fn max_steps_overrides_the_epochs_as_transformers_does() {
        // One epoch of 126 steps: --max-steps 300 takes 300, over three epochs.
        assert_eq!(parse(&["--max-steps", "300"]).total_steps(126, 1), 300);
        assert_eq!(parse(&["--max-steps", "5"]).total_steps(126, 3), 5);
        assert_eq!(parse(&[]).total_steps(126, 3), 378);
    }

    #[test]
    fn max_steps_stops_at_the_limit_and_not_before() {
        let run = parse(&["--max-steps", "5"]);
        assert!(!run.reached_max_steps(4));
        assert!(run.reached_max_steps(5));
        assert!(!parse(&[]).reached_max_steps(u64::MAX));
    }
}
