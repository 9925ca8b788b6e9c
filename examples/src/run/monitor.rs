//! What a run reports as it goes: the metrics log, the progress bar, and the counts behind the
//! summary line.

use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::Path;
use std::time::Instant;

use accelerate_core::Accelerator;
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

/// Tracks a training run: the wall clock, the time of the current optimizer step's window, the
/// micro-steps and skipped steps taken, the last global loss; writes `--metrics` JSON lines and
/// draws the progress bar (main process, and the bar only on a terminal).
#[derive(Debug)]
pub struct RunMonitor {
    metrics: Option<BufWriter<File>>,
    progress: Option<ProgressBar>,
    start: Instant,
    window_start: Instant,
    micro_steps: u64,
    skipped_steps: u64,
    last_loss: f64,
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
    /// The global loss of the last optimizer step (NaN if none was taken).
    pub last_loss: f64,
}

impl RunMonitor {
    /// Starts the clock; creates the `metrics` file and a bar of `total_steps` on the main process.
    pub fn start(acc: &Accelerator, metrics: Option<&Path>, total_steps: u64) -> Result<Self> {
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
            start: Instant::now(),
            window_start: Instant::now(),
            micro_steps: 0,
            skipped_steps: 0,
            last_loss: f64::NAN,
        })
    }

    /// Counts one micro-step.
    pub fn micro_step(&mut self) {
        self.micro_steps += 1;
    }

    /// Counts the optimizer step just taken as skipped if fp16 overflow made it so (the loss scale
    /// backed off instead); call it on syncing micro-steps only.
    pub fn count_if_skipped(&mut self, acc: &Accelerator) {
        if acc.step_was_skipped() {
            self.skipped_steps += 1;
        }
    }

    /// Seconds since the current optimizer step's window began.
    pub fn window_seconds(&self) -> f64 {
        self.window_start.elapsed().as_secs_f64()
    }

    /// Records optimizer step `step` of global loss `loss`: writes `metrics` as one JSON line,
    /// shows `status` beside the bar, and starts the next step's window.
    pub fn record_step(
        &mut self,
        step: u64,
        loss: f64,
        metrics: serde_json::Value,
        status: String,
    ) -> Result<()> {
        self.last_loss = loss;
        if let Some(m) = self.metrics.as_mut() {
            writeln!(m, "{metrics}")?;
        }
        if let Some(bar) = &self.progress {
            bar.set_position(step);
            bar.set_message(status);
        }
        self.window_start = Instant::now();
        Ok(())
    }

    /// Clears the bar, flushes the metrics file and returns the run's totals.
    pub fn finish(self) -> Result<RunTotals> {
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
