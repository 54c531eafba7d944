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
pub(crate) struct Optimizer {
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

impl Optimizer {
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

// ---- Updating one parameter slice by slice -----------------------------------------------------
// O2's step materializes each fp32 master gradient a slice at a time, right before its update
// (src/optim/amp_optimizer.rs), so that no full-size fp32 gradient exists. For an elementwise
// rule ([`UpdateRule::is_elementwise`]) updating a parameter slice by slice gives its
// whole-tensor update bit for bit: the rule is called with a group holding only the slice
// (`param`, `grad` and a `ParamState` whose buffers are views of the full-size state).

/// One slice of a parameter's gradient for [`Optimizer::update_in_slices`]: the fp32 gradient
/// of the flat elements `[start, start + grad.numel())`.
pub(crate) struct GradSlice {
    pub(crate) start: i64,
    pub(crate) grad: Tensor,
}

impl Optimizer {
    /// Whether [`Self::update_in_slices`] may be used (the rule is elementwise).
    pub(crate) fn updates_in_slices(&self) -> bool {
        self.rule.is_elementwise()
    }

    /// Updates parameter `i` (contiguous, fp32 or fp64) from its gradient given slice by slice:
    /// `next` yields the slices in order until the parameter is covered (`None` ends it), and
    /// `done(start, len)` runs after each slice's update (O2 rounds the updated master slice into
    /// the model there). The parameter's update count goes up once; the group's step count is
    /// the one [`Self::step`] set this step (it runs first). State tensors the rule creates at a
    /// parameter's first update are created full-size and filled slice by slice.
    pub(crate) fn update_in_slices(
        &mut self,
        i: usize,
        next: &mut dyn FnMut() -> Result<Option<GradSlice>>,
        done: &mut dyn FnMut(i64, i64) -> Result<()>,
    ) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let gi = self.group_of[i];
        let group = &self.groups[gi];
        let param = self.params[i].shallow_clone();
        let name = self.names[i].as_str();
        let st = &mut self.state[i];
        st.step += 1;
        let flat = |t: &Tensor| t.f_view([-1]).ctx("a parameter slice");
        let param_flat = flat(&param)?;
        let numel = param_flat.numel() as i64;
        // Existing state: flat views (parameter-shaped) or as they are (0-dim).
        let mut state_flat: Vec<(String, Tensor, bool)> = Vec::new();
        for (k, t) in &st.buffers {
            let like_param = t.numel() as i64 == numel && t.dim() > 0;
            state_flat.push((k.clone(), if like_param { flat(t)? } else { t.shallow_clone() }, like_param));
        }
        while let Some(GradSlice { start, grad }) = next()? {
            let len = grad.numel() as i64;
            let slice = |t: &Tensor| {
                if len == numel {
                    Ok(t.shallow_clone())
                } else {
                    t.f_narrow(0, start, len).ctx("a parameter slice")
                }
            };
            let p = slice(&param_flat)?;
            let mut view = ParamState { step: st.step, buffers: BTreeMap::new() };
            for (k, t, like_param) in &state_flat {
                view.buffers.insert(k.clone(), if *like_param { slice(t)? } else { t.shallow_clone() });
            }
            {
                let pv = ParamView { name, param: p, grad, state: &mut view };
                let mut views =
                    [GroupView { id: group.id, lr: group.lr, hyper: &group.hyper, step: group.step, params: vec![pv] }];
                self.rule.step(&mut views)?;
            }
            // State created for this slice (the parameter's first update): into full-size state.
            for (k, t) in view.buffers {
                if state_flat.iter().any(|(name, _, _)| *name == k) {
                    continue;
                }
                if !st.buffers.contains_key(&k) {
                    let full =
                        Tensor::f_empty(param.size(), (t.kind(), t.device())).ctx("allocating optimizer state")?;
                    st.buffers.insert(k.clone(), full);
                }
                flat(&st.buffers[&k])?
                    .f_narrow(0, start, len)
                    .and_then(|mut s| s.f_copy_(&t))
                    .ctx("optimizer state slice")?;
            }
            done(start, len)?;
        }
        Ok(())
    }
}
