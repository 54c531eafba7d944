//! [`AmpConfig::build`]: Apex's rule checks (what `amp.initialize` rejects), then the
//! resolution of the level's row and the overrides into [`Properties`].
use crate::error::ConfigError;
use tch::Kind;

use super::scale_constants as consts;
use super::{AmpConfig, LossScale, OptLevel, Properties};
use crate::cast::{warn_if_slow_cpu_kernels, CastPolicy, CastSettings};
use crate::error::{AmpError, Result};

fn incompatible(level: OptLevel, option: &'static str, why: &'static str) -> AmpError {
    AmpError::Config(ConfigError::IncompatibleOption { level, option, why })
}

fn invalid(option: &'static str, value: impl ToString, expected: &'static str) -> AmpError {
    AmpError::Config(ConfigError::InvalidOption { option, value: value.to_string(), expected })
}

/// The scalers' option checks (Apex's, torch's GradScaler, apex.fp16_utils'): a scale that is
/// finite and positive.
pub(crate) fn positive_scale(option: &'static str, v: f64) -> Result<f64> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(invalid(option, v, "a finite number > 0"))
    }
}

/// A growth factor: finite and above 1.
pub(crate) fn growth_factor(option: &'static str, v: f64) -> Result<f64> {
    if v.is_finite() && v > 1.0 {
        Ok(v)
    } else {
        Err(invalid(option, v, "a finite number > 1"))
    }
}

/// A backoff factor: in (0, 1).
pub(crate) fn backoff_factor(v: f64) -> Result<f64> {
    if v > 0.0 && v < 1.0 {
        Ok(v)
    } else {
        Err(invalid("backoff_factor", v, "a number in (0, 1)"))
    }
}

/// A growth interval (clean steps before the scale grows): at least 1.
pub(crate) fn growth_interval(option: &'static str, v: i64) -> Result<i64> {
    if v >= 1 {
        Ok(v)
    } else {
        Err(invalid(option, v, "an integer >= 1"))
    }
}

/// A scale (or floor, or cap) within [`crate::scaling::LossScaler::SCALE_RANGE`].
fn in_scale_range(option: &'static str, v: f64) -> Result<f64> {
    let (lo, hi) = consts::SCALE_RANGE;
    if v.is_finite() && (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(invalid(option, v, "a number in [2^-126, 2^127], so that it and its inverse are normal fp32 numbers"))
    }
}

impl AmpConfig {
    /// The level given (O1 when none was, as Apex's default).
    fn level(&self) -> OptLevel {
        self.opt_level.unwrap_or(OptLevel::O1)
    }

    /// Applies the overrides to the level's defaults and checks Apex's rules.
    ///
    /// # Errors
    /// [`ConfigError::IncompatibleOption`] for what Apex rejects: `cast_model_type` other than
    /// fp32/`None` under O1, `patch_torch_functions` outside O1, `keep_batchnorm_fp32` or
    /// `master_weights` set under O1, and (tch-amp) a `cast_policy` outside O1;
    /// [`ConfigError::InvalidOption`] for a loss scale, `min_loss_scale` or `max_loss_scale`
    /// outside [`crate::scaling::LossScaler::SCALE_RANGE`] (2^-126 to 2^127), min above max, a
    /// hysteresis or recovery growth interval of 0, `num_losses == 0`, or a low-precision dtype
    /// other than fp16/bf16.
    pub fn build(&self) -> Result<Properties> {
        self.check_apex_rules()?;
        self.resolve()
    }

    /// The combinations Apex's `initialize` rejects at this level.
    fn check_apex_rules(&self) -> Result<()> {
        let level = self.level();
        let o1 = level == OptLevel::O1;
        if o1 && matches!(self.cast_model_type, Some(Some(k)) if k != Kind::Float) {
            return Err(incompatible(
                level,
                "cast_model_type",
                "O1 inserts casts around ops rather than casting the model weights, so the weights \
                 stay fp32; use O2 or O3 to cast the model",
            ));
        }
        if self.patch_torch_functions == Some(true) && !o1 {
            return Err(incompatible(
                level,
                "patch_torch_functions",
                "the per-op cast policy is only set by choosing opt level O1",
            ));
        }
        if o1 && self.keep_batchnorm_fp32.is_some() {
            return Err(incompatible(
                level,
                "keep_batchnorm_fp32",
                "under O1 batch norm already runs in fp32 through the cast policy; leave it unset",
            ));
        }
        if o1 && self.master_weights.is_some() {
            return Err(incompatible(
                level,
                "master_weights",
                "master weights make no sense under O1, whose model weights are fp32 already; leave it unset",
            ));
        }
        if !o1 && self.cast_policy.is_some() {
            return Err(incompatible(
                level,
                "cast_policy",
                "a per-op cast policy only acts under O1 (Apex's register_*_function too); choose O1",
            ));
        }
        Ok(())
    }

    /// The level's row with the overrides applied, each value range-checked.
    fn resolve(&self) -> Result<Properties> {
        let level = self.level();
        let d = level.defaults();
        let o1 = level == OptLevel::O1;
        let low = self.low_precision_dtype.unwrap_or(Kind::Half);
        if !matches!(low, Kind::Half | Kind::BFloat16) {
            return Err(invalid("low_precision_dtype", format!("{low:?}"), "Kind::Half or Kind::BFloat16"));
        }
        let cast_model_type = self.cast_model_type.unwrap_or(d.cast_model_type);
        if let Some(k) = cast_model_type {
            if !matches!(k, Kind::Half | Kind::BFloat16 | Kind::Float) {
                return Err(invalid(
                    "cast_model_type",
                    format!("{k:?}"),
                    "Kind::Half, Kind::BFloat16, Kind::Float or None",
                ));
            }
        }
        // bf16 has fp32's exponent range: no loss scaling unless asked for.
        let bf16 = if o1 { low == Kind::BFloat16 } else { cast_model_type == Some(Kind::BFloat16) };
        let loss_scale = match self.loss_scale {
            Some(LossScale::Static(v)) => LossScale::Static(in_scale_range("loss_scale", v)?),
            Some(s) => s,
            None if bf16 => LossScale::Static(1.0),
            None => d.loss_scale,
        };
        let max_loss_scale =
            in_scale_range("max_loss_scale", self.max_loss_scale.unwrap_or(consts::DEFAULT_MAX_LOSS_SCALE))?;
        if let Some(min) = self.min_loss_scale {
            in_scale_range("min_loss_scale", min)?;
            if min > max_loss_scale {
                return Err(invalid("min_loss_scale", min, "a value not above max_loss_scale"));
            }
        }
        if let Some(init) = self.init_loss_scale {
            in_scale_range("init_loss_scale", init)?;
            if loss_scale != LossScale::Dynamic {
                return Err(invalid(
                    "init_loss_scale",
                    init,
                    "a dynamic loss scale (a static one is its own initial value: set loss_scale)",
                ));
            }
            if init > max_loss_scale || self.min_loss_scale.is_some_and(|m| init < m) {
                return Err(invalid("init_loss_scale", init, "a value within [min_loss_scale, max_loss_scale]"));
            }
        }
        let num_losses = self.num_losses.unwrap_or(1);
        if num_losses == 0 {
            return Err(invalid("num_losses", 0, "at least 1"));
        }
        if let Some(k) = self.cast_model_outputs {
            if !matches!(k, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double) {
                return Err(invalid("cast_model_outputs", format!("{k:?}"), "a floating kind"));
            }
        }
        let hysteresis = self.hysteresis.unwrap_or(1);
        if hysteresis == 0 {
            return Err(invalid("hysteresis", 0, "at least 1 (1 lowers the scale at every overflow, as Apex)"));
        }
        let recovery_growth_interval = self.recovery_growth_interval;
        if recovery_growth_interval == Some(0) {
            return Err(invalid("recovery_growth_interval", 0, "at least 1"));
        }
        let props = Properties {
            enabled: self.enabled.unwrap_or(true),
            opt_level: level,
            cast_model_type,
            patch_torch_functions: self.patch_torch_functions.unwrap_or(d.patch_torch_functions),
            keep_batchnorm_fp32: self.keep_batchnorm_fp32.or(d.keep_batchnorm_fp32).unwrap_or(false),
            master_weights: self.master_weights.or(d.master_weights).unwrap_or(false),
            loss_scale,
            cast_model_outputs: self.cast_model_outputs,
            num_losses,
            min_loss_scale: self.min_loss_scale,
            max_loss_scale,
            init_loss_scale: self.init_loss_scale,
            verbosity: self.verbosity.unwrap_or(1),
            cast_settings: CastSettings {
                low_precision_dtype: low,
                allow_banned: self.allow_banned.unwrap_or(false),
                cpu_fp16: self.cpu_fp16.unwrap_or_default(),
                cpu_bf16: self.cpu_bf16.unwrap_or_default(),
            }
            .resolved(),
            cast_policy: self.cast_policy.clone().unwrap_or_else(CastPolicy::apex),
            fp32_optimizer_state: self.fp32_optimizer_state.unwrap_or(false),
            hysteresis,
            consecutive_hysteresis: self.consecutive_hysteresis.unwrap_or(false),
            collapse_limit: self.collapse_limit.unwrap_or(consts::DEFAULT_COLLAPSE_LIMIT),
            recovery_growth_interval,
            scale_history_len: self.scale_history_len.unwrap_or(consts::DEFAULT_HISTORY_LEN),
            check_static_overflow: self.check_static_overflow.unwrap_or(false),
        };
        if let Some(kind) = props.low_precision_kind() {
            warn_if_slow_cpu_kernels(props.cast_settings().cpu_kernels_of(kind), kind);
        }
        Ok(props)
    }
}
