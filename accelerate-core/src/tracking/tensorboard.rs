//! The `tensorboard` tracker: an event file `events.out.tfevents.<seconds>.<host>.<pid>.<n>` in
//! the logging directory, as TensorBoard and PyTorch's `SummaryWriter` name them (each run starts
//! a file of its own; TensorBoard merges a directory's files). Its first event carries the file
//! version `brain.Event:2`; each log call is one event at its step holding a `simple_value`
//! scalar per metric (f32, TensorBoard's precision), which TensorBoard's scalar dashboard and
//! `EventAccumulator.Scalars(tag)` read. The first step logged after a resume is preceded by a
//! `SessionLog` START event at that step, as PyTorch's `SummaryWriter(purge_step=)` writes: the
//! readers then drop what earlier files hold at that step and later.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::append::AppendFile;
use super::event_record::{
    event_record, Event, SessionLog, Summary, SummaryValue, FILE_VERSION, SESSION_START,
};
use super::run_dir::host_name;
use super::Tracker;
use crate::error::Result;

/// Writes one event per log call to a TensorBoard event file.
#[derive(Debug)]
pub(super) struct TensorBoardTracker {
    file: AppendFile,
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl TensorBoardTracker {
    pub(super) fn create(dir: &Path) -> Result<Self> {
        // The pid and a counter keep two trackers of one second apart (PyTorch's suffix).
        static FILES: AtomicU64 = AtomicU64::new(0);
        let now = wall_time();
        let name = format!(
            "events.out.tfevents.{:010}.{}.{}.{}",
            now as u64,
            host_name(),
            std::process::id(),
            FILES.fetch_add(1, Ordering::Relaxed)
        );
        let mut file = AppendFile::open(&dir.join(name), true)?;
        file.append(&event_record(&Event {
            wall_time: now,
            step: 0,
            file_version: Some(FILE_VERSION.to_string()),
            summary: None,
            session_log: None,
        }))?;
        Ok(Self { file })
    }

    /// The event file's path.
    #[cfg(test)]
    pub(super) fn path(&self) -> &Path {
        self.file.path()
    }
}

impl Tracker for TensorBoardTracker {
    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        let event = Event {
            wall_time: wall_time(),
            step: i64::try_from(step).unwrap_or(i64::MAX),
            file_version: None,
            summary: Some(Summary {
                value: metrics
                    .iter()
                    .map(|(tag, value)| SummaryValue {
                        tag: tag.clone(),
                        simple_value: Some(*value as f32),
                    })
                    .collect(),
            }),
            session_log: None,
        };
        self.file.append(&event_record(&event))
    }

    fn finish(&mut self) -> Result<()> {
        self.file.sync()
    }

    fn purge_from(&mut self, step: u64) -> Result<()> {
        self.file.append(&event_record(&Event {
            wall_time: wall_time(),
            step: i64::try_from(step).unwrap_or(i64::MAX),
            file_version: None,
            summary: None,
            session_log: Some(SessionLog {
                status: SESSION_START,
            }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::super::event_record::unframe;
    use super::*;

    fn logged() -> Vec<(u64, Vec<(String, f64)>)> {
        (1..=4u64)
            .map(|step| {
                let mut metrics = vec![
                    ("train/loss".to_string(), 3.0 / step as f64),
                    ("train/learning_rate".to_string(), 1e-3 * step as f64),
                ];
                if step % 2 == 0 {
                    metrics.push(("eval/loss".to_string(), 10.0 + step as f64));
                }
                (step, metrics)
            })
            .collect()
    }

    fn write_events(dir: &Path) -> std::path::PathBuf {
        let mut tracker = TensorBoardTracker::create(dir).unwrap();
        for (step, metrics) in logged() {
            tracker.log(step, &metrics).unwrap();
        }
        tracker.finish().unwrap();
        tracker.path().to_path_buf()
    }

    #[test]
    fn the_records_decode_to_the_version_then_the_logged_scalars() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_events(dir.path());
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let records = unframe(&std::fs::read(&path).unwrap()).unwrap();
        let events: Vec<Event> = records
            .iter()
            .map(|r| <Event as prost::Message>::decode(r.as_slice()).unwrap())
            .collect();
        assert_eq!(events.len(), 5);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        for (event, (step, metrics)) in events[1..].iter().zip(logged()) {
            assert_eq!(event.step, step as i64);
            assert!(event.wall_time > 1.6e9, "wall time in seconds since 1970");
            let values = &event.summary.as_ref().unwrap().value;
            let got: Vec<(String, f32)> = values
                .iter()
                .map(|v| (v.tag.clone(), v.simple_value.unwrap()))
                .collect();
            let want: Vec<(String, f32)> = metrics
                .iter()
                .map(|(n, v)| (n.clone(), *v as f32))
                .collect();
            assert_eq!(got, want);
        }
    }

    const READER: &str = r#"
import json, sys
try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as e:
    print("MISSING", e)
    sys.exit(0)
acc = EventAccumulator(sys.argv[1])
acc.Reload()
print(json.dumps({tag: [[s.step, s.value] for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}))
"#;

    /// Where CI sets `ACCELERATE_REQUIRE_TENSORBOARD=1`, a missing reader fails the test
    /// instead of skipping it.
    fn skip(reason: &str) {
        let required = std::env::var("ACCELERATE_REQUIRE_TENSORBOARD").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "ACCELERATE_REQUIRE_TENSORBOARD=1 but {reason}; `pip install tensorboard`"
        );
        eprintln!("skipped: {reason}; `pip install tensorboard` to run TensorBoard's own reader");
    }

    #[test]
    fn tensorboards_own_reader_reads_the_logged_scalars() {
        let dir = tempfile::tempdir().unwrap();
        write_events(dir.path());
        let output = match std::process::Command::new("python3")
            .arg("-c")
            .arg(READER)
            .arg(dir.path())
            .output()
        {
            Ok(output) => output,
            Err(e) => {
                skip(&format!("no python3 on PATH ({e})"));
                return;
            }
        };
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "reader failed: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        if stdout.starts_with("MISSING") {
            skip(&format!(
                "python3 has no tensorboard package ({})",
                stdout.trim()
            ));
            return;
        }
        let scalars: std::collections::BTreeMap<String, Vec<(i64, f32)>> =
            serde_json::from_str(stdout.trim()).unwrap();
        let mut want: std::collections::BTreeMap<String, Vec<(i64, f32)>> = Default::default();
        for (step, metrics) in logged() {
            for (name, value) in metrics {
                // simple_value is an f32; the reader widens it, JSON carries it exactly.
                want.entry(name)
                    .or_default()
                    .push((step as i64, value as f32));
            }
        }
        assert_eq!(scalars, want);
    }
}
