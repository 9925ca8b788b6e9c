//! Evaluation on the held-out split: a prepared, unshuffled loader over the split;
//! each rank computes per-sample values of its batches, and `gather_for_metrics` collects every
//! rank's, dropping the rows of the samples repeated to complete the last round, so the totals
//! are exactly those of the split on any number of ranks.
//!
//! Evaluating leaves training as it was: no backward pass (the accumulated gradients and the
//! accumulation window are untouched), no random draw (no dropout), and the training loader's
//! position is its own, so a run resumed from a checkpoint ends as the uninterrupted one does.

use std::sync::Arc;

use accelerate_core::data::{DataLoader, Dataset};
use accelerate_core::{Accelerator, EVAL_ACCURACY, EVAL_LOSS};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, D};

use super::split::Subset;

/// What one evaluation found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    /// The optimizer step it evaluated after.
    pub step: u64,
    /// The loss per item over the whole split: the summed loss of every sample divided by the
    /// items (1 per sample, or the tokens of a language model).
    pub loss: f64,
    /// The share of samples classified correctly, for a classifier.
    pub accuracy: Option<f64>,
    /// Samples evaluated (the split's size: each counted once).
    pub samples: usize,
    /// Items the loss is averaged over.
    pub items: f64,
}

/// The held-out split's prepared loader, what its samples and items are called in the printed
/// lines, and the latest result.
#[derive(Debug)]
pub struct Evaluator<D: Dataset> {
    loader: Option<DataLoader<Subset<D>>>,
    unit: &'static str,
    item_unit: Option<&'static str>,
    last: Option<EvalResult>,
}

impl<D: Dataset> Evaluator<D> {
    /// Prepares an unshuffled loader of `batch_size` over `split` (nothing when there is no
    /// split). Call it on every rank, after the training loader is prepared and before
    /// `--resume` loads a checkpoint (checkpoints hold every prepared loader's position). `unit`
    /// names the samples ("samples", "windows", "rows") and `item_unit` the items of an
    /// item-weighted loss ("tokens"), in the printed lines.
    pub fn prepare(
        acc: &mut Accelerator,
        split: Option<Subset<D>>,
        batch_size: usize,
        unit: &'static str,
        item_unit: Option<&'static str>,
    ) -> Result<Self> {
        let loader = match split {
            Some(split) => Some(
                acc.prepare(DataLoader::new(Arc::new(split), batch_size).shuffle(false))
                    .context("preparing the evaluation loader")?,
            ),
            None => None,
        };
        Ok(Self {
            loader,
            unit,
            item_unit,
            last: None,
        })
    }

    /// Evaluates after optimizer `step` (collective: every rank calls it): runs the split
    /// through `per_sample`, which maps a batch to one row per sample of `[summed loss, items]`
    /// or `[summed loss, items, correct]` (see [`sample_rows`]); logs `eval/loss` (and
    /// `eval/accuracy`) at `step` and prints them on the main process. Does nothing without a
    /// split.
    pub fn evaluate(
        &mut self,
        acc: &Accelerator,
        step: u64,
        per_sample: impl FnMut(D::Batch) -> Result<Tensor>,
    ) -> Result<()> {
        let Some(loader) = self.loader.as_mut() else {
            return Ok(());
        };
        let (sums, samples) = gathered_sums(acc, loader, per_sample)?;
        let items = sums.get(1).copied().unwrap_or(samples as f64);
        let result = EvalResult {
            step,
            loss: sums.first().copied().unwrap_or(f64::NAN) / items,
            accuracy: sums.get(2).map(|correct| correct / samples as f64),
            samples,
            items,
        };
        let mut metrics = vec![(EVAL_LOSS, result.loss)];
        let mut line = format!("eval step={step} loss={:.6}", result.loss);
        if let Some(a) = result.accuracy {
            metrics.push((EVAL_ACCURACY, a));
            line.push_str(&format!(" accuracy={a:.6}"));
        }
        line.push_str(&format!(" {}={samples}", self.unit));
        if let Some(unit) = self.item_unit {
            line.push_str(&format!(" {unit}={items}"));
        }
        acc.log(metrics, step)?;
        acc.print(line);
        self.last = Some(result);
        Ok(())
    }

    /// The evaluation at the end of the run, after optimizer `step`: [`evaluate`](Self::evaluate)
    /// unless the last evaluation was at this step already. Collective.
    pub fn at_end(
        &mut self,
        acc: &Accelerator,
        step: u64,
        per_sample: impl FnMut(D::Batch) -> Result<Tensor>,
    ) -> Result<()> {
        if self.last.is_some_and(|r| r.step == step) {
            return Ok(());
        }
        self.evaluate(acc, step, per_sample)
    }

    /// The latest result.
    pub fn last(&self) -> Option<EvalResult> {
        self.last
    }

    /// The summary line's fields of the latest result, ` eval_loss=… [eval_accuracy=…]`, or
    /// nothing without a split.
    pub fn summary_fields(&self) -> String {
        let Some(r) = self.last else {
            return String::new();
        };
        let mut s = format!(" eval_loss={:.6}", r.loss);
        if let Some(a) = r.accuracy {
            s.push_str(&format!(" eval_accuracy={a:.6}"));
        }
        s
    }
}

/// The column sums over the whole split of `per_sample`'s rows, and the number of samples: each
/// rank's rows of each batch are gathered with `gather_for_metrics`, which drops the rows of the
/// samples repeated to complete the last round, and summed in f64 on the host.
pub fn gathered_sums<D: Dataset>(
    acc: &Accelerator,
    loader: &mut DataLoader<D>,
    mut per_sample: impl FnMut(D::Batch) -> Result<Tensor>,
) -> Result<(Vec<f64>, usize)> {
    let mut sums: Vec<f64> = Vec::new();
    let mut samples = 0;
    for batch in loader.iter() {
        let rows = per_sample(batch?)?.detach().to_dtype(DType::F64)?;
        let all = acc.gather_for_metrics(&rows)?;
        samples += all.dim(0)?;
        let column_sums = all.to_device(&Device::Cpu)?.sum(0)?.to_vec1::<f64>()?;
        if sums.is_empty() {
            sums = vec![0.0; column_sums.len()];
        }
        for (s, c) in sums.iter_mut().zip(column_sums) {
            *s += c;
        }
    }
    Ok((sums, samples))
}

/// Stacks per-sample columns (each `[batch]`, any float or integer dtype) into the `[batch,
/// columns]` f64 rows that [`Evaluator::evaluate`]'s `per_sample` returns.
pub fn sample_rows(columns: &[&Tensor]) -> Result<Tensor> {
    let columns = columns
        .iter()
        .map(|c| c.to_dtype(DType::F64))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::stack(&columns, 1)?)
}

/// The cross-entropy of each row of `logits` `[n, classes]` against its class in `targets`
/// `[n]` (integer): `[n]`, in f32 for f32 logits.
pub fn per_row_cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let log_probs = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let targets = targets.to_dtype(DType::U32)?.unsqueeze(1)?.contiguous()?;
    Ok(log_probs.gather(&targets, 1)?.squeeze(1)?.neg()?)
}

/// 1 for each row of `logits` `[n, classes]` whose largest logit is at its class in `targets`,
/// else 0: `[n]` f32.
pub fn correct_predictions(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let predicted = logits.argmax(D::Minus1)?;
    Ok(predicted
        .eq(&targets.to_dtype(predicted.dtype())?)?
        .to_dtype(DType::F32)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_row_cross_entropy_is_minus_the_log_softmax_at_the_class() {
        let logits = Tensor::new(&[[1f32, 2., 3.], [0., 0., 0.]], &Device::Cpu).unwrap();
        let targets = Tensor::new(&[2u32, 0], &Device::Cpu).unwrap();
        let ce = per_row_cross_entropy(&logits, &targets)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        // ln(e^1 + e^2 + e^3) - 3, and ln 3 for uniform logits.
        let first = ((1f64).exp() + (2f64).exp() + (3f64).exp()).ln() - 3.0;
        assert!((ce[0] as f64 - first).abs() < 1e-6, "{ce:?}");
        assert!((ce[1] as f64 - 3f64.ln()).abs() < 1e-6, "{ce:?}");
        let right = correct_predictions(&logits, &targets)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(right, [1.0, 1.0]);
        let wrong = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
        let right = correct_predictions(&logits, &wrong)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(right, [0.0, 0.0]);
    }
}
