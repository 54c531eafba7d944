//! The stand-alone scaler classes of `apex.fp16_utils.loss_scaler`: [`StaticLossScaler`]
//! (Apex's `LossScaler`) and [`DynamicLossScaler`], for scripts that scaled by hand
//! (`FP16_Optimizer` itself used amp's scaler; see [`super::DynamicLossArgs`]). Both are the one
//! [`LossScaler`] with apex.fp16_utils' window, factor and floor.
use tch::{Kind, Tensor};

use crate::config::rules::{growth_factor, growth_interval, positive_scale};
#[cfg(doc)]
use crate::error::{AmpError, ConfigError};
use crate::error::{Result, TorchContext};
use crate::scaling::LossScaler;

/// Apex's `apex.fp16_utils.LossScaler(scale=1)`: a fixed scale; never an overflow. A static
/// [`LossScaler`] underneath.
#[derive(Debug, Clone, PartialEq)]
pub struct StaticLossScaler {
    scaler: LossScaler,
}

impl StaticLossScaler {
    /// A scaler with a fixed `scale`.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a scale that is not finite and positive.
    pub fn new(scale: f64) -> Result<Self> {
        let scale = positive_scale("scale", scale)?;
        Ok(Self { scaler: LossScaler::with_rule(false, scale, scale, scale, 1, 2.0) })
    }
    /// The scale (Apex's `loss_scale` property).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.loss_scale()
    }
    /// Always false (Apex's `has_overflow`).
    pub fn has_overflow(&self, _params: &[Tensor]) -> bool {
        false
    }
    /// Nothing to do (Apex's `update_scale`).
    pub fn update_scale(&mut self, _overflow: bool) {}
    /// `(loss * loss_scale).backward()`.
    ///
    /// # Errors
    /// [`AmpError::Torch`] from backward.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        (loss * self.loss_scale()).f_backward().ctx("backward")
    }
}

/// Apex's `apex.fp16_utils.DynamicLossScaler(init_scale=2**32, scale_factor=2.,
/// scale_window=1000)`: on overflow the scale is divided by `scale_factor` (never below 1);
/// it is multiplied by `scale_factor` at every iteration whose distance from the last overflow
/// (or from iteration -1 at the start) is a multiple of `scale_window`, i.e. after each
/// `scale_window` clean iterations. No cap. A dynamic [`LossScaler`] with that window, factor
/// and floor underneath (it multiplies by `1 / scale_factor`: Apex's division, exactly, for
/// factors that are powers of two, such as the default 2).
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicLossScaler {
    scaler: LossScaler,
    last_overflow_iter: i64,
}

impl Default for DynamicLossScaler {
    /// Apex's defaults: 2^32, factor 2, window 1000.
    fn default() -> Self {
        Self { scaler: LossScaler::with_rule(true, 4_294_967_296.0, 1.0, f64::MAX, 1000, 2.0), last_overflow_iter: -1 }
    }
}

impl DynamicLossScaler {
    /// A scaler with Apex's arguments.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for an `init_scale` that is not finite and positive, a
    /// `scale_factor` not above 1, or a `scale_window` of 0 (Apex divided by it).
    pub fn new(init_scale: f64, scale_factor: f64, scale_window: u64) -> Result<Self> {
        let init_scale = positive_scale("init_scale", init_scale)?;
        let scale_factor = growth_factor("scale_factor", scale_factor)?;
        let window = growth_interval("scale_window", i64::try_from(scale_window).unwrap_or(0))?;
        let scaler = LossScaler::with_rule(true, init_scale, 1.0, f64::MAX, window.unsigned_abs(), scale_factor);
        Ok(Self { scaler, last_overflow_iter: -1 })
    }

    /// The scale (Apex's `loss_scale` property).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.loss_scale()
    }

    /// Iterations counted so far (Apex's `cur_iter`) and the last overflow's (`-1`: none).
    pub fn iterations(&self) -> (i64, i64) {
        (i64::try_from(self.scaler.passes()).unwrap_or(i64::MAX), self.last_overflow_iter)
    }

    /// Apex's `has_overflow(params)`: some parameter's gradient, summed in fp32, is inf or
    /// NaN (so a finite fp32 gradient whose sum overflows counts, as in Apex).
    ///
    /// # Errors
    /// [`AmpError::Torch`] if the sum fails.
    pub fn has_overflow(&self, params: &[Tensor]) -> Result<bool> {
        for p in params {
            let g = p.grad();
            if g.defined() {
                let sum = g.f_to_kind(Kind::Float).and_then(|f| f.f_sum(Kind::Float)).ctx("overflow check")?;
                if !sum.f_double_value(&[]).ctx("overflow check")?.is_finite() {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Apex's `update_scale(overflow)`.
    pub fn update_scale(&mut self, overflow: bool) {
        if overflow {
            self.last_overflow_iter = self.iterations().0;
        }
        self.scaler.update(overflow);
    }

    /// `(loss * loss_scale).backward()`.
    ///
    /// # Errors
    /// [`AmpError::Torch`] from backward.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        (loss * self.loss_scale()).f_backward().ctx("backward")
    }
}
