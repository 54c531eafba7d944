//! `--log FILE`: one JSON object per line and per optimizer step, with at least `step`,
//! `loss`, `loss_scale` and `skipped`, plus whatever the example adds (`level`, `epoch`,
//! per-loss values, ...). Non-finite numbers are written as `null` (JSON has no inf/NaN).
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{Map, Value};

/// One line of the log.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepRecord {
    /// Optimizer step, counted from 0 over the whole run (continues after `--resume`).
    pub step: u64,
    /// The loss of this step (unscaled).
    pub loss: f64,
    /// The loss scale used for this step's backward pass.
    pub loss_scale: f64,
    /// Whether the optimizer step was skipped after an overflow.
    pub skipped: bool,
    /// Further fields.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl StepRecord {
    /// A record with the four common fields.
    pub fn new(step: u64, loss: f64, loss_scale: f64, skipped: bool) -> Self {
        Self { step, loss, loss_scale, skipped, extra: Map::new() }
    }

    /// Adds a field.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(key.to_string(), value.into());
        self
    }
}

/// The JSON-lines writer; does nothing when no file was asked for.
#[derive(Debug)]
pub struct StepLog {
    out: Option<(PathBuf, BufWriter<File>)>,
}

impl StepLog {
    /// Creates (truncates) `path`, making its folder; `None` logs nothing.
    ///
    /// # Errors
    /// The file or its folder cannot be created (the message names the file).
    pub fn create(path: Option<&Path>) -> Result<Self> {
        let Some(path) = path else { return Ok(Self { out: None }) };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create the log's folder", dir.display()))?;
        }
        let f = File::create(path).with_context(|| format!("{}: cannot create the log file", path.display()))?;
        Ok(Self { out: Some((path.to_path_buf(), BufWriter::new(f))) })
    }

    /// Appends one record.
    ///
    /// # Errors
    /// A write error, naming the file.
    pub fn write(&mut self, record: &StepRecord) -> Result<()> {
        let Some((path, w)) = &mut self.out else { return Ok(()) };
        let line = serde_json::to_string(record).with_context(|| path.display().to_string())?;
        writeln!(w, "{line}").with_context(|| format!("{}: cannot write the log", path.display()))
    }

    /// Flushes the file.
    ///
    /// # Errors
    /// A write error, naming the file.
    pub fn flush(&mut self) -> Result<()> {
        let Some((path, w)) = &mut self.out else { return Ok(()) };
        w.flush().with_context(|| format!("{}: cannot write the log", path.display()))
    }
}

impl Drop for StepLog {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}
