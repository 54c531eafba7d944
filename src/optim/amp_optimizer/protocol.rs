//! The scaling protocol's side of the optimizer: the hooks [`crate::Amp::scale_loss`] calls
//! around backward (set aside, unscale, flag, mark a skip), and the gradient inspections of the
//! overflow path.
use crate::error::Divergence;
use tch::{Device, Kind, Tensor};

use super::{AmpOptimizer, Stage};
use crate::error::{AmpError, Result, TorchContext};
use crate::optim::grads::{clear_grad, set_grad, take_grad, unscale_};
use crate::optim::params::ParamEntry;
use crate::scaling::{NonFiniteGrad, OverflowReport};

/// An overflow seen by a `scale_loss` pass: the next `step` skips and reports it.
#[derive(Debug, Clone)]
pub(super) struct PendingSkip {
    pub(super) loss_id: usize,
    pub(super) loss_scale: f64,
    pub(super) report: OverflowReport,
    pub(super) collapse: Option<CollapseInfo>,
}

/// A collapse of a loss scaler, reported by the next `step()` (see [`Divergence::ScaleCollapsed`]
/// and [`Divergence::GradientsVanished`]).
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
    pub(super) fn error(self) -> AmpError {
        let last_pass = self.first_pass.saturating_add(self.passes.saturating_sub(1));
        let (loss_id, first_pass, passes, loss_scale) = (self.loss_id, self.first_pass, self.passes, self.loss_scale);
        if self.overflow {
            AmpError::Diverged(Divergence::ScaleCollapsed {
                loss_id,
                first_pass,
                last_pass,
                passes,
                loss_scale,
                params: self.params,
            })
        } else {
            AmpError::Diverged(Divergence::GradientsVanished { loss_id, first_pass, last_pass, passes, loss_scale })
        }
    }
}

impl AmpOptimizer {
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
            let g = e.update_target().grad();
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
            let g = e.update_target().grad();
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

    /// [`Self::grads_all_zero`] over every rank of a sharded optimizer (a collective).
    pub(crate) fn grads_all_zero_agreed(&self) -> Result<Option<bool>> {
        let local = self.grads_all_zero()?;
        self.agree_all_zero(local)
    }

    /// The fp32 masters (of the fp16/bf16 parameters under master weights), shallow clones.
    pub(crate) fn masters(&self) -> Vec<Tensor> {
        self.entries.iter().filter_map(|e| e.master().map(Tensor::shallow_clone)).collect()
    }

    /// The fp32 masters by VarStore name (this rank's shard's for a sharded optimizer).
    pub(crate) fn named_masters(&self) -> Vec<(String, Tensor)> {
        self.entries.iter().filter_map(|e| e.master().map(|m| (e.name().to_string(), m.shallow_clone()))).collect()
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
        self.door = super::FrontDoor::Apex;
        if matches!(self.stage, Stage::Scaled) {
            return Ok(());
        }
        for (i, (e, stash)) in self.entries.iter().zip(self.stash.iter_mut()).enumerate() {
            let owned = self.shard.as_ref().map_or(true, |s| s.owns(i));
            match e.master() {
                // Master grads keep accumulating; the fp16 grads must start empty (and so must
                // those of another rank's parameters, which are dropped at the exit).
                Some(_) => clear_grad(e.model())?,
                None if !owned => clear_grad(e.model())?,
                None => *stash = take_grad(e.model())?,
            }
        }
        Ok(())
    }

    /// `scale_loss` exit after a `delay_unscale` pass: the gradients stay scaled.
    pub(crate) fn keep_scaled(&mut self) {
        self.enter(Stage::Scaled);
    }

    /// A `scale_loss` pass that handed the loss straight to backward (disabled AMP, or a
    /// static scale of 1 without masters): the gradients are as backward left them.
    pub(crate) fn note_pass_through(&mut self) {
        self.door = super::FrontDoor::Apex;
        self.enter(Stage::Unscaled);
    }

    /// `scale_loss` exit: unscale the new gradients into the fp32 master gradients (or in
    /// place), flag inf/NaN into `found_inf`, and add back what was set aside. No host sync.
    /// The fp16 model gradients of parameters with masters are released (Apex keeps them until
    /// `zero_grad`; the masters' are what the optimizer steps and clips).
    pub(crate) fn end_backward(&mut self, found_inf: &Tensor, inv_scale: &Tensor) -> Result<()> {
        // Gather the new (scaled) gradients: fp16 model grads become fresh fp32 tensors.
        let mut fresh: Vec<Tensor> = Vec::new();
        let mut targets: Vec<(usize, Tensor)> = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            if !self.owns(i) {
                // Another rank updates it (and checks its gradient, the same after DDP's
                // averaging): released here.
                clear_grad(e.model())?;
                self.stash[i] = None;
                continue;
            }
            match e.master() {
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
        self.enter(Stage::Unscaled);
        Ok(())
    }

    pub(crate) fn mark_skip(
        &mut self,
        loss_id: usize,
        loss_scale: f64,
        report: OverflowReport,
        collapse: Option<CollapseInfo>,
    ) {
        self.stage = Stage::Overflowed(PendingSkip { loss_id, loss_scale, report, collapse });
    }

    pub(crate) fn mark_vanished(&mut self, collapse: CollapseInfo) {
        if !matches!(self.stage, Stage::Overflowed(_)) {
            self.stage = Stage::Vanished(collapse);
        }
    }
}
