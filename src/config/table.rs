//! Apex's opt-level property table (`apex/amp/frontend.py`, classes `O0`..`O3`), one const row
//! per level.
use crate::error::ConfigError;
use tch::Kind;

use super::loss_scale::LossScale;
use super::opt_level::OptLevel;
use crate::error::{AmpError, Result};

/// One row of Apex's opt-level table. `None` is Apex's "unset".
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LevelDefaults {
    /// The level.
    pub opt_level: OptLevel,
    /// Apex's one-line description.
    pub brief: &'static str,
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

/// The rows, indexed by `OptLevel as usize`.
const TABLE: [LevelDefaults; 4] = [
    // Pure FP32 training.
    LevelDefaults {
        opt_level: OptLevel::O0,
        brief: "Pure FP32 training.",
        cast_model_type: Some(Kind::Float),
        patch_torch_functions: false,
        keep_batchnorm_fp32: None,
        master_weights: Some(false),
        loss_scale: LossScale::Static(1.0),
    },
    // A per-op cast policy (Apex's O1 lists, `opt_levels/o1_apex.toml`); weights stay FP32.
    LevelDefaults {
        opt_level: OptLevel::O1,
        brief: "Insert automatic casts around libtorch ops (Apex's O1 lists); weights stay FP32.",
        cast_model_type: None,
        patch_torch_functions: true,
        keep_batchnorm_fp32: None,
        master_weights: None,
        loss_scale: LossScale::Dynamic,
    },
    // FP16 model, FP32 batch norm, FP32 master weights, dynamic loss scaling.
    LevelDefaults {
        opt_level: OptLevel::O2,
        brief: "FP16 training with FP32 batchnorm and FP32 master weights.",
        cast_model_type: Some(Kind::Half),
        patch_torch_functions: false,
        keep_batchnorm_fp32: Some(true),
        master_weights: Some(true),
        loss_scale: LossScale::Dynamic,
    },
    // Pure FP16 training.
    LevelDefaults {
        opt_level: OptLevel::O3,
        brief: "Pure FP16 training.",
        cast_model_type: Some(Kind::Half),
        patch_torch_functions: false,
        keep_batchnorm_fp32: Some(false),
        master_weights: Some(false),
        loss_scale: LossScale::Static(1.0),
    },
];

impl OptLevel {
    /// This level's row of Apex's property table.
    pub const fn defaults(self) -> LevelDefaults {
        TABLE[self as usize]
    }
}

/// Parses a dtype name as written in Apex (`"float16"`, `"bfloat16"`, `"float32"`, with
/// `torch.` prefixes and `half`/`float`/`bf16` accepted).
pub(crate) fn parse_dtype(option: &'static str, s: &str) -> Result<Kind> {
    match s.trim().trim_start_matches("torch.") {
        "float16" | "half" | "fp16" => Ok(Kind::Half),
        "bfloat16" | "bf16" => Ok(Kind::BFloat16),
        "float32" | "float" | "fp32" => Ok(Kind::Float),
        _ => Err(AmpError::Config(ConfigError::InvalidOption {
            option,
            value: s.to_string(),
            expected: "\"float16\", \"bfloat16\" or \"float32\"",
        })),
    }
}
