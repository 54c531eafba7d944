//! [`Fp16Optimizer`], Apex's legacy `FP16_Optimizer` (apex.fp16_utils at e13873de): fp32
//! masters for the fp16 parameters, a static or dynamic loss scale, `backward(loss)`,
//! `update_master_grads`, `clip_master_grads`, `step` skipping on overflow, and a state dict
//! in Apex's keys. The update rules, masters and their records are [`AmpOptimizer`]'s; the
//! scale is a [`LossScaler`] set up as Apex's amp `LossScaler` that `FP16_Optimizer` uses.
use crate::error::{ConfigError, StateError, UsageError};
use serde::{Deserialize, Serialize};
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::config::rules::positive_scale;
use crate::config::{AmpConfig, LossScale, OptLevel};
use crate::error::{mismatch, AmpError, Result, TorchContext};
use crate::optim::{AmpOptimizer, OptimizerConfig, OptimizerRecord, StepOutcome};
use crate::scaling::LossScaler;
use crate::torch_io::{Dict, Value};
use crate::{Amp, CpuKernels};

/// Apex's `dynamic_loss_args`: the options `FP16_Optimizer` hands to amp's `LossScaler`.
/// Defaults are that scaler's: start at 2^16 (capped at `max_loss_scale`), halve on overflow,
/// double after 2000 clean passes, at most 2^24, no floor.
///
/// Note: the legacy `apex.fp16_utils.DynamicLossScaler` class (2^32, factor 2, window 1000,
/// floor 1) is *not* what `FP16_Optimizer` used at e13873de; its `dynamic_loss_args` went to
/// `apex.amp.scaler.LossScaler`, reproduced here.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DynamicLossArgs {
    /// Initial scale, capped at `max_loss_scale` (Apex: `min(max_loss_scale, init_scale)`).
    pub init_scale: f64,
    /// Accepted for Apex's signature, but amp's `LossScaler` ignored it and always halved and
    /// doubled: only 2.0 is accepted (anything else would not reproduce the Python run).
    pub scale_factor: f64,
    /// Clean backward passes in a row before the scale doubles.
    pub scale_window: u64,
    /// Floor under the scale. `None`: Apex had none; tch-amp puts
    /// [`LossScaler::DEFAULT_MIN_LOSS_SCALE`] (2^-24) there, reached only after ~40 overflows
    /// in a row from 2^16.
    pub min_loss_scale: Option<f64>,
    /// Cap over the scale.
    pub max_loss_scale: f64,
}

impl Default for DynamicLossArgs {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            scale_factor: 2.0,
            scale_window: 2000,
            min_loss_scale: None,
            max_loss_scale: LossScaler::DEFAULT_MAX_LOSS_SCALE,
        }
    }
}

impl DynamicLossArgs {
    /// Sets `init_scale`.
    pub fn init_scale(mut self, v: f64) -> Self {
        self.init_scale = v;
        self
    }
    /// Sets `scale_factor` (only 2.0 is accepted; see the field).
    pub fn scale_factor(mut self, v: f64) -> Self {
        self.scale_factor = v;
        self
    }
    /// Sets `scale_window`.
    pub fn scale_window(mut self, v: u64) -> Self {
        self.scale_window = v;
        self
    }
    /// Sets `min_loss_scale`.
    pub fn min_loss_scale(mut self, v: f64) -> Self {
        self.min_loss_scale = Some(v);
        self
    }
    /// Sets `max_loss_scale`.
    pub fn max_loss_scale(mut self, v: f64) -> Self {
        self.max_loss_scale = v;
        self
    }
}

/// The constructor arguments of Apex's `FP16_Optimizer(init_optimizer, static_loss_scale=1.0,
/// dynamic_loss_scale=False, dynamic_loss_args=None, verbose=True)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Fp16OptimizerOptions {
    /// The fixed scale when `dynamic_loss_scale` is false (never checked for overflow).
    pub static_loss_scale: f64,
    /// Use a dynamic scale.
    pub dynamic_loss_scale: bool,
    /// Options of the dynamic scale (`None`: the defaults).
    pub dynamic_loss_args: Option<DynamicLossArgs>,
    /// Print Apex's line at each skipped step ("Gradient overflow.  Skipping step, reducing
    /// loss scale to ..."). Apex also printed each parameter at construction; tch-amp does not.
    pub verbose: bool,
}

impl Default for Fp16OptimizerOptions {
    fn default() -> Self {
        Self { static_loss_scale: 1.0, dynamic_loss_scale: false, dynamic_loss_args: None, verbose: true }
    }
}

impl Fp16OptimizerOptions {
    /// Sets `static_loss_scale`.
    pub fn static_loss_scale(mut self, v: f64) -> Self {
        self.static_loss_scale = v;
        self
    }
    /// Sets `dynamic_loss_scale`.
    pub fn dynamic_loss_scale(mut self, on: bool) -> Self {
        self.dynamic_loss_scale = on;
        self
    }
    /// Sets `dynamic_loss_args` (and does not by itself turn dynamic scaling on, as in Apex).
    pub fn dynamic_loss_args(mut self, args: DynamicLossArgs) -> Self {
        self.dynamic_loss_args = Some(args);
        self
    }
    /// Sets `verbose`.
    pub fn verbose(mut self, on: bool) -> Self {
        self.verbose = on;
        self
    }
}

/// What Apex pickled as `state_dict['loss_scaler']` (amp's `LossScaler` object), attribute by
/// attribute (Apex's leading underscores dropped; `scale_seq_len` is the window).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LegacyScalerState {
    /// `_loss_scale`.
    pub loss_scale: f64,
    /// `_unskipped`: clean passes since the last change.
    pub unskipped: u64,
    /// `dynamic`.
    pub dynamic: bool,
    /// `_scale_seq_len`: the growth window.
    pub scale_seq_len: u64,
    /// `_min_loss_scale`.
    pub min_loss_scale: Option<f64>,
    /// `_max_loss_scale`.
    pub max_loss_scale: f64,
}

/// `FP16_Optimizer.state_dict()`, with Apex's keys as fields.
#[derive(Debug)]
pub struct Fp16OptimizerState {
    /// The loss scaler.
    pub loss_scaler: LegacyScalerState,
    /// Whether the scale is dynamic.
    pub dynamic_loss_scale: bool,
    /// Whether the last gradients overflowed (the next `step` skips).
    pub overflow: bool,
    /// Apex's closure bookkeeping; always true between steps (closures are not supported).
    pub first_closure_call_this_step: bool,
    /// The wrapped optimizer's state ([`AmpOptimizer::to_record`], its tensors copied).
    pub optimizer_state_dict: OptimizerRecord,
    /// The fp32 masters of the fp16 parameters, per parameter group (ascending tch group ids,
    /// each group's parameters in creation order). Copies.
    pub fp32_from_fp16: Vec<Vec<Tensor>>,
}

/// `record` with every tensor copied, so that it survives the next steps.
fn copied(mut record: OptimizerRecord) -> Result<OptimizerRecord> {
    let copy = |t: &Tensor| t.f_detach_copy().ctx("copying optimizer state");
    for p in record.params.iter_mut() {
        for b in p.buffers.values_mut() {
            *b = copy(b)?;
        }
        if let Some(m) = p.master.as_mut() {
            *m = copy(m)?;
        }
    }
    Ok(record)
}

/// One parameter as `FP16_Optimizer` sees it.
#[derive(Debug)]
struct Slot {
    name: String,
    group: usize,
    model: Tensor,
    /// The fp32 master of an fp16 parameter (`None`: an fp32 parameter, stepped itself).
    master: Option<Tensor>,
}

impl Slot {
    /// The tensor the optimizer updates (and whose gradient it reads).
    fn target(&self) -> &Tensor {
        self.master.as_ref().unwrap_or(&self.model)
    }
}

/// Apex's `FP16_Optimizer`: an optimizer over a `VarStore` whose fp16 variables get fp32
/// masters. See the [module documentation](crate::fp16_utils) for an example.
///
/// Each step: [`Self::zero_grad`]; [`Self::backward`] (the loss in fp32 times the scale,
/// backward, then [`Self::update_master_grads`]: each fp16 gradient copied to fp32 times
/// 1/scale into its master's gradient, fp32 gradients multiplied by 1/scale in place, any
/// inf/NaN an overflow for a dynamic scale, and the scale updated); optionally
/// [`Self::clip_master_grads`]; [`Self::step`] (skipped after an overflow; otherwise the
/// masters and fp32 parameters are updated and the masters rounded into the fp16 model).
#[derive(Debug)]
pub struct Fp16Optimizer {
    opt: AmpOptimizer,
    slots: Vec<Slot>,
    groups: Vec<usize>,
    scaler: LossScaler,
    scaler_cfg: LegacyScalerState,
    overflow: bool,
    first_closure_call_this_step: bool,
    /// `backward_with(.., false)` ran since the last `update_master_grads`.
    pending_update: bool,
    /// Master gradients were made since the last step.
    fresh: bool,
    verbose: bool,
}

fn invalid(option: &'static str, value: impl ToString, expected: &'static str) -> AmpError {
    AmpError::Config(ConfigError::InvalidOption { option, value: value.to_string(), expected })
}

/// A tch-amp [`Amp`] whose scaler 0 is Apex's amp `LossScaler` in state `s`, and whose
/// optimizers give fp16 variables fp32 masters without any cast policy (CPU kernels native).
fn scaler_amp(s: &LegacyScalerState) -> Result<Amp> {
    let mut c = AmpConfig::new(OptLevel::O2).cpu_kernels(CpuKernels::Native);
    c = if s.dynamic {
        let c = c.loss_scale(LossScale::Dynamic).max_loss_scale(s.max_loss_scale);
        // Apex: `if self._min_loss_scale:` (None and 0 mean no floor).
        match s.min_loss_scale {
            Some(m) if m != 0.0 => c.min_loss_scale(m),
            _ => c,
        }
    } else {
        c.loss_scale(LossScale::Static(s.loss_scale))
    };
    let mut amp = Amp::new(&c)?;
    let int = |v: u64| Value::Int(i64::try_from(v).unwrap_or(i64::MAX));
    let state = if s.dynamic {
        Dict::new()
            .with("scale", Value::Float(s.loss_scale))
            .with("growth_factor", Value::Float(2.0))
            .with("backoff_factor", Value::Float(0.5))
            .with("growth_interval", int(s.scale_seq_len))
            .with("_growth_tracker", int(s.unskipped))
    } else {
        Dict::new().with(
            "loss_scaler0",
            Value::Dict(Dict::new().with("loss_scale", Value::Float(s.loss_scale)).with("unskipped", int(s.unskipped))),
        )
    };
    let state = Value::Dict(state);
    amp.load_state_dict(&state)?;
    Ok(amp)
}

/// The scaler `FP16_Optimizer` sets up from its options (amp's `LossScaler`), checked.
fn legacy_scaler(options: &Fp16OptimizerOptions) -> Result<LegacyScalerState> {
    Ok(if options.dynamic_loss_scale {
        let a = options.dynamic_loss_args.unwrap_or_default();
        if a.scale_factor != 2.0 {
            return Err(invalid(
                "scale_factor",
                a.scale_factor,
                "2.0: FP16_Optimizer passed dynamic_loss_args to amp's LossScaler, which ignored scale_factor \
                 and always halved and doubled the scale, so the Python run used 2 (drop the argument)",
            ));
        }
        if a.scale_window == 0 {
            return Err(invalid("scale_window", 0, "at least 1 clean pass"));
        }
        positive_scale("init_scale", a.init_scale)?;
        LegacyScalerState {
            loss_scale: a.init_scale.min(a.max_loss_scale),
            unskipped: 0,
            dynamic: true,
            scale_seq_len: a.scale_window,
            min_loss_scale: a.min_loss_scale,
            max_loss_scale: a.max_loss_scale,
        }
    } else {
        positive_scale("static_loss_scale", options.static_loss_scale)?;
        LegacyScalerState {
            loss_scale: options.static_loss_scale,
            unskipped: 0,
            dynamic: false,
            scale_seq_len: 2000,
            min_loss_scale: None,
            max_loss_scale: LossScaler::DEFAULT_MAX_LOSS_SCALE,
        }
    })
}

/// The optimizer's parameters in Apex's order: parameter groups in order, each group's
/// parameters as the model made them; fp16 ones with their masters.
fn apex_order(vs: &VarStore, opt: &AmpOptimizer) -> Result<Vec<Slot>> {
    // Apex's order: parameter groups in order, each group's parameters as the model made them.
    let order: Vec<(Tensor, usize)> = {
        let v = vs.variables_.lock().map_err(|_| {
            AmpError::torch("locking the VarStore", "the lock is poisoned: another thread panicked while holding it")
        })?;
        v.trainable_variables.iter().map(|var| (var.tensor.shallow_clone(), var.group)).collect()
    };
    let vars = vs.variables();
    let mut keyed = Vec::new();
    for (name, target) in opt.param_names().into_iter().zip(opt.master_params()) {
        let model = vars[name].shallow_clone();
        let pos = order.iter().position(|(t, _)| t.is_set_to(&model));
        let group = pos.map_or(0, |i| order[i].1);
        let master = (model.kind() == Kind::Half).then_some(target);
        keyed.push(((group, pos.unwrap_or(usize::MAX)), Slot { name: name.to_string(), group, model, master }));
    }
    keyed.sort_by_key(|(k, _)| *k);
    Ok(keyed.into_iter().map(|(_, s)| s).collect())
}

impl Fp16Optimizer {
    /// Apex's `FP16_Optimizer(optimizer, static_loss_scale=.., dynamic_loss_scale=..,
    /// dynamic_loss_args=..)` where `optimizer = <config>(model.parameters(), lr)`: an optimizer
    /// over every trainable variable of `vs`; fp16 ones get fp32 masters (copies of their current
    /// values), fp32 ones are stepped themselves.
    ///
    /// # Errors
    /// [`ConfigError::LegacyParamDtype`] for a trainable variable neither fp16 nor fp32;
    /// [`ConfigError::InvalidOption`] for a static scale or `init_scale` that is not finite and
    /// positive (or outside the dynamic scaler's range), `scale_factor` other than 2, a
    /// `scale_window` of 0, bad `min_loss_scale`/`max_loss_scale`, or a bad learning rate.
    pub fn new(
        vs: &VarStore,
        config: impl Into<OptimizerConfig>,
        lr: f64,
        options: Fp16OptimizerOptions,
    ) -> Result<Self> {
        let mut names: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some((name, v)) =
            names.iter().find(|(_, v)| v.requires_grad() && !matches!(v.kind(), Kind::Half | Kind::Float))
        {
            return Err(AmpError::Config(ConfigError::LegacyParamDtype { name: name.clone(), kind: v.kind() }));
        }
        let cfg = legacy_scaler(&options)?;
        let amp = scaler_amp(&cfg).map_err(|e| match e {
            AmpError::State(StateError::StateMismatch { message }) => AmpError::Config(ConfigError::InvalidOption {
                option: "dynamic_loss_args",
                value: message,
                expected: "init_scale within [min_loss_scale (2^-24 when unset), max_loss_scale]",
            }),
            other => other,
        })?;
        let scaler = amp.scaler(0)?.clone();
        let opt = amp.optimizer(vs, config, lr)?;
        let slots = apex_order(vs, &opt)?;
        let mut groups: Vec<usize> = slots.iter().map(|s| s.group).collect();
        groups.sort_unstable();
        groups.dedup();
        Ok(Self {
            opt,
            slots,
            groups,
            scaler,
            scaler_cfg: cfg,
            overflow: false,
            first_closure_call_this_step: true,
            pending_update: false,
            fresh: false,
            verbose: options.verbose,
        })
    }

    /// The current loss scale (Apex's `loss_scale` property).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.loss_scale()
    }

    /// Sets the loss scale (Apex's `loss_scale` setter); the count of clean passes is kept.
    ///
    /// # Errors
    /// [`StateError::StateMismatch`] for a scale outside the scaler's range (nothing changes).
    pub fn set_loss_scale(&mut self, scale: f64) -> Result<()> {
        let cfg = LegacyScalerState { loss_scale: scale, unskipped: self.scaler.unskipped(), ..self.scaler_cfg };
        self.scaler = scaler_amp(&cfg)?.scaler(0)?.clone();
        self.scaler_cfg.loss_scale = scale;
        Ok(())
    }

    /// Whether the last [`Self::update_master_grads`] found an overflow (Apex's `overflow`):
    /// the next [`Self::step`] skips.
    pub fn overflow(&self) -> bool {
        self.overflow
    }

    /// Whether the scale is dynamic (Apex's `dynamic_loss_scale`).
    pub fn dynamic_loss_scale(&self) -> bool {
        self.scaler_cfg.dynamic
    }

    /// The loss scaler (its scale, clean passes, overflows, history of changes).
    pub fn loss_scaler(&self) -> &LossScaler {
        &self.scaler
    }

    /// The wrapped optimizer (learning rates, records, memory).
    pub fn optimizer(&self) -> &AmpOptimizer {
        &self.opt
    }

    /// Sets the learning rate of every group (Apex: `for g in optimizer.param_groups:
    /// g['lr'] = lr`).
    ///
    /// # Errors
    /// As [`AmpOptimizer::set_lr`].
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.opt.set_lr(lr)
    }

    /// Sets the learning rate of one tch parameter group.
    ///
    /// # Errors
    /// As [`AmpOptimizer::set_lr_group`].
    pub fn set_lr_group(&mut self, group: usize, lr: f64) -> Result<()> {
        self.opt.set_lr_group(group, lr)
    }

    /// The parameters the optimizer updates, in Apex's order (groups ascending, creation order
    /// within a group): the fp32 masters of fp16 variables, the fp32 variables themselves.
    /// Shallow clones (they share storage and `.grad`).
    pub fn master_params(&self) -> Vec<Tensor> {
        self.slots.iter().map(|s| s.target().shallow_clone()).collect()
    }

    /// The VarStore names, in the order of [`Self::master_params`].
    pub fn param_names(&self) -> Vec<&str> {
        self.slots.iter().map(|s| s.name.as_str()).collect()
    }

    /// Apex's `inspect_master_grad_data()`: per group, each master's (or fp32 parameter's)
    /// gradient, `None` where it has none; `None` in an overflow state (the gradients are
    /// invalid), as Apex.
    pub fn inspect_master_grad_data(&self) -> Option<Vec<Vec<Option<Tensor>>>> {
        if self.overflow {
            return None;
        }
        Some(
            self.groups
                .iter()
                .map(|&g| {
                    self.slots
                        .iter()
                        .filter(|s| s.group == g)
                        .map(|s| Some(s.target().grad()).filter(Tensor::defined))
                        .collect()
                })
                .collect(),
        )
    }

    /// Apex's `zero_grad()`: zeroes every existing gradient (masters, fp32 and fp16 variables);
    /// gradients that do not exist stay absent.
    ///
    /// # Errors
    /// [`AmpError::Torch`] if zeroing fails (not expected).
    pub fn zero_grad(&mut self) -> Result<()> {
        for s in &self.slots {
            for t in std::iter::once(&s.model).chain(s.master.as_ref()) {
                let mut g = t.grad();
                if g.defined() {
                    let _ = g.f_zero_().ctx("zero_grad")?;
                }
            }
        }
        Ok(())
    }

    /// Apex's `zero_grad(set_grads_to_None=True)`: every gradient set to None (freed).
    ///
    /// # Errors
    /// [`AmpError::Torch`](crate::AmpError::Torch) if libtorch refuses (not expected).
    pub fn zero_grad_set_to_none(&mut self) -> Result<()> {
        for s in &self.slots {
            for t in std::iter::once(&s.model).chain(s.master.as_ref()) {
                crate::sys::set_grad(t, None)?;
            }
        }
        Ok(())
    }

    /// Apex's `backward(loss)`: [`Self::backward_with`] with `update_master_grads = true`.
    ///
    /// # Errors
    /// As [`Self::backward_with`].
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        self.backward_with(loss, true)
    }

    /// Apex's `backward(loss, update_master_grads)`: `(loss.float() * loss_scale).backward()`, then
    /// [`Self::update_master_grads`] unless `update_master_grads` is false (several losses
    /// accumulate their scaled fp16 gradients first; call `update_master_grads()` once before
    /// `step`).
    ///
    /// # Errors
    /// Checked before backward runs: [`UsageError::BadLoss`](crate::error::UsageError::BadLoss);
    /// afterwards [`AmpError::Torch`] from backward.
    pub fn backward_with(&mut self, loss: &Tensor, update_master_grads: bool) -> Result<()> {
        crate::error::check_loss_value(loss)?;
        let scaled = loss.f_to_kind(Kind::Float).ctx("loss.float()")? * self.scaler.loss_scale();
        scaled.f_backward().ctx("backward")?;
        self.pending_update = true;
        if update_master_grads {
            self.update_master_grads()?;
        }
        Ok(())
    }

    /// Apex's `update_master_grads()`: each fp16 gradient (in order) copied to fp32 and
    /// multiplied by 1/scale into its master's gradient, then each fp32 gradient multiplied by
    /// 1/scale in place; with a dynamic scale the first gradient holding inf/NaN stops the copy
    /// and is an overflow. Then one pass of the scaler (halve on overflow; double after
    /// `scale_window` clean passes) and [`Self::overflow`] set. One host read per gradient under
    /// dynamic scaling.
    ///
    /// # Errors
    /// [`AmpError::Torch`] if an op fails (not expected).
    pub fn update_master_grads(&mut self) -> Result<()> {
        let scale = self.scaler.loss_scale();
        let inv = 1.0 / scale;
        let dynamic = self.scaler_cfg.dynamic;
        let non_finite = |g: &Tensor| -> Result<bool> {
            crate::counters::note_host_read();
            Ok(g.f_isfinite().and_then(|f| f.f_all()).and_then(|a| a.f_int64_value(&[])).ctx("overflow check")? == 0)
        };
        let _no_grad = tch::no_grad_guard();
        let mut overflow = false;
        for s in self.slots.iter().filter(|s| s.master.is_some()) {
            let g = s.model.grad();
            if !g.defined() {
                continue;
            }
            if dynamic && non_finite(&g)? {
                overflow = true;
                break;
            }
            let mut g32 = g.f_to_kind(Kind::Float).ctx("copying a model gradient to fp32")?;
            if g32.data_ptr() == g.data_ptr() {
                g32 = g32.f_detach_copy().ctx("copying a model gradient")?;
            }
            let _ = g32.f_mul_scalar_(inv).ctx("unscaling a master gradient")?;
            if let Some(m) = &s.master {
                crate::sys::set_grad(m, Some(&g32))?;
            }
        }
        if !overflow {
            for s in self.slots.iter().filter(|s| s.master.is_none()) {
                let mut g = s.model.grad();
                if !g.defined() {
                    continue;
                }
                if dynamic && non_finite(&g)? {
                    overflow = true;
                    break;
                }
                let _ = g.f_mul_scalar_(inv).ctx("unscaling a gradient")?;
            }
        }
        self.overflow = self.scaler.update(overflow);
        self.pending_update = false;
        self.fresh = true;
        Ok(())
    }

    /// Apex's `clip_master_grads(max_norm)`: torch's `clip_grad_norm_` over
    /// [`Self::master_params`] (in that order), returning the total 2-norm; -1.0 when the last
    /// gradients overflowed (Apex's value; nothing is clipped then).
    ///
    /// # Errors
    /// As [`super::clip_grad_norm`].
    pub fn clip_master_grads(&mut self, max_norm: f64) -> Result<f64> {
        self.clip_master_grads_with(max_norm, 2.0)
    }

    /// [`Self::clip_master_grads`] with a `norm_type` (`f64::INFINITY` for the max norm).
    ///
    /// # Errors
    /// As [`super::clip_grad_norm`].
    pub fn clip_master_grads_with(&mut self, max_norm: f64, norm_type: f64) -> Result<f64> {
        if self.overflow {
            return Ok(-1.0);
        }
        super::clip_grad_norm(&self.master_params(), max_norm, norm_type)
    }

    /// Apex's `step()`: after an overflow nothing happens (returns [`StepOutcome::Skipped`] with
    /// the reduced scale; Apex printed "Gradient overflow.  Skipping step, reducing loss scale to
    /// ..." and returned None; [`Self::overflow`] is Apex's flag); otherwise the wrapped optimizer
    /// updates the masters and fp32 variables from their gradients, each master is rounded into
    /// its fp16 variable, and [`StepOutcome::Stepped`] is returned. The master gradients are released
    /// after the update (Apex kept them until `zero_grad`).
    ///
    /// # Errors
    /// - [`UsageError::CallOrder`](crate::error::UsageError::CallOrder) after `backward_with(loss,
    ///   false)` without `update_master_grads()`;
    /// - [`UsageError::NoGradients`] when no backward ran since the last step (Apex would apply the
    ///   old gradients again);
    /// - as [`AmpOptimizer::step`].
    ///
    /// Nothing changes on these errors.
    pub fn step(&mut self) -> Result<StepOutcome> {
        if self.pending_update {
            return Err(AmpError::Usage(UsageError::CallOrder {
                call: "step()",
                when: "after backward_with(loss, false) without update_master_grads()",
                remedy: "call update_master_grads() first (it unscales the gradients into the fp32 masters)",
            }));
        }
        if self.overflow {
            let loss_scale = self.scaler.loss_scale();
            if self.verbose {
                log::warn!("Gradient overflow.  Skipping step, reducing loss scale to {loss_scale}");
            }
            return Ok(StepOutcome::Skipped { loss_id: 0, loss_scale });
        }
        if !self.fresh {
            return Err(AmpError::Usage(UsageError::NoGradients));
        }
        // The fp16 gradients were already unscaled into the masters; they stay in place, as
        // Apex leaves them.
        let outcome = self.opt.step_keeping_model_grads()?;
        if outcome.stepped() {
            self.fresh = false;
        }
        Ok(outcome)
    }

    /// Apex's `state_dict()`: the scaler, the flags, the wrapped optimizer's record and copies
    /// of the fp32 masters per group (see [`Fp16OptimizerState`]).
    ///
    /// # Errors
    /// [`AmpError::Torch`] if copying a master fails (not expected).
    pub fn state_dict(&self) -> Result<Fp16OptimizerState> {
        let mut fp32_from_fp16 = Vec::with_capacity(self.groups.len());
        for &g in &self.groups {
            let mut group = Vec::new();
            for m in self.slots.iter().filter(|s| s.group == g).filter_map(|s| s.master.as_ref()) {
                group.push(m.f_detach_copy().ctx("copying a master")?);
            }
            fp32_from_fp16.push(group);
        }
        Ok(Fp16OptimizerState {
            loss_scaler: self.current_scaler_state(),
            dynamic_loss_scale: self.scaler_cfg.dynamic,
            overflow: self.overflow,
            first_closure_call_this_step: self.first_closure_call_this_step,
            optimizer_state_dict: copied(self.opt.to_record())?,
            fp32_from_fp16,
        })
    }

    /// Writes the model's variables, this optimizer's state (fp32 masters included) and the
    /// scale to one safetensors file with [`crate::save_checkpoint`] (the port of Apex's
    /// `torch.save({'model': model.state_dict(), 'optimizer': optimizer.state_dict()}, path)`).
    /// The scaler's options and the `overflow` flag are not saved: they come from the
    /// constructor, and a checkpoint is written between steps.
    ///
    /// # Errors
    /// As [`crate::save_checkpoint`].
    pub fn save_checkpoint(&self, path: impl AsRef<std::path::Path>, vs: &VarStore) -> Result<()> {
        let amp = scaler_amp(&self.current_scaler_state())?;
        crate::save_checkpoint(path, vs, &[&self.opt], &amp)
    }

    /// Reads a file written by [`Self::save_checkpoint`] into the model's variables, this
    /// optimizer (built the same way) and the scale, with [`crate::load_checkpoint`]: checked
    /// in full first, nothing changes on error; gradients are cleared.
    ///
    /// # Errors
    /// As [`crate::load_checkpoint`].
    pub fn load_checkpoint(&mut self, path: impl AsRef<std::path::Path>, vs: &VarStore) -> Result<()> {
        let mut amp = scaler_amp(&self.current_scaler_state())?;
        crate::load_checkpoint(path, vs, &mut [&mut self.opt], &mut amp)?;
        self.scaler = amp.scaler(0)?.clone();
        self.overflow = false;
        self.pending_update = false;
        self.fresh = false;
        Ok(())
    }

    fn current_scaler_state(&self) -> LegacyScalerState {
        LegacyScalerState {
            loss_scale: self.scaler.loss_scale(),
            unskipped: self.scaler.unskipped(),
            ..self.scaler_cfg
        }
    }

    /// Apex's `load_state_dict(state)`: the scaler (its options too, as Apex replaced the object),
    /// the flags, the wrapped optimizer's state, and the fp32 masters from `fp32_from_fp16` (Apex's
    /// choice: saved masters, not masters rebuilt from the fp16 model). Load the model's variables
    /// first (`vs.load`), as Apex expected. Everything is checked before anything changes; all
    /// gradients are cleared.
    ///
    /// # Errors
    /// [`StateError::StateMismatch`] for a scaler state out of range, `dynamic_loss_scale` that
    /// disagrees with the scaler, masters whose groups, counts, shapes or dtype (fp32) differ from
    /// this optimizer's or that hold inf/NaN, and every mismatch [`AmpOptimizer::load_record`]
    /// reports. Nothing changes then.
    pub fn load_state_dict(&mut self, state: Fp16OptimizerState) -> Result<()> {
        let Fp16OptimizerState {
            loss_scaler,
            dynamic_loss_scale,
            overflow,
            first_closure_call_this_step,
            mut optimizer_state_dict,
            fp32_from_fp16,
        } = state;
        if loss_scaler.dynamic != dynamic_loss_scale {
            return Err(mismatch(format!(
                "dynamic_loss_scale is {dynamic_loss_scale} but the loss_scaler's dynamic is {}",
                loss_scaler.dynamic
            )));
        }
        if loss_scaler.dynamic && loss_scaler.scale_seq_len == 0 {
            return Err(mismatch("loss_scaler: scale_seq_len must be at least 1"));
        }
        let scaler = scaler_amp(&loss_scaler)
            .and_then(|a| a.scaler(0).cloned())
            .map_err(|e| mismatch(format!("loss_scaler: {e}")))?;
        if fp32_from_fp16.len() != self.groups.len() {
            return Err(mismatch(format!(
                "fp32_from_fp16 holds {} parameter groups, this optimizer has {}",
                fp32_from_fp16.len(),
                self.groups.len()
            )));
        }
        let mut masters: Vec<(String, Tensor)> = Vec::new();
        for (&g, saved) in self.groups.iter().zip(fp32_from_fp16) {
            let ours: Vec<&Slot> = self.slots.iter().filter(|s| s.group == g && s.master.is_some()).collect();
            if ours.len() != saved.len() {
                return Err(mismatch(format!(
                    "fp32_from_fp16 group {g}: {} masters saved, this optimizer has {}",
                    saved.len(),
                    ours.len()
                )));
            }
            for (s, t) in ours.into_iter().zip(saved) {
                if t.kind() != Kind::Float || t.size() != s.model.size() {
                    return Err(mismatch(format!(
                        "fp32_from_fp16: the master of {} is {:?} {:?}, expected Float {:?}",
                        s.name,
                        t.kind(),
                        t.size(),
                        s.model.size()
                    )));
                }
                masters.push((s.name.clone(), t));
            }
        }
        for p in optimizer_state_dict.params.iter_mut() {
            if let Some(i) = masters.iter().position(|(n, _)| *n == p.name) {
                p.master = Some(masters.swap_remove(i).1);
            }
        }
        self.opt.load_record(optimizer_state_dict)?;
        self.scaler = scaler;
        self.scaler_cfg = loss_scaler;
        self.overflow = overflow;
        self.first_closure_call_this_step = first_closure_call_this_step;
        self.pending_update = false;
        self.fresh = false;
        Ok(())
    }
}
