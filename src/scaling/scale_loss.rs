//! The options and the outcome of one `scale_loss` call.

/// Options of one [`crate::Amp::scale_loss_with`] call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScaleLossOptions {
    /// Which loss scaler (`0..num_losses`).
    pub loss_id: usize,
    /// Keep the gradients scaled and accumulate them; no unscale, no overflow check, no scale
    /// update until a later call without it (Apex's `delay_unscale`).
    pub delay_unscale: bool,
}

/// What one `scale_loss` did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleLossOutcome {
    /// The loss scaler used.
    pub loss_id: usize,
    /// The scale the loss was multiplied by.
    pub loss_scale: f64,
    /// inf/NaN found in the new gradients (always false for static scaling and delayed passes).
    pub overflow: bool,
    /// The scaler's scale after this pass.
    pub new_loss_scale: f64,
    /// The gradients were left scaled (`delay_unscale`).
    pub delayed: bool,
    /// The loss went to `backward` unscaled and unchecked (disabled AMP, or static scale 1.0
    /// without master weights, as in Apex, unless
    /// [`crate::AmpConfig::check_static_overflow`] is on).
    pub passed_through: bool,
}
