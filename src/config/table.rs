//! Apex's opt-level property table, kept as data in `opt_levels/O*.toml` and parsed once.
use once_cell::sync::Lazy;
use serde::Deserialize;
use tch::Kind;

use super::loss_scale::LossScale;
use super::opt_level::OptLevel;
use crate::error::{AmpError, Result};

/// One row of Apex's opt-level table. `None` is Apex's "unset".
#[derive(Debug, Clone, PartialEq)]
pub struct LevelDefaults {
    /// The level.
    pub opt_level: OptLevel,
    /// One line from Apex's description.
    pub brief: String,
    /// Dtype the model's floating variables are cast to.
    pub cast_model_type: Option<Kind>,
    /// Whether the per-op cast policy is installed (O1).
    pub patch_torch_functions: bool,
    /// Whether batch-norm variables stay fp32 when the model is cast.
    pub keep_batchnorm_fp32: Option<bool>,
    /// Whether the optimizer steps fp32 master copies of fp16 weights.
    pub master_weights: Option<bool>,
    /// Static or dynamic loss scaling.
    pub loss_scale: LossScale,
}

const FILES: [(OptLevel, &str, &str); 4] = [
    (OptLevel::O0, "opt_levels/O0.toml", include_str!("../../opt_levels/O0.toml")),
    (OptLevel::O1, "opt_levels/O1.toml", include_str!("../../opt_levels/O1.toml")),
    (OptLevel::O2, "opt_levels/O2.toml", include_str!("../../opt_levels/O2.toml")),
    (OptLevel::O3, "opt_levels/O3.toml", include_str!("../../opt_levels/O3.toml")),
];

/// The four rows, parsed at first use. A parse failure is kept as (file, message): the
/// embedded table is a build input, so this is a packaging defect (covered by the tests).
static TABLE: Lazy<std::result::Result<Vec<LevelDefaults>, (String, String)>> =
    Lazy::new(|| FILES.iter().map(|&(level, file, text)| parse_row(level, file, text)).collect());

impl OptLevel {
    /// This level's row of Apex's property table, from `opt_levels/<level>.toml`.
    ///
    /// # Errors
    /// [`AmpError::Parse`] if the embedded table is malformed (a build defect, tested).
    pub fn defaults(self) -> Result<LevelDefaults> {
        match &*TABLE {
            Ok(rows) => Ok(rows[self as usize].clone()),
            Err((what, message)) => Err(AmpError::Parse { what: what.clone(), message: message.clone() }),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLevel {
    opt_level: String,
    brief: String,
    cast_model_type: Option<String>,
    patch_torch_functions: bool,
    keep_batchnorm_fp32: Option<bool>,
    master_weights: Option<bool>,
    loss_scale: toml::Value,
}

/// Parses a dtype name as written in the data files and in Apex (`"float16"`, `"bfloat16"`,
/// `"float32"`, with `torch.` prefixes and `half`/`float`/`bf16` accepted).
pub(crate) fn parse_dtype(option: &'static str, s: &str) -> Result<Kind> {
    match s.trim().trim_start_matches("torch.") {
        "float16" | "half" | "fp16" => Ok(Kind::Half),
        "bfloat16" | "bf16" => Ok(Kind::BFloat16),
        "float32" | "float" | "fp32" => Ok(Kind::Float),
        _ => Err(AmpError::InvalidOption {
            option,
            value: s.to_string(),
            expected: "\"float16\", \"bfloat16\" or \"float32\"",
        }),
    }
}

fn parse_row(level: OptLevel, file: &str, text: &str) -> std::result::Result<LevelDefaults, (String, String)> {
    let fail = |message: String| (file.to_string(), message);
    let raw: RawLevel = toml::from_str(text).map_err(|e| fail(e.to_string()))?;
    let opt_level: OptLevel = raw.opt_level.parse().map_err(|e: super::ParseOptLevelError| fail(e.to_string()))?;
    if opt_level != level {
        return Err(fail(format!("file holds {opt_level}, expected {level}")));
    }
    let cast_model_type = raw
        .cast_model_type
        .as_deref()
        .map(|s| parse_dtype("cast_model_type", s))
        .transpose()
        .map_err(|e| fail(e.to_string()))?;
    let loss_scale = match &raw.loss_scale {
        toml::Value::String(s) => s.parse().map_err(|e: AmpError| fail(e.to_string()))?,
        toml::Value::Float(f) => LossScale::Static(*f),
        toml::Value::Integer(i) => LossScale::Static(*i as f64),
        other => return Err(fail(format!("loss_scale must be \"dynamic\" or a number, got {other}"))),
    };
    Ok(LevelDefaults {
        opt_level,
        brief: raw.brief,
        cast_model_type,
        patch_torch_functions: raw.patch_torch_functions,
        keep_batchnorm_fp32: raw.keep_batchnorm_fp32,
        master_weights: raw.master_weights,
        loss_scale,
    })
}
