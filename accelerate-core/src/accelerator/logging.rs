//! `log` and `end_training`: the accelerator's side of the trackers (see [`crate::tracking`]).

use std::path::Path;

use super::Accelerator;
use crate::error::Result;

impl Accelerator {
    /// Logs `metrics` (name → value) at `step` to the trackers chosen with
    /// [`report_to`](crate::AcceleratorBuilder::report_to), from the main process only, as
    /// Accelerate's `log`: on every other rank it checks the names and writes nothing. Names are
    /// free; Hugging Face's are [`TRAIN_LOSS`](crate::TRAIN_LOSS),
    /// [`TRAIN_LEARNING_RATE`](crate::TRAIN_LEARNING_RATE),
    /// [`TRAIN_GRAD_NORM`](crate::TRAIN_GRAD_NORM) and [`EVAL_LOSS`](crate::EVAL_LOSS).
    ///
    /// ```
    /// # fn main() -> accelerate_core::Result<()> {
    /// # let acc = accelerate_core::Accelerator::new()?;
    /// use accelerate_core::{TRAIN_LEARNING_RATE, TRAIN_LOSS};
    /// acc.log([(TRAIN_LOSS, 2.31), (TRAIN_LEARNING_RATE, 3e-4)], 10)?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Every tracker has the call on disk (handed to the operating system) when it returns. A
    /// tracker that cannot write does not keep the call from the others; its failure is printed
    /// or returned as [`tracker_errors`](crate::AcceleratorBuilder::tracker_errors) says. A
    /// name that is empty, `step`, holds a control character or appears twice in one call is an
    /// error; so is a call after [`end_training`](Self::end_training).
    pub fn log<N: Into<String>>(
        &self,
        metrics: impl IntoIterator<Item = (N, f64)>,
        step: u64,
    ) -> Result<()> {
        let metrics = metrics.into_iter().map(|(n, v)| (n.into(), v)).collect();
        self.trackers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .log(step, metrics)
    }

    /// Ends the training's logging (Accelerate's `end_training`): syncs every tracker's file to
    /// disk, closes the trackers and, on the main process, draws the loss and learning-rate
    /// curves logged under [`TRAIN_LOSS`](crate::TRAIN_LOSS), [`EVAL_LOSS`](crate::EVAL_LOSS)
    /// and [`TRAIN_LEARNING_RATE`](crate::TRAIN_LEARNING_RATE) to
    /// `<logging_dir>/`[`CURVES_PNG`](crate::CURVES_PNG). Call it once, after the loop; a second
    /// call does nothing.
    pub fn end_training(&self) -> Result<()> {
        self.trackers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .end()
    }

    /// After `load_state`: the next logged step purges the later steps of the run resumed.
    pub(super) fn resumed_logging(&self) {
        self.trackers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .resumed();
    }

    /// The directory this process's trackers write to: `Some` on the main process when
    /// [`report_to`](crate::AcceleratorBuilder::report_to) chose any, `None` elsewhere.
    pub fn logging_dir(&self) -> Option<std::path::PathBuf> {
        self.trackers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .logging_dir()
            .map(Path::to_path_buf)
    }
}
