//! The PNGs of the examples (plotters, bitmap backend): the main job's comparison of opt
//! levels ([`plot_levels`]) and image grids ([`save_grid`]).
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

const COLORS: [RGBColor; 6] = [
    RGBColor(0, 0, 0),
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
];

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

/// The axes of a per-level panel: the level names under their slots and a light mesh, or the
/// text-free frame.
fn level_axes<DB: DrawingBackend>(
    chart: &mut ChartContext<
        '_,
        DB,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
    text: bool,
    n: usize,
    name_of: &dyn Fn(&f64) -> String,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    if text {
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .x_labels(n + 1)
            .x_label_formatter(name_of)
            .disable_x_mesh()
            .draw()?;
    } else {
        frame(chart.plotting_area())?;
    }
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

/// What one opt level of a comparison run produced, for [`plot_levels`].
#[derive(Debug, Clone)]
pub struct LevelSummary {
    /// The opt level ("O0", ...).
    pub name: String,
    /// Index into the palette (black, blue, red, green, purple, orange), so that a level
    /// keeps its colour whichever levels are drawn.
    pub color: usize,
    /// Training loss per step.
    pub losses: Vec<f64>,
    /// Loss scale per step.
    pub scales: Vec<f64>,
    /// Final test accuracy, percent.
    pub test_accuracy: f64,
    /// Mean seconds per epoch.
    pub seconds_per_epoch: f64,
    /// Seconds per epoch divided by O0's (below 1: faster than O0).
    pub time_vs_o0: Option<f64>,
    /// Training-state bytes: weights, gradients, fp32 masters, optimizer state.
    pub state_bytes: [u64; 4],
    /// The most bytes held during one training step (state, batch, activations, gradients),
    /// where measured.
    pub peak_bytes: Option<u64>,
}

/// A line style per level, so that curves lying on top of each other stay apart: solid,
/// dashed, long-dashed, dotted.
fn styled_line<DB: DrawingBackend, CT: CoordTranslate<From = (f64, f64)>>(
    chart: &mut ChartContext<'_, DB, CT>,
    pts: Vec<(f64, f64)>,
    i: usize,
    color: RGBColor,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let style = color.stroke_width(2);
    match i % 4 {
        0 => {
            chart.draw_series(LineSeries::new(pts, style))?;
        }
        1 => {
            chart.draw_series(DashedLineSeries::new(pts, 10, 6, style))?;
        }
        2 => {
            chart.draw_series(DashedLineSeries::new(pts, 22, 6, style))?;
        }
        _ => {
            chart.draw_series(DashedLineSeries::new(pts, 3, 4, style))?;
        }
    }
    Ok(())
}

/// The legend entry of [`styled_line`]'s style `i`, drawn at (x, y).
fn legend_sample(i: usize, color: RGBColor, (x, y): (i32, i32)) -> Vec<PathElement<(i32, i32)>> {
    let segs: &[(i32, i32)] = match i % 4 {
        0 => &[(0, 24)],
        1 => &[(0, 8), (14, 24)],
        2 => &[(0, 18)],
        _ => &[(0, 3), (7, 10), (14, 17), (21, 24)],
    };
    segs.iter().map(|&(a, b)| PathElement::new(vec![(x + a, y), (x + b, y)], color.stroke_width(2))).collect()
}

/// Draws the comparison of opt levels a reader of the main job wants, into a 1500x900 PNG:
/// training loss per level (line styles keep overlapping curves apart), each level's loss
/// minus O0's (the differences the first panel cannot show), the loss scale per level when
/// it moves (else the constant scales as text), test accuracy per level, seconds per epoch
/// with the time relative to O0, and the peak memory of a training step per level (training
/// state and the rest: batch, activations, gradients; levels without a measured peak show
/// their training state split into weights, gradients, masters and optimizer state). `with_text` false draws no text at all (for a machine without
/// the font). Returns whether text was drawn.
///
/// # Errors
/// The PNG cannot be written.
pub fn plot_levels(path: &Path, title: &str, levels: &[LevelSummary], with_text: bool) -> Result<bool> {
    draw_levels(path, title, levels, with_text)
        .map_err(|e| anyhow!("{}: cannot draw the plot: {e}", path.display()))?;
    Ok(with_text)
}

/// [`plot_levels`] with text when the font can be registered.
///
/// # Errors
/// As [`plot_levels`].
pub fn plot_levels_auto(path: &Path, title: &str, levels: &[LevelSummary]) -> Result<bool> {
    plot_levels(path, title, levels, register_font())
}

/// A legend in the upper right corner of `area` with each level's line style (plotters' own
/// legend draws one sample per series kind, not the dash pattern).
fn legend<'a, DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    entries: impl Iterator<Item = (usize, &'a LevelSummary)>,
    color: &dyn Fn(&LevelSummary) -> RGBColor,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let (pw, _) = area.dim_in_pixel();
    for (row, (i, l)) in entries.enumerate() {
        let (x, y) = (pw as i32 - 90, 12 + 18 * row as i32);
        for e in legend_sample(i, color(l), (x, y)) {
            area.draw(&e)?;
        }
        area.draw(&Text::new(l.name.clone(), (x + 30, y - 7), ("sans-serif", 14)))?;
    }
    Ok(())
}

fn draw_levels(
    path: &Path,
    title: &str,
    levels: &[LevelSummary],
    text: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, (1500, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = if text { root.titled(title, ("sans-serif", 22))? } else { root };
    let panels = root.split_evenly((2, 3));
    let label_area = if text { 40 } else { 0 };
    let caption = |b: &mut ChartBuilder<'_, '_, BitMapBackend<'_>>, c: &str| {
        if text {
            b.caption(c, ("sans-serif", 16));
        }
    };
    let color = |l: &LevelSummary| COLORS[l.color % COLORS.len()];
    let n = levels.len().max(1);
    let steps = levels.iter().map(|l| l.losses.len()).max().unwrap_or(1).max(2) as f64;
    let w = (steps as usize / 40).max(1);
    let curves: Vec<Vec<(f64, f64)>> = levels.iter().map(|l| smooth(&l.losses, w)).collect();

    // 1. Training loss.
    let ymax = curves.iter().flatten().map(|p| p.1).fold(0.0f64, f64::max).max(1e-3) * 1.05;
    let mut b = ChartBuilder::on(&panels[0]);
    b.margin(12).x_label_area_size(label_area).y_label_area_size(label_area + 10);
    caption(
        &mut b,
        &if w > 1 { format!("training loss (moving average of {w} steps)") } else { "training loss".to_string() },
    );
    let mut chart = b.build_cartesian_2d(0f64..steps, 0f64..ymax)?;
    if text {
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .x_desc("step")
            .y_desc("loss")
            .x_label_formatter(&|v| format!("{v:.0}"))
            .draw()?;
    } else {
        frame(chart.plotting_area())?;
    }
    for (i, (l, pts)) in levels.iter().zip(&curves).enumerate() {
        styled_line(&mut chart, pts.clone(), i, color(l))?;
    }
    if text {
        legend(&chart.plotting_area().strip_coord_spec(), levels.iter().enumerate(), &color)?;
    }

    // 2. Loss minus O0's (or the first level's).
    let base = levels.iter().position(|l| l.name == "O0").unwrap_or(0);
    let diffs: Vec<Vec<(f64, f64)>> = curves
        .iter()
        .map(|c| c.iter().filter_map(|&(x, y)| curves[base].iter().find(|p| p.0 == x).map(|p| (x, y - p.1))).collect())
        .collect();
    let dmax = diffs.iter().flatten().map(|p| p.1.abs()).fold(0.0f64, f64::max).max(1e-3) * 1.1;
    let mut b = ChartBuilder::on(&panels[1]);
    b.margin(12).x_label_area_size(label_area).y_label_area_size(label_area + 15);
    caption(&mut b, &format!("loss minus {}'s (same batches, same start)", levels.get(base).map_or("O0", |l| &l.name)));
    let mut chart = b.build_cartesian_2d(0f64..steps, -dmax..dmax)?;
    if text {
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .x_desc("step")
            .y_desc("loss difference")
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| if v.abs() < 5e-4 { "0".into() } else { format!("{v:.3}") })
            .draw()?;
    } else {
        frame(chart.plotting_area())?;
    }
    for (i, (l, pts)) in levels.iter().zip(&diffs).enumerate() {
        styled_line(&mut chart, pts.clone(), i, color(l))?;
    }

    // 3. Loss scale when it moves.
    let moving: Vec<usize> = (0..levels.len())
        .filter(|&i| {
            let s = &levels[i].scales;
            s.iter().any(|v| v.is_finite() && s.first().is_some_and(|f| v != f))
        })
        .collect();
    if moving.is_empty() {
        if text {
            let area = &panels[2];
            area.draw(&Text::new("loss scale: constant throughout", (30, 40), ("sans-serif", 16)))?;
            for (i, l) in levels.iter().enumerate() {
                let s = l.scales.first().copied().unwrap_or(f64::NAN);
                let line = format!("{}: {s} (no overflow, no growth)", l.name);
                area.draw(&Text::new(line, (40, 75 + 24 * i as i32), ("sans-serif", 15).into_font().color(&color(l))))?;
            }
        }
    } else {
        // log2 of the scale on a linear axis: ticks at whole powers of two.
        let finite =
            || moving.iter().flat_map(|&i| levels[i].scales.iter().copied()).filter(|v| v.is_finite() && *v > 0.0);
        let lo = finite().fold(f64::INFINITY, f64::min).log2().floor() - 1.0;
        let hi = finite().fold(0.0f64, f64::max).log2().ceil() + 1.0;
        let mut b = ChartBuilder::on(&panels[2]);
        b.margin(12).x_label_area_size(label_area).y_label_area_size(label_area + 20);
        caption(&mut b, "loss scale of the levels where it moves");
        let mut chart = b.build_cartesian_2d(0f64..steps, lo..hi)?;
        if text {
            chart
                .configure_mesh()
                .light_line_style(WHITE)
                .x_desc("step")
                .y_labels((hi - lo) as usize + 1)
                .x_label_formatter(&|v| format!("{v:.0}"))
                .y_label_formatter(&|v| if (v - v.round()).abs() < 1e-6 { format!("2^{v:.0}") } else { String::new() })
                .draw()?;
        } else {
            frame(chart.plotting_area())?;
        }
        for &i in &moving {
            let pts: Vec<(f64, f64)> = levels[i]
                .scales
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite() && **v > 0.0)
                .map(|(x, v)| (x as f64, v.log2()))
                .collect();
            styled_line(&mut chart, pts, i, color(&levels[i]))?;
        }
        if text {
            legend(&chart.plotting_area().strip_coord_spec(), moving.iter().map(|&i| (i, &levels[i])), &color)?;
        }
    }

    // 4-6: one value per level.
    let names: Vec<String> = levels.iter().map(|l| l.name.clone()).collect();
    let x_range = -0.6f64..(n as f64 - 0.4);
    let name_of = move |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 0.01 && i >= 0.0 {
            names.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };

    // 4. Test accuracy: dots with values (the axis is zoomed to the spread).
    let accs: Vec<f64> = levels.iter().map(|l| l.test_accuracy).collect();
    let (amin, amax) = accs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| (a.min(v), b.max(v)));
    let pad = ((amax - amin) * 0.6).max(0.5);
    let mut b = ChartBuilder::on(&panels[3]);
    b.margin(12).x_label_area_size(label_area).y_label_area_size(label_area + 10);
    caption(&mut b, "test accuracy (%), axis zoomed to the spread");
    let mut chart = b.build_cartesian_2d(x_range.clone(), (amin - pad)..(amax + pad))?;
    level_axes(&mut chart, text, n, &name_of)?;
    for (i, l) in levels.iter().enumerate() {
        let c = color(l);
        chart.draw_series(std::iter::once(Circle::new((i as f64, l.test_accuracy), 7, c.filled())))?;
        if text {
            let t = format!("{:.2}%", l.test_accuracy);
            chart.draw_series(std::iter::once(Text::new(t, (i as f64 + 0.12, l.test_accuracy), ("sans-serif", 14))))?;
        }
    }

    // 5. Seconds per epoch, with the time relative to O0.
    let tmax = levels.iter().map(|l| l.seconds_per_epoch).fold(0.0f64, f64::max).max(1e-6) * 1.25;
    let mut b = ChartBuilder::on(&panels[4]);
    b.margin(12).x_label_area_size(label_area).y_label_area_size(label_area + 10);
    caption(&mut b, "seconds per epoch (time vs O0: below 1 is faster)");
    let mut chart = b.build_cartesian_2d(x_range.clone(), 0f64..tmax)?;
    level_axes(&mut chart, text, n, &name_of)?;
    for (i, l) in levels.iter().enumerate() {
        let x = i as f64;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x - 0.3, 0.0), (x + 0.3, l.seconds_per_epoch)],
            color(l).filled(),
        )))?;
        if text {
            let t = match l.time_vs_o0 {
                Some(r) => format!("{:.2} s ({r:.2}x)", l.seconds_per_epoch),
                None => format!("{:.2} s", l.seconds_per_epoch),
            };
            chart.draw_series(std::iter::once(Text::new(
                t,
                (x - 0.3, l.seconds_per_epoch + tmax * 0.06),
                ("sans-serif", 14),
            )))?;
        }
    }

    // 6. Peak memory of a step, stacked: training state below, the rest (batch, activations,
    // gradients, temporaries) above; the training state alone, split, where no peak was measured.
    fn state(l: &LevelSummary) -> u64 {
        l.state_bytes.iter().sum()
    }
    fn top(l: &LevelSummary) -> u64 {
        l.peak_bytes.unwrap_or(0).max(state(l))
    }
    let measured = levels.iter().any(|l| l.peak_bytes.is_some());
    let biggest = levels.iter().map(top).max().unwrap_or(0);
    let (unit, div) = if biggest >= 10 << 20 { ("MiB", (1u64 << 20) as f64) } else { ("KiB", 1024.0) };
    let scaled = move |b: u64| b as f64 / div;
    let bmax = levels.iter().map(|l| scaled(top(l))).fold(0.0f64, f64::max).max(1e-6) * 1.3;
    let mut b = ChartBuilder::on(&panels[5]);
    b.margin(12).x_label_area_size(label_area).y_label_area_size(label_area + 15);
    if measured {
        caption(&mut b, &format!("peak memory of a training step ({unit})"));
    } else {
        caption(&mut b, &format!("training state ({unit}), activations excluded"));
    }
    let mut chart = b.build_cartesian_2d(x_range, 0f64..bmax)?;
    level_axes(&mut chart, text, n, &name_of)?;
    // (label, shade, the byte range a level's bar covers).
    type Part = (&'static str, RGBColor, Box<dyn Fn(&LevelSummary) -> (u64, u64)>);
    let parts: Vec<Part> = if measured {
        vec![
            ("training state", RGBColor(90, 90, 90), Box::new(|l: &LevelSummary| (0, state(l)))),
            ("batch, activations, gradients", RGBColor(110, 150, 210), Box::new(|l: &LevelSummary| (state(l), top(l)))),
        ]
    } else {
        let names = ["weights", "grads", "masters", "opt state"];
        let shades = [RGBColor(90, 90, 90), RGBColor(150, 150, 150), RGBColor(200, 160, 60), RGBColor(110, 150, 210)];
        (0..4)
            .map(|p| -> Part {
                let range = move |l: &LevelSummary| {
                    let below: u64 = l.state_bytes[..p].iter().sum();
                    (below, below + l.state_bytes[p])
                };
                (names[p], shades[p], Box::new(range))
            })
            .collect()
    };
    for (part, shade, range) in &parts {
        let shade = *shade;
        let drawn = chart.draw_series(levels.iter().enumerate().map(|(i, l)| {
            let (from, to) = range(l);
            let x = i as f64;
            Rectangle::new([(x - 0.3, scaled(from)), (x + 0.3, scaled(to))], shade.filled())
        }))?;
        if text {
            drawn.label(*part).legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], shade.filled()));
        }
    }
    if text {
        for (i, l) in levels.iter().enumerate() {
            let total = scaled(top(l));
            chart.draw_series(std::iter::once(Text::new(
                format!("{total:.1}"),
                (i as f64 - 0.2, total + bmax * 0.05),
                ("sans-serif", 14),
            )))?;
        }
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
