//! torch.optim's `state_dict()` and tch-amp's [`OptimizerRecord`], both ways, in one place.
//!
//! torch's layout (2.13; older versions lack some group keys, whose torch defaults are then
//! used): `{'state': {index: {'step': tensor(7.), 'exp_avg': ..., ...}, ...}, 'param_groups':
//! [{'lr': .., <hyper-parameters>, [implementation flags], ['param_names': [...]], 'params':
//! [index, ...]}, ...]}`. An index is a parameter's position in the groups' `params` lists
//! read one after the other; [`TorchParamOrder`] says which VarStore name each position is.
//!
//! tch-amp's optimizers have one set of hyper-parameters and a learning rate per tch parameter
//! group (`Path::set_group`): the file's groups must agree with the optimizer on every
//! hyper-parameter but `lr`, and parameters of one tch group must share one `lr`.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use tch::{nn, Device, Kind, Tensor};

use super::error::Result;
use super::error::TorchCheckpointError as E;
use super::options::TorchParamOrder;
use crate::dtype::is_floating;
use crate::error::TorchContext;
use crate::optim::{AmpOptimizer, OptimizerConfig, OptimizerRecord, ParamRecord};
use crate::torch_io::{Dict, Key, Node, Value};

/// torch.optim's step counter saturates where its fp32 `step` tensor stops counting.
const TORCH_STEP_LIMIT: u64 = 1 << 24;

/// Group keys that choose torch's implementation, not the arithmetic's inputs: accepted and
/// not compared (`fused` Adam keeps the same state as the default).
const IMPLEMENTATION_KEYS: [&str; 4] = ["foreach", "fused", "capturable", "differentiable"];

/// The optimizer class a param group's keys describe.
#[derive(Debug, Clone, Copy, PartialEq)]
enum FileKind {
    Sgd,
    Adam,
    AdamW,
    /// `betas` without `decoupled_weight_decay` (torch before 2.6): Adam or AdamW.
    AdamFamily,
    RmsProp,
}

impl FileKind {
    fn of(group: &Node<'_>) -> Result<Self> {
        let has = |k: &str| group.get_opt(k).map(|n| n.is_some());
        if has("betas")? {
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
        Err(E::BadValue {
            path: group.path(),
            message: "a param group with neither betas (Adam, AdamW), alpha (RMSprop) nor nesterov/dampening (SGD): \
                      tch-amp maps only these torch.optim classes"
                .into(),
        })
    }

    fn name(self) -> &'static str {
        match self {
            FileKind::Sgd => "SGD",
            FileKind::Adam => "Adam",
            FileKind::AdamW => "AdamW",
            FileKind::AdamFamily => "Adam or AdamW",
            FileKind::RmsProp => "RMSprop",
        }
    }

    fn matches(self, ours: &str) -> bool {
        matches!(
            (self, ours),
            (FileKind::Sgd, "sgd")
                | (FileKind::Adam, "adam")
                | (FileKind::AdamW, "adamw")
                | (FileKind::AdamFamily, "adam" | "adamw")
                | (FileKind::RmsProp, "rmsprop")
        )
    }
}

/// torch's class name for tch-amp's kind.
fn torch_class(kind: &str) -> &'static str {
    match kind {
        "sgd" => "SGD",
        "adam" => "Adam",
        "adamw" => "AdamW",
        "rmsprop" => "RMSprop",
        _ => "an unknown optimizer",
    }
}

/// One hyper-parameter: torch's group key, tch-amp's name (`OptimizerConfig::hyper_parameters`),
/// torch's constructor default, whether it is a flag.
struct Hyper {
    torch: &'static str,
    ours: &'static str,
    default: f64,
    flag: bool,
}

const fn h(torch: &'static str, default: f64) -> Hyper {
    Hyper { torch, ours: torch, default, flag: false }
}
const fn flag(torch: &'static str) -> Hyper {
    Hyper { torch, ours: torch, default: 0.0, flag: true }
}

const SGD: [Hyper; 5] =
    [h("momentum", 0.0), h("dampening", 0.0), h("weight_decay", 0.0), flag("nesterov"), flag("maximize")];
const ADAM: [Hyper; 4] = [h("eps", 1e-8), h("weight_decay", 0.0), flag("amsgrad"), flag("maximize")];
const ADAMW: [Hyper; 4] = [h("eps", 1e-8), h("weight_decay", 1e-2), flag("amsgrad"), flag("maximize")];
const RMSPROP: [Hyper; 6] =
    [h("alpha", 0.99), h("eps", 1e-8), h("weight_decay", 0.0), h("momentum", 0.0), flag("centered"), flag("maximize")];

fn table(kind: &str) -> &'static [Hyper] {
    match kind {
        "sgd" => &SGD,
        "adam" => &ADAM,
        "adamw" => &ADAMW,
        _ => &RMSPROP,
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

/// The hyper-parameters of param group `g`, as (tch-amp name, value), for tch-amp's `kind`
/// ("adam" or "adamw" for the Adam family); missing keys take torch's defaults.
fn group_hypers(g: &Node<'_>, kind: &str) -> Result<Vec<(&'static str, f64)>> {
    let mut out = Vec::new();
    if matches!(kind, "adam" | "adamw") {
        let betas = g.get("betas")?;
        let b = betas.elements()?;
        if b.len() != 2 {
            return Err(E::BadValue { path: betas.path(), message: format!("{} betas, expected 2", b.len()) });
        }
        out.push(("beta1", number(&b[0])?));
        out.push(("beta2", number(&b[1])?));
    }
    for hp in table(kind) {
        let v = match g.get_opt(hp.torch)? {
            None => hp.default,
            Some(n) if hp.flag => f64::from(u8::from(n.as_bool()?)),
            Some(n) => number(&n)?,
        };
        out.push((hp.ours, v));
    }
    Ok(out)
}

fn show(name: &str, v: f64) -> String {
    let is_flag = ["nesterov", "maximize", "amsgrad", "centered"].contains(&name);
    match (is_flag, v) {
        (true, 0.0) => "False".into(),
        (true, _) => "True".into(),
        _ => format!("{v:?}"),
    }
}

/// torch's parameter indices of each param group, and their sum.
fn group_ids(groups: &[Node<'_>]) -> Result<Vec<Vec<i64>>> {
    groups.iter().map(|g| g.get("params")?.elements()?.iter().map(|n| Ok(n.as_i64()?)).collect()).collect()
}

/// The order to save `optimizer`'s parameters in when the caller gives none: one torch param
/// group per tch parameter group, in the order of their first parameter, each group's
/// parameters in creation order with each module's weight before its bias (tch's linear and
/// convolution layers create the bias first, torch's register the weight first). With one
/// group (no `Path::set_group`) this is `model.parameters()`'s order when the Rust model creates
/// its layers in the order the Python module registers them.
pub fn default_param_order(optimizer: &AmpOptimizer) -> TorchParamOrder {
    optimizer.torch_param_groups().into_iter().map(|g| g.into_iter().map(str::to_string).collect()).collect()
}

/// Checks that `order` has the file's group sizes and names each of the optimizer's
/// parameters once.
fn check_order(order: &TorchParamOrder, sizes: &[usize], optimizer: &AmpOptimizer, index: usize) -> Result<()> {
    let err = |reason: String| E::ParamOrder { optimizer: index, reason };
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
/// model state dict's order (the order of `model.parameters()` in Python) cut into the groups'
/// sizes, accepted only when it is not a guess: every parameter of the optimizer is in the
/// model state dict and, with several groups, each file group falls into one tch parameter
/// group and no two into the same one.
///
/// # Errors
/// [`E::ParamCount`] when the file's groups hold another number of parameters than the
/// optimizer; [`E::ParamOrder`] when the order is ambiguous or does not fit.
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
        return Err(E::ParamCount { optimizer: index, path: node.path(), in_file: total, in_optimizer: names.len() });
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
            E::ParamOrder { optimizer, reason } => {
                E::ParamOrder { optimizer, reason: format!("the file's param_names: {reason}") }
            }
            other => other,
        })?;
        return Ok(order);
    }
    let ours: BTreeSet<&str> = names.iter().copied().collect();
    let in_model: Vec<&String> = model_order.iter().filter(|n| ours.contains(n.as_str())).collect();
    if in_model.len() != names.len() {
        let listed: BTreeSet<&str> = in_model.iter().map(|s| s.as_str()).collect();
        let absent: Vec<&str> = names.iter().copied().filter(|n| !listed.contains(n)).take(5).collect();
        return Err(E::ParamOrder {
            optimizer: index,
            reason: format!(
                "the file has no param_names and the parameters {absent:?} are not in the model state dict, whose \
                 order is model.parameters()'s"
            ),
        });
    }
    let mut order = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for &n in &sizes {
        order.push(in_model[at..at + n].iter().map(|s| s.to_string()).collect::<Vec<String>>());
        at += n;
    }
    if order.len() > 1 {
        let layout = optimizer.param_layout();
        let group_of: HashMap<&str, usize> = names.iter().copied().zip(layout.iter().map(|l| l.group)).collect();
        let mut taken: BTreeMap<usize, usize> = BTreeMap::new();
        for (i, g) in order.iter().enumerate() {
            let tch: BTreeSet<usize> = g.iter().map(|n| group_of[n.as_str()]).collect();
            let single = tch.len() == 1;
            let first = tch.iter().next().copied().unwrap_or(0);
            if !single || taken.insert(first, i).is_some() {
                return Err(E::ParamOrder {
                    optimizer: index,
                    reason: format!(
                        "the file has {} param groups and no param_names; cutting the model's parameter order into \
                         them gives groups that do not line up with the optimizer's tch parameter groups (group {i} \
                         would be {g:?}), so the Python script built its groups in another order",
                        order.len()
                    ),
                });
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
        return Err(E::BadValue { path: n.path(), message: format!("step {v} is not a count (an integer >= 0)") });
    }
    Ok(v as u64)
}

/// Reads torch's optimizer state dict at `node` into a record for `optimizer` (see
/// [`super::optimizer_record_from_torch`]).
pub(super) fn record_from_node(
    node: &Node<'_>,
    optimizer: &AmpOptimizer,
    order: &TorchParamOrder,
    index: usize,
    exact_dtypes: bool,
) -> Result<LoadedRecord> {
    let groups = node.get("param_groups")?.elements()?;
    let ids = group_ids(&groups)?;
    let sizes: Vec<usize> = ids.iter().map(Vec::len).collect();
    let names = optimizer.param_names();
    let total: usize = sizes.iter().sum();
    if total != names.len() {
        return Err(E::ParamCount { optimizer: index, path: node.path(), in_file: total, in_optimizer: names.len() });
    }
    check_order(order, &sizes, optimizer, index)?;
    let config = optimizer.config().ok_or_else(|| E::Options {
        message: "torch checkpoints hold torch.optim optimizers: this optimizer runs a user's UpdateRule".into(),
    })?;
    let kind = config.name();
    let ours: BTreeMap<&str, f64> = config.hyper_parameters().into_iter().collect();
    let layout = optimizer.param_layout();
    let position: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut ignored_keys = Vec::new();

    // Hyper-parameters and learning rates, group by group.
    let mut group_lrs: Vec<f64> = Vec::with_capacity(groups.len());
    let mut tch_lr: BTreeMap<usize, (f64, usize)> = BTreeMap::new();
    for (gi, g) in groups.iter().enumerate() {
        let file_kind = FileKind::of(g)?;
        if !file_kind.matches(kind) {
            return Err(E::OptimizerKind {
                optimizer: index,
                path: node.path(),
                in_file: file_kind.name().into(),
                in_optimizer: torch_class(kind).into(),
            });
        }
        for (name, v) in group_hypers(g, kind)? {
            let want = ours.get(name).copied().unwrap_or(f64::NAN);
            if v != want {
                let torch_name = if name.starts_with("beta") { "betas" } else { name };
                let (in_file, in_optimizer) = if torch_name == "betas" {
                    let b = |o: &BTreeMap<&str, f64>| format!("({:?}, {:?})", o["beta1"], o["beta2"]);
                    let file: BTreeMap<&str, f64> = group_hypers(g, kind)?.into_iter().collect();
                    (b(&file), b(&ours))
                } else {
                    (show(name, v), show(name, want))
                };
                return Err(E::HyperParameter {
                    optimizer: index,
                    path: g.path(),
                    name: torch_name.into(),
                    in_file,
                    in_optimizer,
                });
            }
        }
        let lr_node = g.get("lr")?;
        let lr = number(&lr_node)?;
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(E::BadValue { path: lr_node.path(), message: format!("lr {lr} must be finite and >= 0") });
        }
        group_lrs.push(lr);
        for name in &order[gi] {
            let tg = layout[position[name.as_str()]].group;
            match tch_lr.get(&tg) {
                Some(&(other, og)) if other.to_bits() != lr.to_bits() => {
                    return Err(E::HyperParameter {
                        optimizer: index,
                        path: g.path(),
                        name: "lr".into(),
                        in_file: format!("{lr:?} here and {other:?} in param group {og}"),
                        in_optimizer: format!(
                            "one learning rate for tch parameter group {tg} (which holds {name}); give those \
                             parameters their own group with Path::set_group"
                        ),
                    })
                }
                Some(_) => {}
                None => {
                    tch_lr.insert(tg, (lr, gi));
                }
            }
        }
        for (k, _) in g.entries()? {
            let key = match k {
                Key::Str(s) => s.clone(),
                Key::Int(i) => i.to_string(),
            };
            let known = ["lr", "params", "param_names", "betas", "decoupled_weight_decay"].contains(&key.as_str())
                || IMPLEMENTATION_KEYS.contains(&key.as_str())
                || table(kind).iter().any(|hp| hp.torch == key);
            if !known {
                ignored_keys.push(format!("{}.{key}", g.path()));
            }
        }
    }

    // Which torch index is which parameter.
    let mut id_to_name: HashMap<i64, &str> = HashMap::new();
    for (gi, (g_ids, g_names)) in ids.iter().zip(order).enumerate() {
        for (id, name) in g_ids.iter().zip(g_names) {
            if id_to_name.insert(*id, name.as_str()).is_some() {
                return Err(E::BadValue {
                    path: format!("{}.param_groups.{gi}.params", node.path()),
                    message: format!("parameter index {id} is listed twice"),
                });
            }
        }
    }

    // Per-parameter state.
    let expected: Vec<&'static str> = config.buffer_names().to_vec();
    let counts_steps = kind != "sgd";
    let mut params: Vec<ParamRecord> = names
        .iter()
        .map(|n| ParamRecord { name: n.to_string(), step: 0, buffers: BTreeMap::new(), master: None })
        .collect();
    let mut converted = Vec::new();
    let state = node.get("state")?;
    for (key, st) in state.entries()? {
        let id = match key {
            Key::Int(i) => *i,
            Key::Str(s) => {
                return Err(E::BadValue {
                    path: state.path(),
                    message: format!("has the key {s:?}; torch.optim keys its state by parameter index"),
                })
            }
        };
        let name = *id_to_name.get(&id).ok_or_else(|| E::BadValue {
            path: st.path(),
            message: format!("state for parameter index {id}, which no param group lists"),
        })?;
        let pos = position[name];
        let lay = &layout[pos];
        let p = &mut params[pos];
        for (k, v) in st.entries()? {
            let k = match k {
                Key::Str(s) => s.as_str(),
                Key::Int(i) => return Err(E::BadValue { path: st.path(), message: format!("unexpected int key {i}") }),
            };
            if k == "step" {
                if counts_steps {
                    p.step = read_step(&v)?;
                }
                continue;
            }
            let Some(&buf) = expected.iter().find(|b| **b == k) else {
                return Err(E::BadValue {
                    path: v.path(),
                    message: format!(
                        "torch.optim.{} configured as this optimizer keeps {expected:?}, not {k:?}",
                        torch_class(kind)
                    ),
                });
            };
            if v.is_none() {
                continue; // SGD without momentum may store momentum_buffer = None
            }
            let t = v.as_tensor()?;
            if t.size() != lay.shape {
                return Err(E::ShapeMismatch {
                    path: v.path(),
                    target: name.to_string(),
                    expected: lay.shape.clone(),
                    found: t.size(),
                });
            }
            let ok = if exact_dtypes { t.kind() == lay.state_kind } else { is_floating(t.kind()) };
            if !ok {
                return Err(E::DtypeMismatch {
                    path: v.path(),
                    target: name.to_string(),
                    expected: format!("{:?} (the optimizer keeps this state in it)", lay.state_kind),
                    found: t.kind(),
                });
            }
            if !super::model::all_finite(t)? {
                return Err(E::NonFinite { path: v.path() });
            }
            if t.kind() != lay.state_kind {
                converted.push((v.path(), t.kind(), lay.state_kind));
            }
            let t = t.f_to_kind(lay.state_kind).and_then(|t| t.f_detach_copy()).ctx("copying optimizer state")?;
            p.buffers.insert(buf.to_string(), t);
        }
        if !p.buffers.is_empty() && p.buffers.len() != expected.len() {
            let have: Vec<&str> = p.buffers.keys().map(String::as_str).collect();
            return Err(E::BadValue {
                path: st.path(),
                message: format!("has {have:?}; torch.optim.{} keeps {expected:?} together", torch_class(kind)),
            });
        }
        if counts_steps && !p.buffers.is_empty() && p.step == 0 {
            return Err(E::BadValue { path: st.path(), message: "has optimizer state but no step (or step 0)".into() });
        }
    }

    // Learning rates: one per tch group; a single value when they are all the same.
    let lr = group_lrs.first().copied().unwrap_or_else(|| optimizer.lr());
    let uniform = tch_lr.values().all(|(v, _)| v.to_bits() == lr.to_bits());
    let group_lr = if uniform { BTreeMap::new() } else { tch_lr.into_iter().map(|(g, (v, _))| (g, v)).collect() };
    let steps = params.iter().map(|p| p.step).max().unwrap_or(0);
    let record = OptimizerRecord {
        kind: kind.to_string(),
        hyper_parameters: ours.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        lr,
        group_lr,
        groups: Vec::new(),
        steps,
        skipped: 0,
        params,
    };
    Ok(LoadedRecord { record, converted, ignored_keys })
}

/// The group dict of tch-amp's `kind` with its hyper-parameters, in torch 2.13's key order.
fn group_dict(record: &OptimizerRecord, fused: bool, lr: f64) -> Result<Dict> {
    let hp =
        |name: &str| -> Result<f64> {
            record.hyper_parameters.get(name).copied().ok_or_else(|| E::Options {
                message: format!("the {} record has no hyper-parameter {name}", record.kind),
            })
        };
    let fl = |name: &str| -> Result<Value> { Ok(Value::Bool(hp(name)? != 0.0)) };
    let num = |name: &str| -> Result<Value> { Ok(Value::Float(hp(name)?)) };
    let mut g = Dict::new();
    g.insert("lr", Value::Float(lr));
    match record.kind.as_str() {
        "sgd" => {
            g.insert("momentum", num("momentum")?);
            g.insert("dampening", num("dampening")?);
            g.insert("weight_decay", num("weight_decay")?);
            g.insert("nesterov", fl("nesterov")?);
            g.insert("maximize", fl("maximize")?);
            g.insert("foreach", Value::None);
            g.insert("differentiable", Value::Bool(false));
            g.insert("fused", Value::None);
        }
        "adam" | "adamw" => {
            g.insert("betas", Value::Tuple(vec![num("beta1")?, num("beta2")?]));
            g.insert("eps", num("eps")?);
            g.insert("weight_decay", num("weight_decay")?);
            g.insert("amsgrad", fl("amsgrad")?);
            g.insert("maximize", fl("maximize")?);
            g.insert("foreach", Value::None);
            g.insert("capturable", Value::Bool(false));
            g.insert("differentiable", Value::Bool(false));
            g.insert("fused", if fused { Value::Bool(true) } else { Value::None });
            g.insert("decoupled_weight_decay", Value::Bool(record.kind == "adamw"));
        }
        "rmsprop" => {
            g.insert("momentum", num("momentum")?);
            g.insert("alpha", num("alpha")?);
            g.insert("eps", num("eps")?);
            g.insert("centered", fl("centered")?);
            g.insert("weight_decay", num("weight_decay")?);
            g.insert("capturable", Value::Bool(false));
            g.insert("foreach", Value::None);
            g.insert("maximize", fl("maximize")?);
            g.insert("differentiable", Value::Bool(false));
        }
        other => {
            return Err(E::Options { message: format!("no torch.optim class for a {other:?} optimizer") });
        }
    }
    Ok(g)
}

/// Writes `record` (of `optimizer`) as torch.optim's state dict (see
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
        return Err(E::Options {
            message: format!("optimizer {index}: the record covers {rec_names:?}, the optimizer {names:?}"),
        });
    }
    let sizes: Vec<usize> = order.iter().map(Vec::len).collect();
    check_order(order, &sizes, optimizer, index).map_err(|e| match e {
        E::ParamOrder { reason, .. } => E::Options { message: format!("param_order of optimizer {index}: {reason}") },
        other => other,
    })?;
    let position: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let config = optimizer.config().ok_or_else(|| E::Options {
        message: "torch checkpoints hold torch.optim optimizers: this optimizer runs a user's UpdateRule".into(),
    })?;
    let buffer_order = config.buffer_names();
    let fused = config.is_fused();
    let counts_steps = record.kind != "sgd";
    let mut state = Dict::new();
    let mut groups = Vec::with_capacity(order.len());
    let mut next: i64 = 0;
    for (gi, g_names) in order.iter().enumerate() {
        let mut lr: Option<f64> = None;
        let mut ids = Vec::with_capacity(g_names.len());
        for name in g_names {
            let pos = position[name.as_str()];
            let p = &record.params[pos];
            let this_lr = record.group_lr.get(&layout[pos].group).copied().unwrap_or(record.lr);
            match lr {
                Some(l) if l.to_bits() != this_lr.to_bits() => {
                    return Err(E::Options {
                        message: format!(
                            "param_order of optimizer {index}: group {gi} holds parameters with learning rates {l:?} \
                             and {this_lr:?} ({name}); torch keeps one per group"
                        ),
                    })
                }
                _ => lr = Some(this_lr),
            }
            if !p.buffers.is_empty() || (counts_steps && p.step > 0) {
                let mut st = Dict::new();
                if counts_steps {
                    let step = p.step.min(TORCH_STEP_LIMIT) as f64;
                    st.insert(
                        "step",
                        Value::Tensor(Tensor::f_scalar_tensor(step, (Kind::Float, Device::Cpu)).ctx("step")?),
                    );
                }
                for buf in buffer_order {
                    if let Some(t) = p.buffers.get(*buf) {
                        st.insert(*buf, Value::Tensor(t.f_detach().ctx("optimizer state")?));
                    }
                }
                state.insert(next, Value::Dict(st));
            }
            ids.push(Value::Int(next));
            next += 1;
        }
        let mut g = Dict::new();
        if let Some(prefix) = names_prefix {
            g.insert("param_names", Value::List(g_names.iter().map(|n| Value::Str(format!("{prefix}{n}"))).collect()));
        }
        for (k, v) in group_dict(record, fused, lr.unwrap_or(record.lr))?.iter() {
            g.insert(k.clone(), v.shallow_clone());
        }
        g.insert("params", Value::List(ids));
        groups.push(Value::Dict(g));
    }
    Ok(Value::Dict(Dict::new().with("state", Value::Dict(state)).with("param_groups", Value::List(groups))))
}

/// The optimizer configuration and learning rate a torch.optim state dict was made with (see
/// [`super::optimizer_config`]).
pub(super) fn config_from_node(node: &Node<'_>) -> Result<(OptimizerConfig, f64)> {
    let groups = node.get("param_groups")?.elements()?;
    let g = groups.first().ok_or_else(|| E::BadValue { path: node.path(), message: "no param groups".into() })?;
    let kind = match FileKind::of(g)? {
        FileKind::Sgd => "sgd",
        FileKind::Adam => "adam",
        FileKind::AdamW => "adamw",
        FileKind::RmsProp => "rmsprop",
        FileKind::AdamFamily => {
            return Err(E::BadValue {
                path: g.path(),
                message: "an Adam-family group without decoupled_weight_decay (written by torch < 2.6): Adam and \
                          AdamW cannot be told apart; build the optimizer yourself"
                    .into(),
            })
        }
    };
    let v: BTreeMap<&str, f64> = group_hypers(g, kind)?.into_iter().collect();
    for other in &groups[1..] {
        let w: BTreeMap<&str, f64> = group_hypers(other, kind)?.into_iter().collect();
        if let Some((name, _)) = v.iter().find(|(k, x)| w.get(*k) != Some(*x)) {
            return Err(E::BadValue {
                path: other.path(),
                message: format!(
                    "{name} differs from param group 0's: tch-amp's optimizers have one set of hyper-parameters \
                     besides the learning rate"
                ),
            });
        }
    }
    let on = |k: &str| v[k] != 0.0;
    let fused = matches!(kind, "adam" | "adamw")
        && match g.get_opt("fused")? {
            Some(n) if !n.is_none() => n.as_bool()?,
            _ => false,
        };
    let config: OptimizerConfig = match kind {
        "sgd" => nn::Sgd {
            momentum: v["momentum"],
            dampening: v["dampening"],
            wd: v["weight_decay"],
            nesterov: on("nesterov"),
        }
        .into(),
        "adam" => nn::Adam {
            beta1: v["beta1"],
            beta2: v["beta2"],
            wd: v["weight_decay"],
            eps: v["eps"],
            amsgrad: on("amsgrad"),
        }
        .into(),
        "adamw" => nn::AdamW {
            beta1: v["beta1"],
            beta2: v["beta2"],
            wd: v["weight_decay"],
            eps: v["eps"],
            amsgrad: on("amsgrad"),
        }
        .into(),
        _ => nn::RmsProp {
            alpha: v["alpha"],
            eps: v["eps"],
            wd: v["weight_decay"],
            momentum: v["momentum"],
            centered: on("centered"),
        }
        .into(),
    };
    let lr = number(&g.get("lr")?)?;
    Ok((config.maximize(on("maximize")).fused(fused), lr))
}
