//! The stand-alone scaler classes of `apex.fp16_utils.loss_scaler`: [`StaticLossScaler`]
//! (Apex's `LossScaler`) and [`DynamicLossScaler`], for scripts that scaled by hand
//! (`FP16_Optimizer` itself used amp's scaler; see [`super::DynamicLossArgs`]).
use crate::error::ConfigError;
use tch::{Kind, Tensor};

use crate::error::{AmpError, Result, TorchContext};

/// Apex's `apex.fp16_utils.LossScaler(scale=1)`: a fixed scale; never an overflow.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StaticLossScaler {
    cur_scale: f64,
}

impl StaticLossScaler {
    /// A scaler with a fixed `scale`.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a scale that is not finite and positive.
    pub fn new(scale: f64) -> Result<Self> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(AmpError::Config(ConfigError::InvalidOption {
                option: "scale",
                value: scale.to_string(),
                expected: "a finite positive number",
            }));
        }
        Ok(Self { cur_scale: scale })
    }
    /// The scale (Apex's `loss_scale` property).
    pub fn loss_scale(&self) -> f64 {
        self.cur_scale
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
        (loss * self.cur_scale).f_backward().ctx("backward")
    }
}

/// Apex's `apex.fp16_utils.DynamicLossScaler(init_scale=2**32, scale_factor=2.,
/// scale_window=1000)`: on overflow the scale is divided by `scale_factor` (never below 1);
/// it is multiplied by `scale_factor` at every iteration whose distance from the last overflow
/// (or from iteration -1 at the start) is a multiple of `scale_window`, i.e. after each
/// `scale_window` clean iterations. No cap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamicLossScaler {
    cur_scale: f64,
    cur_iter: i64,
    last_overflow_iter: i64,
    scale_factor: f64,
    scale_window: i64,
}

impl Default for DynamicLossScaler {
    /// Apex's defaults: 2^32, factor 2, window 1000.
    fn default() -> Self {
        Self { cur_scale: 4_294_967_296.0, cur_iter: 0, last_overflow_iter: -1, scale_factor: 2.0, scale_window: 1000 }
    }
}

impl DynamicLossScaler {
    /// A scaler with Apex's arguments.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for an `init_scale` that is not finite and positive, a
    /// `scale_factor` not above 1, or a `scale_window` of 0 (Apex divided by it).
    pub fn new(init_scale: f64, scale_factor: f64, scale_window: u64) -> Result<Self> {
        let bad = |option: &'static str, value: String, expected: &'static str| {
            AmpError::Config(ConfigError::InvalidOption { option, value, expected })
        };
        if !(init_scale.is_finite() && init_scale > 0.0) {
            return Err(bad("init_scale", init_scale.to_string(), "a finite positive number"));
        }
        if !(scale_factor.is_finite() && scale_factor > 1.0) {
            return Err(bad("scale_factor", scale_factor.to_string(), "a finite number above 1"));
        }
        let window = i64::try_from(scale_window).ok().filter(|&w| w > 0);
        let Some(scale_window) = window else {
            return Err(bad("scale_window", scale_window.to_string(), "at least 1 (and below 2^63)"));
        };
        Ok(Self { cur_scale: init_scale, cur_iter: 0, last_overflow_iter: -1, scale_factor, scale_window })
    }

    /// The scale (Apex's `loss_scale` property).
    pub fn loss_scale(&self) -> f64 {
        self.cur_scale
    }

    /// Iterations counted so far (Apex's `cur_iter`) and the last overflow's (`-1`: none).
    pub fn iterations(&self) -> (i64, i64) {
        (self.cur_iter, self.last_overflow_iter)
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
            self.cur_scale = (self.cur_scale / self.scale_factor).max(1.0);
            self.last_overflow_iter = self.cur_iter;
        } else if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0 {
            self.cur_scale *= self.scale_factor;
        }
        self.cur_iter += 1;
    }

    /// `(loss * loss_scale).backward()`.
    ///
    /// # Errors
    /// [`AmpError::Torch`] from backward.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        (loss * self.cur_scale).f_backward().ctx("backward")
    }
}
