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

/// The state of global rank `rank` of 2 on two machines, `local_rank` on its own.
fn rank(rank: usize, local_rank: usize) -> ProcessState {
    ProcessState {
        rank,
        world_size: 2,
        local_rank,
        local_world_size: 1,
        ..ProcessState::single()
    }
}

/// The trackers of `kinds` in `dir` for the process `state`, warning about tracker errors.
fn open_warning(kinds: &[TrackerKind], dir: &Path, state: &ProcessState) -> Trackers {
    Trackers::open(kinds, Some(dir), state, TrackerErrors::Warn).unwrap()
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
    let mut trackers = open_warning(&TrackerKind::ALL, &dir, &rank(1, 1));
    assert_eq!(trackers.logging_dir(), None);
    trackers.log(1, vec![(TRAIN_LOSS.into(), 1.0)]).unwrap();
    trackers.end().unwrap();
    assert!(!dir.exists(), "a non-main rank created {}", dir.display());
    // Names are still checked there, so a bad one fails on every rank alike.
    let mut trackers = open_warning(&TrackerKind::ALL, &dir, &rank(1, 1));
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

/// A tracker whose every write fails as on a full disk: it appends to `/dev/full`.
struct FullDisk(append::AppendFile);

impl Tracker for FullDisk {
    fn log(&mut self, _step: u64, _metrics: &[(String, f64)]) -> crate::Result<()> {
        self.0.append(b"record\n")
    }
    fn finish(&mut self) -> crate::Result<()> {
        self.0.append(b"last\n")
    }
    fn purge_from(&mut self, _step: u64) -> crate::Result<()> {
        self.0.append(b"start\n")
    }
}

fn full_disk() -> Option<Box<dyn Tracker>> {
    let path = Path::new("/dev/full");
    if !path.exists() {
        eprintln!("skipped: no /dev/full on this system");
        return None;
    }
    Some(Box::new(FullDisk(
        append::AppendFile::open(path, false).unwrap(),
    )))
}

#[test]
fn a_failing_tracker_leaves_the_others_and_the_curves_their_records() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(failing) = full_disk() else { return };
    let mut trackers = open_warning(&[TrackerKind::Jsonl], tmp.path(), &ProcessState::single());
    // First in line, so a failure that stopped the loop would starve the JSONL tracker.
    trackers.trackers.insert(0, failing);
    trackers.warned.insert(0, false);
    trackers.log(1, vec![(TRAIN_LOSS.into(), 2.0)]).unwrap();
    trackers.log(2, vec![(TRAIN_LOSS.into(), 1.0)]).unwrap();
    trackers.end().unwrap();
    let jsonl = std::fs::read_to_string(tmp.path().join(jsonl::FILE)).unwrap();
    assert_eq!(
        jsonl,
        "{\"step\":1,\"train/loss\":2.0}\n{\"step\":2,\"train/loss\":1.0}\n"
    );
    assert!(tmp.path().join(CURVES_PNG).exists(), "the curves are drawn");
}

#[test]
fn under_fail_the_error_names_the_failed_file_and_the_others_still_have_the_call() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(failing) = full_disk() else { return };
    let state = ProcessState::single();
    let mut trackers = Trackers::open(
        &[TrackerKind::Jsonl],
        Some(tmp.path()),
        &state,
        TrackerErrors::Fail,
    )
    .unwrap();
    trackers.trackers.insert(0, failing);
    trackers.warned.insert(0, false);
    let err = trackers
        .log(1, vec![(TRAIN_LOSS.into(), 2.0)])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("1 of 2 trackers") && err.contains("/dev/full") && err.contains("space"),
        "{err}"
    );
    assert!(!err.contains(jsonl::FILE), "{err}");
    let err = trackers.end().unwrap_err().to_string();
    assert!(
        err.contains("/dev/full") && err.contains("end_training"),
        "{err}"
    );
    let jsonl = std::fs::read_to_string(tmp.path().join(jsonl::FILE)).unwrap();
    assert_eq!(jsonl, "{\"step\":1,\"train/loss\":2.0}\n");
    assert!(tmp.path().join(CURVES_PNG).exists(), "the curves are drawn");
}

#[test]
fn the_main_process_is_global_rank_zero_not_each_machines_local_rank_zero() {
    let tmp = tempfile::tempdir().unwrap();
    // Rank 1 is local rank 0 of the second machine: it must not write.
    let second_machine = tmp.path().join("second");
    let mut trackers = open_warning(&TrackerKind::ALL, &second_machine, &rank(1, 0));
    trackers.log(1, vec![(TRAIN_LOSS.into(), 1.0)]).unwrap();
    trackers.end().unwrap();
    assert!(!second_machine.exists(), "rank 1 (local rank 0) wrote");
    let first_machine = tmp.path().join("first");
    let mut trackers = open_warning(&[TrackerKind::Jsonl], &first_machine, &rank(0, 0));
    trackers.log(1, vec![(TRAIN_LOSS.into(), 1.0)]).unwrap();
    assert!(first_machine.join(jsonl::FILE).exists());
}

#[test]
fn without_a_logging_dir_each_run_gets_a_directory_of_its_own() {
    let build = || {
        Accelerator::builder()
            .process_state(ProcessState::single())
            .report_to([TrackerKind::Csv, TrackerKind::Jsonl])
            .build()
            .unwrap()
    };
    let (first, second) = (build(), build());
    let dirs = [first.logging_dir().unwrap(), second.logging_dir().unwrap()];
    let cleanup = || {
        for dir in &dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
        // The parent too when no one else has a run in it (remove_dir refuses a non-empty one).
        let _ = std::fs::remove_dir(DEFAULT_LOGGING_DIR);
    };
    first.log([(TRAIN_LOSS, 1.0)], 1).unwrap();
    second.log([(TRAIN_LOSS, 2.0)], 1).unwrap();
    let jsonl: Vec<String> = dirs
        .iter()
        .map(|d| std::fs::read_to_string(d.join(jsonl::FILE)).unwrap_or_default())
        .collect();
    cleanup();
    assert_ne!(dirs[0], dirs[1], "two runs share {}", dirs[0].display());
    // runs/<YYYYmmdd-HHMMSS>_<host>, as Hugging Face's <output_dir>/runs/<time>_<host>.
    for dir in &dirs {
        assert_eq!(
            dir.parent(),
            Some(Path::new(DEFAULT_LOGGING_DIR)),
            "{dir:?}"
        );
        let name = dir.file_name().unwrap().to_string_lossy();
        let (time, host) = name.split_once('_').unwrap_or(("", ""));
        let digits = |s: &str| s.chars().all(|c| c.is_ascii_digit());
        assert!(
            time.len() == 15 && time.as_bytes()[8] == b'-' && digits(&time[..8]),
            "{name}"
        );
        assert!(digits(&time[9..]) && time.starts_with("20"), "{name}");
        assert!(!host.is_empty(), "{name}");
    }
    assert_eq!(jsonl[0], "{\"step\":1,\"train/loss\":1.0}\n");
    assert_eq!(jsonl[1], "{\"step\":1,\"train/loss\":2.0}\n");
}

#[test]
fn a_second_live_writer_of_a_logging_dir_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("shared");
    let state = ProcessState::single();
    let kinds = [TrackerKind::Csv];
    let mut first = open_warning(&kinds, &dir, &state);
    let err = Trackers::open(&kinds, Some(&dir), &state, TrackerErrors::Warn)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains(&dir.display().to_string()), "{err}");
    assert!(
        err.contains("another") && err.contains("logging_dir"),
        "{err}"
    );
    // Once the first run has ended, the directory can be continued (a resumed run).
    first.end().unwrap();
    open_warning(&kinds, &dir, &state);
}

/// The steps and `train/loss` values of each line of `metrics.jsonl`.
fn jsonl_losses(dir: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(dir.join(jsonl::FILE))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v[TRAIN_LOSS].as_f64().unwrap())
        })
        .collect()
}

/// A run that logged steps 1..=4 (loss = step), then a run resumed from a checkpoint of step 2
/// that logs steps 3..=5 (loss = 10 × step) into the same directory.
fn resumed_run(dir: &Path) -> Trackers {
    let state = ProcessState::single();
    let mut first =
        Trackers::open(&TrackerKind::ALL, Some(dir), &state, TrackerErrors::Fail).unwrap();
    for step in 1..=4u64 {
        first
            .log(step, vec![(TRAIN_LOSS.into(), step as f64)])
            .unwrap();
    }
    first.end().unwrap();
    drop(first);
    let mut second =
        Trackers::open(&TrackerKind::ALL, Some(dir), &state, TrackerErrors::Fail).unwrap();
    second.resumed();
    for step in 3..=5u64 {
        second
            .log(step, vec![(TRAIN_LOSS.into(), 10.0 * step as f64)])
            .unwrap();
    }
    second
}

const RESUMED: [(u64, f64); 5] = [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)];

#[test]
fn after_a_resume_the_tables_drop_the_orphaned_steps_and_tensorboard_gets_a_start() {
    let tmp = tempfile::tempdir().unwrap();
    let mut second = resumed_run(tmp.path());
    second.end().unwrap();
    assert_eq!(jsonl_losses(tmp.path()), RESUMED);
    let csv = std::fs::read_to_string(tmp.path().join(csv_table::FILE)).unwrap();
    assert_eq!(csv, "step,train/loss\n1,1\n2,2\n3,30\n4,40\n5,50\n");
    // The resumed run's event file: the version, SessionLog START at step 3 (torch's
    // SummaryWriter(purge_step=3)), then the scalars.
    let mut event_files: Vec<_> = files(tmp.path())
        .into_iter()
        .filter(|n| n.starts_with("events.out.tfevents."))
        .collect();
    assert_eq!(event_files.len(), 2, "{event_files:?}");
    event_files.sort_by_key(|n| n.rsplit('.').next().unwrap().parse::<u64>().unwrap());
    let bytes = std::fs::read(tmp.path().join(&event_files[1])).unwrap();
    let events: Vec<event_record::Event> = event_record::unframe(&bytes)
        .unwrap()
        .iter()
        .map(|r| <event_record::Event as prost::Message>::decode(r.as_slice()).unwrap())
        .collect();
    assert_eq!(events.len(), 5);
    assert_eq!(events[1].step, 3);
    assert_eq!(
        events[1].session_log,
        Some(event_record::SessionLog {
            status: event_record::SESSION_START
        })
    );
    assert!(events[1].summary.is_none());
    assert_eq!(events[2].step, 3);
}

#[test]
fn after_a_resume_the_curves_show_the_whole_run() {
    let tmp = tempfile::tempdir().unwrap();
    let second = resumed_run(tmp.path());
    assert_eq!(second.final_curves().train_loss, RESUMED);
}

#[test]
fn load_state_makes_the_next_logged_step_start_the_history_over() {
    let tmp = tempfile::tempdir().unwrap();
    let logs = tmp.path().join("logs");
    let checkpoint = tmp.path().join("checkpoint");
    let first = accelerator(&logs, &[TrackerKind::Jsonl]);
    for step in 1..=2u64 {
        first.log([(TRAIN_LOSS, step as f64)], step).unwrap();
    }
    first.save_state(&checkpoint).unwrap();
    for step in 3..=4u64 {
        first.log([(TRAIN_LOSS, step as f64)], step).unwrap();
    }
    first.end_training().unwrap();
    drop(first);
    let second = accelerator(&logs, &[TrackerKind::Jsonl]);
    second.load_state(&checkpoint).unwrap();
    for step in 3..=5u64 {
        second
            .log([(TRAIN_LOSS, 10.0 * step as f64)], step)
            .unwrap();
    }
    assert_eq!(jsonl_losses(&logs), RESUMED);
}
