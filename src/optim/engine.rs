//! The optimizer behind [`crate::AmpOptimizer`]: torch.optim's parameter groups (each with its
//! learning rate, hyper-parameters and step count), the per-parameter state, and one call of
//! the [`UpdateRule`] per step over the parameters that have a gradient.
use crate::error::ConfigError;
use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use super::rule::{GroupView, HyperParams, ParamState, ParamView, UpdateRule};
use super::rules::OptimizerConfig;
use crate::dtype::is_low_precision;
use crate::error::{AmpError, Result, TorchContext};

/// One parameter group (torch.optim's `param_groups[i]`).
#[derive(Debug, Clone)]
pub(crate) struct Group {
    /// Its id: the tch group (`Path::set_group`) for groups made from a VarStore's groups, else
    /// its position.
    pub(crate) id: usize,
    pub(crate) lr: f64,
    /// Every key of the rule's defaults, with this group's values.
    pub(crate) hyper: HyperParams,
    /// Steps of this group (Apex's `group["step"]`).
    pub(crate) step: u64,
}

/// An optimizer over a list of parameters (fp32 masters under O2), in groups.
#[derive(Debug)]
pub(crate) struct Engine {
    rule: Box<dyn UpdateRule>,
    /// The built-in configuration the rule was made from (`None` for a user's rule).
    config: Option<OptimizerConfig>,
    defaults: HyperParams,
    /// The learning rate groups get unless they set their own.
    lr: f64,
    groups: Vec<Group>,
    params: Vec<Tensor>,
    names: Vec<String>,
    /// Index into `groups` of each parameter.
    group_of: Vec<usize>,
    state: Vec<ParamState>,
    /// The order the rule sees the parameters in (indices into `params`; empty: as stored).
    step_order: Vec<usize>,
    /// fp16/bf16 parameters are updated in fp32 with fp32 state (else in their own dtype, as
    /// torch.optim and Apex's O3 do).
    fp32_state: bool,
}

/// Checks a learning rate as torch.optim does, and that it is finite.
pub(crate) fn check_lr(lr: f64) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(())
    } else {
        Err(AmpError::Config(ConfigError::InvalidOption {
            option: "lr",
            value: lr.to_string(),
            expected: "a finite number >= 0",
        }))
    }
}

impl Engine {
    /// An optimizer with no parameter and no group yet.
    pub(crate) fn new(
        rule: Box<dyn UpdateRule>,
        config: Option<OptimizerConfig>,
        lr: f64,
        fp32_state: bool,
    ) -> Result<Self> {
        check_lr(lr)?;
        let defaults = rule.defaults();
        rule.validate(lr, &defaults)?;
        Ok(Self {
            rule,
            config,
            defaults,
            lr,
            groups: Vec::new(),
            params: Vec::new(),
            names: Vec::new(),
            group_of: Vec::new(),
            state: Vec::new(),
            step_order: Vec::new(),
            fp32_state,
        })
    }

    /// The group's full hyper-parameters: the defaults with `overrides` applied, checked.
    pub(crate) fn group_hyper(&self, lr: f64, overrides: &HyperParams) -> Result<HyperParams> {
        let mut hyper = self.defaults.clone();
        for (k, v) in overrides.iter() {
            if !hyper.contains(k) {
                return Err(AmpError::Config(ConfigError::UnknownHyperParameter {
                    name: k.to_string(),
                    known: self.defaults.keys().map(str::to_string).collect(),
                }));
            }
            hyper.set(k, v);
        }
        check_lr(lr)?;
        self.rule.validate(lr, &hyper)?;
        Ok(hyper)
    }

    /// Appends a group over `params` (names and update targets), already checked by
    /// [`Self::group_hyper`]. Returns its index.
    pub(crate) fn push_group(
        &mut self,
        id: usize,
        lr: f64,
        hyper: HyperParams,
        params: Vec<(String, Tensor)>,
    ) -> usize {
        let index = self.groups.len();
        self.groups.push(Group { id, lr, hyper, step: 0 });
        for (name, t) in params {
            self.names.push(name);
            self.params.push(t);
            self.group_of.push(index);
            self.state.push(ParamState::default());
        }
        index
    }

    /// Places parameter `i` (already pushed) in group `index` (for optimizers whose order is
    /// not group-major: the VarStore's groups over name-sorted parameters).
    pub(crate) fn push_param(&mut self, name: String, t: Tensor, group_index: usize) {
        self.names.push(name);
        self.params.push(t);
        self.group_of.push(group_index);
        self.state.push(ParamState::default());
    }

    /// Appends an empty group.
    pub(crate) fn push_empty_group(&mut self, id: usize, lr: f64, hyper: HyperParams) -> usize {
        self.groups.push(Group { id, lr, hyper, step: 0 });
        self.groups.len() - 1
    }

    /// The order [`Self::step`] hands the parameters to the rule in (a permutation of the
    /// parameters' indices; anything else keeps the stored order).
    pub(crate) fn set_step_order(&mut self, order: Vec<usize>) {
        self.step_order = order;
    }

    pub(crate) fn rule(&self) -> &dyn UpdateRule {
        &*self.rule
    }

    pub(crate) fn config(&self) -> Option<OptimizerConfig> {
        self.config
    }

    pub(crate) fn defaults(&self) -> &HyperParams {
        &self.defaults
    }

    pub(crate) fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// Index into [`Self::groups`] of each parameter.
    pub(crate) fn group_of(&self) -> &[usize] {
        &self.group_of
    }

    pub(crate) fn group_index(&self, id: usize) -> Option<usize> {
        self.groups.iter().position(|g| g.id == id)
    }

    /// The dtype of the optimizer state of a parameter of `param_kind`: its own, or fp32 for
    /// fp16/bf16 parameters when the state is kept in fp32.
    pub(crate) fn state_kind(&self, param_kind: Kind) -> Kind {
        if self.fp32_state && is_low_precision(param_kind) {
            Kind::Float
        } else {
            param_kind
        }
    }

    /// The learning rate of groups without their own.
    pub(crate) fn lr(&self) -> f64 {
        self.lr
    }

    /// Sets the learning rate of every group (torch: `for g in param_groups: g["lr"] = lr`).
    pub(crate) fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_lr(lr)?;
        for g in &self.groups {
            self.rule.validate(lr, &g.hyper)?;
        }
        self.lr = lr;
        self.groups.iter_mut().for_each(|g| g.lr = lr);
        Ok(())
    }

    /// Sets the learning rate of the group at `index`.
    pub(crate) fn set_group_lr(&mut self, index: usize, lr: f64) -> Result<()> {
        check_lr(lr)?;
        self.rule.validate(lr, &self.groups[index].hyper)?;
        self.groups[index].lr = lr;
        Ok(())
    }

    /// Sets one hyper-parameter of the group at `index`.
    pub(crate) fn set_group_hyper(&mut self, index: usize, key: &str, value: f64) -> Result<()> {
        let g = &self.groups[index];
        let hyper = self.group_hyper(g.lr, &g.hyper.clone().with(key, value))?;
        self.groups[index].hyper = hyper;
        Ok(())
    }

    /// The state of every parameter, in order.
    pub(crate) fn states(&self) -> &[ParamState] {
        &self.state
    }

    /// Replaces the default learning rate, the groups' settings and the per-parameter state
    /// (already validated by the caller; `groups` in this optimizer's group order).
    pub(crate) fn restore(
        &mut self,
        lr: f64,
        groups: Vec<(f64, HyperParams, u64)>,
        states: Vec<(u64, ParamStateBuffers)>,
    ) {
        self.lr = lr;
        for (g, (glr, hyper, step)) in self.groups.iter_mut().zip(groups) {
            g.lr = glr;
            g.hyper = hyper;
            g.step = step;
        }
        for (st, (step, buffers)) in self.state.iter_mut().zip(states) {
            st.step = step;
            st.buffers = buffers;
        }
    }

    /// Restores the state of some parameters only (by index), leaving the others as they are.
    pub(crate) fn restore_params(&mut self, states: Vec<(usize, u64, ParamStateBuffers)>) {
        for (i, step, buffers) in states {
            self.state[i].step = step;
            self.state[i].buffers = buffers;
        }
    }

    /// Restores the settings of some groups only (by index).
    pub(crate) fn restore_groups(&mut self, groups: Vec<(usize, f64, HyperParams, u64)>) {
        for (i, lr, hyper, step) in groups {
            self.groups[i].lr = lr;
            self.groups[i].hyper = hyper;
            self.groups[i].step = step;
        }
    }

    /// Sets the default learning rate (already checked).
    pub(crate) fn set_default_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// One update of every parameter that has a gradient (torch.optim skips the others), by
    /// the rule. Every group with parameters counts a step; every parameter with a gradient
    /// counts an update.
    pub(crate) fn step(&mut self) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let mut per_group: Vec<Vec<ParamView<'_>>> = self.groups.iter().map(|_| Vec::new()).collect();
        let mut write_back: Vec<(Tensor, Tensor)> = Vec::new();
        let mut has_params = vec![false; self.groups.len()];
        let n = self.params.len();
        let mut order: Vec<usize> = self.step_order.clone();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        if !sorted.iter().copied().eq(0..n) {
            order = (0..n).collect();
        }
        let mut states: Vec<Option<&mut ParamState>> = self.state.iter_mut().map(Some).collect();
        for i in order {
            let (param, name, gi) = (&self.params[i], &self.names[i], self.group_of[i]);
            let Some(st) = states[i].take() else { continue };
            has_params[gi] = true;
            let grad = param.grad();
            if !grad.defined() {
                continue;
            }
            // fp16/bf16 parameters without masters (O3) run in their own dtype as in torch.optim
            // and Apex, or, with fp32_optimizer_state, in fp32 with fp32 state, rounded once: in
            // fp16, Adam's eps (1e-8) rounds to 0 and tiny squared gradients underflow, so the
            // fp16 update divides by zero.
            let low = self.fp32_state && is_low_precision(param.kind());
            let (p, grad) = if low {
                let p = param.f_to_kind(Kind::Float).ctx("fp32 update")?;
                write_back.push((param.shallow_clone(), p.shallow_clone()));
                (p, grad.f_to_kind(Kind::Float).ctx("fp32 update")?)
            } else {
                (param.shallow_clone(), grad)
            };
            st.step += 1;
            per_group[gi].push(ParamView { name, param: p, grad, state: st });
        }
        for (g, has) in self.groups.iter_mut().zip(&has_params) {
            if *has {
                g.step += 1;
            }
        }
        let mut views: Vec<GroupView<'_>> = self
            .groups
            .iter()
            .zip(per_group)
            .map(|(g, params)| GroupView { id: g.id, lr: g.lr, hyper: &g.hyper, step: g.step, params })
            .collect();
        self.rule.step(&mut views)?;
        drop(views);
        for (mut target, p) in write_back {
            target.f_copy_(&p).ctx("rounding an fp32 update")?;
        }
        Ok(())
    }
}

/// A parameter's state tensors by name.
pub(crate) type ParamStateBuffers = BTreeMap<String, Tensor>;
