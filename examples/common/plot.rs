//! The PNG of a comparison run (plotters, bitmap backend): training-loss curves per run on
//! the left, loss-scale trajectories (log axis) on the right.
//!
//! Text needs a font: plotters is built with its `ab_glyph` feature (pure Rust, no system
//! font libraries) and this module registers DejaVu Sans from Debian's `fonts-dejavu-core`
//! (`scripts/setup-data.sh` installs it), or the TTF named by `TCH_AMP_FONT`. Without a font
//! the plot is drawn without any text (no titles, tick labels or legend) rather than failing.
use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

/// Where Debian's `fonts-dejavu-core` puts DejaVu Sans.
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// One curve pair: a name, the loss and the loss scale of each step.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend entry (e.g. the opt level).
    pub name: String,
    /// Loss per step (non-finite values are left out).
    pub losses: Vec<f64>,
    /// Loss scale per step.
    pub scales: Vec<f64>,
    /// Index into the palette (black, blue, red, green, purple, orange), so that a level
    /// keeps its colour whichever levels are drawn.
    pub color: usize,
}

/// Registers the font once; false when it cannot be read or parsed.
pub fn register_font() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        let path = std::env::var("TCH_AMP_FONT").unwrap_or_else(|_| DEFAULT_FONT.to_string());
        let Ok(bytes) = std::fs::read(&path) else { return false };
        // plotters keeps a &'static reference to the font data: leak it once.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
    })
}

const COLORS: [RGBColor; 6] =
    [RGBColor(0, 0, 0), RGBColor(31, 119, 180), RGBColor(214, 39, 40), RGBColor(44, 160, 44), RGBColor(148, 103, 189), RGBColor(255, 127, 14)];

/// Line width of the `i`-th of `n` loss-scale series: earlier series are drawn wider, so that
/// a later one lying on top of it (O2's scale on O1's, O3's on O0's) leaves it visible as a
/// border.
fn width(i: usize, n: usize) -> u32 {
    2 + 2 * (n.saturating_sub(1 + i)) as u32
}

/// Moving average over `w` steps of the finite values, as (step, value) points.
fn smooth(v: &[f64], w: usize) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    let mut window: std::collections::VecDeque<f64> = std::collections::VecDeque::new();
    let mut sum = 0.0;
    for (i, &x) in v.iter().enumerate() {
        if !x.is_finite() {
            continue;
        }
        window.push_back(x);
        sum += x;
        if window.len() > w {
            sum -= window.pop_front().unwrap_or(0.0);
        }
        out.push((i as f64, sum / window.len() as f64));
    }
    out
}

/// Draws `series` into the PNG `path` (1200x500). `with_text` false draws no text at all
/// (for a machine without the font). Returns whether text was drawn.
///
/// # Errors
/// The PNG cannot be written.
pub fn plot(path: &Path, title: &str, series: &[Series], with_text: bool) -> Result<bool> {
    draw(path, title, series, with_text).map_err(|e| anyhow!("{}: cannot draw the plot: {e}", path.display()))?;
    Ok(with_text)
}

/// [`plot`] with text when the font can be registered.
///
/// # Errors
/// As [`plot`].
pub fn plot_auto(path: &Path, title: &str, series: &[Series]) -> Result<bool> {
    plot(path, title, series, register_font())
}

/// A grey border around a plotting area (the text-free stand-in for the mesh and its labels).
fn frame<DB: DrawingBackend, X: Ranged, Y: Ranged>(
    area: &DrawingArea<DB, plotters::coord::cartesian::Cartesian2d<X, Y>>,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let (w, h) = area.dim_in_pixel();
    let base = area.strip_coord_spec();
    base.draw(&Rectangle::new([(0, 0), (w as i32 - 1, h as i32 - 1)], RGBColor(120, 120, 120).stroke_width(1)))?;
    Ok(())
}

fn draw(path: &Path, title: &str, series: &[Series], text: bool) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = if text { root.titled(title, ("sans-serif", 22))? } else { root };
    let (left, right) = root.split_horizontally(600);

    let steps = series.iter().map(|s| s.losses.len().max(s.scales.len())).max().unwrap_or(1).max(2) as f64;
    let w = (steps as usize / 40).max(1);
    let curves: Vec<Vec<(f64, f64)>> = series.iter().map(|s| smooth(&s.losses, w)).collect();
    let ymax = curves.iter().flatten().map(|p| p.1).fold(0.0f64, f64::max).max(1e-3) * 1.05;

    let label_area = if text { 45 } else { 0 };
    let mut b = ChartBuilder::on(&left);
    b.margin(12).x_label_area_size(label_area).y_label_area_size(label_area + 10);
    if text {
        b.caption(format!("training loss (moving average of {w} steps)"), ("sans-serif", 16));
    }
    let mut chart = b.build_cartesian_2d(0f64..steps, 0f64..ymax)?;
    if text {
        chart.configure_mesh().x_desc("step").y_desc("loss").x_label_formatter(&|v| format!("{v:.0}")).draw()?;
    } else {
        frame(chart.plotting_area())?;
    }
    for (s, pts) in series.iter().zip(&curves) {
        let c = COLORS[s.color % COLORS.len()].stroke_width(2);
        let drawn = chart.draw_series(LineSeries::new(pts.iter().copied(), c))?;
        if text {
            drawn.label(s.name.clone()).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }

    let finite = || series.iter().flat_map(|s| s.scales.iter().copied()).filter(|v| v.is_finite() && *v > 0.0);
    let lo = finite().fold(f64::INFINITY, f64::min);
    let hi = finite().fold(0.0f64, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > 0.0 { (lo / 4.0, hi * 4.0) } else { (0.25, 4.0) };
    let mut b = ChartBuilder::on(&right);
    b.margin(12).x_label_area_size(label_area).y_label_area_size(label_area + 20);
    if text {
        b.caption("loss scale (log axis)", ("sans-serif", 16));
    }
    let mut chart = b.build_cartesian_2d(0f64..steps, (lo..hi).log_scale())?;
    if text {
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss scale")
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| format!("{v:.0e}"))
            .draw()?;
    } else {
        frame(chart.plotting_area())?;
    }
    for (i, s) in series.iter().enumerate() {
        let c = COLORS[s.color % COLORS.len()].stroke_width(width(i, series.len()));
        let pts: Vec<(f64, f64)> =
            s.scales.iter().enumerate().filter(|(_, v)| v.is_finite() && **v > 0.0).map(|(i, v)| (i as f64, *v)).collect();
        let drawn = chart.draw_series(LineSeries::new(pts, c))?;
        if text {
            drawn.label(s.name.clone()).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// Writes `images` (`[N, 1, H, W]`, values in [0, 1]) as a grey PNG grid of `cols` columns
/// with a 2-pixel border (the role of torchvision's `save_image` in Apex's DCGAN example).
///
/// # Errors
/// A tensor of another shape, or the PNG cannot be written.
pub fn save_grid(path: &Path, images: &tch::Tensor, cols: usize) -> Result<()> {
    let size = images.size();
    if size.len() != 4 || size[1] != 1 {
        return Err(anyhow!("save_grid: expected [N, 1, H, W] images, got {size:?}"));
    }
    let (n, h, w) = (size[0] as usize, size[2] as usize, size[3] as usize);
    let cols = cols.clamp(1, n.max(1));
    let rows = n.div_ceil(cols);
    let flat = images.to_kind(tch::Kind::Float).clamp(0.0, 1.0).contiguous().view([-1]);
    let px = Vec::<f32>::try_from(&flat).map_err(|e| anyhow!("save_grid: {e}"))?;
    let (gw, gh) = ((cols * (w + 2) + 2) as u32, (rows * (h + 2) + 2) as u32);
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, (gw, gh)).into_drawing_area();
        root.fill(&RGBColor(40, 40, 40))?;
        for i in 0..n {
            let (ox, oy) = ((i % cols) * (w + 2) + 2, (i / cols) * (h + 2) + 2);
            for y in 0..h {
                for x in 0..w {
                    let v = (px[i * h * w + y * w + x] * 255.0).round() as u8;
                    root.draw_pixel(((ox + x) as i32, (oy + y) as i32), &RGBColor(v, v, v))?;
                }
            }
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow!("{}: cannot write the image: {e}", path.display()))
}
