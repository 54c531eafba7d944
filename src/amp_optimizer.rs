//! The optimizer `initialize` returns: steps the fp32 masters (O2) or the model's own
//! variables, skips a step after an overflow, clips on the master gradients.
use tch::{Kind, Tensor};

use crate::error::{AmpError, Result, TorchContext};
use crate::grads::{clear_grad, set_grad, take_grad, total_norm, unscale_};
use crate::master_weights::{copy_masters_to_model, ParamEntry};
use crate::optim::{check_lr, Optimizer, OptimizerConfig};

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

#[derive(Debug, Clone, Copy)]
struct PendingSkip {
    loss_id: usize,
    loss_scale: f64,
}

/// An optimizer under AMP. Made by [`crate::Amp::optimizer`] or [`crate::initialize`].
#[derive(Debug)]
pub struct AmpOptimizer {
    pub(crate) amp_id: u64,
    pub(crate) inner: Optimizer,
    pub(crate) entries: Vec<ParamEntry>,
    /// Gradients of self-mastered parameters set aside at `scale_loss` entry (accumulation).
    stash: Vec<Option<Tensor>>,
    /// Grads hold a scaled, not yet unscaled, contribution (a `delay_unscale` pass).
    pub(crate) scaled_pending: bool,
    skip_next: Option<PendingSkip>,
    pub(crate) disable_casts_in_step: bool,
    verbosity: u8,
    steps: u64,
    skipped: u64,
}

impl AmpOptimizer {
    pub(crate) fn new(
        amp_id: u64,
        config: OptimizerConfig,
        lr: f64,
        entries: Vec<ParamEntry>,
        disable_casts_in_step: bool,
        verbosity: u8,
    ) -> Result<Self> {
        let params = entries.iter().map(|e| e.stepped().shallow_clone()).collect();
        let groups = entries.iter().map(|e| e.group).collect();
        let inner = Optimizer::new(config, lr, params, groups)?;
        let stash = entries.iter().map(|_| None).collect();
        Ok(Self {
            amp_id,
            inner,
            entries,
            stash,
            scaled_pending: false,
            skip_next: None,
            disable_casts_in_step,
            verbosity,
            steps: 0,
            skipped: 0,
        })
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        self.inner.lr
    }

    /// Sets the learning rate of every parameter group.
    ///
    /// # Errors
    /// [`AmpError::InvalidOption`] for a negative or non-finite rate (nothing changes).
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_lr(lr)?;
        self.inner.lr = lr;
        self.inner.group_lr.clear();
        Ok(())
    }

    /// Sets the learning rate of one parameter group (variables created under
    /// `vs.root().set_group(group)`), as torch's per-group `lr`.
    ///
    /// # Errors
    /// [`AmpError::InvalidOption`] for a negative or non-finite rate (nothing changes).
    pub fn set_lr_group(&mut self, group: usize, lr: f64) -> Result<()> {
        check_lr(lr)?;
        self.inner.group_lr.insert(group, lr);
        Ok(())
    }

    /// The learning rate of `group`.
    pub fn lr_group(&self, group: usize) -> f64 {
        self.inner.group_lr.get(&group).copied().unwrap_or(self.inner.lr)
    }

    /// The optimizer's configuration.
    pub fn config(&self) -> OptimizerConfig {
        self.inner.config
    }

    /// Steps taken and steps skipped so far.
    pub fn step_counts(&self) -> (u64, u64) {
        (self.steps, self.skipped)
    }

    /// The parameters this optimizer updates: the fp32 masters for low-precision model
    /// variables under master weights, the model's own variables otherwise (Apex's
    /// `amp.master_params(optimizer)`). Shallow clones: they share storage and `.grad`.
    pub fn master_params(&self) -> Vec<Tensor> {
        self.entries.iter().map(|e| e.stepped().shallow_clone()).collect()
    }

    /// Names (VarStore paths) of the parameters, in the order of [`Self::master_params`].
    pub fn param_names(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.name.as_str()).collect()
    }

    /// Bytes held right now by the weights, masters, gradients and optimizer state.
    pub fn memory(&self) -> MemoryReport {
        let mut r = MemoryReport::default();
        for (e, st) in self.entries.iter().zip(&self.inner.state) {
            r.params += e.model.numel();
            r.weights += bytes(&e.model);
            r.grads += bytes(&e.model.grad());
            if let Some(m) = &e.master {
                r.masters += bytes(m);
                r.grads += bytes(&m.grad());
            }
            r.optimizer_state += st.buffers.values().map(bytes).sum::<usize>();
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
            clear_grad(&e.model)?;
            if let Some(m) = &e.master {
                clear_grad(m)?;
            }
        }
        self.stash.iter_mut().for_each(|s| *s = None);
        self.scaled_pending = false;
        Ok(())
    }

    /// Updates the parameters from their (unscaled) gradients, or skips the update when a
    /// loss that reached this optimizer overflowed since the last step. With master weights
    /// the fp16 model is then set to the masters rounded to fp16.
    ///
    /// # Errors
    /// [`AmpError::Usage`] when the gradients are still scaled (the last `scale_loss` used
    /// `delay_unscale`); [`AmpError::Torch`] if an update fails.
    pub fn step(&mut self) -> Result<StepOutcome> {
        if let Some(skip) = self.skip_next.take() {
            // Every gradient of this optimizer is dropped: they hold the inf/NaN. (Apex clears
            // only the masters of fp16 variables, so an fp32 variable's inf survives into the
            // next pass when the caller accumulates without zero_grad.)
            self.zero_grad()?;
            self.skipped += 1;
            if self.verbosity >= 1 {
                println!(
                    "Gradient overflow.  Skipping step, loss scaler {} reducing loss scale to {}",
                    skip.loss_id, skip.loss_scale
                );
            }
            return Ok(StepOutcome::Skipped { loss_id: skip.loss_id, loss_scale: skip.loss_scale });
        }
        if self.scaled_pending {
            return Err(AmpError::Usage(
                "step() called while the gradients are still scaled: the last scale_loss used delay_unscale; \
                 run a scale_loss without delay_unscale before stepping"
                    .into(),
            ));
        }
        if self.disable_casts_in_step {
            crate::o1::without_casts(|| self.inner.step())??;
        } else {
            self.inner.step()?;
        }
        copy_masters_to_model(&self.entries)?;
        // As Apex: master grads are not reached by zeroing the model's grads, so they are
        // released here (which also frees their memory until the next backward).
        for e in &self.entries {
            if let Some(m) = &e.master {
                clear_grad(m)?;
            }
        }
        self.steps += 1;
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
        if !(max_norm.is_finite() && max_norm >= 0.0) {
            return Err(AmpError::InvalidOption {
                option: "max_norm",
                value: max_norm.to_string(),
                expected: "a finite number >= 0",
            });
        }
        if norm_type.is_nan() || norm_type <= 0.0 {
            return Err(AmpError::InvalidOption {
                option: "norm_type",
                value: norm_type.to_string(),
                expected: "a positive number or f64::INFINITY",
            });
        }
        let grads: Vec<Tensor> =
            self.entries.iter().map(|e| e.stepped().grad()).filter(Tensor::defined).collect();
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
        total.f_double_value(&[]).ctx("reading the gradient norm")
    }

    /// `scale_loss` entry: set aside existing gradients so that the new, scaled ones can be
    /// unscaled alone and added back (gradient accumulation across losses/iterations).
    pub(crate) fn prepare_backward(&mut self) -> Result<()> {
        if self.scaled_pending {
            return Ok(());
        }
        for (e, stash) in self.entries.iter().zip(self.stash.iter_mut()) {
            match &e.master {
                // Master grads keep accumulating; the fp16 grads must start empty.
                Some(_) => clear_grad(&e.model)?,
                None => *stash = take_grad(&e.model)?,
            }
        }
        Ok(())
    }

    /// `scale_loss` exit: unscale the new gradients into the fp32 master gradients (or in
    /// place), flag inf/NaN into `found_inf`, and add back what was set aside. No host sync.
    pub(crate) fn post_backward(&mut self, found_inf: &Tensor, inv_scale: &Tensor) -> Result<()> {
        // Gather the new (scaled) gradients: fp16 model grads become fresh fp32 tensors.
        let mut fresh: Vec<Tensor> = Vec::new();
        let mut targets: Vec<(usize, Tensor)> = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            match &e.master {
                Some(_) => {
                    if let Some(g) = take_grad(&e.model)? {
                        let g32 = g.f_to_kind(Kind::Float).ctx("copying a model gradient to fp32")?;
                        fresh.push(g32.shallow_clone());
                        targets.push((i, g32));
                    }
                }
                None => {
                    let g = e.model.grad();
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
            let e = &self.entries[i];
            match &e.master {
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
                set_grad(&e.model, &s)?;
            }
        }
        self.scaled_pending = false;
        Ok(())
    }

    pub(crate) fn mark_skip(&mut self, loss_id: usize, loss_scale: f64) {
        self.skip_next = Some(PendingSkip { loss_id, loss_scale });
    }
}

impl AmpOptimizer {
    /// Checkpoint restore (values already checked): lr, counters, per-parameter step counts,
    /// buffers and master values.
    pub(crate) fn restore(
        &mut self,
        (lr, group_lr): (f64, std::collections::BTreeMap<usize, f64>),
        steps: u64,
        skipped: u64,
        per_param: Vec<(u64, std::collections::BTreeMap<&'static str, Tensor>, Option<Tensor>)>,
    ) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        self.inner.lr = lr;
        self.inner.group_lr = group_lr;
        self.steps = steps;
        self.skipped = skipped;
        for ((e, st), (step, buffers, master)) in self.entries.iter().zip(self.inner.state.iter_mut()).zip(per_param) {
            st.step = step;
            st.buffers = buffers;
            if let (Some(m), Some(v)) = (&e.master, master) {
                let mut m = m.shallow_clone();
                m.f_copy_(&v).ctx("restoring a master weight")?;
            }
        }
        self.zero_grad()?;
        self.skip_next = None;
        Ok(())
    }
}
