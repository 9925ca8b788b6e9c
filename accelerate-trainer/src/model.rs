//! What the user gives the Trainer: a model that turns a batch into per-sample losses (and
//! optionally logits and labels for `compute_metrics`).

use std::collections::BTreeMap;

use candle_core::Tensor;

/// A model the [`Trainer`](crate::Trainer) can train and evaluate on batches of type `B` (the
/// dataset's `Batch`).
///
/// The parameters live in the `VarMap` handed to [`Trainer::train`](crate::Trainer::train),
/// built in [`Trainer::compute_dtype`](crate::Trainer::compute_dtype) on
/// [`Trainer::device`](crate::Trainer::device) (the f32 master copies of mixed precision are the
/// Trainer's business).
pub trait TrainerModel<B> {
    /// The forward pass over one batch. [`ModelOutput::losses`] holds one loss per sample
    /// (`[batch]`, f32): the Trainer trains on their mean, or, for an item-weighted loss
    /// ([`num_items`](Self::num_items) returns a count), on their sum divided by the items of
    /// the whole accumulation window on all ranks. Evaluation gathers them per sample, which
    /// makes the evaluation loss exact on any number of processes.
    fn forward(&self, batch: &B) -> candle_core::Result<ModelOutput>;

    /// For an item-weighted loss (a sum over tokens, say): the items of `batch` that count (e.g.
    /// non-padding tokens), known before the forward pass, so the Trainer weights the gradient as
    /// that of one batch holding the whole window. `forward`'s `losses` are then per-sample sums
    /// over items, and its [`ModelOutput::items`] the per-sample counts. Default: `None`, a mean
    /// loss per sample.
    fn num_items(&self, _batch: &B) -> candle_core::Result<Option<usize>> {
        Ok(None)
    }
}

/// What [`TrainerModel::forward`] returns.
#[derive(Debug, Clone)]
pub struct ModelOutput {
    /// One loss per sample, `[batch]` (f32): a mean over the sample's items, or under
    /// [`TrainerModel::num_items`] a sum.
    pub losses: Tensor,
    /// Items per sample, `[batch]`, for item-weighted losses (`None`: one item per sample).
    pub items: Option<Tensor>,
    /// Predictions (e.g. logits `[batch, classes]`) for `compute_metrics`; gathered over the
    /// whole evaluation set.
    pub logits: Option<Tensor>,
    /// Labels (`[batch, ...]`) for `compute_metrics`; gathered like the logits.
    pub labels: Option<Tensor>,
}

impl ModelOutput {
    /// An output with per-sample losses only.
    pub fn losses(losses: Tensor) -> Self {
        Self {
            losses,
            items: None,
            logits: None,
            labels: None,
        }
    }

    /// Adds the logits and labels that `compute_metrics` receives.
    pub fn with_predictions(mut self, logits: Tensor, labels: Tensor) -> Self {
        self.logits = Some(logits);
        self.labels = Some(labels);
        self
    }
}

/// What `compute_metrics` receives: the logits and labels of the whole evaluation set, gathered
/// from every rank in dataset order per batch, without the samples a last uneven round repeats
/// (Hugging Face's `EvalPrediction`).
#[derive(Debug, Clone)]
pub struct EvalPrediction {
    /// [`ModelOutput::logits`], concatenated over the evaluation set.
    pub predictions: Tensor,
    /// [`ModelOutput::labels`], concatenated over the evaluation set.
    pub label_ids: Tensor,
}

/// Metrics by name (`loss`, `accuracy`, ...); the Trainer prefixes `eval_` in its results and
/// `eval/` in the trackers.
pub type Metrics = BTreeMap<String, f64>;

/// A `compute_metrics` function: metrics of the gathered evaluation predictions.
pub type ComputeMetrics = Box<dyn FnMut(&EvalPrediction) -> candle_core::Result<Metrics>>;
