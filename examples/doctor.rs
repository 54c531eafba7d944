//! The precision doctor on the main job's CNN (examples/fashion_mnist.rs, same network and
//! seed) for one batch of Fashion-MNIST: per set-up, a table of the modules sorted by severity
//! (max |x| forward, smallest non-zero |gradient| at the loss scale, the shares that overflow or
//! underflow the 16-bit type, the relative error against fp32), the findings with their
//! evidence and the call to write, then `doctor.json` (every report) and `doctor.png` (per
//! module, the range of its forward values and of its gradients against the dtype's limits, and
//! its relative error) in `--out`.
//!
//! ```text
//! cargo run --example doctor                                  # O1, O2, autocast fp16 and bf16
//! cargo run --example doctor -- --levels O2 --loss-scale 1    # O2 at a loss scale of 1
//! cargo run --example doctor -- --input-scale 1e4             # inputs 10^4 times too large
//! ```
//!
//! To diagnose your own model, call `tch_amp::doctor::Doctor::run` as `diagnose` does here with
//! its VarStore and a closure computing the loss of one batch. See docs/doctor.md.
mod common;

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Parser;
use plotters::prelude::*;
use tch::nn::VarStore;
use tch::{Device, Kind};
use tch_amp::doctor::{Doctor, DoctorReport, TensorStats};
use tch_amp::{AmpConfig, Autocast, CpuKernels, OptLevel};

use common::data::{Dataset, DEFAULT_DATA_DIR};
use common::model::{ResNetConfig, SmallResNet};

/// One batch of the main job, diagnosed at several set-ups.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    /// Folder with the four IDX files of Fashion-MNIST.
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    data: PathBuf,
    /// Set-ups: O1, O2, O3, autocast-fp16, autocast-bf16 (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "O1,O2,autocast-fp16,autocast-bf16")]
    levels: Vec<String>,
    /// The loss scale of the diagnosed backward (default: the set-up's initial scale).
    #[arg(long)]
    loss_scale: Option<f64>,
    /// Multiplies the (standardised) images: a way to provoke an overflow.
    #[arg(long, default_value_t = 1.0)]
    input_scale: f64,
    /// Batch size.
    #[arg(short = 'b', long, default_value_t = 128)]
    batch_size: i64,
    /// Seed of the weights (the main job's default).
    #[arg(long, default_value_t = 0)]
    seed: i64,
    /// Output folder for doctor.json and doctor.png.
    #[arg(long, default_value = "runs/doctor")]
    out: PathBuf,
    /// Do not draw doctor.png.
    #[arg(long)]
    no_plot: bool,
}

fn doctor_for(level: &str) -> Result<Doctor> {
    // The fp32 emulation of the 16-bit GEMMs and convolutions: the same numbers on every CPU.
    Ok(match level {
        "autocast-fp16" => Doctor::autocast(Autocast::new(Device::Cpu).dtype(Kind::Half)),
        "autocast-bf16" => Doctor::autocast(Autocast::new(Device::Cpu).dtype(Kind::BFloat16)),
        other => Doctor::apex(AmpConfig::new(other.parse::<OptLevel>()?).cpu_kernels(CpuKernels::Emulate)),
    })
}

fn fmt_e(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.2e}"))
}

fn share(s: Option<&TensorStats>, f: fn(&TensorStats) -> f64) -> String {
    s.map_or("-".into(), |s| format!("{:.2}%", 100.0 * f(s)))
}

fn print_report(r: &DoctorReport) {
    println!(
        "\n== {} (loss scale {}; loss fp32 {:.5}, target {:.5})",
        r.target, r.loss_scale, r.loss.fp32, r.loss.target
    );
    println!(
        "{:<22} {:>8} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9}  severity",
        "module", "ops", "max|x|", "min|g|", "x over", "x under", "g under", "rel.err"
    );
    for m in &r.modules {
        let grads = m.backward.as_ref().or(m.weight_grads.as_ref());
        println!(
            "{:<22} {:>8} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9}  {}",
            if m.module.is_empty() { "(root)" } else { &m.module },
            m.ops.len(),
            fmt_e(m.forward.as_ref().map(|f| f.max_abs)),
            fmt_e(grads.and_then(|g| g.min_nonzero_abs)),
            share(m.forward.as_ref(), TensorStats::overflow_share),
            share(m.forward.as_ref(), TensorStats::underflow_share),
            share(grads, TensorStats::underflow_share),
            fmt_e(m.forward.as_ref().and_then(TensorStats::relative_error)),
            m.severity.map_or("ok".into(), |s| format!("{s:?}").to_lowercase()),
        );
    }
    if let Some(o) = &r.first_non_finite {
        println!("first inf/NaN: {o}");
    }
    if let Some(w) = &r.scale_window {
        println!("loss scales that fit this batch: [{}, {}]", w.min, w.max);
    }
    for f in &r.findings {
        println!("[{:?}] {}\n    evidence: {}", f.severity, f.message, f.evidence);
        for a in &f.advice {
            println!("    -> {}{}", a.action, if a.code.is_empty() { String::new() } else { format!(": {}", a.code) });
        }
    }
    println!("verdict: {}", r.summary());
}

/// Per module (x axis) and set-up (colour): log2 of the forward range [min nonzero, max] and of
/// the gradient range, against fp16's limits; below, log10 of the relative error.
fn plot(path: &Path, reports: &[DoctorReport]) -> Result<()> {
    if reports.is_empty() || !common::plot::register_font() {
        return Ok(());
    }
    let modules: Vec<String> = reports[0].ops.iter().map(|o| o.module.clone()).fold(Vec::new(), |mut v, m| {
        if !v.contains(&m) {
            v.push(m);
        }
        v
    });
    let n = modules.len() as f64;
    let root = BitMapBackend::new(path, (1200, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(600);
    let colors = [RGBColor(31, 119, 180), RGBColor(214, 39, 40), RGBColor(44, 160, 44), RGBColor(148, 103, 189)];
    let mut chart = ChartBuilder::on(&top)
        .caption("log2 |x| (forward, bars) and |g| at the loss scale (thin): fp16 max, min normal and min subnormal as lines", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(-0.5..n - 0.5, -40.0..40.0)?;
    chart.configure_mesh().disable_x_mesh().x_labels(0).draw()?;
    for limit in [65504f64.log2(), (2f64.powi(-14)).log2(), (2f64.powi(-24)).log2()] {
        chart.draw_series(LineSeries::new([(-0.5, limit), (n - 0.5, limit)], BLACK.mix(0.5)))?;
    }
    let width = 0.8 / reports.len() as f64;
    let log2 = |v: f64| v.max(1e-12).log2().clamp(-40.0, 40.0);
    for (k, r) in reports.iter().enumerate() {
        let c = colors[k % colors.len()];
        for (i, m) in modules.iter().enumerate() {
            let Some(rep) = r.module(m) else { continue };
            let x0 = i as f64 - 0.4 + k as f64 * width;
            if let Some(f) = &rep.forward {
                let lo = log2(f.min_nonzero_abs.unwrap_or(f.max_abs));
                chart.draw_series([Rectangle::new([(x0, lo), (x0 + width * 0.6, log2(f.max_abs))], c.filled())])?;
            }
            if let Some(g) = rep.backward.as_ref().or(rep.weight_grads.as_ref()) {
                let lo = log2(g.min_nonzero_abs.unwrap_or(g.max_abs));
                let xg = x0 + width * 0.7;
                chart.draw_series([Rectangle::new(
                    [(xg, lo), (xg + width * 0.2, log2(g.max_abs))],
                    c.mix(0.6).filled(),
                )])?;
            }
        }
        chart
            .draw_series([Circle::new((-1.0, 0.0), 0, c.filled())])?
            .label(r.target.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], c.filled()));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    let mut err = ChartBuilder::on(&bottom)
        .caption("log10 relative error of the forward against fp32, per module", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(60)
        .y_label_area_size(50)
        .build_cartesian_2d(-0.5..n - 0.5, -8.0..1.0)?;
    let names = modules.clone();
    err.configure_mesh()
        .disable_x_mesh()
        .x_labels(modules.len())
        .x_label_formatter(&|x| names.get(x.round() as usize).cloned().unwrap_or_default())
        .draw()?;
    for (k, r) in reports.iter().enumerate() {
        let c = colors[k % colors.len()];
        let points = modules.iter().enumerate().filter_map(|(i, m)| {
            let e = r.module(m)?.forward.as_ref()?.relative_error()?;
            Some((i as f64 - 0.4 + (k as f64 + 0.3) * width, e.max(1e-8).log10().min(1.0)))
        });
        err.draw_series(points.map(|p| Circle::new(p, 4, c.filled())))?;
    }
    root.present()?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::main(run)
}

fn run() -> Result<()> {
    let args = Args::parse();
    tch::set_num_threads(1);
    let data = Dataset::load(&args.data)?.standardize();
    tch::manual_seed(args.seed);
    let vs = VarStore::new(Device::Cpu);
    let cfg = ResNetConfig { in_channels: 1, num_classes: data.num_classes, width: 16, stages: 2, pool: 7 };
    let net = SmallResNet::new(&vs.root(), cfg);
    let idx: Vec<i64> = (0..args.batch_size.min(data.train.len() as i64)).collect();
    let (x, y) = data.train.batch(&idx);
    let x = x * args.input_scale;
    let mut reports = Vec::new();
    for level in &args.levels {
        let mut doctor = doctor_for(level)?;
        if let Some(s) = args.loss_scale {
            doctor = doctor.loss_scale(s);
        }
        let report = doctor.run(&vs, |p| p.forward_t(&net, &x, true).cross_entropy_for_logits(&y))?;
        print_report(&report);
        reports.push(report);
    }
    std::fs::create_dir_all(&args.out)?;
    let json = serde_json::to_string_pretty(&reports)?;
    std::fs::write(args.out.join("doctor.json"), json)?;
    if !args.no_plot {
        plot(&args.out.join("doctor.png"), &reports)?;
    }
    println!("\nwrote {}", args.out.display());
    Ok(())
}
