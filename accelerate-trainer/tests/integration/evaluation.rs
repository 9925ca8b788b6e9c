//! The evaluation loop on 1, 2 and 3 ranks against a single-process evaluation of the same split
//! and weights, computed here.

use std::sync::{Arc, Mutex};

use crate::common::{data, dataset, per_sample_loss, ranks_as_threads, tiny};
use accelerate_trainer::{Metrics, Trainer, TrainingArguments};
use candle_core::DType;

/// 23 samples in batches of 4: not a multiple of ranks × batch for 2 or 3 ranks, so the last
/// round repeats samples that must not count.
const SAMPLES: usize = 23;

/// eval_loss and accuracy of the whole split in one forward pass, in f64.
fn single_process_reference() -> (f64, f64) {
    let (_, model) = tiny(3);
    let (x, y) = data(SAMPLES, 9);
    let logits = model.logits(&x).unwrap();
    let losses = per_sample_loss(&logits, &y).unwrap();
    let losses: Vec<f32> = losses.to_vec1().unwrap();
    let loss = losses.iter().map(|&l| l as f64).sum::<f64>() / SAMPLES as f64;
    let predicted: Vec<u32> = logits.argmax(1).unwrap().to_vec1().unwrap();
    let labels: Vec<u32> = y.to_vec1().unwrap();
    let hits = predicted
        .iter()
        .zip(&labels)
        .filter(|(p, l)| p == l)
        .count();
    (loss, hits as f64 / SAMPLES as f64)
}

fn evaluate_on(ranks: usize) -> Vec<(Metrics, usize)> {
    let dir = tempfile::tempdir().unwrap();
    ranks_as_threads(ranks, |builder| {
        let args = TrainingArguments {
            output_dir: dir.path().to_path_buf(),
            per_device_eval_batch_size: 4,
            disable_tqdm: true,
            ..Default::default()
        };
        let mut trainer = Trainer::with_accelerator(args, builder).unwrap();
        let (_, model) = tiny(3);
        let seen = Arc::new(Mutex::new(0));
        let counted = seen.clone();
        trainer.compute_metrics(move |p| {
            *counted.lock().unwrap() = p.label_ids.dim(0)?;
            let hits = p.predictions.argmax(1)?.eq(&p.label_ids)?;
            let accuracy = hits.to_dtype(DType::F64)?.mean_all()?.to_scalar::<f64>()?;
            Ok(Metrics::from([("accuracy".to_string(), accuracy)]))
        });
        let metrics = trainer.evaluate(&model, dataset(SAMPLES, 9)).unwrap();
        let seen = *seen.lock().unwrap();
        (metrics, seen)
    })
}

#[test]
fn eval_loss_on_1_2_and_3_ranks_is_the_single_process_evaluation_of_the_split() {
    let (loss, accuracy) = single_process_reference();
    for ranks in [1, 2, 3] {
        for (rank, (metrics, seen)) in evaluate_on(ranks).into_iter().enumerate() {
            // Every sample once: the repeated ones of the last round are dropped.
            assert_eq!(seen, SAMPLES, "{ranks} ranks, rank {rank}");
            assert_eq!(metrics["eval_accuracy"], accuracy, "{ranks} ranks");
            // The per-sample losses come from batches of 4 here and of 23 in the reference; a
            // matrix product may round a row differently with the batch's shape, hence 1e-6.
            let got = metrics["eval_loss"];
            assert!(
                (got - loss).abs() <= 1e-6 * loss,
                "{ranks} ranks, rank {rank}: eval_loss {got} vs {loss}"
            );
        }
    }
}
