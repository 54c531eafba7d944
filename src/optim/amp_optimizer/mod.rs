//! The optimizer `initialize` returns: steps the fp32 masters (O2) or the model's own
//! variables, skips a step after an overflow, clips on the master gradients.
//!
//! An adaptor around an [`UpdateRule`] (run by `engine`), split by job: the user's API and the
//! per-step [`Stage`] here; the hooks `scale_loss` calls (and O2's master gradients) in
//! `protocol`; what it saves and restores in `records`.
use crate::error::{ConfigError, UsageError};

use tch::nn::VarStore;
use tch::Tensor;

use super::engine::Engine;
use super::grads::{clear_grad, clip_grads, scale_clipped, NonFiniteNorm};
use super::groups::{resolve, ParamGroup, ResolvedGroup};
use super::params::{copy_masters_to_model, ParamEntry};
use super::rule::{HyperParams, UpdateRule};
use super::rules::OptimizerConfig;
use crate::error::{mismatch, AmpError, Result, TorchContext};
use crate::scaling::OverflowReport;

mod protocol;
mod records;
mod shard;

pub(crate) use protocol::CollapseInfo;
use protocol::PendingSkip;
pub(crate) use records::{CheckedRecord, ParamLayout};
pub(crate) use shard::Collectives;

/// What [`AmpOptimizer::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutcome {
    /// The parameters were updated.
    Stepped,
    /// The step was skipped because a loss that reached this optimizer overflowed; weights,
    /// masters and optimizer state are untouched, and every gradient of the optimizer (model
    /// and master) is cleared.
    Skipped {
        /// The loss whose scaler saw the overflow.
        loss_id: usize,
        /// That scaler's scale after reducing it.
        loss_scale: f64,
    },
}

impl StepOutcome {
    /// True for [`StepOutcome::Stepped`].
    pub fn stepped(&self) -> bool {
        matches!(self, StepOutcome::Stepped)
    }
}

/// Bytes held by the tensors an optimizer manages, as [`AmpOptimizer::memory`] counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Number of trainable parameters (elements).
    pub params: usize,
    /// The model's trainable variables.
    pub weights: usize,
    /// fp32 master copies (0 without master weights; self-mastered fp32 variables count once,
    /// under `weights`).
    pub masters: usize,
    /// Gradients alive now (model and master).
    pub grads: usize,
    /// Optimizer state (moments, momentum buffers).
    pub optimizer_state: usize,
}

impl MemoryReport {
    /// Everything together.
    pub fn total(&self) -> usize {
        self.weights + self.masters + self.grads + self.optimizer_state
    }
    /// Bytes per trainable parameter.
    pub fn bytes_per_param(&self) -> f64 {
        self.total() as f64 / self.params.max(1) as f64
    }
}

fn bytes(t: &Tensor) -> usize {
    if t.defined() {
        t.numel() * t.kind().elt_size_in_bytes()
    } else {
        0
    }
}

/// The entries' indices in torch's order: the model's creation order with each module's weight
/// before its bias (see [`crate::optim::torch_param_order`]).
fn torch_order(entries: &[ParamEntry]) -> Vec<usize> {
    let mut by_creation: Vec<(usize, &str)> = entries.iter().map(|e| (e.order(), e.name())).collect();
    by_creation.sort_by_key(|&(order, name)| (order, name.to_string()));
    let names = super::params::torch_param_order(by_creation.iter().map(|(_, n)| n.to_string()).collect());
    let index: std::collections::HashMap<&str, usize> =
        entries.iter().enumerate().map(|(i, e)| (e.name(), i)).collect();
    names.iter().filter_map(|n| index.get(n.as_str()).copied()).collect()
}

/// Where an optimizer stands in the per-step order `zero_grad` -> `scale_loss` (one pass or
/// more) -> `clip_grad_norm` -> `step`, as torch's GradScaler keeps an `OptState` per
/// optimizer. Every call checks it; a call out of order is a typed error that changes nothing.
#[derive(Debug, Default)]
enum Stage {
    /// No `scale_loss` pass since the last `step` or `zero_grad`.
    #[default]
    Ready,
    /// A `delay_unscale` pass left the gradients scaled.
    Scaled,
    /// A pass unscaled the gradients (under O2 into the fp32 master gradients).
    Unscaled,
    /// A pass overflowed: the next `step` skips (later passes do not change that).
    Overflowed(PendingSkip),
    /// The gradients vanished with the scale at its floor: the next `step` reports it.
    Vanished(CollapseInfo),
    /// `step` ran: a `scale_loss` pass must come before the next `step` or clip.
    Stepped,
}

/// Which front door drives an optimizer, so that its errors speak that API's words: Apex's
/// `scale_loss` (the default, and after every `scale_loss`), or torch.amp's `GradScaler` (after
/// `scaler.step(&mut opt)`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum FrontDoor {
    #[default]
    Apex,
    TorchAmp,
}

/// A call-order error in the words of `door`: (when, remedy) for Apex's and torch.amp's.
fn call_order(
    door: FrontDoor,
    call: &'static str,
    apex: (&'static str, &'static str),
    torch_amp: (&'static str, &'static str),
) -> AmpError {
    let (when, remedy) = if door == FrontDoor::TorchAmp { torch_amp } else { apex };
    AmpError::Usage(UsageError::CallOrder { call, when, remedy })
}

/// How an [`crate::Amp`] sets up the optimizers it makes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OptimizerSetup {
    /// The id of the `Amp` that made the optimizer (`scale_loss` refuses others' optimizers).
    pub(crate) amp_id: u64,
    /// Run the update with O1's casts off (Apex's optimizers ran outside the patched functions).
    pub(crate) disable_casts_in_step: bool,
    /// Update fp16/bf16 parameters without masters in fp32 with fp32 state.
    pub(crate) fp32_optimizer_state: bool,
    /// fp16/bf16 parameters get fp32 masters (O2), also when added later.
    pub(crate) master_weights: bool,
    /// `scale_loss` hands the loss straight to backward (disabled AMP, or a static scale of 1
    /// without masters): a plain `backward` gives the same gradients.
    pub(crate) pass_through: bool,
}

/// How the parameters of a new optimizer are grouped.
#[derive(Debug)]
pub(crate) enum Layout {
    /// One group per tch group (`Path::set_group`) of the entries, by ascending id; the
    /// parameters in the entries' (name) order.
    TchGroups(Vec<ParamEntry>),
    /// The given groups, in order (id = position); parameters group by group.
    Groups(Vec<ResolvedGroup>),
}

/// An optimizer under AMP. Made by [`crate::Amp::optimizer`] or [`crate::initialize`].
#[derive(Debug)]
pub struct AmpOptimizer {
    setup: OptimizerSetup,
    inner: Engine,
    entries: Vec<ParamEntry>,
    /// Gradients of self-mastered parameters set aside at `scale_loss` entry (accumulation).
    stash: Vec<Option<Tensor>>,
    /// Where the optimizer stands in the per-step order.
    stage: Stage,
    last_overflow: Option<OverflowReport>,
    steps: u64,
    skipped: u64,
    /// The API that drove the last step, for the words of call-order errors.
    door: FrontDoor,
    /// The process group and partition of a sharded optimizer.
    shard: Option<shard::Shard>,
}

impl OptimizerSetup {
    /// torch.optim without AMP: no `Amp`, no masters, no casts; gradients from a plain backward.
    const PLAIN: OptimizerSetup = OptimizerSetup {
        amp_id: 0,
        disable_casts_in_step: false,
        fp32_optimizer_state: false,
        master_weights: false,
        pass_through: true,
    };
}

/// The parameters of `vs` grouped as `groups` select them (empty: one group per tch group),
/// with fp32 masters of the low-precision ones when `masters`.
pub(crate) fn layout(vs: &VarStore, groups: &[ParamGroup], masters: bool) -> Result<Layout> {
    if groups.is_empty() {
        Ok(Layout::TchGroups(super::params::build_entries(vs, &[], masters)?))
    } else {
        Ok(Layout::Groups(resolve(vs, groups, &[], masters)?))
    }
}

impl AmpOptimizer {
    /// torch.optim's optimizer without AMP (`torch.optim.AdamW(params, lr)`, or Apex's
    /// `FusedLAMB`): `config` over the trainable variables of `vs` that `groups` select (each
    /// group with `config`'s hyper-parameters and `lr` unless it sets its own; empty `groups`:
    /// one group per tch group), stepped in their own dtypes, no masters, no casts, gradients
    /// from a plain `backward`. What a torch.amp loop steps through [`crate::GradScaler`];
    /// [`crate::Amp::optimizer`] makes the Apex path's, with masters and `scale_loss`.
    ///
    /// ```
    /// use tch::nn::{self, Module, VarStore};
    /// use tch::{Device, Kind, Tensor};
    /// use tch_amp::{AmpOptimizer, FusedLamb, GradScaler, ParamGroup};
    /// # fn main() -> Result<(), tch_amp::AmpError> {
    /// let vs = VarStore::new(Device::Cpu);
    /// let net = nn::linear(vs.root() / "fc", 8, 2, Default::default());
    /// let groups = [ParamGroup::matching(|n| !n.ends_with("bias")).weight_decay(0.01), ParamGroup::rest()];
    /// let mut opt = AmpOptimizer::new(&vs, FusedLamb::default(), 1e-3, &groups)?;
    /// let mut scaler = GradScaler::new(Device::Cpu);
    /// let x = Tensor::ones([4, 8], (Kind::Float, Device::Cpu));
    /// let loss = tch_amp::autocast(Device::Cpu, || net.forward(&x))?.to_kind(Kind::Float).square().mean(None);
    /// opt.zero_grad()?;
    /// scaler.scale(&loss)?.backward();
    /// assert!(scaler.step(&mut opt)?.stepped());
    /// scaler.update()?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a bad learning rate or setting;
    /// [`ConfigError::ParamInTwoGroups`], [`ConfigError::UnknownVariable`],
    /// [`ConfigError::NoVariablesUnder`] for the selections;
    /// [`ConfigError::UnknownHyperParameter`] for a group's settings.
    pub fn new(vs: &VarStore, config: impl Into<OptimizerConfig>, lr: f64, groups: &[ParamGroup]) -> Result<Self> {
        let config = config.into();
        Self::build(OptimizerSetup::PLAIN, Box::new(config.rule()), Some(config), lr, layout(vs, groups, false)?)
    }

    /// [`Self::new`] running a user's [`UpdateRule`].
    ///
    /// # Errors
    /// As [`Self::new`]; the rule's [`UpdateRule::validate`] errors.
    pub fn with_rule(vs: &VarStore, rule: impl UpdateRule + 'static, lr: f64, groups: &[ParamGroup]) -> Result<Self> {
        Self::build(OptimizerSetup::PLAIN, Box::new(rule), None, lr, layout(vs, groups, false)?)
    }

    /// torch's `ZeroRedundancyOptimizer(params, optimizer_class, process_group=pg, lr=lr)`: the
    /// optimizer of [`Self::new`] sharded over the ranks of `pg` (ZeRO stage 1). The parameters
    /// are partitioned as torch partitions them ([`Self::param_ranks`]: each parameter group in
    /// turn, its parameters largest first, each to the rank holding the fewest elements so far),
    /// so the same rank updates the same parameter as under torch. Each rank keeps the optimizer
    /// state of its shard only and updates only it; `step` then broadcasts every rank's shard
    /// (one collective per parameter, from its rank, as torch), so every rank holds the whole
    /// updated model. Every rank builds it alike and calls `step` (and `clip_grad_norm`,
    /// `consolidate_state_dict`) together: these are collectives, bounded by the group's timeout
    /// ([`AmpError::Distributed`] otherwise).
    ///
    /// Gradients must be the same on every rank: wrap the model in
    /// [`crate::distributed::DistributedDataParallel`] (pass the optimizer to it). Under a
    /// [`crate::GradScaler`] the ranks check their shards' gradients and agree on the inf/NaN
    /// verdict before anyone steps; `clip_grad_norm` clips by the norm over every rank's
    /// gradients, bit for bit the unsharded norm. Checkpoints need the whole state on one rank:
    /// [`Self::consolidate_state_dict`] or [`crate::distributed::save_checkpoint_on_rank0`]. Where
    /// this differs from torch: `docs/distributed.md`.
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn sharded(
        pg: &crate::distributed::ProcessGroup,
        vs: &VarStore,
        config: impl Into<OptimizerConfig>,
        lr: f64,
        groups: &[ParamGroup],
    ) -> Result<Self> {
        let config = config.into();
        let comm: Box<dyn Collectives> = Box::new(pg.clone());
        let layout = layout(vs, groups, false)?;
        Self::build_sharded(OptimizerSetup::PLAIN, Box::new(config.rule()), Some(config), lr, layout, Some(comm))
    }

    /// An optimizer running `rule` (made from `config` for the built-ins) over `layout`.
    pub(crate) fn build(
        setup: OptimizerSetup,
        rule: Box<dyn UpdateRule>,
        config: Option<OptimizerConfig>,
        lr: f64,
        layout: Layout,
    ) -> Result<Self> {
        Self::build_sharded(setup, rule, config, lr, layout, None)
    }

    /// [`Self::build`], sharded over `comm`'s ranks when given: `layout` then holds no masters
    /// and each rank makes those of its shard.
    pub(crate) fn build_sharded(
        setup: OptimizerSetup,
        rule: Box<dyn UpdateRule>,
        config: Option<OptimizerConfig>,
        lr: f64,
        layout: Layout,
        comm: Option<Box<dyn Collectives>>,
    ) -> Result<Self> {
        let mut inner = Engine::new(rule, config, lr, setup.fp32_optimizer_state)?;
        let defaults = inner.defaults().clone();
        // The groups (id, lr, hyper-parameters) and each entry with its group's position.
        let mut groups: Vec<(usize, f64, HyperParams)> = Vec::new();
        let mut entries: Vec<ParamEntry> = Vec::new();
        let mut slots: Vec<usize> = Vec::new();
        match layout {
            Layout::TchGroups(list) => {
                let mut ids: Vec<usize> = list.iter().map(ParamEntry::group).collect();
                ids.sort_unstable();
                ids.dedup();
                groups.extend(ids.iter().map(|&id| (id, lr, defaults.clone())));
                for e in list {
                    slots.push(ids.iter().position(|&id| id == e.group()).unwrap_or(0));
                    entries.push(e);
                }
            }
            Layout::Groups(resolved) => {
                // Check every group before building any.
                for (id, g) in resolved.iter().enumerate() {
                    let glr = g.lr.unwrap_or(lr);
                    groups.push((id, glr, inner.group_hyper(glr, &g.overrides)?));
                }
                for (slot, g) in resolved.into_iter().enumerate() {
                    slots.extend(g.entries.iter().map(|_| slot));
                    entries.extend(g.entries);
                }
            }
        }
        let shard = match comm {
            Some(comm) => {
                let mut shard = shard::Shard::new(comm);
                let order = torch_order(&entries);
                let per_group: Vec<Vec<(usize, usize)>> = (0..groups.len())
                    .map(|slot| {
                        order.iter().filter(|&&i| slots[i] == slot).map(|&i| (i, entries[i].model().numel())).collect()
                    })
                    .collect();
                let numel: Vec<usize> = entries.iter().map(|e| e.model().numel()).collect();
                shard.assign(&per_group, &numel);
                if setup.master_weights {
                    for (i, e) in entries.iter_mut().enumerate() {
                        if shard.owns(i) {
                            e.make_master()?;
                        }
                    }
                }
                Some(shard)
            }
            None => None,
        };
        for (id, glr, hyper) in groups {
            inner.push_empty_group(id, glr, hyper);
        }
        for (e, &slot) in entries.iter().zip(&slots) {
            inner.push_param(e.name().to_string(), e.update_target().shallow_clone(), slot);
        }
        if let Some(s) = &shard {
            inner.set_skipped((0..entries.len()).map(|i| !s.owns(i)).collect());
        }
        let stash = entries.iter().map(|_| None).collect();
        inner.set_step_order(torch_order(&entries));
        Ok(Self {
            setup,
            inner,
            entries,
            stash,
            stage: Stage::Ready,
            last_overflow: None,
            steps: 0,
            skipped: 0,
            door: FrontDoor::default(),
            shard,
        })
    }

    /// The default learning rate (of groups that do not set their own, and of groups added
    /// later).
    pub fn lr(&self) -> f64 {
        self.inner.lr()
    }

    /// Sets the learning rate of every parameter group, and the default (torch: `for g in
    /// optimizer.param_groups: g["lr"] = lr`).
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a negative or non-finite rate (nothing changes).
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.inner.set_lr(lr)
    }

    /// Sets the learning rate of one parameter group (torch: `param_groups[i]["lr"] = lr`). Group
    /// ids are those of [`Self::param_groups`]: for an optimizer built from a VarStore's groups,
    /// the tch group (variables created under `vs.root().set_group(group)`); for one built from
    /// [`ParamGroup`]s, the group's position.
    ///
    /// # Errors
    /// [`ConfigError::UnknownParamGroup`] for a group id the optimizer does not have;
    /// [`ConfigError::InvalidOption`] for a negative or non-finite rate (nothing changes).
    pub fn set_lr_group(&mut self, group: usize, lr: f64) -> Result<()> {
        let index = self.group_index(group)?;
        self.inner.set_group_lr(index, lr)
    }

    /// Sets one hyper-parameter of one parameter group (torch: `param_groups[i]["weight_decay"] =
    /// 0.0`; `"lr"` is the learning rate). Checked as at construction.
    ///
    /// # Errors
    /// [`ConfigError::UnknownParamGroup`]; [`ConfigError::UnknownHyperParameter`] for a key the
    /// optimizer does not have; [`ConfigError::InvalidOption`] for a value the rule refuses
    /// (nothing changes).
    pub fn set_hyper_parameter(&mut self, group: usize, key: &str, value: f64) -> Result<()> {
        let index = self.group_index(group)?;
        if key == "lr" {
            return self.inner.set_group_lr(index, value);
        }
        self.inner.set_group_hyper(index, key, value)
    }

    /// The hyper-parameters of one parameter group (without `lr`: [`Self::lr_group`]), or
    /// `None` for an unknown group.
    pub fn hyper_parameters_group(&self, group: usize) -> Option<&HyperParams> {
        self.inner.group_index(group).map(|i| &self.inner.groups()[i].hyper)
    }

    /// The names of the parameters of one group, in the optimizer's order (empty for an
    /// unknown group).
    pub fn group_param_names(&self, group: usize) -> Vec<&str> {
        let Some(index) = self.inner.group_index(group) else { return Vec::new() };
        self.entries.iter().zip(self.inner.group_of()).filter(|(_, &gi)| gi == index).map(|(e, _)| e.name()).collect()
    }

    /// The ids of this optimizer's parameter groups, in order (torch's `param_groups`).
    pub fn param_groups(&self) -> Vec<usize> {
        self.inner.groups().iter().map(|g| g.id).collect()
    }

    fn group_index(&self, group: usize) -> Result<usize> {
        self.inner
            .group_index(group)
            .ok_or_else(|| AmpError::Config(ConfigError::UnknownParamGroup { group, groups: self.param_groups() }))
    }

    /// torch.optim's `add_param_group` after `initialize` (Apex patches it the same way under O2):
    /// adds a group over the trainable variables of `vs` that `group` selects (created after
    /// `initialize`, or left out of the optimizer until now), with fp32 masters for the fp16/bf16
    /// ones under master weights. Hyper-parameters the group does not set are the optimizer's
    /// defaults (torch's `defaults`), the learning rate the default [`Self::lr`]. The new
    /// parameters start without state; checkpoints and records cover the new group (an optimizer
    /// loading them must have the same groups). Returns the new group's id.
    ///
    /// Variables made after the model was cast are not cast (as in Apex): make them in the model's
    /// dtype (fp16 under O2) to get masters.
    ///
    /// # Errors
    /// [`ConfigError::ParamInTwoGroups`] for a variable the optimizer already holds;
    /// [`ConfigError::UnknownVariable`], [`ConfigError::NoVariablesUnder`] for a selection that
    /// names no variable; [`ConfigError::UnknownHyperParameter`] and [`ConfigError::InvalidOption`]
    /// for the group's settings. Nothing changes then.
    pub fn add_param_group(&mut self, vs: &VarStore, group: ParamGroup) -> Result<usize> {
        let taken: Vec<&str> = self.param_names();
        // A sharded optimizer makes the masters of its shard only, below.
        let masters = self.setup.master_weights && self.shard.is_none();
        let mut resolved = resolve(vs, std::slice::from_ref(&group), &taken, masters)?;
        let mut g = resolved.pop().ok_or_else(|| mismatch("no group resolved"))?;
        let glr = g.lr.unwrap_or(self.inner.lr());
        let hyper = self.inner.group_hyper(glr, &g.overrides)?;
        if let (Some(d), Some(e)) = (self.device(), g.entries.first()) {
            if e.model().device() != d {
                return Err(AmpError::Config(ConfigError::InvalidOption {
                    option: "add_param_group",
                    value: format!("{:?}", e.model().device()),
                    expected: "variables on the optimizer's device",
                }));
            }
        }
        let id = self.inner.groups().iter().map(|g| g.id + 1).max().unwrap_or(0);
        // torch's ZeroRedundancyOptimizer partitions the new group after the others.
        let first = self.entries.len();
        if let Some(shard) = self.shard.as_mut() {
            let local: Vec<usize> = torch_order(&g.entries);
            let group: Vec<(usize, usize)> = local.iter().map(|&k| (first + k, g.entries[k].model().numel())).collect();
            let numel: Vec<usize> = self.entries.iter().chain(&g.entries).map(|e| e.model().numel()).collect();
            shard.assign(&[group], &numel);
            if self.setup.master_weights {
                for (k, e) in g.entries.iter_mut().enumerate() {
                    if shard.owns(first + k) {
                        e.make_master()?;
                    }
                }
            }
        }
        let params = g.entries.iter().map(|e| (e.name().to_string(), e.update_target().shallow_clone())).collect();
        self.inner.push_group(id, glr, hyper, params);
        for e in g.entries {
            self.entries.push(e);
            self.stash.push(None);
        }
        if let Some(s) = &self.shard {
            self.inner.set_skipped((0..self.entries.len()).map(|i| !s.owns(i)).collect());
        }
        self.inner.set_step_order(torch_order(&self.entries));
        self.state_changed();
        Ok(id)
    }

    /// The diagnostics of the last overflow that made this optimizer skip a step (kept until
    /// the next one): which parameters had inf/NaN gradients, with counts.
    pub fn last_overflow(&self) -> Option<&OverflowReport> {
        self.last_overflow.as_ref()
    }

    /// The learning rate of `group` (the default [`Self::lr`] for an unknown group).
    pub fn lr_group(&self, group: usize) -> f64 {
        self.inner.group_index(group).map_or(self.inner.lr(), |i| self.inner.groups()[i].lr)
    }

    /// The built-in configuration the optimizer runs (`None` for a user's
    /// [`UpdateRule`]).
    pub fn config(&self) -> Option<OptimizerConfig> {
        self.inner.config()
    }

    /// The update rule's kind ([`UpdateRule::kind`]: `"adamw"`, `"fused_lamb"`, ...).
    pub fn rule_kind(&self) -> &str {
        self.inner.rule().kind()
    }

    /// Steps taken and steps skipped so far.
    pub fn step_counts(&self) -> (u64, u64) {
        (self.steps, self.skipped)
    }

    /// The parameters this optimizer updates: the fp32 masters for low-precision model
    /// variables under master weights, the model's own variables otherwise (Apex's
    /// `amp.master_params(optimizer)`). Shallow clones: they share storage and `.grad`. A
    /// sharded optimizer updates its rank's shard only: those, in [`Self::param_names`] order.
    pub fn master_params(&self) -> Vec<Tensor> {
        (0..self.entries.len())
            .filter(|&i| self.owns(i))
            .map(|i| self.entries[i].update_target().shallow_clone())
            .collect()
    }

    /// Names (VarStore paths) of the parameters, in the optimizer's order (the order of records
    /// and of [`Self::master_params`]; a sharded optimizer names every rank's parameters).
    pub fn param_names(&self) -> Vec<&str> {
        self.entries.iter().map(ParamEntry::name).collect()
    }

    /// Bytes held right now by the weights, masters, gradients and optimizer state.
    ///
    /// Under O2 `scale_loss` makes the fp32 master gradients and releases the model's fp16
    /// ones, so with Adam the peak is 18 bytes per parameter (2 fp16 weight, 4 master, 4 fp32
    /// grad, 8 state); Apex held 20: it kept the fp16 gradients too. A sharded optimizer counts
    /// what this rank holds (the masters and state of its shard) over every parameter.
    pub fn memory(&self) -> MemoryReport {
        let mut r = MemoryReport::default();
        for (e, st) in self.entries.iter().zip(self.inner.states()) {
            r.params += e.model().numel();
            r.weights += bytes(e.model());
            r.grads += bytes(&e.model().grad());
            if let Some(m) = e.master() {
                r.masters += bytes(m);
                r.grads += bytes(&m.grad());
            }
            r.optimizer_state += st.buffers().values().map(bytes).sum::<usize>();
        }
        r
    }

    /// Whether the next [`Self::step`] will be skipped (an overflow was seen).
    pub fn will_skip(&self) -> bool {
        matches!(self.stage, Stage::Overflowed(_))
    }

    /// Moves to `next`, unless a skip or a collapse is pending: those stay until `step`.
    fn enter(&mut self, next: Stage) {
        if !matches!(self.stage, Stage::Overflowed(_) | Stage::Vanished(_)) {
            self.stage = next;
        }
    }

    /// Sets every gradient (model and master) to None, freeing its memory, and forgets any
    /// pending scaled contribution.
    ///
    /// # Errors
    /// [`AmpError::Torch`](crate::AmpError::Torch) if libtorch refuses (not expected).
    pub fn zero_grad(&mut self) -> Result<()> {
        for e in &self.entries {
            clear_grad(e.model())?;
            if let Some(m) = e.master() {
                clear_grad(m)?;
            }
        }
        self.stash.iter_mut().for_each(|s| *s = None);
        self.enter(Stage::Ready);
        Ok(())
    }

    /// Updates the parameters from their (unscaled) gradients, or skips the update when a loss that
    /// reached this optimizer overflowed since the last step. With master weights the fp16 model is
    /// then set to the masters rounded to fp16.
    ///
    /// # Errors
    /// - [`Divergence::ScaleCollapsed`](crate::error::Divergence::ScaleCollapsed): the step was
    ///   skipped (as `Skipped`) and the scaler has overflowed `collapse_limit` passes in a row at
    ///   its floor;
    /// - [`Divergence::GradientsVanished`](crate::error::Divergence::GradientsVanished): nothing
    ///   stepped; the scale sits at its floor and the gradients were all zero `collapse_limit`
    ///   passes in a row;
    /// - [`UsageError::CallOrder`](crate::error::UsageError::CallOrder) when the last `scale_loss`
    ///   used `delay_unscale`;
    /// - [`UsageError::GradientsNotUnscaled`]: an fp16 model variable holds a gradient its fp32
    ///   master lacks (a backward outside `scale_loss`); nothing changes;
    /// - [`UsageError::NoGradients`]: no parameter has a gradient (no backward since the last step
    ///   or `zero_grad`, e.g. a second `step()` after a skipped one); nothing changes;
    /// - [`AmpError::Torch`] if an update fails.
    pub fn step(&mut self) -> Result<StepOutcome> {
        self.step_checked(false)
    }

    /// [`Self::step`] for a caller that made the fp32 master gradients itself and keeps the fp16
    /// model's gradients in place (the legacy FP16_Optimizer: Apex leaves them there), so they
    /// are not taken for a backward outside `scale_loss`.
    pub(crate) fn step_keeping_model_grads(&mut self) -> Result<StepOutcome> {
        self.step_checked(true)
    }

    /// `legacy`: fp16 model gradients beside their masters are the caller's (the legacy
    /// FP16_Optimizer's), not a stray backward.
    fn step_checked(&mut self, legacy: bool) -> Result<StepOutcome> {
        match std::mem::take(&mut self.stage) {
            Stage::Overflowed(skip) => return self.skip(skip),
            Stage::Vanished(collapse) => {
                self.stage = Stage::Stepped;
                return Err(collapse.error());
            }
            Stage::Unscaled => {}
            other => {
                let refused = self.refusal(&other, legacy);
                if let Some(e) = refused {
                    self.stage = other;
                    return Err(e);
                }
            }
        }
        if let Err(e) = self.check_gradients(legacy) {
            self.stage = Stage::Unscaled;
            return Err(e);
        }
        self.update()
    }

    /// A skipped step after an overflow. Every gradient of this optimizer is dropped: they hold
    /// the inf/NaN. (Apex clears only the masters of fp16 variables, so an fp32 variable's inf
    /// survives into the next pass when the caller accumulates without zero_grad.)
    fn skip(&mut self, skip: PendingSkip) -> Result<StepOutcome> {
        self.zero_grad()?;
        self.stage = Stage::Stepped;
        self.skipped = self.skipped.saturating_add(1);
        self.last_overflow = Some(skip.report);
        if let Some(collapse) = skip.collapse {
            return Err(collapse.error());
        }
        Ok(StepOutcome::Skipped { loss_id: skip.loss_id, loss_scale: skip.loss_scale })
    }

    /// Why `step` may not run from `stage` (other than `Unscaled`), if it may not.
    fn refusal(&self, stage: &Stage, legacy: bool) -> Option<AmpError> {
        let (when, remedy) = match stage {
            Stage::Scaled => (
                "while the gradients are still scaled (the last scale_loss used delay_unscale)",
                "run a scale_loss without delay_unscale before stepping",
            ),
            Stage::Stepped if !legacy => {
                return Some(call_order(
                    self.door,
                    "step()",
                    ("twice with no scale_loss in between", "per update: zero_grad(), scale_loss(..), step()"),
                    (
                        "twice with no backward in between (scaler.step(&mut opt) already stepped it)",
                        "per update: zero_grad(), scaler.scale(&loss)?.backward(), scaler.step(&mut opt)?, \
                         scaler.update()?; scaler.step calls step() itself",
                    ),
                ))
            }
            Stage::Ready if !legacy && !self.setup.pass_through && self.any_grad() => {
                // O2's fp16 gradients without masters' are named by check_gradients.
                if let Err(e) = self.check_gradients(false) {
                    return Some(e);
                }
                (
                    "on gradients no scale_loss produced (a backward outside it)",
                    "run backward inside amp.scale_loss(&loss, .., |s| s.backward())",
                )
            }
            _ => return None,
        };
        Some(AmpError::Usage(UsageError::CallOrder { call: "step()", when, remedy }))
    }

    /// The update itself (casts off where the set-up asks), then the masters rounded into the
    /// model and released (as Apex: zeroing the model's grads does not reach them).
    fn update(&mut self) -> Result<StepOutcome> {
        let update = |this: &mut Self| -> Result<()> {
            // LAMB's global gradient norm, over every rank's shard.
            let global = match this.shard.is_some() && this.inner.needs_global_norm() {
                true => Some(this.global_norm(this.inner.grad_norms(2.0)?, 2.0)?),
                false => None,
            };
            this.inner.step(global)?;
            copy_masters_to_model(&this.entries)
        };
        let result = if self.setup.disable_casts_in_step {
            crate::cast::disable::without_casts(|| update(self))?
        } else {
            update(self)
        };
        self.state_changed();
        if let Err(e) = result {
            // The update may have stopped half-way: the model follows the masters as they are
            // (and the other ranks get this rank's shard as it is, rather than waiting for it).
            copy_masters_to_model(&self.entries)?;
            self.broadcast_shards()?;
            self.zero_grad()?;
            self.stage = Stage::Ready;
            return Err(e);
        }
        self.broadcast_shards()?;
        for m in self.entries.iter().filter_map(ParamEntry::master) {
            clear_grad(m)?;
        }
        self.steps = self.steps.saturating_add(1);
        self.stage = Stage::Stepped;
        Ok(StepOutcome::Stepped)
    }

    /// Whether some parameter holds a gradient (its own, its master's or, under O2, its fp16
    /// model gradient).
    fn any_grad(&self) -> bool {
        self.entries.iter().any(|e| e.update_target().grad().defined() || e.model().grad().defined())
    }

    /// Refuses a call out of the per-step order before clipping: after `step`, before any
    /// `scale_loss` pass (unless `scale_loss` passes the loss through and backward ran), or on
    /// still-scaled gradients.
    fn check_clip_stage(&self) -> Result<()> {
        let (apex, torch_amp) = match &self.stage {
            Stage::Scaled => {
                let when = "while the gradients are still scaled (the last scale_loss used delay_unscale)";
                (when, when)
            }
            Stage::Stepped => {
                ("after step() and before the next scale_loss", "after step() and before the next backward")
            }
            Stage::Ready if !(self.setup.pass_through && self.any_grad()) => ("before scale_loss", "before backward"),
            _ => return Ok(()),
        };
        Err(call_order(
            self.door,
            "clip_grad_norm()",
            (apex, "clip after scale_loss returns, before step()"),
            (torch_amp, "clip after scaler.unscale_(&opt)?, before scaler.step(&mut opt)?"),
        ))
    }

    /// torch.amp's `GradScaler` steps this optimizer: its call-order errors speak of
    /// `scaler.step` and `scaler.update` from now on (until the next `scale_loss`).
    pub(crate) fn note_scaler_step(&mut self) {
        self.door = FrontDoor::TorchAmp;
    }

    /// Clips the gradients of [`Self::master_params`] so that their total `norm_type`-norm is at
    /// most `max_norm`, and returns the total norm before clipping (PyTorch's `clip_grad_norm_`,
    /// which Apex users call on `amp.master_params(optimizer)`). Computed in fp32 even for fp16
    /// gradients, the per-parameter norms taken in torch's parameter order (the order of
    /// `model.parameters()`, and of Apex's `amp.master_params(optimizer)`: each tch parameter
    /// group in turn, its variables in creation order with each module's weight before its bias)
    /// so that the total is torch's to the bit; parameters without a gradient are ignored (0 when
    /// none has one); a non-finite norm is returned and the gradients are left unscaled. One host
    /// sync (reading the norm). A sharded optimizer clips its shard by the norm over every rank's
    /// gradients (bit for bit the unsharded norm): every rank calls it together.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a negative/non-finite `max_norm` or a `norm_type` that is
    /// not positive; [`AmpError::Distributed`] when a sharded optimizer's collective fails.
    pub fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> Result<f64> {
        crate::optim::grads::check_clip_args(max_norm, norm_type)?;
        self.check_clip_stage()?;
        // In torch's parameter order, the order of Apex's `amp.master_params(optimizer)`: the
        // per-parameter norms are summed in it.
        let order = self.inner.view_order();
        let total = if self.shard.is_some() {
            // Each rank's norms of its shard, reduced over the ranks as one process would.
            let mut local = Vec::new();
            let mut grads = Vec::new();
            for &i in order.iter().filter(|&&i| self.owns(i)) {
                let g = self.entries[i].update_target().grad();
                if g.defined() {
                    local.push((i, crate::sys::vector_norm(&g, norm_type)?));
                    grads.push(g);
                }
            }
            let total = self.global_norm(local, norm_type)?;
            scale_clipped(&grads, &total, max_norm, NonFiniteNorm::Skip)?;
            total
        } else {
            let params: Vec<Tensor> = order.iter().map(|&i| self.entries[i].update_target().shallow_clone()).collect();
            clip_grads(&params, max_norm, norm_type, NonFiniteNorm::Skip)?
        };
        crate::counters::note_host_read();
        total.f_double_value(&[]).ctx("reading the gradient norm")
    }

    /// Whether some fp16/bf16 parameter has no fp32 master (O3): the optimizer steps it in its
    /// own dtype unless `fp32_optimizer_state` is on.
    pub(crate) fn has_low_precision_params_without_masters(&self) -> bool {
        (0..self.entries.len()).any(|i| crate::dtype::is_low_precision(self.target_kind(i)))
    }

    /// Before a step: no fp16 model gradient bypassed the masters, and some parameter has a
    /// gradient.
    /// `model_grads_expected`: fp16 model gradients beside their masters are the caller's (the
    /// legacy FP16_Optimizer keeps them).
    fn check_gradients(&self, model_grads_expected: bool) -> Result<()> {
        let stray: Vec<String> = self
            .entries
            .iter()
            .filter(|e| !model_grads_expected && e.master().is_some() && e.model().grad().defined())
            .take(5)
            .map(|e| e.name().to_string())
            .collect();
        if !stray.is_empty() {
            return Err(AmpError::Usage(UsageError::GradientsNotUnscaled { params: stray }));
        }
        let has_grad = |e: &ParamEntry| {
            e.update_target().grad().defined()
                || (model_grads_expected && e.master().is_some() && e.model().grad().defined())
        };
        // A rank's shard may have no gradient where the others' have: sharded, every rank steps
        // (its broadcast is awaited).
        if self.shard.is_none() && !self.entries.iter().any(has_grad) {
            return Err(AmpError::Usage(UsageError::NoGradients));
        }
        Ok(())
    }
}
