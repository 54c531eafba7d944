//! The parameters an optimizer updates: one entry per trainable variable, with the fp32 master
//! copy of a low-precision variable under master weights (O2), and the copy back into the model
//! after each step.
use crate::error::ConfigError;
use tch::{nn::VarStore, Kind, Tensor};

use crate::dtype::is_low_precision;
use crate::error::{AmpError, Result, TorchContext};

/// One trainable variable of the model as an optimizer sees it.
#[derive(Debug)]
pub(crate) struct ParamEntry {
    name: String,
    model: Tensor,
    group: usize,
    /// Position in the VarStore's creation order (model order: diagnostics and torch's parameter
    /// order).
    order: usize,
    master: Option<Tensor>,
}

impl ParamEntry {
    /// The VarStore name (dotted path).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
    /// The model's variable (shares storage with the model's layers).
    pub(crate) fn model(&self) -> &Tensor {
        &self.model
    }
    /// The parameter group (tch's `Path::set_group`), for per-group learning rates.
    pub(crate) fn group(&self) -> usize {
        self.group
    }
    /// Position of the variable in the VarStore's creation order (model order).
    pub(crate) fn order(&self) -> usize {
        self.order
    }
    /// The fp32 master copy of a low-precision variable under master weights. Variables that
    /// are already fp32 (batch norm under O2) are their own masters: `None`.
    pub(crate) fn master(&self) -> Option<&Tensor> {
        self.master.as_ref()
    }
    /// The tensor the optimizer updates: the master when there is one, else the model's own.
    pub(crate) fn update_target(&self) -> &Tensor {
        self.master.as_ref().unwrap_or(&self.model)
    }
}

impl ParamEntry {
    /// Gives a low-precision variable its fp32 master (made from the variable), if it has none.
    pub(crate) fn make_master(&mut self) -> Result<()> {
        if self.master.is_none() && is_low_precision(self.model.kind()) {
            let _no_grad = tch::no_grad_guard();
            let m = self.model.f_detach().and_then(|t| t.f_to_kind(Kind::Float)).ctx("creating a master weight")?;
            self.master = Some(m);
        }
        Ok(())
    }
}

/// True when `name` lies under one of `prefixes`, compared by whole path segments.
pub(crate) fn under_prefix(name: &str, prefixes: &[&str]) -> bool {
    prefixes.is_empty()
        || prefixes.iter().any(|p| {
            let p = p.trim_end_matches('.');
            p.is_empty() || name == p || (name.starts_with(p) && name.as_bytes().get(p.len()) == Some(&b'.'))
        })
}

/// The parameter group of each trainable variable. tch keeps groups only in the VarStore's
/// internal list (`Path::set_group`), so this is the one place tch-amp reads it.
fn trainable_groups(vs: &VarStore) -> Result<Vec<(Tensor, usize)>> {
    let v = vs.variables_.lock().map_err(|_| {
        AmpError::torch("locking the VarStore", "the lock is poisoned: another thread panicked while holding it")
    })?;
    Ok(v.trainable_variables.iter().map(|var| (var.tensor.shallow_clone(), var.group)).collect())
}

/// A trainable variable of a VarStore, before it becomes a [`ParamEntry`].
#[derive(Debug)]
pub(crate) struct Candidate {
    pub(crate) name: String,
    pub(crate) var: Tensor,
    group: usize,
    order: usize,
}

/// The trainable (requires_grad) variables of `vs`, sorted by name, with their tch group and
/// creation order.
pub(crate) fn trainable(vs: &VarStore) -> Result<Vec<Candidate>> {
    let vars = vs.variables();
    let groups = trainable_groups(vs)?;
    let mut out: Vec<Candidate> = vars
        .into_iter()
        .filter(|(_, v)| v.requires_grad())
        .map(|(name, var)| {
            let found = groups.iter().position(|(t, _)| t.is_set_to(&var));
            let group = found.map_or(0, |i| groups[i].1);
            let order = found.unwrap_or(usize::MAX);
            Candidate { name, var, group, order }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

impl Candidate {
    /// The entry, with an fp32 master for a low-precision variable when `master_weights`.
    pub(crate) fn into_entry(self, master_weights: bool) -> Result<ParamEntry> {
        let _no_grad = tch::no_grad_guard();
        let master = if master_weights && is_low_precision(self.var.kind()) {
            Some(
                self.var
                    .f_detach()
                    .ctx("creating a master weight")?
                    .f_to_kind(Kind::Float)
                    .ctx("creating a master weight")?,
            )
        } else {
            None
        };
        Ok(ParamEntry { name: self.name, model: self.var, group: self.group, order: self.order, master })
    }
}

/// The trainable (requires_grad) variables of `vs` under `prefixes`, sorted by name, with
/// fp32 masters for the low-precision ones when `master_weights`.
pub(crate) fn build_entries(vs: &VarStore, prefixes: &[&str], master_weights: bool) -> Result<Vec<ParamEntry>> {
    let all_names = vs.variables();
    if !prefixes.is_empty() && !all_names.keys().any(|n| under_prefix(n, prefixes)) {
        return Err(AmpError::Config(ConfigError::NoVariablesUnder {
            prefixes: prefixes.iter().map(|p| p.to_string()).collect(),
        }));
    }
    trainable(vs)?
        .into_iter()
        .filter(|c| under_prefix(&c.name, prefixes))
        .map(|c| c.into_entry(master_weights))
        .collect()
}

/// Creation order with each module's `weight` moved right before its `bias`: tch's linear and
/// convolution layers create the bias first, torch's modules register the weight first (tch's
/// other layers, batch norm, layer norm, group norm and the RNNs, create theirs in torch's order).
pub(crate) fn torch_param_order(mut names: Vec<String>) -> Vec<String> {
    let mut i = 0;
    while i < names.len() {
        let module = names[i].strip_suffix("bias").filter(|m| m.is_empty() || m.ends_with('.')).map(str::to_string);
        if let Some(m) = module {
            let weight = format!("{m}weight");
            if let Some(j) = names[i + 1..].iter().position(|n| *n == weight) {
                let w = names.remove(i + 1 + j);
                names.insert(i, w);
                i += 1;
            }
        }
        i += 1;
    }
    names
}

/// model ← master (rounded to the model's dtype) for every entry with a master.
pub(crate) fn copy_masters_to_model(entries: &[ParamEntry]) -> Result<()> {
    let _no_grad = tch::no_grad_guard();
    for e in entries {
        if let Some(master) = &e.master {
            let mut m = e.model.shallow_clone();
            m.f_copy_(master).ctx("copying master weights into the model")?;
        }
    }
    Ok(())
}
