//! An exponential moving average of the model's weights, with timm's `ModelEmaV2` semantics
//! (`ema = decay * ema + (1 - decay) * weight` for every entry of the state dict, after each
//! optimizer step), kept in fp32 over the fp32 masters under O2 (so that the average does not
//! lose the bits an fp16 model would), and over the variables themselves otherwise. A torch.amp
//! loop (fp32 parameters, any optimizer) passes no optimizers and the [`crate::StepOutcome`] of
//! [`crate::GradScaler::step`].
//!
//! ```
//! use tch::nn::{self, ModuleT, VarStore};
//! use tch::{Device, Kind, Tensor};
//! use tch_amp::ema::ModelEma;
//! use tch_amp::{AmpConfig, OptLevel};
//! # fn main() -> Result<(), tch_amp::AmpError> {
//! let vs = VarStore::new(Device::Cpu);
//! let net = nn::linear(vs.root() / "fc", 4, 2, Default::default());
//! let (model, mut opt, mut amp) =
//!     tch_amp::initialize(&vs, net, nn::Sgd::default(), 0.1, &AmpConfig::new(OptLevel::O2).verbosity(0))?;
//! // timm: model_ema = ModelEmaV2(model, decay=0.999)
//! let mut ema = ModelEma::new(&vs, &[&opt], 0.999)?;
//! let x = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
//! opt.zero_grad()?;
//! let loss = model.forward_t(&x, true).square().mean(Kind::Float);
//! amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward())?;
//! let outcome = opt.step()?;
//! // timm: model_ema.update(model), after a step that stepped
//! ema.update(&vs, &[&opt], outcome)?;
//! // Evaluation with the averaged weights; the model's own come back afterwards.
//! let _eval = ema.with_weights(&vs, || model.forward_t(&x, false))?;
//! # Ok(())
//! # }
//! ```
//!
//! Differences from timm: an update after a skipped step (an overflow) changes nothing, where
//! timm's `update` would average the unchanged weights in once more; under O2 the average is of
//! the fp32 masters, where timm's of an Apex O2 model would be of its fp16 weights.
use crate::error::ConfigError;
use std::collections::BTreeMap;

use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::error::{AmpError, Result, TorchContext};
use crate::optim::{Optimizer, StepOutcome};

/// An exponential moving average of a `VarStore`'s variables (see the module docs).
#[derive(Debug)]
pub struct ModelEma {
    decay: f64,
    warmup: Option<f64>,
    updates: u64,
    /// The average of each variable, by name: fp32 for floating variables, their own dtype
    /// otherwise (integer buffers such as `num_batches_tracked`).
    shadow: BTreeMap<String, Tensor>,
}

/// Each variable of `vs` as the optimizers step it: the fp32 master where there is one, the
/// variable itself otherwise.
fn sources(vs: &VarStore, optimizers: &[&dyn Optimizer]) -> BTreeMap<String, Tensor> {
    let mut out: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
    for o in optimizers {
        for (name, master) in o.masters() {
            if let Some(slot) = out.get_mut(&name) {
                *slot = master;
            }
        }
    }
    out
}

fn fp32_copy(t: &Tensor) -> Result<Tensor> {
    let kind = if crate::dtype::is_floating(t.kind()) && t.kind() != Kind::Double { Kind::Float } else { t.kind() };
    t.f_detach().and_then(|t| t.f_to_kind(kind)).and_then(|t| t.f_detach_copy()).ctx("copying a weight for the EMA")
}

impl ModelEma {
    /// An average that starts at the current weights (timm copies the model). `decay` in `[0, 1]`.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a decay outside `[0, 1]`; [`AmpError::Torch`] if a copy
    /// fails.
    pub fn new(vs: &VarStore, optimizers: &[&dyn Optimizer], decay: f64) -> Result<Self> {
        if !(0.0..=1.0).contains(&decay) {
            return Err(AmpError::Config(ConfigError::InvalidOption {
                option: "decay",
                value: decay.to_string(),
                expected: "a number in [0, 1]",
            }));
        }
        let _no_grad = tch::no_grad_guard();
        let shadow =
            sources(vs, optimizers).into_iter().map(|(k, v)| fp32_copy(&v).map(|c| (k, c))).collect::<Result<_>>()?;
        Ok(Self { decay, warmup: None, updates: 0, shadow })
    }

    /// timm's warmup (`ModelEmaV3(use_warmup=True)`, power 3/4 by default): the decay at update
    /// `n` (from 1) is `min(decay, 1 - (1 + n) ^ -power)`, so early averages follow the
    /// weights closely.
    pub fn warmup(mut self, power: f64) -> Self {
        self.warmup = Some(power);
        self
    }

    /// The decay the next update uses.
    pub fn current_decay(&self) -> f64 {
        match self.warmup {
            Some(power) => {
                let n = (self.updates + 1) as f64;
                self.decay.min(1.0 - (1.0 + n).powf(-power))
            }
            None => self.decay,
        }
    }

    /// Updates the average from the weights after a step (`outcome` is what `step()` returned):
    /// nothing after a skipped step.
    ///
    /// # Errors
    /// [`StateError::StateMismatch`](crate::error::StateError::StateMismatch) when `vs` lost or
    /// renamed a variable the average holds; [`AmpError::Torch`] if an operation fails.
    pub fn update(&mut self, vs: &VarStore, optimizers: &[&dyn Optimizer], outcome: StepOutcome) -> Result<()> {
        if !outcome.stepped() {
            return Ok(());
        }
        let decay = self.current_decay();
        let sources = sources(vs, optimizers);
        let _no_grad = tch::no_grad_guard();
        // Check every name before changing anything.
        if let Some(name) = self.shadow.keys().find(|k| !sources.contains_key(*k)) {
            return Err(crate::error::mismatch(format!("the EMA holds {name}, which the VarStore no longer has")));
        }
        for (name, e) in &mut self.shadow {
            let m = &sources[name];
            // timm: ema_v.copy_(decay * ema_v + (1. - decay) * model_v), in fp32.
            let m = m.f_to_kind(if crate::dtype::is_floating(e.kind()) { e.kind() } else { Kind::Float }).ctx("EMA")?;
            let e32 = if crate::dtype::is_floating(e.kind()) {
                e.shallow_clone()
            } else {
                e.f_to_kind(Kind::Float).ctx("EMA")?
            };
            let next = e32
                .f_mul_scalar(decay)
                .and_then(|a| m.f_mul_scalar(1.0 - decay).and_then(|b| a.f_add(&b)))
                .ctx("EMA")?;
            e.f_copy_(&next).ctx("EMA")?;
        }
        self.updates += 1;
        Ok(())
    }

    /// Runs `f` with the averaged weights in the model's variables (each rounded to its variable's
    /// dtype), then puts the model's own back, also when `f` panics. Use it for evaluation; the
    /// masters and the optimizer state are not touched.
    ///
    /// # Errors
    /// [`StateError::StateMismatch`](crate::error::StateError::StateMismatch) when `vs` lacks a
    /// variable the average holds; [`AmpError::Torch`] if a copy fails.
    pub fn with_weights<T>(&self, vs: &VarStore, f: impl FnOnce() -> T) -> Result<T> {
        let vars = vs.variables();
        if let Some(name) = self.shadow.keys().find(|k| !vars.contains_key(*k)) {
            return Err(crate::error::mismatch(format!("the EMA holds {name}, which the VarStore no longer has")));
        }
        let _no_grad = tch::no_grad_guard();
        let saved: Vec<(Tensor, Tensor)> = self
            .shadow
            .keys()
            .map(|k| vars[k].f_detach_copy().map(|c| (vars[k].shallow_clone(), c)))
            .collect::<std::result::Result<_, _>>()
            .ctx("saving the model's weights")?;
        /// Puts the model's weights back when dropped (also while unwinding).
        struct Restore(Vec<(Tensor, Tensor)>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let _no_grad = tch::no_grad_guard();
                for (var, own) in &mut self.0 {
                    let _ = var.f_copy_(own);
                }
            }
        }
        let restore = Restore(saved);
        for (k, e) in &self.shadow {
            let mut v = vars[k].shallow_clone();
            v.f_copy_(e).ctx("putting the EMA weights in the model")?;
        }
        let out = f();
        drop(restore);
        Ok(out)
    }

    /// The averages by variable name (fp32 for floating variables), to save them
    /// ([`crate::checkpoint::TrainingState`]).
    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.shadow
    }

    /// How many updates have been made (what the warmup counts).
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Restores averages saved from [`Self::tensors`] and the update count; every name, shape and
    /// dtype must match, and nothing changes otherwise.
    ///
    /// # Errors
    /// [`StateError::StateMismatch`](crate::error::StateError::StateMismatch) for a missing, extra
    /// or mismatched tensor.
    pub fn load(&mut self, tensors: &BTreeMap<String, Tensor>, updates: u64) -> Result<()> {
        if tensors.keys().ne(self.shadow.keys()) {
            return Err(crate::error::mismatch("the saved EMA holds other variables than this one"));
        }
        for (k, e) in &self.shadow {
            let t = &tensors[k];
            if t.size() != e.size() || t.kind() != e.kind() {
                return Err(crate::error::mismatch(format!(
                    "EMA {k}: {:?} {:?}, expected {:?} {:?}",
                    t.kind(),
                    t.size(),
                    e.kind(),
                    e.size()
                )));
            }
        }
        let _no_grad = tch::no_grad_guard();
        for (k, e) in &mut self.shadow {
            e.f_copy_(&tensors[k]).ctx("restoring the EMA")?;
        }
        self.updates = updates;
        Ok(())
    }
}
