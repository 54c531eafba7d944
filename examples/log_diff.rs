//! Compares two per-step JSON-lines logs (the examples' `--log FILE`, or a Python script's
//! log in the same form) and prints the first step and field where they diverge, with both
//! values and their difference; exit status 0 when they agree, 1 when they diverge, 2 on an
//! error. Numbers are compared exactly unless `--tolerance` is given (absolute).
//!
//! ```text
//! cargo run --example log_diff -- rust.jsonl python.jsonl
//! cargo run --example log_diff -- a.jsonl b.jsonl --fields loss,loss_scale --tolerance 1e-6
//! ```
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::{Map, Value};

/// Compares two per-step JSON-lines logs and prints where they first diverge.
#[derive(Parser, Debug)]
struct Args {
    /// The first log.
    a: PathBuf,
    /// The second log.
    b: PathBuf,
    /// Compare only these fields (comma-separated; default: every field of either line).
    #[arg(long, value_delimiter = ',')]
    fields: Vec<String>,
    /// Largest absolute difference of two numbers still counted as equal (default: exact).
    #[arg(long, default_value_t = 0.0)]
    tolerance: f64,
}

fn read(path: &Path) -> Result<Vec<Map<String, Value>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| match serde_json::from_str(l) {
            Ok(Value::Object(m)) => Ok(m),
            Ok(_) => anyhow::bail!("{}:{}: not a JSON object", path.display(), i + 1),
            Err(e) => Err(e).with_context(|| format!("{}:{}: not JSON", path.display(), i + 1)),
        })
        .collect()
}

/// Whether two values agree (numbers within `tolerance`; `null` is a non-finite number).
fn agree(a: Option<&Value>, b: Option<&Value>, tolerance: f64) -> bool {
    match (a, b) {
        (Some(Value::Number(x)), Some(Value::Number(y))) => match (x.as_f64(), y.as_f64()) {
            (Some(x), Some(y)) => x == y || (x - y).abs() <= tolerance,
            _ => x == y,
        },
        _ => a == b,
    }
}

fn show(v: Option<&Value>) -> String {
    v.map_or_else(|| "(absent)".to_string(), Value::to_string)
}

fn run(args: &Args) -> Result<bool> {
    let (a, b) = (read(&args.a)?, read(&args.b)?);
    for (i, (la, lb)) in a.iter().zip(&b).enumerate() {
        let mut fields: Vec<&String> = if args.fields.is_empty() {
            la.keys().chain(lb.keys().filter(|k| !la.contains_key(*k))).collect()
        } else {
            args.fields.iter().collect()
        };
        // The step first, then the fields in order.
        fields.sort_by_key(|f| f.as_str() != "step");
        for f in fields {
            let (va, vb) = (la.get(f), lb.get(f));
            if !agree(va, vb, args.tolerance) {
                let step =
                    la.get("step").or(lb.get("step")).map_or_else(|| format!("line {}", i + 1), Value::to_string);
                println!("first divergence at step {step}, field {f}: {} vs {}", show(va), show(vb));
                if let (Some(x), Some(y)) = (va.and_then(Value::as_f64), vb.and_then(Value::as_f64)) {
                    println!("difference {:e} (relative {:e})", x - y, (x - y).abs() / x.abs().max(y.abs()));
                }
                return Ok(false);
            }
        }
    }
    if a.len() != b.len() {
        println!(
            "the logs agree on their first {} steps; {} has {}, {} has {}",
            a.len().min(b.len()),
            args.a.display(),
            a.len(),
            args.b.display(),
            b.len()
        );
        return Ok(false);
    }
    println!("the logs agree on all {} steps", a.len());
    Ok(true)
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
