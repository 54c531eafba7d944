//! What an optimizer saves and restores: [`OptimizerRecord`], produced by
//! [`crate::AmpOptimizer::to_record`] and consumed (checked in full first) by
//! [`crate::AmpOptimizer::load_record`]. Checkpoint code moves records; it never reaches into
//! an optimizer's state.
//!
//! The record is the one persistent form of an optimizer, shaped like torch.optim's
//! `state_dict()`:
//!
//! | torch.optim `state_dict()` | [`OptimizerRecord`] |
//! |---|---|
//! | `param_groups[i]` | `groups[i]` ([`GroupRecord`]) |
//! | `param_groups[i]["lr"]` | `groups[i].lr` |
//! | `param_groups[i]["momentum"]`, `["weight_decay"]`, `["eps"]`, ... | `groups[i].hyper_parameters["momentum"]`, ... |
//! | `param_groups[i]["betas"] = (b1, b2)` | `groups[i].hyper_parameters["beta1"]`, `["beta2"]` |
//! | `param_groups[i]["step"]` (Apex's fused optimizers) | `groups[i].step` |
//! | `param_groups[i]["params"]` (indices) | `groups[i].params` (VarStore names) |
//! | `state[k]` (k: position over all groups' `params`, in order) | `params[k]` ([`ParamRecord`]; same order) |
//! | `state[k]["step"]` | `params[k].step` |
//! | `state[k]["exp_avg"]`, `["momentum_buffer"]`, ... | `params[k].buffers["exp_avg"]`, ... |
//! | (the optimizer's constructor arguments) | `kind`, `hyper_parameters`, `lr` |
//!
//! `params` is in the optimizer's order ([`crate::AmpOptimizer::param_names`]): group by group,
//! each group's parameters in its order, so the k-th parameter of torch's flattened
//! `param_groups` is `params[k]` when the groups were built alike. Flags (`nesterov`,
//! `amsgrad`, ...) are 0.0 or 1.0. Besides torch's fields it holds the fp32 master value of
//! each parameter that has one (O2), and the step and skip counters of
//! [`crate::AmpOptimizer::step_counts`].
use crate::error::StateError;
use std::collections::BTreeMap;

use tch::Tensor;

use crate::error::{AmpError, Result, TorchContext};

/// The built-in rules whose state holds second moments (or sums of squares), and the names of
/// those buffers: never negative in a state the rule produced.
const SECOND_MOMENTS: &[(&str, &[&str])] = &[
    ("adam", &["exp_avg_sq", "max_exp_avg_sq"]),
    ("adamw", &["exp_avg_sq", "max_exp_avg_sq"]),
    ("rmsprop", &["square_avg"]),
    ("fused_adam", &["exp_avg_sq"]),
    ("fused_lamb", &["exp_avg_sq"]),
    ("fused_novograd", &["exp_avg_sq"]),
    ("fused_adagrad", &["sum"]),
];

/// An optimizer's persistent state (see the module docs for the correspondence with
/// torch.optim's `state_dict()`).
#[derive(Debug)]
pub struct OptimizerRecord {
    /// The rule's kind: `"sgd"`, `"adam"`, `"adamw"`, `"rmsprop"`, `"fused_sgd"`,
    /// `"fused_adam"`, `"fused_lamb"`, `"fused_novograd"`, `"fused_adagrad"`, or a user
    /// rule's [`crate::UpdateRule::kind`].
    pub kind: String,
    /// The optimizer's default hyper-parameters besides the learning rate
    /// ([`crate::OptimizerConfig::hyper_parameters`], [`crate::UpdateRule::defaults`]); a
    /// record loads only into an optimizer with the same values, bit for bit.
    pub hyper_parameters: BTreeMap<String, f64>,
    /// The optimizer's default learning rate (of groups that do not set their own, and of
    /// groups added later).
    pub lr: f64,
    /// Learning rates by group id, of the groups whose rate differs from `lr` (the form of
    /// tch-amp before parameter groups had hyper-parameters). Loading uses it only when
    /// `groups` is empty; with `groups` it is informational.
    pub group_lr: BTreeMap<usize, f64>,
    /// torch.optim's `param_groups`, in order. Empty in records made by hand in the older
    /// form: then `lr` and `group_lr` set the learning rates and the groups keep their
    /// hyper-parameters.
    pub groups: Vec<GroupRecord>,
    /// Steps taken so far.
    pub steps: u64,
    /// Steps skipped after an overflow so far.
    pub skipped: u64,
    /// One record per parameter, in the optimizer's order ([`crate::AmpOptimizer::param_names`]).
    pub params: Vec<ParamRecord>,
}

impl OptimizerRecord {
    /// Checks for state that would poison the next step, which finite-value checks miss: a negative
    /// second moment (`exp_avg_sq`, `max_exp_avg_sq`, `square_avg`, Adagrad's `sum`) of a built-in
    /// rule, whose square root is NaN; a learning rate or hyper-parameter that is not finite, or
    /// finite in f64 but inf in fp32 (`1e308`), or non-zero in f64 but 0 in fp32 (`5e-324`):
    /// updates are computed in fp32. Every loader calls it before applying anything
    /// ([`crate::AmpOptimizer::load_record`], [`crate::load_checkpoint`],
    /// [`crate::load_torch_checkpoint`]). Step counts are unsigned, so never negative here.
    ///
    /// # Errors
    /// [`StateError::PoisonedState`] naming the parameter and buffer, or the hyper-parameter.
    pub fn validate(&self) -> Result<()> {
        check_hyper("lr", self.lr)?;
        for (name, &v) in &self.hyper_parameters {
            check_hyper(name, v)?;
        }
        for (id, &lr) in &self.group_lr {
            check_hyper(&format!("group {id} lr"), lr)?;
        }
        for g in &self.groups {
            check_hyper(&format!("group {} lr", g.id), g.lr)?;
            for (name, &v) in &g.hyper_parameters {
                check_hyper(&format!("group {} {name}", g.id), v)?;
            }
        }
        let second: &[&str] = SECOND_MOMENTS.iter().find(|(k, _)| *k == self.kind).map_or(&[], |(_, n)| n);
        for p in &self.params {
            for (buf, t) in &p.buffers {
                if !second.contains(&buf.as_str()) || t.numel() == 0 {
                    continue;
                }
                // NaN compares false too: refused here as well.
                let ok = t
                    .f_ge(0.0)
                    .and_then(|m| m.f_all())
                    .and_then(|a| a.f_int64_value(&[]))
                    .ctx("checking optimizer state")?;
                if ok == 0 {
                    let min = t.f_min().and_then(|m| m.f_double_value(&[])).ctx("checking optimizer state")?;
                    return Err(AmpError::State(StateError::PoisonedState {
                        param: format!("{} {buf}", p.name),
                        message: format!(
                            "a second moment holds {min} (it is never negative or NaN; its square root would be NaN)"
                        ),
                    }));
                }
            }
        }
        Ok(())
    }
}

/// A hyper-parameter that fp32 arithmetic can use as the f64 value means it.
fn check_hyper(name: &str, v: f64) -> Result<()> {
    let f = v as f32;
    let message = if !v.is_finite() {
        format!("{v:e} is not finite")
    } else if f.is_infinite() {
        format!("{v:e} is finite in f64 but inf in fp32, where the update is computed")
    } else if v != 0.0 && f == 0.0 {
        format!("{v:e} is non-zero in f64 but 0 in fp32, where the update is computed")
    } else {
        return Ok(());
    };
    Err(AmpError::State(StateError::PoisonedState { param: name.to_string(), message }))
}

/// One parameter group's persistent state (torch.optim's `param_groups[i]`).
#[derive(Debug, Clone, PartialEq)]
pub struct GroupRecord {
    /// The group's id ([`crate::AmpOptimizer::param_groups`]): the tch group
    /// (`Path::set_group`) of optimizers built from a VarStore's groups, else the group's
    /// position.
    pub id: usize,
    /// Its learning rate.
    pub lr: f64,
    /// Every hyper-parameter of the optimizer (the keys of `hyper_parameters`), with this
    /// group's values.
    pub hyper_parameters: BTreeMap<String, f64>,
    /// Steps of this group (Apex's fused optimizers' `group["step"]`).
    pub step: u64,
    /// Its parameters' VarStore names, in the optimizer's order.
    pub params: Vec<String>,
}

/// One parameter's persistent state.
#[derive(Debug)]
pub struct ParamRecord {
    /// The VarStore name.
    pub name: String,
    /// Updates applied to this parameter.
    pub step: u64,
    /// The optimizer's state tensors for it (`"exp_avg"`, `"momentum_buffer"`, ...): none
    /// before its first update, all of its rule's ([`crate::UpdateRule::state_spec`]) after.
    pub buffers: BTreeMap<String, Tensor>,
    /// The fp32 master value, for a parameter with a master (O2's fp16 variables).
    pub master: Option<Tensor>,
}
