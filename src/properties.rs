//! The resolved options of one `initialize`: an opt level's row with the user's overrides.
use std::fmt;
use std::str::FromStr;

use tch::Kind;

use crate::error::AmpError;
use crate::o1::CastPolicy;
use crate::opt_level::OptLevel;

/// How the loss is scaled before backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossScale {
    /// Apex's dynamic scaler: start at 2^16 (capped by `max_loss_scale`), halve on overflow and
    /// skip the step, double after 2000 clean backward passes.
    Dynamic,
    /// A fixed scale: never checks for overflow, never skips.
    Static(f64),
}

impl FromStr for LossScale {
    type Err = AmpError;
    /// `"dynamic"` or a number (`"128"`, `"1.0"`), as Apex's `loss_scale` argument.
    fn from_str(s: &str) -> Result<Self, AmpError> {
        let invalid = || AmpError::InvalidOption {
            option: "loss_scale",
            value: s.to_string(),
            expected: "\"dynamic\" or a finite positive number",
        };
        if s.trim() == "dynamic" {
            return Ok(LossScale::Dynamic);
        }
        let v: f64 = s.trim().parse().map_err(|_| invalid())?;
        LossScale::Static(v).validated().map_err(|_| invalid())
    }
}

impl From<f64> for LossScale {
    fn from(v: f64) -> Self {
        LossScale::Static(v)
    }
}

impl LossScale {
    /// Checks that a static scale is finite and positive.
    pub(crate) fn validated(self) -> Result<Self, AmpError> {
        match self {
            LossScale::Static(v) if !(v.is_finite() && v > 0.0) => Err(AmpError::InvalidOption {
                option: "loss_scale",
                value: v.to_string(),
                expected: "\"dynamic\" or a finite positive number",
            }),
            other => Ok(other),
        }
    }
}

impl fmt::Display for LossScale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossScale::Dynamic => f.write_str("dynamic"),
            LossScale::Static(v) => write!(f, "{v}"),
        }
    }
}

/// Options in force after `initialize`: the opt level's defaults with overrides applied and
/// Apex's rules checked. Built by [`crate::AmpConfig::build`].
#[derive(Debug, Clone, PartialEq)]
pub struct Properties {
    /// `false` makes tch-amp a pass-through (Apex's `enabled=False`).
    pub enabled: bool,
    /// The opt level the defaults came from.
    pub opt_level: OptLevel,
    /// Dtype the model's floating variables are cast to; `None` leaves them alone.
    pub cast_model_type: Option<Kind>,
    /// Whether the per-op cast policy (O1) is installed.
    pub patch_torch_functions: bool,
    /// Whether batch-norm variables stay fp32 when the model is cast.
    pub keep_batchnorm_fp32: bool,
    /// Whether optimizers step fp32 master copies of the fp16 weights.
    pub master_weights: bool,
    /// Static or dynamic loss scaling.
    pub loss_scale: LossScale,
    /// Dtype the model wrapper casts floating outputs to (default fp32 when the model is cast).
    pub cast_model_outputs: Option<Kind>,
    /// Number of losses, one loss scaler each.
    pub num_losses: usize,
    /// Floor of the dynamic scale (Apex: none; tch-amp: [`crate::DEFAULT_MIN_LOSS_SCALE`]).
    pub min_loss_scale: Option<f64>,
    /// Cap of the dynamic scale (Apex default 2^24).
    pub max_loss_scale: f64,
    /// 0 = silent, 1 = Apex's messages (overflow lines), 2 = also the resolved options.
    pub verbosity: u8,
    /// Low-precision dtype of the O1 policy (fp16 default, bf16 allowed).
    pub low_precision_dtype: Kind,
    /// O1: let banned ops (binary_cross_entropy) run in fp32 instead of failing.
    pub allow_banned: bool,
    /// Emulate fp16/bf16 GEMMs and convolutions on CPU in fp32 of the rounded inputs
    /// (same numerics, far faster on CPUs without half-precision matrix units).
    pub emulate_low_precision_on_cpu: bool,
    /// The O1 cast policy (Apex's lists unless another was given).
    pub cast_policy: CastPolicy,
}
