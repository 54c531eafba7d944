//! Overflow diagnostics: which parameters had non-finite gradients at an overflow, with their
//! inf and NaN counts. Computed only when an overflow was found (the clean path reads one
//! flag, as before).
use std::fmt;

use crate::doctor::NonFiniteOrigin;

/// One parameter with non-finite gradient values at an overflow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFiniteGrad {
    /// The VarStore name.
    pub name: String,
    /// Elements that are +inf or -inf.
    pub inf: u64,
    /// Elements that are NaN.
    pub nan: u64,
}

/// What one overflow looked like: kept by [`crate::AmpOptimizer::last_overflow`] and
/// [`crate::Amp::last_overflow`], printed at verbosity >= 1 when the step is skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct OverflowReport {
    /// The loss whose scaler saw it.
    pub loss_id: usize,
    /// The scaler's pass index (non-delayed `scale_loss` exits, from 0).
    pub pass: u64,
    /// The scale the loss was multiplied by.
    pub loss_scale: f64,
    /// The scale after the overflow (the same when at the floor, static, or kept by hysteresis).
    pub new_loss_scale: f64,
    /// Whether the scaler is dynamic (a static one checks only with
    /// [`crate::AmpConfig::check_static_overflow`]).
    pub dynamic: bool,
    /// Consecutive overflows with the scale at its floor, this one included (0 when the scale
    /// was above its floor).
    pub overflows_at_floor: u64,
    /// Parameters whose gradients (after unscaling, in the optimizers' accumulation) held inf
    /// or NaN: each optimizer given to `scale_loss` in turn, its parameters in model order
    /// (the order the variables were created in the `VarStore`).
    pub params: Vec<NonFiniteGrad>,
    /// Where the batch's first inf/NaN appeared, when a [`crate::doctor::Watch`] was alive on
    /// the thread (`None` otherwise, or when no observed op produced it).
    pub first_non_finite: Option<NonFiniteOrigin>,
}

impl OverflowReport {
    /// Names of the first `n` parameters with non-finite gradients.
    pub fn first_params(&self, n: usize) -> Vec<String> {
        self.params.iter().take(n).map(|p| p.name.clone()).collect()
    }
}

impl fmt::Display for OverflowReport {
    /// The lines printed at verbosity >= 1: Apex's overflow line (worded for a kept scale),
    /// where the first inf/NaN appeared (with a [`crate::doctor::Watch`]), then the parameters
    /// with non-finite gradients (the first 8).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let id = self.loss_id;
        if self.new_loss_scale < self.loss_scale {
            write!(
                f,
                "Gradient overflow.  Skipping step, loss scaler {id} reducing loss scale to {}",
                self.new_loss_scale
            )?;
        } else if !self.dynamic {
            write!(
                f,
                "Gradient overflow.  Skipping step, loss scaler {id} keeps its static loss scale {} \
                 ({} overflows in a row)",
                self.loss_scale, self.overflows_at_floor
            )?;
        } else if self.overflows_at_floor > 0 {
            write!(
                f,
                "Gradient overflow.  Skipping step, loss scaler {id} is at its floor {} \
                 ({} overflows in a row at the floor)",
                self.loss_scale, self.overflows_at_floor
            )?;
        } else {
            write!(
                f,
                "Gradient overflow.  Skipping step, loss scaler {id} keeps loss scale {} (hysteresis)",
                self.loss_scale
            )?;
        }
        if let Some(origin) = &self.first_non_finite {
            write!(f, "\n  first non-finite: {origin}")?;
        }
        if self.params.is_empty() {
            return Ok(());
        }
        write!(f, "\n  non-finite gradients:")?;
        for (i, p) in self.params.iter().take(8).enumerate() {
            let sep = if i == 0 { " " } else { "; " };
            write!(f, "{sep}{} ({} inf, {} NaN)", p.name, p.inf, p.nan)?;
        }
        if self.params.len() > 8 {
            write!(f, "; and {} more", self.params.len() - 8)?;
        }
        Ok(())
    }
}
