//! Apex's loss scaler (one per loss): the dynamic state machine and a static scale.
use serde::{Deserialize, Serialize};

use crate::config::{LossScale, Properties};

/// Why a scale changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ScaleChangeReason {
    /// inf/NaN found in the gradients: step skipped, scale reduced.
    Overflow,
    /// `growth_interval` clean passes in a row: scale increased.
    Growth,
}

/// One change of a dynamic scale, kept in [`LossScaler::history`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScaleChange {
    /// Index of the backward pass (non-delayed `scale_loss` exit) that caused it, from 0.
    pub pass: u64,
    /// Scale before.
    pub from: f64,
    /// Scale after.
    pub to: f64,
    /// Overflow or growth.
    pub reason: ScaleChangeReason,
}

/// The persistent part of a scaler, in Apex's `amp.state_dict()` form.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalerState {
    /// Current scale.
    pub loss_scale: f64,
    /// Clean backward passes since the last change.
    pub unskipped: u64,
}

/// A loss scaler. Dynamic: starts at min(2^16, max), halves (not below the floor) and asks
/// for a skipped step on overflow, doubles (not above the cap) after 2000 consecutive clean
/// backward passes. Static: never checks, never skips.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    dynamic: bool,
    scale: f64,
    unskipped: u64,
    min_scale: f64,
    max_scale: f64,
    growth_interval: u64,
    growth_factor: f64,
    backoff_factor: f64,
    passes: u64,
    overflows: u64,
    history: Vec<ScaleChange>,
}

impl LossScaler {
    /// Apex's initial dynamic scale, 2^16.
    pub const INITIAL_DYNAMIC_SCALE: f64 = 65536.0;
    /// Apex's growth interval: clean backward passes before the scale doubles.
    pub const GROWTH_INTERVAL: u64 = 2000;
    /// Apex's default `max_loss_scale`: 2^24.
    pub const DEFAULT_MAX_LOSS_SCALE: f64 = 16_777_216.0;
    /// The floor tch-amp puts under a dynamic scale when `min_loss_scale` is not given: 2^-24.
    /// Apex has none (users saw the scale decay to 1e-316, a denormal, after long runs of
    /// overflows); 2^-24 is the smallest fp16 subnormal, below which a scaled fp16 gradient
    /// cannot hold any information.
    pub const DEFAULT_MIN_LOSS_SCALE: f64 = 5.960_464_477_539_063e-8;

    /// A scaler as `initialize` makes it from `props`.
    pub fn new(props: &Properties) -> Self {
        let (dynamic, scale) = match props.loss_scale() {
            LossScale::Dynamic => (true, Self::INITIAL_DYNAMIC_SCALE.min(props.max_loss_scale())),
            LossScale::Static(s) => (false, s),
        };
        Self {
            dynamic,
            scale,
            unskipped: 0,
            min_scale: props.min_loss_scale().unwrap_or(Self::DEFAULT_MIN_LOSS_SCALE),
            max_scale: props.max_loss_scale(),
            growth_interval: Self::GROWTH_INTERVAL,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            passes: 0,
            overflows: 0,
            history: Vec::new(),
        }
    }

    /// The current scale.
    pub fn loss_scale(&self) -> f64 {
        self.scale
    }
    /// Whether this scaler is dynamic.
    pub fn is_dynamic(&self) -> bool {
        self.dynamic
    }
    /// Clean backward passes since the last change (Apex's `_unskipped`).
    pub fn unskipped(&self) -> u64 {
        self.unskipped
    }
    /// Overflows seen so far.
    pub fn overflows(&self) -> u64 {
        self.overflows
    }
    /// Non-delayed backward passes seen so far.
    pub fn passes(&self) -> u64 {
        self.passes
    }
    /// Every change of the scale so far, oldest first.
    pub fn history(&self) -> &[ScaleChange] {
        &self.history
    }
    /// The floor under a dynamic scale.
    pub fn min_loss_scale(&self) -> f64 {
        self.min_scale
    }
    /// The cap over a dynamic scale.
    pub fn max_loss_scale(&self) -> f64 {
        self.max_scale
    }
    /// Clean passes before growth (2000 unless loaded from a GradScaler state).
    pub fn growth_interval(&self) -> u64 {
        self.growth_interval
    }
    /// Growth factor (2) and backoff factor (0.5).
    pub fn factors(&self) -> (f64, f64) {
        (self.growth_factor, self.backoff_factor)
    }

    /// Records one backward pass; `overflow` says whether its gradients held inf/NaN.
    /// Returns true when the step must be skipped (dynamic scaler and overflow).
    pub fn update(&mut self, overflow: bool) -> bool {
        let pass = self.passes;
        self.passes += 1;
        if overflow && self.dynamic {
            self.overflows += 1;
            let from = self.scale;
            self.scale = (self.scale * self.backoff_factor).max(self.min_scale);
            self.unskipped = 0;
            self.history.push(ScaleChange { pass, from, to: self.scale, reason: ScaleChangeReason::Overflow });
            return true;
        }
        self.unskipped += 1;
        if self.dynamic && self.unskipped >= self.growth_interval {
            let from = self.scale;
            self.scale = (self.scale * self.growth_factor).min(self.max_scale);
            self.unskipped = 0;
            if self.scale != from {
                self.history.push(ScaleChange { pass, from, to: self.scale, reason: ScaleChangeReason::Growth });
            }
        }
        false
    }

    /// The persistent state (Apex's `{"loss_scale", "unskipped"}`).
    pub fn state(&self) -> ScalerState {
        ScalerState { loss_scale: self.scale, unskipped: self.unskipped }
    }

    pub(crate) fn apply_state(&mut self, state: ScalerState) {
        self.scale = state.loss_scale;
        self.unskipped = state.unskipped;
    }

    pub(crate) fn apply_grad_scaler(
        &mut self,
        state: ScalerState,
        growth_factor: f64,
        backoff_factor: f64,
        interval: u64,
    ) {
        self.apply_state(state);
        self.growth_factor = growth_factor;
        self.backoff_factor = backoff_factor;
        self.growth_interval = interval;
    }
}
