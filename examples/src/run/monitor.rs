//! What a run reports as it goes: the metrics log, the trackers of `--report-to`, the progress
//! bar, and the counts behind the summary line, read from the device only every
//! `--logging-steps` steps.

use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::Path;
use std::time::Instant;

use accelerate_core::{Accelerator, ReduceOp, TRAIN_GRAD_NORM, TRAIN_LEARNING_RATE, TRAIN_LOSS};
use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use indicatif::{ProgressBar, ProgressStyle};

/// Tracks a training run: the wall clock, the losses and counts since the last report, the
/// micro-steps and skipped steps taken; every `--logging-steps` optimizer steps it reduces the
/// loss over all ranks, writes a `--metrics` JSON line, logs `train/loss`, `train/learning_rate`
/// and `train/grad_norm` (when clipping computed it) with `Accelerator::log`, and updates the
/// progress bar (main process, and the bar only on a terminal).
///
/// The loss stays on the model's device between reports: adding it there is asynchronous, so a
/// step on a GPU never waits for the host, and only a report reads a number back.
#[derive(Debug)]
pub struct RunMonitor {
    metrics: Option<BufWriter<File>>,
    progress: Option<ProgressBar>,
    log_every: u64,
    start: Instant,
    interval_start: Instant,
    /// This rank's summed loss terms since the last report, in f64 on the model's device.
    interval_loss: Option<Tensor>,
    interval_counts: StepCounts,
    last_lr: f64,
    /// The gradient norm of the latest step that computed one since the last report.
    last_grad_norm: Option<f64>,
    micro_steps: u64,
    skipped_steps: u64,
    last_loss: f64,
    samples: f64,
    tokens: f64,
}

/// What one rank's optimizer step covered, counted on the host.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepCounts {
    /// What the summed loss terms are divided by to give the reported loss: tokens for a
    /// token-summed loss, 1 per step for a loss already averaged over the step.
    pub items: f64,
    /// Samples (rows) trained on.
    pub samples: f64,
    /// Tokens read, for tokens/s (0 for a model that reads no tokens).
    pub tokens: f64,
}

/// What a finished run took, for its summary line.
#[derive(Debug, Clone, Copy)]
pub struct RunTotals {
    /// Seconds from the start of training to the end of the last step.
    pub wall: f64,
    /// Micro-steps (forward and backward passes) taken on this rank.
    pub micro_steps: u64,
    /// Optimizer steps skipped because fp16 gradients overflowed.
    pub skipped_steps: u64,
    /// The global loss of the last report (NaN if no step was taken).
    pub last_loss: f64,
    /// Samples trained on over all ranks.
    pub samples: f64,
    /// Tokens read over all ranks.
    pub tokens: f64,
}

impl RunMonitor {
    /// Starts the clock; creates the `metrics` file and a bar of `total_steps` on the main
    /// process; reports every `log_every` optimizer steps (at least 1).
    pub fn start(
        acc: &Accelerator,
        metrics: Option<&Path>,
        total_steps: u64,
        log_every: u64,
    ) -> Result<Self> {
        let metrics = match metrics {
            Some(p) if acc.is_main_process() => Some(BufWriter::new(
                File::create(p).with_context(|| format!("--metrics {}", p.display()))?,
            )),
            _ => None,
        };
        let progress = (acc.is_main_process() && std::io::stderr().is_terminal())
            .then(|| progress_bar(total_steps));
        Ok(Self {
            metrics,
            progress,
            log_every: log_every.max(1),
            start: Instant::now(),
            interval_start: Instant::now(),
            interval_loss: None,
            interval_counts: StepCounts::default(),
            last_lr: f64::NAN,
            last_grad_norm: None,
            micro_steps: 0,
            skipped_steps: 0,
            last_loss: f64::NAN,
            samples: 0.0,
            tokens: 0.0,
        })
    }

    /// Counts one micro-step and adds its loss term (a scalar on the model's device, already
    /// weighted as the report should sum it) without reading it back.
    pub fn micro_step(&mut self, loss_term: &Tensor) -> Result<()> {
        self.micro_steps += 1;
        let term = loss_term.detach().to_dtype(DType::F64)?;
        self.interval_loss = Some(match self.interval_loss.take() {
            Some(sum) => (sum + term)?,
            None => term,
        });
        Ok(())
    }

    /// Records the gradient norm before clipping of a step that clipped, if any: the
    /// next report logs the latest as `train/grad_norm` (Hugging Face's Trainer logs the norm of
    /// the step it reports at).
    pub fn grad_norm(&mut self, norm: Option<f64>) {
        if norm.is_some() {
            self.last_grad_norm = norm;
        }
    }

    /// Closes optimizer step `step` (call it on syncing micro-steps only), which used learning
    /// rate `lr` and covered `counts` on this rank. Counts it as skipped if fp16 overflow made it
    /// so, and reports when `step` is a multiple of `--logging-steps`. Collective when it reports:
    /// every rank calls it for every step.
    pub fn end_step(
        &mut self,
        acc: &Accelerator,
        step: u64,
        lr: f64,
        counts: StepCounts,
    ) -> Result<()> {
        if acc.step_was_skipped() {
            self.skipped_steps += 1;
        }
        self.last_lr = lr;
        let c = &mut self.interval_counts;
        c.items += counts.items;
        c.samples += counts.samples;
        c.tokens += counts.tokens;
        if step.is_multiple_of(self.log_every) {
            self.report(acc, step)?;
        }
        Ok(())
    }

    /// Reports the steps since the last report: one all-reduce of the loss and counts, the only
    /// place the loss is read back to the host.
    fn report(&mut self, acc: &Accelerator, step: u64) -> Result<()> {
        let Some(loss) = self.interval_loss.take() else {
            return Ok(());
        };
        let c = std::mem::take(&mut self.interval_counts);
        let counts = Tensor::new(&[c.items, c.samples, c.tokens], loss.device())?;
        let local = Tensor::cat(&[&loss.reshape(1)?, &counts], 0)?;
        let global = acc.reduce(&local, ReduceOp::Sum)?.to_vec1::<f64>()?;
        let (loss, samples, tokens) = (global[0] / global[1], global[2], global[3]);
        let seconds = self.interval_start.elapsed().as_secs_f64();
        self.last_loss = loss;
        self.samples += samples;
        self.tokens += tokens;
        let mut line = serde_json::json!({"step": step, "loss": loss, "lr": self.last_lr,
            "samples": samples, "samples_per_s": samples / seconds});
        let status = if tokens > 0.0 {
            line["tokens"] = tokens.into();
            line["tokens_per_s"] = (tokens / seconds).into();
            format!("loss {loss:.4}  {:.0} tokens/s", tokens / seconds)
        } else {
            format!("loss {loss:.4}  {:.0} samples/s", samples / seconds)
        };
        if let Some(m) = self.metrics.as_mut() {
            writeln!(m, "{line}")?;
        }
        let mut logged = vec![(TRAIN_LOSS, loss), (TRAIN_LEARNING_RATE, self.last_lr)];
        if let Some(norm) = self.last_grad_norm.take() {
            logged.push((TRAIN_GRAD_NORM, norm));
        }
        acc.log(logged, step)?;
        if let Some(bar) = &self.progress {
            bar.set_position(step);
            bar.set_message(status);
        }
        self.interval_start = Instant::now();
        Ok(())
    }

    /// Reports the steps since the last report (collective: every rank calls it), clears the
    /// bar, flushes the metrics file and returns the run's totals.
    pub fn finish(mut self, acc: &Accelerator) -> Result<RunTotals> {
        self.report(acc, acc.optimizer_steps())?;
        if let Some(bar) = self.progress {
            bar.finish_and_clear();
        }
        if let Some(mut m) = self.metrics {
            m.flush()?;
        }
        Ok(RunTotals {
            wall: self.start.elapsed().as_secs_f64(),
            micro_steps: self.micro_steps,
            skipped_steps: self.skipped_steps,
            last_loss: self.last_loss,
            samples: self.samples,
            tokens: self.tokens,
        })
    }
}

/// A bar of `total_steps` optimizer steps with the loss and throughput beside it.
fn progress_bar(total_steps: u64) -> ProgressBar {
    let bar = ProgressBar::new(total_steps);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise}<{eta_precise}]",
        )
        .expect("static template"),
    );
    bar
}

/// The largest peak resident set (`VmHWM` of `/proc/self/status`) of any rank so far, in MiB
/// (0 where the kernel does not report it). A collective: every rank calls it.
pub fn peak_resident_mib(acc: &Accelerator) -> Result<f64> {
    let kib = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .unwrap_or(0.0);
    let peak = acc.reduce(&Tensor::new(&[kib], acc.device())?, ReduceOp::Max)?;
    Ok(peak.to_dtype(DType::F64)?.to_vec1::<f64>()?[0] / 1024.0)
}
