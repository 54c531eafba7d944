//! Apex's opt levels and their property table, kept as data in `opt_levels/O*.toml`.
use std::fmt;
use std::str::FromStr;

use serde::Deserialize;
use tch::Kind;

use crate::error::{AmpError, Result};
use crate::properties::LossScale;

/// Apex's four optimization levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum OptLevel {
    /// Pure fp32 training: a baseline.
    O0,
    /// Mixed precision by a per-op cast policy; weights stay fp32.
    O1,
    /// fp16 model with fp32 batch norm and fp32 master weights, dynamic loss scaling.
    O2,
    /// Pure fp16 training: a speed baseline.
    O3,
}

impl OptLevel {
    /// All four levels, in order.
    pub const ALL: [OptLevel; 4] = [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3];

    /// This level's row of Apex's property table, read from `opt_levels/<level>.toml`.
    ///
    /// # Errors
    /// [`AmpError::Parse`] if the embedded table is malformed (a build defect, tested).
    pub fn defaults(self) -> Result<LevelDefaults> {
        let (file, text) = match self {
            OptLevel::O0 => ("opt_levels/O0.toml", include_str!("../opt_levels/O0.toml")),
            OptLevel::O1 => ("opt_levels/O1.toml", include_str!("../opt_levels/O1.toml")),
            OptLevel::O2 => ("opt_levels/O2.toml", include_str!("../opt_levels/O2.toml")),
            OptLevel::O3 => ("opt_levels/O3.toml", include_str!("../opt_levels/O3.toml")),
        };
        let raw: RawLevel =
            toml::from_str(text).map_err(|e| AmpError::Parse { what: file.to_string(), message: e.to_string() })?;
        raw.into_defaults(file, self)
    }
}

impl fmt::Display for OptLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl FromStr for OptLevel {
    type Err = AmpError;
    fn from_str(s: &str) -> Result<Self, AmpError> {
        match s {
            "O0" => Ok(Self::O0),
            "O1" => Ok(Self::O1),
            "O2" => Ok(Self::O2),
            "O3" => Ok(Self::O3),
            _ => Err(AmpError::UnknownOptLevel { name: s.to_string() }),
        }
    }
}

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

impl RawLevel {
    fn into_defaults(self, file: &str, level: OptLevel) -> Result<LevelDefaults> {
        let parse_err = |message: String| AmpError::Parse { what: file.to_string(), message };
        let opt_level: OptLevel = self.opt_level.parse()?;
        if opt_level != level {
            return Err(parse_err(format!("file holds {opt_level}, expected {level}")));
        }
        let cast_model_type =
            self.cast_model_type.as_deref().map(|s| parse_dtype("cast_model_type", s)).transpose()?;
        let loss_scale = match &self.loss_scale {
            toml::Value::String(s) => s.parse()?,
            toml::Value::Float(f) => LossScale::Static(*f),
            toml::Value::Integer(i) => LossScale::Static(*i as f64),
            other => return Err(parse_err(format!("loss_scale must be \"dynamic\" or a number, got {other}"))),
        };
        Ok(LevelDefaults {
            opt_level,
            brief: self.brief,
            cast_model_type,
            patch_torch_functions: self.patch_torch_functions,
            keep_batchnorm_fp32: self.keep_batchnorm_fp32,
            master_weights: self.master_weights,
            loss_scale,
        })
    }
}
