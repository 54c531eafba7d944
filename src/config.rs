//! The builder for `initialize`'s options: an opt level plus Apex's keyword overrides.
use tch::Kind;

use crate::error::{AmpError, Result};
use crate::o1::CastPolicy;
use crate::opt_level::{parse_dtype, OptLevel};
use crate::properties::{LossScale, Properties};

/// Apex's default `max_loss_scale`: 2^24.
pub const DEFAULT_MAX_LOSS_SCALE: f64 = 16_777_216.0;

/// The floor tch-amp puts under a dynamic scale when `min_loss_scale` is not given: 2^-24.
/// Apex has none (users saw the scale decay to 1e-316, a denormal, after long runs of
/// overflows); 2^-24 is the smallest fp16 subnormal, below which a scaled fp16 gradient
/// cannot hold any information.
pub const DEFAULT_MIN_LOSS_SCALE: f64 = 5.960_464_477_539_063e-8;

/// `initialize`'s options: an opt level and Apex's overrides. A field left unset means "the
/// opt level's value". [`AmpConfig::build`] checks Apex's rules and returns [`Properties`].
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch_amp::{AmpConfig, LossScale, OptLevel};
/// let props = AmpConfig::new(OptLevel::O2).loss_scale(128.0).build()?;
/// assert_eq!(props.loss_scale, LossScale::Static(128.0));
/// assert!(props.master_weights && props.keep_batchnorm_fp32);
/// // Apex rejects master_weights under O1, and so do we.
/// assert!(AmpConfig::new(OptLevel::O1).master_weights(true).build().is_err());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AmpConfig {
    opt_level: Option<OptLevel>,
    enabled: Option<bool>,
    cast_model_type: Option<Option<Kind>>,
    patch_torch_functions: Option<bool>,
    keep_batchnorm_fp32: Option<bool>,
    master_weights: Option<bool>,
    loss_scale: Option<LossScale>,
    cast_model_outputs: Option<Kind>,
    num_losses: Option<usize>,
    min_loss_scale: Option<f64>,
    max_loss_scale: Option<f64>,
    verbosity: Option<u8>,
    low_precision_dtype: Option<Kind>,
    allow_banned: Option<bool>,
    emulate_low_precision_on_cpu: Option<bool>,
    cast_policy: Option<CastPolicy>,
}

impl AmpConfig {
    /// Options of `opt_level`, nothing overridden.
    pub fn new(opt_level: OptLevel) -> Self {
        Self { opt_level: Some(opt_level), ..Self::default() }
    }

    /// Options from Apex-style strings: `AmpConfig::from_apex("O2", &[("loss_scale", "128.0"),
    /// ("keep_batchnorm_fp32", "True")])`. Values are parsed as Apex's `initialize` parses its
    /// keyword arguments (`"True"`/`"False"`/`"None"`, `"dynamic"`, `"torch.float16"`, ...).
    ///
    /// # Errors
    /// [`AmpError::UnknownOptLevel`] (it is the letter O), [`AmpError::InvalidOption`] for a
    /// value that does not parse or an unknown option name.
    pub fn from_apex(opt_level: &str, overrides: &[(&str, &str)]) -> Result<Self> {
        let mut cfg = Self::new(opt_level.parse()?);
        for &(name, value) in overrides {
            cfg = cfg.set_apex_option(name, value)?;
        }
        Ok(cfg)
    }

    fn set_apex_option(mut self, name: &str, value: &str) -> Result<Self> {
        let v = value.trim();
        let bool_opt = |option: &'static str| -> Result<Option<bool>> {
            match v {
                "True" | "true" => Ok(Some(true)),
                "False" | "false" => Ok(Some(false)),
                "None" | "none" => Ok(None),
                _ => Err(AmpError::InvalidOption {
                    option,
                    value: value.to_string(),
                    expected: "a boolean, the string 'True' or 'False', or None",
                }),
            }
        };
        let number = |option: &'static str| -> Result<f64> {
            v.parse::<f64>().map_err(|_| AmpError::InvalidOption {
                option,
                value: value.to_string(),
                expected: "a number",
            })
        };
        match name {
            "enabled" => self.enabled = bool_opt("enabled")?,
            "cast_model_type" => {
                self.cast_model_type = match v {
                    "None" | "none" => None,
                    "False" | "false" => Some(None),
                    _ => Some(Some(parse_dtype("cast_model_type", v)?)),
                }
            }
            "patch_torch_functions" => self.patch_torch_functions = bool_opt("patch_torch_functions")?,
            "keep_batchnorm_fp32" => self.keep_batchnorm_fp32 = bool_opt("keep_batchnorm_fp32")?,
            "master_weights" => self.master_weights = bool_opt("master_weights")?,
            "loss_scale" => self.loss_scale = if v == "None" { None } else { Some(v.parse()?) },
            "cast_model_outputs" => {
                self.cast_model_outputs =
                    if v == "None" { None } else { Some(parse_dtype("cast_model_outputs", v)?) }
            }
            "num_losses" => {
                self.num_losses = Some(v.parse().map_err(|_| AmpError::InvalidOption {
                    option: "num_losses",
                    value: value.to_string(),
                    expected: "a positive integer",
                })?)
            }
            "min_loss_scale" => self.min_loss_scale = if v == "None" { None } else { Some(number("min_loss_scale")?) },
            "max_loss_scale" => self.max_loss_scale = Some(number("max_loss_scale")?),
            "verbosity" => {
                self.verbosity = Some(v.parse().map_err(|_| AmpError::InvalidOption {
                    option: "verbosity",
                    value: value.to_string(),
                    expected: "0, 1 or 2",
                })?)
            }
            _ => {
                return Err(AmpError::InvalidOption {
                    option: "option name",
                    value: name.to_string(),
                    expected: "one of Apex's initialize options: enabled, cast_model_type, patch_torch_functions, \
                               keep_batchnorm_fp32, master_weights, loss_scale, cast_model_outputs, num_losses, \
                               min_loss_scale, max_loss_scale, verbosity",
                })
            }
        }
        Ok(self)
    }

    /// `false`: tch-amp does nothing (models, optimizers and losses pass through unchanged).
    pub fn enabled(mut self, enabled: bool) -> Self {
        self.enabled = Some(enabled);
        self
    }
    /// Dtype to cast the model to; `None` is Apex's `cast_model_type=False` (no cast).
    pub fn cast_model_type(mut self, kind: Option<Kind>) -> Self {
        self.cast_model_type = Some(kind);
        self
    }
    /// Apex's `patch_torch_functions`: only valid (and already on) under O1.
    pub fn patch_torch_functions(mut self, on: bool) -> Self {
        self.patch_torch_functions = Some(on);
        self
    }
    /// Keep batch-norm variables fp32 when the model is cast (not settable under O1).
    pub fn keep_batchnorm_fp32(mut self, keep: bool) -> Self {
        self.keep_batchnorm_fp32 = Some(keep);
        self
    }
    /// Step fp32 master copies of fp16 weights (not settable under O1).
    pub fn master_weights(mut self, on: bool) -> Self {
        self.master_weights = Some(on);
        self
    }
    /// Static (`128.0`) or [`LossScale::Dynamic`] loss scaling.
    pub fn loss_scale(mut self, scale: impl Into<LossScale>) -> Self {
        self.loss_scale = Some(scale.into());
        self
    }
    /// Dtype of the model wrapper's floating outputs.
    pub fn cast_model_outputs(mut self, kind: Kind) -> Self {
        self.cast_model_outputs = Some(kind);
        self
    }
    /// Number of losses; each gets its own loss scaler, picked by `loss_id`.
    pub fn num_losses(mut self, n: usize) -> Self {
        self.num_losses = Some(n);
        self
    }
    /// Floor of the dynamic loss scale.
    pub fn min_loss_scale(mut self, v: f64) -> Self {
        self.min_loss_scale = Some(v);
        self
    }
    /// Cap of the dynamic loss scale (default 2^24).
    pub fn max_loss_scale(mut self, v: f64) -> Self {
        self.max_loss_scale = Some(v);
        self
    }
    /// 0 = silent, 1 = Apex's messages (default), 2 = also the resolved options at initialize.
    pub fn verbosity(mut self, v: u8) -> Self {
        self.verbosity = Some(v);
        self
    }
    /// The O1 policy's low-precision dtype: `Kind::Half` (default) or `Kind::BFloat16`.
    /// With bf16 and no explicit `loss_scale`, the loss scale defaults to static 1.0: bf16 has
    /// fp32's exponent range and needs no scaling.
    pub fn low_precision_dtype(mut self, kind: Kind) -> Self {
        self.low_precision_dtype = Some(kind);
        self
    }
    /// O1: run banned ops (binary_cross_entropy) in fp32 instead of failing
    /// (Apex's `allow_banned`).
    pub fn allow_banned(mut self, allow: bool) -> Self {
        self.allow_banned = Some(allow);
        self
    }
    /// Emulate fp16/bf16 GEMMs and convolutions on CPU (default on): compute in fp32 from the
    /// rounded inputs and round the outputs. `false` uses libtorch's native half kernels.
    pub fn emulate_low_precision_on_cpu(mut self, on: bool) -> Self {
        self.emulate_low_precision_on_cpu = Some(on);
        self
    }

    /// The O1 cast policy: [`CastPolicy::apex`] (default), [`CastPolicy::torch_native`], or one
    /// with the user's casts (Apex's `register_half_function` and friends).
    pub fn cast_policy(mut self, policy: CastPolicy) -> Self {
        self.cast_policy = Some(policy);
        self
    }

    fn incompatible(level: OptLevel, option: &'static str, why: &'static str) -> AmpError {
        AmpError::IncompatibleOption { level, option, why }
    }

    /// Applies the overrides to the level's defaults and checks Apex's rules.
    ///
    /// # Errors
    /// [`AmpError::IncompatibleOption`] for what Apex rejects: `cast_model_type` other than
    /// fp32/`None` under O1, `patch_torch_functions` outside O1, `keep_batchnorm_fp32` or
    /// `master_weights` set under O1; [`AmpError::InvalidOption`] for a non-positive or
    /// non-finite loss scale, min above max, `num_losses == 0`, or a low-precision dtype
    /// other than fp16/bf16; `cast_policy` outside O1 is an [`AmpError::IncompatibleOption`].
    pub fn build(&self) -> Result<Properties> {
        let level = self.opt_level.unwrap_or(OptLevel::O1);
        let d = level.defaults()?;
        let o1 = level == OptLevel::O1;
        if let Some(cast) = self.cast_model_type {
            if o1 && !matches!(cast, None | Some(Kind::Float)) {
                return Err(Self::incompatible(
                    level,
                    "cast_model_type",
                    "O1 inserts casts around ops rather than casting the model weights, so the weights \
                     stay fp32; use O2 or O3 to cast the model",
                ));
            }
        }
        if self.patch_torch_functions == Some(true) && !o1 {
            return Err(Self::incompatible(
                level,
                "patch_torch_functions",
                "the per-op cast policy is only set by choosing opt level O1",
            ));
        }
        if o1 && self.keep_batchnorm_fp32.is_some() {
            return Err(Self::incompatible(
                level,
                "keep_batchnorm_fp32",
                "under O1 batch norm already runs in fp32 through the cast policy; leave it unset",
            ));
        }
        if o1 && self.master_weights.is_some() {
            return Err(Self::incompatible(
                level,
                "master_weights",
                "master weights make no sense under O1, whose model weights are fp32 already; leave it unset",
            ));
        }
        if !o1 && self.cast_policy.is_some() {
            return Err(Self::incompatible(
                level,
                "cast_policy",
                "a per-op cast policy only acts under O1 (Apex's register_*_function too); choose O1",
            ));
        }
        let low = self.low_precision_dtype.unwrap_or(Kind::Half);
        if !matches!(low, Kind::Half | Kind::BFloat16) {
            return Err(AmpError::InvalidOption {
                option: "low_precision_dtype",
                value: format!("{low:?}"),
                expected: "Kind::Half or Kind::BFloat16",
            });
        }
        let cast_model_type = self.cast_model_type.unwrap_or(d.cast_model_type);
        if let Some(k) = cast_model_type {
            if !matches!(k, Kind::Half | Kind::BFloat16 | Kind::Float) {
                return Err(AmpError::InvalidOption {
                    option: "cast_model_type",
                    value: format!("{k:?}"),
                    expected: "Kind::Half, Kind::BFloat16, Kind::Float or None",
                });
            }
        }
        let bf16 = if o1 { low == Kind::BFloat16 } else { cast_model_type == Some(Kind::BFloat16) };
        let loss_scale = match self.loss_scale {
            Some(s) => s.validated()?,
            None if bf16 => LossScale::Static(1.0),
            None => d.loss_scale,
        };
        let max_loss_scale = self.max_loss_scale.unwrap_or(DEFAULT_MAX_LOSS_SCALE);
        let positive = |option: &'static str, v: f64| -> Result<f64> {
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(AmpError::InvalidOption { option, value: v.to_string(), expected: "a finite positive number" })
            }
        };
        positive("max_loss_scale", max_loss_scale)?;
        if let Some(min) = self.min_loss_scale {
            positive("min_loss_scale", min)?;
            if min > max_loss_scale {
                return Err(AmpError::InvalidOption {
                    option: "min_loss_scale",
                    value: min.to_string(),
                    expected: "a value not above max_loss_scale",
                });
            }
        }
        let num_losses = self.num_losses.unwrap_or(1);
        if num_losses == 0 {
            return Err(AmpError::InvalidOption { option: "num_losses", value: "0".into(), expected: "at least 1" });
        }
        let cast_model_outputs = self.cast_model_outputs;
        if let Some(k) = cast_model_outputs {
            if !matches!(k, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double) {
                return Err(AmpError::InvalidOption {
                    option: "cast_model_outputs",
                    value: format!("{k:?}"),
                    expected: "a floating kind",
                });
            }
        }
        Ok(Properties {
            enabled: self.enabled.unwrap_or(true),
            opt_level: level,
            cast_model_type,
            patch_torch_functions: self.patch_torch_functions.unwrap_or(d.patch_torch_functions),
            keep_batchnorm_fp32: self.keep_batchnorm_fp32.or(d.keep_batchnorm_fp32).unwrap_or(false),
            master_weights: self.master_weights.or(d.master_weights).unwrap_or(false),
            loss_scale,
            cast_model_outputs,
            num_losses,
            min_loss_scale: self.min_loss_scale,
            max_loss_scale,
            verbosity: self.verbosity.unwrap_or(1),
            low_precision_dtype: low,
            allow_banned: self.allow_banned.unwrap_or(false),
            emulate_low_precision_on_cpu: self.emulate_low_precision_on_cpu.unwrap_or(true),
            cast_policy: self.cast_policy.clone().unwrap_or_else(CastPolicy::apex),
        })
    }
}
