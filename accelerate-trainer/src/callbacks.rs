//! [`TrainerCallback`]: hooks into the training loop, and [`EarlyStoppingCallback`].

use crate::args::{IntervalStrategy, TrainingArguments};
use crate::control::TrainerControl;
use crate::error::{Error, Result};
use crate::model::Metrics;
use crate::state::TrainerState;

/// Hooks the [`Trainer`](crate::Trainer) calls on every rank during training, as Hugging Face's
/// `TrainerCallback`. Each gets the arguments, the state, and the [`TrainerControl`] through
/// which it can ask the loop to stop, log, evaluate or save. Every hook does nothing by default.
///
/// A request made on any rank holds on all of them (the Trainer agrees on the requests across
/// ranks before acting), so a callback may decide from something only its own process sees, and
/// a program may add callbacks on the main process only; side effects (printing, writing a
/// file) belong on the rank where [`TrainerState::is_world_process_zero`] is true. A request
/// acts at the next point of the step that reads it: `should_log` from `on_step_end`;
/// `should_evaluate` from `on_step_end` or `on_log`; `should_save` from those or `on_evaluate`;
/// `should_training_stop` from any hook.
pub trait TrainerCallback {
    /// Before the first step: refuse arguments the callback cannot work with.
    fn on_train_begin(&mut self, _args: &TrainingArguments, _state: &TrainerState) -> Result<()> {
        Ok(())
    }

    /// After each optimizer step (`state.global_step` is the step just taken).
    fn on_step_end(
        &mut self,
        _args: &TrainingArguments,
        _state: &TrainerState,
        _control: &mut TrainerControl,
    ) {
    }

    /// After training metrics were logged (`logs`: `loss`, `learning_rate`, `grad_norm`,
    /// `epoch`).
    fn on_log(
        &mut self,
        _args: &TrainingArguments,
        _state: &TrainerState,
        _control: &mut TrainerControl,
        _logs: &Metrics,
    ) {
    }

    /// After an evaluation (`metrics`: `eval_loss`, `eval_<name>` of `compute_metrics`); the
    /// state's best metric is still the one before this evaluation.
    fn on_evaluate(
        &mut self,
        _args: &TrainingArguments,
        _state: &TrainerState,
        _control: &mut TrainerControl,
        _metrics: &Metrics,
    ) {
    }

    /// After a checkpoint was saved.
    fn on_save(
        &mut self,
        _args: &TrainingArguments,
        _state: &TrainerState,
        _control: &mut TrainerControl,
    ) {
    }
}

/// Stops training when `metric_for_best_model` (default `eval_loss`) has not improved by more
/// than `threshold` over the best value so far for `patience` evaluations in a row (Hugging
/// Face's `EarlyStoppingCallback`, with `early_stopping_patience` and
/// `early_stopping_threshold`). Needs an `eval_strategy`.
///
/// A resumed run recounts the evaluations without improvement from the log history it restores
/// (Hugging Face keeps the count in `trainer_state.json`), so it stops at the step where the
/// uninterrupted run stops.
#[derive(Debug, Clone)]
pub struct EarlyStoppingCallback {
    /// Evaluations without improvement that stop training.
    pub patience: usize,
    /// How much better than the best so far a metric must be to count as an improvement.
    pub threshold: f64,
    /// Evaluations without improvement so far.
    evaluations_without_improvement: usize,
    /// The best metric so far (the Trainer's `best_metric` when it tracks one; kept here too so
    /// that the callback works when it does not).
    best: Option<f64>,
}

impl EarlyStoppingCallback {
    /// Stops after `patience` evaluations that do not improve on the best by more than
    /// `threshold`.
    pub fn new(patience: usize, threshold: f64) -> Self {
        Self {
            patience,
            threshold,
            evaluations_without_improvement: 0,
            best: None,
        }
    }

    /// Counts one evaluation whose metric is `value`.
    fn observe(&mut self, value: f64, greater_is_better: bool) {
        let better = |best: f64| match greater_is_better {
            true => value > best,
            false => value < best,
        };
        let improved = match self.best {
            None => true,
            Some(best) => better(best) && (value - best).abs() > self.threshold,
        };
        if improved {
            self.evaluations_without_improvement = 0;
        } else {
            self.evaluations_without_improvement += 1;
        }
        if self.best.is_none_or(better) {
            self.best = Some(value);
        }
    }
}

impl TrainerCallback for EarlyStoppingCallback {
    fn on_train_begin(&mut self, args: &TrainingArguments, state: &TrainerState) -> Result<()> {
        if args.eval_strategy == IntervalStrategy::No {
            return Err(Error::Args(
                "EarlyStoppingCallback watches evaluations, but eval_strategy is no; set \
                 eval_strategy = steps or epoch"
                    .into(),
            ));
        }
        if self.patience == 0 {
            return Err(Error::Args(
                "EarlyStoppingCallback patience is 0, which would stop at the first evaluation; \
                 give at least 1"
                    .into(),
            ));
        }
        // On resume, the evaluations before the checkpoint, in order, as they were counted.
        let name = args.metric_for_best();
        *self = Self::new(self.patience, self.threshold);
        for record in &state.log_history {
            if let Some(&value) = record.get(&name) {
                self.observe(value, args.metric_greater_is_better());
            }
        }
        Ok(())
    }

    fn on_evaluate(
        &mut self,
        args: &TrainingArguments,
        _state: &TrainerState,
        control: &mut TrainerControl,
        metrics: &Metrics,
    ) {
        let name = args.metric_for_best();
        let Some(&value) = metrics.get(&name) else {
            eprintln!(
                "EarlyStoppingCallback: the evaluation has no {name} (it has {:?}); early \
                 stopping is off for this evaluation",
                metrics.keys().collect::<Vec<_>>()
            );
            return;
        };
        self.observe(value, args.metric_greater_is_better());
        if self.evaluations_without_improvement >= self.patience {
            control.should_training_stop = true;
        }
    }
}
