//! The trackers through the accelerator: what `log` and `end_training` leave on disk, on the main
//! process and elsewhere, and the errors.

use std::path::Path;

use super::*;
use crate::{Accelerator, ProcessState};

fn accelerator(dir: &Path, kinds: &[TrackerKind]) -> Accelerator {
    Accelerator::builder()
        .process_state(ProcessState::single())
        .report_to(kinds.iter().copied())
        .logging_dir(dir)
        .build()
        .unwrap()
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn every_tracker_has_each_log_call_and_end_training_draws_the_curves() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("runs/exp");
    let acc = accelerator(&dir, &parse_report_to("tensorboard,csv,jsonl").unwrap());
    assert_eq!(acc.logging_dir().as_deref(), Some(dir.as_path()));
    for step in 1..=3u64 {
        acc.log(
            [
                (TRAIN_LOSS, 1.0 / step as f64),
                (TRAIN_LEARNING_RATE, 0.5e-3 * step as f64),
            ],
            step,
        )
        .unwrap();
    }
    acc.log(vec![(EVAL_LOSS.to_string(), 0.75)], 3).unwrap();
    // Before end_training every call is already in the files (nothing buffered in the process).
    let jsonl = std::fs::read_to_string(dir.join(jsonl::FILE)).unwrap();
    let lines: Vec<serde_json::Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    assert_eq!(lines[1]["step"], 2);
    assert_eq!(lines[1][TRAIN_LOSS], 0.5);
    assert_eq!(lines[1][TRAIN_LEARNING_RATE], 1e-3);
    assert_eq!(lines[3][EVAL_LOSS], 0.75);
    let csv = std::fs::read_to_string(dir.join(csv_table::FILE)).unwrap();
    assert_eq!(
        csv,
        "step,train/loss,train/learning_rate,eval/loss\n\
         1,1,0.0005,\n2,0.5,0.001,\n3,0.3333333333333333,0.0015,\n3,,,0.75\n"
    );
    assert!(!dir.join(CURVES_PNG).exists(), "the PNG comes at the end");

    acc.end_training().unwrap();
    let names = files(&dir);
    assert_eq!(names.len(), 4, "{names:?}");
    assert!(names[0].starts_with("events.out.tfevents."), "{names:?}");
    assert_eq!(names[1..], [csv_table::FILE, jsonl::FILE, CURVES_PNG]);
    let png = std::fs::read(dir.join(CURVES_PNG)).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");

    let err = acc.log([(TRAIN_LOSS, 0.1)], 4).unwrap_err().to_string();
    assert!(err.contains("after end_training"), "{err}");
    acc.end_training().unwrap();
}

#[test]
fn other_ranks_create_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("logs");
    let mut trackers = Trackers::open(&TrackerKind::ALL, &dir, false).unwrap();
    assert_eq!(trackers.logging_dir(), None);
    trackers.log(1, vec![(TRAIN_LOSS.into(), 1.0)]).unwrap();
    trackers.end().unwrap();
    assert!(!dir.exists(), "a non-main rank created {}", dir.display());
    // Names are still checked there, so a bad one fails on every rank alike.
    let mut trackers = Trackers::open(&TrackerKind::ALL, &dir, false).unwrap();
    assert!(trackers.log(1, vec![("step".into(), 1.0)]).is_err());
}

#[test]
fn without_report_to_nothing_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("logs");
    let acc = accelerator(&dir, &[]);
    acc.log([(TRAIN_LOSS, 1.0)], 1).unwrap();
    acc.end_training().unwrap();
    assert!(!dir.exists());
    assert_eq!(acc.logging_dir(), None);
}

#[test]
fn bad_names_are_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let acc = accelerator(tmp.path(), &[TrackerKind::Jsonl]);
    for (metrics, expected) in [
        (vec![("step", 1.0)], "not \"step\""),
        (vec![("", 1.0)], "non-empty"),
        (vec![("a\nb", 1.0)], "printable"),
        (vec![("x", 1.0), ("x", 2.0)], "twice"),
    ] {
        let err = acc.log(metrics, 1).unwrap_err().to_string();
        assert!(err.contains(expected), "{err}");
    }
    assert_eq!(
        std::fs::read_to_string(tmp.path().join(jsonl::FILE)).unwrap(),
        ""
    );
}

#[test]
fn an_unusable_logging_dir_is_an_error_naming_it_and_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a_file");
    std::fs::write(&file, "").unwrap();
    let dir = file.join("logs");
    let err = Accelerator::builder()
        .process_state(ProcessState::single())
        .report_to([TrackerKind::Csv])
        .logging_dir(&dir)
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains(&dir.display().to_string()), "{err}");
    assert!(
        err.contains("logging_dir") && err.contains("writable"),
        "{err}"
    );
}
