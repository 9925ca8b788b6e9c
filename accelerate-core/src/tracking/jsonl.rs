//! The `jsonl` tracker: `metrics.jsonl`, one JSON object per log call, `{"step": N, "<name>":
//! value, ...}` with the names in the order they were logged. A value that is not finite
//! (NaN, ±inf) has no JSON number and is written as `null` (pandas reads it as NaN). A file from
//! an earlier run (a resumed one) is appended to, after the lines of the steps the resumed run
//! logs again are dropped.

use std::path::Path;

use super::append::AppendFile;
use super::{io_error, Curves, Tracker};
use crate::error::Result;

/// File name of the JSON Lines tracker in the logging directory.
pub(super) const FILE: &str = "metrics.jsonl";

/// Appends one JSON object per log call to `metrics.jsonl`.
#[derive(Debug)]
pub(super) struct JsonlTracker {
    file: AppendFile,
}

impl JsonlTracker {
    pub(super) fn open(dir: &Path) -> Result<Self> {
        Ok(Self {
            file: AppendFile::open(&dir.join(FILE), false)?,
        })
    }
}

/// `{"step":N,"name":value,...}\n`, keys in the order given.
fn line(step: u64, metrics: &[(String, f64)]) -> String {
    let mut line = format!("{{\"step\":{step}");
    for (name, value) in metrics {
        // Strings and numbers through serde_json, so escapes and float formatting are JSON's.
        let name = serde_json::Value::from(name.as_str());
        let value = serde_json::Value::from(*value); // non-finite becomes null
        line.push_str(&format!(",{name}:{value}"));
    }
    line.push_str("}\n");
    line
}

/// The step of a line, `None` for a line that is not one of ours.
fn step_of(line: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(line).ok()?["step"].as_u64()
}

impl JsonlTracker {
    fn read(&self) -> Result<String> {
        let path = self.file.path();
        std::fs::read_to_string(path).map_err(|e| io_error(path, "reading the file back", e))
    }
}

impl Tracker for JsonlTracker {
    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        self.file.append(line(step, metrics).as_bytes())
    }

    fn purge_from(&mut self, step: u64) -> Result<()> {
        let text = self.read()?;
        let kept: String = text
            .split_inclusive('\n')
            .filter(|line| step_of(line).is_none_or(|s| s < step))
            .collect();
        if kept.len() == text.len() {
            return Ok(());
        }
        self.file.rewrite(kept.as_bytes())
    }

    fn read_curves(&self) -> Option<Result<Curves>> {
        let text = match self.read() {
            Ok(text) => text,
            Err(e) => return Some(Err(e)),
        };
        let mut curves = Curves::default();
        for line in text.lines() {
            let Ok(serde_json::Value::Object(object)) = serde_json::from_str(line) else {
                continue;
            };
            let Some(step) = object.get("step").and_then(serde_json::Value::as_u64) else {
                continue;
            };
            // null (a non-finite value) has no f64 and is left out, as the plot leaves it out.
            curves.add(
                step,
                object
                    .iter()
                    .filter_map(|(name, value)| Some((name.as_str(), value.as_f64()?))),
            );
        }
        Some(Ok(curves))
    }

    fn finish(&mut self) -> Result<()> {
        self.file.sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_json_objects_in_logged_order_with_null_for_nan() {
        let metrics = vec![
            ("train/loss".to_string(), 0.25),
            ("a \"quoted\" name".to_string(), f64::NAN),
            ("train/learning_rate".to_string(), 3e-4),
        ];
        let text = line(7, &metrics);
        assert_eq!(
            text,
            "{\"step\":7,\"train/loss\":0.25,\"a \\\"quoted\\\" name\":null,\
             \"train/learning_rate\":0.0003}\n"
        );
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(parsed["step"], 7);
        assert_eq!(parsed["train/learning_rate"], 3e-4);
    }
}
