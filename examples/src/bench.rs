//! Statistics shared by the benchmark programs.

use std::fmt;

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
}
