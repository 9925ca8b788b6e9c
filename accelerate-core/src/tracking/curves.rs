//! The PNG `end_training` draws: the training (and evaluation) loss above, the learning rate
//! below, against the optimizer step. Drawn with plotters into memory, encoded with the `png`
//! crate and written atomically. Labels use DejaVu Sans cut down to ASCII (`fonts/`, made by
//! `scripts/subset-font.py`), embedded so the plot needs no system fonts.

use std::ops::Range;
use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::FontStyle;

use super::{EVAL_LOSS, TRAIN_LEARNING_RATE, TRAIN_LOSS};
use crate::error::{Error, Result};
use crate::files::write_atomic;

/// Width of the PNG in pixels.
pub(crate) const WIDTH: u32 = 1000;
/// Height of the PNG in pixels.
pub(crate) const HEIGHT: u32 = 800;

/// The family name the embedded font is registered under (a name of our own, so that a user's
/// plotters fonts are left alone).
const FONT: &str = "accelerate-rs-dejavu-sans";
static FONT_BYTES: &[u8] = include_bytes!("fonts/DejaVuSans-ASCII.ttf");

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bytes are a valid font (a test draws with them), so this cannot fail.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES);
    });
}

/// Colors of the series: matplotlib's first three (blue, orange, green).
const TRAIN_COLOR: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
const EVAL_COLOR: RGBColor = RGBColor(0xff, 0x7f, 0x0e);
const LR_COLOR: RGBColor = RGBColor(0x2c, 0xa0, 0x2c);

/// The finite points of a series, as f64 pairs in step order (a resumed run may log a step
/// again after later ones; a line drawn in logging order would run back).
fn finite(series: &[(u64, f64)]) -> Vec<(f64, f64)> {
    let mut points: Vec<(f64, f64)> = series
        .iter()
        .filter(|(_, v)| v.is_finite())
        .map(|&(s, v)| (s as f64, v))
        .collect();
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    points
}

/// A range holding every value with a 5% margin; a single value gets a range around it.
fn padded(values: impl Iterator<Item = f64>) -> Range<f64> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        return 0.0..1.0;
    }
    let margin = if hi > lo {
        (hi - lo) * 0.05
    } else if lo != 0.0 {
        lo.abs() * 0.1
    } else {
        1.0
    };
    (lo - margin)..(hi + margin)
}

/// The label of an x tick: steps are whole numbers, so a tick between two (plotters puts them
/// at halves over a short range) gets none rather than a rounded duplicate.
fn step_label(v: &f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        String::new()
    }
}

/// One curve: its name, its color and its points.
type Series<'a> = (&'a str, RGBColor, Vec<(f64, f64)>);

/// Draws one panel: `series` over the common step range.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    steps: Range<f64>,
    series: &[Series<'_>],
    y_format: fn(&f64) -> String,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let y = padded(
        series
            .iter()
            .flat_map(|(_, _, p)| p.iter().map(|&(_, v)| v)),
    );
    let title = if series.iter().all(|(_, _, p)| p.is_empty()) {
        format!("{title} (not logged)")
    } else {
        title.to_string()
    };
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FONT, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(steps, y)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .y_label_formatter(&y_format)
        .x_label_formatter(&step_label)
        .draw()?;
    let mut labelled = false;
    for (name, color, points) in series {
        if points.is_empty() {
            continue;
        }
        let color = *color;
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        labelled = true;
    }
    if labelled {
        chart
            .configure_series_labels()
            .label_font((FONT, 14))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
    }
    Ok(())
}

/// Draws the loss and learning-rate curves to `path` (PNG, [`WIDTH`] × [`HEIGHT`]).
pub(super) fn draw_png(
    path: &Path,
    train_loss: &[(u64, f64)],
    eval_loss: &[(u64, f64)],
    learning_rate: &[(u64, f64)],
) -> Result<()> {
    register_font();
    let loss = [
        (TRAIN_LOSS, TRAIN_COLOR, finite(train_loss)),
        (EVAL_LOSS, EVAL_COLOR, finite(eval_loss)),
    ];
    let lr = [(TRAIN_LEARNING_RATE, LR_COLOR, finite(learning_rate))];
    let all_steps = loss
        .iter()
        .chain(&lr)
        .flat_map(|(_, _, p)| p.iter().map(|&(s, _)| s));
    let steps = padded(all_steps);
    let mut pixels = vec![0u8; (WIDTH * HEIGHT * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (WIDTH, HEIGHT)).into_drawing_area();
        let drawn = (|| {
            root.fill(&WHITE)?;
            let (top, bottom) = root.split_vertically(HEIGHT / 2);
            panel(&top, "loss", steps.clone(), &loss, |v| format!("{v:.3}"))?;
            panel(&bottom, "learning rate", steps.clone(), &lr, |v| {
                format!("{v:.2e}")
            })?;
            root.present()
        })();
        drawn.map_err(|e| Error::Tracking {
            path: path.to_path_buf(),
            problem: format!("drawing the training curves failed: {e}"),
        })?;
    }
    let mut encoded = Vec::new();
    let mut encoder = png::Encoder::new(&mut encoded, WIDTH, HEIGHT);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder
        .write_header()
        .and_then(|mut writer| writer.write_image_data(&pixels))
        .map_err(|e| Error::Tracking {
            path: path.to_path_buf(),
            problem: format!("encoding the training curves as PNG failed: {e}"),
        })?;
    write_atomic(path, &encoded).map_err(|e| Error::Tracking {
        path: path.to_path_buf(),
        problem: format!(
            "writing the training curves failed ({e}); check that the logging directory is \
             writable and has free space, or choose another `logging_dir`"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes a PNG into (width, height, RGB pixels).
    pub(crate) fn decode(path: &Path) -> (u32, u32, Vec<u8>) {
        let bytes = std::fs::read(path).unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        buf.truncate(info.buffer_size());
        (info.width, info.height, buf)
    }

    /// How many pixels have exactly `color`.
    pub(crate) fn count(pixels: &[u8], color: RGBColor) -> usize {
        pixels
            .chunks_exact(3)
            .filter(|p| p == &[color.0, color.1, color.2])
            .count()
    }

    #[test]
    fn the_png_has_its_size_and_every_series_in_its_color() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("curves.png");
        let loss: Vec<(u64, f64)> = (0..50)
            .map(|s| (s, 3.0 * (-(s as f64) / 20.0).exp()))
            .collect();
        let eval = vec![(10, 2.0), (20, 1.5), (49, 1.0), (30, f64::NAN)];
        let lr: Vec<(u64, f64)> = (0..50).map(|s| (s, 1e-3 * (s as f64 / 49.0))).collect();
        draw_png(&path, &loss, &eval, &lr).unwrap();
        let (w, h, pixels) = decode(&path);
        assert_eq!((w, h), (WIDTH, HEIGHT));
        // Not blank: each curve's color covers at least a line's worth of pixels (hundreds).
        for color in [TRAIN_COLOR, EVAL_COLOR, LR_COLOR] {
            assert!(
                count(&pixels, color) > 200,
                "{color:?}: {}",
                count(&pixels, color)
            );
        }
        // Mostly white background, but not only.
        let white = count(&pixels, WHITE);
        assert!(
            white > pixels.len() / 6 && white < pixels.len() / 3,
            "{white}"
        );
    }

    #[test]
    fn step_ticks_are_labelled_with_whole_steps_only() {
        // Plotters puts ticks at halves over a short range (4.5..8.5); `{:.0}` labelled them
        // 5 6 6 6 7 8 8 (round half to even).
        let labels: Vec<String> = [5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0]
            .iter()
            .map(step_label)
            .collect();
        assert_eq!(labels, ["5", "", "6", "", "7", "", "8"]);
    }

    #[test]
    fn a_single_point_and_missing_series_still_draw() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("curves.png");
        draw_png(&path, &[(5, 0.0)], &[], &[]).unwrap();
        let (w, h, pixels) = decode(&path);
        assert_eq!((w, h), (WIDTH, HEIGHT));
        assert!(count(&pixels, TRAIN_COLOR) > 0, "the single point is drawn");
    }
}
