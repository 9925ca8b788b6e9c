//! Statistics and child-process plumbing shared by the benchmark programs, the synthetic token
//! data of the step benchmark ([`synthetic`]), its FLOPs formula ([`mfu`]) and what it reads from
//! the GPU ([`gpu_probe`]), and its result line's non-finite floats ([`json_float`]).

pub mod gpu_probe;
pub mod json_float;
pub mod mfu;
pub mod synthetic;

use std::fmt;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// The median of `values` (the upper one of the middle two for an even count); NaN when empty.
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The extra time of one configuration over another, from rounds in which both ran back to back.
/// Each round's ratio cancels the slow drift of a shared machine; the quartiles of the per-round
/// ratios say how far the figure can be trusted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overhead {
    /// `median(measured) / median(baseline) - 1`, in percent.
    pub of_medians: f64,
    /// Median of the per-round `measured / baseline - 1`, in percent.
    pub median: f64,
    /// Lower quartile of the per-round figures, in percent.
    pub lower_quartile: f64,
    /// Upper quartile of the per-round figures, in percent.
    pub upper_quartile: f64,
    /// Rounds compared.
    pub rounds: usize,
}

impl Overhead {
    /// Compares `measured[i]` with `baseline[i]` (times of round `i`).
    pub fn new(measured: &[f64], baseline: &[f64]) -> Self {
        assert_eq!(measured.len(), baseline.len(), "one time per round each");
        let mut per_round: Vec<f64> = measured
            .iter()
            .zip(baseline)
            .map(|(m, b)| (m / b - 1.0) * 100.0)
            .collect();
        per_round.sort_by(f64::total_cmp);
        let quartile = |q: usize| {
            if per_round.is_empty() {
                f64::NAN
            } else {
                per_round[(per_round.len() - 1) * q / 4]
            }
        };
        Self {
            of_medians: (median(measured) / median(baseline) - 1.0) * 100.0,
            median: median(&per_round),
            lower_quartile: quartile(1),
            upper_quartile: quartile(3),
            rounds: per_round.len(),
        }
    }
}

impl fmt::Display for Overhead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:+.2}% (ratio of medians); per round: median {:+.2}%, quartiles {:+.2}% to {:+.2}%, \
             {} rounds",
            self.of_medians, self.median, self.lower_quartile, self.upper_quartile, self.rounds
        )
    }
}

/// Runs `cmd` with its standard output captured (standard error passes through) and returns its
/// exit status and output, or `None` when it ran longer than `timeout` (it is then killed).
/// The output is read on a thread while the child runs, so a chatty child cannot fill the pipe
/// and stall.
pub fn run_within(cmd: &mut Command, timeout: Duration) -> Result<Option<(ExitStatus, String)>> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    let mut stdout = child.stdout.take().context("the child's standard output")?;
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
        out
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok(Some((status, reader.join().unwrap_or_default())))
}

/// The number after `key=` in a child's `key=value` report; `what` names the child in the error.
pub fn report_value(report: &str, key: &str, what: &str) -> Result<f64> {
    report
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {key}= in {what}'s report:\n{report}"))
}

/// `VmHWM` (peak resident set) of this process in KiB.
pub fn peak_resident_kib() -> Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status").context("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM line in /proc/self/status (Linux only)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overhead_of_hand_computed_rounds() {
        // Per-round ratios: +10 %, 0 %, -10 %, +20 %, +5 %; sorted -10, 0, 5, 10, 20.
        let baseline = [10.0, 20.0, 10.0, 5.0, 20.0];
        let measured = [11.0, 20.0, 9.0, 6.0, 21.0];
        let o = Overhead::new(&measured, &baseline);
        assert!((o.median - 5.0).abs() < 1e-9, "{o}");
        assert!((o.lower_quartile - 0.0).abs() < 1e-9, "{o}");
        assert!((o.upper_quartile - 10.0).abs() < 1e-9, "{o}");
        // Medians: measured 11, baseline 10.
        assert!((o.of_medians - 10.0).abs() < 1e-9, "{o}");
        assert_eq!(o.rounds, 5);
        assert!(median(&[]).is_nan());
        assert_eq!(median(&[3.0, 1.0, 2.0, 4.0]), 3.0);
    }

    #[test]
    fn report_values_are_read_by_key() {
        let report = "[rank 0] step_ms=12.5 buckets=5 overlap=x";
        assert_eq!(report_value(report, "step_ms", "the run").unwrap(), 12.5);
        assert_eq!(report_value(report, "buckets", "the run").unwrap(), 5.0);
        let missing = report_value(report, "sync_ms", "the run").unwrap_err();
        assert!(missing
            .to_string()
            .contains("no sync_ms= in the run's report"));
        assert!(report_value(report, "overlap", "the run").is_err());
    }
}
