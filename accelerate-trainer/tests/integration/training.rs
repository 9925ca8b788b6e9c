//! The Trainer's loop against an Accelerator loop written out here, exact resume, checkpoints,
//! callbacks, logging and bad input, on one process.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::common::{dataset, equivalence_args, reference_loop, tiny, values, StopAt};
use accelerate_core::{Accelerator, TrackerKind};
use accelerate_trainer::{
    EarlyStoppingCallback, IntervalStrategy, Metrics, ReportTo, ResumeFrom, SaveStrategy, Trainer,
    TrainerCallback, TrainerControl, TrainerState, TrainingArguments,
};

const SEED: u64 = 11;

#[test]
fn the_trainer_gives_the_parameters_of_the_equivalent_accelerator_loop_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let args = equivalence_args(&dir.path().join("out"), SEED);
    // 50 samples in batches of 4: 13 batches per epoch, in windows of 3 (the last window holds
    // one batch), 5 optimizer steps per epoch.
    let reference = reference_loop(Accelerator::builder(), &args, SEED, 50);
    assert!(reference.clipped > 0, "the settings must make clipping act");
    assert_eq!((reference.batches, reference.steps), (13, 10));
    let expected = reference.params;

    let mut trainer = Trainer::new(args.clone()).unwrap();
    let (varmap, model) = tiny(SEED);
    let before = values(&varmap);
    let out = trainer
        .train(&model, &varmap, dataset(50, 1), None)
        .unwrap();
    assert_eq!(out.global_step, 10);
    assert_ne!(values(&varmap), before);
    assert_eq!(values(&varmap), expected);
    // The final model, PyTorch names, in output_dir.
    let saved = candle_core::safetensors::load(
        args.output_dir.join("model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    for (name, v) in &expected {
        let t = saved[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(&t, v, "{name}");
    }
}

#[test]
fn a_run_stopped_at_a_checkpoint_and_resumed_gives_the_uninterrupted_parameters_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        save_steps: 2,
        logging_steps: 2,
        ..equivalence_args(&dir.path().join("whole"), SEED)
    };
    let (whole, model) = tiny(SEED);
    Trainer::new(args.clone())
        .unwrap()
        .train(&model, &whole, dataset(50, 1), None)
        .unwrap();

    let interrupted = TrainingArguments {
        output_dir: dir.path().join("parts"),
        ..args.clone()
    };
    let (parts, model) = tiny(SEED);
    let mut first = Trainer::new(interrupted.clone()).unwrap();
    first.add_callback(StopAt(4));
    assert_eq!(
        first
            .train(&model, &parts, dataset(50, 1), None)
            .unwrap()
            .global_step,
        4
    );
    assert_ne!(values(&parts), values(&whole));
    // Step 4 is inside the first epoch (5 steps), in the middle of the loader.
    let state = TrainerState::read(&interrupted.output_dir.join("checkpoint-4")).unwrap();
    assert_eq!(state.global_step, 4);
    assert_eq!(state.max_steps, 10);
    assert!((state.epoch - 0.8).abs() < 1e-12, "{}", state.epoch);
    let logged: Vec<f64> = state
        .log_history
        .iter()
        .filter(|r| r.contains_key("loss"))
        .map(|r| r["step"])
        .collect();
    assert_eq!(logged, [2.0, 4.0]);
    assert!(state
        .log_history
        .iter()
        .all(|r| r["loss"].is_finite() && r["learning_rate"] > 0.0 && r["grad_norm"] > 0.0));

    // A fresh process: new model, resumed from the latest checkpoint.
    let (resumed, model) = tiny(SEED);
    let mut second = Trainer::new(TrainingArguments {
        resume_from_checkpoint: Some(ResumeFrom::Latest),
        ..interrupted.clone()
    })
    .unwrap();
    let out = second
        .train(&model, &resumed, dataset(50, 1), None)
        .unwrap();
    assert_eq!(out.global_step, 10);
    assert_eq!(values(&resumed), values(&whole));
    // The log history continues the interrupted one.
    let steps: Vec<f64> = second
        .state()
        .log_history
        .iter()
        .map(|r| r["step"])
        .collect();
    assert_eq!(steps, [2.0, 4.0, 6.0, 8.0, 10.0]);
}

/// Returns the scripted values of `score`, one per evaluation.
fn scripted(
    scores: &[f64],
) -> impl FnMut(&accelerate_trainer::EvalPrediction) -> candle_core::Result<Metrics> {
    let scores = scores.to_vec();
    let mut next = 0;
    move |_| {
        let score = scores[next.min(scores.len() - 1)];
        next += 1;
        Ok(Metrics::from([("score".to_string(), score)]))
    }
}

fn checkpoint_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    names.sort();
    names
}

#[test]
fn rotation_keeps_the_newest_and_the_best_and_the_best_is_loaded_at_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        max_steps: Some(5),
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(1),
        save_steps: 1,
        save_total_limit: Some(2),
        load_best_model_at_end: true,
        metric_for_best_model: Some("score".into()),
        greater_is_better: Some(true),
        ..equivalence_args(&dir.path().join("out"), SEED)
    };
    let (varmap, model) = tiny(SEED);
    let mut trainer = Trainer::new(args.clone()).unwrap();
    trainer.compute_metrics(scripted(&[0.1, 0.9, 0.3, 0.2, 0.4]));
    let out = trainer
        .train(&model, &varmap, dataset(50, 1), Some(dataset(10, 2)))
        .unwrap();
    assert_eq!(out.global_step, 5);
    assert_eq!(
        checkpoint_names(&args.output_dir),
        ["checkpoint-2", "checkpoint-5"]
    );
    let state = trainer.state();
    assert_eq!(state.best_metric, Some(0.9));
    assert_eq!(state.best_global_step, Some(2));
    assert_eq!(
        state.best_model_checkpoint.as_deref(),
        Some(args.output_dir.join("checkpoint-2").as_path())
    );
    let load = |p: &Path| {
        let t = candle_core::safetensors::load(p, &candle_core::Device::Cpu).unwrap();
        let mut v: Vec<(String, Vec<f32>)> = t
            .into_iter()
            .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let best = load(&args.output_dir.join("checkpoint-2/model.safetensors"));
    let last = load(&args.output_dir.join("checkpoint-5/model.safetensors"));
    assert_ne!(best, last);
    assert_eq!(values(&varmap), best);
    assert_eq!(load(&args.output_dir.join("model.safetensors")), best);
    // Five evaluations, each in the log history with its step.
    let evals: Vec<(f64, f64)> = state
        .log_history
        .iter()
        .filter(|r| r.contains_key("eval_score"))
        .map(|r| (r["step"], r["eval_score"]))
        .collect();
    assert_eq!(
        evals,
        [(1.0, 0.1), (2.0, 0.9), (3.0, 0.3), (4.0, 0.2), (5.0, 0.4)]
    );
}

#[test]
fn without_a_best_to_keep_rotation_keeps_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        max_steps: Some(5),
        save_steps: 1,
        save_total_limit: Some(2),
        ..equivalence_args(&dir.path().join("out"), SEED)
    };
    let (varmap, model) = tiny(SEED);
    Trainer::new(args.clone())
        .unwrap()
        .train(&model, &varmap, dataset(50, 1), None)
        .unwrap();
    assert_eq!(
        checkpoint_names(&args.output_dir),
        ["checkpoint-4", "checkpoint-5"]
    );
}

#[test]
fn early_stopping_stops_after_patience_evaluations_without_an_improvement_beyond_threshold() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        max_steps: Some(10),
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(1),
        save_strategy: SaveStrategy::No,
        metric_for_best_model: Some("score".into()),
        ..equivalence_args(&dir.path().join("out"), SEED)
    };
    // Lower is better ("score" is not a loss, so say so).
    let args = TrainingArguments {
        greater_is_better: Some(false),
        ..args
    };
    let (varmap, model) = tiny(SEED);
    let mut trainer = Trainer::new(args).unwrap();
    // 1.0 (first, best), 0.5 (better), 0.6 (worse: 1), 0.47 (better by 0.03 < threshold: 2).
    trainer.compute_metrics(scripted(&[1.0, 0.5, 0.6, 0.47, 0.1, 0.05]));
    trainer.add_callback(EarlyStoppingCallback::new(2, 0.05));
    let out = trainer
        .train(&model, &varmap, dataset(50, 1), Some(dataset(10, 2)))
        .unwrap();
    assert_eq!(out.global_step, 4);
    assert_eq!(out.metrics["eval_score"], 0.47);
}

#[test]
fn train_and_eval_losses_land_in_the_trackers_at_the_logging_and_eval_steps() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let args = TrainingArguments {
        max_steps: Some(6),
        logging_steps: 2,
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(3),
        save_strategy: SaveStrategy::No,
        report_to: ReportTo(vec![TrackerKind::Jsonl]),
        logging_dir: Some(logs.clone()),
        ..equivalence_args(&dir.path().join("out"), SEED)
    };
    let (varmap, model) = tiny(SEED);
    let out = Trainer::new(args)
        .unwrap()
        .train(&model, &varmap, dataset(50, 1), Some(dataset(10, 2)))
        .unwrap();
    let mut at: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for line in std::fs::read_to_string(logs.join("metrics.jsonl"))
        .unwrap()
        .lines()
    {
        let record: serde_json::Value = serde_json::from_str(line).unwrap();
        for (name, _) in record.as_object().unwrap() {
            if name != "step" {
                at.entry(name.clone())
                    .or_default()
                    .push(record["step"].as_u64().unwrap());
            }
        }
    }
    assert_eq!(at["train/loss"], [2, 4, 6]);
    assert_eq!(at["train/learning_rate"], [2, 4, 6]);
    assert_eq!(at["train/grad_norm"], [2, 4, 6]);
    assert_eq!(at["train/epoch"], [2, 4, 6]);
    assert_eq!(at["eval/loss"], [3, 6]);
    assert!(out.training_loss.is_finite() && out.training_loss > 0.0);
}

#[test]
fn bad_arguments_and_inputs_are_refused_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let (varmap, model) = tiny(SEED);
    let err = |args: TrainingArguments, eval: bool| {
        Trainer::new(args)
            .and_then(|mut t| {
                t.train(
                    &model,
                    &varmap,
                    dataset(50, 1),
                    eval.then(|| dataset(10, 2)),
                )
            })
            .unwrap_err()
            .to_string()
    };
    let e = err(
        TrainingArguments {
            eval_strategy: IntervalStrategy::Steps,
            ..equivalence_args(&out, SEED)
        },
        false,
    );
    assert!(e.contains("no eval dataset"), "{e}");
    std::fs::create_dir_all(out.join("checkpoint-7")).unwrap();
    let e = err(equivalence_args(&out, SEED), false);
    assert!(
        e.contains("checkpoint-7") && e.contains("resume_from_checkpoint"),
        "{e}"
    );
    let e = err(
        TrainingArguments {
            resume_from_checkpoint: Some(ResumeFrom::Checkpoint(out.join("checkpoint-99"))),
            ..equivalence_args(&out, SEED)
        },
        false,
    );
    assert!(e.contains("checkpoint-99"), "{e}");
    let e = err(
        TrainingArguments {
            per_device_train_batch_size: 0,
            ..equivalence_args(&dir.path().join("other"), SEED)
        },
        false,
    );
    assert!(e.contains("per_device_train_batch_size"), "{e}");
}

/// Publishes the step just taken, for a `compute_metrics` that scores by step.
struct StepProbe(Arc<AtomicU64>);

impl TrainerCallback for StepProbe {
    fn on_step_end(&mut self, _: &TrainingArguments, s: &TrainerState, _: &mut TrainerControl) {
        self.0.store(s.global_step, Ordering::SeqCst);
    }
}

/// A run with an evaluation and a checkpoint every step, a `score` (lower is better) scripted by
/// step, early stopping with patience 3; `stop_at` stops it early as a kill would. Returns the
/// step it ended at.
fn early_stopped_run(args: &TrainingArguments, stop_at: Option<u64>) -> u64 {
    // Step 2 is the best; 3, 4 and 5 do not improve on it: the third of them stops training.
    let scores = [
        f64::NAN,
        1.0,
        0.5,
        0.6,
        0.7,
        0.8,
        0.9,
        0.95,
        0.97,
        0.98,
        0.99,
    ];
    let step = Arc::new(AtomicU64::new(0));
    let (varmap, model) = tiny(SEED);
    let mut trainer = Trainer::new(args.clone()).unwrap();
    let scored = step.clone();
    trainer.compute_metrics(move |_| {
        let score = scores[scored.load(Ordering::SeqCst) as usize];
        Ok(Metrics::from([("score".to_string(), score)]))
    });
    trainer.add_callback(StepProbe(step));
    trainer.add_callback(EarlyStoppingCallback::new(3, 0.0));
    if let Some(step) = stop_at {
        trainer.add_callback(StopAt(step));
    }
    trainer
        .train(&model, &varmap, dataset(50, 1), Some(dataset(10, 2)))
        .unwrap()
        .global_step
}

#[test]
fn early_stopping_counts_the_evaluations_before_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let args = |name: &str| TrainingArguments {
        max_steps: Some(10),
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(1),
        save_steps: 1,
        metric_for_best_model: Some("score".into()),
        greater_is_better: Some(false),
        ..equivalence_args(&dir.path().join(name), SEED)
    };
    assert_eq!(early_stopped_run(&args("whole"), None), 5);
    // Stopped after step 4: two evaluations without improvement so far, in the checkpoint's log
    // history; the resumed run's first evaluation (step 5) is the third.
    assert_eq!(early_stopped_run(&args("parts"), Some(4)), 4);
    let resumed = TrainingArguments {
        resume_from_checkpoint: Some(ResumeFrom::Latest),
        ..args("parts")
    };
    assert_eq!(early_stopped_run(&resumed, None), 5);
}

#[test]
fn early_stopping_watches_eval_loss_without_metric_for_best_model() {
    let dir = tempfile::tempdir().unwrap();
    // A learning rate too small to move an f32 weight: every evaluation gives the same loss, so
    // the first one is the best and the next two stop training.
    let args = TrainingArguments {
        max_steps: Some(10),
        learning_rate: 1e-30,
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(1),
        save_strategy: SaveStrategy::No,
        ..equivalence_args(&dir.path().join("out"), SEED)
    };
    assert_eq!(args.metric_for_best_model, None);
    let (varmap, model) = tiny(SEED);
    let mut trainer = Trainer::new(args).unwrap();
    trainer.add_callback(EarlyStoppingCallback::new(2, 0.0));
    let out = trainer
        .train(&model, &varmap, dataset(50, 1), Some(dataset(10, 2)))
        .unwrap();
    assert_eq!(out.global_step, 3);
}
