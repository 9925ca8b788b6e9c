//! The progress bar of a Trainer run: on the main process, over optimizer steps, with the latest
//! training loss and evaluation results as its message.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::model::Metrics;

/// A bar over the run's optimizer steps; hidden on other ranks, under `disable_tqdm`, and when
/// stderr is not a terminal (indicatif draws nothing there).
pub struct Progress {
    bar: ProgressBar,
    train: String,
    eval: String,
}

impl Progress {
    /// A bar of `total` steps at `position`, shown when `visible`.
    pub fn new(total: u64, position: u64, visible: bool) -> Self {
        let target = if visible {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(total), target);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed}<{eta}] {msg}")
                .expect("a valid progress template"),
        );
        bar.set_position(position);
        Self {
            bar,
            train: String::new(),
            eval: String::new(),
        }
    }

    /// One optimizer step done.
    pub fn step(&self) {
        self.bar.inc(1);
    }

    /// Shows the latest logged training loss.
    pub fn train_loss(&mut self, loss: f64) {
        self.train = format!("loss={loss:.4}");
        self.refresh();
    }

    /// Shows the latest evaluation's metrics.
    pub fn evaluation(&mut self, metrics: &Metrics) {
        self.eval = metrics
            .iter()
            .map(|(k, v)| format!("{k}={v:.4}"))
            .collect::<Vec<_>>()
            .join(" ");
        self.refresh();
    }

    fn refresh(&self) {
        self.bar
            .set_message(format!("{} {}", self.train, self.eval).trim().to_string());
    }

    /// Leaves the bar as it is.
    pub fn finish(&self) {
        self.bar.abandon();
    }
}
