//! TrainingArguments against Hugging Face's: names, defaults and derived values from
//! fixtures/hf_training_args.json (written by fixtures/make_args_fixture.py with transformers),
//! the command line, JSON and YAML files, and the refusals of `validate`.

use std::path::{Path, PathBuf};

use accelerate_core::optim::Schedule;
use accelerate_core::{MixedPrecision, TrackerKind};
use accelerate_trainer::{
    IntervalStrategy, ReportTo, ResumeFrom, SaveStrategy, SchedulerType, TrainingArguments,
};
use clap::Parser;
use serde_json::Value;

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_training_args.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A program's own flags with the arguments flattened in, as a user writes it.
#[derive(Debug, Parser)]
struct Cli {
    /// A flag of the program itself.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    #[command(flatten)]
    args: TrainingArguments,
}

fn cli(flags: &[&str]) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(std::iter::once("prog").chain(flags.iter().copied()))
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn defaults_are_hugging_faces() {
    let hf = fixture();
    let ours = TrainingArguments::default();
    // Read as a file of Hugging Face's keys and values, it gives our defaults...
    let read: TrainingArguments = serde_json::from_value(hf["defaults"].clone()).unwrap();
    assert_eq!(read, ours);
    // ...and ours, written out, hold Hugging Face's values under its keys.
    let written: Value = serde_json::from_str(&ours.to_json_string()).unwrap();
    for (key, value) in hf["defaults"].as_object().unwrap() {
        assert_eq!(&written[key], value, "default of {key}");
    }
    // The command line with no flags gives the same defaults.
    assert_eq!(cli(&[]).unwrap().args, ours);
}

#[test]
fn a_file_of_hugging_face_arguments_is_read_with_their_meanings() {
    let hf = fixture();
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "args.json", &hf["custom"].to_string());
    let args = TrainingArguments::from_file(&path).unwrap();
    assert_eq!(args.output_dir, PathBuf::from("out"));
    assert_eq!(args.per_device_train_batch_size, 4);
    assert_eq!(args.per_device_eval_batch_size, 16);
    assert_eq!(args.gradient_accumulation_steps, 4);
    assert_eq!(args.learning_rate, 1e-3);
    assert_eq!(args.weight_decay, 0.01);
    assert_eq!((args.adam_beta1, args.adam_beta2), (0.8, 0.99));
    assert_eq!(args.adam_epsilon, 1e-6);
    assert_eq!(args.max_grad_norm, 0.5);
    assert_eq!(args.num_train_epochs, 2.5);
    assert_eq!(args.max_steps, Some(100));
    assert_eq!(args.lr_scheduler_type, SchedulerType::Cosine);
    assert_eq!(args.warmup_steps, 7);
    assert_eq!(args.logging_steps, 5);
    assert_eq!(args.eval_strategy, IntervalStrategy::Steps);
    assert_eq!(args.eval_steps, Some(10));
    assert_eq!(args.save_strategy, SaveStrategy::Steps);
    assert_eq!(args.save_steps, 20);
    assert_eq!(args.save_total_limit, Some(2));
    assert!(args.load_best_model_at_end);
    assert_eq!(args.metric_for_best_model.as_deref(), Some("accuracy"));
    assert_eq!(args.seed, 7);
    assert_eq!(args.report_to, ReportTo(vec![TrackerKind::TensorBoard]));
    assert!(args.disable_tqdm);
    // transformers derives greater_is_better from the metric's name; so do we.
    assert_eq!(
        args.metric_greater_is_better(),
        hf["custom"]["greater_is_better"].as_bool().unwrap()
    );
    assert_eq!(args.metric_for_best(), "eval_accuracy");
    // max_steps wins over the epochs; the schedule ends at it.
    assert_eq!(args.total_steps(1000), 100);
    assert_eq!(
        args.schedule(100),
        Schedule::CosineWithWarmup {
            warmup_steps: 7,
            total_steps: 100
        }
    );
    // Written out and read back, nothing changes.
    let again = write(dir.path(), "again.json", &args.to_json_string());
    assert_eq!(TrainingArguments::from_file(again).unwrap(), args);
}

#[test]
fn warmup_ratio_rounds_up_as_transformers_does() {
    for case in fixture()["warmup"].as_array().unwrap() {
        let args = TrainingArguments {
            warmup_ratio: case["ratio"].as_f64().unwrap(),
            ..Default::default()
        };
        let total = case["total_steps"].as_u64().unwrap() as usize;
        assert_eq!(
            args.warmup_steps_for(total) as u64,
            case["warmup_steps"].as_u64().unwrap(),
            "{case}"
        );
    }
    // warmup_steps above 0 wins over the ratio.
    let args = TrainingArguments {
        warmup_steps: 3,
        warmup_ratio: 0.5,
        ..Default::default()
    };
    assert_eq!(args.warmup_steps_for(100), 3);
}

#[test]
fn fractional_epochs_train_that_share_of_the_steps() {
    let args = TrainingArguments {
        num_train_epochs: 2.5,
        ..Default::default()
    };
    assert_eq!(args.total_steps(10), 25);
    assert_eq!(args.total_steps(3), 8); // ceil(7.5)
    let args = TrainingArguments {
        num_train_epochs: 0.1,
        ..Default::default()
    };
    assert_eq!(args.total_steps(3), 1);
}

#[test]
fn the_best_metric_and_its_direction_default_as_in_hugging_face() {
    let args = TrainingArguments::default();
    assert_eq!(args.metric_for_best(), "eval_loss");
    assert!(!args.metric_greater_is_better());
    for (metric, greater) in [
        ("accuracy", true),
        ("eval_f1", true),
        ("eval_nll_loss", false),
    ] {
        let args = TrainingArguments {
            metric_for_best_model: Some(metric.into()),
            ..Default::default()
        };
        assert_eq!(args.metric_greater_is_better(), greater, "{metric}");
        assert!(args.metric_for_best().starts_with("eval_"));
    }
    let args = TrainingArguments {
        metric_for_best_model: Some("accuracy".into()),
        greater_is_better: Some(false),
        ..Default::default()
    };
    assert!(!args.metric_greater_is_better());
}

#[test]
fn schedules_are_transformers_names() {
    let with = |kind| TrainingArguments {
        lr_scheduler_type: kind,
        warmup_steps: 2,
        ..Default::default()
    };
    assert_eq!(
        with(SchedulerType::Linear).schedule(10),
        Schedule::LinearWarmupDecay {
            warmup_steps: 2,
            total_steps: 10
        }
    );
    assert_eq!(
        with(SchedulerType::ConstantWithWarmup).schedule(10),
        Schedule::ConstantWithWarmup { warmup_steps: 2 }
    );
    let constant = TrainingArguments {
        lr_scheduler_type: SchedulerType::Constant,
        ..Default::default()
    };
    assert_eq!(constant.schedule(10), Schedule::Constant);
}

#[test]
fn flags_take_kebab_case_and_hugging_faces_underscores() {
    let parsed = cli(&[
        "--hidden",
        "32",
        "--output-dir",
        "runs/a",
        "--per_device_train_batch_size",
        "4",
        "--gradient-accumulation-steps",
        "8",
        "--learning_rate",
        "3e-4",
        "--lr-scheduler-type",
        "constant_with_warmup",
        "--warmup-ratio",
        "0.1",
        "--eval-strategy",
        "steps",
        "--eval-steps",
        "5",
        "--save-strategy",
        "best",
        "--load-best-model-at-end",
        "--metric-for-best-model",
        "accuracy",
        "--greater-is-better",
        "true",
        "--max-steps",
        "40",
        "--mixed-precision",
        "bf16",
        "--report-to",
        "tensorboard,csv",
        "--resume-from-checkpoint",
    ])
    .unwrap();
    assert_eq!(parsed.hidden, 32);
    let args = parsed.args;
    assert_eq!(args.output_dir, PathBuf::from("runs/a"));
    assert_eq!(args.per_device_train_batch_size, 4);
    assert_eq!(args.gradient_accumulation_steps, 8);
    assert_eq!(args.learning_rate, 3e-4);
    assert_eq!(args.lr_scheduler_type, SchedulerType::ConstantWithWarmup);
    assert_eq!(args.warmup_ratio, 0.1);
    assert_eq!(args.eval_strategy, IntervalStrategy::Steps);
    assert_eq!(args.eval_interval(), 5);
    assert_eq!(args.save_strategy, SaveStrategy::Best);
    assert!(args.load_best_model_at_end);
    assert_eq!(args.greater_is_better, Some(true));
    assert_eq!(args.max_steps, Some(40));
    assert_eq!(args.mixed_precision, Some(MixedPrecision::Bf16));
    assert_eq!(
        args.report_to,
        ReportTo(vec![TrackerKind::TensorBoard, TrackerKind::Csv])
    );
    // The flag without a value resumes from the newest checkpoint.
    assert_eq!(args.resume_from_checkpoint, Some(ResumeFrom::Latest));
    args.validate().unwrap();

    let path = cli(&["--resume-from-checkpoint", "out/checkpoint-20"]).unwrap();
    assert_eq!(
        path.args.resume_from_checkpoint,
        Some(ResumeFrom::Checkpoint("out/checkpoint-20".into()))
    );
    // eval_steps defaults to logging_steps.
    let args = cli(&["--logging-steps", "7"]).unwrap().args;
    assert_eq!(args.eval_interval(), 7);
}

#[test]
fn bad_flags_name_the_flag_and_the_valid_values() {
    let err = cli(&["--lr-scheduler-type", "polynomial"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("polynomial") && err.contains("cosine"),
        "{err}"
    );
    let err = cli(&["--report-to", "wandb"]).unwrap_err().to_string();
    assert!(
        err.contains("wandb") && err.contains("tensorboard"),
        "{err}"
    );
    let err = cli(&["--mixed-precision", "fp8"]).unwrap_err().to_string();
    assert!(err.contains("fp8") && err.contains("bf16"), "{err}");
    let err = cli(&["--eval-strategy", "sometimes"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("sometimes") && err.contains("epoch"), "{err}");
}

#[test]
fn yaml_files_read_like_json_files() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = write(
        dir.path(),
        "args.yaml",
        "output_dir: out\n\
         per_device_train_batch_size: 4\n\
         gradient_accumulation_steps: 4\n\
         learning_rate: 1.0e-3\n\
         max_steps: -1\n\
         num_train_epochs: 2\n\
         lr_scheduler_type: cosine\n\
         evaluation_strategy: epoch\n\
         report_to: all\n\
         mixed_precision: fp16\n\
         resume_from_checkpoint: true\n",
    );
    let args = TrainingArguments::from_file(&yaml).unwrap();
    let expected = TrainingArguments {
        output_dir: "out".into(),
        per_device_train_batch_size: 4,
        gradient_accumulation_steps: 4,
        learning_rate: 1e-3,
        max_steps: None,
        num_train_epochs: 2.0,
        lr_scheduler_type: SchedulerType::Cosine,
        eval_strategy: IntervalStrategy::Epoch,
        report_to: ReportTo(TrackerKind::ALL.to_vec()),
        mixed_precision: Some(MixedPrecision::Fp16),
        resume_from_checkpoint: Some(ResumeFrom::Latest),
        ..Default::default()
    };
    assert_eq!(args, expected);
    let json = write(
        dir.path(),
        "args.JSON",
        r#"{"output_dir": "out", "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 4, "learning_rate": 0.001, "max_steps": null,
            "num_train_epochs": 2, "lr_scheduler_type": "cosine", "eval_strategy": "epoch",
            "report_to": ["tensorboard", "csv", "jsonl"], "mixed_precision": "fp16",
            "resume_from_checkpoint": "latest"}"#,
    );
    assert_eq!(TrainingArguments::from_file(json).unwrap(), expected);
}

#[test]
fn bad_files_say_which_key_and_how_to_fix_it() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&str, &str, &[&str])] = &[
        // Hugging Face's bf16 flag is mixed_precision here: the key is named.
        ("a.json", r#"{"bf16": true}"#, &["bf16", "mixed_precision"]),
        (
            "b.yaml",
            "per_device_train_batch_size: 0\n",
            &["per_device_train_batch_size", "at least 1"],
        ),
        ("c.json", r#"{"max_steps": -5}"#, &["max_steps", "-1"]),
        (
            "d.json",
            r#"{"warmup_steps": 0.1}"#,
            &["warmup_steps", "warmup_ratio: 0.1"],
        ),
        (
            "e.json",
            r#"{"resume_from_checkpoint": false}"#,
            &["resume_from_checkpoint"],
        ),
        (
            "f.json",
            r#"{"lr_scheduler_type": "polynomial"}"#,
            &["polynomial", "cosine"],
        ),
        ("g.toml", "seed = 1\n", &["g.toml", ".json", ".yaml"]),
        ("h.json", "{\"seed\": 1,", &["h.json"]),
        (
            "i.json",
            r#"{"report_to": "wandb"}"#,
            &["wandb", "tensorboard"],
        ),
    ];
    for (name, text, needles) in cases {
        let path = write(dir.path(), name, text);
        let err = TrainingArguments::from_file(&path).unwrap_err().to_string();
        for needle in *needles {
            assert!(err.contains(needle), "{name}: {err:?} lacks {needle:?}");
        }
    }
    let err = TrainingArguments::from_file(dir.path().join("missing.json"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing.json"), "{err}");
}

#[test]
fn validate_refuses_what_cannot_work() {
    type Edit = fn(&mut TrainingArguments);
    let cases: &[(Edit, &[&str])] = &[
        (
            |a| a.gradient_accumulation_steps = 0,
            &["gradient_accumulation_steps"],
        ),
        (
            |a| a.per_device_eval_batch_size = 0,
            &["per_device_eval_batch_size"],
        ),
        (|a| a.logging_steps = 0, &["logging_steps"]),
        (|a| a.eval_steps = Some(0), &["eval_steps"]),
        (|a| a.save_steps = 0, &["save_steps"]),
        (
            |a| a.max_steps = Some(0),
            &["max_steps", "num_train_epochs"],
        ),
        (
            |a| a.save_total_limit = Some(0),
            &["save_total_limit", "save_strategy = no"],
        ),
        (|a| a.learning_rate = f64::NAN, &["learning_rate"]),
        (|a| a.weight_decay = -0.1, &["weight_decay"]),
        (|a| a.adam_beta2 = 1.0, &["adam_beta2", "[0, 1)"]),
        (|a| a.adam_epsilon = 0.0, &["adam_epsilon"]),
        (
            |a| a.max_grad_norm = -1.0,
            &["max_grad_norm", "0 for no clipping"],
        ),
        (
            |a| a.num_train_epochs = 0.0,
            &["num_train_epochs", "max_steps"],
        ),
        (|a| a.warmup_ratio = 1.5, &["warmup_ratio"]),
        (
            |a| {
                a.lr_scheduler_type = SchedulerType::Constant;
                a.warmup_steps = 5;
            },
            &["constant_with_warmup"],
        ),
        (
            |a| a.load_best_model_at_end = true,
            &["load_best_model_at_end", "eval_strategy"],
        ),
        (
            |a| {
                a.load_best_model_at_end = true;
                a.eval_strategy = IntervalStrategy::Steps;
                a.eval_steps = Some(30);
                a.save_steps = 50;
            },
            &["save_steps (50)", "eval_steps (30)", "multiple"],
        ),
        (
            |a| {
                a.load_best_model_at_end = true;
                a.eval_strategy = IntervalStrategy::Epoch;
            },
            &["save_strategy", "eval_strategy"],
        ),
        (
            |a| {
                a.load_best_model_at_end = true;
                a.eval_strategy = IntervalStrategy::Epoch;
                a.save_strategy = SaveStrategy::No;
            },
            &["save_strategy is no"],
        ),
        (
            |a| a.metric_for_best_model = Some("accuracy".into()),
            &["metric_for_best_model", "eval_strategy"],
        ),
        (
            |a| a.save_strategy = SaveStrategy::Best,
            &["save_strategy = best"],
        ),
    ];
    for (i, (edit, needles)) in cases.iter().enumerate() {
        let mut args = TrainingArguments::default();
        args.validate().unwrap();
        edit(&mut args);
        let err = args
            .validate()
            .expect_err(&format!("case {i} passed"))
            .to_string();
        for needle in *needles {
            assert!(err.contains(needle), "case {i}: {err:?} lacks {needle:?}");
        }
    }
    // What each refusal's fix says works.
    let fixed = TrainingArguments {
        load_best_model_at_end: true,
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(25),
        save_steps: 50,
        ..Default::default()
    };
    fixed.validate().unwrap();
    let fixed = TrainingArguments {
        max_steps: Some(10),
        num_train_epochs: 0.0,
        ..Default::default()
    };
    fixed.validate().unwrap();
}
