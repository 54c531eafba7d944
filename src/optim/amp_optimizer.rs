//! The optimizer `initialize` returns: steps the fp32 masters (O2) or the model's own
//! variables, skips a step after an overflow, clips on the master gradients.
use std::collections::BTreeMap;
use std::sync::Mutex;

use tch::{Device, Kind, Tensor};

use tch::nn::VarStore;

use super::engine::GradSlice;
use super::engine::{check_lr, Optimizer, ParamStateBuffers};
use super::grads::{clear_grad, non_finite_check_, set_grad, take_grad, total_norm, unscale_};
use super::groups::{resolve, ParamGroup, ResolvedGroup};
use super::params::{copy_masters_to_model, ParamEntry};
use super::record::{GroupRecord, OptimizerRecord, ParamRecord};
use super::rule::{HyperParams, StateShape, UpdateRule};
use super::rules::OptimizerConfig;
use crate::error::{mismatch, AmpError, Result, TorchContext};
use crate::scaling::{NonFiniteGrad, OverflowReport};

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

/// A parameter's gradient as it stands: its master's, or the model's fp16 one while O2's
/// slice-wise step has not made the master's yet (see [`HalfGrads`]).
fn latest_grad(e: &ParamEntry) -> Tensor {
    let g = e.update_target().grad();
    if !g.defined() && e.master().is_some() {
        e.model().grad()
    } else {
        g
    }
}

fn bytes(t: &Tensor) -> usize {
    if t.defined() {
        t.numel() * t.kind().elt_size_in_bytes()
    } else {
        0
    }
}

/// O2's gradients between `scale_loss` and `step`: still the model's fp16/bf16 `.grad`,
/// checked for inf/NaN but not unscaled. `step` turns them into fp32 master gradients a slice
/// at a time, right before each slice's update, so that no full-size fp32 gradient is ever
/// held: 16 bytes per parameter at the peak with Adam (2 fp16 weight, 4 master, 2 fp16 grad,
/// 8 state) instead of 18. Anything that needs the fp32 master gradients before `step`
/// (clipping, [`AmpOptimizer::master_params`], another `scale_loss` accumulating into them)
/// makes them all at once, as before.
#[derive(Debug)]
struct HalfGrads {
    /// The fp32 `1 / loss_scale` of the pass that made them.
    inv_scale: Tensor,
}

/// Largest slice (elements) of a master gradient made at once in `step` (see [`HalfGrads`]):
/// 256 Ki elements, 1 MiB of fp32 gradient. A multiple of 64, so every slice starts where the
/// kernels' own vector blocks and thread ranges would, and each element takes the same code
/// path as in a whole-tensor update.
const SLICE_MAX: i64 = 1 << 18;

#[derive(Debug, Clone)]
struct PendingSkip {
    loss_id: usize,
    loss_scale: f64,
    report: OverflowReport,
    collapse: Option<CollapseInfo>,
}

/// A collapse of a loss scaler, reported by the next `step()` (see
/// [`AmpError::ScaleCollapsed`] and [`AmpError::GradientsVanished`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CollapseInfo {
    /// Overflows at the floor (`ScaleCollapsed`) or zero gradients there (`GradientsVanished`).
    pub(crate) overflow: bool,
    pub(crate) loss_id: usize,
    pub(crate) first_pass: u64,
    pub(crate) passes: u64,
    pub(crate) loss_scale: f64,
    pub(crate) params: Vec<String>,
}

impl CollapseInfo {
    fn error(self) -> AmpError {
        let last_pass = self.first_pass.saturating_add(self.passes.saturating_sub(1));
        let (loss_id, first_pass, passes, loss_scale) = (self.loss_id, self.first_pass, self.passes, self.loss_scale);
        if self.overflow {
            AmpError::ScaleCollapsed { loss_id, first_pass, last_pass, passes, loss_scale, params: self.params }
        } else {
            AmpError::GradientsVanished { loss_id, first_pass, last_pass, passes, loss_scale }
        }
    }
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
    inner: Optimizer,
    entries: Vec<ParamEntry>,
    /// Gradients of self-mastered parameters set aside at `scale_loss` entry (accumulation).
    stash: Vec<Option<Tensor>>,
    /// Grads hold a scaled, not yet unscaled, contribution (a `delay_unscale` pass).
    scaled_pending: bool,
    skip_next: Option<PendingSkip>,
    /// A `GradientsVanished` collapse to report at the next step.
    vanished: Option<CollapseInfo>,
    last_overflow: Option<OverflowReport>,
    /// O2: master gradients not made yet (see [`HalfGrads`]); behind a mutex so that
    /// [`Self::master_params`] (`&self`) can make them.
    half_grads: Mutex<Option<HalfGrads>>,
    steps: u64,
    skipped: u64,
}

impl AmpOptimizer {
    /// An optimizer running `rule` (made from `config` for the built-ins) over `layout`.
    pub(crate) fn build(
        setup: OptimizerSetup,
        rule: Box<dyn UpdateRule>,
        config: Option<OptimizerConfig>,
        lr: f64,
        layout: Layout,
    ) -> Result<Self> {
        let mut inner = Optimizer::new(rule, config, lr, setup.fp32_optimizer_state)?;
        let defaults = inner.defaults().clone();
        let mut entries = Vec::new();
        match layout {
            Layout::TchGroups(list) => {
                let mut ids: Vec<usize> = list.iter().map(ParamEntry::group).collect();
                ids.sort_unstable();
                ids.dedup();
                for &id in &ids {
                    inner.push_empty_group(id, lr, defaults.clone());
                }
                for e in list {
                    let gi = ids.iter().position(|&id| id == e.group()).unwrap_or(0);
                    inner.push_param(e.name().to_string(), e.update_target().shallow_clone(), gi);
                    entries.push(e);
                }
            }
            Layout::Groups(groups) => {
                // Check every group before building any.
                let mut checked = Vec::with_capacity(groups.len());
                for g in &groups {
                    let glr = g.lr.unwrap_or(lr);
                    checked.push((glr, inner.group_hyper(glr, &g.overrides)?));
                }
                for (id, (g, (glr, hyper))) in groups.into_iter().zip(checked).enumerate() {
                    let params =
                        g.entries.iter().map(|e| (e.name().to_string(), e.update_target().shallow_clone())).collect();
                    inner.push_group(id, glr, hyper, params);
                    entries.extend(g.entries);
                }
            }
        }
        let stash = entries.iter().map(|_| None).collect();
        Ok(Self {
            setup,
            inner,
            entries,
            stash,
            scaled_pending: false,
            skip_next: None,
            vanished: None,
            last_overflow: None,
            half_grads: Mutex::new(None),
            steps: 0,
            skipped: 0,
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
    /// [`AmpError::InvalidOption`] for a negative or non-finite rate (nothing changes).
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.inner.set_lr(lr)
    }

    /// Sets the learning rate of one parameter group (torch: `param_groups[i]["lr"] = lr`).
    /// Group ids are those of [`Self::param_groups`]: for an optimizer built from a VarStore's
    /// groups, the tch group (variables created under `vs.root().set_group(group)`); for one
    /// built from [`ParamGroup`]s, the group's position.
    ///
    /// # Errors
    /// [`AmpError::UnknownParamGroup`] for a group id the optimizer does not have;
    /// [`AmpError::InvalidOption`] for a negative or non-finite rate (nothing changes).
    pub fn set_lr_group(&mut self, group: usize, lr: f64) -> Result<()> {
        let index = self.group_index(group)?;
        self.inner.set_group_lr(index, lr)
    }

    /// Sets one hyper-parameter of one parameter group (torch: `param_groups[i]["weight_decay"]
    /// = 0.0`; `"lr"` is the learning rate). Checked as at construction.
    ///
    /// # Errors
    /// [`AmpError::UnknownParamGroup`]; [`AmpError::UnknownHyperParameter`] for a key the
    /// optimizer does not have; [`AmpError::InvalidOption`] for a value the rule refuses
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
        self.inner.group_index(group).ok_or_else(|| AmpError::UnknownParamGroup { group, groups: self.param_groups() })
    }

    /// torch.optim's `add_param_group` after `initialize` (Apex patches it the same way under
    /// O2): adds a group over the trainable variables of `vs` that `group` selects (created
    /// after `initialize`, or left out of the optimizer until now), with fp32 masters for the
    /// fp16/bf16 ones under master weights. Hyper-parameters the group does not set are the
    /// optimizer's defaults (torch's `defaults`), the learning rate the default
    /// [`Self::lr`]. The new parameters start without state; checkpoints and records cover the
    /// new group (an optimizer loading them must have the same groups). Returns the new group's
    /// id.
    ///
    /// Variables made after the model was cast are not cast (as in Apex): make them in the
    /// model's dtype (fp16 under O2) to get masters.
    ///
    /// # Errors
    /// [`AmpError::ParamInTwoGroups`] for a variable the optimizer already holds;
    /// [`AmpError::UnknownVariable`], [`AmpError::NoVariablesUnder`] for a selection that names
    /// no variable; [`AmpError::UnknownHyperParameter`] and [`AmpError::InvalidOption`] for the
    /// group's settings. Nothing changes then.
    pub fn add_param_group(&mut self, vs: &VarStore, group: ParamGroup) -> Result<usize> {
        let taken: Vec<&str> = self.param_names();
        let mut resolved = resolve(vs, std::slice::from_ref(&group), &taken, self.setup.master_weights)?;
        let g = resolved.pop().ok_or_else(|| mismatch("no group resolved"))?;
        let glr = g.lr.unwrap_or(self.inner.lr());
        let hyper = self.inner.group_hyper(glr, &g.overrides)?;
        if let (Some(d), Some(e)) = (self.device(), g.entries.first()) {
            if e.model().device() != d {
                return Err(AmpError::InvalidOption {
                    option: "add_param_group",
                    value: format!("{:?}", e.model().device()),
                    expected: "variables on the optimizer's device",
                });
            }
        }
        let id = self.inner.groups().iter().map(|g| g.id + 1).max().unwrap_or(0);
        let params = g.entries.iter().map(|e| (e.name().to_string(), e.update_target().shallow_clone())).collect();
        self.inner.push_group(id, glr, hyper, params);
        for e in g.entries {
            self.entries.push(e);
            self.stash.push(None);
        }
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
    /// `amp.master_params(optimizer)`). Shallow clones: they share storage and `.grad`.
    ///
    /// Between `scale_loss` and `step` under O2 this makes the fp32 master gradients (unscaled)
    /// from the model's fp16 ones, which `step` would otherwise make a slice at a time (see
    /// [`Self::memory`]); if that fails (out of memory) the masters are returned without them.
    pub fn master_params(&self) -> Vec<Tensor> {
        let _ = self.make_master_grads();
        self.entries.iter().map(|e| e.update_target().shallow_clone()).collect()
    }

    /// Makes the pending fp32 master gradients of an O2 pass at once: each fp16 model gradient
    /// is copied to fp32, unscaled and added to its master's (`scale_loss` did this itself
    /// before the slice-wise step existed). Nothing to do when none are pending.
    fn make_master_grads(&self) -> Result<()> {
        let Some(half) = self.half_grads.lock().map_err(|_| AmpError::PoisonedLock { what: "the optimizer" })?.take()
        else {
            return Ok(());
        };
        let _no_grad = tch::no_grad_guard();
        let mut made: Vec<(usize, Tensor)> = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            if e.master().is_some() {
                if let Some(g) = take_grad(e.model())? {
                    made.push((i, g.f_to_kind(Kind::Float).ctx("copying a model gradient to fp32")?));
                }
            }
        }
        let grads: Vec<Tensor> = made.iter().map(|(_, g)| g.shallow_clone()).collect();
        let flag = Tensor::f_zeros([1], (Kind::Float, half.inv_scale.device())).ctx("found_inf")?;
        unscale_(&grads, &flag, &half.inv_scale)?;
        for (i, g) in made {
            let Some(master) = self.entries[i].master() else { continue };
            let existing = master.grad();
            if existing.defined() {
                let mut ex = existing;
                let _ = ex.f_add_(&g).ctx("accumulating a master gradient")?;
            } else {
                set_grad(master, &g)?;
            }
        }
        Ok(())
    }

    /// Names (VarStore paths) of the parameters, in the order of [`Self::master_params`].
    pub fn param_names(&self) -> Vec<&str> {
        self.entries.iter().map(ParamEntry::name).collect()
    }

    /// Bytes held right now by the weights, masters, gradients and optimizer state.
    ///
    /// Under O2 the gradients between `scale_loss` and `step` are the model's fp16 ones (2 bytes
    /// per parameter): `step` unscales each into fp32 a slice of at most 256 Ki elements at a
    /// time (in storage whose values are spent), updates that slice of the master and rounds it
    /// into the model, so with Adam the peak is 16 bytes per parameter (2 fp16 weight, 4 master,
    /// 2 fp16 grad, 8 state) plus the update rule's own temporaries for one slice (none for
    /// fused Adam; Apex held 20 bytes: it kept fp16 and fp32 gradients).
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
        self.skip_next.is_some()
    }

    /// Sets every gradient (model and master) to None, freeing its memory, and forgets any
    /// pending scaled contribution.
    ///
    /// # Errors
    /// [`AmpError::Shim`] if libtorch refuses (not expected).
    pub fn zero_grad(&mut self) -> Result<()> {
        for e in &self.entries {
            clear_grad(e.model())?;
            if let Some(m) = e.master() {
                clear_grad(m)?;
            }
        }
        self.stash.iter_mut().for_each(|s| *s = None);
        self.scaled_pending = false;
        *self.half_grads.lock().map_err(|_| AmpError::PoisonedLock { what: "the optimizer" })? = None;
        Ok(())
    }

    /// Updates the parameters from their (unscaled) gradients, or skips the update when a
    /// loss that reached this optimizer overflowed since the last step. With master weights
    /// the fp16 model is then set to the masters rounded to fp16.
    ///
    /// # Errors
    /// - [`AmpError::ScaleCollapsed`]: the step was skipped (as `Skipped`) and the scaler has
    ///   overflowed `collapse_limit` passes in a row at its floor;
    /// - [`AmpError::GradientsVanished`]: nothing stepped; the scale sits at its floor and the
    ///   gradients were all zero `collapse_limit` passes in a row;
    /// - [`AmpError::GradientsStillScaled`] when the last `scale_loss` used `delay_unscale`;
    /// - [`AmpError::GradientsNotUnscaled`]: an fp16 model variable holds a gradient its fp32
    ///   master lacks (a backward outside `scale_loss`); nothing changes;
    /// - [`AmpError::NoGradients`]: no parameter has a gradient (no backward since the last
    ///   step or `zero_grad`, e.g. a second `step()` after a skipped one); nothing changes;
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

    /// `model_grads_expected`: fp16 model gradients beside their masters are the caller's, not
    /// a stray backward.
    fn step_checked(&mut self, model_grads_expected: bool) -> Result<StepOutcome> {
        if let Some(skip) = self.skip_next.take() {
            // Every gradient of this optimizer is dropped: they hold the inf/NaN. (Apex clears
            // only the masters of fp16 variables, so an fp32 variable's inf survives into the
            // next pass when the caller accumulates without zero_grad.)
            self.zero_grad()?;
            self.skipped = self.skipped.saturating_add(1);
            self.vanished = None;
            self.last_overflow = Some(skip.report);
            if let Some(collapse) = skip.collapse {
                return Err(collapse.error());
            }
            return Ok(StepOutcome::Skipped { loss_id: skip.loss_id, loss_scale: skip.loss_scale });
        }
        if let Some(collapse) = self.vanished.take() {
            return Err(collapse.error());
        }
        if self.scaled_pending {
            return Err(AmpError::GradientsStillScaled);
        }
        let half = {
            let mut slot = self.half_grads.lock().map_err(|_| AmpError::PoisonedLock { what: "the optimizer" })?;
            self.check_gradients(slot.is_some() || model_grads_expected)?;
            slot.take()
        };
        let update = |this: &mut Self| -> Result<()> {
            // Parameters holding their gradient (fp32 variables, masters whose gradient was
            // made at once); then the masters whose gradient is still the model's fp16 one.
            this.inner.step()?;
            match half {
                Some(h) => this.step_from_half_grads(&h),
                None => copy_masters_to_model(&this.entries),
            }
        };
        let result = if self.setup.disable_casts_in_step {
            crate::cast::disable::without_casts(|| update(self))?
        } else {
            update(self)
        };
        if let Err(e) = result {
            // A slice-wise step uses spent gradients and not-yet-rounded weights as scratch:
            // set the model back to the (rounded) masters and drop the gradients.
            copy_masters_to_model(&self.entries)?;
            self.zero_grad()?;
            return Err(e);
        }
        // As Apex: master grads are not reached by zeroing the model's grads, so they are
        // released here (which also frees their memory until the next backward).
        for m in self.entries.iter().filter_map(ParamEntry::master) {
            clear_grad(m)?;
        }
        self.steps = self.steps.saturating_add(1);
        Ok(StepOutcome::Stepped)
    }

    /// Clips the gradients of [`Self::master_params`] so that their total `norm_type`-norm is
    /// at most `max_norm`, and returns the total norm before clipping (PyTorch's
    /// `clip_grad_norm_`, which Apex users call on `amp.master_params(optimizer)`).
    /// Computed in fp32 even for fp16 gradients; parameters without a gradient are ignored (0
    /// when none has one); a non-finite norm is returned and the gradients are left unscaled.
    /// One host sync (reading the norm).
    ///
    /// # Errors
    /// [`AmpError::InvalidOption`] for a negative/non-finite `max_norm` or a `norm_type` that
    /// is not positive.
    pub fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> Result<f64> {
        crate::optim::check_clip_args(max_norm, norm_type)?;
        self.make_master_grads()?;
        let grads: Vec<Tensor> =
            self.entries.iter().map(|e| e.update_target().grad()).filter(Tensor::defined).collect();
        if grads.is_empty() {
            return Ok(0.0);
        }
        let total = total_norm(&grads, norm_type)?;
        let _no_grad = tch::no_grad_guard();
        let coef = (max_norm / (&total + 1e-6)).f_clamp_max(1.0).ctx("clip coefficient")?;
        let coef = coef.f_where_self(&total.f_isfinite().ctx("clip")?, &coef.ones_like()).ctx("clip")?;
        for g in &grads {
            let coef = coef.f_to_kind(g.kind()).ctx("clip")?;
            let mut g = g.shallow_clone();
            let _ = g.f_mul_(&coef).ctx("clipping a gradient")?;
        }
        crate::counters::note_host_read();
        total.f_double_value(&[]).ctx("reading the gradient norm")
    }

    /// Whether some fp16/bf16 parameter has no fp32 master (O3): the optimizer steps it in its
    /// own dtype unless `fp32_optimizer_state` is on.
    pub(crate) fn has_low_precision_params_without_masters(&self) -> bool {
        self.entries.iter().any(|e| e.master().is_none() && crate::dtype::is_low_precision(e.model().kind()))
    }

    /// Before a step: no fp16 model gradient bypassed the masters, and some parameter has a
    /// gradient.
    /// `model_grads_expected`: fp16 model gradients beside their masters are legitimate (O2's
    /// waiting for the slice-wise step, see [`HalfGrads`], or a caller's own).
    fn check_gradients(&self, model_grads_expected: bool) -> Result<()> {
        let stray: Vec<String> = self
            .entries
            .iter()
            .filter(|e| !model_grads_expected && e.master().is_some() && e.model().grad().defined())
            .take(5)
            .map(|e| e.name().to_string())
            .collect();
        if !stray.is_empty() {
            return Err(AmpError::GradientsNotUnscaled { params: stray });
        }
        let has_grad = |e: &ParamEntry| {
            e.update_target().grad().defined()
                || (model_grads_expected && e.master().is_some() && e.model().grad().defined())
        };
        if !self.entries.iter().any(has_grad) {
            return Err(AmpError::NoGradients);
        }
        Ok(())
    }

    /// The parameters whose gradients hold inf or NaN, in model order, with counts (one host
    /// read). Run on the overflow path only.
    pub(crate) fn non_finite_grads(&self) -> Result<Vec<NonFiniteGrad>> {
        crate::counters::note_gradient_scan();
        let _no_grad = tch::no_grad_guard();
        let mut order: Vec<&ParamEntry> = self.entries.iter().collect();
        order.sort_by_key(|e| e.order());
        let mut names = Vec::new();
        let mut counts = Vec::new();
        for e in order {
            // Scaled while still the model's fp16 one: the counts of inf and NaN are the same.
            let g = latest_grad(e);
            if !g.defined() {
                continue;
            }
            counts.push(g.f_isinf().and_then(|t| t.f_sum(Kind::Int64)).ctx("counting inf gradients")?);
            counts.push(g.f_isnan().and_then(|t| t.f_sum(Kind::Int64)).ctx("counting NaN gradients")?);
            names.push(e.name());
        }
        if counts.is_empty() {
            return Ok(Vec::new());
        }
        let all = Tensor::f_stack(&counts, 0).and_then(|t| t.f_to_device(Device::Cpu)).ctx("counting")?;
        let all = Vec::<i64>::try_from(&all).ctx("reading the counts")?;
        Ok(names
            .into_iter()
            .zip(all.chunks(2))
            .filter(|(_, c)| c[0] > 0 || c[1] > 0)
            .map(|(name, c)| NonFiniteGrad { name: name.to_string(), inf: c[0] as u64, nan: c[1] as u64 })
            .collect())
    }

    /// Whether every gradient is exactly zero (`None` when no parameter has one); one host
    /// read. Run only with the scale at its floor.
    pub(crate) fn grads_all_zero(&self) -> Result<Option<bool>> {
        crate::counters::note_gradient_scan();
        let _no_grad = tch::no_grad_guard();
        let mut nonzero = Vec::new();
        for e in &self.entries {
            let g = latest_grad(e);
            if g.defined() {
                nonzero.push(g.f_ne(0.0).and_then(|t| t.f_any()).ctx("checking for zero gradients")?);
            }
        }
        if nonzero.is_empty() {
            return Ok(None);
        }
        let any = Tensor::f_stack(&nonzero, 0)
            .and_then(|t| t.f_any())
            .and_then(|t| t.f_int64_value(&[]))
            .ctx("checking for zero gradients")?;
        Ok(Some(any == 0))
    }

    /// The fp32 masters (of the fp16/bf16 parameters under master weights), shallow clones.
    pub(crate) fn masters(&self) -> Vec<Tensor> {
        self.entries.iter().filter_map(|e| e.master().map(Tensor::shallow_clone)).collect()
    }

    /// For each parameter, whether it has an fp32 master.
    pub(crate) fn master_flags(&self) -> Vec<bool> {
        self.entries.iter().map(|e| e.master().is_some()).collect()
    }

    /// The id of the [`crate::Amp`] that made this optimizer.
    pub(crate) fn amp_id(&self) -> u64 {
        self.setup.amp_id
    }

    /// The device of the parameters (of the first one; `None` for an empty optimizer).
    pub(crate) fn device(&self) -> Option<Device> {
        self.entries.first().map(|e| e.model().device())
    }

    /// `scale_loss` entry: set aside existing gradients so that the new, scaled ones can be
    /// unscaled alone and added back (gradient accumulation across losses/iterations).
    pub(crate) fn begin_backward(&mut self) -> Result<()> {
        if self.scaled_pending {
            return Ok(());
        }
        // A second pass before `step` (accumulation): the first pass's gradients become fp32
        // master gradients now, and the new ones are added to them at exit.
        self.make_master_grads()?;
        for (e, stash) in self.entries.iter().zip(self.stash.iter_mut()) {
            match e.master() {
                // Master grads keep accumulating; the fp16 grads must start empty.
                Some(_) => clear_grad(e.model())?,
                None => *stash = take_grad(e.model())?,
            }
        }
        Ok(())
    }

    /// `scale_loss` exit after a `delay_unscale` pass: the gradients stay scaled.
    pub(crate) fn keep_scaled(&mut self) {
        self.scaled_pending = true;
    }

    /// `scale_loss` exit: unscale the new gradients into the fp32 master gradients (or in
    /// place), flag inf/NaN into `found_inf`, and add back what was set aside. No host sync.
    pub(crate) fn end_backward(&mut self, found_inf: &Tensor, inv_scale: &Tensor) -> Result<()> {
        // O2 with no master gradient yet: the fp16 gradients stay where they are, only checked
        // for inf/NaN (multiplied by 1, exactly), and `step` unscales them slice by slice.
        let slice_wise = self.inner.updates_in_slices()
            && self.entries.iter().any(|e| e.master().is_some())
            && self.entries.iter().filter_map(ParamEntry::master).all(|m| !m.grad().defined())
            && self.entries.iter().filter(|e| e.master().is_some()).all(|e| {
                let g = e.model().grad();
                !g.defined()
                    || (g.is_contiguous() && e.model().is_contiguous() && e.master().is_some_and(Tensor::is_contiguous))
            });
        let mut half: Vec<Tensor> = Vec::new();
        // Gather the new (scaled) gradients: fp16 model grads become fresh fp32 tensors.
        let mut fresh: Vec<Tensor> = Vec::new();
        let mut targets: Vec<(usize, Tensor)> = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            match e.master() {
                Some(_) if slice_wise => {
                    let g = e.model().grad();
                    if g.defined() {
                        half.push(g);
                    }
                }
                Some(_) => {
                    if let Some(g) = take_grad(e.model())? {
                        let g32 = g.f_to_kind(Kind::Float).ctx("copying a model gradient to fp32")?;
                        fresh.push(g32.shallow_clone());
                        targets.push((i, g32));
                    }
                }
                None => {
                    let g = e.model().grad();
                    if g.defined() {
                        fresh.push(g.shallow_clone());
                        targets.push((i, g));
                    }
                }
            }
        }
        unscale_(&fresh, found_inf, inv_scale)?;
        if slice_wise {
            // Only checked (read, not written): `step` unscales them.
            non_finite_check_(&half, found_inf)?;
            *self.half_grads.lock().map_err(|_| AmpError::PoisonedLock { what: "the optimizer" })? =
                Some(HalfGrads { inv_scale: inv_scale.shallow_clone() });
        }
        let _no_grad = tch::no_grad_guard();
        for (i, new_grad) in targets {
            match self.entries[i].master() {
                Some(master) => {
                    let existing = master.grad();
                    if existing.defined() {
                        let mut ex = existing;
                        let _ = ex.f_add_(&new_grad).ctx("accumulating a master gradient")?;
                    } else {
                        set_grad(master, &new_grad)?;
                    }
                }
                None => {
                    if let Some(stashed) = self.stash[i].take() {
                        let mut g = new_grad;
                        let _ = g.f_add_(&stashed).ctx("adding back a stashed gradient")?;
                    }
                }
            }
        }
        // Stashed grads of parameters that got no new gradient go back unchanged.
        for (e, stash) in self.entries.iter().zip(self.stash.iter_mut()) {
            if let Some(s) = stash.take() {
                set_grad(e.model(), &s)?;
            }
        }
        self.scaled_pending = false;
        Ok(())
    }

    /// The slice-wise O2 update (see [`HalfGrads`]): for each parameter with a master and an
    /// fp16 gradient, each slice of at most [`SLICE_MAX`] elements of the gradient is unscaled
    /// into one reused fp32 buffer (`fp16 -> fp32`, then times `inv_scale`: what the full-size
    /// path computes), the master slice updated from it and rounded into the model.
    fn step_from_half_grads(&mut self, half: &HalfGrads) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let order: Vec<usize> = (0..self.entries.len())
            .filter(|&i| self.entries[i].master().is_some() && self.entries[i].model().grad().defined())
            .collect();
        let Some(largest) = order.iter().map(|&i| self.entries[i].model().numel() as i64).max() else {
            return Ok(());
        };
        let device = self.entries[order[0]].model().device();
        let buffer = Tensor::f_empty([largest.min(SLICE_MAX)], (Kind::Float, device)).ctx("a master-gradient slice")?;
        for i in order {
            let e = &self.entries[i];
            let (model, master) =
                (e.model().shallow_clone(), e.master().map(Tensor::shallow_clone).unwrap_or_default());
            let grad = model.grad().f_view([-1]).ctx("an fp16 gradient")?;
            let n = grad.numel() as i64;
            let (model_flat, master_flat) = (model.f_view([-1]).ctx("a weight")?, master.f_view([-1]).ctx("a master")?);
            let narrow = |t: &Tensor, at: i64, len: i64| -> Result<Tensor> {
                if len == n {
                    Ok(t.shallow_clone())
                } else {
                    t.f_narrow(0, at, len).ctx("a parameter slice")
                }
            };
            let mut start = 0i64;
            let mut next = || -> Result<Option<GradSlice>> {
                if start >= n {
                    return Ok(None);
                }
                let len = (n - start).min(SLICE_MAX);
                let mut g = buffer.f_narrow(0, 0, len).ctx("a master-gradient slice")?;
                g.f_copy_(&narrow(&grad, start, len)?).ctx("an fp16 gradient slice to fp32")?;
                let _ = g.f_mul_(&half.inv_scale).ctx("unscaling a gradient slice")?;
                let out = GradSlice { start, grad: g };
                start += len;
                Ok(Some(out))
            };
            let mut done = |at: i64, len: i64| -> Result<()> {
                let mut w = narrow(&model_flat, at, len)?;
                w.f_copy_(&narrow(&master_flat, at, len)?).ctx("copying master weights into the model").map(|_| ())
            };
            self.inner.update_in_slices(i, &mut next, &mut done)?;
            clear_grad(&model)?;
        }
        Ok(())
    }

    pub(crate) fn mark_skip(
        &mut self,
        loss_id: usize,
        loss_scale: f64,
        report: OverflowReport,
        collapse: Option<CollapseInfo>,
    ) {
        self.skip_next = Some(PendingSkip { loss_id, loss_scale, report, collapse });
    }

    pub(crate) fn mark_vanished(&mut self, collapse: CollapseInfo) {
        self.vanished = Some(collapse);
    }
}

impl AmpOptimizer {
    /// The optimizer's persistent state: the default learning rate, the parameter groups
    /// (learning rate, hyper-parameters, step count, parameters), counters, and per parameter
    /// its step count, state tensors and fp32 master value. Tensors are shared, not copied:
    /// save or copy them before the next step. See [`OptimizerRecord`] for the correspondence
    /// with torch.optim's `state_dict()`.
    pub fn to_record(&self) -> OptimizerRecord {
        let names_of = |index: usize| -> Vec<String> {
            self.entries
                .iter()
                .zip(self.inner.group_of())
                .filter(|(_, &gi)| gi == index)
                .map(|(e, _)| e.name().to_string())
                .collect()
        };
        let groups: Vec<GroupRecord> = self
            .inner
            .groups()
            .iter()
            .enumerate()
            .map(|(i, g)| GroupRecord {
                id: g.id,
                lr: g.lr,
                hyper_parameters: g.hyper.as_map().clone(),
                step: g.step,
                params: names_of(i),
            })
            .collect();
        let params = self
            .entries
            .iter()
            .zip(self.inner.states())
            .map(|(e, st)| ParamRecord {
                name: e.name().to_string(),
                step: st.step(),
                buffers: st.buffers().iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect(),
                master: e.master().map(Tensor::shallow_clone),
            })
            .collect();
        let lr = self.inner.lr();
        OptimizerRecord {
            kind: self.inner.rule().kind().to_string(),
            hyper_parameters: self.inner.defaults().as_map().clone(),
            lr,
            group_lr: groups.iter().filter(|g| g.lr.to_bits() != lr.to_bits()).map(|g| (g.id, g.lr)).collect(),
            groups,
            steps: self.steps,
            skipped: self.skipped,
            params,
        }
    }

    /// Restores a record made by [`Self::to_record`] (of this optimizer or of one built the
    /// same way; or mapped from another framework's state, see [`OptimizerRecord`]).
    /// Everything is checked before anything changes: the rule's kind and default
    /// hyper-parameters, the parameter names and order, the groups (same ids and parameters;
    /// their learning rates and hyper-parameters are restored, as torch's `load_state_dict`
    /// restores `param_groups`, and checked as at construction), for each parameter either no
    /// state (never updated) or exactly the state tensors its group's rule keeps, each with
    /// the expected shape, the state dtype (fp32 for fp16 parameters where the rule or the
    /// configuration says so) and finite values, and a finite fp32 master of the right shape
    /// for each parameter with a master. Gradients are cleared and a pending skip forgotten.
    ///
    /// # Errors
    /// [`AmpError::StateMismatch`] for any difference; nothing is changed then.
    pub fn load_record(&mut self, record: OptimizerRecord) -> Result<()> {
        let staged = self.stage_record(record)?;
        self.apply_staged(staged)
    }

    /// Checks that `record` comes from an optimizer of the same rule and defaults.
    fn check_identity(&self, record: &OptimizerRecord) -> Result<()> {
        let kind = self.inner.rule().kind();
        if record.kind != kind {
            return Err(mismatch(format!("the record is of a {} optimizer, this one is {kind}", record.kind)));
        }
        let ours = self.inner.defaults();
        if !ours.same_bits(&HyperParams::from(record.hyper_parameters.clone())) {
            return Err(mismatch(format!(
                "the record's {} hyper-parameters are {:?}, this optimizer's are {:?}: build the optimizer with the \
                 record's values",
                record.kind,
                record.hyper_parameters,
                ours.as_map()
            )));
        }
        if check_lr(record.lr).is_err() {
            return Err(mismatch(format!("learning rate {} must be finite and >= 0", record.lr)));
        }
        Ok(())
    }

    /// A recorded group's settings, checked against the rule.
    fn stage_group(&self, g: &GroupRecord) -> Result<(f64, HyperParams, u64)> {
        let hyper = HyperParams::from(g.hyper_parameters.clone());
        let defaults = self.inner.defaults();
        if !hyper.keys().eq(defaults.keys()) {
            return Err(mismatch(format!(
                "group {}: hyper-parameters {:?}, this optimizer's are {:?}",
                g.id,
                hyper.keys().collect::<Vec<_>>(),
                defaults.keys().collect::<Vec<_>>()
            )));
        }
        check_lr(g.lr)
            .and_then(|_| self.inner.rule().validate(g.lr, &hyper))
            .map_err(|e| mismatch(format!("group {}: lr {} and {:?}: {e}", g.id, g.lr, g.hyper_parameters)))?;
        Ok((g.lr, hyper, g.step))
    }

    /// A recorded parameter's state, checked against entry `i` and its group's `hyper`.
    fn stage_param(
        &self,
        i: usize,
        p: ParamRecord,
        hyper: &HyperParams,
        with_master: bool,
    ) -> Result<(u64, ParamStateBuffers, Option<Tensor>)> {
        let e = &self.entries[i];
        let target = e.update_target();
        let mut specs = self.inner.rule().state_spec(hyper);
        specs.sort_by(|a, b| a.name().cmp(b.name()));
        if !p.buffers.is_empty() || p.step > 0 {
            let found: Vec<&str> = p.buffers.keys().map(String::as_str).collect();
            let expected: Vec<&str> = specs.iter().map(|s| s.name()).collect();
            if found != expected {
                return Err(mismatch(format!(
                    "{}: optimizer state {found:?} at step {}, this optimizer keeps {expected:?}",
                    p.name, p.step
                )));
            }
        }
        let mut buffers = ParamStateBuffers::new();
        for (spec, (k, v)) in specs.iter().zip(p.buffers) {
            let (kind, shape) = spec.expected(target, self.inner.state_kind(target.kind()));
            let v = staged_tensor(&format!("{}/{k}", p.name), v, &shape, target, kind)?;
            if spec.shape() == StateShape::Scalar && v.dim() != 0 {
                return Err(mismatch(format!("{}/{k} must be a 0-dim tensor", p.name)));
            }
            buffers.insert(k, v);
        }
        let master = match (e.master(), p.master, with_master) {
            (Some(m), Some(v), true) => {
                Some(staged_tensor(&format!("{} (master)", p.name), v, &m.size(), m, Kind::Float)?)
            }
            (Some(_), None, true) => return Err(mismatch(format!("{}: the record has no master value", p.name))),
            _ => None,
        };
        Ok((p.step, buffers, master))
    }

    /// Checks `record` against this optimizer and stages its values on the parameters' device.
    pub(crate) fn stage_record(&self, record: OptimizerRecord) -> Result<StagedRecord> {
        record.validate()?;
        self.check_identity(&record)?;
        let names: Vec<&str> = record.params.iter().map(|p| p.name.as_str()).collect();
        if names != self.param_names() {
            return Err(mismatch(format!(
                "the record covers parameters {names:?}, this optimizer covers {:?}",
                self.param_names()
            )));
        }
        let ours = self.to_record().groups;
        let groups: Vec<(f64, HyperParams, u64)> = if record.groups.is_empty() {
            // The older form: learning rates only.
            let ids = self.param_groups();
            if let Some(g) = record.group_lr.keys().find(|g| !ids.contains(g)) {
                return Err(mismatch(format!(
                    "the record sets the learning rate of group {g}, this optimizer's groups are {ids:?}"
                )));
            }
            if record.group_lr.values().any(|&v| check_lr(v).is_err()) {
                return Err(mismatch(format!("learning rates {:?} must be finite and >= 0", record.group_lr)));
            }
            ours.iter()
                .map(|g| {
                    let glr = record.group_lr.get(&g.id).copied().unwrap_or(record.lr);
                    let hyper = HyperParams::from(g.hyper_parameters.clone());
                    self.inner
                        .rule()
                        .validate(glr, &hyper)
                        .map_err(|e| mismatch(format!("group {}: lr {glr}: {e}", g.id)))?;
                    Ok((glr, hyper, g.step))
                })
                .collect::<Result<_>>()?
        } else {
            if record.groups.len() != ours.len() {
                return Err(mismatch(format!(
                    "the record has {} parameter groups, this optimizer {} (add the same groups with \
                     add_param_group before loading)",
                    record.groups.len(),
                    ours.len()
                )));
            }
            let mut staged = Vec::with_capacity(ours.len());
            for (g, r) in ours.iter().zip(&record.groups) {
                if g.id != r.id || g.params != r.params {
                    return Err(mismatch(format!(
                        "the record's group {} holds {:?}, this optimizer's group {} holds {:?}",
                        r.id, r.params, g.id, g.params
                    )));
                }
                staged.push(self.stage_group(r)?);
            }
            staged
        };
        let group_of = self.inner.group_of().to_vec();
        let mut per_param = Vec::with_capacity(record.params.len());
        for (i, p) in record.params.into_iter().enumerate() {
            per_param.push(self.stage_param(i, p, &groups[group_of[i]].1, true)?);
        }
        Ok(StagedRecord { lr: record.lr, groups, steps: record.steps, skipped: record.skipped, per_param })
    }

    /// Applies a record checked by [`Self::stage_record`].
    pub(crate) fn apply_staged(&mut self, staged: StagedRecord) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let mut states = Vec::with_capacity(staged.per_param.len());
        for (e, (step, buffers, master)) in self.entries.iter().zip(staged.per_param) {
            if let (Some(m), Some(v)) = (e.master(), master) {
                let mut m = m.shallow_clone();
                m.f_copy_(&v).ctx("restoring a master weight")?;
            }
            states.push((step, buffers));
        }
        self.inner.restore(staged.lr, staged.groups, states);
        self.steps = staged.steps;
        self.skipped = staged.skipped;
        self.reset_transient()
    }

    /// Gradients cleared, pending skips and collapses forgotten.
    fn reset_transient(&mut self) -> Result<()> {
        self.zero_grad()?;
        self.skip_next = None;
        self.vanished = None;
        Ok(())
    }

    /// Checks the optimizer state of `record` (state tensors, step counts, groups' settings;
    /// never master values) against this optimizer, matching parameters and groups by name
    /// and id. `strict`: the parameters and groups must be the same ones; otherwise those of
    /// the record this optimizer lacks are ignored (`unexpected`) and those it has that the
    /// record lacks keep their state (`missing`).
    pub(crate) fn stage_state_only(&self, record: OptimizerRecord, strict: bool) -> Result<StagedPartial> {
        self.check_identity(&record)?;
        let names = self.param_names();
        let rec_names: Vec<String> = record.params.iter().map(|p| p.name.clone()).collect();
        let missing: Vec<String> =
            names.iter().filter(|n| !rec_names.iter().any(|r| r == *n)).map(|n| n.to_string()).collect();
        let unexpected: Vec<String> = rec_names.iter().filter(|r| !names.contains(&r.as_str())).cloned().collect();
        if strict && (!missing.is_empty() || !unexpected.is_empty()) {
            return Err(AmpError::IncompatibleKeys {
                what: "optimizer state".to_string(),
                missing_keys: missing,
                unexpected_keys: unexpected,
            });
        }
        let ours = self.to_record().groups;
        let mut missing_groups = Vec::new();
        let mut unexpected_groups = Vec::new();
        let mut groups = Vec::new();
        for (gi, g) in ours.iter().enumerate() {
            match record.groups.iter().find(|r| r.id == g.id) {
                Some(r) => {
                    if strict && r.params != g.params {
                        return Err(mismatch(format!(
                            "the record's group {} holds {:?}, this optimizer's holds {:?}",
                            r.id, r.params, g.params
                        )));
                    }
                    let (lr, hyper, step) = self.stage_group(r)?;
                    groups.push((gi, lr, hyper, step));
                }
                None if record.groups.is_empty() => {}
                None => missing_groups.push(format!("param_groups.{}", g.id)),
            }
        }
        for r in &record.groups {
            if !ours.iter().any(|g| g.id == r.id) {
                unexpected_groups.push(format!("param_groups.{}", r.id));
            }
        }
        if strict
            && (!missing.is_empty()
                || !unexpected.is_empty()
                || !missing_groups.is_empty()
                || !unexpected_groups.is_empty())
        {
            return Err(AmpError::IncompatibleKeys {
                what: "optimizer state".to_string(),
                missing_keys: [missing, missing_groups].concat(),
                unexpected_keys: [unexpected, unexpected_groups].concat(),
            });
        }
        if strict && rec_names != names.iter().map(|n| n.to_string()).collect::<Vec<_>>() {
            return Err(mismatch(format!(
                "the record covers parameters {rec_names:?} in another order than {names:?}"
            )));
        }
        let group_of = self.inner.group_of().to_vec();
        let mut per_param = Vec::new();
        for p in record.params {
            let Some(i) = names.iter().position(|n| *n == p.name) else { continue };
            let hyper = groups
                .iter()
                .find(|(gi, ..)| *gi == group_of[i])
                .map_or_else(|| self.inner.groups()[group_of[i]].hyper.clone(), |(_, _, h, _)| h.clone());
            let (step, buffers, _) = self.stage_param(i, p, &hyper, false)?;
            per_param.push((i, step, buffers));
        }
        Ok(StagedPartial {
            lr: record.lr,
            groups,
            steps: record.steps,
            skipped: record.skipped,
            per_param,
            missing: [missing, missing_groups].concat(),
            unexpected: [unexpected, unexpected_groups].concat(),
        })
    }

    /// Applies a state checked by [`Self::stage_state_only`]; returns the missing and
    /// unexpected keys.
    pub(crate) fn apply_state_only(&mut self, staged: StagedPartial) -> Result<(Vec<String>, Vec<String>)> {
        self.inner.set_default_lr(staged.lr);
        self.inner.restore_groups(staged.groups);
        self.inner.restore_params(staged.per_param);
        self.steps = staged.steps;
        self.skipped = staged.skipped;
        self.reset_transient()?;
        Ok((staged.missing, staged.unexpected))
    }

    /// Sets the fp32 masters of the parameters named in `values` (fp32 tensors on the
    /// parameters' device, already checked) and leaves the others.
    pub(crate) fn set_masters(&mut self, values: &BTreeMap<String, Tensor>) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        for e in &self.entries {
            if let (Some(m), Some(v)) = (e.master(), values.get(e.name())) {
                let mut m = m.shallow_clone();
                m.f_copy_(v).ctx("restoring a master weight")?;
            }
        }
        Ok(())
    }
}

impl AmpOptimizer {
    /// Per parameter, in [`Self::param_names`] order, what mapping torch.optim's state dicts
    /// needs (`crate::torch_checkpoint`): its tch parameter group, its place in the
    /// VarStore's creation order, its shape, whether it has an fp32 master and the dtype of its
    /// optimizer state.
    pub(crate) fn param_layout(&self) -> Vec<ParamLayout> {
        self.entries
            .iter()
            .map(|e| ParamLayout {
                group: e.group(),
                order: e.order(),
                shape: e.model().size(),
                has_master: e.master().is_some(),
                state_kind: self.inner.state_kind(e.update_target().kind()),
            })
            .collect()
    }
}

/// One parameter of an optimizer as [`AmpOptimizer::param_layout`] describes it.
#[derive(Debug, Clone)]
pub(crate) struct ParamLayout {
    pub(crate) group: usize,
    pub(crate) order: usize,
    pub(crate) shape: Vec<i64>,
    pub(crate) has_master: bool,
    pub(crate) state_kind: Kind,
}

/// A record checked against an optimizer, its tensors on the parameters' device.
#[derive(Debug)]
pub(crate) struct StagedRecord {
    lr: f64,
    groups: Vec<(f64, HyperParams, u64)>,
    steps: u64,
    skipped: u64,
    per_param: Vec<(u64, ParamStateBuffers, Option<Tensor>)>,
}

/// An optimizer state (no masters) checked against an optimizer, matched by name.
#[derive(Debug)]
pub(crate) struct StagedPartial {
    lr: f64,
    groups: Vec<(usize, f64, HyperParams, u64)>,
    steps: u64,
    skipped: u64,
    per_param: Vec<(usize, u64, ParamStateBuffers)>,
    missing: Vec<String>,
    unexpected: Vec<String>,
}

/// `v` checked against `shape` and `kind`, finite, moved to `like`'s device.
fn staged_tensor(what: &str, v: Tensor, shape: &[i64], like: &Tensor, kind: Kind) -> Result<Tensor> {
    if v.size() != shape || v.kind() != kind {
        return Err(mismatch(format!("{what}: {:?} {:?}, expected {kind:?} {shape:?}", v.kind(), v.size())));
    }
    crate::counters::note_host_read();
    let finite = v.f_isfinite().and_then(|f| f.f_all()).and_then(|a| a.f_int64_value(&[])).ctx("checking a state")?;
    if finite == 0 {
        return Err(mismatch(format!("{what}: holds inf or NaN")));
    }
    v.f_to_device(like.device()).ctx("moving a state to the parameter's device")
}
