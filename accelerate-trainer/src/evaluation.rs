//! The evaluation loop: every rank runs its share of the evaluation set, and the per-sample
//! losses (and the predictions for `compute_metrics`) are gathered without the samples that the
//! last uneven round repeats, so the result is that of one process over the whole set.

use accelerate_core::data::{DataLoader, Dataset};
use accelerate_core::Accelerator;
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::model::{ComputeMetrics, EvalPrediction, Metrics, TrainerModel};

/// Evaluates `model` over one pass of the prepared `loader`: `eval_loss` (the mean per-sample
/// loss, or the loss sum over the item count for item-weighted losses) and `eval_<name>` for
/// each metric of `compute_metrics`.
pub(crate) fn evaluate_loader<D, M>(
    acc: &Accelerator,
    model: &M,
    loader: &mut DataLoader<D>,
    compute_metrics: Option<&mut ComputeMetrics>,
) -> Result<Metrics>
where
    D: Dataset,
    M: TrainerModel<D::Batch> + ?Sized,
{
    // Sums in f64 of f32 losses: exact for any realistic set, so independent of the order in
    // which ranks and batches deliver them.
    let mut loss_sum = 0f64;
    let mut items = 0f64;
    let mut predictions = Vec::new();
    let mut labels = Vec::new();
    let wants_predictions = compute_metrics.is_some();
    for batch in loader.iter() {
        let batch = batch?;
        let out = model.forward(&batch)?;
        if out.losses.rank() != 1 {
            return Err(Error::Args(format!(
                "the model's forward returned losses of shape {:?}; the Trainer needs one loss \
                 per sample, [batch] (e.g. cross-entropy without the mean)",
                out.losses.dims()
            )));
        }
        // Detached: on one process a gather is a copy that would keep every batch's forward
        // graph (its activations) alive until the end of the pass.
        let losses = acc.gather_for_metrics(&out.losses.detach().to_dtype(DType::F32)?)?;
        loss_sum += sum_f64(&losses)?;
        items += match &out.items {
            Some(counts) => {
                sum_f64(&acc.gather_for_metrics(&counts.detach().to_dtype(DType::F32)?)?)?
            }
            None => losses.dim(0)? as f64,
        };
        if wants_predictions {
            match (&out.logits, &out.labels) {
                (Some(p), Some(l)) => {
                    // Kept on the host until compute_metrics: the whole set's predictions need
                    // not fit on the device beside the model.
                    predictions.push(
                        acc.gather_for_metrics(&p.detach())?
                            .to_device(&Device::Cpu)?,
                    );
                    labels.push(
                        acc.gather_for_metrics(&l.detach())?
                            .to_device(&Device::Cpu)?,
                    );
                }
                _ => {
                    return Err(Error::Args(
                        "compute_metrics is set, but the model's forward returned no logits \
                         and labels; return them with ModelOutput::with_predictions"
                            .into(),
                    ))
                }
            }
        }
    }
    if items == 0.0 {
        return Err(Error::Args(
            "the evaluation set holds no samples (or no items); give a non-empty eval dataset"
                .into(),
        ));
    }
    let mut metrics = Metrics::new();
    metrics.insert("eval_loss".into(), loss_sum / items);
    if let Some(compute) = compute_metrics {
        let prediction = EvalPrediction {
            predictions: cat_batches(&predictions, "logits")?,
            label_ids: cat_batches(&labels, "labels")?,
        };
        for (name, value) in compute(&prediction)? {
            let name = if name.starts_with("eval_") {
                name
            } else {
                format!("eval_{name}")
            };
            metrics.insert(name, value);
        }
    }
    Ok(metrics)
}

/// The batches' gathered tensors as one, refusing batches whose shapes differ past the first
/// dimension (sequences of several lengths) with the fix.
fn cat_batches(batches: &[Tensor], what: &str) -> Result<Tensor> {
    if let Some(first) = batches.first() {
        if let Some(other) = batches.iter().find(|b| b.dims()[1..] != first.dims()[1..]) {
            return Err(Error::Args(format!(
                "compute_metrics: the model's {what} have shape {:?} in one evaluation batch and \
                 {:?} in another; pad them to one length in the model's forward (e.g. the \
                 dataset's longest sequence), so the evaluation set's {what} stack",
                first.dims(),
                other.dims()
            )));
        }
    }
    Ok(Tensor::cat(batches, 0)?)
}

fn sum_f64(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?)
}
