//! [`TrainerControl`]: what callbacks ask of the training loop (Hugging Face's `TrainerControl`).

/// Requests from [`TrainerCallback`](crate::TrainerCallback)s, read by the loop after each hook
/// and reset once acted on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrainerControl {
    /// Stop training after this step (the final evaluation and save still happen).
    pub should_training_stop: bool,
    /// Log the training metrics at this step.
    pub should_log: bool,
    /// Evaluate at this step.
    pub should_evaluate: bool,
    /// Save a checkpoint at this step.
    pub should_save: bool,
}
