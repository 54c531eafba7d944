//! Loading and saving `torch.save` checkpoints (see the module above).
use std::collections::HashMap;
use std::path::Path;
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use super::error::bad_value;
use super::optim::default_param_order;
use super::options::{TorchLoadOptions, TorchParamOrder, TorchSaveOptions};
use super::{model, optim};
#[cfg(doc)]
use crate::amp::Amp;
use crate::error::{AmpError, ConfigError, Result, StateError};
use crate::optim::amp_optimizer::{CheckedRecord, ParamLayout};
use crate::optim::{AmpOptimizer, OptimizerConfig, OptimizerRecord};
use crate::scaling::CheckpointScalers;
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
/// scalers from it (see the [module docs](crate::torch_checkpoint) for what is mapped how).
/// `scalers`: an [`Amp`] (Apex's path), a [`crate::GradScaler`] or a slice of them (torch.amp's),
/// or `&mut ()` for none. Tensors are read onto [`TorchLoadOptions::map_location`], by default
/// the VarStore's device.
///
/// # Errors
/// [`AmpError::File`] when the file cannot be read (truncated, wrong magic, a pickle
/// naming a global outside torch's weights-only set, ...) or an entry is of the wrong type (the
/// message names its path); [`StateError::MissingEntry`](crate::error::StateError::MissingEntry) for an entry the options
/// name that the file lacks; [`StateError`] when it does not fit (keys, shapes, dtypes,
/// optimizer class, hyper-parameters, parameter count or order, non-finite values);
/// [`StateError::StateMismatch`] for a scaler state the scalers refuse. Nothing is changed on
/// error.
pub fn load_torch_checkpoint<S: CheckpointScalers + ?Sized>(
    path: impl AsRef<Path>,
    vs: &VarStore,
    optimizers: &mut [&mut AmpOptimizer],
    scalers: &mut S,
    options: &TorchLoadOptions,
) -> Result<TorchLoadReport> {
    let load = LoadOptions::new().map_location(options.map_location.unwrap_or(vs.device())).limits(options.limits);
    let value = torch_io::load_with(path, &load)?;
    load_torch_checkpoint_value(value, vs, optimizers, scalers, options)
}

/// The entry `key` of the checkpoint dict, or [`StateError::MissingEntry`](crate::error::StateError::MissingEntry).
fn entry<'a>(root: &Node<'a>, key: &str, holds: &'static str, remedy: &'static str) -> Result<Node<'a>> {
    root.get_opt(key)?.ok_or_else(|| AmpError::State(StateError::MissingEntry { key: key.to_string(), holds, remedy }))
}

/// [`load_torch_checkpoint`] on a checkpoint already read with [`torch_io::load`].
///
/// # Errors
/// As [`load_torch_checkpoint`], less the file errors.
pub fn load_torch_checkpoint_value<S: CheckpointScalers + ?Sized>(
    checkpoint: Value,
    vs: &VarStore,
    optimizers: &mut [&mut AmpOptimizer],
    scalers: &mut S,
    options: &TorchLoadOptions,
) -> Result<TorchLoadReport> {
    check_call(optimizers.len(), options)?;
    let root = checkpoint.node();
    root.as_dict()?;

    // Phase 1: read and check everything.
    let model_node = entry(
        &root,
        &options.model_key,
        "the model state dict",
        "name the model's entry with TorchLoadOptions::model_key (TorchLoadOptions::main_amp() reads Apex's \
         imagenet layout, whose model is under \"state_dict\")",
    )?;
    let checked_model = model::check(&model_node, vs, options)?;
    let scaler_key = options.scaler_key(scalers.torch_key());
    let scaler_node = check_scaler_entry(&root, &*scalers, scaler_key.as_ref(), options)?;
    let mut report = TorchLoadReport {
        stripped_prefix: checked_model.prefix.clone(),
        missing: checked_model.missing.clone(),
        unexpected: checked_model.unexpected.clone(),
        ignored: checked_model.ignored.clone(),
        converted: checked_model.converted.clone(),
        amp_loaded: scaler_node.is_some(),
        param_orders: Vec::new(),
        ignored_group_keys: Vec::new(),
        entries: Dict::new(),
    };
    let vars = vs.variables();
    let mut model_overrides: Vec<(Tensor, Tensor)> = Vec::new();
    let mut checked_records = Vec::with_capacity(optimizers.len());
    let reading = OptimizerEntries { root: &root, options, model: &checked_model, vars: &vars };
    for (i, o) in optimizers.iter().enumerate() {
        checked_records.push(reading.check(o, i, &mut model_overrides, &mut report)?);
    }

    // Phase 2: apply (every check passed).
    {
        let _no_grad = tch::no_grad_guard();
        for (var, value) in checked_model.copies.iter().chain(&model_overrides) {
            let mut v = var.shallow_clone();
            v.f_copy_(value).map_err(|source| AmpError::Torch { context: "restoring a model variable", source })?;
        }
    }
    for (o, r) in optimizers.iter_mut().zip(checked_records) {
        o.apply_checked(r)?;
    }
    if let Some(node) = &scaler_node {
        scalers.apply_scaler_state(node)?;
    }
    let mut consumed: Vec<&str> = vec![options.model_key.as_str()];
    consumed.extend(options.optimizer_keys.iter().take(optimizers.len()).map(String::as_str));
    if report.amp_loaded {
        consumed.extend(scaler_key.as_deref());
    }
    consumed.extend(options.master_params.values().map(String::as_str));
    report.entries = leftover_entries(checkpoint, &consumed);
    Ok(report)
}

/// The scalers' entry, checked against them: `None` when the scalers have no key, or the file
/// has no such entry and the options allow that.
fn check_scaler_entry<'a, S: CheckpointScalers + ?Sized>(
    root: &Node<'a>,
    scalers: &S,
    key: Option<&String>,
    options: &TorchLoadOptions,
) -> Result<Option<Node<'a>>> {
    let Some(key) = key else { return Ok(None) };
    match root.get_opt(key.as_str())? {
        Some(node) => {
            scalers.check_scaler_state(&node)?;
            Ok(Some(node))
        }
        None if options.amp_required => Err(AmpError::State(StateError::MissingEntry {
            key: key.clone(),
            holds: "the loss scalers' state",
            remedy: "name its entry with TorchLoadOptions::amp_key(Some(key), true), or load without it \
                     (the scalers keep their state) with TorchLoadOptions::amp_key(None, false)",
        })),
        None => Ok(None),
    }
}

/// The checkpoint's entries no part of the load read, in the file's order.
fn leftover_entries(mut checkpoint: Value, consumed: &[&str]) -> Dict {
    let Value::Dict(d) = &mut checkpoint else { return Dict::new() };
    let mut d = std::mem::take(d);
    for k in consumed {
        d.remove(&Key::from(*k));
    }
    d
}

/// What reading the optimizers' entries shares: the checkpoint, the options, the checked model
/// and the VarStore's variables.
struct OptimizerEntries<'a, 'n> {
    root: &'a Node<'n>,
    options: &'a TorchLoadOptions,
    model: &'a model::CheckedModel,
    vars: &'a HashMap<String, Tensor>,
}

impl OptimizerEntries<'_, '_> {
    /// Optimizer `i`'s entry read and checked into a record to apply: its state in torch's
    /// parameter order, the masters from the model's fp32 values (or Apex's 'master params'),
    /// what it converted and left unread noted in `report`.
    fn check(
        &self,
        o: &AmpOptimizer,
        i: usize,
        model_overrides: &mut Vec<(Tensor, Tensor)>,
        report: &mut TorchLoadReport,
    ) -> Result<CheckedRecord> {
        let (root, options, checked_model, vars) = (self.root, self.options, self.model, self.vars);
        let node = entry(
            root,
            &options.optimizer_keys[i],
            "an optimizer's state dict",
            "name each optimizer's entry with TorchLoadOptions::optimizer_keys (one key per optimizer given), or \
             pass no optimizer to load the model alone",
        )?;
        let order = optim::resolve_order(
            &node,
            o,
            i,
            options.param_orders.get(&i),
            &checked_model.order,
            checked_model.prefix.as_deref(),
        )?;
        let loaded =
            optim::record_from_node(&node, o, &order, i, options.exact_dtypes, options.strict_hyper_parameters)?;
        let mut record = loaded.record;
        // Masters: the state dict's fp32 values (or, for a variable a non-strict load skipped,
        // the current master).
        let current = o.to_record();
        let layout = o.param_layout();
        for ((p, lay), cur) in record.params.iter_mut().zip(&layout).zip(current.params) {
            if lay.has_master {
                p.master = match checked_model.fp32.get(&p.name) {
                    Some(t) => Some(t.shallow_clone()),
                    None => cur.master,
                };
            }
        }
        // Apex-era 'master params': the masters (or the fp32 parameters themselves), in torch order.
        if let Some(key) = options.master_params.get(&i) {
            let list = entry(
                root,
                key,
                "the optimizer's master parameters",
                "name it with TorchLoadOptions::master_params(optimizer, key), or leave that option out for a \
                 file without one",
            )?;
            let flat: Vec<&String> = order.iter().flatten().collect();
            let read = MasterParams { list: &list, flat: &flat, optimizer: o, index: i, layout: &layout, vars };
            read.apply(&mut record, model_overrides, &mut report.converted)?;
        }
        let checked = o.check_record(record).map_err(|e| match e {
            AmpError::State(StateError::StateMismatch { message }) => {
                AmpError::State(StateError::StateMismatch { message: format!("optimizer {i}: {message}") })
            }
            other => other,
        })?;
        report.converted.extend(loaded.converted);
        report.ignored_group_keys.extend(loaded.ignored_keys);
        report.param_orders.push(order);
        Ok(checked)
    }
}

/// The call's options against the call: one optimizer key per optimizer given, and no
/// per-optimizer option for an optimizer that was not given.
fn check_call(optimizers: usize, options: &TorchLoadOptions) -> Result<()> {
    if !optimizers == 0 && optimizers != options.optimizer_keys.len() {
        return Err(AmpError::Config(ConfigError::OptionsMismatch {
            message: format!(
                "{} optimizers given but {} optimizer keys {:?}: name one key per optimizer with \
                 TorchLoadOptions::optimizer_keys",
                optimizers,
                options.optimizer_keys.len(),
                options.optimizer_keys
            ),
        }));
    }
    for (what, map) in [
        ("param_order", options.param_orders.keys().collect::<Vec<_>>()),
        ("master_params", options.master_params.keys().collect()),
    ] {
        if let Some(i) = map.into_iter().find(|&&i| i >= optimizers) {
            return Err(AmpError::Config(ConfigError::OptionsMismatch {
                message: format!("a {what} for optimizer {i}, but {} optimizers were given", optimizers),
            }));
        }
    }
    Ok(())
}

/// An Apex-era `'master params'` list (`list(amp.master_params(optimizer))`) for one optimizer.
struct MasterParams<'a, 'n> {
    list: &'a Node<'n>,
    /// The optimizer's parameter names in torch's order (the list's).
    flat: &'a [&'a String],
    optimizer: &'a AmpOptimizer,
    index: usize,
    layout: &'a [ParamLayout],
    vars: &'a std::collections::HashMap<String, Tensor>,
}

impl MasterParams<'_, '_> {
    /// Checks every value (count, shape, floating, finite) and puts it in the record's masters,
    /// or, for a parameter without a master (fp32), in `model_overrides`; conversions are noted.
    fn apply(
        &self,
        record: &mut OptimizerRecord,
        model_overrides: &mut Vec<(Tensor, Tensor)>,
        converted: &mut Vec<(String, Kind, Kind)>,
    ) -> Result<()> {
        let items = self.list.elements()?;
        if items.len() != self.flat.len() {
            return Err(bad_value(
                self.list.path(),
                format!(
                    "{} master parameters, optimizer {} has {} (the list is amp.master_params(optimizer): \
                     every parameter of its groups in order)",
                    items.len(),
                    self.index,
                    self.flat.len()
                ),
            ));
        }
        let position: std::collections::HashMap<&str, usize> =
            self.optimizer.param_names().into_iter().enumerate().map(|(k, n)| (n, k)).collect();
        for (item, name) in items.iter().zip(self.flat.iter().copied()) {
            let pos = position[name.as_str()];
            let var = &self.vars[name.as_str()];
            let t = item.as_tensor()?;
            if t.size() != var.size() {
                return Err(AmpError::State(StateError::ShapeMismatch {
                    path: item.path(),
                    target: name.clone(),
                    expected: var.size(),
                    found: t.size(),
                }));
            }
            if !crate::dtype::is_floating(t.kind()) {
                return Err(AmpError::State(StateError::DtypeMismatch {
                    path: item.path(),
                    target: name.clone(),
                    expected: "a floating dtype".into(),
                    found: t.kind(),
                }));
            }
            if !model::all_finite(t)? {
                return Err(AmpError::State(StateError::NonFinite { path: item.path() }));
            }
            let kind = if self.layout[pos].has_master { Kind::Float } else { var.kind() };
            if t.kind() != kind {
                converted.push((item.path(), t.kind(), kind));
            }
            let value = t
                .f_to_device(var.device())
                .and_then(|t| t.f_to_kind(kind))
                .and_then(|t| t.f_detach_copy())
                .map_err(|source| AmpError::Torch { context: "checking a master parameter", source })?;
            if self.layout[pos].has_master {
                record.params[pos].master = Some(value);
            } else {
                model_overrides.push((var.shallow_clone(), value));
            }
        }
        Ok(())
    }
}

/// The checkpoint dict [`save_torch_checkpoint`] writes, as a value tree. Its tensors share
/// storage with the masters and the optimizer state: save it before the next step.
///
/// # Errors
/// [`ConfigError::OptionsMismatch`] for options that do not fit the call (a key per
/// optimizer, no entry named like the model, optimizer, scaler or master-parameter entry, a
/// `param_order` that covers the optimizer's parameters once and keeps each group to one set of
/// values, `tied` names of a variable and of no variable);
/// [`ConfigError::NoTorchForm`](crate::error::ConfigError::NoTorchForm) for an optimizer running
/// a user's rule; [`AmpError::Torch`] if a tensor cannot be read;
/// [`UsageError::NotConsolidated`](crate::error::UsageError::NotConsolidated) for a sharded
/// optimizer whose state was not gathered on this rank
/// ([`AmpOptimizer::consolidate_state_dict`], as torch's `consolidate_state_dict(to=0)` before
/// `torch.save` on rank 0: the file is then the one torch's `ZeroRedundancyOptimizer` writes
/// and loads, a plain torch.optim state dict).
pub fn torch_checkpoint_value<S: CheckpointScalers + ?Sized>(
    vs: &VarStore,
    optimizers: &[&AmpOptimizer],
    scalers: &S,
    options: &TorchSaveOptions,
) -> Result<Value> {
    let options_err = |message: String| AmpError::Config(ConfigError::OptionsMismatch { message });
    if optimizers.len() != options.optimizer_keys.len() {
        return Err(options_err(format!(
            "{} optimizers given but {} optimizer keys {:?}: name one key per optimizer with \
             TorchSaveOptions::optimizer_keys",
            optimizers.len(),
            options.optimizer_keys.len(),
            options.optimizer_keys
        )));
    }
    for (what, map) in [
        ("param_order", options.param_orders.keys().collect::<Vec<_>>()),
        ("master_params", options.master_params.keys().collect()),
    ] {
        if let Some(i) = map.into_iter().find(|&&i| i >= optimizers.len()) {
            return Err(options_err(format!(
                "a {what} for optimizer {i}, but {} optimizers were given",
                optimizers.len()
            )));
        }
    }
    let scaler_key = options.scaler_key(scalers.torch_key());
    let mut keys: Vec<&str> = vec![options.model_key.as_str()];
    keys.extend(options.optimizer_keys.iter().map(String::as_str));
    keys.extend(scaler_key.as_deref());
    keys.extend(options.master_params.values().map(String::as_str));
    keys.extend(options.entries.iter().map(|(k, _)| k.as_str()));
    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = keys.iter().find(|k| !seen.insert(**k)) {
        return Err(options_err(format!("the key {dup:?} is used twice in the checkpoint dict")));
    }
    let records: Vec<OptimizerRecord> =
        optimizers.iter().map(|o| o.consolidated_record()).collect::<std::result::Result<_, AmpError>>()?;
    let mut root = Dict::new();
    for (k, v) in &options.entries {
        root.insert(k.as_str(), v.shallow_clone());
    }
    root.insert(options.model_key.as_str(), Value::Dict(model::state_dict(vs, &records, options)?));
    let prefix = options.key_prefix.as_deref().unwrap_or("");
    let vars = vs.variables();
    for (i, (o, r)) in optimizers.iter().zip(&records).enumerate() {
        let order = options.param_orders.get(&i).cloned().unwrap_or_else(|| default_param_order(o));
        let names = options.param_names.then_some(prefix);
        root.insert(options.optimizer_keys[i].as_str(), optim::record_to_value(r, o, &order, i, names)?);
        if let Some(key) = options.master_params.get(&i) {
            let position: std::collections::HashMap<&str, usize> =
                o.param_names().into_iter().enumerate().map(|(k, n)| (n, k)).collect();
            let mut list = Vec::with_capacity(position.len());
            for name in order.iter().flatten() {
                let p = &r.params[position[name.as_str()]];
                let t = match &p.master {
                    Some(m) => m.shallow_clone(),
                    None => vars[name.as_str()].shallow_clone(),
                };
                list.push(Value::Tensor(
                    t.f_detach().map_err(|source| AmpError::Torch { context: "saving a master parameter", source })?,
                ));
            }
            root.insert(key.as_str(), Value::List(list));
        }
    }
    if let Some(key) = &scaler_key {
        root.insert(key.as_str(), scalers.scaler_state());
    }
    Ok(Value::Dict(root))
}

/// Writes the checkpoint a Python script resumes from (see the [module docs](crate::torch_checkpoint)):
/// `torch.load(path, weights_only=True)` reads it, `model.load_state_dict`,
/// `optimizer.load_state_dict` and `amp.load_state_dict` (or `scaler.load_state_dict`) take its
/// entries. `scalers`: an [`Amp`], a [`crate::GradScaler`] or a slice of them, or `&()`. The
/// file is written to a temporary file beside `path`, synced and renamed over it: `path` holds
/// the previous file or the complete new one.
///
/// # Errors
/// As [`torch_checkpoint_value`], and [`AmpError::File`] when the file cannot be written
/// (the previous file is intact).
pub fn save_torch_checkpoint<S: CheckpointScalers + ?Sized>(
    path: impl AsRef<Path>,
    vs: &VarStore,
    optimizers: &[&AmpOptimizer],
    scalers: &S,
    options: &TorchSaveOptions,
) -> Result<()> {
    let value = torch_checkpoint_value(vs, optimizers, scalers, options)?;
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
    Ok(optim::record_from_node(&state_dict.node(), optimizer, order, 0, false, false)?.record)
}

/// `record` (from [`AmpOptimizer::to_record`] of `optimizer`) as torch.optim's state dict,
/// with torch's groups and index order from `order` (see [`default_param_order`]) and each
/// group's `param_names`.
///
/// # Errors
/// [`StateError::ParamOrder`] when `order` does not name each parameter once or puts
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
/// [`StateError::ParamCount`], [`StateError::ParamOrder`] as [`load_torch_checkpoint`].
pub fn param_order_from_torch(
    state_dict: &Value,
    optimizer: &AmpOptimizer,
    model_keys: &[String],
) -> Result<TorchParamOrder> {
    optim::resolve_order(&state_dict.node(), optimizer, 0, None, model_keys, None)
}

/// The optimizer configuration and learning rate of param group 0 of a torch.optim (or
/// `apex.optimizers`) state dict, to build the optimizer a checkpoint loads into:
/// `amp.optimizer(&vs, config, lr)`, or the defaults of `amp.optimizer_groups` whose groups
/// then take each file group's own values when the checkpoint loads. Options Apex reads from
/// the optimizer rather than its groups (`adam_w_mode`, `use_nvlamb`, ...) are not in the file:
/// they are Apex's defaults here. An SGD group without torch's `maximize`, `foreach` and
/// `differentiable` keys (which torch has written since 1.11) is Apex's FusedSGD (the same
/// update as torch.optim.SGD).
///
/// # Errors
/// [`StateError::StateMismatch`] for a state dict of another class than torch.optim's
/// SGD, Adam, AdamW and RMSprop and Apex's FusedSGD, FusedAdam, FusedLAMB, FusedNovoGrad and
/// FusedAdagrad, or an Adam-family state dict that does not say which of the two it is
/// (torch < 2.6);
/// [`AmpError::File`] for a missing or mistyped entry.
pub fn optimizer_config(state_dict: &Value) -> Result<(OptimizerConfig, f64)> {
    optim::config_from_node(&state_dict.node())
}
