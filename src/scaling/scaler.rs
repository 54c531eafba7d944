//! Apex's loss scaler (one per loss): the dynamic state machine and a static scale, with
//! tch-amp's additions (all off or Apex-neutral by default): DeepSpeed's hysteresis, an opt-in
//! overflow check for static scales, the collapse detection at the floor, an opt-in faster
//! regrowth after an overflow storm, and a bounded history of scale changes.
use serde::{Deserialize, Serialize};

use crate::config::{scale_constants as consts, LossScale, Properties};

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

/// The persistent part of a scaler, in Apex's `amp.state_dict()` form. The two optional
/// fields are tch-amp's: they are written only when they carry something (a hysteresis above
/// 1, an active recovery), so a default scaler's state is exactly Apex's
/// `{"loss_scale": .., "unskipped": ..}`, and Apex's form loads into any scaler.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalerState {
    /// Current scale.
    pub loss_scale: f64,
    /// Clean backward passes since the last change.
    pub unskipped: u64,
    /// Overflows still to come before the scale is lowered (DeepSpeed's `cur_hysteresis`);
    /// written only by a scaler with hysteresis above 1. Absent: the configured hysteresis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hysteresis_left: Option<u32>,
    /// The scale a recovering scaler grows back to at the faster rate
    /// ([`crate::AmpConfig::recovery_growth_interval`]); written only while recovering.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_target: Option<f64>,
}

/// How a run of bad passes at the scale's floor looks, as [`LossScaler::collapse`] reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Collapse {
    /// Consecutive overflowing passes with the scale already at its floor.
    OverflowAtFloor { first_pass: u64, passes: u64 },
    /// Consecutive clean passes at the floor whose gradients were all exactly zero.
    ZeroGradients { first_pass: u64, passes: u64 },
}

/// A run of consecutive passes of one kind: its first pass and its length.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Streak {
    first_pass: u64,
    passes: u64,
}

impl Streak {
    fn extend(&mut self, pass: u64) {
        if self.passes == 0 {
            self.first_pass = pass;
        }
        self.passes = self.passes.saturating_add(1);
    }
}

/// A loss scaler. Dynamic: starts at min(2^16, max), halves (not below the floor) and asks
/// for a skipped step on overflow, doubles (not above the cap) after 2000 consecutive clean
/// backward passes. Static: never checks, never skips (unless
/// [`crate::AmpConfig::check_static_overflow`] is set: then it skips, never changing).
///
/// With hysteresis k > 1 ([`crate::AmpConfig::hysteresis`], DeepSpeed's `hysteresis`), an
/// overflow skips the step but lowers the scale only when it is the k-th since the counter
/// was last restored; the counter is restored at each growth, or with
/// `consecutive_hysteresis` at each clean pass. k = 1 is Apex's scaler.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    dynamic: bool,
    check_static: bool,
    scale: f64,
    unskipped: u64,
    min_scale: f64,
    max_scale: f64,
    growth_interval: u64,
    growth_factor: f64,
    backoff_factor: f64,
    hysteresis: u32,
    consecutive_hysteresis: bool,
    hysteresis_left: u32,
    recovery_interval: Option<u64>,
    recovery_target: Option<f64>,
    collapse_limit: u32,
    floor_overflows: Streak,
    floor_zero_grads: Streak,
    passes: u64,
    overflows: u64,
    history: Vec<ScaleChange>,
    history_len: usize,
}

impl LossScaler {
    /// Apex's initial dynamic scale, 2^16.
    pub const INITIAL_DYNAMIC_SCALE: f64 = consts::INITIAL_DYNAMIC_SCALE;
    /// Apex's growth interval: clean backward passes before the scale doubles.
    pub const GROWTH_INTERVAL: u64 = consts::GROWTH_INTERVAL;
    /// Apex's default `max_loss_scale`: 2^24.
    pub const DEFAULT_MAX_LOSS_SCALE: f64 = consts::DEFAULT_MAX_LOSS_SCALE;
    /// The floor tch-amp puts under a dynamic scale when `min_loss_scale` is not given: 2^-24.
    /// Apex has none (users saw the scale decay to 1e-316, a denormal, after long runs of
    /// overflows); 2^-24 is the smallest fp16 subnormal, below which a scaled fp16 gradient
    /// cannot hold any information.
    pub const DEFAULT_MIN_LOSS_SCALE: f64 = consts::DEFAULT_MIN_LOSS_SCALE;
    /// The range every scale (static, dynamic, floor, cap, loaded) must lie in: 2^-126 to
    /// 2^127, so that the scale and its inverse are normal fp32 numbers (the loss is scaled
    /// and the gradients unscaled in fp32).
    pub const SCALE_RANGE: (f64, f64) = consts::SCALE_RANGE;
    /// Default of [`crate::AmpConfig::collapse_limit`]: 20 consecutive overflowing passes with the
    /// scale at its floor (or 20 consecutive clean passes there whose gradients are all exactly
    /// zero) end in [`Divergence::ScaleCollapsed`](crate::error::Divergence::ScaleCollapsed).
    pub const DEFAULT_COLLAPSE_LIMIT: u32 = consts::DEFAULT_COLLAPSE_LIMIT;
    /// Default of [`crate::AmpConfig::scale_history_len`]: the last 256 scale changes are kept.
    pub const DEFAULT_HISTORY_LEN: usize = consts::DEFAULT_HISTORY_LEN;

    /// A scaler as `initialize` makes it from `props`.
    pub fn new(props: &Properties) -> Self {
        let (dynamic, scale) = match props.loss_scale() {
            LossScale::Dynamic => {
                (true, props.init_loss_scale().unwrap_or(Self::INITIAL_DYNAMIC_SCALE.min(props.max_loss_scale())))
            }
            LossScale::Static(s) => (false, s),
        };
        let mut s = Self::with_rule(
            dynamic,
            scale,
            props.min_loss_scale().unwrap_or(Self::DEFAULT_MIN_LOSS_SCALE),
            props.max_loss_scale(),
            Self::GROWTH_INTERVAL,
            2.0,
        );
        s.check_static = props.check_static_overflow();
        s.hysteresis = props.hysteresis();
        s.consecutive_hysteresis = props.consecutive_hysteresis();
        s.hysteresis_left = props.hysteresis();
        s.recovery_interval = props.recovery_growth_interval();
        s.collapse_limit = props.collapse_limit();
        s.history_len = props.scale_history_len();
        s
    }

    /// A scaler starting at `scale` (checked by the caller) that, when `dynamic`, multiplies it
    /// by `growth_factor` after `growth_interval` clean passes and by `1 / growth_factor` at an
    /// overflow, within `[min, max]`; no hysteresis, recovery, collapse detection or history.
    pub(crate) fn with_rule(
        dynamic: bool,
        scale: f64,
        min: f64,
        max: f64,
        growth_interval: u64,
        growth_factor: f64,
    ) -> Self {
        Self {
            dynamic,
            check_static: false,
            scale,
            unskipped: 0,
            min_scale: min,
            max_scale: max,
            growth_interval,
            growth_factor,
            backoff_factor: 1.0 / growth_factor,
            hysteresis: 1,
            consecutive_hysteresis: false,
            hysteresis_left: 1,
            recovery_interval: None,
            recovery_target: None,
            collapse_limit: 0,
            floor_overflows: Streak::default(),
            floor_zero_grads: Streak::default(),
            passes: 0,
            overflows: 0,
            history: Vec::new(),
            history_len: 0,
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
    /// Whether this scaler checks the gradients for inf/NaN (dynamic, or static with
    /// [`crate::AmpConfig::check_static_overflow`]).
    pub fn checks_overflow(&self) -> bool {
        self.dynamic || self.check_static
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
    /// The last changes of the scale (at most [`crate::AmpConfig::scale_history_len`], a ring
    /// buffer), oldest first. A scale that stays put (an overflow at the floor or tolerated by
    /// hysteresis, a growth at the cap) is no change.
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
    /// Whether the scale sits at its floor (a static scale always does: it cannot go lower).
    pub fn at_floor(&self) -> bool {
        !self.dynamic || self.scale <= self.min_scale
    }
    /// Clean passes before growth (2000 unless loaded from a GradScaler state).
    pub fn growth_interval(&self) -> u64 {
        self.growth_interval
    }
    /// Growth factor (2) and backoff factor (0.5).
    pub fn factors(&self) -> (f64, f64) {
        (self.growth_factor, self.backoff_factor)
    }
    /// The hysteresis k (1: Apex) and whether it is restored at every clean pass.
    pub fn hysteresis(&self) -> (u32, bool) {
        (self.hysteresis, self.consecutive_hysteresis)
    }
    /// Overflows still to come before the scale is lowered (k right after a restore; 1 means
    /// the next overflow lowers it).
    pub fn hysteresis_left(&self) -> u32 {
        self.hysteresis_left
    }
    /// While recovering from an overflow storm with
    /// [`crate::AmpConfig::recovery_growth_interval`]: the scale it grows back to at the faster
    /// rate.
    pub fn recovery_target(&self) -> Option<f64> {
        self.recovery_target
    }
    /// Consecutive overflowing passes so far with the scale at its floor (0 after a clean
    /// pass).
    pub fn overflows_at_floor(&self) -> u64 {
        self.floor_overflows.passes
    }

    /// Records one backward pass; `overflow` says whether its gradients held inf/NaN.
    /// Returns true when the step must be skipped (a checking scaler and an overflow).
    pub fn update(&mut self, overflow: bool) -> bool {
        self.record_pass(overflow, false)
    }

    /// [`Self::update`], also told whether every gradient of a clean pass at the floor was
    /// exactly zero (the silent collapse).
    pub(crate) fn record_pass(&mut self, overflow: bool, all_zero_at_floor: bool) -> bool {
        let pass = self.passes;
        self.passes = self.passes.saturating_add(1);
        if overflow && self.checks_overflow() {
            self.overflows = self.overflows.saturating_add(1);
            self.unskipped = 0;
            self.floor_zero_grads = Streak::default();
            if self.at_floor() {
                self.floor_overflows.extend(pass);
            } else {
                self.floor_overflows = Streak::default();
            }
            if self.dynamic {
                if self.hysteresis_left <= 1 {
                    if self.recovery_interval.is_some() && self.recovery_target.is_none() {
                        self.recovery_target = Some(self.scale);
                    }
                    let from = self.scale;
                    self.scale = (self.scale * self.backoff_factor).max(self.min_scale);
                    self.push_change(pass, from, ScaleChangeReason::Overflow);
                } else {
                    self.hysteresis_left -= 1;
                }
            }
            return true;
        }
        self.floor_overflows = Streak::default();
        if all_zero_at_floor && self.dynamic && self.at_floor() {
            self.floor_zero_grads.extend(pass);
        } else {
            self.floor_zero_grads = Streak::default();
        }
        self.unskipped = self.unskipped.saturating_add(1);
        if self.dynamic {
            if self.consecutive_hysteresis {
                self.hysteresis_left = self.hysteresis;
            }
            let interval = match (self.recovery_target, self.recovery_interval) {
                (Some(_), Some(fast)) => fast.min(self.growth_interval),
                _ => self.growth_interval,
            };
            if self.unskipped >= interval {
                if !self.consecutive_hysteresis {
                    self.hysteresis_left = self.hysteresis;
                }
                let from = self.scale;
                self.scale = (self.scale * self.growth_factor).min(self.max_scale);
                self.unskipped = 0;
                self.push_change(pass, from, ScaleChangeReason::Growth);
                if self.recovery_target.is_some_and(|t| self.scale >= t || self.scale >= self.max_scale) {
                    self.recovery_target = None;
                }
            }
        }
        false
    }

    fn push_change(&mut self, pass: u64, from: f64, reason: ScaleChangeReason) {
        if self.scale == from || self.history_len == 0 {
            return;
        }
        if self.history.len() >= self.history_len {
            let excess = self.history.len() + 1 - self.history_len;
            self.history.drain(..excess);
        }
        self.history.push(ScaleChange { pass, from, to: self.scale, reason });
    }

    /// The collapse in progress once a streak at the floor reached the limit.
    pub(crate) fn collapse(&self) -> Option<Collapse> {
        let limit = u64::from(self.collapse_limit);
        if limit == 0 {
            return None;
        }
        let Streak { first_pass, passes } = self.floor_overflows;
        if passes >= limit {
            return Some(Collapse::OverflowAtFloor { first_pass, passes });
        }
        let Streak { first_pass, passes } = self.floor_zero_grads;
        if passes >= limit {
            return Some(Collapse::ZeroGradients { first_pass, passes });
        }
        None
    }

    /// The persistent state (Apex's `{"loss_scale", "unskipped"}`, plus the hysteresis counter
    /// when k > 1 and the recovery target while recovering).
    pub fn state(&self) -> ScalerState {
        ScalerState {
            loss_scale: self.scale,
            unskipped: self.unskipped,
            hysteresis_left: (self.hysteresis > 1).then_some(self.hysteresis_left),
            recovery_target: self.recovery_target,
        }
    }

    /// Checks that `state` can be applied to this scaler (with `interval` as the growth
    /// interval it would have): every value within bounds, so that the next passes cannot
    /// overflow a counter or a float conversion. `Err` holds what is wrong.
    pub(crate) fn check_state(&self, state: &ScalerState, interval: u64) -> Result<(), String> {
        let s = state.loss_scale;
        let (lo, hi) = if self.dynamic { (self.min_scale, self.max_scale) } else { Self::SCALE_RANGE };
        if !(s.is_finite() && s >= lo && s <= hi) {
            return Err(format!(
                "loss scale {s:e} is outside [{lo:e}, {hi:e}] ({}); set min_loss_scale / max_loss_scale to admit it",
                if self.dynamic {
                    "this scaler's min_loss_scale and max_loss_scale"
                } else {
                    "the representable range"
                }
            ));
        }
        if self.dynamic && state.unskipped >= interval {
            return Err(format!(
                "unskipped {} must be below the growth interval {interval} (the scale grows and the count restarts there)",
                state.unskipped
            ));
        }
        if let Some(left) = state.hysteresis_left {
            if self.hysteresis == 1 || !self.dynamic {
                return Err(format!(
                    "hysteresis_left {left} given, but this scaler has no hysteresis (set AmpConfig::hysteresis as the \
                     run that wrote it did)"
                ));
            }
            if left == 0 || left > self.hysteresis {
                return Err(format!(
                    "hysteresis_left {left} must lie in 1..={} (this scaler's hysteresis)",
                    self.hysteresis
                ));
            }
        }
        if let Some(t) = state.recovery_target {
            if self.recovery_interval.is_none() || !self.dynamic {
                return Err("recovery_target is set but this scaler has no recovery_growth_interval".to_string());
            }
            if !(t.is_finite() && t >= self.min_scale && t <= self.max_scale) {
                return Err(format!("recovery_target {t:e} is outside [{:e}, {:e}]", self.min_scale, self.max_scale));
            }
        }
        Ok(())
    }

    /// Applies a state checked by [`Self::check_state`]. Streaks at the floor restart.
    pub(crate) fn apply_state(&mut self, state: ScalerState) {
        self.scale = state.loss_scale;
        self.unskipped = state.unskipped;
        self.hysteresis_left = state.hysteresis_left.unwrap_or(self.hysteresis);
        self.recovery_target = state.recovery_target;
        self.floor_overflows = Streak::default();
        self.floor_zero_grads = Streak::default();
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
