//! Loading and saving `torch.save` checkpoints (see the module above).
use crate::error::StateError;
use std::path::Path;
use tch::nn::VarStore;
use tch::Kind;

use super::error::{Result, TorchCheckpointError};
use super::optim::default_param_order;
use super::options::{TorchLoadOptions, TorchParamOrder, TorchSaveOptions};
use super::{model, optim};
use crate::amp::Amp;
use crate::error::AmpError;
use crate::optim::{AmpOptimizer, OptimizerConfig, OptimizerRecord};
use crate::torch_io::{self, Dict, Key, LoadOptions, Node, Value};

/// What [`load_torch_checkpoint`] did besides loading.
#[derive(Debug)]
#[non_exhaustive]
pub struct TorchLoadReport {
    /// The prefix stripped from the model's keys (`module.`).
    pub stripped_prefix: Option<String>,
    /// VarStore variables the state dict lacks (non-strict loads only; they kept their values).
    pub missing: Vec<String>,
    /// State dict entries no variable took (non-strict loads only).
    pub unexpected: Vec<String>,
    /// Entries skipped on purpose: `num_batches_tracked` counters, second names of tied tensors.
    pub ignored: Vec<String>,
    /// dtype conversions made: (path or name, the file's dtype, the dtype loaded into).
    pub converted: Vec<(String, Kind, Kind)>,
    /// Whether the loss scalers were restored (false when the file has no amp entry and none
    /// was required).
    pub amp_loaded: bool,
    /// Per optimizer, the parameter order used (torch's groups, VarStore names in index order).
    pub param_orders: Vec<TorchParamOrder>,
    /// Param group keys that are neither hyper-parameters nor implementation flags, not
    /// applied (`initial_lr` from an LR scheduler, ...), as paths.
    pub ignored_group_keys: Vec<String>,
    /// The checkpoint's other entries (`epoch`, `arch`, `best_prec1`, ...), in the file's order.
    pub entries: Dict,
}

/// Reads a `torch.save` checkpoint and restores the model variables, the optimizers and the loss
/// scalers from it (see the [module docs](crate::torch_checkpoint) for what is mapped how). Tensors
/// are read onto [`TorchLoadOptions::map_location`], by default the VarStore's device.
///
/// # Errors
/// [`TorchCheckpointError::File`] when the file cannot be read (truncated, wrong magic, a pickle
/// naming a global outside torch's weights-only set, ...) or an entry is missing or of the wrong
/// type (the message names its path); [`TorchCheckpointError`] when it does not fit (keys, shapes,
/// dtypes, optimizer class, hyper-parameters, parameter count or order, non-finite values);
/// [`StateError::StateMismatch`] for an amp state the scalers refuse. Nothing is changed on error.
pub fn load_torch_checkpoint(
    path: impl AsRef<Path>,
    vs: &VarStore,
    optimizers: &mut [&mut AmpOptimizer],
    amp: &mut Amp,
    options: &TorchLoadOptions,
) -> Result<TorchLoadReport> {
    let load = LoadOptions::new().map_location(options.map_location.unwrap_or(vs.device()));
    let value = torch_io::load_with(path, &load)?;
    load_torch_checkpoint_value(value, vs, optimizers, amp, options)
}

/// [`load_torch_checkpoint`] on a checkpoint already read with [`torch_io::load`].
///
/// # Errors
/// As [`load_torch_checkpoint`], less the file errors.
pub fn load_torch_checkpoint_value(
    checkpoint: Value,
    vs: &VarStore,
    optimizers: &mut [&mut AmpOptimizer],
    amp: &mut Amp,
    options: &TorchLoadOptions,
) -> Result<TorchLoadReport> {
    if !optimizers.is_empty() && optimizers.len() != options.optimizer_keys.len() {
        return Err(TorchCheckpointError::Options {
            message: format!(
                "{} optimizers given but {} optimizer keys {:?}: name one key per optimizer with \
                 TorchLoadOptions::optimizer_keys",
                optimizers.len(),
                options.optimizer_keys.len(),
                options.optimizer_keys
            ),
        });
    }
    if let Some(i) = options.param_orders.keys().find(|&&i| i >= optimizers.len()) {
        return Err(TorchCheckpointError::Options {
            message: format!("a param_order for optimizer {i}, but {} optimizers were given", optimizers.len()),
        });
    }
    let root = checkpoint.node();
    root.as_dict()?;

    // Phase 1: read and check everything.
    let staged_model = model::stage(&root.get(options.model_key.as_str())?, vs, options)?;
    let amp_state = match &options.amp_key {
        Some(key) => match root.get_opt(key.as_str())? {
            Some(node) => Some(amp.check_state_dict(&to_json(&node)?)?),
            None if options.amp_required => {
                return Err(torch_io::TorchIoError::MissingKey { path: root.path(), key: format!("{key:?}") }.into())
            }
            None => None,
        },
        None => None,
    };
    let mut report = TorchLoadReport {
        stripped_prefix: staged_model.prefix.clone(),
        missing: staged_model.missing.clone(),
        unexpected: staged_model.unexpected.clone(),
        ignored: staged_model.ignored.clone(),
        converted: staged_model.converted.clone(),
        amp_loaded: amp_state.is_some(),
        param_orders: Vec::new(),
        ignored_group_keys: Vec::new(),
        entries: Dict::new(),
    };
    let mut staged_records = Vec::with_capacity(optimizers.len());
    for (i, o) in optimizers.iter().enumerate() {
        let node = root.get(options.optimizer_keys[i].as_str())?;
        let order = optim::resolve_order(
            &node,
            o,
            i,
            options.param_orders.get(&i),
            &staged_model.order,
            staged_model.prefix.as_deref(),
        )?;
        let loaded = optim::record_from_node(&node, o, &order, i, options.exact_dtypes)?;
        let mut record = loaded.record;
        // Masters: the state dict's fp32 values (or, for a variable a non-strict load skipped,
        // the current master).
        let current = o.to_record();
        for ((p, lay), cur) in record.params.iter_mut().zip(o.param_layout()).zip(current.params) {
            if lay.has_master {
                p.master = match staged_model.fp32.get(&p.name) {
                    Some(t) => Some(t.shallow_clone()),
                    None => cur.master,
                };
            }
        }
        staged_records.push(o.stage_record(record).map_err(|e| match e {
            AmpError::State(StateError::StateMismatch { message }) => {
                AmpError::State(StateError::StateMismatch { message: format!("optimizer {i}: {message}") })
            }
            other => other,
        })?);
        report.converted.extend(loaded.converted);
        report.ignored_group_keys.extend(loaded.ignored_keys);
        report.param_orders.push(order);
    }

    // Phase 2: apply (every check passed).
    {
        let _no_grad = tch::no_grad_guard();
        for (var, value) in &staged_model.copies {
            let mut v = var.shallow_clone();
            v.f_copy_(value).map_err(|source| AmpError::Torch { context: "restoring a model variable", source })?;
        }
    }
    for (o, r) in optimizers.iter_mut().zip(staged_records) {
        o.apply_staged(r)?;
    }
    if let Some(state) = amp_state {
        amp.apply_checked_state(state);
    }
    let mut checkpoint = checkpoint;
    if let Value::Dict(d) = &mut checkpoint {
        let mut d = std::mem::take(d);
        let mut consumed: Vec<&str> = vec![options.model_key.as_str()];
        consumed.extend(options.optimizer_keys.iter().take(optimizers.len()).map(String::as_str));
        if report.amp_loaded {
            consumed.extend(options.amp_key.as_deref());
        }
        for k in consumed {
            d.remove(&Key::from(k));
        }
        report.entries = d;
    }
    Ok(report)
}

/// The checkpoint dict [`save_torch_checkpoint`] writes, as a value tree. Its tensors share
/// storage with the masters and the optimizer state: save it before the next step.
///
/// # Errors
/// [`TorchCheckpointError`] (`Options`) for options that do not fit the call (a key per
/// optimizer, no entry named like the model, optimizer or amp entry, a `param_order` that
/// covers the optimizer's parameters once and keeps each group to one learning rate);
/// [`AmpError::Torch`] if a tensor cannot be read.
pub fn torch_checkpoint_value(
    vs: &VarStore,
    optimizers: &[&AmpOptimizer],
    amp: &Amp,
    options: &TorchSaveOptions,
) -> Result<Value> {
    let options_err = |message: String| TorchCheckpointError::Options { message };
    if optimizers.len() != options.optimizer_keys.len() {
        return Err(options_err(format!(
            "{} optimizers given but {} optimizer keys {:?}: name one key per optimizer with \
             TorchSaveOptions::optimizer_keys",
            optimizers.len(),
            options.optimizer_keys.len(),
            options.optimizer_keys
        )));
    }
    if let Some(i) = options.param_orders.keys().find(|&&i| i >= optimizers.len()) {
        return Err(options_err(format!(
            "a param_order for optimizer {i}, but {} optimizers were given",
            optimizers.len()
        )));
    }
    let mut keys: Vec<&str> = vec![options.model_key.as_str()];
    keys.extend(options.optimizer_keys.iter().map(String::as_str));
    keys.extend(options.amp_key.as_deref());
    keys.extend(options.entries.iter().map(|(k, _)| k.as_str()));
    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = keys.iter().find(|k| !seen.insert(**k)) {
        return Err(options_err(format!("the key {dup:?} is used twice in the checkpoint dict")));
    }
    let records: Vec<OptimizerRecord> = optimizers.iter().map(|o| o.to_record()).collect();
    let mut root = Dict::new();
    for (k, v) in &options.entries {
        root.insert(k.as_str(), v.shallow_clone());
    }
    root.insert(options.model_key.as_str(), Value::Dict(model::state_dict(vs, &records, options)?));
    let prefix = options.key_prefix.as_deref().unwrap_or("");
    for (i, (o, r)) in optimizers.iter().zip(&records).enumerate() {
        let order = options.param_orders.get(&i).cloned().unwrap_or_else(|| default_param_order(o));
        let names = options.param_names.then_some(prefix);
        root.insert(options.optimizer_keys[i].as_str(), optim::record_to_value(r, o, &order, i, names)?);
    }
    if let Some(key) = &options.amp_key {
        root.insert(key.as_str(), amp_value(amp));
    }
    Ok(Value::Dict(root))
}

/// Writes the checkpoint a Python Apex script resumes from (see the [module docs](crate::torch_checkpoint)):
/// `torch.load(path, weights_only=True)` reads it, `model.load_state_dict`,
/// `optimizer.load_state_dict` and `amp.load_state_dict` take its entries. The file is written
/// to a temporary file beside `path`, synced and renamed over it: `path` holds the previous
/// file or the complete new one.
///
/// # Errors
/// As [`torch_checkpoint_value`], and [`TorchCheckpointError::File`] when the file cannot be written
/// (the previous file is intact).
pub fn save_torch_checkpoint(
    path: impl AsRef<Path>,
    vs: &VarStore,
    optimizers: &[&AmpOptimizer],
    amp: &Amp,
    options: &TorchSaveOptions,
) -> Result<()> {
    let value = torch_checkpoint_value(vs, optimizers, amp, options)?;
    torch_io::save(path, &value)?;
    Ok(())
}

/// torch.optim's state dict (`optimizer.state_dict()`, read with [`torch_io::load`]) as a
/// record for `optimizer`, with `order` saying which VarStore name each index is (see
/// [`param_order_from_torch`]). Checked as [`load_torch_checkpoint`] checks it; the records'
/// `master` fields are left `None`: fill them (fp32 values of the model state dict) before
/// [`AmpOptimizer::load_record`] for an optimizer with masters.
///
/// # Errors
/// As the optimizer part of [`load_torch_checkpoint`].
pub fn optimizer_record_from_torch(
    state_dict: &Value,
    optimizer: &AmpOptimizer,
    order: &TorchParamOrder,
) -> Result<OptimizerRecord> {
    Ok(optim::record_from_node(&state_dict.node(), optimizer, order, 0, false)?.record)
}

/// `record` (from [`AmpOptimizer::to_record`] of `optimizer`) as torch.optim's state dict,
/// with torch's groups and index order from `order` (see [`default_param_order`]) and each
/// group's `param_names`.
///
/// # Errors
/// [`TorchCheckpointError`] when `order` does not name each parameter once or puts
/// parameters of different learning rates into one group.
pub fn optimizer_record_to_torch(
    record: &OptimizerRecord,
    optimizer: &AmpOptimizer,
    order: &TorchParamOrder,
) -> Result<Value> {
    optim::record_to_value(record, optimizer, order, 0, Some(""))
}

/// Which VarStore name each index of torch.optim's state dict is, from the groups'
/// `param_names` or else from `model_keys`, the model state dict's keys in order (see the
/// [module docs](crate::torch_checkpoint)).
///
/// # Errors
/// [`TorchCheckpointError`] (`ParamCount`, `ParamOrder`) as [`load_torch_checkpoint`].
pub fn param_order_from_torch(
    state_dict: &Value,
    optimizer: &AmpOptimizer,
    model_keys: &[String],
) -> Result<TorchParamOrder> {
    optim::resolve_order(&state_dict.node(), optimizer, 0, None, model_keys, None)
}

/// The optimizer configuration and learning rate (of param group 0) a torch.optim state dict
/// was made with, to build the optimizer a checkpoint loads into:
/// `amp.optimizer(&vs, config, lr)`.
///
/// # Errors
/// [`TorchCheckpointError`] (`BadValue`) for a state dict of another class than SGD,
/// Adam, AdamW and RMSprop, an Adam-family state dict that does not say which of the two it is
/// (torch < 2.6), or groups whose hyper-parameters besides `lr` differ;
/// [`TorchCheckpointError::File`] for a missing or mistyped entry.
pub fn optimizer_config(state_dict: &Value) -> Result<(OptimizerConfig, f64)> {
    optim::config_from_node(&state_dict.node())
}

/// Apex's `amp.state_dict()`: an OrderedDict `loss_scaler0`, `loss_scaler1`, ... (in loss
/// order: Apex's load_state_dict assigns them in the dict's order) of `{'loss_scale': float,
/// 'unskipped': int}` (plus tch-amp's `hysteresis_left` / `recovery_target` when set; Apex
/// reads only its two keys).
fn amp_value(amp: &Amp) -> Value {
    let mut d = Dict::new_ordered();
    for (i, s) in amp.scalers().iter().enumerate() {
        let st = s.state();
        let mut e = Dict::new()
            .with("loss_scale", Value::Float(st.loss_scale))
            .with("unskipped", Value::Int(i64::try_from(st.unskipped).unwrap_or(i64::MAX)));
        if let Some(h) = st.hysteresis_left {
            e.insert("hysteresis_left", Value::Int(h.into()));
        }
        if let Some(t) = st.recovery_target {
            e.insert("recovery_target", Value::Float(t));
        }
        d.insert(format!("loss_scaler{i}"), Value::Dict(e));
    }
    Value::Dict(d)
}

/// An amp state (numbers, strings, containers) as JSON for [`Amp::load_state_dict`]'s checks;
/// dict attributes are left out. A loop over a walk of the tree, which refuses a state nested
/// more than [`torch_io::MAX_DEPTH`] levels (a file's tree is never deeper).
fn to_json(node: &Node<'_>) -> Result<serde_json::Value> {
    use serde_json::Value as J;
    use torch_io::{Edge, Step, Walk};
    let bad = |path: String, message: &str| TorchCheckpointError::BadValue { path, message: message.into() };
    // The arrays and objects being filled, innermost last, each with the key it goes under.
    let mut open: Vec<(J, Option<String>)> = Vec::new();
    // The depth of the attribute being skipped, while one is.
    let mut skipping: Option<usize> = None;
    let mut walk = Walk::new(node.value());
    while let Some(step) = walk.next() {
        let depth = walk.path().len();
        if let Some(d) = skipping {
            if matches!(step, Step::Leave(_)) && depth == d {
                skipping = None;
            }
            continue;
        }
        let (json, key) = match step {
            Step::Enter(v, edge) => {
                let path = walk.path();
                let key = match edge {
                    Some(Edge::Attr(..)) => {
                        // Skipped up to its own Leave, the next step at this depth.
                        skipping = Some(depth);
                        continue;
                    }
                    Some(Edge::Key(_, Key::Str(s))) => Some(s.clone()),
                    Some(Edge::Key(_, Key::Int(i))) => {
                        return Err(bad(
                            node.path_below(&path[..depth - 1]),
                            &format!("has the int key {i}; the amp state's keys are names"),
                        ))
                    }
                    Some(Edge::Index(_)) | None => None,
                };
                if depth > torch_io::MAX_DEPTH {
                    return Err(torch_io::TorchIoError::TooDeep {
                        what: "nesting depth",
                        path: node.path_below(path),
                        limit: torch_io::MAX_DEPTH as u64,
                    }
                    .into());
                }
                let json = match v {
                    Value::None => J::Null,
                    Value::Bool(b) => J::Bool(*b),
                    Value::Int(i) => J::from(*i),
                    Value::Float(f) => J::Number(
                        serde_json::Number::from_f64(*f)
                            .ok_or_else(|| bad(node.path_below(path), "a loss scaler state must be finite"))?,
                    ),
                    Value::Str(s) => J::String(s.clone()),
                    Value::Tensor(t) if t.numel() == 1 => {
                        let f = t
                            .f_reshape([])
                            .and_then(|t| t.f_double_value(&[]))
                            .map_err(|source| AmpError::Torch { context: "reading the amp state", source })?;
                        J::Number(
                            serde_json::Number::from_f64(f)
                                .ok_or_else(|| bad(node.path_below(path), "a loss scaler state must be finite"))?,
                        )
                    }
                    Value::List(_) | Value::Tuple(_) => {
                        open.push((J::Array(Vec::new()), key));
                        continue;
                    }
                    Value::Dict(_) => {
                        open.push((J::Object(serde_json::Map::new()), key));
                        continue;
                    }
                    other => {
                        return Err(bad(node.path_below(path), &format!("a {} in the amp state", other.type_name())))
                    }
                };
                (json, key)
            }
            Step::Leave(Value::List(_) | Value::Tuple(_) | Value::Dict(_)) => {
                open.pop().expect("a container left was entered")
            }
            Step::Leave(_) => continue,
        };
        match open.last_mut() {
            None => return Ok(json),
            Some((J::Array(items), _)) => items.push(json),
            Some((J::Object(m), _)) => {
                m.insert(key.expect("a dict's entries have keys"), json);
            }
            Some(_) => unreachable!("only arrays and objects are open"),
        }
    }
    unreachable!("a walk ends by leaving the root")
}
