//! The training-run scaffolding the example programs share: the flags every run takes
//! ([`RunArgs`]), resuming from the latest checkpoint, the per-step metrics log, trackers and
//! progress bar ([`RunMonitor`]), the held-out evaluation split ([`hold_out`]) and its evaluation
//! ([`Evaluator`]), periodic checkpoints, and writing the trained weights.
//!
//! Each example keeps what is its own (its model, data, loss and summary line); what is here is
//! the part that must behave the same in all of them, so that tests and users can rely on one set
//! of flags and messages.

mod evaluate;
mod flags;
mod model_file;
mod monitor;
mod optimizer;
mod resume;
mod split;

pub use evaluate::{
    correct_predictions, gathered_sums, per_row_cross_entropy, sample_rows, EvalResult, Evaluator,
};
pub use flags::{ReportTo, RunArgs, ScheduleKind, DEFAULT_EVAL_FRACTION};
pub use model_file::save_model;
pub use monitor::{peak_resident_mib, RunMonitor, RunTotals, StepCounts};
pub use optimizer::{OptimizerFlags, OptimizerKind};
pub use split::{hold_out, split_indices, Subset};

use accelerate_core::optim::Optimizer;
use accelerate_core::{Accelerator, PreparedOptimizer, PreparedScheduler};
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

/// Steps the optimizer and the scheduler and clears the gradients (all three do nothing on
/// micro-steps that do not sync); returns the learning rate the step used, read before the
/// scheduler moves it.
pub fn step_optimizer<O: Optimizer>(
    opt: &mut PreparedOptimizer<O>,
    sched: &mut PreparedScheduler,
) -> Result<f64> {
    let lr = opt.learning_rate();
    opt.step()?;
    sched.step();
    opt.zero_grad();
    Ok(lr)
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
