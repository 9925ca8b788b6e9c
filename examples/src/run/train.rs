//! The training loop every example runs: resume, the monitor, accumulation windows, the
//! optimizer and scheduler steps, evaluation, checkpoints, and the summary line, written once.
//! An example gives its model's loss as a closure and says what each batch counts.
//!
//! `--max-steps` means what transformers' `max_steps` means: it overrides `--epochs`, and the run
//! goes through as many epochs as its steps take.

use std::path::Path;

use accelerate_core::data::{DataLoader, Dataset};
use accelerate_core::optim::{LrScheduler, Optimizer};
use accelerate_core::Accelerator;
use accelerate_trainer::micro_step;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

use super::{Evaluator, RunArgs, RunMonitor, RunTotals, StepCounts};

/// What one batch holds, counted on the host before its window's first backward pass.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchCounts {
    /// Rows (samples) of the batch.
    pub samples: usize,
    /// For a loss summed over items (tokens), their number: the window is then item-weighted
    /// (`set_window_items`) and the reported loss is per item. `None` for a loss that is already
    /// the batch's mean.
    pub items: Option<usize>,
    /// Tokens read, for tokens/s (0 for a model that reads no tokens).
    pub tokens: usize,
}

/// Which fields the summary line carries beyond those every example prints.
#[derive(Debug, Clone, Default)]
pub struct SummaryFields {
    /// `tokens/s`, after `samples/s` (language models).
    pub tokens_per_s: bool,
    /// The example's own fields after `final_loss` (with their leading space), e.g.
    /// `" unigram_entropy=2.9"`.
    pub after_loss: String,
    /// The gradient sync's detail: `buckets`, `grad_bytes`, `overlap`, `transport`.
    pub gradient_sync: bool,
    /// `zero_stage` and `peak_rss_mib` (the largest peak resident set of any rank).
    pub memory: bool,
}

/// The loss of one micro-batch: the mean over its rows, or with [`BatchCounts::items`] the sum
/// over its items.
type LossFn<'a, B> = dyn FnMut(&Accelerator, &B) -> Result<Tensor> + 'a;
/// One evaluation row per sample of a batch (see [`Evaluator::evaluate`]).
type EvalRowsFn<'a, B> = dyn FnMut(B) -> Result<Tensor> + 'a;
/// A check on every rank once `--resume` has loaded its checkpoint (or found none).
pub type AfterResumeFn<'a> = dyn FnOnce(&Accelerator) -> Result<()> + 'a;

/// One training run of an example over batches of type `B`: build it with [`new`](Self::new),
/// set the public fields that differ from their defaults, then [`run`](Self::run) it.
pub struct TrainLoop<'a, B> {
    args: &'a RunArgs,
    epochs: usize,
    batch_size: usize,
    loss: Box<LossFn<'a, B>>,
    counts: Box<dyn Fn(&B) -> BatchCounts + 'a>,
    eval_rows: Box<EvalRowsFn<'a, B>>,
    /// Where one JSON line per optimizer step goes (--metrics); none by default.
    pub metrics: Option<&'a Path>,
    /// What the opening line says of the data right after `training: `, e.g.
    /// `"16384 samples, "`; empty by default.
    pub data: String,
    /// A check run on every rank once --resume has loaded its checkpoint (or found none),
    /// before the first step: an error ends the run.
    pub after_resume: Option<Box<AfterResumeFn<'a>>>,
    /// Where the trained weights go (--save-model), written before the summary line.
    pub save_model: Option<&'a Path>,
    /// The summary line's fields beyond the common ones.
    pub summary: SummaryFields,
}

impl<'a, B> TrainLoop<'a, B> {
    /// A run of `epochs` passes (unless --max-steps) over micro-batches of `batch_size` with the
    /// shared flags `args`: `loss` is a micro-batch's loss (see [`BatchCounts::items`] for which),
    /// `counts` what a batch holds, `eval_rows` one evaluation row per sample.
    pub fn new(
        args: &'a RunArgs,
        epochs: usize,
        batch_size: usize,
        loss: impl FnMut(&Accelerator, &B) -> Result<Tensor> + 'a,
        counts: impl Fn(&B) -> BatchCounts + 'a,
        eval_rows: impl FnMut(B) -> Result<Tensor> + 'a,
    ) -> Self {
        Self {
            args,
            epochs,
            batch_size,
            loss: Box::new(loss),
            counts: Box::new(counts),
            eval_rows: Box::new(eval_rows),
            metrics: None,
            data: String::new(),
            after_resume: None,
            save_model: None,
            summary: SummaryFields::default(),
        }
    }

    /// Trains with `opt` (prepared here, after `loader` and `evaluator`, which `acc` prepared)
    /// under the schedule of the flags; evaluates every --eval-steps and at the end, saves
    /// checkpoints every --checkpoint-every, and prints the summary line.
    pub fn run<D, E>(
        mut self,
        acc: &mut Accelerator,
        mut loader: DataLoader<D>,
        mut evaluator: Evaluator<E>,
        opt: Box<dyn Optimizer + Send>,
    ) -> Result<()>
    where
        D: Dataset<Batch = B>,
        E: Dataset<Batch = B>,
    {
        let args = self.args;
        let per_epoch = acc.num_update_steps(loader.len()) as u64;
        let total_steps = args.total_steps(per_epoch, self.epochs);
        // --max-steps overrides --epochs: as many epochs as its steps take.
        let last_epoch = match args.max_steps {
            Some(_) => u64::MAX,
            None => self.epochs as u64,
        };
        let mut opt = acc.prepare_optimizer(opt)?;
        let schedule = args.schedule(total_steps);
        let mut sched = acc.prepare(LrScheduler::new(opt.learning_rate_handle(), schedule)?)?;
        args.resume_if_asked(acc, &loader)?;
        if let Some(check) = self.after_resume.take() {
            check(acc)?;
        }
        if per_epoch == 0 && total_steps > acc.optimizer_steps() {
            bail!(
                "--max-steps {total_steps}: the training data gives this rank no batch, so no \
                 step can be taken; give more data, or fewer processes"
            );
        }
        let mut monitor = RunMonitor::start(acc, self.metrics, total_steps, args.logging_steps())?;
        super::announce_training(acc, &self.data, self.batch_size, total_steps);

        let acc = &*acc;
        let k = acc.gradient_accumulation_steps();
        // Windows that synced, stepped or skipped (fp16 overflow), as transformers' global_step
        // counts them: --max-steps, --eval-steps and --checkpoint-every count these, so a run
        // whose steps keep overflowing still ends.
        let mut windows = acc.optimizer_steps();
        'epochs: for _epoch in loader.next_epoch()..last_epoch {
            if args.reached_max_steps(windows) {
                break;
            }
            for window in loader.windows(k) {
                let window = window?;
                let counts: Vec<BatchCounts> = window.iter().map(&self.counts).collect();
                // This rank's items in the whole window, before its first backward pass.
                let items: Option<usize> = counts.iter().map(|c| c.items).sum();
                if let Some(items) = items {
                    acc.set_window_items(items)?;
                }
                let (mut samples, mut tokens) = (0, 0);
                for (batch, count) in window.iter().zip(&counts) {
                    let loss = &mut self.loss;
                    let done = micro_step(acc, &mut opt, &mut sched, args.max_grad_norm, || {
                        loss(acc, batch)
                    })?;
                    // The loss term the report sums: a summed loss as it is (divided by the
                    // items), a mean scaled by the window's share (one item per rank and step).
                    match items {
                        Some(_) => monitor.micro_step(&done.loss)?,
                        None => monitor.micro_step(
                            &(done.loss.to_dtype(DType::F64)? * done.step.loss_scale)?,
                        )?,
                    }
                    samples += count.samples;
                    tokens += count.tokens;
                    monitor.grad_norm(done.grad_norm);
                    if !done.step.sync {
                        continue;
                    }
                    // The loss of the whole global batch: every rank's window.
                    let n = acc.optimizer_steps();
                    let counts = StepCounts {
                        items: items.map_or(1.0, |n| n as f64),
                        samples: samples as f64,
                        tokens: tokens as f64,
                    };
                    monitor.end_step(acc, n, done.lr, counts)?;
                    windows += 1;
                    if args.eval_due(windows) {
                        evaluator.evaluate(acc, n, &mut self.eval_rows)?;
                    }
                    if args.end_of_step(acc, windows)? {
                        break 'epochs;
                    }
                }
            }
        }
        let totals = monitor.finish(acc)?;
        evaluator.at_end(acc, acc.optimizer_steps(), &mut self.eval_rows)?;
        acc.end_training()?;
        // Before save_model, which only some ranks may be asked for: every rank takes part.
        let peak_rss_mib = match self.summary.memory {
            true => Some(super::peak_resident_mib(acc)?),
            false => None,
        };
        super::save_model(acc, self.save_model)?;
        acc.print(summary_line(
            acc,
            &totals,
            &self.summary,
            peak_rss_mib,
            &evaluator.summary_fields(),
        ));
        Ok(())
    }
}

/// The line that closes a run: throughput, the last reported loss, the step counts, the sync and
/// precision in force, `fields`' optional ones, and the evaluation's (`eval`).
fn summary_line(
    acc: &Accelerator,
    totals: &RunTotals,
    fields: &SummaryFields,
    peak_rss_mib: Option<f64>,
    eval: &str,
) -> String {
    let wall = totals.wall;
    let sync = acc.gradient_sync_stats();
    let mut line = format!("samples/s={:.1}", totals.samples / wall);
    let mut add = |piece: String| {
        line.push(' ');
        line.push_str(&piece);
    };
    if fields.tokens_per_s {
        add(format!("tokens/s={:.0}", totals.tokens / wall));
    }
    add(format!(
        "final_loss={:.6}{}",
        totals.last_loss, fields.after_loss
    ));
    add(format!("wall={wall:.2}s"));
    add(format!("steps={}", acc.optimizer_steps()));
    add(format!("micro_steps={}", totals.micro_steps));
    if fields.gradient_sync {
        add(format!("buckets={}", acc.model().gradient_buckets()));
    }
    add(format!("grad_all_reduces={}", sync.all_reduces));
    if fields.gradient_sync {
        add(format!("grad_bytes={}", sync.bytes));
    }
    add(format!("mixed_precision={}", acc.mixed_precision()));
    add(format!("skipped_steps={}", totals.skipped_steps));
    if fields.gradient_sync {
        add(format!(
            "overlap={}",
            u8::from(acc.overlaps_gradient_reduction())
        ));
    }
    if fields.memory {
        add(format!("zero_stage={}", acc.zero_stage()));
    }
    if fields.gradient_sync {
        add(format!("transport={}", acc.transport_name()));
    }
    if let Some(peak) = peak_rss_mib {
        add(format!("peak_rss_mib={peak:.0}"));
    }
    line + eval
}
