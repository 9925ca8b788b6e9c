//! The names `report_to` takes (Hugging Face's `report_to`): `tensorboard`, `csv`, `jsonl`, and
//! `all` or `none`.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// A kind of tracker `report_to` can choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrackerKind {
    /// `metrics.jsonl`: one JSON object per log call, `{"step": N, "<name>": value, ...}`.
    Jsonl,
    /// `metrics.csv`: one row per log call, a column per metric name.
    Csv,
    /// `events.out.tfevents.*`: TensorBoard event files with a scalar per metric.
    TensorBoard,
}

impl TrackerKind {
    /// Every kind, in the order `all` opens them.
    pub const ALL: [TrackerKind; 3] = [Self::TensorBoard, Self::Csv, Self::Jsonl];

    /// The name `report_to` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Jsonl => "jsonl",
            Self::Csv => "csv",
            Self::TensorBoard => "tensorboard",
        }
    }
}

impl fmt::Display for TrackerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

const VALID: &str = "tensorboard, csv, jsonl, all or none";

impl FromStr for TrackerKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "jsonl" => Ok(Self::Jsonl),
            "csv" => Ok(Self::Csv),
            "tensorboard" => Ok(Self::TensorBoard),
            other => Err(Error::Config(format!(
                "unknown tracker {other:?} in report_to; expected {VALID}"
            ))),
        }
    }
}

/// Parses a `--report-to` value: comma-separated kinds (`"tensorboard,csv,jsonl"`), `all`, or
/// `none` (also the empty string) for no tracker. Repeated kinds count once.
pub fn parse_report_to(value: &str) -> Result<Vec<TrackerKind>> {
    let mut kinds = Vec::new();
    let items: Vec<&str> = value.split(',').map(str::trim).collect();
    for item in &items {
        let kind = match item.to_ascii_lowercase().as_str() {
            "" | "none" if items.len() == 1 => continue,
            "all" if items.len() == 1 => return Ok(TrackerKind::ALL.to_vec()),
            "" | "none" | "all" => {
                return Err(Error::Config(format!(
                    "report_to {value:?}: {item:?} cannot be combined with other trackers; \
                     give {VALID}"
                )))
            }
            _ => item.parse::<TrackerKind>()?,
        };
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    Ok(kinds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_to_lists_parse_in_order_and_refuse_unknown_names() {
        use TrackerKind::*;
        assert_eq!(
            parse_report_to("tensorboard,csv,jsonl").unwrap(),
            vec![TensorBoard, Csv, Jsonl]
        );
        assert_eq!(
            parse_report_to(" CSV , jsonl,csv").unwrap(),
            vec![Csv, Jsonl]
        );
        assert_eq!(
            parse_report_to("all").unwrap(),
            vec![TensorBoard, Csv, Jsonl]
        );
        assert!(parse_report_to("none").unwrap().is_empty());
        assert!(parse_report_to("").unwrap().is_empty());
        let err = parse_report_to("tensorboard,wandb")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"wandb\"") && err.contains("tensorboard, csv, jsonl"),
            "{err}"
        );
        let err = parse_report_to("none,csv").unwrap_err().to_string();
        assert!(err.contains("cannot be combined"), "{err}");
    }

    /// clap's `value_parser = parse_report_to` needs an error it can box as `Send + Sync`.
    #[test]
    fn the_parse_error_can_be_boxed_for_command_line_parsers() {
        fn boxable<E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>>(_: E) {}
        boxable(parse_report_to("bogus").unwrap_err());
    }
}
