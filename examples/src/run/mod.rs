//! The training-run scaffolding the example programs share: the flags every run takes
//! ([`RunArgs`]), resuming from the latest checkpoint, the per-step metrics log, trackers and
//! progress bar ([`RunMonitor`]), the held-out evaluation split ([`hold_out`]) and its evaluation
//! ([`Evaluator`]), periodic checkpoints, writing the trained weights, and the training loop that
//! runs them all ([`TrainLoop`]).
//!
//! Each example keeps what is its own (its model, data and loss); what is here is the part that
//! must behave the same in all of them, so that tests and users can rely on one set of flags and
//! messages.

mod evaluate;
mod flags;
mod model_file;
mod monitor;
mod optimizer;
mod resume;
mod split;
mod train;
mod units;

pub use evaluate::{
    correct_predictions, gathered_sums, per_row_cross_entropy, sample_rows, EvalResult, Evaluator,
};
pub use flags::{ReportTo, RunArgs, ScheduleKind, DEFAULT_EVAL_FRACTION};
pub use model_file::{parameter_tensors, save_model};
pub use monitor::{peak_resident_mib, RunMonitor, RunTotals, StepCounts};
pub use optimizer::{OptimizerArgs, OptimizerKind};
pub use split::{hold_out, split_indices, Subset};
pub use train::{AfterResumeFn, BatchCounts, SummaryFields, TrainLoop};
pub use units::check_wrap_classes;

use accelerate_core::Accelerator;
use anyhow::Result;

/// Ends the process with status 1 and the error's whole chain on stderr when `result` failed.
///
/// Examples print `error: <cause>: <cause>...` themselves rather than returning the error from
/// `main`, whose `Debug` output would be harder to read.
pub fn exit_on_error(result: Result<()>) {
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Prints the line that opens training on the main process: `data` (empty, or e.g.
/// `"16384 samples, "`) is printed right after `training: `. It ends with `zero_stage=N`, the
/// stage in force whether it came from `--zero-stage` or the launcher's environment.
pub fn announce_training(acc: &Accelerator, data: &str, batch_size: usize, total_steps: u64) {
    acc.print(format!(
        "training: {data}{} process(es), batch {batch_size} x {} micro-steps per rank, \
         {total_steps} optimizer steps, on {:?}, zero_stage={}",
        acc.num_processes(),
        acc.gradient_accumulation_steps(),
        acc.device().location(),
        acc.zero_stage()
    ));
}
