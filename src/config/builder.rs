//! The builder for `initialize`'s options: an opt level plus Apex's keyword overrides.
//! [`AmpConfig::build`] (in `rules.rs`) checks Apex's rules and resolves [`super::Properties`].
use crate::error::ConfigError;
use tch::Kind;

use super::table::parse_dtype;
use super::{LossScale, OptLevel};
use crate::cast::{CastPolicy, CpuKernelChoice, CpuKernels, OpClass};
use crate::error::{AmpError, Result};

/// `initialize`'s options: an opt level and Apex's overrides. A field left unset means "the
/// opt level's value". [`AmpConfig::build`] checks Apex's rules and returns [`Properties`](super::Properties).
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch_amp::{AmpConfig, LossScale, OptLevel};
/// let props = AmpConfig::new(OptLevel::O2).loss_scale(128.0).build()?;
/// assert_eq!(props.loss_scale(), LossScale::Static(128.0));
/// assert!(props.master_weights() && props.keep_batchnorm_fp32());
/// // Apex rejects master_weights under O1, and so do we.
/// assert!(AmpConfig::new(OptLevel::O1).master_weights(true).build().is_err());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AmpConfig {
    pub(super) opt_level: Option<OptLevel>,
    pub(super) enabled: Option<bool>,
    pub(super) cast_model_type: Option<Option<Kind>>,
    pub(super) patch_torch_functions: Option<bool>,
    pub(super) keep_batchnorm_fp32: Option<bool>,
    pub(super) master_weights: Option<bool>,
    pub(super) loss_scale: Option<LossScale>,
    pub(super) cast_model_outputs: Option<Kind>,
    pub(super) num_losses: Option<usize>,
    pub(super) min_loss_scale: Option<f64>,
    pub(super) max_loss_scale: Option<f64>,
    pub(super) init_loss_scale: Option<f64>,
    pub(super) verbosity: Option<u8>,
    pub(super) low_precision_dtype: Option<Kind>,
    pub(super) allow_banned: Option<bool>,
    pub(super) cpu_fp16: Option<CpuKernelChoice>,
    pub(super) cpu_bf16: Option<CpuKernelChoice>,
    pub(super) cast_policy: Option<CastPolicy>,
    pub(super) fp32_optimizer_state: Option<bool>,
    pub(super) hysteresis: Option<u32>,
    pub(super) consecutive_hysteresis: Option<bool>,
    pub(super) collapse_limit: Option<u32>,
    pub(super) recovery_growth_interval: Option<u64>,
    pub(super) scale_history_len: Option<usize>,
    pub(super) check_static_overflow: Option<bool>,
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
    /// [`ConfigError::UnknownOptLevel`] (it is the letter O), [`ConfigError::InvalidOption`] for a
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
                _ => Err(AmpError::Config(ConfigError::InvalidOption {
                    option,
                    value: value.to_string(),
                    expected: "a boolean, the string 'True' or 'False', or None",
                })),
            }
        };
        let number = |option: &'static str| -> Result<f64> {
            v.parse::<f64>().map_err(|_| {
                AmpError::Config(ConfigError::InvalidOption { option, value: value.to_string(), expected: "a number" })
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
                self.cast_model_outputs = if v == "None" { None } else { Some(parse_dtype("cast_model_outputs", v)?) }
            }
            "num_losses" => {
                self.num_losses = Some(v.parse().map_err(|_| {
                    AmpError::Config(ConfigError::InvalidOption {
                        option: "num_losses",
                        value: value.to_string(),
                        expected: "a positive integer",
                    })
                })?)
            }
            "min_loss_scale" => self.min_loss_scale = if v == "None" { None } else { Some(number("min_loss_scale")?) },
            "max_loss_scale" => self.max_loss_scale = Some(number("max_loss_scale")?),
            "hysteresis" => {
                self.hysteresis = Some(v.parse().map_err(|_| {
                    AmpError::Config(ConfigError::InvalidOption {
                        option: "hysteresis",
                        value: value.to_string(),
                        expected: "a positive integer (DeepSpeed's fp16 \"hysteresis\"; 1 is Apex's scaler)",
                    })
                })?)
            }
            "consecutive_hysteresis" => self.consecutive_hysteresis = bool_opt("consecutive_hysteresis")?,
            "verbosity" => {
                self.verbosity = Some(v.parse().map_err(|_| {
                    AmpError::Config(ConfigError::InvalidOption {
                        option: "verbosity",
                        value: value.to_string(),
                        expected: "0, 1 or 2",
                    })
                })?)
            }
            _ => {
                return Err(AmpError::Config(ConfigError::InvalidOption {
                    option: "option name",
                    value: name.to_string(),
                    expected: "one of Apex's initialize options: enabled, cast_model_type, patch_torch_functions, \
                               keep_batchnorm_fp32, master_weights, loss_scale, cast_model_outputs, num_losses, \
                               min_loss_scale, max_loss_scale, verbosity; or DeepSpeed's fp16 options \
                               hysteresis, consecutive_hysteresis",
                }))
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
    /// The dynamic scale's initial value (default `min(2^16, max_loss_scale)`, Apex's). Apex has
    /// no option for it; BERT's run_pretraining.py sets it after `amp.initialize` with
    /// `amp._amp_state.loss_scalers[0]._loss_scale = args.init_loss_scale` (every loss scaler
    /// starts at it here). Only with [`LossScale::Dynamic`]; within `[min_loss_scale,
    /// max_loss_scale]`.
    pub fn init_loss_scale(mut self, v: f64) -> Self {
        self.init_loss_scale = Some(v);
        self
    }
    /// 0 = silent, 1 = Apex's messages (default), 2 = also the resolved options at initialize.
    /// Messages go through the `log` crate (overflows and warnings at `warn`, the resolved
    /// options at `info`), never to stdout: the program's logger decides where they go.
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
    /// How every class of fp16 and bf16 ops runs on the CPU (default [`CpuKernels::Auto`]:
    /// libtorch's native kernels where they were measured fast for the class and type on this
    /// kind of CPU, see [`crate::cast::CpuFeatures::native_is_fast`], the fp32 emulation
    /// elsewhere). The choice is made at `initialize` and shown by
    /// [`crate::Properties::cast_settings`]; forcing [`CpuKernels::Native`] where it is known to
    /// be many times slower than fp32 logs a warning once.
    pub fn cpu_kernels(mut self, mode: CpuKernels) -> Self {
        self.cpu_fp16 = Some(CpuKernelChoice::all(mode));
        self.cpu_bf16 = Some(CpuKernelChoice::all(mode));
        self
    }
    /// [`Self::cpu_kernels`] for one type (`Kind::Half` or `Kind::BFloat16`; other kinds
    /// change nothing).
    pub fn cpu_kernels_for(self, kind: Kind, mode: CpuKernels) -> Self {
        self.cpu_kernel_choice(kind, CpuKernelChoice::all(mode))
    }
    /// [`Self::cpu_kernels`] for one operation class, both types; the other classes keep what
    /// was set (`Auto` unless set).
    pub fn cpu_kernels_class(mut self, class: OpClass, mode: CpuKernels) -> Self {
        self.cpu_fp16 = Some(self.cpu_fp16.unwrap_or_default().with(class, mode));
        self.cpu_bf16 = Some(self.cpu_bf16.unwrap_or_default().with(class, mode));
        self
    }
    /// Every class's mode for one type (`Kind::Half` or `Kind::BFloat16`; other kinds change
    /// nothing), e.g. parsed from `"native,convolution=emulate"` ([`CpuKernelChoice`]).
    pub fn cpu_kernel_choice(mut self, kind: Kind, choice: CpuKernelChoice) -> Self {
        match kind {
            Kind::Half => self.cpu_fp16 = Some(choice),
            Kind::BFloat16 => self.cpu_bf16 = Some(choice),
            _ => {}
        }
        self
    }
    /// `true`: emulate fp16/bf16 GEMMs and convolutions on CPU in fp32 ([`CpuKernels::Emulate`]);
    /// `false`: libtorch's native kernels ([`CpuKernels::Native`]). Unset: [`CpuKernels::Auto`].
    pub fn emulate_low_precision_on_cpu(self, on: bool) -> Self {
        self.cpu_kernels(if on { CpuKernels::Emulate } else { CpuKernels::Native })
    }

    /// Update fp16/bf16 parameters that have no fp32 master (O3, or O2 with
    /// `master_weights(false)`) in fp32 with fp32 optimizer state, rounding the result once
    /// (default false: Apex's O3, where the user's optimizer runs on the fp16 parameters with
    /// fp16 state, as torch.optim does). In fp16, Adam's `eps = 1e-8` rounds to 0 and
    /// `(1 - beta2) * g^2` underflows for small gradients, so Apex's O3 with Adam divides 0 by 0
    /// and the weights turn NaN at the first step; this option avoids that at the cost of
    /// 4 extra bytes per parameter and state element. tch-amp prints a one-time warning at
    /// verbosity >= 1 when an Adam/AdamW optimizer is built over such parameters without it.
    pub fn fp32_optimizer_state(mut self, on: bool) -> Self {
        self.fp32_optimizer_state = Some(on);
        self
    }

    /// DeepSpeed's fp16 `hysteresis` (default 1, Apex's scaler): an overflow always skips the
    /// step, but the dynamic scale is lowered only at the k-th overflow since the counter was
    /// last restored (at each growth, or at each clean pass with
    /// [`Self::consecutive_hysteresis`]). Also `from_apex` option `"hysteresis"`. Must be >= 1.
    pub fn hysteresis(mut self, k: u32) -> Self {
        self.hysteresis = Some(k);
        self
    }
    /// DeepSpeed's `consecutive_hysteresis` (default false): restore the hysteresis counter at
    /// every clean pass, so only k overflows in a row lower the scale. Also `from_apex` option
    /// `"consecutive_hysteresis"`.
    pub fn consecutive_hysteresis(mut self, on: bool) -> Self {
        self.consecutive_hysteresis = Some(on);
        self
    }
    /// How many consecutive bad passes at the scale's floor end training with
    /// [`Divergence::ScaleCollapsed`](crate::error::Divergence::ScaleCollapsed) from `step()`
    /// (default [`crate::scaling::LossScaler::DEFAULT_COLLAPSE_LIMIT`], 20; 0 turns the check off,
    /// as in Apex, which skips forever). Bad passes are overflows with the scale already at its
    /// floor (a loss that is NaN at every step), or clean passes at the floor whose gradients are
    /// all exactly zero (the scaled gradients underflowed: the model silently stopped learning). A
    /// static scale checked with [`Self::check_static_overflow`] is always at its floor.
    pub fn collapse_limit(mut self, n: u32) -> Self {
        self.collapse_limit = Some(n);
        self
    }
    /// Opt-in faster regrowth after an overflow storm (default off: Apex's 2000 clean passes
    /// per doubling). When on, the first overflow after a calm period records the scale in
    /// force as the recovery target; while the scale is below it, it doubles after `n` clean
    /// passes instead of 2000, and normal growth resumes once the target (or the cap) is
    /// reached. The price: a scale that overflows at its target comes back there every `n`
    /// passes. Must be >= 1.
    pub fn recovery_growth_interval(mut self, n: u64) -> Self {
        self.recovery_growth_interval = Some(n);
        self
    }
    /// How many of the last scale changes each scaler keeps in [`crate::scaling::LossScaler::history`]
    /// (a ring buffer; default [`crate::scaling::LossScaler::DEFAULT_HISTORY_LEN`], 256).
    pub fn scale_history_len(mut self, n: usize) -> Self {
        self.scale_history_len = Some(n);
        self
    }
    /// Opt-in overflow check for static scales (default off, as Apex: a static scale never checks,
    /// and at O0/O3 a NaN loss reaches the weights). When on, a static scaler checks the new
    /// gradients for inf/NaN at every `scale_loss` exit (one fused pass and one host sync, as a
    /// dynamic scaler), skips the step on overflow with the same diagnostics, and never changes its
    /// scale; [`Self::collapse_limit`] consecutive overflows end in
    /// [`Divergence::ScaleCollapsed`](crate::error::Divergence::ScaleCollapsed). At O0/O3 the loss
    /// then no longer passes straight through.
    pub fn check_static_overflow(mut self, on: bool) -> Self {
        self.check_static_overflow = Some(on);
        self
    }

    /// The O1 cast policy: [`CastPolicy::apex`] (default), [`CastPolicy::torch_native`], or one
    /// with the user's casts (Apex's `register_half_function` and friends).
    pub fn cast_policy(mut self, policy: CastPolicy) -> Self {
        self.cast_policy = Some(policy);
        self
    }
}
