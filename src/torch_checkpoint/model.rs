//! The model state dict: `model.state_dict()` by name into the VarStore (checked and checked,
//! applied later), and the VarStore out as a state dict in torch's module order.
use std::collections::{BTreeMap, BTreeSet};

use tch::nn::VarStore;
use tch::{Kind, Tensor};

use super::error::bad_value;
use crate::error::{AmpError, ConfigError, Result, StateError};

use super::options::{KeyPrefix, TorchLoadOptions, TorchSaveOptions};
use crate::dtype::{is_floating, is_low_precision};
use crate::error::TorchContext;
use crate::optim::{torch_param_order, OptimizerRecord};
use crate::torch_io::{Dict, Key, Node, Value};

/// The prefixes [`KeyPrefix::Auto`] strips: `module.` (`nn.DataParallel`,
/// `DistributedDataParallel`) and `_orig_mod.` (a `torch.compile`d model).
const AUTO_PREFIXES: [&str; 2] = ["module.", "_orig_mod."];
const NUM_BATCHES_TRACKED: &str = "num_batches_tracked";

/// A model state dict checked against a VarStore, ready to apply.
pub(super) struct CheckedModel {
    /// (variable, value in the variable's dtype on its device).
    pub(super) copies: Vec<(Tensor, Tensor)>,
    /// fp32 values of the fp16/bf16 variables, by name: their masters under O2.
    pub(super) fp32: BTreeMap<String, Tensor>,
    /// The VarStore names of the file's entries, in the file's order, without aliases: the
    /// order `model.parameters()` had in Python.
    pub(super) order: Vec<String>,
    /// The prefix stripped from the keys.
    pub(super) prefix: Option<String>,
    pub(super) missing: Vec<String>,
    pub(super) unexpected: Vec<String>,
    pub(super) ignored: Vec<String>,
    pub(super) converted: Vec<(String, Kind, Kind)>,
}

fn key_str<'a>(node: &Node<'_>, key: &'a Key) -> Result<&'a str> {
    match key {
        Key::Str(s) => Ok(s),
        Key::Int(i) => Err(bad_value(
            node.path(),
            format!("has the int key {i}; a state dict's keys are parameter and buffer names"),
        )),
    }
}

/// The prefix to strip from `keys`, as `rule` says.
pub(super) fn prefix_to_strip(keys: &[&str], vs_names: &BTreeSet<String>, rule: &KeyPrefix) -> Option<String> {
    match rule {
        KeyPrefix::Keep => None,
        KeyPrefix::Strip(p) => Some(p.clone()),
        KeyPrefix::Auto => {
            // Stacked wrappers stack their prefixes (`module._orig_mod.`): strip them one by one.
            let mut prefix = String::new();
            while let Some(p) = AUTO_PREFIXES.iter().find(|p| {
                let full = format!("{prefix}{p}");
                !keys.is_empty()
                    && keys.iter().all(|k| k.starts_with(&full))
                    && !vs_names.iter().any(|n| n.starts_with(**p))
            }) {
                prefix.push_str(p);
            }
            (!prefix.is_empty()).then_some(prefix)
        }
    }
}

/// `key` without `prefix` (when it starts with it).
pub(super) fn strip<'a>(key: &'a str, prefix: Option<&str>) -> &'a str {
    match prefix {
        Some(p) => key.strip_prefix(p).unwrap_or(key),
        None => key,
    }
}

/// Whether every element of a floating tensor is finite (integer tensors always are).
pub(super) fn all_finite(t: &Tensor) -> Result<bool> {
    if !is_floating(t.kind()) {
        return Ok(true);
    }
    let n = t.f_isfinite().and_then(|f| f.f_all()).and_then(|a| a.f_int64_value(&[])).ctx("checking for inf/NaN")?;
    Ok(n != 0)
}

/// Whether `b` views exactly what `a` views (a tied parameter saved under two names).
fn same_view(a: &Tensor, b: &Tensor) -> bool {
    a.kind() == b.kind()
        && a.size() == b.size()
        && a.stride() == b.stride()
        && a.numel() > 0
        && a.data_ptr() == b.data_ptr()
        && a.device() == b.device()
}

/// Checks the model state dict at `node` against `vs` and copies every value to the variables' devices.
pub(super) fn check(node: &Node<'_>, vs: &VarStore, options: &TorchLoadOptions) -> Result<CheckedModel> {
    let entries = node.entries()?;
    let vars = vs.variables();
    let vs_names: BTreeSet<String> = vars.keys().cloned().collect();
    let keys: Vec<&str> = entries.iter().map(|(k, _)| key_str(node, k)).collect::<Result<_>>()?;
    let prefix = prefix_to_strip(&keys, &vs_names, &options.key_prefix);
    let mut checked = CheckedModel {
        copies: Vec::new(),
        fp32: BTreeMap::new(),
        order: Vec::new(),
        prefix: prefix.clone(),
        missing: Vec::new(),
        unexpected: Vec::new(),
        ignored: Vec::new(),
        converted: Vec::new(),
    };
    let mut seen_tensors: Vec<(&str, &Tensor)> = Vec::new();
    let mut loaded: BTreeSet<&str> = BTreeSet::new();
    let _no_grad = tch::no_grad_guard();
    for ((_, entry), key) in entries.iter().zip(&keys) {
        let name = strip(key, prefix.as_deref());
        let t = entry.as_tensor()?;
        let alias_of = seen_tensors.iter().find(|(_, s)| same_view(s, t)).map(|(n, _)| *n);
        seen_tensors.push((name, t));
        let Some(var) = vars.get(name) else {
            if let Some(first) = alias_of {
                checked.ignored.push(format!("{name} (the same tensor as {first})"));
            } else if name.rsplit('.').next() == Some(NUM_BATCHES_TRACKED) {
                checked.ignored.push(name.to_string());
            } else {
                checked.unexpected.push(name.to_string());
            }
            continue;
        };
        if alias_of.is_none() {
            checked.order.push(name.to_string());
        }
        if !loaded.insert(name) {
            return Err(bad_value(
                entry.path(),
                format!("{name} appears twice once the prefix {prefix:?} is stripped"),
            ));
        }
        if t.size() != var.size() {
            return Err(AmpError::State(StateError::ShapeMismatch {
                path: entry.path(),
                target: name.to_string(),
                expected: var.size(),
                found: t.size(),
            }));
        }
        check_dtype(&entry.path(), name, t.kind(), var.kind(), options.exact_dtypes)?;
        if !all_finite(t)? {
            return Err(AmpError::State(StateError::NonFinite { path: entry.path() }));
        }
        let on_device = t.f_to_device(var.device()).ctx("moving a state dict entry to the VarStore's device")?;
        if is_low_precision(var.kind()) {
            let fp32 = on_device.f_to_kind(Kind::Float).ctx("an fp32 copy for the master")?;
            checked.fp32.insert(name.to_string(), fp32);
        }
        if t.kind() != var.kind() {
            checked.converted.push((name.to_string(), t.kind(), var.kind()));
        }
        let value = on_device.f_to_kind(var.kind()).ctx("converting a state dict entry")?;
        checked.copies.push((var.shallow_clone(), value));
    }
    checked.missing = vs_names.iter().filter(|n| !loaded.contains(n.as_str())).cloned().collect();
    if options.strict && !(checked.missing.is_empty() && checked.unexpected.is_empty()) {
        let (missing_keys, unexpected_keys) =
            (std::mem::take(&mut checked.missing), std::mem::take(&mut checked.unexpected));
        let remedy = super::error::mismatch_remedy(&missing_keys, &unexpected_keys);
        return Err(AmpError::State(StateError::IncompatibleKeys {
            what: "the model state dict".to_string(),
            missing_keys,
            unexpected_keys,
            remedy,
        }));
    }
    Ok(checked)
}

/// Whether a tensor of `found` may load into a variable of `var` (see
/// `TorchLoadOptions::exact_dtypes`).
fn check_dtype(path: &str, name: &str, found: Kind, var: Kind, exact: bool) -> Result<()> {
    let ok = if exact {
        found == var || (is_low_precision(var) && found == Kind::Float)
    } else if is_floating(var) {
        is_floating(found)
    } else {
        found == var
    };
    if ok {
        return Ok(());
    }
    let expected = if exact && is_low_precision(var) {
        format!("{var:?}, or Float (an O2 state dict)")
    } else if exact || !is_floating(var) {
        format!("{var:?}")
    } else {
        format!("a floating dtype (the variable is {var:?})")
    };
    Err(AmpError::State(StateError::DtypeMismatch {
        path: path.to_string(),
        target: name.to_string(),
        expected,
        found,
    }))
}

/// The trainable variables' names in the VarStore's creation order (tch keeps groups and
/// order only in its internal list, matched here to names by tensor identity).
pub(super) fn creation_order(vs: &VarStore) -> Result<Vec<String>> {
    let named = vs.variables();
    let v = vs.variables_.lock().map_err(|_| {
        AmpError::torch("locking the VarStore", "the lock is poisoned: another thread panicked while holding it")
    })?;
    let mut out = Vec::with_capacity(v.trainable_variables.len());
    for var in &v.trainable_variables {
        if let Some((name, _)) = named.iter().find(|(_, t)| t.is_set_to(&var.tensor)) {
            out.push(name.clone());
        }
    }
    Ok(out)
}

/// The VarStore's names in torch's `state_dict()` order as far as tch can know it: modules in
/// the order of their first trainable variable, in each module its trainable
/// variables then the others (running statistics) by name; modules without trainable variables
/// last, by name. The trainable variables come out in torch's parameter order, which is
/// `model.parameters()`'s order when the Rust model creates its layers in the order the Python
/// module registers them.
pub(super) fn state_dict_order(vs: &VarStore) -> Result<Vec<String>> {
    let trainable = torch_param_order(creation_order(vs)?);
    let rank: BTreeMap<&str, usize> = trainable.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
    let module = |n: &str| n.rsplit_once('.').map_or("", |(m, _)| m).to_string();
    let mut module_rank: BTreeMap<String, usize> = BTreeMap::new();
    for (i, n) in trainable.iter().enumerate() {
        module_rank.entry(module(n)).or_insert(i);
    }
    let mut names: Vec<String> = vs.variables().into_keys().collect();
    names.sort_by_cached_key(|n| {
        let m = module(n);
        let (within, r) = match rank.get(n.as_str()) {
            Some(&r) => (0, r),
            None => (1, 0),
        };
        (module_rank.get(&m).copied().unwrap_or(usize::MAX), m, within, r, n.clone())
    });
    Ok(names)
}

/// The model state dict tch-amp writes: an OrderedDict in [`state_dict_order`], floating
/// variables in fp32 (the fp32 masters where the optimizers have them, so nothing is lost),
/// others as they are, then the second names of tied parameters (`options.tied`) viewing the
/// same tensors, every key behind `options.key_prefix`.
pub(super) fn state_dict(vs: &VarStore, records: &[OptimizerRecord], options: &TorchSaveOptions) -> Result<Dict> {
    let masters: BTreeMap<&str, &Tensor> = records
        .iter()
        .flat_map(|r| r.params.iter().filter_map(|p| p.master.as_ref().map(|m| (p.name.as_str(), m))))
        .collect();
    let vars = vs.variables();
    let prefix = options.key_prefix.as_deref().unwrap_or("");
    let names = state_dict_order(vs)?;
    let _no_grad = tch::no_grad_guard();
    let mut dict = Dict::new_ordered();
    for name in &names {
        let var = &vars[name];
        let t = match masters.get(name.as_str()) {
            Some(m) => m.f_detach().ctx("saving a master")?,
            None if is_floating(var.kind()) && var.kind() != Kind::Double => {
                var.f_detach().and_then(|v| v.f_to_kind(Kind::Float)).ctx("saving a variable in fp32")?
            }
            None => var.f_detach().ctx("saving a variable")?,
        };
        dict.insert(format!("{prefix}{name}"), Value::Tensor(t));
        // After a batch norm's running_var: its num_batches_tracked, when asked for.
        if let (Some(n), Some(m)) = (options.num_batches_tracked, name.strip_suffix(".running_var")) {
            let counter = format!("{m}.{NUM_BATCHES_TRACKED}");
            if vars.contains_key(&format!("{m}.running_mean")) && !vars.contains_key(&counter) {
                let t = Tensor::from_slice(&[n])
                    .f_reshape([])
                    .and_then(|t| t.f_to_device(var.device()))
                    .ctx("num_batches_tracked")?;
                dict.insert(format!("{prefix}{counter}"), Value::Tensor(t));
            }
        }
    }
    for (alias, variable) in &options.tied {
        let options_err = |message: String| AmpError::Config(ConfigError::OptionsMismatch { message });
        if vars.contains_key(alias) {
            return Err(options_err(format!(
                "tied({alias:?}, {variable:?}): {alias} is a variable of the VarStore itself"
            )));
        }
        let Some(Value::Tensor(t)) = dict.get_str(&format!("{prefix}{variable}")) else {
            return Err(options_err(format!(
                "tied({alias:?}, {variable:?}): {variable} is not a variable of the VarStore"
            )));
        };
        let t = t.shallow_clone();
        if dict.insert(format!("{prefix}{alias}"), Value::Tensor(t)).is_some() {
            return Err(options_err(format!("tied({alias:?}, ..): {alias} is named twice")));
        }
    }
    Ok(dict)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn auto_strips_wrapper_prefixes_stacked_or_alone() {
        let vs: BTreeSet<String> = names(&["fc.weight", "fc.bias"]).into_iter().collect();
        let strip = |keys: &[&str]| prefix_to_strip(keys, &vs, &KeyPrefix::Auto);
        assert_eq!(strip(&["module.fc.weight", "module.fc.bias"]).as_deref(), Some("module."));
        assert_eq!(strip(&["_orig_mod.fc.weight", "_orig_mod.fc.bias"]).as_deref(), Some("_orig_mod."));
        assert_eq!(strip(&["module._orig_mod.fc.weight"]).as_deref(), Some("module._orig_mod."));
        assert_eq!(strip(&["_orig_mod.module.fc.weight"]).as_deref(), Some("_orig_mod.module."));
        assert_eq!(strip(&["module.fc.weight", "fc.bias"]), None);
        assert_eq!(strip(&[]), None);
        // A VarStore whose own names start with the prefix keeps the keys.
        let vs: BTreeSet<String> = names(&["module.fc.weight"]).into_iter().collect();
        assert_eq!(prefix_to_strip(&["module.fc.weight"], &vs, &KeyPrefix::Auto), None);
    }
}
