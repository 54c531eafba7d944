//! [`ParamGroup`]: torch.optim's parameter groups for a VarStore. A group selects trainable
//! variables by name (path prefixes, exact names, a predicate, or "everything no other group
//! took") and overrides any of the optimizer's hyper-parameters for them, the learning rate
//! included: the BERT `no_decay` groups, per-group betas or eps.
use crate::error::ConfigError;
use std::fmt;
use std::sync::Arc;

use tch::nn::VarStore;
use tch::Tensor;

use super::params::{trainable, under_prefix, ParamEntry};
use super::rule::HyperParams;
use crate::error::{AmpError, Result};

/// A predicate over a variable's name and the variable.
type VarPredicate = Arc<dyn Fn(&str, &Tensor) -> bool + Send + Sync>;

/// Which variables a group takes.
#[derive(Clone)]
pub(crate) enum Selector {
    /// Under these path prefixes (whole segments); empty: every variable.
    Prefixes(Vec<String>),
    /// Exactly these names.
    Names(Vec<String>),
    /// Those whose name satisfies the predicate.
    Matching(Arc<dyn Fn(&str) -> bool + Send + Sync>),
    /// Those whose name and variable satisfy the predicate.
    MatchingVar(VarPredicate),
    /// Every variable no other group of the same call (or of the optimizer, for
    /// `add_param_group`) takes.
    Rest,
}

impl fmt::Debug for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Selector::Prefixes(p) => f.debug_tuple("Prefixes").field(p).finish(),
            Selector::Names(n) => f.debug_tuple("Names").field(n).finish(),
            Selector::Matching(_) => f.write_str("Matching(..)"),
            Selector::MatchingVar(_) => f.write_str("MatchingVar(..)"),
            Selector::Rest => f.write_str("Rest"),
        }
    }
}

impl Selector {
    /// Whether variable `name` (`var`) is selected (`Rest` answers false: it is resolved by the
    /// caller).
    pub(crate) fn selects(&self, name: &str, var: &Tensor) -> bool {
        match self {
            Selector::Prefixes(p) => {
                let p: Vec<&str> = p.iter().map(String::as_str).collect();
                under_prefix(name, &p)
            }
            Selector::Names(n) => n.iter().any(|x| x == name),
            Selector::Matching(f) => f(name),
            Selector::MatchingVar(f) => f(name, var),
            Selector::Rest => false,
        }
    }
}

/// One parameter group of an optimizer (an entry of torch.optim's `param_groups`): which trainable
/// variables of the VarStore it holds, and the hyper-parameters it sets instead of the optimizer's
/// defaults (`lr` included). Keys are those of the optimizer's
/// [`crate::OptimizerConfig::hyper_parameters`] (or a user rule's [`crate::UpdateRule::defaults`]);
/// an unknown key is [`ConfigError::UnknownHyperParameter`].
///
/// Within a group, parameters are in VarStore-name order ([`crate::AmpOptimizer::param_names`]);
/// groups keep the order given. Torch checkpoints write one torch group per `ParamGroup`, in
/// this order, each group's parameters in the model's creation order (Python's registration
/// order, see [`crate::torch_checkpoint::default_param_order`]). A variable
/// that two groups select is [`ConfigError::ParamInTwoGroups`] (torch: "some parameters appear in
/// more than one parameter group"); a trainable variable no group selects is not optimized, as in
/// torch.
///
/// The BERT pattern (`no_decay = ["bias", "LayerNorm.weight"]`):
/// ```
/// use tch_amp::ParamGroup;
/// let no_decay = |n: &str| n.ends_with("bias") || n.contains("LayerNorm");
/// let groups = [
///     ParamGroup::matching(move |n| !no_decay(n)).weight_decay(0.01),
///     ParamGroup::rest().weight_decay(0.0),
/// ];
/// # let _ = groups;
/// ```
#[derive(Debug, Clone)]
pub struct ParamGroup {
    pub(crate) selector: Selector,
    pub(crate) lr: Option<f64>,
    pub(crate) overrides: HyperParams,
}

impl ParamGroup {
    fn new(selector: Selector) -> Self {
        Self { selector, lr: None, overrides: HyperParams::new() }
    }

    /// Every trainable variable.
    pub fn all() -> Self {
        Self::new(Selector::Prefixes(Vec::new()))
    }

    /// The variables under these path prefixes (whole segments: `"layer1"` selects
    /// `layer1.*`, never `layer10.*`).
    pub fn prefixes<S: AsRef<str>>(prefixes: &[S]) -> Self {
        let p: Vec<String> = prefixes.iter().map(|s| s.as_ref().to_string()).collect();
        if p.is_empty() {
            // An empty prefix list would mean "everything"; here it means nothing.
            return Self::new(Selector::Names(Vec::new()));
        }
        Self::new(Selector::Prefixes(p))
    }

    /// Exactly these variables (torch's `{"params": [...]}`).
    pub fn names<S: AsRef<str>>(names: &[S]) -> Self {
        Self::new(Selector::Names(names.iter().map(|s| s.as_ref().to_string()).collect()))
    }

    /// The variables whose name satisfies `predicate`.
    pub fn matching(predicate: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        Self::new(Selector::Matching(Arc::new(predicate)))
    }

    /// The variables for which `predicate(name, variable)` holds: timm's no-weight-decay rule
    /// is `ParamGroup::matching_var(|name, v| v.dim() <= 1 || name.ends_with(".bias"))`.
    pub fn matching_var(predicate: impl Fn(&str, &Tensor) -> bool + Send + Sync + 'static) -> Self {
        Self::new(Selector::MatchingVar(Arc::new(predicate)))
    }

    /// Every trainable variable that no other group takes (no other group of the same call;
    /// for [`crate::AmpOptimizer::add_param_group`], none already in the optimizer).
    pub fn rest() -> Self {
        Self::new(Selector::Rest)
    }

    /// The group's learning rate (default: the optimizer's).
    pub fn lr(mut self, lr: f64) -> Self {
        self.lr = Some(lr);
        self
    }

    /// Sets a hyper-parameter by name (`"momentum"`, `"eps"`, `"max_grad_norm"`, ...).
    pub fn set(mut self, key: &str, value: f64) -> Self {
        if key == "lr" {
            self.lr = Some(value);
        } else {
            self.overrides.set(key, value);
        }
        self
    }

    /// Sets a flag hyper-parameter by name (`"nesterov"`, `"amsgrad"`, `"bias_correction"`).
    pub fn set_flag(self, key: &str, on: bool) -> Self {
        self.set(key, if on { 1.0 } else { 0.0 })
    }

    /// `weight_decay`.
    pub fn weight_decay(self, value: f64) -> Self {
        self.set("weight_decay", value)
    }

    /// `betas=(beta1, beta2)`.
    pub fn betas(self, beta1: f64, beta2: f64) -> Self {
        self.set("beta1", beta1).set("beta2", beta2)
    }

    /// `eps`.
    pub fn eps(self, value: f64) -> Self {
        self.set("eps", value)
    }

    /// `momentum`.
    pub fn momentum(self, value: f64) -> Self {
        self.set("momentum", value)
    }

    /// The hyper-parameters this group overrides (without `lr`).
    pub fn overrides(&self) -> &HyperParams {
        &self.overrides
    }

    /// The learning rate this group sets, if any.
    pub fn lr_override(&self) -> Option<f64> {
        self.lr
    }
}

/// A group with its variables chosen and their entries (masters) made.
#[derive(Debug)]
pub(crate) struct ResolvedGroup {
    pub(crate) lr: Option<f64>,
    pub(crate) overrides: HyperParams,
    pub(crate) entries: Vec<ParamEntry>,
}

/// Chooses the trainable variables of `vs` for each group (`taken`: the names an optimizer already
/// holds, for `add_param_group`) and makes their entries, fp32 masters for the low-precision ones
/// when `master_weights`. Nothing is created when a check fails.
///
/// # Errors
/// [`ConfigError::ParamInTwoGroups`] for a variable two groups (or a group and the optimizer) take;
/// [`ConfigError::UnknownVariable`] for a name that is no trainable variable of `vs`;
/// [`ConfigError::NoVariablesUnder`] for path prefixes under which there is no variable;
/// [`ConfigError::InvalidOption`] for more than one [`ParamGroup::rest`].
pub(crate) fn resolve(
    vs: &VarStore,
    groups: &[ParamGroup],
    taken: &[&str],
    master_weights: bool,
) -> Result<Vec<ResolvedGroup>> {
    if groups.iter().filter(|g| matches!(g.selector, Selector::Rest)).count() > 1 {
        return Err(AmpError::Config(ConfigError::InvalidOption {
            option: "param groups",
            value: "two ParamGroup::rest() groups".into(),
            expected: "at most one ParamGroup::rest()",
        }));
    }
    let candidates = trainable(vs)?;
    let all_names: Vec<String> = vs.variables().into_keys().collect();
    // owner[i]: the group that takes candidate i.
    let mut owner: Vec<Option<usize>> = vec![None; candidates.len()];
    for (gi, g) in groups.iter().enumerate() {
        match &g.selector {
            Selector::Rest => continue,
            Selector::Names(names) => {
                if let Some(missing) = names.iter().find(|n| !candidates.iter().any(|c| &c.name == *n)) {
                    return Err(AmpError::Config(ConfigError::UnknownVariable { name: missing.clone() }));
                }
            }
            Selector::Prefixes(p) if !p.is_empty() => {
                let refs: Vec<&str> = p.iter().map(String::as_str).collect();
                if !all_names.iter().any(|n| under_prefix(n, &refs)) {
                    return Err(AmpError::Config(ConfigError::NoVariablesUnder { prefixes: p.clone() }));
                }
            }
            _ => {}
        }
        for (ci, c) in candidates.iter().enumerate() {
            if !g.selector.selects(&c.name, &c.var) {
                continue;
            }
            if taken.contains(&c.name.as_str()) || owner[ci].is_some() {
                return Err(AmpError::Config(ConfigError::ParamInTwoGroups { name: c.name.clone() }));
            }
            owner[ci] = Some(gi);
        }
    }
    if let Some(rest) = groups.iter().position(|g| matches!(g.selector, Selector::Rest)) {
        for (ci, c) in candidates.iter().enumerate() {
            if owner[ci].is_none() && !taken.contains(&c.name.as_str()) {
                owner[ci] = Some(rest);
            }
        }
    }
    let mut out: Vec<ResolvedGroup> = groups
        .iter()
        .map(|g| ResolvedGroup { lr: g.lr, overrides: g.overrides.clone(), entries: Vec::new() })
        .collect();
    for (c, o) in candidates.into_iter().zip(owner) {
        if let Some(gi) = o {
            out[gi].entries.push(c.into_entry(master_weights)?);
        }
    }
    Ok(out)
}
