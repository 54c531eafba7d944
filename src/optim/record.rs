//! What an optimizer saves and restores: [`OptimizerRecord`], produced by
//! [`crate::AmpOptimizer::to_record`] and consumed (checked in full first) by
//! [`crate::AmpOptimizer::load_record`]. Checkpoint code moves records; it never reaches into
//! an optimizer's state.
use std::collections::BTreeMap;

use tch::Tensor;

/// An optimizer's persistent state.
#[derive(Debug)]
pub struct OptimizerRecord {
    /// The optimizer's kind: `"sgd"`, `"adam"`, `"adamw"` or `"rmsprop"`.
    pub kind: String,
    /// The hyper-parameters besides the learning rate
    /// ([`crate::OptimizerConfig::hyper_parameters`]); a record loads only into an optimizer
    /// with the same values.
    pub hyper_parameters: BTreeMap<String, f64>,
    /// Learning rate of the parameter groups without their own.
    pub lr: f64,
    /// Per-group learning rates, by tch parameter group.
    pub group_lr: BTreeMap<usize, f64>,
    /// Steps taken so far.
    pub steps: u64,
    /// Steps skipped after an overflow so far.
    pub skipped: u64,
    /// One record per parameter, in the optimizer's order ([`crate::AmpOptimizer::param_names`]).
    pub params: Vec<ParamRecord>,
}

/// One parameter's persistent state.
#[derive(Debug)]
pub struct ParamRecord {
    /// The VarStore name.
    pub name: String,
    /// Updates applied to this parameter.
    pub step: u64,
    /// The optimizer's buffers for it (`"exp_avg"`, `"momentum_buffer"`, ...): none before its
    /// first update, all of the optimizer's after.
    pub buffers: BTreeMap<String, Tensor>,
    /// The fp32 master value, for a parameter with a master (O2's fp16 variables).
    pub master: Option<Tensor>,
}
