//! What an optimizer saves and restores: its [`OptimizerRecord`], checked in full (checked)
//! before anything is applied.
use crate::error::StateError;
use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use super::{AmpOptimizer, Stage};
use crate::error::{mismatch, AmpError, Result, TorchContext};
use crate::optim::engine::{check_lr, ParamStateBuffers};
use crate::optim::record::{GroupRecord, OptimizerRecord, ParamRecord};
use crate::optim::rule::{HyperParams, StateShape};
/// What a strict partial load's key mismatch suggests.
const STRICT_REMEDY: &str = "load with strict = false";

impl AmpOptimizer {
    /// The optimizer's persistent state: the default learning rate, the parameter groups
    /// (learning rate, hyper-parameters, step count, parameters), counters, and per parameter
    /// its step count, state tensors and fp32 master value. Tensors are shared, not copied:
    /// save or copy them before the next step. See [`OptimizerRecord`] for the correspondence
    /// with torch.optim's `state_dict()`.
    pub fn to_record(&self) -> OptimizerRecord {
        let names_of = |index: usize| -> Vec<String> {
            self.entries
                .iter()
                .zip(self.inner.group_of())
                .filter(|(_, &gi)| gi == index)
                .map(|(e, _)| e.name().to_string())
                .collect()
        };
        let groups: Vec<GroupRecord> = self
            .inner
            .groups()
            .iter()
            .enumerate()
            .map(|(i, g)| GroupRecord {
                id: g.id,
                lr: g.lr,
                hyper_parameters: g.hyper.as_map().clone(),
                step: g.step,
                params: names_of(i),
            })
            .collect();
        let params = self
            .entries
            .iter()
            .zip(self.inner.states())
            .map(|(e, st)| ParamRecord {
                name: e.name().to_string(),
                step: st.step(),
                buffers: st.buffers().iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect(),
                master: e.master().map(Tensor::shallow_clone),
            })
            .collect();
        let lr = self.inner.lr();
        OptimizerRecord {
            kind: self.inner.rule().kind().to_string(),
            hyper_parameters: self.inner.defaults().as_map().clone(),
            lr,
            group_lr: groups.iter().filter(|g| g.lr.to_bits() != lr.to_bits()).map(|g| (g.id, g.lr)).collect(),
            groups,
            steps: self.steps,
            skipped: self.skipped,
            params,
        }
    }

    /// Restores a record made by [`Self::to_record`] (of this optimizer or of one built the same
    /// way; or mapped from another framework's state, see [`OptimizerRecord`]). Everything is
    /// checked before anything changes: the rule's kind and default hyper-parameters, the parameter
    /// names and order, the groups (same ids and parameters; their learning rates and
    /// hyper-parameters are restored, as torch's `load_state_dict` restores `param_groups`, and
    /// checked as at construction), for each parameter either no state (never updated) or exactly
    /// the state tensors its group's rule keeps, each with the expected shape, the state dtype
    /// (fp32 for fp16 parameters where the rule or the configuration says so) and finite values,
    /// and a finite fp32 master of the right shape for each parameter with a master. Gradients are
    /// cleared and a pending skip forgotten.
    ///
    /// # Errors
    /// [`StateError::StateMismatch`] for any difference; nothing is changed then.
    pub fn load_record(&mut self, record: OptimizerRecord) -> Result<()> {
        let checked = self.check_record(record)?;
        self.apply_checked(checked)
    }

    /// Checks that `record` comes from an optimizer of the same rule and defaults.
    fn check_identity(&self, record: &OptimizerRecord) -> Result<()> {
        let kind = self.inner.rule().kind();
        if record.kind != kind {
            return Err(mismatch(format!("the record is of a {} optimizer, this one is {kind}", record.kind)));
        }
        let ours = self.inner.defaults();
        if !ours.same_bits(&HyperParams::from(record.hyper_parameters.clone())) {
            return Err(mismatch(format!(
                "the record's {} hyper-parameters are {:?}, this optimizer's are {:?}: build the optimizer with the \
                 record's values",
                record.kind,
                record.hyper_parameters,
                ours.as_map()
            )));
        }
        if check_lr(record.lr).is_err() {
            return Err(mismatch(format!("learning rate {} must be finite and >= 0", record.lr)));
        }
        Ok(())
    }

    /// A recorded group's settings, checked against the rule.
    fn check_group(&self, g: &GroupRecord) -> Result<(f64, HyperParams, u64)> {
        let hyper = HyperParams::from(g.hyper_parameters.clone());
        let defaults = self.inner.defaults();
        if !hyper.keys().eq(defaults.keys()) {
            return Err(mismatch(format!(
                "group {}: hyper-parameters {:?}, this optimizer's are {:?}",
                g.id,
                hyper.keys().collect::<Vec<_>>(),
                defaults.keys().collect::<Vec<_>>()
            )));
        }
        check_lr(g.lr)
            .and_then(|_| self.inner.rule().validate(g.lr, &hyper))
            .map_err(|e| mismatch(format!("group {}: lr {} and {:?}: {e}", g.id, g.lr, g.hyper_parameters)))?;
        Ok((g.lr, hyper, g.step))
    }

    /// A recorded parameter's state, checked against entry `i` and its group's `hyper`.
    fn check_param(
        &self,
        i: usize,
        p: ParamRecord,
        hyper: &HyperParams,
        with_master: bool,
    ) -> Result<(u64, ParamStateBuffers, Option<Tensor>)> {
        let e = &self.entries[i];
        let target = e.update_target();
        let target_kind = self.target_kind(i);
        let mut specs = self.inner.rule().state_spec(hyper);
        specs.sort_by(|a, b| a.name().cmp(b.name()));
        if !p.buffers.is_empty() || p.step > 0 {
            let found: Vec<&str> = p.buffers.keys().map(String::as_str).collect();
            let expected: Vec<&str> = specs.iter().map(|s| s.name()).collect();
            if found != expected {
                return Err(mismatch(format!(
                    "{}: optimizer state {found:?} at step {}, this optimizer keeps {expected:?}",
                    p.name, p.step
                )));
            }
        }
        let mut buffers = ParamStateBuffers::new();
        for (spec, (k, v)) in specs.iter().zip(p.buffers) {
            let (kind, shape) = self.inner.stored_state(spec, target_kind, &target.size());
            let v = checked_tensor(&format!("{}/{k}", p.name), v, &shape, target, kind)?;
            if spec.shape() == StateShape::Scalar && v.dim() != 0 {
                return Err(mismatch(format!("{}/{k} must be a 0-dim tensor", p.name)));
            }
            buffers.insert(k, v);
        }
        let master = match (e.master(), p.master, with_master) {
            (Some(m), Some(v), true) => {
                Some(checked_tensor(&format!("{} (master)", p.name), v, &m.size(), m, Kind::Float)?)
            }
            (Some(_), None, true) => return Err(mismatch(format!("{}: the record has no master value", p.name))),
            _ => None,
        };
        Ok((p.step, buffers, master))
    }

    /// Checks `record` against this optimizer and copies its values to the parameters' device.
    pub(crate) fn check_record(&self, record: OptimizerRecord) -> Result<CheckedRecord> {
        record.validate()?;
        self.check_identity(&record)?;
        let names: Vec<&str> = record.params.iter().map(|p| p.name.as_str()).collect();
        if names != self.param_names() {
            return Err(mismatch(format!(
                "the record covers parameters {names:?}, this optimizer covers {:?}",
                self.param_names()
            )));
        }
        let ours = self.to_record().groups;
        let groups: Vec<(f64, HyperParams, u64)> = if record.groups.is_empty() {
            // The older form: learning rates only.
            let ids = self.param_groups();
            if let Some(g) = record.group_lr.keys().find(|g| !ids.contains(g)) {
                return Err(mismatch(format!(
                    "the record sets the learning rate of group {g}, this optimizer's groups are {ids:?}"
                )));
            }
            if record.group_lr.values().any(|&v| check_lr(v).is_err()) {
                return Err(mismatch(format!("learning rates {:?} must be finite and >= 0", record.group_lr)));
            }
            ours.iter()
                .map(|g| {
                    let glr = record.group_lr.get(&g.id).copied().unwrap_or(record.lr);
                    let hyper = HyperParams::from(g.hyper_parameters.clone());
                    self.inner
                        .rule()
                        .validate(glr, &hyper)
                        .map_err(|e| mismatch(format!("group {}: lr {glr}: {e}", g.id)))?;
                    Ok((glr, hyper, g.step))
                })
                .collect::<Result<_>>()?
        } else {
            if record.groups.len() != ours.len() {
                return Err(mismatch(format!(
                    "the record has {} parameter groups, this optimizer {} (add the same groups with \
                     add_param_group before loading)",
                    record.groups.len(),
                    ours.len()
                )));
            }
            let mut checked = Vec::with_capacity(ours.len());
            for (g, r) in ours.iter().zip(&record.groups) {
                if g.id != r.id || g.params != r.params {
                    return Err(mismatch(format!(
                        "the record's group {} holds {:?}, this optimizer's group {} holds {:?}",
                        r.id, r.params, g.id, g.params
                    )));
                }
                checked.push(self.check_group(r)?);
            }
            checked
        };
        let group_of = self.inner.group_of().to_vec();
        let mut per_param = Vec::with_capacity(record.params.len());
        for (i, p) in record.params.into_iter().enumerate() {
            per_param.push(self.check_param(i, p, &groups[group_of[i]].1, true)?);
        }
        Ok(CheckedRecord { lr: record.lr, groups, steps: record.steps, skipped: record.skipped, per_param })
    }

    /// Applies a record checked by [`Self::check_record`].
    pub(crate) fn apply_checked(&mut self, checked: CheckedRecord) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let mut states = Vec::with_capacity(checked.per_param.len());
        for (e, (step, buffers, master)) in self.entries.iter().zip(checked.per_param) {
            if let (Some(m), Some(v)) = (e.master(), master) {
                let mut m = m.shallow_clone();
                m.f_copy_(&v).ctx("restoring a master weight")?;
            }
            states.push((step, buffers));
        }
        self.inner.restore(checked.lr, checked.groups, states);
        self.steps = checked.steps;
        self.skipped = checked.skipped;
        self.state_changed();
        self.reset_transient()
    }

    /// Gradients cleared, pending skips and collapses forgotten.
    fn reset_transient(&mut self) -> Result<()> {
        self.zero_grad()?;
        self.stage = Stage::Ready;
        Ok(())
    }

    /// Checks the optimizer state of `record` (state tensors, step counts, groups' settings;
    /// never master values) against this optimizer, matching parameters and groups by name
    /// and id. `strict`: the parameters and groups must be the same ones; otherwise those of
    /// the record this optimizer lacks are ignored (`unexpected`) and those it has that the
    /// record lacks keep their state (`missing`).
    pub(crate) fn check_state_only(&self, record: OptimizerRecord, strict: bool) -> Result<CheckedPartial> {
        record.validate()?;
        self.check_identity(&record)?;
        let names = self.param_names();
        let rec_names: Vec<String> = record.params.iter().map(|p| p.name.clone()).collect();
        let missing: Vec<String> =
            names.iter().filter(|n| !rec_names.iter().any(|r| r == *n)).map(|n| n.to_string()).collect();
        let unexpected: Vec<String> = rec_names.iter().filter(|r| !names.contains(&r.as_str())).cloned().collect();
        if strict && (!missing.is_empty() || !unexpected.is_empty()) {
            return Err(AmpError::State(StateError::IncompatibleKeys {
                what: "optimizer state".to_string(),
                missing_keys: missing,
                unexpected_keys: unexpected,
                remedy: STRICT_REMEDY.to_string(),
            }));
        }
        let ours = self.to_record().groups;
        let mut missing_groups = Vec::new();
        let mut unexpected_groups = Vec::new();
        let mut groups = Vec::new();
        for (gi, g) in ours.iter().enumerate() {
            match record.groups.iter().find(|r| r.id == g.id) {
                Some(r) => {
                    if strict && r.params != g.params {
                        return Err(mismatch(format!(
                            "the record's group {} holds {:?}, this optimizer's holds {:?}",
                            r.id, r.params, g.params
                        )));
                    }
                    let (lr, hyper, step) = self.check_group(r)?;
                    groups.push((gi, lr, hyper, step));
                }
                None if record.groups.is_empty() => {}
                None => missing_groups.push(format!("param_groups.{}", g.id)),
            }
        }
        for r in &record.groups {
            if !ours.iter().any(|g| g.id == r.id) {
                unexpected_groups.push(format!("param_groups.{}", r.id));
            }
        }
        if strict
            && (!missing.is_empty()
                || !unexpected.is_empty()
                || !missing_groups.is_empty()
                || !unexpected_groups.is_empty())
        {
            return Err(AmpError::State(StateError::IncompatibleKeys {
                what: "optimizer state".to_string(),
                missing_keys: [missing, missing_groups].concat(),
                unexpected_keys: [unexpected, unexpected_groups].concat(),
                remedy: STRICT_REMEDY.to_string(),
            }));
        }
        if strict && rec_names != names.iter().map(|n| n.to_string()).collect::<Vec<_>>() {
            return Err(mismatch(format!(
                "the record covers parameters {rec_names:?} in another order than {names:?}"
            )));
        }
        let group_of = self.inner.group_of().to_vec();
        let mut per_param = Vec::new();
        for p in record.params {
            let Some(i) = names.iter().position(|n| *n == p.name) else { continue };
            let hyper = groups
                .iter()
                .find(|(gi, ..)| *gi == group_of[i])
                .map_or_else(|| self.inner.groups()[group_of[i]].hyper.clone(), |(_, _, h, _)| h.clone());
            let (step, buffers, _) = self.check_param(i, p, &hyper, false)?;
            per_param.push((i, step, buffers));
        }
        Ok(CheckedPartial {
            lr: record.lr,
            groups,
            steps: record.steps,
            skipped: record.skipped,
            per_param,
            missing: [missing, missing_groups].concat(),
            unexpected: [unexpected, unexpected_groups].concat(),
        })
    }

    /// Applies a state checked by [`Self::check_state_only`]; returns the missing and
    /// unexpected keys.
    pub(crate) fn apply_state_only(&mut self, checked: CheckedPartial) -> Result<(Vec<String>, Vec<String>)> {
        self.inner.set_default_lr(checked.lr);
        self.inner.restore_groups(checked.groups);
        self.inner.restore_params(checked.per_param);
        self.steps = checked.steps;
        self.skipped = checked.skipped;
        self.state_changed();
        self.reset_transient()?;
        Ok((checked.missing, checked.unexpected))
    }

    /// Sets the fp32 masters of the parameters named in `values` (fp32 tensors on the
    /// parameters' device, already checked) and leaves the others.
    pub(crate) fn set_masters(&mut self, values: &BTreeMap<String, Tensor>) -> Result<()> {
        self.state_changed();
        let _no_grad = tch::no_grad_guard();
        for e in &self.entries {
            if let (Some(m), Some(v)) = (e.master(), values.get(e.name())) {
                let mut m = m.shallow_clone();
                m.f_copy_(v).ctx("restoring a master weight")?;
            }
        }
        Ok(())
    }
}

impl AmpOptimizer {
    /// Per parameter, in [`Self::param_names`] order, what mapping torch.optim's state dicts
    /// needs (`crate::torch_checkpoint`): its tch parameter group, its parameter group's
    /// position, its place in the VarStore's creation order, whether it has an fp32 master and
    /// the dtype it is updated in.
    pub(crate) fn param_layout(&self) -> Vec<ParamLayout> {
        // A sharded optimizer's parameters as their owners hold them (with a master there).
        self.entries
            .iter()
            .zip(self.inner.group_of())
            .enumerate()
            .map(|(i, (e, &slot))| {
                let kind = self.target_kind(i);
                ParamLayout { group: e.group(), slot, order: e.order(), has_master: kind != e.model().kind(), kind }
            })
            .collect()
    }

    /// The state tensors parameter `i` keeps in a group with hyper-parameters `hyper`, by
    /// name: (name, dtype, shape), sorted by name.
    pub(crate) fn state_layout(&self, i: usize, hyper: &HyperParams) -> Vec<(String, Kind, Vec<i64>)> {
        let (kind, size) = (self.target_kind(i), self.entries[i].model().size());
        let mut specs = self.inner.rule().state_spec(hyper);
        specs.sort_by(|a, b| a.name().cmp(b.name()));
        specs
            .iter()
            .map(|s| {
                let (kind, shape) = self.inner.stored_state(s, kind, &size);
                (s.name().to_string(), kind, shape)
            })
            .collect()
    }
}

/// One parameter of an optimizer as [`AmpOptimizer::param_layout`] describes it.
#[derive(Debug, Clone)]
pub(crate) struct ParamLayout {
    /// Its tch parameter group (`Path::set_group`).
    pub(crate) group: usize,
    /// The position of its parameter group in [`AmpOptimizer::param_groups`].
    pub(crate) slot: usize,
    pub(crate) order: usize,
    pub(crate) has_master: bool,
    /// The dtype it is updated in (the master's, or the variable's).
    pub(crate) kind: Kind,
}

/// A record checked against an optimizer, its tensors on the parameters' device.
#[derive(Debug)]
pub(crate) struct CheckedRecord {
    lr: f64,
    groups: Vec<(f64, HyperParams, u64)>,
    steps: u64,
    skipped: u64,
    per_param: Vec<(u64, ParamStateBuffers, Option<Tensor>)>,
}

/// An optimizer state (no masters) checked against an optimizer, matched by name.
#[derive(Debug)]
pub(crate) struct CheckedPartial {
    lr: f64,
    groups: Vec<(usize, f64, HyperParams, u64)>,
    steps: u64,
    skipped: u64,
    per_param: Vec<(usize, u64, ParamStateBuffers)>,
    missing: Vec<String>,
    unexpected: Vec<String>,
}

/// `v` checked against `shape` and `kind`, finite, moved to `like`'s device.
fn checked_tensor(what: &str, v: Tensor, shape: &[i64], like: &Tensor, kind: Kind) -> Result<Tensor> {
    if v.size() != shape || v.kind() != kind {
        return Err(mismatch(format!("{what}: {:?} {:?}, expected {kind:?} {shape:?}", v.kind(), v.size())));
    }
    crate::counters::note_host_read();
    let finite = v.f_isfinite().and_then(|f| f.f_all()).and_then(|a| a.f_int64_value(&[])).ctx("checking a state")?;
    if finite == 0 {
        return Err(mismatch(format!("{what}: holds inf or NaN")));
    }
    v.f_to_device(like.device()).ctx("moving a state to the parameter's device")
}
