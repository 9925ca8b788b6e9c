//! Logging metrics to files (Accelerate's trackers): `Accelerator::log` hands each call's metrics
//! to the trackers chosen with `report_to`, on the main process only, and `end_training` closes
//! them and draws the loss and learning-rate curves.
//!
//! Every tracker appends whole records and flushes them to the operating system before `log`
//! returns, so a crash of the process loses nothing already logged, and a failed write is cut
//! back off the file so it never ends in a partial record.
//!
//! A tracker that cannot write (a full disk) does not stop the others: every log call is handed
//! to every tracker and to the curves, and the failures are reported afterwards, as a warning
//! (the default: a multi-day run is not killed by its logs) or as an error
//! ([`TrackerErrors`]). A failed call is not to be retried: the trackers that did write it would
//! have it twice.

mod append;
mod csv_table;
mod curves;
mod event_record;
mod jsonl;
mod kind;
mod run_dir;
mod tensorboard;

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::process::ProcessState;

pub use kind::{parse_report_to, TrackerKind};

/// Hugging Face's tag of the training loss (the Trainer's `loss`, under `train/` in TensorBoard).
pub const TRAIN_LOSS: &str = "train/loss";
/// Hugging Face's tag of the learning rate.
pub const TRAIN_LEARNING_RATE: &str = "train/learning_rate";
/// Hugging Face's tag of the gradient norm before clipping.
pub const TRAIN_GRAD_NORM: &str = "train/grad_norm";
/// Hugging Face's tag of the evaluation loss.
pub const EVAL_LOSS: &str = "eval/loss";
/// Hugging Face's tag of the evaluation accuracy (from `compute_metrics`' `accuracy`).
pub const EVAL_ACCURACY: &str = "eval/accuracy";

/// Where a run that names no logging directory logs: a directory of its own,
/// `runs/<YYYYmmdd-HHMMSS>_<host>` (Hugging Face's Trainer: `<output_dir>/runs/<time>_<host>`).
pub const DEFAULT_LOGGING_DIR: &str = "runs";

/// File name of the loss and learning-rate curves drawn by `end_training`.
pub const CURVES_PNG: &str = "training_curves.png";

/// What [`Accelerator::log`](crate::Accelerator::log) and
/// [`end_training`](crate::Accelerator::end_training) do when a tracker cannot write its file.
/// Either way every other tracker and the curves still get the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TrackerErrors {
    /// Print the failure on stderr, once per tracker (naming its file and the fix), and go on:
    /// a full disk does not end the training.
    #[default]
    Warn,
    /// Return one [`Error::Tracking`] naming every tracker that failed.
    Fail,
}

/// One destination of logged metrics. A trait because there are three: JSON Lines, CSV and
/// TensorBoard event files.
trait Tracker: Send {
    /// Appends one log call's metrics (validated: distinct names, none `step`).
    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()>;
    /// Makes everything written durable (fsync); called by `end_training`.
    fn finish(&mut self) -> Result<()>;
    /// Starts the history over at `step`, the first step logged after a resume: what an earlier
    /// run logged at `step` or later is dropped (the tables) or marked to be dropped by readers
    /// (TensorBoard's `SessionLog` START).
    fn purge_from(&mut self, step: u64) -> Result<()>;
    /// The curves' series as the file holds them, a resumed run's earlier part included; `None`
    /// for a file that cannot be read back (TensorBoard's, written as f32).
    fn read_curves(&self) -> Option<Result<Curves>> {
        None
    }
}

/// The series the curves PNG draws, kept as they are logged.
#[derive(Debug, Default, Clone, PartialEq)]
struct Curves {
    train_loss: Vec<(u64, f64)>,
    eval_loss: Vec<(u64, f64)>,
    learning_rate: Vec<(u64, f64)>,
}

impl Curves {
    /// Adds the values of the curves' tags among one call's metrics.
    fn add<'a>(&mut self, step: u64, metrics: impl IntoIterator<Item = (&'a str, f64)>) {
        for (name, value) in metrics {
            let series = match name {
                TRAIN_LOSS => &mut self.train_loss,
                EVAL_LOSS => &mut self.eval_loss,
                TRAIN_LEARNING_RATE => &mut self.learning_rate,
                _ => continue,
            };
            series.push((step, value));
        }
    }

    /// Drops the points at `step` and later (a resumed run logs them again).
    fn purge_from(&mut self, step: u64) {
        for series in [
            &mut self.train_loss,
            &mut self.eval_loss,
            &mut self.learning_rate,
        ] {
            series.retain(|&(s, _)| s < step);
        }
    }
}

/// The trackers of one process: those chosen with `report_to` on the main process, none elsewhere.
pub(crate) struct Trackers {
    trackers: Vec<Box<dyn Tracker>>,
    /// Per tracker: whether its failure was already printed (warned once, not at every step).
    warned: Vec<bool>,
    on_error: TrackerErrors,
    logging_dir: Option<PathBuf>,
    /// Held from open to `end`: a second live writer of the directory is refused.
    lock: Option<run_dir::DirLock>,
    curves: Curves,
    /// Set by `load_state`: the next logged step purges the resumed run's later steps.
    purge_pending: bool,
    ended: bool,
}

impl std::fmt::Debug for Trackers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trackers")
            .field("trackers", &self.trackers.len())
            .field("logging_dir", &self.logging_dir)
            .finish_non_exhaustive()
    }
}

impl Trackers {
    /// Opens the trackers of `kinds` in `logging_dir` (created if missing) on the main process
    /// (global rank 0, not each machine's local rank 0: Accelerate's `log` writes once per job);
    /// on every other rank, nothing is opened and nothing will be written. `logging_dir`
    /// `None` makes a fresh `runs/<time>_<host>`; a directory named is continued (a resumed
    /// run appends to its files), unless another live run holds it.
    pub(crate) fn open(
        kinds: &[TrackerKind],
        logging_dir: Option<&Path>,
        state: &ProcessState,
        on_error: TrackerErrors,
    ) -> Result<Self> {
        let mut trackers: Vec<Box<dyn Tracker>> = Vec::new();
        let active = state.is_main_process() && !kinds.is_empty();
        let mut lock = None;
        let mut opened_dir = None;
        if active {
            let logging_dir = match logging_dir {
                Some(dir) => {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| io_error(dir, "creating the logging directory", e))?;
                    dir.to_path_buf()
                }
                None => run_dir::fresh_run_dir(Path::new(DEFAULT_LOGGING_DIR))?,
            };
            lock = Some(run_dir::DirLock::acquire(&logging_dir)?);
            let logging_dir = opened_dir.insert(logging_dir).as_path();
            let mut seen = Vec::new();
            for kind in kinds {
                if seen.contains(kind) {
                    continue;
                }
                seen.push(*kind);
                trackers.push(match kind {
                    TrackerKind::Jsonl => Box::new(jsonl::JsonlTracker::open(logging_dir)?),
                    TrackerKind::Csv => Box::new(csv_table::CsvTracker::open(logging_dir)?),
                    TrackerKind::TensorBoard => {
                        Box::new(tensorboard::TensorBoardTracker::create(logging_dir)?)
                    }
                });
            }
        }
        Ok(Self {
            warned: vec![false; trackers.len()],
            trackers,
            on_error,
            logging_dir: opened_dir,
            lock,
            curves: Curves::default(),
            purge_pending: false,
            ended: false,
        })
    }

    /// Hands one log call to every tracker, after checking the names (on every rank, so a bad
    /// name fails alike everywhere).
    pub(crate) fn log(&mut self, step: u64, metrics: Vec<(String, f64)>) -> Result<()> {
        validate_names(&metrics)?;
        if self.ended {
            return Err(Error::Config(
                "log was called after end_training, which closed the trackers; log before \
                 ending the training"
                    .into(),
            ));
        }
        if self.trackers.is_empty() {
            return Ok(());
        }
        let purge = std::mem::take(&mut self.purge_pending);
        if purge {
            self.curves.purge_from(step);
        }
        let results: Vec<Result<()>> = self
            .trackers
            .iter_mut()
            .map(|tracker| {
                let purged = if purge {
                    tracker.purge_from(step)
                } else {
                    Ok(())
                };
                // Logged even when the purge failed: the step itself is not lost.
                let logged = tracker.log(step, &metrics);
                purged.and(logged)
            })
            .collect();
        self.curves
            .add(step, metrics.iter().map(|(n, v)| (n.as_str(), *v)));
        self.report(results, &format!("logging step {step}"))
    }

    /// Applies the [`TrackerErrors`] policy to one result per tracker.
    fn report(&mut self, results: Vec<Result<()>>, action: &str) -> Result<()> {
        let mut failures = Vec::new();
        for (i, result) in results.into_iter().enumerate() {
            let Err(e) = result else { continue };
            match self.on_error {
                TrackerErrors::Warn => {
                    if !std::mem::replace(&mut self.warned[i], true) {
                        eprintln!(
                            "warning: {e} (while {action}; the other trackers go on, and \
                             further failures of this file are not printed; \
                             `tracker_errors(TrackerErrors::Fail)` makes this an error)"
                        );
                    }
                }
                TrackerErrors::Fail => failures.push(e.to_string()),
            }
        }
        if failures.is_empty() {
            return Ok(());
        }
        Err(Error::Tracking {
            path: self.logging_dir.clone().unwrap_or_default(),
            problem: format!(
                "{} of {} trackers failed while {action} (the others wrote it; do not retry \
                 the call, they would have it twice): {}",
                failures.len(),
                self.trackers.len(),
                failures.join("; ")
            ),
        })
    }

    /// Makes every tracker's file durable and draws the curves PNG (when something was logged
    /// to draw). A second call does nothing.
    pub(crate) fn end(&mut self) -> Result<()> {
        if self.ended {
            return Ok(());
        }
        self.ended = true;
        // The files are complete after this: another run may continue them.
        let _unlock = self.lock.take();
        let results: Vec<Result<()>> = self
            .trackers
            .iter_mut()
            .map(|tracker| tracker.finish())
            .collect();
        // The curves are drawn whatever the trackers' fate, and their failure is reported first.
        let drawn = self.draw_curves();
        let finished = self.report(results, "syncing the files at end_training");
        drawn.and(finished)
    }

    /// A resumed run (`load_state`): the next logged step starts the history over from there,
    /// as PyTorch's `SummaryWriter(purge_step=)`. The tables drop the earlier run's rows at and
    /// after that step rather than keeping them, so that all three files hold one timeline, as
    /// TensorBoard shows it, and `pd.read_csv` gets each step once.
    pub(crate) fn resumed(&mut self) {
        self.purge_pending = true;
    }

    /// The series the curves PNG draws: read back from `metrics.jsonl` or `metrics.csv` when
    /// one is kept, so that a resumed run's curves start at its first step; otherwise (only
    /// `tensorboard`) what this process logged.
    fn final_curves(&self) -> Curves {
        self.trackers
            .iter()
            .find_map(|tracker| tracker.read_curves().and_then(Result::ok))
            .unwrap_or_else(|| self.curves.clone())
    }

    /// Draws the curves PNG when something was logged to draw.
    fn draw_curves(&self) -> Result<()> {
        let Some(dir) = &self.logging_dir else {
            return Ok(());
        };
        let c = &self.final_curves();
        if c.train_loss.is_empty() && c.eval_loss.is_empty() && c.learning_rate.is_empty() {
            return Ok(());
        }
        curves::draw_png(
            &dir.join(CURVES_PNG),
            &c.train_loss,
            &c.eval_loss,
            &c.learning_rate,
        )
    }

    /// Where this process writes, if it writes at all.
    pub(crate) fn logging_dir(&self) -> Option<&Path> {
        self.logging_dir.as_deref()
    }
}

impl Drop for Trackers {
    /// Says so when the accelerator goes without `end_training`: the files hold every call, but
    /// are not synced to disk and the curves are not drawn.
    fn drop(&mut self) {
        if self.ended || self.trackers.is_empty() || std::thread::panicking() {
            return;
        }
        if let Some(dir) = &self.logging_dir {
            eprintln!(
                "warning: the trackers writing to {} were dropped without end_training: what was \
                 logged is in the files, but not synced to disk, and {CURVES_PNG} is not drawn; \
                 call `end_training()` after the loop",
                dir.display()
            );
        }
    }
}

/// Names must be distinct, not `step` (the column and key the step takes), and printable.
fn validate_names(metrics: &[(String, f64)]) -> Result<()> {
    for (i, (name, _)) in metrics.iter().enumerate() {
        if name.is_empty() || name == "step" || name.chars().any(char::is_control) {
            return Err(Error::Config(format!(
                "metric name {name:?} cannot be logged: names must be non-empty, printable and \
                 not \"step\" (the step is log's own argument); use e.g. \"train/loss\""
            )));
        }
        if metrics[..i].iter().any(|(other, _)| other == name) {
            return Err(Error::Config(format!(
                "metric {name:?} appears twice in one log call; log each name once per call"
            )));
        }
    }
    Ok(())
}

/// A tracker's I/O failure, naming the file and the way out.
fn io_error(path: &Path, action: &str, source: std::io::Error) -> Error {
    Error::Tracking {
        path: path.to_path_buf(),
        problem: format!(
            "{action} failed: {source}; check that the logging directory is writable and has \
             free space, or choose another with `logging_dir` (or leave it out of `report_to`)"
        ),
    }
}

#[cfg(test)]
mod tests;
