//! The `csv` tracker: `metrics.csv`, one row per log call, `step` and then one column per metric
//! name in the order the names first appeared; a metric a call did not log is an empty cell.
//!
//! Wide rather than long (`step,tag,value`), because that is the table pandas users get from
//! Hugging Face's `log_history` (`pd.DataFrame(trainer.state.log_history)`): `pd.read_csv` gives
//! a column per metric, empty cells read as NaN, and `df.plot(x="step", y="train/loss")` works
//! as it is. A name that first appears mid-run widens the table: the file is rewritten
//! atomically (temporary file, fsync, rename) with the new header and an empty cell added to
//! every earlier row, so at any moment the file is a complete table. Each widening costs a
//! rewrite of the whole file, so a run whose names keep appearing (k new names over n rows)
//! writes O(k·n) bytes; the usual handful (the first evaluation, say) costs little. A file from
//! an earlier run (a resumed one) is continued with its columns, after the rows of the steps the
//! resumed run logs again are dropped.

use std::path::Path;

use super::append::AppendFile;
use super::{io_error, Curves, Tracker};
use crate::error::{Error, Result};

/// File name of the CSV tracker in the logging directory.
pub(super) const FILE: &str = "metrics.csv";

/// Appends one row per log call to `metrics.csv`, widening the table for new names.
#[derive(Debug)]
pub(super) struct CsvTracker {
    file: AppendFile,
    /// The metric columns after `step`, as in the header on disk (empty before the first row).
    columns: Vec<String>,
}

/// One CSV record with the `csv` crate's quoting (names may hold commas and quotes).
fn record<I, T>(fields: I) -> Vec<u8>
where
    I: IntoIterator<Item = T>,
    T: AsRef<[u8]>,
{
    let mut writer = csv::WriterBuilder::new()
        .terminator(csv::Terminator::Any(b'\n'))
        .from_writer(Vec::new());
    writer
        .write_record(fields)
        .expect("writing CSV into memory cannot fail");
    writer
        .into_inner()
        .expect("flushing into memory cannot fail")
}

/// A cell for `value`: the shortest form that reads back as the same f64, with an exponent
/// where that is shorter (`5e-324`, `1e-7`), integers without `.0`; NaN, inf and -inf as
/// pandas reads them.
fn number(value: f64) -> String {
    let mut buffer = ryu::Buffer::new();
    let text = buffer.format(value);
    text.strip_suffix(".0").unwrap_or(text).to_string()
}

fn header(columns: &[String]) -> Vec<u8> {
    record(std::iter::once("step").chain(columns.iter().map(String::as_str)))
}

impl CsvTracker {
    pub(super) fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(FILE);
        let file = AppendFile::open(&path, false)?;
        let columns = if file.len() == 0 {
            Vec::new()
        } else {
            Self::read_columns(&path)?
        };
        Ok(Self { file, columns })
    }

    /// The metric columns of an existing file's header, which must start with `step`.
    fn read_columns(path: &Path) -> Result<Vec<String>> {
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(false)
            .from_path(path)
            .map_err(|e| Self::foreign(path, &e.to_string()))?;
        let mut first = csv::StringRecord::new();
        match reader.read_record(&mut first) {
            Ok(true) if first.get(0) == Some("step") => {
                Ok(first.iter().skip(1).map(str::to_string).collect())
            }
            Ok(_) => Err(Self::foreign(path, "its header does not start with `step`")),
            Err(e) => Err(Self::foreign(path, &e.to_string())),
        }
    }

    fn foreign(path: &Path, problem: &str) -> Error {
        Error::Tracking {
            path: path.to_path_buf(),
            problem: format!(
                "cannot continue this file as a metrics table ({problem}); move it away or \
                 choose another `logging_dir`"
            ),
        }
    }

    /// Rewrites the file with `added` columns appended to the header and an empty cell for
    /// each appended to every row (the rows were written by this tracker: one line each, with
    /// exactly the old number of cells).
    fn widen(&mut self, added: &[String]) -> Result<()> {
        let path = self.file.path().to_path_buf();
        let mut columns = self.columns.clone();
        columns.extend(added.iter().cloned());
        let mut text = header(&columns);
        if self.file.len() > 0 {
            let old = std::fs::read(&path)
                .map_err(|e| io_error(&path, "reading the table to widen it", e))?;
            // The header never holds a newline (names are printable), so it is the first line.
            let rows_start = old
                .iter()
                .position(|&b| b == b'\n')
                .map_or(old.len(), |i| i + 1);
            let padding = ",".repeat(added.len());
            for row in old[rows_start..].split_inclusive(|&b| b == b'\n') {
                let row = row.strip_suffix(b"\n").unwrap_or(row);
                text.extend_from_slice(row);
                text.extend_from_slice(padding.as_bytes());
                text.push(b'\n');
            }
        }
        // Once the rewrite is in place the columns are those on disk, whatever comes next.
        self.file.rewrite(&text)?;
        self.columns = columns;
        Ok(())
    }
}

impl Tracker for CsvTracker {
    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        let added: Vec<String> = metrics
            .iter()
            .filter(|(name, _)| !self.columns.contains(name))
            .map(|(name, _)| name.clone())
            .collect();
        if !added.is_empty() || self.file.len() == 0 {
            self.widen(&added)?;
        }
        let mut cells = vec![step.to_string()];
        cells.extend(self.columns.iter().map(|column| {
            metrics
                .iter()
                .find(|(name, _)| name == column)
                .map_or_else(String::new, |(_, value)| number(*value))
        }));
        self.file.append(&record(&cells))
    }

    fn finish(&mut self) -> Result<()> {
        self.file.sync()
    }

    fn purge_from(&mut self, step: u64) -> Result<()> {
        let path = self.file.path().to_path_buf();
        let old = std::fs::read(&path).map_err(|e| io_error(&path, "reading the table back", e))?;
        // Rows are one line each (names are printable, numbers plain), the step first.
        let mut lines = old.split_inclusive(|&b| b == b'\n');
        let mut kept: Vec<u8> = lines.next().unwrap_or_default().to_vec();
        for row in lines {
            let first = row.split(|&b| b == b',').next().unwrap_or_default();
            let row_step = std::str::from_utf8(first)
                .ok()
                .and_then(|s| s.parse::<u64>().ok());
            if row_step.is_none_or(|s| s < step) {
                kept.extend_from_slice(row);
            }
        }
        if kept.len() == old.len() {
            return Ok(());
        }
        self.file.rewrite(&kept)
    }

    fn read_curves(&self) -> Option<Result<Curves>> {
        let path = self.file.path();
        let mut reader = match csv::Reader::from_path(path) {
            Ok(reader) => reader,
            Err(e) => return Some(Err(Self::foreign(path, &e.to_string()))),
        };
        let mut curves = Curves::default();
        for row in reader.records() {
            let Ok(row) = row else { continue };
            let Some(step) = row.get(0).and_then(|s| s.parse::<u64>().ok()) else {
                continue;
            };
            curves.add(
                step,
                self.columns
                    .iter()
                    .zip(row.iter().skip(1))
                    .filter_map(|(name, cell)| Some((name.as_str(), cell.parse::<f64>().ok()?))),
            );
        }
        Some(Ok(curves))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(path: &Path) -> Vec<Vec<String>> {
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(false)
            .from_path(path)
            .unwrap();
        reader
            .records()
            .map(|r| r.unwrap().iter().map(str::to_string).collect())
            .collect()
    }

    fn metrics(pairs: &[(&str, f64)]) -> Vec<(String, f64)> {
        pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect()
    }

    #[test]
    fn a_new_name_mid_run_widens_every_row_and_a_reopened_file_continues() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = CsvTracker::open(dir.path()).unwrap();
        t.log(
            1,
            &metrics(&[("train/loss", 2.5), ("train/learning_rate", 0.001)]),
        )
        .unwrap();
        t.log(2, &metrics(&[("train/loss", 2.0)])).unwrap();
        t.log(2, &metrics(&[("eval/loss", 2.25), ("a,b", f64::NAN)]))
            .unwrap();
        drop(t);
        let mut t = CsvTracker::open(dir.path()).unwrap();
        t.log(3, &metrics(&[("train/learning_rate", 0.0005)]))
            .unwrap();
        let path = dir.path().join(FILE);
        let s = |v: &[&str]| v.iter().map(|c| c.to_string()).collect::<Vec<_>>();
        assert_eq!(
            rows(&path),
            vec![
                s(&[
                    "step",
                    "train/loss",
                    "train/learning_rate",
                    "eval/loss",
                    "a,b"
                ]),
                s(&["1", "2.5", "0.001", "", ""]),
                s(&["2", "2", "", "", ""]),
                s(&["2", "", "", "2.25", "NaN"]),
                s(&["3", "", "0.0005", "", ""]),
            ]
        );
        // No temporary file of the rewrite is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(FILE)]);
    }

    #[test]
    fn numbers_are_the_shortest_round_trip_with_an_exponent_when_shorter() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = CsvTracker::open(dir.path()).unwrap();
        let values = [5e-324, 1e-7, 1.0, -2.5e20, 0.1, f64::INFINITY, f64::NAN];
        let names: Vec<String> = (0..values.len()).map(|i| format!("m{i}")).collect();
        let logged: Vec<(String, f64)> = names.iter().cloned().zip(values).collect();
        t.log(1, &logged).unwrap();
        let table = rows(&dir.path().join(FILE));
        assert_eq!(
            table[1],
            ["1", "5e-324", "1e-7", "1", "-2.5e20", "0.1", "inf", "NaN"]
        );
        // Each cell reads back as the value logged (pandas and Rust parse these alike).
        for (cell, value) in table[1][1..].iter().zip(values) {
            let back: f64 = cell.parse().unwrap();
            assert!(back == value || (back.is_nan() && value.is_nan()), "{cell}");
        }
    }

    #[test]
    fn a_widening_whose_reopen_failed_is_not_redone_and_loses_no_row() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = CsvTracker::open(dir.path()).unwrap();
        t.log(1, &metrics(&[("a", 1.0)])).unwrap();
        // The rewrite's rename succeeds, the reopen after it fails once.
        super::super::append::FAILING_OPENS.with(|n| n.set(1));
        let _ = t.log(2, &metrics(&[("a", 2.0), ("b", 3.0)]));
        t.log(3, &metrics(&[("a", 4.0), ("b", 5.0)])).unwrap();
        let s = |v: &[&str]| v.iter().map(|c| c.to_string()).collect::<Vec<_>>();
        assert_eq!(
            rows(&dir.path().join(FILE)),
            vec![
                s(&["step", "a", "b"]),
                s(&["1", "1", ""]),
                s(&["2", "2", "3"]),
                s(&["3", "4", "5"]),
            ]
        );
    }

    #[test]
    fn a_file_that_is_not_a_metrics_table_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE), "epoch,loss\n1,2\n").unwrap();
        let err = CsvTracker::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains(FILE) && err.contains("`step`"), "{err}");
        assert!(err.contains("logging_dir"), "{err}");
    }
}
