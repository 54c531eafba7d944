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
use std::collections::BTreeMap;

use tch::Tensor;

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
