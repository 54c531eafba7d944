//! torch.optim's and Apex's `optimizer.state_dict()` and tch-amp's [`OptimizerRecord`], both
//! ways, in one place.
//!
//! The layout (torch 2.13; `apex.optimizers` at e13873de; older torch versions lack some group
//! keys, whose defaults are then used): `{'state': {index: {'step': tensor(7.), 'exp_avg': ...,
//! ...}, ...}, 'param_groups': [{'lr': .., <hyper-parameters>, [implementation flags],
//! ['param_names': [...]], 'params': [index, ...]}, ...]}`. An index is a parameter's position
//! in the groups' `params` lists read one after the other; [`TorchParamOrder`] says which
//! VarStore name each position is. Apex's optimizers count `step` per group (an int, written
//! after the first step), not per parameter, and read some options from the optimizer object
//! rather than its groups (`adam_w_mode`, LAMB's `use_nvlamb` and `max_grad_norm`, ...): those
//! are not in the file, and the optimizer keeps its own. FusedNovoGrad keeps its per-tensor
//! norms in the group (`exp_avg_sq`: one vector for the group's fp16 parameters, one for its
//! fp32 ones).
//!
//! Every group of the file gives its `lr` and hyper-parameters to the parameter groups of the
//! optimizer its parameters are in, as torch's `load_state_dict` does; two file groups that give
//! one parameter group different values are refused.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use tch::{nn, Device, Kind, Tensor};

use super::error::bad_value;
use crate::error::{AmpError, ConfigError, Result, StateError};

use super::options::TorchParamOrder;
use crate::dtype::is_floating;
use crate::error::TorchContext;
use crate::optim::amp_optimizer::ParamLayout;
use crate::optim::apex::{FusedAdagrad, FusedAdam, FusedLamb, FusedNovoGrad, FusedSgd, NovoGradNorm};
use crate::optim::{AmpOptimizer, GroupRecord, OptimizerConfig, OptimizerRecord, ParamRecord};
use crate::torch_io::{Dict, Key, Node, Value};

/// torch.optim's step counter saturates where its fp32 `step` tensor stops counting.
const TORCH_STEP_LIMIT: u64 = 1 << 24;

/// How one key of a param group is read and written.
#[derive(Debug, Clone, Copy)]
enum Slot {
    /// A number (tch-amp's hyper-parameter of the same name), with the class's default for a
    /// file that lacks it.
    Num(f64),
    /// A bool (0.0 or 1.0 in tch-amp).
    Flag(bool),
    /// An int (FusedNovoGrad's `norm_type`).
    Int(i64),
    /// `betas`: tch-amp's `beta1` and `beta2`.
    Betas(f64, f64),
    /// A number Apex writes into every group but reads from the optimizer (FusedLAMB's
    /// `max_grad_norm`): the optimizer keeps its own value.
    Wide,
    /// An implementation flag torch writes as `None` (not compared on load).
    NoneFlag,
    /// An implementation flag torch writes as `False` (not compared on load).
    FalseFlag,
    /// torch's `fused`: `None`, or `True` for the fused Adam kernel.
    Fused,
    /// torch's `decoupled_weight_decay` (Adam: False, AdamW: True).
    Decoupled(bool),
}
use Slot::{Betas, Decoupled, FalseFlag, Flag, Fused, Int, NoneFlag, Num, Wide};

/// One optimizer class as its state dict holds it.
struct Class {
    /// tch-amp's kind ([`OptimizerConfig::name`]).
    kind: &'static str,
    /// The class's name, for messages.
    name: &'static str,
    /// The group keys after `lr`, in the order the class writes them.
    keys: &'static [(&'static str, Slot)],
    /// Apex: `step` counts the group's steps (an int); no parameter has its own.
    group_step: bool,
    /// torch: each parameter's state has a `step` tensor (all of torch's classes but SGD).
    param_step: bool,
}

const SGD: Class = Class {
    kind: "sgd",
    name: "torch.optim.SGD",
    keys: &[
        ("momentum", Num(0.0)),
        ("dampening", Num(0.0)),
        ("weight_decay", Num(0.0)),
        ("nesterov", Flag(false)),
        ("maximize", Flag(false)),
        ("foreach", NoneFlag),
        ("differentiable", FalseFlag),
        ("fused", NoneFlag),
    ],
    group_step: false,
    param_step: false,
};
const ADAM: Class = Class {
    kind: "adam",
    name: "torch.optim.Adam",
    keys: &[
        ("betas", Betas(0.9, 0.999)),
        ("eps", Num(1e-8)),
        ("weight_decay", Num(0.0)),
        ("amsgrad", Flag(false)),
        ("maximize", Flag(false)),
        ("foreach", NoneFlag),
        ("capturable", FalseFlag),
        ("differentiable", FalseFlag),
        ("fused", Fused),
        ("decoupled_weight_decay", Decoupled(false)),
    ],
    group_step: false,
    param_step: true,
};
const ADAMW: Class = Class {
    kind: "adamw",
    name: "torch.optim.AdamW",
    keys: &[
        ("betas", Betas(0.9, 0.999)),
        ("eps", Num(1e-8)),
        ("weight_decay", Num(1e-2)),
        ("amsgrad", Flag(false)),
        ("maximize", Flag(false)),
        ("foreach", NoneFlag),
        ("capturable", FalseFlag),
        ("differentiable", FalseFlag),
        ("fused", Fused),
        ("decoupled_weight_decay", Decoupled(true)),
    ],
    group_step: false,
    param_step: true,
};
const RMSPROP: Class = Class {
    kind: "rmsprop",
    name: "torch.optim.RMSprop",
    keys: &[
        ("momentum", Num(0.0)),
        ("alpha", Num(0.99)),
        ("eps", Num(1e-8)),
        ("centered", Flag(false)),
        ("weight_decay", Num(0.0)),
        ("capturable", FalseFlag),
        ("foreach", NoneFlag),
        ("maximize", Flag(false)),
        ("differentiable", FalseFlag),
    ],
    group_step: false,
    param_step: true,
};
const FUSED_SGD: Class = Class {
    kind: "fused_sgd",
    name: "apex.optimizers.FusedSGD",
    keys: &[("momentum", Num(0.0)), ("dampening", Num(0.0)), ("weight_decay", Num(0.0)), ("nesterov", Flag(false))],
    group_step: false,
    param_step: false,
};
const FUSED_ADAM: Class = Class {
    kind: "fused_adam",
    name: "apex.optimizers.FusedAdam",
    keys: &[
        ("bias_correction", Flag(true)),
        ("betas", Betas(0.9, 0.999)),
        ("eps", Num(1e-8)),
        ("weight_decay", Num(0.0)),
    ],
    group_step: true,
    param_step: false,
};
const FUSED_LAMB: Class = Class {
    kind: "fused_lamb",
    name: "apex.optimizers.FusedLAMB",
    keys: &[
        ("bias_correction", Flag(true)),
        ("betas", Betas(0.9, 0.999)),
        ("eps", Num(1e-6)),
        ("weight_decay", Num(0.01)),
        ("grad_averaging", Flag(true)),
        ("max_grad_norm", Wide),
    ],
    group_step: true,
    param_step: false,
};
const FUSED_NOVOGRAD: Class = Class {
    kind: "fused_novograd",
    name: "apex.optimizers.FusedNovoGrad",
    keys: &[
        ("bias_correction", Flag(true)),
        ("betas", Betas(0.9, 0.999)),
        ("eps", Num(1e-8)),
        ("weight_decay", Num(0.0)),
        ("grad_averaging", Flag(true)),
        ("norm_type", Int(2)),
        ("init_zero", Flag(false)),
    ],
    group_step: true,
    param_step: false,
};
const FUSED_ADAGRAD: Class = Class {
    kind: "fused_adagrad",
    name: "apex.optimizers.FusedAdagrad",
    keys: &[("eps", Num(1e-10)), ("weight_decay", Num(0.0))],
    group_step: false,
    param_step: false,
};

const CLASSES: [&Class; 9] =
    [&SGD, &ADAM, &ADAMW, &RMSPROP, &FUSED_SGD, &FUSED_ADAM, &FUSED_LAMB, &FUSED_NOVOGRAD, &FUSED_ADAGRAD];

/// FusedNovoGrad's group key holding the norms.
const NOVOGRAD_NORMS: &str = "exp_avg_sq";

/// The class of tch-amp's `kind`, or the typed error for an optimizer without a torch form.
fn class_of(kind: &str, optimizer: usize) -> Result<&'static Class> {
    CLASSES
        .iter()
        .copied()
        .find(|c| c.kind == kind)
        .ok_or_else(|| AmpError::Config(ConfigError::NoTorchForm { optimizer, kind: kind.to_string() }))
}

/// The optimizer class a param group's keys describe.
#[derive(Debug, Clone, Copy, PartialEq)]
enum FileKind {
    /// torch.optim.SGD or Apex's FusedSGD (the same state; FusedSGD is documented as SGD).
    Sgd,
    Adam,
    AdamW,
    /// `betas` without `decoupled_weight_decay` (torch before 2.6): Adam or AdamW.
    AdamFamily,
    RmsProp,
    FusedAdam,
    FusedLamb,
    FusedNovoGrad,
    FusedAdagrad,
}

impl FileKind {
    fn of(group: &Node<'_>) -> Result<Self> {
        let has = |k: &str| group.get_opt(k).map(|n| n.is_some());
        if has("max_grad_norm")? {
            return Ok(FileKind::FusedLamb);
        }
        if has("norm_type")? {
            return Ok(FileKind::FusedNovoGrad);
        }
        if has("betas")? {
            if has("bias_correction")? {
                return Ok(FileKind::FusedAdam);
            }
            return Ok(match group.get_opt("decoupled_weight_decay")? {
                Some(n) if n.as_bool()? => FileKind::AdamW,
                Some(_) => FileKind::Adam,
                None => FileKind::AdamFamily,
            });
        }
        if has("alpha")? {
            return Ok(FileKind::RmsProp);
        }
        if has("nesterov")? || has("dampening")? {
            return Ok(FileKind::Sgd);
        }
        if has("eps")? && !has("lr_decay")? && !has("initial_accumulator_value")? {
            return Ok(FileKind::FusedAdagrad);
        }
        Err(bad_value(
            group.path(),
            "a param group of none of the optimizers tch-amp maps (torch.optim's SGD, Adam, AdamW and \
                      RMSprop; apex.optimizers' FusedSGD, FusedAdam, FusedLAMB, FusedNovoGrad and FusedAdagrad)",
        ))
    }

    fn name(self) -> &'static str {
        match self {
            FileKind::Sgd => "SGD",
            FileKind::Adam => "Adam",
            FileKind::AdamW => "AdamW",
            FileKind::AdamFamily => "Adam or AdamW",
            FileKind::RmsProp => "RMSprop",
            FileKind::FusedAdam => "FusedAdam",
            FileKind::FusedLamb => "FusedLAMB",
            FileKind::FusedNovoGrad => "FusedNovoGrad",
            FileKind::FusedAdagrad => "FusedAdagrad",
        }
    }

    fn matches(self, ours: &str) -> bool {
        matches!(
            (self, ours),
            (FileKind::Sgd, "sgd" | "fused_sgd")
                | (FileKind::Adam, "adam")
                | (FileKind::AdamW, "adamw")
                | (FileKind::AdamFamily, "adam" | "adamw")
                | (FileKind::RmsProp, "rmsprop")
                | (FileKind::FusedAdam, "fused_adam")
                | (FileKind::FusedLamb, "fused_lamb")
                | (FileKind::FusedNovoGrad, "fused_novograd")
                | (FileKind::FusedAdagrad, "fused_adagrad")
        )
    }
}

/// A number: a float, an int, or a one-element tensor (torch 2.x accepts `lr=torch.tensor(..)`).
fn number(n: &Node<'_>) -> Result<f64> {
    match n.value() {
        Value::Tensor(t) if t.numel() == 1 => {
            Ok(t.f_reshape([]).and_then(|t| t.f_double_value(&[])).ctx("reading a number held in a tensor")?)
        }
        _ => Ok(n.as_f64()?),
    }
}

/// A flag: a bool, or an int 0 / 1 (Apex's options are often passed as ints).
fn flag(n: &Node<'_>) -> Result<bool> {
    match n.value() {
        Value::Int(0) => Ok(false),
        Value::Int(1) => Ok(true),
        _ => Ok(n.as_bool()?),
    }
}

/// One value a file group gives: tch-amp's name, the value, the torch key it came from.
struct GroupValue {
    ours: &'static str,
    value: f64,
    torch: &'static str,
}

/// The hyper-parameters of param group `g` for `class` (missing keys: the class's defaults),
/// and the optimizer-wide ones the file holds (FusedLAMB's `max_grad_norm`).
fn group_values(g: &Node<'_>, class: &Class) -> Result<(Vec<GroupValue>, Vec<GroupValue>)> {
    let mut values = Vec::new();
    let mut wide = Vec::new();
    for &(key, slot) in class.keys {
        let node = g.get_opt(key)?;
        match (slot, node) {
            (Num(d), n) => values.push(GroupValue { ours: key, value: n.map_or(Ok(d), |n| number(&n))?, torch: key }),
            (Flag(d), n) => {
                let on = n.map_or(Ok(d), |n| flag(&n))?;
                values.push(GroupValue { ours: key, value: f64::from(u8::from(on)), torch: key });
            }
            (Int(d), n) => {
                let v = match n {
                    None => d as f64,
                    Some(n) => match n.value() {
                        Value::Int(i) => *i as f64,
                        _ => number(&n)?,
                    },
                };
                values.push(GroupValue { ours: key, value: v, torch: key });
            }
            (Betas(b1, b2), n) => {
                let (b1, b2) = match n {
                    None => (b1, b2),
                    Some(betas) => {
                        let b = betas.elements()?;
                        if b.len() != 2 {
                            return Err(bad_value(betas.path(), format!("{} betas, expected 2", b.len())));
                        }
                        (number(&b[0])?, number(&b[1])?)
                    }
                };
                values.push(GroupValue { ours: "beta1", value: b1, torch: key });
                values.push(GroupValue { ours: "beta2", value: b2, torch: key });
            }
            (Wide, Some(n)) => wide.push(GroupValue { ours: key, value: number(&n)?, torch: key }),
            _ => {}
        }
    }
    Ok((values, wide))
}

/// A value as Python shows it (`True` for a flag).
fn show(name: &str, v: f64) -> String {
    let is_flag = [
        "nesterov",
        "maximize",
        "amsgrad",
        "centered",
        "bias_correction",
        "grad_averaging",
        "init_zero",
        "adam_w_mode",
        "use_nvlamb",
    ]
    .contains(&name);
    match (is_flag, v) {
        (true, 0.0) => "False".into(),
        (true, _) => "True".into(),
        _ => format!("{v:?}"),
    }
}

/// torch's parameter indices of each param group.
fn group_ids(groups: &[Node<'_>]) -> Result<Vec<Vec<i64>>> {
    groups.iter().map(|g| g.get("params")?.elements()?.iter().map(|n| Ok(n.as_i64()?)).collect()).collect()
}

/// The order to save `optimizer`'s parameters in when the caller gives none: one torch param
/// group per parameter group of the optimizer ([`AmpOptimizer::param_groups`], in that order),
/// each group's parameters in the VarStore's creation order with each module's weight before its
/// bias (tch's linear and convolution layers create the bias first, torch's register the weight
/// first). That is `model.parameters()`'s order in Python, filtered into the groups, when the Rust
/// model creates its layers in the order the Python module registers them (define the layers in
/// the same order as the Python `__init__`).
pub fn default_param_order(optimizer: &AmpOptimizer) -> TorchParamOrder {
    let layout = optimizer.param_layout();
    let names = optimizer.param_names();
    let slots = optimizer.param_groups().len();
    (0..slots)
        .map(|slot| {
            let mut members: Vec<(usize, &str)> =
                layout.iter().zip(&names).filter(|(l, _)| l.slot == slot).map(|(l, n)| (l.order, *n)).collect();
            members.sort_by_key(|&(order, name)| (order, name.to_string()));
            crate::optim::torch_param_order(members.into_iter().map(|(_, n)| n.to_string()).collect())
        })
        .collect()
}

/// Checks that `order` has the file's group sizes and names each of the optimizer's
/// parameters once.
fn check_order(order: &TorchParamOrder, sizes: &[usize], optimizer: &AmpOptimizer, index: usize) -> Result<()> {
    let err = |reason: String| AmpError::State(StateError::ParamOrder { optimizer: index, reason });
    let got: Vec<usize> = order.iter().map(Vec::len).collect();
    if got != sizes {
        return Err(err(format!("the order gives groups of {got:?} parameters, the file's groups have {sizes:?}")));
    }
    let ours: BTreeSet<&str> = optimizer.param_names().into_iter().collect();
    let mut seen = BTreeSet::new();
    for name in order.iter().flatten() {
        if !ours.contains(name.as_str()) {
            return Err(err(format!("{name} is not a parameter of the optimizer")));
        }
        if !seen.insert(name.as_str()) {
            return Err(err(format!("{name} appears twice")));
        }
    }
    if seen.len() != ours.len() {
        let left: Vec<&str> = ours.difference(&seen).copied().collect();
        return Err(err(format!("the order leaves out the parameters {left:?}")));
    }
    Ok(())
}

/// Which VarStore name each index of torch's optimizer state dict `node` is, in this order
/// of preference: `explicit` (checked); the file's `param_names` (torch >= 2.6 writes them for
/// optimizers made from `named_parameters()`; `prefix` stripped); else `model_order`, the
/// model state dict's order (the order of `model.parameters()` in Python), accepted only when it
/// is not a guess: every parameter of the optimizer is in the model state dict, and either the
/// file's groups have the sizes of the optimizer's parameter groups (group `i` is then the
/// optimizer's group `i`, its parameters in model order), or cutting the model order into the
/// file's group sizes puts each file group into one tch parameter group and no two into the same.
///
/// # Errors
/// [`StateError::ParamCount`](crate::error::StateError::ParamCount) when the file's groups hold another number of parameters than the
/// optimizer; [`StateError::ParamOrder`](crate::error::StateError::ParamOrder) when the order is ambiguous or does not fit.
pub(super) fn resolve_order(
    node: &Node<'_>,
    optimizer: &AmpOptimizer,
    index: usize,
    explicit: Option<&TorchParamOrder>,
    model_order: &[String],
    prefix: Option<&str>,
) -> Result<TorchParamOrder> {
    let groups = node.get("param_groups")?.elements()?;
    let sizes: Vec<usize> = group_ids(&groups)?.iter().map(Vec::len).collect();
    let total: usize = sizes.iter().sum();
    let names = optimizer.param_names();
    if total != names.len() {
        return Err(AmpError::State(StateError::ParamCount {
            optimizer: index,
            path: node.path(),
            in_file: total,
            in_optimizer: names.len(),
        }));
    }
    if let Some(order) = explicit {
        check_order(order, &sizes, optimizer, index)?;
        return Ok(order.clone());
    }
    let named: Vec<Option<Node<'_>>> = groups.iter().map(|g| g.get_opt("param_names")).collect::<Result<_, _>>()?;
    if !named.is_empty() && named.iter().all(Option::is_some) {
        let order: TorchParamOrder = named
            .iter()
            .flatten()
            .map(|n| {
                n.elements()?
                    .iter()
                    .map(|s| Ok(super::model::strip(s.as_str()?, prefix).to_string()))
                    .collect::<Result<Vec<String>>>()
            })
            .collect::<Result<_>>()?;
        check_order(&order, &sizes, optimizer, index).map_err(|e| match e {
            AmpError::State(StateError::ParamOrder { optimizer, reason }) => AmpError::State(StateError::ParamOrder {
                optimizer,
                reason: format!("the file's param_names: {reason}"),
            }),
            other => other,
        })?;
        return Ok(order);
    }
    order_from_model(optimizer, index, model_order, &sizes)
}

/// The order of a file without `param_names`: the model's parameter order (what
/// `model.parameters()` gives, as the model state dict lists it), grouped as the optimizer's
/// groups when their sizes are the file's, else cut into the file's group sizes, each cut
/// within one tch group.
fn order_from_model(
    optimizer: &AmpOptimizer,
    index: usize,
    model_order: &[String],
    sizes: &[usize],
) -> Result<TorchParamOrder> {
    let names = optimizer.param_names();
    let ours: BTreeSet<&str> = names.iter().copied().collect();
    let in_model: Vec<&String> = model_order.iter().filter(|n| ours.contains(n.as_str())).collect();
    if in_model.len() != names.len() {
        let listed: BTreeSet<&str> = in_model.iter().map(|s| s.as_str()).collect();
        let absent: Vec<&str> = names.iter().copied().filter(|n| !listed.contains(n)).take(5).collect();
        return Err(AmpError::State(StateError::ParamOrder {
            optimizer: index,
            reason: format!(
                "the file has no param_names and the parameters {absent:?} are not in the model state dict, whose \
                 order is model.parameters()'s"
            ),
        }));
    }
    let layout = optimizer.param_layout();
    // The optimizer's groups, each in model order.
    let slot_of: HashMap<&str, usize> = names.iter().copied().zip(layout.iter().map(|l| l.slot)).collect();
    let slots = optimizer.param_groups().len();
    if sizes.len() == slots {
        let by_slot: TorchParamOrder = (0..slots)
            .map(|s| in_model.iter().filter(|n| slot_of[n.as_str()] == s).map(|n| n.to_string()).collect())
            .collect();
        if by_slot.iter().map(Vec::len).eq(sizes.iter().copied()) {
            return Ok(by_slot);
        }
    }
    // The model order cut into the file's group sizes, each cut within one tch group.
    let mut order = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for &n in sizes {
        order.push(in_model[at..at + n].iter().map(|s| s.to_string()).collect::<Vec<String>>());
        at += n;
    }
    if order.len() > 1 {
        let group_of: HashMap<&str, usize> = names.iter().copied().zip(layout.iter().map(|l| l.group)).collect();
        let mut taken: BTreeMap<usize, usize> = BTreeMap::new();
        for (i, g) in order.iter().enumerate() {
            let tch: BTreeSet<usize> = g.iter().map(|n| group_of[n.as_str()]).collect();
            let single = tch.len() == 1;
            let first = tch.iter().next().copied().unwrap_or(0);
            if !single || taken.insert(first, i).is_some() {
                return Err(AmpError::State(StateError::ParamOrder {
                    optimizer: index,
                    reason: format!(
                        "the file has {} param groups of {sizes:?} parameters and no param_names; the optimizer's \
                         {slots} parameter groups do not have those sizes, and cutting the model's parameter order \
                         into them gives groups that do not line up with its tch parameter groups (group {i} \
                         would be {g:?}), so the Python script built its groups in another way",
                        order.len()
                    ),
                }));
            }
        }
    }
    Ok(order)
}

/// An optimizer state dict read into a record.
pub(super) struct LoadedRecord {
    pub(super) record: OptimizerRecord,
    pub(super) converted: Vec<(String, Kind, Kind)>,
    pub(super) ignored_keys: Vec<String>,
}

/// A non-negative integral `step`, as an int, a float or a one-element tensor (torch 2.x).
fn read_step(n: &Node<'_>) -> Result<u64> {
    let v = match n.value() {
        Value::Int(i) => *i as f64,
        _ => number(n)?,
    };
    if !(v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= 9_007_199_254_740_992.0) {
        return Err(bad_value(n.path(), format!("step {v} is not a count (an integer >= 0)")));
    }
    Ok(v as u64)
}

/// What one file group gives a parameter group of the optimizer.
struct Given {
    /// The file group (its path, for messages).
    path: String,
    lr: f64,
    values: Vec<(&'static str, f64, &'static str)>,
    /// Apex's group step (0 for torch's classes).
    step: u64,
}

/// Reads torch's optimizer state dict at `node` into a record for `optimizer` (see
/// [`super::optimizer_record_from_torch`]). `strict_hyper`: a file value other than the
/// optimizer group's own is an error instead of being taken.
pub(super) fn record_from_node(
    node: &Node<'_>,
    optimizer: &AmpOptimizer,
    order: &TorchParamOrder,
    index: usize,
    exact_dtypes: bool,
    strict_hyper: bool,
) -> Result<LoadedRecord> {
    let groups = node.get("param_groups")?.elements()?;
    let ids = group_ids(&groups)?;
    let sizes: Vec<usize> = ids.iter().map(Vec::len).collect();
    let names = optimizer.param_names();
    let total: usize = sizes.iter().sum();
    if total != names.len() {
        return Err(AmpError::State(StateError::ParamCount {
            optimizer: index,
            path: node.path(),
            in_file: total,
            in_optimizer: names.len(),
        }));
    }
    check_order(order, &sizes, optimizer, index)?;
    let kind = optimizer.rule_kind().to_string();
    let class = class_of(&kind, index)?;
    let current = optimizer.to_record();
    let ctx = Reading {
        node,
        index,
        class,
        position: names.iter().enumerate().map(|(i, n)| (*n, i)).collect(),
        layout: optimizer.param_layout(),
        names,
    };
    let (given, first_lr, ignored_keys) = ctx.read_groups(&groups, order, &current, strict_hyper)?;
    let mut group_records = with_given(&current.groups, &given);
    let id_to_name = ctx.index_names(&ids, order)?;
    // Per-parameter state, each parameter's as its group's settings keep it.
    let expected: Vec<Vec<(String, Kind, Vec<i64>)>> = (0..ctx.names.len())
        .map(|i| optimizer.state_layout(i, &group_records[ctx.layout[i].slot].hyper_parameters.clone().into()))
        .collect();
    let mut params: Vec<ParamRecord> = ctx
        .names
        .iter()
        .map(|n| ParamRecord { name: n.to_string(), step: 0, buffers: BTreeMap::new(), master: None })
        .collect();
    let mut converted = Vec::new();
    ctx.read_state(&id_to_name, &expected, exact_dtypes, &mut params, &mut converted)?;
    if class.kind == FUSED_NOVOGRAD.kind {
        ctx.read_novograd_norms(&groups, order, &expected, &mut params)?;
    }
    ctx.check_steps(&expected, &mut group_records, &mut params)?;
    let lr = first_lr.unwrap_or_else(|| optimizer.lr());
    let steps = if class.group_step {
        group_records.iter().map(|g| g.step).max().unwrap_or(0)
    } else {
        params.iter().map(|p| p.step).max().unwrap_or(0)
    };
    let record = OptimizerRecord {
        kind,
        hyper_parameters: current.hyper_parameters,
        lr,
        group_lr: group_records.iter().filter(|g| g.lr.to_bits() != lr.to_bits()).map(|g| (g.id, g.lr)).collect(),
        groups: group_records,
        steps,
        skipped: 0,
        params,
    };
    Ok(LoadedRecord { record, converted, ignored_keys })
}

/// The optimizer's groups with the file's values where a file group gave them.
fn with_given(groups: &[GroupRecord], given: &BTreeMap<usize, Given>) -> Vec<GroupRecord> {
    groups
        .iter()
        .enumerate()
        .map(|(slot, own)| {
            let mut g = own.clone();
            if let Some(giv) = given.get(&slot) {
                g.lr = giv.lr;
                for (k, v, _) in &giv.values {
                    if g.hyper_parameters.contains_key(*k) {
                        g.hyper_parameters.insert((*k).to_string(), *v);
                    }
                }
                g.step = giv.step;
            }
            g
        })
        .collect()
}

/// What the readers of one optimizer state dict share: the dict, the optimizer's position in
/// the call, its class, and its parameters (names, positions, layout).
struct Reading<'a, 'n> {
    node: &'a Node<'n>,
    index: usize,
    class: &'static Class,
    names: Vec<&'a str>,
    position: HashMap<&'a str, usize>,
    layout: Vec<ParamLayout>,
}

/// Whether `buf` is a state FusedNovoGrad keeps in its group rather than per parameter.
fn in_group(kind: &str, buf: &str) -> bool {
    kind == FUSED_NOVOGRAD.kind && buf == NOVOGRAD_NORMS
}

/// What [`Reading::read_groups`] gives: per optimizer group, the values the file gives it; the
/// first group's learning rate; the group keys left unread.
type GroupsRead = (BTreeMap<usize, Given>, Option<f64>, Vec<String>);

impl<'a, 'n> Reading<'a, 'n> {
    /// Hyper-parameters, learning rates and Apex's group steps, file group by file group, given
    /// to the optimizer's groups their parameters are in; the first group's learning rate; the
    /// group keys left unread.
    fn read_groups(
        &self,
        groups: &[Node<'_>],
        order: &TorchParamOrder,
        current: &OptimizerRecord,
        strict_hyper: bool,
    ) -> Result<GroupsRead> {
        let (index, class) = (self.index, self.class);
        let mut given: BTreeMap<usize, Given> = BTreeMap::new();
        let mut first_lr = None;
        let mut ignored_keys = Vec::new();
        for (gi, g) in groups.iter().enumerate() {
            let file_kind = FileKind::of(g)?;
            if !file_kind.matches(class.kind) {
                return Err(AmpError::State(StateError::OptimizerKind {
                    optimizer: index,
                    path: self.node.path(),
                    in_file: file_kind.name().into(),
                    in_optimizer: class.name.into(),
                }));
            }
            let lr_node = g.get("lr")?;
            let lr = number(&lr_node)?;
            if !(lr.is_finite() && lr >= 0.0) {
                return Err(bad_value(lr_node.path(), format!("lr {lr} must be finite and >= 0")));
            }
            first_lr.get_or_insert(lr);
            let step = match (class.group_step, g.get_opt("step")?) {
                (true, Some(n)) => read_step(&n)?,
                _ => 0,
            };
            let (values, wide) = group_values(g, class)?;
            let values: Vec<(&'static str, f64, &'static str)> =
                values.into_iter().map(|v| (v.ours, v.value, v.torch)).collect();
            for (k, _) in g.entries()? {
                let key = match k {
                    Key::Str(s) => s.clone(),
                    Key::Int(i) => i.to_string(),
                };
                let known = ["lr", "params", "param_names"].contains(&key.as_str())
                    || (class.group_step && key == "step")
                    || in_group(class.kind, &key)
                    || class.keys.iter().any(|(k, _)| *k == key);
                if !known {
                    ignored_keys.push(format!("{}.{key}", g.path()));
                }
            }
            for name in &order[gi] {
                let slot = self.layout[self.position[name.as_str()]].slot;
                let own = &current.groups[slot];
                // Optimizer-wide values the file repeats: Apex reads the optimizer's, so do we.
                for w in &wide {
                    let ours = own.hyper_parameters.get(w.ours).copied().unwrap_or(f64::NAN);
                    if w.value.to_bits() != ours.to_bits() {
                        if strict_hyper {
                            return Err(hyper_error(index, g, w.torch, show(w.ours, w.value), show(w.ours, ours)));
                        }
                        let path = format!("{}.{}", g.path(), w.torch);
                        if !ignored_keys.contains(&path) {
                            ignored_keys.push(path);
                        }
                    }
                }
                if strict_hyper {
                    check_strict(index, g, &values, own)?;
                }
                match given.get(&slot) {
                    None => {
                        given.insert(slot, Given { path: g.path(), lr, values: values.clone(), step });
                    }
                    Some(other) => check_same_group(index, g, name, own.id, other, lr, &values, step)?,
                }
            }
        }
        Ok((given, first_lr, ignored_keys))
    }

    /// Which torch index is which parameter.
    fn index_names(&self, ids: &[Vec<i64>], order: &TorchParamOrder) -> Result<HashMap<i64, &'a str>> {
        let mut id_to_name: HashMap<i64, &'a str> = HashMap::new();
        for (gi, (g_ids, g_names)) in ids.iter().zip(order).enumerate() {
            for (id, name) in g_ids.iter().zip(g_names) {
                let name = self.names[self.position[name.as_str()]];
                if id_to_name.insert(*id, name).is_some() {
                    return Err(bad_value(
                        format!("{}.param_groups.{gi}.params", self.node.path()),
                        format!("parameter index {id} is listed twice"),
                    ));
                }
            }
        }
        Ok(id_to_name)
    }

    /// A state tensor of parameter `pos`, checked (shape, dtype, finite) and copied in the dtype
    /// the optimizer keeps; conversions are noted in `converted`.
    fn state_tensor(
        &self,
        v: &Node<'_>,
        pos: usize,
        want: (Kind, &[i64]),
        exact_dtypes: bool,
        converted: &mut Vec<(String, Kind, Kind)>,
    ) -> Result<Tensor> {
        let (want_kind, want_shape) = want;
        let name = self.names[pos];
        let t = v.as_tensor()?;
        if t.size() != want_shape {
            return Err(AmpError::State(StateError::ShapeMismatch {
                path: v.path(),
                target: name.to_string(),
                expected: want_shape.to_vec(),
                found: t.size(),
            }));
        }
        let ok = if exact_dtypes { t.kind() == want_kind } else { is_floating(t.kind()) };
        if !ok {
            return Err(AmpError::State(StateError::DtypeMismatch {
                path: v.path(),
                target: name.to_string(),
                expected: format!("{want_kind:?} (the optimizer keeps this state in it)"),
                found: t.kind(),
            }));
        }
        if !super::model::all_finite(t)? {
            return Err(AmpError::State(StateError::NonFinite { path: v.path() }));
        }
        if t.kind() != want_kind {
            converted.push((v.path(), t.kind(), want_kind));
        }
        t.f_to_kind(want_kind).and_then(|t| t.f_detach_copy()).ctx("copying optimizer state")
    }

    /// The `state` dict: each parameter's step and buffers, as its group's settings keep them.
    fn read_state(
        &self,
        id_to_name: &HashMap<i64, &'a str>,
        expected: &[Vec<(String, Kind, Vec<i64>)>],
        exact_dtypes: bool,
        params: &mut [ParamRecord],
        converted: &mut Vec<(String, Kind, Kind)>,
    ) -> Result<()> {
        let class = self.class;
        let state = self.node.get("state")?;
        for (key, st) in state.entries()? {
            let id = match key {
                Key::Int(i) => *i,
                Key::Str(s) => {
                    return Err(bad_value(
                        state.path(),
                        format!("has the key {s:?}; torch.optim keys its state by parameter index"),
                    ))
                }
            };
            let name = *id_to_name.get(&id).ok_or_else(|| {
                bad_value(st.path(), format!("state for parameter index {id}, which no param group lists"))
            })?;
            let pos = self.position[name];
            for (k, v) in st.entries()? {
                let k = match k {
                    Key::Str(s) => s.as_str(),
                    Key::Int(i) => return Err(bad_value(st.path(), format!("unexpected int key {i}"))),
                };
                if k == "step" {
                    if class.param_step {
                        params[pos].step = read_step(&v)?;
                    }
                    continue;
                }
                if v.is_none() {
                    continue; // SGD without momentum may store momentum_buffer = None
                }
                let kept = |b: &str| !in_group(class.kind, b);
                let Some((buf, want_kind, want_shape)) = expected[pos].iter().find(|(b, ..)| b == k && kept(b)) else {
                    let names_kept: Vec<&str> =
                        expected[pos].iter().map(|(n, ..)| n.as_str()).filter(|n| kept(n)).collect();
                    return Err(bad_value(
                        v.path(),
                        format!("{} configured as this optimizer's group keeps {names_kept:?}, not {k:?}", class.name),
                    ));
                };
                let t = self.state_tensor(&v, pos, (*want_kind, want_shape), exact_dtypes, converted)?;
                params[pos].buffers.insert(buf.clone(), t);
            }
        }
        Ok(())
    }

    /// FusedNovoGrad's norms, kept in the group: one vector for its fp16 parameters, one for its
    /// fp32 ones, each in the group's order.
    fn read_novograd_norms(
        &self,
        groups: &[Node<'_>],
        order: &TorchParamOrder,
        expected: &[Vec<(String, Kind, Vec<i64>)>],
        params: &mut [ParamRecord],
    ) -> Result<()> {
        for (gi, g) in groups.iter().enumerate() {
            let Some(norms) = g.get_opt(NOVOGRAD_NORMS)? else { continue };
            let parts = norms.elements()?;
            if parts.len() != 2 {
                return Err(bad_value(
                    norms.path(),
                    format!("{} entries; FusedNovoGrad keeps [fp16 norms, fp32 norms]", parts.len()),
                ));
            }
            for (part, half) in parts.iter().zip([true, false]) {
                let members: Vec<usize> = order[gi]
                    .iter()
                    .map(|n| self.position[n.as_str()])
                    .filter(|&p| (self.layout[p].kind == Kind::Half) == half)
                    .collect();
                let t = part.as_tensor()?;
                if t.size() != [members.len() as i64] {
                    return Err(AmpError::State(StateError::ShapeMismatch {
                        path: part.path(),
                        target: format!(
                            "the norms of param group {gi}'s {} parameters",
                            if half { "fp16" } else { "fp32" }
                        ),
                        expected: vec![members.len() as i64],
                        found: t.size(),
                    }));
                }
                if !is_floating(t.kind()) {
                    return Err(AmpError::State(StateError::DtypeMismatch {
                        path: part.path(),
                        target: format!("the norms of param group {gi}"),
                        expected: "a floating dtype".into(),
                        found: t.kind(),
                    }));
                }
                if !super::model::all_finite(t)? {
                    return Err(AmpError::State(StateError::NonFinite { path: part.path() }));
                }
                for (j, &pos) in members.iter().enumerate() {
                    let Some((buf, want_kind, _)) = expected[pos].iter().find(|(b, ..)| in_group(self.class.kind, b))
                    else {
                        continue;
                    };
                    if params[pos].buffers.is_empty() {
                        continue; // no state yet: no norm either
                    }
                    let norm = t
                        .f_get(j as i64)
                        .and_then(|n| n.f_to_kind(*want_kind))
                        .and_then(|n| n.f_detach_copy())
                        .ctx("a FusedNovoGrad norm")?;
                    params[pos].buffers.insert(buf.clone(), norm);
                }
            }
        }
        Ok(())
    }

    /// Every parameter with state has all of it and has counted a step; the step counts of
    /// groups and parameters as the class keeps them (torch's count per parameter: a group's
    /// count is its parameters' highest).
    fn check_steps(
        &self,
        expected: &[Vec<(String, Kind, Vec<i64>)>],
        group_records: &mut [GroupRecord],
        params: &mut [ParamRecord],
    ) -> Result<()> {
        let class = self.class;
        for (pos, p) in params.iter_mut().enumerate() {
            let keeps = expected[pos].len();
            let slot = self.layout[pos].slot;
            let where_ = || format!("{}.state (parameter {})", self.node.path(), p.name);
            if !p.buffers.is_empty() && p.buffers.len() != keeps {
                let have: Vec<&str> = p.buffers.keys().map(String::as_str).collect();
                let want: Vec<&str> = expected[pos].iter().map(|(n, ..)| n.as_str()).collect();
                return Err(bad_value(where_(), format!("has {have:?}; {} keeps {want:?} together", class.name)));
            }
            if class.group_step && !p.buffers.is_empty() {
                p.step = group_records[slot].step;
            }
            // Classes that count steps (per group or per parameter) must have counted one.
            let counted = if class.group_step || class.param_step { p.step } else { 1 };
            if !p.buffers.is_empty() && counted == 0 {
                return Err(bad_value(where_(), "has optimizer state but no step (or step 0)"));
            }
        }
        if !class.group_step {
            for (slot, g) in group_records.iter_mut().enumerate() {
                g.step = params
                    .iter()
                    .zip(&self.layout)
                    .filter(|(_, l)| l.slot == slot)
                    .map(|(p, _)| p.step)
                    .max()
                    .unwrap_or(0);
            }
        }
        Ok(())
    }
}

/// Under `strict_hyper_parameters`: file group `g`'s values equal the optimizer group `own`'s.
fn check_strict(
    index: usize,
    g: &Node<'_>,
    values: &[(&'static str, f64, &'static str)],
    own: &GroupRecord,
) -> Result<()> {
    for (ours, v, torch) in values {
        let mine = own.hyper_parameters.get(*ours).copied().unwrap_or(f64::NAN);
        if v.to_bits() != mine.to_bits() {
            let (in_file, in_opt) = if *torch == "betas" {
                let b = |f: &dyn Fn(&str) -> f64| format!("({:?}, {:?})", f("beta1"), f("beta2"));
                let file = |k: &str| values.iter().find(|x| x.0 == k).map_or(f64::NAN, |x| x.1);
                let opt = |k: &str| own.hyper_parameters.get(k).copied().unwrap_or(f64::NAN);
                (b(&file), b(&opt))
            } else {
                (show(ours, *v), show(ours, mine))
            };
            return Err(hyper_error(index, g, torch, in_file, in_opt));
        }
    }
    Ok(())
}

/// A second file group `g` giving values to the optimizer's group `group` (through parameter
/// `name`): they must be the first's (`other`).
#[allow(clippy::too_many_arguments)]
fn check_same_group(
    index: usize,
    g: &Node<'_>,
    name: &str,
    group: usize,
    other: &Given,
    lr: f64,
    values: &[(&'static str, f64, &'static str)],
    step: u64,
) -> Result<()> {
    if other.lr.to_bits() != lr.to_bits() {
        return Err(AmpError::State(StateError::HyperParameter {
            optimizer: index,
            path: g.path(),
            name: "lr".into(),
            in_file: format!("{lr:?} here and {:?} in {}", other.lr, other.path),
            in_optimizer: format!("one learning rate for parameter group {group} (which holds {name})"),
            remedy: group_remedy(),
        }));
    }
    if let Some(((k, v, t), (_, w, _))) =
        values.iter().zip(&other.values).find(|((_, v, _), (_, w, _))| v.to_bits() != w.to_bits())
    {
        return Err(AmpError::State(StateError::HyperParameter {
            optimizer: index,
            path: g.path(),
            name: (*t).into(),
            in_file: format!("{} here and {} in {}", show(k, *v), show(k, *w), other.path),
            in_optimizer: format!("one value for parameter group {group} (which holds {name})"),
            remedy: group_remedy(),
        }));
    }
    if other.step != step {
        return Err(bad_value(
            g.path(),
            format!("step {step} here and {} in {}, for one parameter group of the optimizer", other.step, other.path),
        ));
    }
    Ok(())
}

/// What to do about a value that differs between the file and the optimizer (strict) or
/// between two file groups.
fn group_remedy() -> &'static str {
    "torch keeps one value per parameter group: give those parameters the same group in the file (or their own \
     parameter groups here)"
}

/// The error of a strict load for a value of file group `g` other than the optimizer's.
fn hyper_error(index: usize, g: &Node<'_>, key: &str, in_file: String, in_optimizer: String) -> AmpError {
    AmpError::State(StateError::HyperParameter {
        optimizer: index,
        path: g.path(),
        name: key.to_string(),
        in_file,
        in_optimizer,
        remedy: "TorchLoadOptions::strict_hyper_parameters refuses values other than the optimizer's: load without \
                 it to take the file's (as torch's load_state_dict does), or build the optimizer with the file's \
                 values",
    })
}

/// A group's settings as the writer needs them: its learning rate, hyper-parameters and step.
struct Settings<'a> {
    lr: f64,
    hyper: &'a BTreeMap<String, f64>,
    step: u64,
}

/// The group dict of `class` with `s`'s values, in the class's key order.
fn group_dict(class: &Class, s: &Settings<'_>, fused: bool) -> Result<Dict> {
    let hp = |name: &str| -> Result<f64> {
        s.hyper.get(name).copied().ok_or_else(|| {
            AmpError::Config(ConfigError::OptionsMismatch {
                message: format!("the {} record has no hyper-parameter {name}", class.kind),
            })
        })
    };
    let mut g = Dict::new();
    g.insert("lr", Value::Float(s.lr));
    for &(key, slot) in class.keys {
        let v = match slot {
            Num(_) | Wide => Value::Float(hp(key)?),
            Flag(_) => Value::Bool(hp(key)? != 0.0),
            Int(_) => Value::Int(hp(key)? as i64),
            Betas(..) => Value::Tuple(vec![Value::Float(hp("beta1")?), Value::Float(hp("beta2")?)]),
            NoneFlag => Value::None,
            FalseFlag => Value::Bool(false),
            Fused => {
                if fused {
                    Value::Bool(true)
                } else {
                    Value::None
                }
            }
            Decoupled(on) => Value::Bool(on),
        };
        g.insert(key, v);
    }
    // Apex adds the group's step at its first step.
    if class.group_step && s.step > 0 {
        g.insert("step", Value::Int(i64::try_from(s.step).unwrap_or(i64::MAX)));
    }
    Ok(g)
}

/// Writes `record` (of `optimizer`) as torch.optim's (or Apex's) state dict (see
/// [`super::optimizer_record_to_torch`]).
pub(super) fn record_to_value(
    record: &OptimizerRecord,
    optimizer: &AmpOptimizer,
    order: &TorchParamOrder,
    index: usize,
    names_prefix: Option<&str>,
) -> Result<Value> {
    let names = optimizer.param_names();
    let layout = optimizer.param_layout();
    let rec_names: Vec<&str> = record.params.iter().map(|p| p.name.as_str()).collect();
    if rec_names != names {
        return Err(AmpError::Config(ConfigError::OptionsMismatch {
            message: format!("optimizer {index}: the record covers {rec_names:?}, the optimizer {names:?}"),
        }));
    }
    let class = class_of(&record.kind, index)?;
    let sizes: Vec<usize> = order.iter().map(Vec::len).collect();
    check_order(order, &sizes, optimizer, index).map_err(|e| match e {
        AmpError::State(StateError::ParamOrder { reason, .. }) => AmpError::Config(ConfigError::OptionsMismatch {
            message: format!("param_order of optimizer {index}: {reason}"),
        }),
        other => other,
    })?;
    let position: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let fused = optimizer.config().is_some_and(|c| c.is_fused());
    let own = optimizer.to_record();
    let settings = group_settings(record, &own, index)?;
    let mut state = Dict::new();
    let mut groups = Vec::with_capacity(order.len());
    let mut next: i64 = 0;
    for (gi, g_names) in order.iter().enumerate() {
        let mut slot: Option<(usize, &str)> = None;
        let mut ids = Vec::with_capacity(g_names.len());
        for name in g_names {
            let pos = position[name.as_str()];
            let p = &record.params[pos];
            let this = layout[pos].slot;
            match slot {
                Some((s, first)) if s != this => {
                    one_group_setting(&settings[s], &settings[this], class, [first, name.as_str()], index, gi)?
                }
                Some(_) => {}
                None => slot = Some((this, name.as_str())),
            }
            if let Some(st) = param_state(p, class)? {
                state.insert(next, Value::Dict(st));
            }
            ids.push(Value::Int(next));
            next += 1;
        }
        let s = slot.map_or(&settings[0], |(s, _)| &settings[s]);
        let mut g = Dict::new();
        if let Some(prefix) = names_prefix {
            g.insert("param_names", Value::List(g_names.iter().map(|n| Value::Str(format!("{prefix}{n}"))).collect()));
        }
        for (k, v) in group_dict(class, s, fused)?.iter() {
            g.insert(k.clone(), v.shallow_clone());
        }
        if class.kind == FUSED_NOVOGRAD.kind {
            if let Some(norms) = novograd_norms(record, &layout, &position, g_names, index, gi)? {
                g.insert(NOVOGRAD_NORMS, norms);
            }
        }
        g.insert("params", Value::List(ids));
        groups.push(Value::Dict(g));
    }
    Ok(Value::Dict(Dict::new().with("state", Value::Dict(state)).with("param_groups", Value::List(groups))))
}

/// Each parameter group's settings (a record made by hand in the older form has no groups:
/// the defaults with per-group learning rates).
fn group_settings<'r>(record: &'r OptimizerRecord, own: &OptimizerRecord, index: usize) -> Result<Vec<Settings<'r>>> {
    if record.groups.is_empty() {
        return Ok(own
            .groups
            .iter()
            .map(|g| Settings {
                lr: record.group_lr.get(&g.id).copied().unwrap_or(record.lr),
                hyper: &record.hyper_parameters,
                step: g.step,
            })
            .collect());
    }
    if record.groups.len() != own.groups.len() {
        return Err(AmpError::Config(ConfigError::OptionsMismatch {
            message: format!(
                "optimizer {index}: the record has {} parameter groups, the optimizer {}",
                record.groups.len(),
                own.groups.len()
            ),
        }));
    }
    Ok(record.groups.iter().map(|g| Settings { lr: g.lr, hyper: &g.hyper_parameters, step: g.step }).collect())
}

/// Two parameters the order puts in torch group `gi` (`names`: the first one's, this one's)
/// come from tch-amp groups with the same learning rate and hyper-parameters: torch keeps one
/// value per group.
fn one_group_setting(
    a: &Settings<'_>,
    b: &Settings<'_>,
    class: &Class,
    names: [&str; 2],
    index: usize,
    gi: usize,
) -> Result<()> {
    let [first, name] = names;
    if a.lr.to_bits() != b.lr.to_bits() {
        return Err(AmpError::Config(ConfigError::OptionsMismatch {
            message: format!(
                "param_order of optimizer {index}: group {gi} holds parameters with learning rates \
                 {:?} ({first}) and {:?} ({name}); torch keeps one per group",
                a.lr, b.lr
            ),
        }));
    }
    let keys = class.keys.iter().flat_map(|(k, _)| if *k == "betas" { vec!["beta1", "beta2"] } else { vec![*k] });
    for k in keys {
        let (x, y) = (a.hyper.get(k), b.hyper.get(k));
        if x.map(|v| v.to_bits()) != y.map(|v| v.to_bits()) {
            return Err(AmpError::Config(ConfigError::OptionsMismatch {
                message: format!(
                    "param_order of optimizer {index}: group {gi} holds parameters with {k} {x:?} \
                     ({first}) and {y:?} ({name}); torch keeps one value per group"
                ),
            }));
        }
    }
    Ok(())
}

/// A parameter's state entry (`step` where the class keeps one per parameter, then the rule's
/// buffers in torch's order), or `None` where torch keeps none for it.
fn param_state(p: &ParamRecord, class: &Class) -> Result<Option<Dict>> {
    let keeps_state = !p.buffers.keys().all(|b| class.kind == FUSED_NOVOGRAD.kind && b == NOVOGRAD_NORMS)
        || (class.param_step && p.step > 0);
    if !keeps_state {
        return Ok(None);
    }
    let mut st = Dict::new();
    if class.param_step {
        let step = p.step.min(TORCH_STEP_LIMIT) as f64;
        st.insert("step", Value::Tensor(Tensor::f_scalar_tensor(step, (Kind::Float, Device::Cpu)).ctx("step")?));
    }
    let mut bufs: Vec<&String> = p.buffers.keys().collect();
    bufs.sort_by_key(|b| (buffer_rank(b), b.to_string()));
    for buf in bufs {
        if class.kind == FUSED_NOVOGRAD.kind && buf == NOVOGRAD_NORMS {
            continue;
        }
        st.insert(buf.as_str(), Value::Tensor(p.buffers[buf].f_detach().ctx("optimizer state")?));
    }
    Ok(Some(st))
}

/// torch's order of a parameter's state entries (after `step`).
fn buffer_rank(name: &str) -> usize {
    ["momentum_buffer", "square_avg", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "grad_avg", "sum"]
        .iter()
        .position(|b| *b == name)
        .unwrap_or(usize::MAX)
}

/// FusedNovoGrad's `exp_avg_sq` of one group: `[norms of its fp16 parameters, norms of its fp32
/// ones]`, each in the group's order; `None` before the first step. Apex makes them for every
/// parameter of the group at once, so either all of the group's parameters have one or none.
fn novograd_norms(
    record: &OptimizerRecord,
    layout: &[crate::optim::amp_optimizer::ParamLayout],
    position: &HashMap<&str, usize>,
    g_names: &[String],
    index: usize,
    gi: usize,
) -> Result<Option<Value>> {
    let with: Vec<usize> = g_names
        .iter()
        .map(|n| position[n.as_str()])
        .filter(|&p| record.params[p].buffers.contains_key(NOVOGRAD_NORMS))
        .collect();
    if with.is_empty() {
        return Ok(None);
    }
    if with.len() != g_names.len() {
        return Err(AmpError::Config(ConfigError::OptionsMismatch {
            message: format!(
                "optimizer {index}: torch group {gi} has FusedNovoGrad norms for {} of its {} parameters; Apex keeps \
                 them for all or none (put parameters stepped at different times into different groups)",
                with.len(),
                g_names.len()
            ),
        }));
    }
    let mut parts = Vec::with_capacity(2);
    for half in [true, false] {
        let norms: Vec<Tensor> = with
            .iter()
            .filter(|&&p| (layout[p].kind == Kind::Half) == half)
            .map(|&p| record.params[p].buffers[NOVOGRAD_NORMS].f_reshape([1]))
            .collect::<Result<_, _>>()
            .ctx("FusedNovoGrad norms")?;
        let t = if norms.is_empty() {
            Tensor::f_zeros([0], (Kind::Float, Device::Cpu)).ctx("FusedNovoGrad norms")?
        } else {
            Tensor::f_cat(&norms, 0).and_then(|t| t.f_to_kind(Kind::Float)).ctx("FusedNovoGrad norms")?
        };
        parts.push(Value::Tensor(t));
    }
    Ok(Some(Value::List(parts)))
}

/// The optimizer configuration and learning rate a state dict was made with, from its first
/// param group (see [`super::optimizer_config`]).
pub(super) fn config_from_node(node: &Node<'_>) -> Result<(OptimizerConfig, f64)> {
    let groups = node.get("param_groups")?.elements()?;
    let g = groups.first().ok_or_else(|| bad_value(node.path(), "no param groups"))?;
    let torch_2 = |k: &str| g.get_opt(k).map(|n| n.is_some());
    let class: &Class = match FileKind::of(g)? {
        // Apex's FusedSGD writes torch.optim.SGD's keys of before `maximize` (torch 1.11) only.
        FileKind::Sgd if !(torch_2("maximize")? || torch_2("foreach")? || torch_2("differentiable")?) => &FUSED_SGD,
        FileKind::Sgd => &SGD,
        FileKind::Adam => &ADAM,
        FileKind::AdamW => &ADAMW,
        FileKind::RmsProp => &RMSPROP,
        FileKind::FusedAdam => &FUSED_ADAM,
        FileKind::FusedLamb => &FUSED_LAMB,
        FileKind::FusedNovoGrad => &FUSED_NOVOGRAD,
        FileKind::FusedAdagrad => &FUSED_ADAGRAD,
        FileKind::AdamFamily => {
            return Err(bad_value(
                g.path(),
                "an Adam-family group without decoupled_weight_decay (written by torch < 2.6): Adam and \
                          AdamW cannot be told apart; build the optimizer yourself",
            ))
        }
    };
    let (values, wide) = group_values(g, class)?;
    let v: BTreeMap<&str, f64> = values.iter().chain(&wide).map(|x| (x.ours, x.value)).collect();
    let on = |k: &str| v.get(k).is_some_and(|x| *x != 0.0);
    let fused = matches!(class.kind, "adam" | "adamw")
        && match g.get_opt("fused")? {
            Some(n) if !n.is_none() => n.as_bool()?,
            _ => false,
        };
    let config = config_of(class.kind, &v);
    let lr = number(&g.get("lr")?)?;
    let maximize = class.keys.iter().any(|(k, _)| *k == "maximize") && on("maximize");
    Ok((config.maximize(maximize).fused(fused), lr))
}

/// The configuration of optimizer `kind` with the group's values `v` (absent: 0).
fn config_of(kind: &str, v: &BTreeMap<&str, f64>) -> OptimizerConfig {
    let on = |k: &str| v.get(k).is_some_and(|x| *x != 0.0);
    let get = |k: &str| v.get(k).copied().unwrap_or(0.0);
    match kind {
        "fused_sgd" => FusedSgd {
            momentum: get("momentum"),
            dampening: get("dampening"),
            weight_decay: get("weight_decay"),
            nesterov: on("nesterov"),
            ..FusedSgd::default()
        }
        .into(),
        "sgd" => nn::Sgd {
            momentum: get("momentum"),
            dampening: get("dampening"),
            wd: get("weight_decay"),
            nesterov: on("nesterov"),
        }
        .into(),
        "adam" => nn::Adam {
            beta1: get("beta1"),
            beta2: get("beta2"),
            wd: get("weight_decay"),
            eps: get("eps"),
            amsgrad: on("amsgrad"),
        }
        .into(),
        "adamw" => nn::AdamW {
            beta1: get("beta1"),
            beta2: get("beta2"),
            wd: get("weight_decay"),
            eps: get("eps"),
            amsgrad: on("amsgrad"),
        }
        .into(),
        "rmsprop" => nn::RmsProp {
            alpha: get("alpha"),
            eps: get("eps"),
            wd: get("weight_decay"),
            momentum: get("momentum"),
            centered: on("centered"),
        }
        .into(),
        "fused_adam" => FusedAdam {
            beta1: get("beta1"),
            beta2: get("beta2"),
            eps: get("eps"),
            weight_decay: get("weight_decay"),
            bias_correction: on("bias_correction"),
            ..FusedAdam::default()
        }
        .into(),
        "fused_lamb" => FusedLamb {
            beta1: get("beta1"),
            beta2: get("beta2"),
            eps: get("eps"),
            weight_decay: get("weight_decay"),
            bias_correction: on("bias_correction"),
            grad_averaging: on("grad_averaging"),
            max_grad_norm: v.get("max_grad_norm").copied().unwrap_or(FusedLamb::default().max_grad_norm),
            ..FusedLamb::default()
        }
        .into(),
        "fused_novograd" => FusedNovoGrad {
            beta1: get("beta1"),
            beta2: get("beta2"),
            eps: get("eps"),
            weight_decay: get("weight_decay"),
            bias_correction: on("bias_correction"),
            grad_averaging: on("grad_averaging"),
            norm_type: if get("norm_type") == 0.0 { NovoGradNorm::Inf } else { NovoGradNorm::L2 },
            init_zero: on("init_zero"),
            ..FusedNovoGrad::default()
        }
        .into(),
        _ => FusedAdagrad { eps: get("eps"), weight_decay: get("weight_decay"), ..FusedAdagrad::default() }.into(),
    }
}
