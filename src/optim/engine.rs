//! The optimizer behind [`crate::AmpOptimizer`]: torch.optim's parameter groups (each with its
//! learning rate, hyper-parameters and step count), the per-parameter state, and one call of
//! the [`UpdateRule`] per step over the parameters that have a gradient.
use crate::error::ConfigError;
use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use super::rule::{GroupView, HyperParams, ParamState, ParamView, StateShape, StateSpec, UpdateRule};
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
    /// The dtype state tensors shaped like their parameter are stored in between steps
    /// (`None`: the dtype they are computed in). The rule always sees them in fp32.
    state_storage: Option<Kind>,
    /// Parameters another process updates (a sharded optimizer): never stepped, no state.
    skipped: Vec<bool>,
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
            state_storage: config.and_then(|c| c.stored_state_dtype()),
            skipped: Vec::new(),
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
            self.push_param(name, t, index);
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
        self.skipped.push(false);
    }

    /// Which parameters another process updates: they are never stepped and keep no state.
    pub(crate) fn set_skipped(&mut self, skipped: Vec<bool>) {
        for (st, &skip) in self.state.iter_mut().zip(&skipped) {
            if skip {
                *st = ParamState::default();
            }
        }
        self.skipped = skipped;
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
        if self.low_in_fp32(param_kind) {
            Kind::Float
        } else {
            param_kind
        }
    }

    /// Whether a parameter of `kind` without a master is updated in an fp32 copy (fp32 state,
    /// or state stored in another dtype, which the rule sees in fp32).
    fn low_in_fp32(&self, kind: Kind) -> bool {
        (self.fp32_state || self.state_storage.is_some()) && is_low_precision(kind)
    }

    /// The dtype and shape `spec` expects for a parameter whose update target (its master, or
    /// itself) has `kind` and `shape`, as the state is stored between steps.
    pub(crate) fn stored_state(&self, spec: &StateSpec, kind: Kind, shape: &[i64]) -> (Kind, Vec<i64>) {
        let (k, shape) = spec.expected_shape(shape, self.state_kind(kind));
        match (self.state_storage, spec.shape()) {
            (Some(storage), StateShape::LikeParam) => (storage, shape),
            _ => (k, shape),
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
        for ((st, (step, buffers)), &skip) in self.state.iter_mut().zip(states).zip(&self.skipped) {
            if !skip {
                st.step = step;
                st.buffers = buffers;
            }
        }
    }

    /// Restores the state of some parameters only (by index), leaving the others as they are.
    pub(crate) fn restore_params(&mut self, states: Vec<(usize, u64, ParamStateBuffers)>) {
        for (i, step, buffers) in states {
            if !self.skipped[i] {
                self.state[i].step = step;
                self.state[i].buffers = buffers;
            }
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

    /// The parameters in the order the rule sees them: group by group, each group's in the step
    /// order (torch's parameter order).
    pub(crate) fn view_order(&self) -> Vec<usize> {
        let n = self.params.len();
        let mut order: Vec<usize> = self.step_order.clone();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        if !sorted.iter().copied().eq(0..n) {
            order = (0..n).collect();
        }
        (0..self.groups.len()).flat_map(|gi| order.iter().copied().filter(move |&i| self.group_of[i] == gi)).collect()
    }

    /// Whether the rule combines the gradients of every parameter (LAMB's global gradient norm):
    /// it is then handed that norm when it sees only some parameters at a time.
    pub(crate) fn needs_global_norm(&self) -> bool {
        self.config.is_some_and(|c| matches!(c.algorithm(), super::rules::Algorithm::FusedLamb(_)))
    }

    /// Per parameter this process steps (in [`Self::view_order`]) that has a gradient: its
    /// gradient's `ord`-norm in fp32, taken on the gradient the rule sees (an fp32 copy for an
    /// fp16/bf16 parameter updated in fp32).
    pub(crate) fn grad_norms(&self, ord: f64) -> Result<Vec<(usize, Tensor)>> {
        let _no_grad = tch::no_grad_guard();
        let mut out = Vec::new();
        for i in self.view_order() {
            let g = self.params[i].grad();
            if self.skipped[i] || !g.defined() {
                continue;
            }
            let g =
                if self.low_in_fp32(self.params[i].kind()) { g.f_to_kind(Kind::Float).ctx("fp32 update")? } else { g };
            out.push((i, crate::sys::vector_norm(&g, ord)?));
        }
        Ok(out)
    }

    /// One update of every parameter this process steps that has a gradient (torch.optim skips
    /// the others), by the rule. Every group with parameters counts a step; every parameter with
    /// a gradient counts an update. `global_norm`: LAMB's global gradient norm when the rule does
    /// not see every parameter (a sharded optimizer).
    ///
    /// The rule sees every parameter at once, unless fp16/bf16 parameters are updated in fp32
    /// copies or the state is stored in another dtype: then it runs one parameter at a time, so
    /// that the fp32 copies of one parameter (and of its state) live at once, not of all (the
    /// built-in rules update each parameter on its own, and LAMB gets its global norm).
    pub(crate) fn step(&mut self, global_norm: Option<Tensor>) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let mut has_params = vec![false; self.groups.len()];
        for &gi in &self.group_of {
            has_params[gi] = true;
        }
        for (g, has) in self.groups.iter_mut().zip(&has_params) {
            if *has {
                g.step += 1;
            }
        }
        let stepping: Vec<usize> =
            self.view_order().into_iter().filter(|&i| !self.skipped[i] && self.params[i].grad().defined()).collect();
        let one_at_a_time =
            self.state_storage.is_some() || stepping.iter().any(|&i| self.low_in_fp32(self.params[i].kind()));
        if !one_at_a_time {
            return self.step_some(&stepping, global_norm);
        }
        let global_norm = match global_norm {
            Some(n) => Some(n),
            None if self.needs_global_norm() => {
                Some(total_of_norms(self.grad_norms(2.0)?.into_iter().map(|(_, n)| n).collect(), 2.0)?)
            }
            None => None,
        };
        for &i in &stepping {
            self.step_some(&[i], global_norm.as_ref().map(Tensor::shallow_clone))?;
        }
        Ok(())
    }

    /// The rule's update of the parameters `indices` (in view order, each with a gradient).
    fn step_some(&mut self, indices: &[usize], global_norm: Option<Tensor>) -> Result<()> {
        let storage = self.state_storage;
        // State tensors stored in another dtype, by group: the rule sees them in fp32.
        let compact: Vec<Vec<String>> = self
            .groups
            .iter()
            .map(|g| {
                self.rule
                    .state_spec(&g.hyper)
                    .into_iter()
                    .filter(|s| storage.is_some() && s.shape() == StateShape::LikeParam)
                    .map(|s| s.name().to_string())
                    .collect()
            })
            .collect();
        let mut per_group: Vec<Vec<ParamView<'_>>> = self.groups.iter().map(|_| Vec::new()).collect();
        let mut write_back: Vec<(Tensor, Tensor)> = Vec::new();
        let mut stored: Vec<usize> = Vec::new();
        let mut states: Vec<Option<&mut ParamState>> = self.state.iter_mut().map(Some).collect();
        for &i in indices {
            let (param, name, gi) = (&self.params[i], &self.names[i], self.group_of[i]);
            let Some(st) = states[i].take() else { continue };
            let grad = param.grad();
            // fp16/bf16 parameters without masters (O3) run in their own dtype as in torch.optim
            // and Apex, or, with fp32_optimizer_state, in fp32 with fp32 state, rounded once: in
            // fp16, Adam's eps (1e-8) rounds to 0 and tiny squared gradients underflow, so the
            // fp16 update divides by zero.
            let low = (self.fp32_state || storage.is_some()) && is_low_precision(param.kind());
            let (p, grad) = if low {
                let p = param.f_to_kind(Kind::Float).ctx("fp32 update")?;
                write_back.push((param.shallow_clone(), p.shallow_clone()));
                (p, grad.f_to_kind(Kind::Float).ctx("fp32 update")?)
            } else {
                (param.shallow_clone(), grad)
            };
            if !compact[gi].is_empty() {
                for (k, v) in st.buffers.iter_mut() {
                    if compact[gi].contains(k) {
                        *v = v.f_to_kind(Kind::Float).ctx("widening stored optimizer state")?;
                    }
                }
                stored.push(i);
            }
            st.step += 1;
            per_group[gi].push(ParamView { name, param: p, grad, state: st });
        }
        let mut views: Vec<GroupView<'_>> = self
            .groups
            .iter()
            .zip(per_group)
            .map(|(g, params)| GroupView {
                id: g.id,
                lr: g.lr,
                hyper: &g.hyper,
                step: g.step,
                params,
                global_grad_norm: global_norm.as_ref().map(Tensor::shallow_clone),
            })
            .collect();
        let result = self.rule.step(&mut views);
        drop(views);
        // Stored state goes back to its storage dtype (rounded once per step) even after a
        // failure, so that it keeps the dtype records expect.
        if let Some(kind) = storage {
            for i in stored {
                let names = &compact[self.group_of[i]];
                for (k, v) in self.state[i].buffers.iter_mut() {
                    if names.contains(k) && v.kind() != kind {
                        *v = v.f_to_kind(kind).ctx("storing optimizer state")?;
                    }
                }
            }
        }
        result?;
        for (mut target, p) in write_back {
            target.f_copy_(&p).ctx("rounding an fp32 update")?;
        }
        Ok(())
    }
}

/// The `ord`-norm of per-tensor norms (0-dim fp32, in order): torch's `clip_grad_norm_` total,
/// `vector_norm(stack(norms))`; 0 for none.
pub(crate) fn total_of_norms(norms: Vec<Tensor>, ord: f64) -> Result<Tensor> {
    if norms.is_empty() {
        return Tensor::f_zeros([], (Kind::Float, tch::Device::Cpu)).ctx("a gradient norm");
    }
    let stacked = Tensor::f_stack(&norms, 0).ctx("stacking gradient norms")?;
    crate::sys::vector_norm(&stacked, ord)
}

/// A parameter's state tensors by name.
pub(crate) type ParamStateBuffers = BTreeMap<String, Tensor>;
