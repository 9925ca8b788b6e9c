//! The Trainer where real runs go wrong: the best checkpoint after an extra final evaluation and
//! after a resume that spells `output_dir` otherwise, a checkpoint cut short before its
//! `trainer_state.json`, callbacks that decide on one rank only, evaluation outputs of several
//! shapes, and a resume on two ranks.

use std::path::{Path, PathBuf};

use crate::common::{
    dataset, per_sample_loss, ranks_as_threads, ranks_as_threads_knowing_rank, tiny, values,
    StopAt, Tiny,
};
use accelerate_trainer::{
    EvalPrediction, IntervalStrategy, Metrics, ModelOutput, ResumeFrom, SaveStrategy, Trainer,
    TrainerCallback, TrainerControl, TrainerModel, TrainerState, TrainingArguments,
};
use candle_core::Tensor;

fn base(out: &Path) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        per_device_train_batch_size: 4,
        learning_rate: 0.05,
        seed: 11,
        disable_tqdm: true,
        ..Default::default()
    }
}

/// A `compute_metrics` returning `score` from a script, one value per evaluation (the last one
/// repeated).
fn scripted(scores: &[f64]) -> impl FnMut(&EvalPrediction) -> candle_core::Result<Metrics> {
    let scores = scores.to_vec();
    let mut next = 0;
    move |_| {
        let s = scores[next.min(scores.len() - 1)];
        next += 1;
        Ok(Metrics::from([("score".to_string(), s)]))
    }
}

fn load(p: &Path) -> Vec<(String, Vec<f32>)> {
    let t = candle_core::safetensors::load(p, &candle_core::Device::Cpu).unwrap();
    let mut v: Vec<_> = t
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn the_extra_final_evaluation_never_becomes_a_best_without_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // Evaluations at steps 2 and 4 (saved) and a final one at 5 (not saved) that scores best.
    let args = TrainingArguments {
        max_steps: Some(5),
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(2),
        save_steps: 2,
        load_best_model_at_end: true,
        metric_for_best_model: Some("score".into()),
        greater_is_better: Some(true),
        ..base(&out)
    };
    let (varmap, model) = tiny(11);
    let mut trainer = Trainer::new(args).unwrap();
    trainer.compute_metrics(scripted(&[0.1, 0.2, 0.9]));
    trainer
        .train(&model, &varmap, dataset(50, 1), Some(dataset(10, 2)))
        .unwrap();
    let s = trainer.state();
    assert_eq!((s.best_global_step, s.best_metric), (Some(4), Some(0.2)));
    assert_eq!(
        s.best_model_checkpoint.as_deref().and_then(Path::file_name),
        Some("checkpoint-4".as_ref())
    );
    assert_eq!(
        values(&varmap),
        load(&out.join("checkpoint-4/model.safetensors"))
    );
}

#[test]
fn the_best_checkpoint_survives_a_resume_that_spells_output_dir_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("a")).unwrap();
    let args = |out: PathBuf| TrainingArguments {
        max_steps: Some(6),
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(1),
        save_steps: 1,
        save_total_limit: Some(2),
        load_best_model_at_end: true,
        metric_for_best_model: Some("score".into()),
        greater_is_better: Some(true),
        ..base(&out)
    };
    let (v, m) = tiny(11);
    let mut first = Trainer::new(args(dir.path().join("a/../out"))).unwrap();
    // Step 1 is the best of the whole run.
    first.compute_metrics(scripted(&[0.9, 0.1]));
    first.add_callback(StopAt(2));
    first
        .train(&m, &v, dataset(50, 1), Some(dataset(10, 2)))
        .unwrap();
    let (v, m) = tiny(11);
    let out = dir.path().join("out");
    let mut second = Trainer::new(TrainingArguments {
        resume_from_checkpoint: Some(ResumeFrom::Latest),
        ..args(out.clone())
    })
    .unwrap();
    second.compute_metrics(scripted(&[0.1]));
    second
        .train(&m, &v, dataset(50, 1), Some(dataset(10, 2)))
        .unwrap();
    assert!(
        out.join("checkpoint-1").is_dir(),
        "the best was rotated away"
    );
    assert_eq!(
        values(&v),
        load(&out.join("checkpoint-1/model.safetensors"))
    );
}

#[test]
fn a_checkpoint_cut_short_before_its_trainer_state_is_passed_over_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let args = |out: &Path| TrainingArguments {
        max_steps: Some(6),
        save_steps: 2,
        ..base(out)
    };
    let (whole_vars, m) = tiny(11);
    Trainer::new(args(&dir.path().join("whole")))
        .unwrap()
        .train(&m, &whole_vars, dataset(50, 1), None)
        .unwrap();
    let parts = dir.path().join("parts");
    let (v, m) = tiny(11);
    let mut first = Trainer::new(args(&parts)).unwrap();
    first.add_callback(StopAt(4));
    first.train(&m, &v, dataset(50, 1), None).unwrap();
    // As if the process died after the accelerator's state and before trainer_state.json.
    std::fs::remove_file(parts.join("checkpoint-4/trainer_state.json")).unwrap();
    let (v, m) = tiny(11);
    let out = Trainer::new(TrainingArguments {
        resume_from_checkpoint: Some(ResumeFrom::Latest),
        ..args(&parts)
    })
    .unwrap()
    .train(&m, &v, dataset(50, 1), None)
    .unwrap();
    assert_eq!(out.global_step, 6);
    assert_eq!(values(&v), values(&whole_vars));
}

/// Asks for a save at step 2, on rank 0 only (as a callback reading the wall clock might).
struct SaveOnRankZero;

impl TrainerCallback for SaveOnRankZero {
    fn on_step_end(&mut self, _: &TrainingArguments, s: &TrainerState, c: &mut TrainerControl) {
        c.should_save |= s.is_world_process_zero && s.global_step == 2;
    }
}

#[test]
fn a_request_of_one_rank_is_carried_out_by_all() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let args = TrainingArguments {
        max_steps: Some(3),
        save_strategy: SaveStrategy::No,
        ..base(&out)
    };
    let mains = ranks_as_threads(2, |builder| {
        let (v, m) = tiny(11);
        let mut t = Trainer::with_accelerator(args.clone(), builder).unwrap();
        t.add_callback(SaveOnRankZero);
        t.train(&m, &v, dataset(50, 1), None).unwrap();
        t.state().is_world_process_zero
    });
    assert_eq!(mains, [true, false]);
    assert!(out.join("checkpoint-2/trainer_state.json").is_file());
}

/// Logits whose second dimension is the batch size: the last, shorter batch has fewer.
struct Ragged(Tiny);

impl TrainerModel<(Tensor, Tensor)> for Ragged {
    fn forward(&self, (x, y): &(Tensor, Tensor)) -> candle_core::Result<ModelOutput> {
        let logits = self.0.logits(x)?;
        let n = x.dim(0)?;
        let seq = logits.unsqueeze(1)?.repeat((1, n, 1))?;
        Ok(ModelOutput::losses(per_sample_loss(&logits, y)?).with_predictions(seq, y.clone()))
    }
}

#[test]
fn predictions_of_several_shapes_are_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        max_steps: Some(1),
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(1),
        save_strategy: SaveStrategy::No,
        per_device_eval_batch_size: 4,
        ..base(&dir.path().join("o"))
    };
    let (v, m) = tiny(11);
    let mut t = Trainer::new(args).unwrap();
    t.compute_metrics(|_| Ok(Metrics::new()));
    let err = t
        .train(&Ragged(m), &v, dataset(50, 1), Some(dataset(10, 2)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("[4, 4, 3]") && err.contains("[2, 2, 3]"),
        "{err}"
    );
    assert!(err.contains("pad them to one length"), "{err}");
}

#[test]
fn two_ranks_stopped_at_a_checkpoint_and_resumed_end_as_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let args = |out: PathBuf| TrainingArguments {
        num_train_epochs: 2.0,
        gradient_accumulation_steps: 2,
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(2),
        save_steps: 2,
        save_total_limit: Some(1),
        logging_steps: 1,
        ..base(&out)
    };
    let whole = ranks_as_threads(2, |b| {
        let (v, m) = tiny(11);
        let mut t = Trainer::with_accelerator(args(dir.path().join("whole")), b).unwrap();
        let o = t
            .train(&m, &v, dataset(50, 1), Some(dataset(11, 2)))
            .unwrap();
        (values(&v), o.metrics["eval_loss"], o.global_step)
    });
    let parts = dir.path().join("parts");
    ranks_as_threads(2, |b| {
        let (v, m) = tiny(11);
        let mut t = Trainer::with_accelerator(args(parts.clone()), b).unwrap();
        t.add_callback(StopAt(4));
        t.train(&m, &v, dataset(50, 1), Some(dataset(11, 2)))
            .unwrap();
    });
    let resumed = ranks_as_threads(2, |b| {
        let (v, m) = tiny(11);
        let resume = TrainingArguments {
            resume_from_checkpoint: Some(ResumeFrom::Latest),
            ..args(parts.clone())
        };
        let mut t = Trainer::with_accelerator(resume, b).unwrap();
        let o = t
            .train(&m, &v, dataset(50, 1), Some(dataset(11, 2)))
            .unwrap();
        (values(&v), o.metrics["eval_loss"], o.global_step)
    });
    assert_eq!(whole, resumed);
}

/// Does nothing: a callback a program adds on its main process only.
struct Quiet;

impl TrainerCallback for Quiet {}

#[test]
fn a_callback_added_on_the_main_process_only_trains_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        max_steps: Some(4),
        logging_steps: 1,
        save_steps: 2,
        ..base(&dir.path().join("out"))
    };
    let steps = ranks_as_threads(2, |builder| {
        let (v, m) = tiny(11);
        let mut t = Trainer::with_accelerator(args.clone(), builder).unwrap();
        if t.accelerator().is_main_process() {
            t.add_callback(Quiet);
        }
        t.train(&m, &v, dataset(50, 1), None).unwrap().global_step
    });
    assert_eq!(steps, [4, 4]);
}

#[test]
fn a_run_resumed_into_another_output_dir_loads_the_best_from_where_it_was_saved() {
    let dir = tempfile::tempdir().unwrap();
    let args = |out: PathBuf| TrainingArguments {
        max_steps: Some(4),
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(1),
        save_steps: 1,
        load_best_model_at_end: true,
        metric_for_best_model: Some("score".into()),
        greater_is_better: Some(true),
        ..base(&out)
    };
    let first_dir = dir.path().join("a");
    let (v, m) = tiny(11);
    let mut first = Trainer::new(args(first_dir.clone())).unwrap();
    first.compute_metrics(scripted(&[0.9, 0.1]));
    first.add_callback(StopAt(2));
    first
        .train(&m, &v, dataset(50, 1), Some(dataset(10, 2)))
        .unwrap();
    let second_dir = dir.path().join("b");
    let (v, m) = tiny(11);
    let mut second = Trainer::new(TrainingArguments {
        resume_from_checkpoint: Some(ResumeFrom::Checkpoint(first_dir.join("checkpoint-2"))),
        ..args(second_dir.clone())
    })
    .unwrap();
    second.compute_metrics(scripted(&[0.1]));
    second
        .train(&m, &v, dataset(50, 1), Some(dataset(10, 2)))
        .unwrap();
    let best = load(&first_dir.join("checkpoint-1/model.safetensors"));
    assert_eq!(values(&v), best);
    assert_eq!(load(&second_dir.join("model.safetensors")), best);
}

#[test]
fn under_the_epoch_strategy_a_checkpoint_cut_short_is_saved_again() {
    let dir = tempfile::tempdir().unwrap();
    // 50 samples in batches of 4: 13 steps an epoch, checkpoints 13, 26, 39.
    let args = |out: &Path| TrainingArguments {
        num_train_epochs: 3.0,
        save_strategy: SaveStrategy::Epoch,
        ..base(out)
    };
    let (whole, m) = tiny(11);
    Trainer::new(args(&dir.path().join("whole")))
        .unwrap()
        .train(&m, &whole, dataset(50, 1), None)
        .unwrap();
    let parts = dir.path().join("parts");
    let (v, m) = tiny(11);
    let mut first = Trainer::new(args(&parts)).unwrap();
    first.add_callback(StopAt(26));
    first.train(&m, &v, dataset(50, 1), None).unwrap();
    std::fs::remove_file(parts.join("checkpoint-26/trainer_state.json")).unwrap();
    let (v, m) = tiny(11);
    Trainer::new(TrainingArguments {
        resume_from_checkpoint: Some(ResumeFrom::Latest),
        ..args(&parts)
    })
    .unwrap()
    .train(&m, &v, dataset(50, 1), None)
    .unwrap();
    assert!(parts.join("checkpoint-26/trainer_state.json").is_file());
    assert_eq!(values(&v), values(&whole));
}

/// The `checkpoint-<step>` directories in `out`, sorted by step.
fn checkpoint_steps(out: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(out)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.strip_prefix("checkpoint-")?.parse().ok()
        })
        .collect();
    steps.sort();
    steps
}

#[test]
fn resuming_from_an_older_checkpoint_while_newer_ones_exist_is_refused_before_anything_changes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let args = TrainingArguments {
        max_steps: Some(5),
        save_steps: 1,
        ..base(&out)
    };
    let (v, m) = tiny(11);
    Trainer::new(args.clone())
        .unwrap()
        .train(&m, &v, dataset(50, 1), None)
        .unwrap();
    assert_eq!(checkpoint_steps(&out), [1, 2, 3, 4, 5]);
    let checkpoint_5 = std::fs::read(out.join("checkpoint-5/model.safetensors")).unwrap();
    // Resumed from step 1 with a limit of 2: rotation would delete the past (1 to 4) and keep
    // the abandoned run's checkpoint-5, which a later `latest` would resume.
    let (v, m) = tiny(11);
    let before = values(&v);
    let resumed = Trainer::new(TrainingArguments {
        resume_from_checkpoint: Some(ResumeFrom::Checkpoint(out.join("checkpoint-1"))),
        save_total_limit: Some(2),
        save_steps: 2,
        ..args
    })
    .unwrap()
    .train(&m, &v, dataset(50, 1), None);
    let err = match resumed {
        Ok(o) => panic!(
            "resumed to step {} next to newer checkpoints; left: {:?}",
            o.global_step,
            checkpoint_steps(&out)
        ),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("checkpoint-1")
            && err.contains("4 checkpoint(s) newer")
            && err.contains("checkpoint-5")
            && err.contains("another output_dir"),
        "{err}"
    );
    assert_eq!(checkpoint_steps(&out), [1, 2, 3, 4, 5], "nothing deleted");
    assert_eq!(
        std::fs::read(out.join("checkpoint-5/model.safetensors")).unwrap(),
        checkpoint_5
    );
    assert_eq!(values(&v), before, "nothing loaded");
}

#[test]
fn ranks_that_find_different_checkpoints_to_resume_or_none_stop_and_name_both() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let args = |out: &Path| TrainingArguments {
        max_steps: Some(4),
        save_steps: 2,
        ..base(out)
    };
    ranks_as_threads(2, |builder| {
        let (v, m) = tiny(11);
        Trainer::with_accelerator(args(&a), builder)
            .unwrap()
            .train(&m, &v, dataset(50, 1), None)
            .unwrap();
    });
    // Rank 1's machine sees an output_dir without checkpoints (b), then one with an older one.
    let resume = |b_has: Option<u64>| {
        std::fs::create_dir_all(&b).unwrap();
        if let Some(step) = b_has {
            let from = a.join(format!("checkpoint-{step}"));
            let to = b.join(format!("checkpoint-{step}"));
            std::fs::create_dir_all(&to).unwrap();
            for f in std::fs::read_dir(&from).unwrap() {
                let f = f.unwrap();
                std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let (a, b) = (a.clone(), b.clone());
        std::thread::spawn(move || {
            let results = ranks_as_threads_knowing_rank(2, |rank, builder| {
                let out = if rank == 0 { &a } else { &b };
                let (v, m) = tiny(11);
                let before = values(&v);
                let result = Trainer::with_accelerator(
                    TrainingArguments {
                        resume_from_checkpoint: Some(ResumeFrom::Latest),
                        ..args(out)
                    },
                    builder,
                )
                .unwrap()
                .train(&m, &v, dataset(50, 1), None);
                (
                    result.map(|o| o.global_step).map_err(|e| e.to_string()),
                    values(&v) == before,
                )
            });
            let _ = tx.send(results);
        });
        // A guard against the hang this test is about (one rank waiting in a collective the
        // other skipped), far above the run's second or two.
        rx.recv_timeout(std::time::Duration::from_secs(120))
            .expect("the ranks did not return: one waits in a collective the other skipped")
    };
    for (b_has, rank_1) in [(None, "rank 1: none"), (Some(2), "checkpoint-2 (step 2")] {
        let results = resume(b_has);
        for (rank, (result, untouched)) in results.iter().enumerate() {
            let e = result
                .as_ref()
                .expect_err(&format!("rank {rank} resumed: {result:?}"));
            assert!(
                e.contains("rank 0: ") && e.contains("checkpoint-4 (step 4") && e.contains(rank_1),
                "rank {rank}: {e}"
            );
            assert!(untouched, "rank {rank} loaded something");
        }
    }
}
