//! Resuming PyTorch/Apex checkpoints in Rust, and writing checkpoints a Python script resumes.
//!
//! [`load_torch_checkpoint`] reads what an Apex script saved — Apex's README recipe,
//! `torch.save({'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'amp':
//! amp.state_dict(), 'epoch': e}, path)`, or Apex's imagenet example (`main_amp.py`:
//! `{'epoch', 'arch', 'state_dict', 'best_prec1', 'optimizer'}`, with [`TorchLoadOptions::main_amp`])
//! — in any container `torch.save` has written (zip, legacy, tar; see [`crate::torch_io`]) into
//! a VarStore, [`AmpOptimizer`]s and an [`Amp`]. [`save_torch_checkpoint`] writes the mirror:
//! the dict the Python script's resume code reads with `model.load_state_dict`,
//! `optimizer.load_state_dict` and `amp.load_state_dict`, loadable with
//! `torch.load(path, weights_only=True)`, written atomically.
//!
//! ```
//! use tch::nn::{self, VarStore};
//! use tch::Device;
//! use tch_amp::torch_checkpoint::{load_torch_checkpoint, save_torch_checkpoint, TorchLoadOptions, TorchSaveOptions};
//! use tch_amp::{Amp, AmpConfig, OptLevel};
//! # fn main() -> Result<(), tch_amp::AmpError> {
//! let vs = VarStore::new(Device::Cpu);
//! let net = nn::linear(vs.root() / "fc", 4, 2, Default::default());
//! let mut amp = Amp::new(&AmpConfig::new(OptLevel::O2).verbosity(0))?;
//! let _model = amp.cast_model(&vs, net)?;
//! let sgd = nn::Sgd { momentum: 0.9, ..Default::default() };
//! let mut opt = amp.optimizer(&vs, sgd, 0.1)?;
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("checkpoint.pt");
//! // Python: torch.save({'model': ..., 'optimizer': ..., 'amp': ..., 'epoch': 3}, path)
//! save_torch_checkpoint(&path, &vs, &[&opt], &amp, &TorchSaveOptions::new().entry("epoch", 3i64))?;
//! // Python: model.load_state_dict(ckpt['model']); optimizer.load_state_dict(ckpt['optimizer']); ...
//! let report = load_torch_checkpoint(&path, &vs, &mut [&mut opt], &mut amp, &TorchLoadOptions::new())?;
//! assert_eq!(report.entries.get_str("epoch").map(|v| v.type_name()), Some("int"));
//! # Ok(())
//! # }
//! ```
//!
//! ## What loading does
//! Everything is read and checked first, then applied; on any error nothing has changed.
//! - **Model**: each entry of the model state dict goes to the VarStore variable of the same
//!   name (dotted paths, as tch's layers and torch's modules both name them). A prefix
//!   `module.` on every key (`nn.DataParallel` / `DistributedDataParallel` state dicts) is
//!   stripped ([`KeyPrefix`]). Shapes must match. Strict by default, like
//!   `load_state_dict(strict=True)`: missing and unexpected keys are
//!   [`TorchCheckpointError::KeysMismatch`] listing both; with `strict(false)` the names both
//!   have are loaded and the others reported. dtypes convert as torch's `copy_` does (fp32 state
//!   dict into O2's fp16 model: rounded once), and the report lists every conversion;
//!   [`TorchLoadOptions::exact_dtypes`] refuses them. An integer tensor never loads into a
//!   floating variable, nor the other way. Non-finite weights are refused.
//! - **`num_batches_tracked`**: tch's batch norm has no such counter, so these entries are
//!   skipped (listed in [`TorchLoadReport::ignored`], never "unexpected"). torch reads the counter
//!   only for `momentum=None` (a cumulative average), which tch's batch norm does not offer; with
//!   a momentum (torch's default, 0.1) the running statistics evolve the same without it. A
//!   VarStore variable of that name, if the user made one, loads like any other.
//! - **Tied parameters** (one tensor saved under two names): the second name is skipped and
//!   reported unless the VarStore has a variable of that name.
//! - **Optimizer**: torch.optim's state dict is keyed by parameter index, in `param_groups`
//!   order; tch-amp's optimizers order their parameters by VarStore name. The mapping
//!   ([`TorchParamOrder`], per torch group the VarStore names in index order) is taken, in this
//!   order of preference, from [`TorchLoadOptions::param_order`]; from the groups'
//!   `param_names` (torch >= 2.6 writes them for optimizers made from `named_parameters()`,
//!   tch-amp always does); or from the model state dict's order, which is `model.parameters()`'s
//!   order (both are the module registration order): its entries that are parameters of the
//!   optimizer, cut into the groups' sizes. That last one is accepted only when it is no guess:
//!   every parameter of the optimizer must appear in the model state dict, and with several
//!   groups each group must fall into one tch parameter group (`Path::set_group`) and no two
//!   into the same one; otherwise [`TorchCheckpointError::ParamOrder`] says so (a script that
//!   built its groups out of model order, e.g. weights and biases apart). Every state tensor's
//!   shape is checked against its parameter, so a wrong mapping of differently shaped
//!   parameters cannot load.
//! - **Hyper-parameters**: the file's `lr` of each group becomes the learning rate of the tch
//!   groups of its parameters (two rates for one tch group are an error). The others (momentum,
//!   dampening, nesterov, betas, eps, weight_decay, amsgrad, alpha, centered, maximize; torch's
//!   defaults where an old file lacks one) must equal the optimizer's in every group
//!   ([`TorchCheckpointError::HyperParameter`]): build the optimizer from the file with
//!   [`optimizer_config`]. `foreach`, `fused`, `capturable` and `differentiable` choose torch's
//!   implementation and are not compared; other keys (`initial_lr` from an LR scheduler) are
//!   listed in [`TorchLoadReport::ignored_group_keys`].
//! - **State**: `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, `momentum_buffer`, `square_avg`,
//!   `grad_avg` go into the optimizer's state in the dtype it keeps them (fp32 for O2's masters),
//!   `step` (tensor, float or int) into each parameter's step count. torch's SGD keeps no step
//!   count: an SGD optimizer's step counts restart at 0 (they are not used by its update).
//! - **Masters (O2)**: the fp32 masters are the model state dict's values — what Apex does
//!   too. A state dict Apex wrote under O2 holds the fp16 model cast to fp32 (its state-dict
//!   hook does not read the masters), so the masters' low bits were already lost when the
//!   Python run saved; tch-amp's own checkpoints ([`crate::save_checkpoint`]) and
//!   [`save_torch_checkpoint`]'s files hold the masters and resume bit-exactly.
//! - **Amp**: Apex's `{'loss_scaler0': {'loss_scale', 'unskipped'}, ...}` (or a
//!   `GradScaler.state_dict()`) into the scalers, checked as [`Amp::load_state_dict`] checks it.
//!
//! ## How a resumed run differs from Apex's own resume
//! Resumed here, a run continues exactly as the Python run would have continued without the
//! interruption, given the file's values (tests/torch_checkpoint.rs: bit for bit at O0 and O2).
//! Apex's own resume (README recipe) does not: `optimizer.load_state_dict` runs before Apex
//! swaps the fp32 masters into the optimizer, so torch casts the saved fp32 state to the fp16
//! model parameters' dtype, and Apex casts it back to fp32 when it makes the masters. The state
//! makes a round trip through fp16: SGD's momentum lands up to 5.7e-5 off in the test's model,
//! and Adam's second moments below fp16's smallest subnormal (6e-8; 1e-14 for the biases of a
//! layer followed by batch norm) become 0, so the first resumed Adam step divides by `eps`
//! alone and moves those parameters by up to 0.09 where the uninterrupted run moves them by
//! 1e-3. tch-amp loads the state straight into fp32 and does neither. (Apex's masters come from
//! the fp16 model as tch-amp's do from the fp32 state dict: for a file Apex wrote, the same
//! values.)
//!
//! ## What saving writes
//! A plain dict: the caller's entries ([`TorchSaveOptions::entry`]: `epoch`, `arch`,
//! `best_prec1`, ...), then the model state dict (an OrderedDict in torch's module order as far
//! as tch knows it, floating variables in fp32 taken from the masters where there are masters
//! — what Apex's O2 hook writes, without its rounding — running statistics as they are), one
//! torch.optim state dict per optimizer (`{'state': {index: {'step': tensor(n.), buffers...}},
//! 'param_groups': [{'lr', hyper-parameters, implementation flags as torch 2.13 writes them,
//! 'param_names', 'params': [index, ...]}]}`, the groups and order from
//! [`default_param_order`] or [`TorchSaveOptions::param_order`]), and `amp`
//! (`{'loss_scaler0': {'loss_scale': float, 'unskipped': int}}`). A Python script resumes it
//! with its usual code; under O2 Apex then rounds the masters to the fp16 model and round-trips
//! the state through fp16 as above, so only a resume that builds its masters from the file
//! (as tch-amp does) continues exactly.
use std::path::Path;

use tch::nn::VarStore;
use tch::Kind;

mod error;
mod model;
mod optim;
mod options;

pub use error::TorchCheckpointError;
pub use optim::default_param_order;
pub use options::{KeyPrefix, TorchLoadOptions, TorchParamOrder, TorchSaveOptions};

use crate::amp::Amp;
use crate::error::{AmpError, Result};
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

/// Reads a `torch.save` checkpoint and restores the model variables, the optimizers and the
/// loss scalers from it (see the [module docs](self) for what is mapped how). Tensors are read
/// onto [`TorchLoadOptions::map_location`], by default the VarStore's device.
///
/// # Errors
/// [`AmpError::TorchFile`] when the file cannot be read (truncated, wrong magic, a pickle
/// naming a global outside torch's weights-only set, ...) or an entry is missing or of the
/// wrong type (the message names its path); [`AmpError::TorchCheckpoint`] when it does not fit
/// (keys, shapes, dtypes, optimizer class, hyper-parameters, parameter count or order,
/// non-finite values); [`AmpError::StateMismatch`] for an amp state the scalers refuse. Nothing
/// is changed on error.
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
        }
        .into());
    }
    if let Some(i) = options.param_orders.keys().find(|&&i| i >= optimizers.len()) {
        return Err(TorchCheckpointError::Options {
            message: format!("a param_order for optimizer {i}, but {} optimizers were given", optimizers.len()),
        }
        .into());
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
            AmpError::StateMismatch { message } => {
                AmpError::StateMismatch { message: format!("optimizer {i}: {message}") }
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
    if let Value::Dict(mut d) = checkpoint {
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
/// [`AmpError::TorchCheckpoint`] (`Options`) for options that do not fit the call (a key per
/// optimizer, no entry named like the model, optimizer or amp entry, a `param_order` that
/// covers the optimizer's parameters once and keeps each group to one learning rate);
/// [`AmpError::Torch`] if a tensor cannot be read.
pub fn torch_checkpoint_value(
    vs: &VarStore,
    optimizers: &[&AmpOptimizer],
    amp: &Amp,
    options: &TorchSaveOptions,
) -> Result<Value> {
    let options_err = |message: String| AmpError::from(TorchCheckpointError::Options { message });
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

/// Writes the checkpoint a Python Apex script resumes from (see the [module docs](self)):
/// `torch.load(path, weights_only=True)` reads it, `model.load_state_dict`,
/// `optimizer.load_state_dict` and `amp.load_state_dict` take its entries. The file is written
/// to a temporary file beside `path`, synced and renamed over it: `path` holds the previous
/// file or the complete new one.
///
/// # Errors
/// As [`torch_checkpoint_value`], and [`AmpError::TorchFile`] when the file cannot be written
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
/// [`AmpError::TorchCheckpoint`] when `order` does not name each parameter once or puts
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
/// [module docs](self)).
///
/// # Errors
/// [`AmpError::TorchCheckpoint`] (`ParamCount`, `ParamOrder`) as [`load_torch_checkpoint`].
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
/// [`AmpError::TorchCheckpoint`] (`BadValue`) for a state dict of another class than SGD,
/// Adam, AdamW and RMSprop, an Adam-family state dict that does not say which of the two it is
/// (torch < 2.6), or groups whose hyper-parameters besides `lr` differ;
/// [`AmpError::TorchFile`] for a missing or mistyped entry.
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

/// An amp state (numbers, strings, containers) as JSON for [`Amp::load_state_dict`]'s checks.
fn to_json(node: &Node<'_>) -> Result<serde_json::Value> {
    use serde_json::Value as J;
    let bad =
        |message: &str| AmpError::from(TorchCheckpointError::BadValue { path: node.path(), message: message.into() });
    Ok(match node.value() {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::Float(f) => {
            J::Number(serde_json::Number::from_f64(*f).ok_or_else(|| bad("a loss scaler state must be finite"))?)
        }
        Value::Str(s) => J::String(s.clone()),
        Value::Tensor(t) if t.numel() == 1 => {
            let f = t
                .f_reshape([])
                .and_then(|t| t.f_double_value(&[]))
                .map_err(|source| AmpError::Torch { context: "reading the amp state", source })?;
            J::Number(serde_json::Number::from_f64(f).ok_or_else(|| bad("a loss scaler state must be finite"))?)
        }
        Value::List(_) | Value::Tuple(_) => J::Array(node.elements()?.iter().map(to_json).collect::<Result<_>>()?),
        Value::Dict(_) => {
            let mut m = serde_json::Map::new();
            for (k, v) in node.entries()? {
                let key = match k {
                    Key::Str(s) => s.clone(),
                    Key::Int(i) => return Err(bad(&format!("has the int key {i}; the amp state's keys are names"))),
                };
                m.insert(key, to_json(&v)?);
            }
            J::Object(m)
        }
        other => return Err(bad(&format!("a {} in the amp state", other.type_name()))),
    })
}
