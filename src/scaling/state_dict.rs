//! `amp.state_dict()` / `amp.load_state_dict()`: the loss scalers' state as the `torch.save`
//! value Apex writes (`{'loss_scaler0': {'loss_scale': 65536.0, 'unskipped': 0}, ...}`), also
//! accepting torch's `GradScaler.state_dict()` keys. Validated in full before anything is applied.
use std::collections::BTreeMap;

use super::scaler::{LossScaler, ScalerState};
use crate::config::rules;
use crate::error::{mismatch, Result, TorchContext};
use crate::torch_io::{Dict, Key, Node, Value};

/// The scalers' state keyed `loss_scaler0`, `loss_scaler1`, ..., as tch-amp's own checkpoint
/// format records it (a `BTreeMap`: stable files).
pub(crate) type AmpState = BTreeMap<String, ScalerState>;

const GRAD_SCALER_KEYS: [&str; 5] = ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"];

/// The scalers' state for tch-amp's own checkpoint format.
pub(crate) fn amp_state(scalers: &[LossScaler]) -> AmpState {
    scalers.iter().enumerate().map(|(i, s)| (format!("loss_scaler{i}"), s.state())).collect()
}

/// Apex's `amp.state_dict()` as a `torch.save` value: an OrderedDict `loss_scaler0`,
/// `loss_scaler1`, ... (in loss order: Apex's load_state_dict assigns them in the dict's order)
/// of `{'loss_scale': float, 'unskipped': int}` (plus tch-amp's `hysteresis_left` /
/// `recovery_target` when set; Apex reads only its two keys).
pub(crate) fn state_value(scalers: &[LossScaler]) -> Value {
    let mut d = Dict::new_ordered();
    for (i, s) in scalers.iter().enumerate() {
        d.insert(format!("loss_scaler{i}"), scaler_value(&s.state()));
    }
    Value::Dict(d)
}

/// [`AmpState`] (tch-amp's own checkpoint format) as the value [`parse_state`] reads.
pub(crate) fn amp_state_value(state: &AmpState) -> Value {
    let mut d = Dict::new_ordered();
    for (key, s) in state {
        d.insert(key.as_str(), scaler_value(s));
    }
    Value::Dict(d)
}

fn scaler_value(st: &ScalerState) -> Value {
    let mut e = Dict::new()
        .with("loss_scale", Value::Float(st.loss_scale))
        .with("unskipped", Value::Int(i64::try_from(st.unskipped).unwrap_or(i64::MAX)));
    if let Some(h) = st.hysteresis_left {
        e.insert("hysteresis_left", Value::Int(h.into()));
    }
    if let Some(t) = st.recovery_target {
        e.insert("recovery_target", Value::Float(t));
    }
    Value::Dict(e)
}

/// The entries of a dict node with string keys.
fn named_entries<'a>(node: &Node<'a>) -> Result<Vec<(&'a str, Node<'a>)>> {
    node.entries()
        .map_err(|e| mismatch(e.to_string()))?
        .into_iter()
        .map(|(k, v)| match k {
            Key::Str(s) => Ok((s.as_str(), v)),
            Key::Int(i) => {
                Err(mismatch(format!("{}: has the int key {i}; the amp state's keys are names", node.path())))
            }
        })
        .collect()
}

/// A number: an int, a float or a one-element tensor (a `GradScaler`'s scale may be saved as
/// either).
fn number(node: &Node<'_>) -> Result<f64> {
    match node.value() {
        Value::Tensor(t) if t.numel() == 1 => {
            t.f_reshape([]).and_then(|t| t.f_double_value(&[])).ctx("reading the amp state")
        }
        _ => node.as_f64().map_err(|e| mismatch(e.to_string())),
    }
}

/// A non-negative int within `T`.
fn count<T: TryFrom<i64>>(node: &Node<'_>) -> Result<T> {
    let i = node.as_i64().map_err(|e| mismatch(e.to_string()))?;
    T::try_from(i).map_err(|_| mismatch(format!("{}: {i} is out of range", node.path())))
}

/// One scaler's `{'loss_scale', 'unskipped'[, 'hysteresis_left', 'recovery_target']}`.
fn scaler_state(node: &Node<'_>) -> Result<ScalerState> {
    let (mut loss_scale, mut unskipped, mut hysteresis_left, mut recovery_target) = (None, None, None, None);
    for (key, v) in named_entries(node)? {
        match key {
            "loss_scale" => loss_scale = Some(number(&v)?),
            "unskipped" => unskipped = Some(count(&v)?),
            "hysteresis_left" => hysteresis_left = Some(count(&v)?),
            "recovery_target" => recovery_target = Some(number(&v)?),
            other => {
                return Err(mismatch(format!(
                    "{}: unknown key {other:?} (expected loss_scale, unskipped, hysteresis_left, recovery_target)",
                    node.path()
                )))
            }
        }
    }
    let missing = |key: &str| mismatch(format!("{}: missing {key:?}", node.path()));
    Ok(ScalerState {
        loss_scale: loss_scale.ok_or_else(|| missing("loss_scale"))?,
        unskipped: unskipped.ok_or_else(|| missing("unskipped"))?,
        hysteresis_left,
        recovery_target,
    })
}

/// Checks `state` (Apex's form or a GradScaler dict) against `scalers` without applying it.
pub(crate) fn parse_state(scalers: &[LossScaler], state: &Node<'_>) -> Result<ParsedState> {
    if !matches!(state.value(), Value::Dict(_)) {
        return Err(mismatch(format!("the amp state must be a dict, found a {}", state.value().type_name())));
    }
    let entries = named_entries(state)?;
    let n = scalers.len();
    if entries.iter().any(|(k, _)| GRAD_SCALER_KEYS.contains(k)) {
        return parse_grad_scaler(scalers, &entries);
    }
    for (key, _) in &entries {
        let idx = key.strip_prefix("loss_scaler").and_then(|d| d.parse::<usize>().ok()).ok_or_else(|| {
            mismatch(format!("unexpected key {key:?} (expected loss_scaler0..loss_scaler{})", n.saturating_sub(1)))
        })?;
        if idx >= n {
            return Err(mismatch(format!("{key} is beyond num_losses = {n}")));
        }
    }
    if entries.len() != n {
        return Err(mismatch(format!("the state holds {} loss scalers, this Amp has num_losses = {n}", entries.len())));
    }
    let mut parsed = Vec::with_capacity(n);
    for (i, scaler) in scalers.iter().enumerate() {
        let key = format!("loss_scaler{i}");
        let node = entries
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
            .ok_or_else(|| mismatch(format!("missing {key}")))?;
        let s = scaler_state(node)?;
        scaler.check_state(&s, scaler.growth_interval()).map_err(|e| mismatch(format!("{key}: {e}")))?;
        parsed.push(s);
    }
    Ok(ParsedState::Apex(parsed))
}

/// Applies a state checked by [`parse_state`] against the same scalers.
pub(crate) fn apply_state(scalers: &mut [LossScaler], parsed: ParsedState) {
    match parsed {
        ParsedState::Apex(states) => {
            for (scaler, s) in scalers.iter_mut().zip(states) {
                scaler.apply_state(s);
            }
        }
        ParsedState::GradScaler { state, growth, backoff, interval } => {
            if let Some(first) = scalers.first_mut() {
                first.apply_grad_scaler(state, growth, backoff, interval)
            }
        }
    }
}

fn parse_grad_scaler(scalers: &[LossScaler], entries: &[(&str, Node<'_>)]) -> Result<ParsedState> {
    if let Some((k, _)) = entries.iter().find(|(k, _)| !GRAD_SCALER_KEYS.contains(k)) {
        return Err(mismatch(format!("unexpected key {k:?} in a GradScaler state")));
    }
    if scalers.len() != 1 {
        return Err(mismatch(format!(
            "a GradScaler state holds one scaler, this Amp has num_losses = {}",
            scalers.len()
        )));
    }
    let num = |k: &str| -> Result<Option<f64>> {
        entries.iter().find(|(key, _)| *key == k).map(|(_, v)| number(v)).transpose()
    };
    let current = &scalers[0];
    let (g0, b0) = current.factors();
    let scale = num("scale")?.ok_or_else(|| mismatch("GradScaler state without \"scale\""))?;
    let growth = num("growth_factor")?.unwrap_or(g0);
    let backoff = num("backoff_factor")?.unwrap_or(b0);
    let interval = num("growth_interval")?.unwrap_or(current.growth_interval() as f64);
    let tracker = num("_growth_tracker")?.unwrap_or(0.0);
    let in_range = |e: crate::error::AmpError| mismatch(format!("GradScaler state: {e}"));
    let growth = rules::growth_factor("growth_factor", growth).map_err(in_range)?;
    let backoff = rules::backoff_factor(backoff).map_err(in_range)?;
    if !((1.0..=MAX_INTERVAL).contains(&interval)
        && interval.fract() == 0.0
        && tracker >= 0.0
        && tracker.fract() == 0.0)
    {
        return Err(mismatch(format!(
            "growth_interval {interval} and _growth_tracker {tracker} must be integers, 1 <= interval <= 2^53, tracker >= 0"
        )));
    }
    // Both are below 2^53 here, so the conversions are exact.
    let (interval, tracker) = (interval as u64, tracker.min(MAX_INTERVAL) as u64);
    let state = ScalerState { loss_scale: scale, unskipped: tracker, hysteresis_left: None, recovery_target: None };
    current.check_state(&state, interval).map_err(|e| mismatch(format!("GradScaler state: {e}")))?;
    Ok(ParsedState::GradScaler { state, growth, backoff, interval })
}

/// A checked state, ready to apply.
pub(crate) enum ParsedState {
    Apex(Vec<ScalerState>),
    GradScaler { state: ScalerState, growth: f64, backoff: f64, interval: u64 },
}

/// The largest growth interval a GradScaler state may carry: 2^53, where f64 still counts
/// exactly (a larger one never grows anyway).
const MAX_INTERVAL: f64 = 9_007_199_254_740_992.0;
