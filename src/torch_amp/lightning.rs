//! PyTorch Lightning's precision flags (`Trainer(precision=...)`, and Lightning 1.x's
//! `amp_backend` / `amp_level`) as the tch-amp set-up they ask for.
use std::str::FromStr;

use tch::Kind;

use crate::config::OptLevel;
use crate::error::{AmpError, ConfigError, Result};

/// What a Lightning precision flag sets up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// `"32-true"` (1.x: `32`): fp32 everywhere, no autocast, no scaler.
    Fp32,
    /// torch.amp: autocast in `dtype` around the forward, and a [`crate::GradScaler`] when
    /// `grad_scaler` (`"16-mixed"`: fp16 with a scaler; `"bf16-mixed"`: bf16 without).
    Mixed {
        /// Autocast's low-precision dtype.
        dtype: Kind,
        /// Whether the loss goes through a GradScaler.
        grad_scaler: bool,
    },
    /// The model itself in `dtype`, no autocast, no scaler (`"16-true"`, `"bf16-true"`,
    /// `"64-true"`).
    Pure {
        /// The model's dtype.
        dtype: Kind,
    },
    /// Lightning 1.x `precision=16, amp_backend="apex"`: the Apex path ([`crate::initialize`])
    /// at `opt_level` (`amp_level`, `"O2"` when not given).
    Apex {
        /// Apex's opt level.
        opt_level: OptLevel,
    },
}

/// Lightning 2.x's accepted values, in its order (`_PRECISION_INPUT_STR`).
const ALLOWED: &str = "one of Lightning's \"16-true\", \"16-mixed\", \"bf16-true\", \"bf16-mixed\", \"32-true\", \
                       \"64-true\" (and the legacy 16, 32, 64, \"bf16\")";

/// [`ConfigError::InvalidOption`] for a flag Lightning refuses.
fn refuse(option: &'static str, value: &str, expected: &'static str) -> AmpError {
    AmpError::Config(ConfigError::InvalidOption { option, value: value.to_string(), expected })
}

impl Precision {
    /// Lightning 2.x's `Trainer(precision=flag)`. The legacy `"16"`, `"32"`, `"64"` and
    /// `"bf16"` map as Lightning maps them (to `"16-mixed"`, `"32-true"`, `"64-true"`,
    /// `"bf16-mixed"`), with Lightning's deprecation message through `log`.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a value Lightning rejects, and for
    /// `"transformer-engine"` (not available in tch-amp).
    pub fn parse(flag: &str) -> Result<Self> {
        let canonical = match flag {
            "16" => Some("16-mixed"),
            "32" => Some("32-true"),
            "64" => Some("64-true"),
            "bf16" => Some("bf16-mixed"),
            _ => None,
        };
        if let Some(c) = canonical {
            if flag != "32" && flag != "64" {
                log::warn!("precision={flag:?} is supported for historical reasons but its usage is discouraged. Please set your precision to {c:?} instead!");
            }
        }
        Ok(match canonical.unwrap_or(flag) {
            "32-true" => Precision::Fp32,
            "16-mixed" => Precision::Mixed { dtype: Kind::Half, grad_scaler: true },
            "bf16-mixed" => Precision::Mixed { dtype: Kind::BFloat16, grad_scaler: false },
            "16-true" => Precision::Pure { dtype: Kind::Half },
            "bf16-true" => Precision::Pure { dtype: Kind::BFloat16 },
            "64-true" => Precision::Pure { dtype: Kind::Double },
            te if te.starts_with("transformer-engine") => {
                return Err(refuse(
                    "precision",
                    flag,
                    "not \"transformer-engine\" (not available in tch-amp; use \"bf16-mixed\")",
                ))
            }
            _ => return Err(refuse("precision", flag, ALLOWED)),
        })
    }

    /// Lightning 1.x's `Trainer(precision=precision, amp_backend=amp_backend,
    /// amp_level=amp_level)`: `precision` 16, 32, 64 or `"bf16"`; `amp_backend` `"native"`
    /// (torch.amp) or `"apex"`; `amp_level` (Apex's opt level, `"O2"` by default) only with
    /// `"apex"`.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] where Lightning 1.x raised: an unknown precision or backend,
    /// `amp_level` without `amp_backend="apex"`, `"bf16"` with apex, an `amp_level` that is
    /// not an opt level.
    pub fn parse_v1(precision: &str, amp_backend: &str, amp_level: Option<&str>) -> Result<Self> {
        let apex = match amp_backend.to_ascii_lowercase().as_str() {
            "native" => false,
            "apex" => true,
            _ => return Err(refuse("amp_backend", amp_backend, "\"native\" or \"apex\" (Lightning 1.x)")),
        };
        if let (Some(level), false) = (amp_level, apex) {
            return Err(refuse(
                "amp_level",
                level,
                "no amp_level unless amp_backend=\"apex\" (drop it, or pass amp_backend=\"apex\")",
            ));
        }
        match precision {
            "16" if apex => {
                let opt_level = match amp_level {
                    None => OptLevel::O2,
                    Some(l) => OptLevel::from_str(l).map_err(|_| {
                        refuse("amp_level", l, "\"O0\", \"O1\", \"O2\" or \"O3\" (the letter O, not zero)")
                    })?,
                };
                Ok(Precision::Apex { opt_level })
            }
            "16" => Ok(Precision::Mixed { dtype: Kind::Half, grad_scaler: true }),
            "bf16" if apex => {
                Err(refuse("precision", precision, "16, 32 or 64 with amp_backend=\"apex\" (bf16 needs \"native\")"))
            }
            "bf16" => Ok(Precision::Mixed { dtype: Kind::BFloat16, grad_scaler: false }),
            "32" => Ok(Precision::Fp32),
            "64" => Ok(Precision::Pure { dtype: Kind::Double }),
            _ => Err(refuse("precision", precision, "16, 32, 64 or \"bf16\" (Lightning 1.x)")),
        }
    }

    /// The autocast dtype of the torch.amp path (`Mixed`), or None.
    pub fn autocast_dtype(&self) -> Option<Kind> {
        match self {
            Precision::Mixed { dtype, .. } => Some(*dtype),
            _ => None,
        }
    }

    /// Whether the set-up scales the loss with a [`crate::GradScaler`] (`"16-mixed"`).
    pub fn uses_grad_scaler(&self) -> bool {
        matches!(self, Precision::Mixed { grad_scaler: true, .. })
    }
}
