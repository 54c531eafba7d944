//! `amp.state_dict()` / `amp.load_state_dict()`: the loss scalers' state in Apex's JSON form
//! (`{"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}, ...}`), also accepting torch's
//! `GradScaler.state_dict()` keys. Validated in full before anything is applied.
use std::collections::BTreeMap;

use serde_json::Value;

use super::scaler::{LossScaler, ScalerState};
use crate::error::{mismatch, Result, TorchContext};
use crate::torch_io::{Dict, Key, Node, Value as TorchValue};

/// The scalers' state, keyed `loss_scaler0`, `loss_scaler1`, ... (a `BTreeMap`: stable files).
pub type AmpState = BTreeMap<String, ScalerState>;

const GRAD_SCALER_KEYS: [&str; 5] = ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"];

/// The scalers' state in Apex's form (see [`crate::Amp::state_dict`]).
pub(crate) fn state_dict(scalers: &[LossScaler]) -> AmpState {
    scalers.iter().enumerate().map(|(i, s)| (format!("loss_scaler{i}"), s.state())).collect()
}

/// Checks `state` (Apex's form or a GradScaler dict) against `scalers` without applying it.
pub(crate) fn parse_state(scalers: &[LossScaler], state: &Value) -> Result<ParsedState> {
    let obj = state.as_object().ok_or_else(|| mismatch("the amp state must be a JSON object"))?;
    let n = scalers.len();
    if obj.keys().any(|k| GRAD_SCALER_KEYS.contains(&k.as_str())) {
        return parse_grad_scaler(scalers, obj);
    }
    let mut parsed = Vec::with_capacity(n);
    for key in obj.keys() {
        let idx = key.strip_prefix("loss_scaler").and_then(|d| d.parse::<usize>().ok()).ok_or_else(|| {
            mismatch(format!("unexpected key {key:?} (expected loss_scaler0..loss_scaler{})", n.saturating_sub(1)))
        })?;
        if idx >= n {
            return Err(mismatch(format!("{key} is beyond num_losses = {n}")));
        }
    }
    if obj.len() != n {
        return Err(mismatch(format!("the state holds {} loss scalers, this Amp has num_losses = {n}", obj.len())));
    }
    for (i, scaler) in scalers.iter().enumerate() {
        let key = format!("loss_scaler{i}");
        let v = obj.get(&key).ok_or_else(|| mismatch(format!("missing {key}")))?;
        let s: ScalerState = serde_json::from_value(v.clone()).map_err(|e| mismatch(format!("{key}: {e}")))?;
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

fn parse_grad_scaler(scalers: &[LossScaler], obj: &serde_json::Map<String, Value>) -> Result<ParsedState> {
    if let Some(k) = obj.keys().find(|k| !GRAD_SCALER_KEYS.contains(&k.as_str())) {
        return Err(mismatch(format!("unexpected key {k:?} in a GradScaler state")));
    }
    if scalers.len() != 1 {
        return Err(mismatch(format!(
            "a GradScaler state holds one scaler, this Amp has num_losses = {}",
            scalers.len()
        )));
    }
    let num = |k: &str| -> Result<Option<f64>> {
        match obj.get(k) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| mismatch(format!("{k} must be a number"))),
        }
    };
    let current = &scalers[0];
    let (g0, b0) = current.factors();
    let scale = num("scale")?.ok_or_else(|| mismatch("GradScaler state without \"scale\""))?;
    let growth = num("growth_factor")?.unwrap_or(g0);
    let backoff = num("backoff_factor")?.unwrap_or(b0);
    let interval = num("growth_interval")?.unwrap_or(current.growth_interval() as f64);
    let tracker = num("_growth_tracker")?.unwrap_or(0.0);
    if !(growth.is_finite() && growth > 1.0) {
        return Err(mismatch(format!("growth_factor {growth} must be > 1")));
    }
    if !(backoff > 0.0 && backoff < 1.0) {
        return Err(mismatch(format!("backoff_factor {backoff} must be in (0, 1)")));
    }
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

/// Apex's `amp.state_dict()` as a `torch.save` value: an OrderedDict `loss_scaler0`,
/// `loss_scaler1`, ... (in loss order: Apex's load_state_dict assigns them in the dict's order)
/// of `{'loss_scale': float, 'unskipped': int}` (plus tch-amp's `hysteresis_left` /
/// `recovery_target` when set; Apex reads only its two keys).
pub(crate) fn state_value(scalers: &[LossScaler]) -> TorchValue {
    let mut d = Dict::new_ordered();
    for (i, s) in scalers.iter().enumerate() {
        let st = s.state();
        let mut e = Dict::new()
            .with("loss_scale", TorchValue::Float(st.loss_scale))
            .with("unskipped", TorchValue::Int(i64::try_from(st.unskipped).unwrap_or(i64::MAX)));
        if let Some(h) = st.hysteresis_left {
            e.insert("hysteresis_left", TorchValue::Int(h.into()));
        }
        if let Some(t) = st.recovery_target {
            e.insert("recovery_target", TorchValue::Float(t));
        }
        d.insert(format!("loss_scaler{i}"), TorchValue::Dict(e));
    }
    TorchValue::Dict(d)
}

/// An amp state read from a `torch.save` file (numbers, strings, containers) as the JSON
/// [`parse_state`] checks.
pub(crate) fn to_json(node: &Node<'_>) -> Result<Value> {
    let bad = |message: &str| mismatch(format!("{}: {message}", node.path()));
    Ok(match node.value() {
        TorchValue::None => Value::Null,
        TorchValue::Bool(b) => Value::Bool(*b),
        TorchValue::Int(i) => Value::from(*i),
        TorchValue::Float(f) => {
            Value::Number(serde_json::Number::from_f64(*f).ok_or_else(|| bad("a loss scaler state must be finite"))?)
        }
        TorchValue::Str(s) => Value::String(s.clone()),
        TorchValue::Tensor(t) if t.numel() == 1 => {
            let f = t.f_reshape([]).and_then(|t| t.f_double_value(&[])).ctx("reading the amp state")?;
            Value::Number(serde_json::Number::from_f64(f).ok_or_else(|| bad("a loss scaler state must be finite"))?)
        }
        TorchValue::List(_) | TorchValue::Tuple(_) => Value::Array(
            node.elements().map_err(|e| mismatch(e.to_string()))?.iter().map(to_json).collect::<Result<_>>()?,
        ),
        TorchValue::Dict(_) => {
            let mut m = serde_json::Map::new();
            for (k, v) in node.entries().map_err(|e| mismatch(e.to_string()))? {
                let key = match k {
                    Key::Str(s) => s.clone(),
                    Key::Int(i) => return Err(bad(&format!("has the int key {i}; the amp state's keys are names"))),
                };
                m.insert(key, to_json(&v)?);
            }
            Value::Object(m)
        }
        other => return Err(bad(&format!("a {} in the amp state", other.type_name()))),
    })
}
