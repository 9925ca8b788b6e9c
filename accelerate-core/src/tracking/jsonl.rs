//! The `jsonl` tracker: `metrics.jsonl`, one JSON object per log call, `{"step": N, "<name>":
//! value, ...}` with the names in the order they were logged. A value that is not finite
//! (NaN, ±inf) has no JSON number and is written as `null` (pandas reads it as NaN). A file from
//! an earlier run (a resumed one) is appended to.

use std::path::Path;

use super::append::AppendFile;
use super::Tracker;
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

impl Tracker for JsonlTracker {
    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        self.file.append(line(step, metrics).as_bytes())
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
