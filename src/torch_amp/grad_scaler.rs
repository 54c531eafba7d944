//! [`GradScaler`]: torch.amp.GradScaler on libtorch's own fused kernels
//! (`_amp_foreach_non_finite_check_and_unscale_`, `_amp_update_scale_`), so the scale, the
//! growth tracker and the unscaled gradients are torch's, bit for bit.
use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::config::rules::{backoff_factor as check_backoff, positive_scale as check_scale};
use crate::error::{mismatch, AmpError, ConfigError, Result, UsageError};
use crate::optim::Optimizer;
use crate::optim::StepOutcome;
use crate::sys;
use crate::torch_io::{self, Dict, Value};

/// The shape of a 0-dim tensor.
const SCALAR: [i64; 0] = [];

/// GradScaler's constructor arguments, with torch's defaults.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GradScalerOptions {
    /// The scale before the first update (torch: `init_scale=2.0**16`).
    pub init_scale: f64,
    /// Multiplies the scale after `growth_interval` clean steps (2.0); must be > 1.
    pub growth_factor: f64,
    /// Multiplies the scale at a step with inf/NaN gradients (0.5); must be in (0, 1).
    pub backoff_factor: f64,
    /// Consecutive clean steps before the scale grows (2000); at least 1.
    pub growth_interval: i64,
    /// When false every call passes through (`scale` returns its input, `step` steps).
    pub enabled: bool,
}

impl Default for GradScalerOptions {
    fn default() -> Self {
        Self { init_scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000, enabled: true }
    }
}

impl GradScalerOptions {
    /// Sets `init_scale`.
    pub fn init_scale(mut self, v: f64) -> Self {
        self.init_scale = v;
        self
    }
    /// Sets `growth_factor`.
    pub fn growth_factor(mut self, v: f64) -> Self {
        self.growth_factor = v;
        self
    }
    /// Sets `backoff_factor`.
    pub fn backoff_factor(mut self, v: f64) -> Self {
        self.backoff_factor = v;
        self
    }
    /// Sets `growth_interval`.
    pub fn growth_interval(mut self, v: i64) -> Self {
        self.growth_interval = v;
        self
    }
    /// Sets `enabled`.
    pub fn enabled(mut self, v: bool) -> Self {
        self.enabled = v;
        self
    }
}

/// A state dict [`GradScaler::check_state_dict`] accepted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CheckedState {
    scale: f64,
    growth: f64,
    backoff: f64,
    interval: i64,
    tracker: i64,
}

/// torch's `OptState`: where one optimizer is within the current iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Ready,
    Unscaled,
    Stepped,
}

/// One optimizer's state since the last update (torch's `_per_optimizer_states[id(opt)]`).
#[derive(Debug)]
struct PerOptimizer {
    id: usize,
    stage: Stage,
    /// One 0-dim fp32 flag per device that had gradients (> 0: inf/NaN seen).
    found_inf: Vec<(Device, Tensor)>,
}

fn invalid(option: &'static str, value: impl ToString, expected: &'static str) -> AmpError {
    AmpError::Config(ConfigError::InvalidOption { option, value: value.to_string(), expected })
}

/// A call out of torch's per-optimizer order, in torch's words.
fn order(call: &'static str, when: &'static str, remedy: &'static str) -> AmpError {
    AmpError::Usage(UsageError::CallOrder { call, when, remedy })
}

/// `call` before the first `scale` (torch: "Attempted step but _scale is None").
fn not_initialized(call: &'static str) -> AmpError {
    order(call, "before the scale is initialized", "scale the loss with scaler.scale(&loss) earlier in the iteration")
}

fn check_growth(v: f64) -> Result<f64> {
    crate::config::rules::growth_factor("growth_factor", v)
}

fn check_interval(v: i64) -> Result<i64> {
    crate::config::rules::growth_interval("growth_interval", v)
}

fn check_device(device: Device) -> Result<Device> {
    match device {
        Device::Cpu | Device::Cuda(_) => Ok(device),
        other => Err(invalid("device", format!("{other:?}"), "Device::Cpu or Device::Cuda(_)")),
    }
}

/// [`UsageError::BadLoss`] for a tensor `GradScaler::scale` cannot scale.
fn not_floating(t: &Tensor) -> AmpError {
    let problem =
        format!("is a {:?} tensor: scale the floating-point loss (or outputs), not an integer tensor", t.kind());
    AmpError::Usage(UsageError::BadLoss { call: "GradScaler::scale", problem })
}

/// The address of an optimizer: its identity within an iteration (torch's `id(optimizer)`).
fn optimizer_id<O: Optimizer + ?Sized>(optimizer: &O) -> usize {
    (optimizer as *const O).cast::<()>() as usize
}

/// torch.amp.GradScaler: scales the loss, unscales and checks the gradients per optimizer,
/// skips a step whose gradients hold inf/NaN, and updates the scale (×`backoff_factor` on
/// inf/NaN, ×`growth_factor` after `growth_interval` clean steps).
///
/// The scale and growth tracker are a 0-dim fp32 / int32 tensor on the device of the first
/// tensor given to [`GradScaler::scale`], updated by libtorch's `_amp_update_scale_`; the
/// gradients are unscaled by libtorch's `_amp_foreach_non_finite_check_and_unscale_` with torch's
/// fp64 reciprocal. Host syncs are torch's: one per device in `step` (reading the inf flag),
/// and `get_scale`/`state_dict`.
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch::nn::{self, Module, OptimizerConfig};
/// use tch::{Device, Kind, Tensor};
/// use tch_amp::GradScaler;
/// let vs = nn::VarStore::new(Device::Cpu);
/// let net = nn::linear(vs.root(), 8, 2, Default::default());
/// let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
/// let mut scaler = GradScaler::new(Device::Cpu);
/// let x = Tensor::ones([4, 8], (Kind::Float, Device::Cpu));
/// let loss = tch_amp::autocast(Device::Cpu, || net.forward(&x).to_kind(Kind::Float).square().mean(None))?;
/// opt.zero_grad();
/// scaler.scale(&loss)?.backward();
/// let outcome = scaler.step(&mut opt)?; // unscales, steps unless inf/NaN
/// scaler.update()?;
/// assert!(outcome.stepped());
/// assert_eq!(scaler.get_scale(), 65536.0);
/// # Ok(())
/// # }
/// ```
///
/// # Differences from torch
/// - Bad options are errors (torch asserts only `growth_factor > 1` and `backoff_factor < 1`),
///   and they are checked even for a disabled scaler.
/// - Sparse gradients are not supported (torch coalesces sparse fp16 ones).
/// - `step` returns [`StepOutcome`] (torch returns `optimizer.step()`'s value, or None when
///   skipping).
#[derive(Debug)]
pub struct GradScaler {
    enabled: bool,
    init_scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: i64,
    init_growth_tracker: i64,
    scale: Option<Tensor>,
    growth_tracker: Option<Tensor>,
    per_optimizer: Vec<PerOptimizer>,
}

impl GradScaler {
    /// torch's `GradScaler(device)` with the defaults (scale 2^16, growth ×2 every 2000 clean
    /// steps, backoff ×0.5). As torch, a CUDA scaler on a machine without CUDA disables itself
    /// (with a `log` warning).
    pub fn new(device: Device) -> Self {
        let opts = GradScalerOptions::default();
        Self::with_options(device, opts).unwrap_or_else(|_| Self::from_checked(opts, device))
    }

    /// `GradScaler(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)`.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a non-finite or non-positive `init_scale`,
    /// `growth_factor <= 1`, `backoff_factor` outside (0, 1), `growth_interval < 1`, or a device
    /// other than CPU/CUDA.
    pub fn with_options(device: Device, options: GradScalerOptions) -> Result<Self> {
        check_device(device)?;
        check_scale("init_scale", options.init_scale)?;
        check_growth(options.growth_factor)?;
        check_backoff(options.backoff_factor)?;
        check_interval(options.growth_interval)?;
        Ok(Self::from_checked(options, device))
    }

    fn from_checked(options: GradScalerOptions, device: Device) -> Self {
        let mut enabled = options.enabled;
        if enabled && matches!(device, Device::Cuda(_)) && !tch::Cuda::is_available() {
            log::warn!("GradScaler is enabled for CUDA, but CUDA is not available. Disabling.");
            enabled = false;
        }
        Self {
            enabled,
            init_scale: options.init_scale,
            growth_factor: options.growth_factor,
            backoff_factor: options.backoff_factor,
            growth_interval: options.growth_interval,
            init_growth_tracker: 0,
            scale: None,
            growth_tracker: None,
            per_optimizer: Vec::new(),
        }
    }

    fn lazy_init(&mut self, device: Device) -> Result<&Tensor> {
        if self.scale.is_none() {
            let scale = Tensor::f_full(SCALAR, self.init_scale, (Kind::Float, device))?;
            let tracker = Tensor::f_full(SCALAR, self.init_growth_tracker, (Kind::Int, device))?;
            self.growth_tracker = Some(tracker);
            self.scale = Some(scale);
        }
        self.initialized("scale")
    }

    fn initialized(&self, call: &'static str) -> Result<&Tensor> {
        self.scale.as_ref().ok_or_else(|| not_initialized(call))
    }

    /// `outputs * scale` (the scale moved to `outputs`' device). The first call puts the scale
    /// on that device. Disabled: `outputs` itself (a shallow handle).
    ///
    /// # Errors
    /// [`UsageError::BadLoss`] for an integer or bool tensor; [`ConfigError::InvalidOption`] off
    /// CPU/CUDA.
    pub fn scale(&mut self, outputs: &Tensor) -> Result<Tensor> {
        if !self.enabled {
            return Ok(outputs.shallow_clone());
        }
        if !outputs.is_floating_point() {
            return Err(not_floating(outputs));
        }
        let device = check_device(outputs.device())?;
        let scale = self.lazy_init(device)?.f_to_device(device)?;
        Ok(outputs.f_mul(&scale)?)
    }

    /// [`Self::scale`] for several outputs (torch's `scale(iterable)`), in order; the scale is
    /// put on the first one's device. Nothing is scaled when one of them is refused.
    ///
    /// # Errors
    /// As [`Self::scale`].
    pub fn scale_all(&mut self, outputs: &[Tensor]) -> Result<Vec<Tensor>> {
        if !self.enabled {
            return Ok(outputs.iter().map(Tensor::shallow_clone).collect());
        }
        for t in outputs {
            if !t.is_floating_point() {
                return Err(not_floating(t));
            }
            check_device(t.device())?;
        }
        outputs.iter().map(|t| self.scale(t)).collect()
    }

    fn state_mut(&mut self, id: usize) -> &mut PerOptimizer {
        let at = match self.per_optimizer.iter().position(|s| s.id == id) {
            Some(at) => at,
            None => {
                self.per_optimizer.push(PerOptimizer { id, stage: Stage::Ready, found_inf: Vec::new() });
                self.per_optimizer.len() - 1
            }
        };
        &mut self.per_optimizer[at]
    }

    /// Divides `optimizer`'s gradients by the scale in place (torch's `unscale_`, e.g. before
    /// clipping) and records whether they hold inf/NaN, for `step` and `update`. At most once
    /// per optimizer per iteration. Disabled: does nothing.
    ///
    /// # Errors
    /// [`UsageError::CallOrder`] for a second `unscale_` or one after `step` in the iteration, or
    /// before any `scale`; [`UsageError::UnscaleFp16Gradients`] for an fp16 gradient (nothing
    /// unscaled then).
    pub fn unscale_<O: Optimizer + ?Sized>(&mut self, optimizer: &O) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        self.initialized("unscale_()")?;
        match self.state_mut(optimizer_id(optimizer)).stage {
            Stage::Unscaled => {
                return Err(order(
                    "unscale_()",
                    "twice on this optimizer since the last update()",
                    "call it once per step",
                ))
            }
            Stage::Stepped => {
                return Err(order("unscale_()", "after step()", "unscale before stepping, then call update()"))
            }
            Stage::Ready => {}
        }
        let mut found_inf = self.unscale_grads(&optimizer.params())?;
        // A sharded optimizer's ranks each checked their shard: they agree on one flag.
        let mut flags: Vec<Tensor> = found_inf.iter().map(|(_, f)| f.shallow_clone()).collect();
        optimizer.agree_on_overflow(&mut flags)?;
        found_inf = flags.into_iter().map(|f| (f.device(), f)).collect();
        let state = self.state_mut(optimizer_id(optimizer));
        state.found_inf = found_inf;
        state.stage = Stage::Unscaled;
        Ok(())
    }

    /// torch's `_unscale_grads_`: gradients grouped by (device, dtype), one fused
    /// unscale-and-check per group; one inf flag per device.
    fn unscale_grads(&self, params: &[Tensor]) -> Result<Vec<(Device, Tensor)>> {
        let scale = self.initialized("unscale_()")?;
        let inv_scale = scale.f_to_kind(Kind::Double)?.f_reciprocal()?.f_to_kind(Kind::Float)?;
        let mut groups: Vec<((Device, Kind), Vec<Tensor>)> = Vec::new();
        for (index, p) in params.iter().enumerate() {
            let g = p.grad();
            if !g.defined() {
                continue;
            }
            if g.kind() == Kind::Half {
                return Err(AmpError::Usage(UsageError::UnscaleFp16Gradients { index }));
            }
            let key = (g.device(), g.kind());
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, list)) => list.push(g),
                None => groups.push((key, vec![g])),
            }
        }
        let mut per_device: Vec<(Device, Tensor, Tensor)> = Vec::new();
        for ((device, _), grads) in &groups {
            if !per_device.iter().any(|(d, _, _)| d == device) {
                let found = Tensor::f_full(SCALAR, 0.0, (Kind::Float, *device))?;
                per_device.push((*device, found, inv_scale.f_to_device(*device)?));
            }
            let (_, found, inv) = per_device
                .iter()
                .find(|(d, _, _)| d == device)
                .ok_or_else(|| mismatch("a gradient's device has no inf flag"))?;
            let _no_grad = tch::no_grad_guard();
            sys::unscale_(grads, found, inv)?;
        }
        Ok(per_device.into_iter().map(|(d, found, _)| (d, found)).collect())
    }

    /// torch's `step(optimizer)`: unscales first unless [`Self::unscale_`] already ran, then
    /// calls `optimizer.step()` unless the gradients held inf/NaN. Reads the inf flags (one host
    /// sync per device). Disabled: `optimizer.step()`. With a [`crate::doctor::Watch`] alive on
    /// the thread, a skipped step logs (warn) where the batch's first inf/NaN appeared.
    ///
    /// # Errors
    /// [`UsageError::CallOrder`] for a second `step` of the optimizer with no `update` in between,
    /// or when no parameter has a gradient (torch: "No inf checks were recorded for this
    /// optimizer."); the errors of
    /// [`Self::unscale_`], and the optimizer's own.
    pub fn step<O: Optimizer + ?Sized>(&mut self, optimizer: &mut O) -> Result<StepOutcome> {
        if !self.enabled {
            optimizer.step()?;
            return Ok(StepOutcome::Stepped);
        }
        self.initialized("step()")?;
        let id = optimizer_id(optimizer);
        match self.state_mut(id).stage {
            Stage::Stepped => {
                return Err(order(
                    "step()",
                    "twice for this optimizer since the last update()",
                    "call scaler.update() after each step",
                ))
            }
            Stage::Ready => self.unscale_(optimizer)?,
            Stage::Unscaled => {}
        }
        let state = self.state_mut(id);
        if state.found_inf.is_empty() {
            return Err(order(
                "scaler.step()",
                "with no gradient on any of the optimizer's parameters (no inf checks were recorded for it)",
                "run backward on scaler.scale(&loss) before step()",
            ));
        }
        let mut found = 0.0;
        for (_, flag) in &state.found_inf {
            found += flag.f_double_value(&[])?;
        }
        let outcome = if found == 0.0 {
            optimizer.step()?;
            StepOutcome::Stepped
        } else {
            // With a doctor::Watch on this thread: where the batch's first inf/NaN appeared.
            let scale = self.get_scale();
            match crate::doctor::watch::overflow_origin(scale) {
                Some(origin) => log::warn!("GradScaler: inf/NaN gradients, step skipped; first inf/NaN at {origin}"),
                None => log::debug!("GradScaler: inf/NaN gradients, step skipped"),
            }
            // The scale update() will set: torch's _amp_update_scale_ multiplies in fp32.
            let loss_scale = f64::from(scale as f32 * self.backoff_factor as f32);
            StepOutcome::Skipped { loss_id: 0, loss_scale }
        };
        self.state_mut(id).stage = Stage::Stepped;
        Ok(outcome)
    }

    /// torch's `update()`: combines the inf flags of every optimizer unscaled or stepped since
    /// the last update and runs libtorch's `_amp_update_scale_` (backoff on inf/NaN, growth after
    /// `growth_interval` clean updates); then every optimizer is ready for the next iteration.
    /// No host sync. Disabled: does nothing.
    ///
    /// # Errors
    /// [`UsageError::CallOrder`] before any `scale`, or with no `step` or `unscale_` since the
    /// last update (torch: "No inf checks were recorded prior to update.").
    pub fn update(&mut self) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let scale = self.initialized("update()")?;
        let device = scale.device();
        let mut flags = self.per_optimizer.iter().flat_map(|s| s.found_inf.iter().map(|(_, f)| f));
        let Some(first) = flags.next() else {
            return Err(order(
                "update()",
                "with no inf checks recorded since the last update",
                "call scaler.step(optimizer) (or unscale_) before update()",
            ));
        };
        let mut combined = first.f_to_device(device)?;
        for f in flags {
            let _ = combined.f_add_(&f.f_to_device(device)?)?;
        }
        let (Some(scale), Some(tracker)) = (self.scale.as_mut(), self.growth_tracker.as_ref()) else {
            return Err(not_initialized("update()"));
        };
        let _ = scale.f_internal_amp_update_scale_(
            tracker,
            &combined,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )?;
        self.per_optimizer.clear();
        crate::doctor::watch::next_batch();
        Ok(())
    }

    /// torch's `update(new_scale)`: sets the scale (rounded to fp32) and readies every optimizer
    /// for the next iteration; the growth tracker is kept. Disabled: does nothing.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a scale that is not finite and > 0 (nothing changed);
    /// [`UsageError::CallOrder`] before any `scale`.
    pub fn update_to(&mut self, new_scale: f64) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        check_scale("new_scale", new_scale)?;
        self.initialized("update()")?;
        if let Some(scale) = self.scale.as_mut() {
            let _ = scale.f_fill_(new_scale)?;
        }
        self.per_optimizer.clear();
        Ok(())
    }

    /// The current scale (a host sync once it is on a device); `init_scale` before the first
    /// `scale`; 1.0 when disabled. NaN if libtorch cannot read the scale (not expected).
    pub fn get_scale(&self) -> f64 {
        if !self.enabled {
            return 1.0;
        }
        match &self.scale {
            None => self.init_scale,
            Some(s) => s.f_double_value(&[]).unwrap_or(f64::NAN),
        }
    }

    /// The scale tensor (0-dim fp32), once [`Self::scale`] has created it.
    pub fn scale_tensor(&self) -> Option<&Tensor> {
        self.scale.as_ref()
    }

    /// Consecutive clean updates since the last growth or backoff (torch's `_growth_tracker`).
    pub fn growth_tracker(&self) -> i64 {
        match &self.growth_tracker {
            None => self.init_growth_tracker,
            Some(t) => t.f_int64_value(&[]).unwrap_or(0),
        }
    }

    /// The growth factor.
    pub fn get_growth_factor(&self) -> f64 {
        self.growth_factor
    }

    /// Sets the growth factor.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] unless finite and > 1.
    pub fn set_growth_factor(&mut self, v: f64) -> Result<()> {
        self.growth_factor = check_growth(v)?;
        Ok(())
    }

    /// The backoff factor.
    pub fn get_backoff_factor(&self) -> f64 {
        self.backoff_factor
    }

    /// Sets the backoff factor.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] unless in (0, 1).
    pub fn set_backoff_factor(&mut self, v: f64) -> Result<()> {
        self.backoff_factor = check_backoff(v)?;
        Ok(())
    }

    /// The growth interval.
    pub fn get_growth_interval(&self) -> i64 {
        self.growth_interval
    }

    /// Sets the growth interval.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] unless >= 1.
    pub fn set_growth_interval(&mut self, v: i64) -> Result<()> {
        self.growth_interval = check_interval(v)?;
        Ok(())
    }

    /// Whether the scaler is enabled (a CUDA scaler without CUDA disables itself).
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// torch's `state_dict()`: a dict with `scale` (float), `growth_factor` (float),
    /// `backoff_factor` (float), `growth_interval` (int) and `_growth_tracker` (int); an empty
    /// dict when disabled. [`crate::torch_io::save`] writes it as `torch.save` does.
    pub fn state_dict(&self) -> Value {
        let mut d = Dict::new();
        if self.enabled {
            d.insert("scale", Value::Float(self.get_scale()));
            d.insert("growth_factor", Value::Float(self.growth_factor));
            d.insert("backoff_factor", Value::Float(self.backoff_factor));
            d.insert("growth_interval", Value::Int(self.growth_interval));
            d.insert("_growth_tracker", Value::Int(self.growth_tracker()));
        }
        Value::Dict(d)
    }

    /// torch's `load_state_dict(state_dict)`, checked in full before anything is applied (torch
    /// applies key by key). Keys other than the five are ignored, as in torch. Disabled: does
    /// nothing.
    ///
    /// # Errors
    /// [`StateError::StateMismatch`](crate::error::StateError::StateMismatch): not a dict, empty (saved from a disabled scaler), a key
    /// missing or of the wrong type (floats may be given as ints), a scale that is not finite
    /// and > 0, factors or interval out of range, a tracker outside 0..2^31.
    pub fn load_state_dict(&mut self, state: &Value) -> Result<()> {
        let Some(s) = self.check_state_dict(state)? else { return Ok(()) };
        if let (Some(scale), Some(tracker)) = (self.scale.as_mut(), self.growth_tracker.as_mut()) {
            let _ = scale.f_fill_(s.scale)?;
            let _ = tracker.f_fill_(s.tracker)?;
        }
        self.init_scale = s.scale;
        self.init_growth_tracker = s.tracker;
        self.growth_factor = s.growth;
        self.backoff_factor = s.backoff;
        self.growth_interval = s.interval;
        Ok(())
    }

    /// [`Self::load_state_dict`]'s checks, without applying anything: the values to apply, or
    /// `None` for a disabled scaler (which loads nothing).
    pub(crate) fn check_state_dict(&self, state: &Value) -> Result<Option<CheckedState>> {
        if !self.enabled {
            return Ok(None);
        }
        let bad = |message: String| mismatch(format!("GradScaler state dict: {message}"));
        let Value::Dict(d) = state else {
            return Err(bad(format!("expected a dict, found a {}", state.type_name())));
        };
        if d.is_empty() {
            return Err(bad("the dict is empty, possibly because it was saved from a disabled GradScaler".into()));
        }
        let get = |key: &str| d.get_str(key).ok_or_else(|| bad(format!("missing key {key:?}")));
        let float = |key: &str| -> Result<f64> {
            match get(key)? {
                Value::Float(v) => Ok(*v),
                Value::Int(v) => Ok(*v as f64),
                other => Err(bad(format!("{key:?} must be a float, found a {}", other.type_name()))),
            }
        };
        let int = |key: &str| -> Result<i64> {
            match get(key)? {
                Value::Int(v) => Ok(*v),
                other => Err(bad(format!("{key:?} must be an int, found a {}", other.type_name()))),
            }
        };
        let in_range = |e: AmpError| bad(e.to_string());
        let scale = check_scale("scale", float("scale")?).map_err(in_range)?;
        let growth = check_growth(float("growth_factor")?).map_err(in_range)?;
        let backoff = check_backoff(float("backoff_factor")?).map_err(in_range)?;
        let interval = check_interval(int("growth_interval")?).map_err(in_range)?;
        let tracker = int("_growth_tracker")?;
        if !(0..=i64::from(i32::MAX)).contains(&tracker) {
            return Err(bad(format!("_growth_tracker {tracker} must be in 0..2^31")));
        }
        Ok(Some(CheckedState { scale, growth, backoff, interval, tracker }))
    }

    /// Writes [`Self::state_dict`] to `path` in `torch.save`'s format
    /// (`torch.load(path)` gives torch's `scaler.state_dict()`).
    ///
    /// # Errors
    /// [`AmpError::File`] when the file cannot be written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        Ok(torch_io::save(path, &self.state_dict())?)
    }

    /// Loads a state written by `torch.save(scaler.state_dict(), path)` or [`Self::save`].
    ///
    /// # Errors
    /// [`AmpError::File`] when the file cannot be read; as [`Self::load_state_dict`].
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let value = torch_io::load(path)?;
        self.load_state_dict(&value)
    }
}
