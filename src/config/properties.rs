//! The resolved options of one `initialize`: an opt level's row with the user's overrides.
use tch::Kind;

use super::{LossScale, OptLevel};
use crate::cast::{CastPolicy, CastSettings, CpuKernelChoice};

/// Options in force after `initialize`: the opt level's defaults with overrides applied and
/// Apex's rules checked. Built by [`crate::AmpConfig::build`]; read-only.
#[derive(Debug, Clone, PartialEq)]
pub struct Properties {
    pub(super) enabled: bool,
    pub(super) opt_level: OptLevel,
    pub(super) cast_model_type: Option<Kind>,
    pub(super) patch_torch_functions: bool,
    pub(super) keep_batchnorm_fp32: bool,
    pub(super) master_weights: bool,
    pub(super) loss_scale: LossScale,
    pub(super) cast_model_outputs: Option<Kind>,
    pub(super) num_losses: usize,
    pub(super) min_loss_scale: Option<f64>,
    pub(super) max_loss_scale: f64,
    pub(super) init_loss_scale: Option<f64>,
    pub(super) verbosity: u8,
    pub(super) cast_settings: CastSettings,
    pub(super) cast_policy: CastPolicy,
    pub(super) fp32_optimizer_state: bool,
    pub(super) hysteresis: u32,
    pub(super) consecutive_hysteresis: bool,
    pub(super) collapse_limit: u32,
    pub(super) recovery_growth_interval: Option<u64>,
    pub(super) scale_history_len: usize,
    pub(super) check_static_overflow: bool,
}

impl Properties {
    /// `false` makes tch-amp a pass-through (Apex's `enabled=False`).
    pub fn enabled(&self) -> bool {
        self.enabled
    }
    /// The opt level the defaults came from.
    pub fn opt_level(&self) -> OptLevel {
        self.opt_level
    }
    /// Dtype the model's floating variables are cast to; `None` leaves them alone.
    pub fn cast_model_type(&self) -> Option<Kind> {
        self.cast_model_type
    }
    /// Whether the per-op cast policy (O1) is installed.
    pub fn patch_torch_functions(&self) -> bool {
        self.patch_torch_functions
    }
    /// Whether batch-norm variables stay fp32 when the model is cast.
    pub fn keep_batchnorm_fp32(&self) -> bool {
        self.keep_batchnorm_fp32
    }
    /// Whether optimizers step fp32 master copies of the fp16 weights.
    pub fn master_weights(&self) -> bool {
        self.master_weights
    }
    /// Static or dynamic loss scaling.
    pub fn loss_scale(&self) -> LossScale {
        self.loss_scale
    }
    /// Dtype the model wrapper casts floating outputs to (default fp32 when the model is cast).
    pub fn cast_model_outputs(&self) -> Option<Kind> {
        self.cast_model_outputs
    }
    /// Number of losses, one loss scaler each.
    pub fn num_losses(&self) -> usize {
        self.num_losses
    }
    /// Floor of the dynamic scale as given (`None`: tch-amp's
    /// [`crate::scaling::LossScaler::DEFAULT_MIN_LOSS_SCALE`]; Apex had none).
    pub fn min_loss_scale(&self) -> Option<f64> {
        self.min_loss_scale
    }
    /// Cap of the dynamic scale (Apex default 2^24).
    pub fn max_loss_scale(&self) -> f64 {
        self.max_loss_scale
    }
    /// The dynamic scale's initial value as given ([`crate::AmpConfig::init_loss_scale`];
    /// `None`: `min(2^16, max_loss_scale)`).
    pub fn init_loss_scale(&self) -> Option<f64> {
        self.init_loss_scale
    }
    /// 0 = silent, 1 = Apex's messages (overflow lines, `log::warn!`), 2 = also the resolved
    /// options (`log::info!`).
    pub fn verbosity(&self) -> u8 {
        self.verbosity
    }
    /// The cast engine's switches: O1's low-precision dtype, `allow_banned`, and how fp16/bf16
    /// GEMMs, convolutions and attention run on the CPU (O1, O2 and O3), `Auto` already resolved
    /// class by class to [`crate::CpuKernels::Native`] or [`crate::CpuKernels::Emulate`] for
    /// this CPU.
    pub fn cast_settings(&self) -> CastSettings {
        self.cast_settings
    }
    /// The 16-bit type this configuration computes in: O1's low-precision dtype, or the model's
    /// cast type when it is fp16/bf16; `None` for fp32 training (O0) or a disabled config.
    pub fn low_precision_kind(&self) -> Option<Kind> {
        if !self.enabled {
            return None;
        }
        if self.patch_torch_functions {
            return Some(self.cast_settings.low_precision_dtype);
        }
        self.cast_model_type.filter(|k| matches!(k, Kind::Half | Kind::BFloat16))
    }
    /// How this configuration's fp16/bf16 GEMMs, convolutions and attention run on the CPU
    /// (resolved for [`Self::low_precision_kind`]); `None` when it computes in fp32.
    pub fn cpu_kernels(&self) -> Option<CpuKernelChoice> {
        self.low_precision_kind().map(|k| self.cast_settings.cpu_kernels_of(k))
    }
    /// The O1 cast policy (Apex's lists unless another was given).
    pub fn cast_policy(&self) -> &CastPolicy {
        &self.cast_policy
    }
    /// Whether fp16/bf16 parameters without masters are updated in fp32 with fp32 optimizer
    /// state (see [`crate::AmpConfig::fp32_optimizer_state`]; default false, as Apex).
    pub fn fp32_optimizer_state(&self) -> bool {
        self.fp32_optimizer_state
    }
    /// DeepSpeed's hysteresis k (1: Apex's scaler).
    pub fn hysteresis(&self) -> u32 {
        self.hysteresis
    }
    /// Whether the hysteresis counter is restored at every clean pass.
    pub fn consecutive_hysteresis(&self) -> bool {
        self.consecutive_hysteresis
    }
    /// Consecutive bad passes at the floor before
    /// [`Divergence::ScaleCollapsed`](crate::error::Divergence::ScaleCollapsed) (0: never).
    pub fn collapse_limit(&self) -> u32 {
        self.collapse_limit
    }
    /// The faster growth interval while recovering from an overflow storm (`None`: off).
    pub fn recovery_growth_interval(&self) -> Option<u64> {
        self.recovery_growth_interval
    }
    /// How many scale changes each scaler's history keeps.
    pub fn scale_history_len(&self) -> usize {
        self.scale_history_len
    }
    /// Whether static scales check for overflow (tch-amp's opt-in; Apex never does).
    pub fn check_static_overflow(&self) -> bool {
        self.check_static_overflow
    }
}
