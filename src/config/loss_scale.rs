//! Static or dynamic loss scaling, as Apex's `loss_scale` argument.
use crate::error::ConfigError;
use std::fmt;
use std::str::FromStr;

use crate::error::AmpError;

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
        let invalid = || {
            AmpError::Config(ConfigError::InvalidOption {
                option: "loss_scale",
                value: s.to_string(),
                expected: "\"dynamic\" or a finite positive number",
            })
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
            LossScale::Static(v) if !(v.is_finite() && v > 0.0) => Err(AmpError::Config(ConfigError::InvalidOption {
                option: "loss_scale",
                value: v.to_string(),
                expected: "\"dynamic\" or a finite positive number",
            })),
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

/// The loss scaler's constants (documented on [`crate::scaling::LossScaler`]'s associated constants),
/// here so that configuration checks them without depending on the scaler.
pub(crate) mod scale_constants {
    pub(crate) const INITIAL_DYNAMIC_SCALE: f64 = 65536.0;
    pub(crate) const GROWTH_INTERVAL: u64 = 2000;
    pub(crate) const DEFAULT_MAX_LOSS_SCALE: f64 = 16_777_216.0;
    /// fp16's smallest subnormal, 2^-24.
    pub(crate) const DEFAULT_MIN_LOSS_SCALE: f64 = half::f16::MIN_POSITIVE_SUBNORMAL.to_f64_const();
    pub(crate) const SCALE_RANGE: (f64, f64) = (1.175_494_350_822_287_5e-38, 1.701_411_834_604_692_3e38);
    pub(crate) const DEFAULT_COLLAPSE_LIMIT: u32 = 20;
    pub(crate) const DEFAULT_HISTORY_LEN: usize = 256;
}
