//! The `trainer` example (the mlp workload through the Trainer) under `accelerate-launch` on 2 CPU
//! processes: it prints its eval loss from rank 0 only, which equals an evaluation computed here
//! from the model it saved and its held-out split; it writes checkpoints; `--args-file` with a
//! YAML file gives the run of the same flags; and a run stopped by `--max-steps` and resumed with
//! `--resume-from-checkpoint` ends with the uninterrupted run's model bitwise.

use std::path::Path;
use std::time::Duration;

use accelerate_tests::{load_flat, Job, JobOutput};
use accelerate_trainer::TrainerState;

use crate::evaluation::mlp_reference;

const LIMIT: Duration = Duration::from_secs(240);
const RANKS: usize = 2;
/// 410 samples of which the example holds out the last 10%: 369 to train on (185 per rank, 24
/// batches of 8, 12 optimizer steps per epoch with K = 2) and 41 to evaluate, which 2 ranks × 8
/// do not divide (the last round repeats samples).
const SAMPLES: usize = 410;
const HELD_OUT: usize = 41;
const SEED: u64 = 4;
/// Past the first epoch (12 steps); the interrupted run stops at 8, inside it.
const STEPS: u64 = 16;

/// The example's flags but `--output-dir` and `--max-steps`: accumulation, decay, warm-up of a
/// schedule that does not depend on the step count (so a run stopped early by `--max-steps` is
/// the start of the longer one), clipping, evaluation every 6 steps, a checkpoint every 4.
const FLAGS: &[&str] = &[
    "--hidden",
    "16",
    "--samples",
    "410",
    "--per-device-train-batch-size",
    "8",
    "--per-device-eval-batch-size",
    "8",
    "--gradient-accumulation-steps",
    "2",
    "--learning-rate",
    "0.01",
    "--weight-decay",
    "0.1",
    "--lr-scheduler-type",
    "constant_with_warmup",
    "--warmup-steps",
    "2",
    "--max-grad-norm",
    "0.5",
    "--eval-strategy",
    "steps",
    "--eval-steps",
    "6",
    "--save-steps",
    "4",
    "--logging-steps",
    "4",
    "--seed",
    "4",
];

fn trainer(out: &Path, steps: u64, extra: &[&str]) -> JobOutput {
    let o = Job::example("trainer")
        .ranks(RANKS)
        .args(FLAGS)
        .args(["--output-dir", out.to_str().unwrap()])
        .args(["--max-steps", &steps.to_string()])
        .args(extra)
        .limit(LIMIT)
        .run();
    assert!(o.status.success(), "{}", o.text());
    o
}

/// The `eval_loss=` of the summary line, which only rank 0 prints.
fn printed_eval_loss(o: &JobOutput) -> f64 {
    let stdout = o.stdout_text();
    let summaries: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("eval_loss="))
        .collect();
    assert_eq!(summaries.len(), 1, "one summary line:\n{}", o.text());
    assert!(summaries[0].starts_with("[rank 0] "), "{}", o.text());
    o.summary("eval_loss")
}

#[test]
fn the_trainer_example_on_two_ranks_prints_the_eval_loss_of_its_saved_model() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = trainer(&out, STEPS, &[]);
    assert_eq!(o.summary::<u64>("steps"), STEPS);
    let printed = printed_eval_loss(&o);

    // The held-out split: the last 41 samples of the example's seeded data.
    let eval: Vec<usize> = (SAMPLES - HELD_OUT..SAMPLES).collect();
    assert!(!HELD_OUT.is_multiple_of(8 * RANKS));
    let (loss, correct) = mlp_reference(&out.join("model.safetensors"), SAMPLES, SEED, &eval);
    assert!(
        (printed - loss).abs() < 2e-5,
        "eval_loss {printed} vs {loss} computed from the saved model\n{}",
        o.text()
    );
    let accuracy: f64 = o.summary("eval_accuracy");
    assert!((accuracy - correct as f64 / HELD_OUT as f64).abs() < 1e-4);

    // Checkpoints every 4 steps, each with its trainer state; the final state in output_dir.
    for step in [4, 8, 12, 16] {
        let checkpoint = out.join(format!("checkpoint-{step}"));
        assert!(checkpoint.join("model.safetensors").is_file(), "{step}");
        assert_eq!(TrainerState::read(&checkpoint).unwrap().global_step, step);
    }
    let state = TrainerState::read(&out).unwrap();
    assert_eq!(state.global_step, STEPS);
    let evaluated: Vec<f64> = state
        .log_history
        .iter()
        .filter(|r| r.contains_key("eval_loss"))
        .map(|r| r["step"])
        .collect();
    assert_eq!(evaluated, [6.0, 12.0, 16.0]);
}

#[test]
fn the_trainer_example_reads_its_arguments_from_a_yaml_file() {
    let dir = tempfile::tempdir().unwrap();
    let by_flags = dir.path().join("flags");
    let by_file = dir.path().join("file");
    let flags = trainer(&by_flags, 6, &[]);

    let yaml = dir.path().join("args.yaml");
    std::fs::write(
        &yaml,
        format!(
            "output_dir: {}\n\
             per_device_train_batch_size: 8\n\
             per_device_eval_batch_size: 8\n\
             gradient_accumulation_steps: 2\n\
             learning_rate: 0.01\n\
             weight_decay: 0.1\n\
             lr_scheduler_type: constant_with_warmup\n\
             warmup_steps: 2\n\
             max_grad_norm: 0.5\n\
             max_steps: 6\n\
             eval_strategy: steps\n\
             eval_steps: 6\n\
             save_steps: 4\n\
             logging_steps: 4\n\
             seed: 4\n",
            by_file.display()
        ),
    )
    .unwrap();
    let file = Job::example("trainer")
        .ranks(RANKS)
        .args(["--hidden", "16", "--samples", "410", "--args-file"])
        .arg(&yaml)
        .limit(LIMIT)
        .run();
    assert!(file.status.success(), "{}", file.text());
    assert_eq!(printed_eval_loss(&file), printed_eval_loss(&flags));
    assert_eq!(
        load_flat(&by_file.join("model.safetensors")),
        load_flat(&by_flags.join("model.safetensors"))
    );
    assert!(by_file.join("checkpoint-4").is_dir());
}

#[test]
fn a_trainer_run_stopped_by_max_steps_and_resumed_ends_with_the_uninterrupted_model_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole");
    let parts = dir.path().join("parts");
    let uninterrupted = trainer(&whole, STEPS, &[]);

    let first = trainer(&parts, 8, &[]);
    assert_eq!(first.summary::<u64>("steps"), 8);
    let stopped = load_flat(&parts.join("model.safetensors"));
    assert_ne!(stopped, load_flat(&whole.join("model.safetensors")));
    let resumed = trainer(&parts, STEPS, &["--resume-from-checkpoint"]);
    assert_eq!(resumed.summary::<u64>("steps"), STEPS);
    assert_eq!(
        load_flat(&parts.join("model.safetensors")),
        load_flat(&whole.join("model.safetensors"))
    );
    // The evaluation at the end, of the same model, is the same too.
    assert_eq!(
        printed_eval_loss(&resumed),
        printed_eval_loss(&uninterrupted)
    );
}
