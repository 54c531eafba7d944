//! The open side of the optimizers: [`UpdateRule`], the trait every update rule implements
//! (the built-ins of [`crate::OptimizerConfig`] and a user's own), with what it works on:
//! [`HyperParams`] (a group's hyper-parameters by torch.optim's names), [`ParamState`] (one
//! parameter's step count and named state tensors), [`GroupView`] / [`ParamView`] (the
//! parameters of one group that have a gradient) and [`StateSpec`] (the state a rule keeps, for
//! checking records). [`crate::AmpOptimizer`] does the rest unchanged for every rule: fp32
//! masters, skipping after an overflow, clipping, parameter groups, records and checkpoints.
use crate::error::ConfigError;
use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use crate::error::{AmpError, Result, TorchContext};

/// The hyper-parameters of an optimizer or of one parameter group, by torch.optim's names
/// (`"momentum"`, `"weight_decay"`, `"beta1"`, `"beta2"`, `"eps"`, ...; flags as 0.0 or 1.0),
/// without the learning rate (a group's `lr` is kept beside it, as tch passes it beside its
/// config structs). Sorted by name, so records and checkpoints are stable.
///
/// torch's `betas=(b1, b2)` is the two entries `beta1` and `beta2`.
///
/// ```
/// use tch_amp::optim::HyperParams;
/// let h = HyperParams::new().with("beta1", 0.9).with("beta2", 0.999).with_flag("amsgrad", false);
/// assert_eq!(h.get("beta1")?, 0.9);
/// assert!(!h.flag("amsgrad")?);
/// assert!(h.get("beta3").is_err());
/// # Ok::<(), tch_amp::AmpError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HyperParams(BTreeMap<String, f64>);

impl HyperParams {
    /// No hyper-parameters.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `key` set to `value`.
    pub fn with(mut self, key: impl Into<String>, value: f64) -> Self {
        self.0.insert(key.into(), value);
        self
    }

    /// With the flag `key` set (stored as 1.0 or 0.0).
    pub fn with_flag(self, key: impl Into<String>, on: bool) -> Self {
        self.with(key, if on { 1.0 } else { 0.0 })
    }

    /// The value of `key`.
    ///
    /// # Errors
    /// [`ConfigError::UnknownHyperParameter`] when there is no such key.
    pub fn get(&self, key: &str) -> Result<f64> {
        self.0.get(key).copied().ok_or_else(|| {
            AmpError::Config(ConfigError::UnknownHyperParameter {
                name: key.to_string(),
                known: self.0.keys().cloned().collect(),
            })
        })
    }

    /// The flag `key` (any value other than 0.0 is on).
    ///
    /// # Errors
    /// As [`Self::get`].
    pub fn flag(&self, key: &str) -> Result<bool> {
        Ok(self.get(key)? != 0.0)
    }

    /// Whether `key` is set.
    pub fn contains(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    /// Sets `key` (inserting it when absent).
    pub fn set(&mut self, key: impl Into<String>, value: f64) {
        self.0.insert(key.into(), value);
    }

    /// The entries, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, f64)> {
        self.0.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// The names, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is no entry.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The entries as a map.
    pub fn as_map(&self) -> &BTreeMap<String, f64> {
        &self.0
    }

    /// Whether both hold the same keys with bit-identical values.
    pub(crate) fn same_bits(&self, other: &HyperParams) -> bool {
        self.0.len() == other.0.len()
            && self.0.iter().zip(&other.0).all(|((k, v), (ok, ov))| k == ok && v.to_bits() == ov.to_bits())
    }
}

impl From<BTreeMap<String, f64>> for HyperParams {
    fn from(map: BTreeMap<String, f64>) -> Self {
        Self(map)
    }
}

impl From<HyperParams> for BTreeMap<String, f64> {
    fn from(h: HyperParams) -> Self {
        h.0
    }
}

impl<K: Into<String>> FromIterator<(K, f64)> for HyperParams {
    fn from_iter<I: IntoIterator<Item = (K, f64)>>(iter: I) -> Self {
        Self(iter.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }
}

/// One parameter's optimizer state: how many updates it has had and its named state tensors
/// (torch.optim's `optimizer.state[p]`: `"exp_avg"`, `"momentum_buffer"`, ...). Checkpoints
/// save and restore exactly this, so a rule keeps all its per-parameter state here.
#[derive(Debug, Default)]
pub struct ParamState {
    pub(crate) step: u64,
    pub(crate) buffers: BTreeMap<String, Tensor>,
}

impl ParamState {
    /// Updates of this parameter so far; during [`UpdateRule::step`] it already counts the
    /// update being made (torch.optim increments `state["step"]` before using it).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The state tensor `name`, if it exists yet.
    pub fn buffer(&self, name: &str) -> Option<&Tensor> {
        self.buffers.get(name)
    }

    /// The state tensor `name` (sharing storage: update it in place), created as zeros shaped
    /// and typed like `like` the first time.
    ///
    /// # Errors
    /// [`AmpError::Torch`] if the allocation fails.
    pub fn buffer_or_zeros(&mut self, name: &str, like: &Tensor) -> Result<Tensor> {
        if let Some(t) = self.buffers.get(name) {
            return Ok(t.shallow_clone());
        }
        let t = like.f_zeros_like().ctx("allocating optimizer state")?;
        self.buffers.insert(name.to_string(), t.shallow_clone());
        Ok(t)
    }

    /// Sets the state tensor `name` (replacing any previous one).
    pub fn set_buffer(&mut self, name: &str, value: Tensor) {
        self.buffers.insert(name.to_string(), value);
    }

    /// Every state tensor, by name.
    pub fn buffers(&self) -> &BTreeMap<String, Tensor> {
        &self.buffers
    }
}

/// The shape of a state tensor a rule keeps (see [`StateSpec`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StateShape {
    /// Shaped like the parameter (a moment, a momentum buffer).
    LikeParam,
    /// One number, a 0-dim tensor (NovoGrad's per-tensor gradient norm).
    Scalar,
}

/// One state tensor an [`UpdateRule`] keeps per parameter: its name, shape and dtype. Records
/// and checkpoints are checked against these before anything is loaded.
///
/// ```
/// use tch_amp::optim::{StateShape, StateSpec};
/// let m = StateSpec::like_param("exp_avg");
/// let n = StateSpec::scalar("exp_avg_sq");
/// assert_eq!((m.name(), m.shape(), m.is_fp32()), ("exp_avg", StateShape::LikeParam, false));
/// assert!(n.is_fp32());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateSpec {
    name: String,
    shape: StateShape,
    fp32: bool,
}

impl StateSpec {
    /// A tensor shaped like the parameter, of the parameter's state dtype (the parameter's
    /// own, or fp32 for an fp16/bf16 parameter when the optimizer keeps fp32 state).
    pub fn like_param(name: impl Into<String>) -> Self {
        Self { name: name.into(), shape: StateShape::LikeParam, fp32: false }
    }

    /// A 0-dim fp32 tensor.
    pub fn scalar(name: impl Into<String>) -> Self {
        Self { name: name.into(), shape: StateShape::Scalar, fp32: true }
    }

    /// Always fp32, whatever the parameter's dtype (Apex's FusedAdam keeps fp32 moments for
    /// fp16 parameters).
    pub fn fp32(mut self) -> Self {
        self.fp32 = true;
        self
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The shape.
    pub fn shape(&self) -> StateShape {
        self.shape
    }

    /// Whether it is always fp32.
    pub fn is_fp32(&self) -> bool {
        self.fp32
    }

    /// The dtype and shape this spec expects for a parameter of shape `param_shape` whose state
    /// dtype is `state_kind`.
    pub(crate) fn expected_shape(&self, param_shape: &[i64], state_kind: Kind) -> (Kind, Vec<i64>) {
        let kind = if self.fp32 { Kind::Float } else { state_kind };
        let shape = match self.shape {
            StateShape::LikeParam => param_shape.to_vec(),
            StateShape::Scalar => Vec::new(),
        };
        (kind, shape)
    }
}

/// One parameter of a [`GroupView`]: the tensor to update in place, its gradient and its
/// state.
///
/// `param` is the fp32 master under master weights (O2), else the model's variable; an
/// fp16/bf16 parameter without a master is handed over as an fp32 copy (written back, rounded,
/// after the step) when the optimizer keeps fp32 state. Update it in place, under no_grad
/// (`step` runs under a no_grad guard).
#[derive(Debug)]
pub struct ParamView<'a> {
    pub(crate) name: &'a str,
    pub(crate) param: Tensor,
    pub(crate) grad: Tensor,
    pub(crate) state: &'a mut ParamState,
}

impl ParamView<'_> {
    /// The VarStore name of the parameter.
    pub fn name(&self) -> &str {
        self.name
    }
    /// The tensor to update in place.
    pub fn param(&self) -> &Tensor {
        &self.param
    }
    /// Its gradient (unscaled; after any clipping).
    pub fn grad(&self) -> &Tensor {
        &self.grad
    }
    /// Its state.
    pub fn state(&self) -> &ParamState {
        self.state
    }
    /// Its state, to update.
    pub fn state_mut(&mut self) -> &mut ParamState {
        self.state
    }
    /// The parameter, its gradient and its state at once (for borrowing all three).
    pub fn parts(&mut self) -> (&Tensor, &Tensor, &mut ParamState) {
        (&self.param, &self.grad, self.state)
    }
}

/// One parameter group as [`UpdateRule::step`] sees it: its learning rate and
/// hyper-parameters, its step count, and its parameters that have a gradient (torch.optim
/// skips the others; a group may have none this step).
#[derive(Debug)]
pub struct GroupView<'a> {
    pub(crate) id: usize,
    pub(crate) lr: f64,
    pub(crate) hyper: &'a HyperParams,
    pub(crate) step: u64,
    pub(crate) params: Vec<ParamView<'a>>,
    /// The global gradient norm over every parameter of every group, when the rule sees only
    /// some of them (a sharded optimizer, or one parameter at a time).
    pub(crate) global_grad_norm: Option<Tensor>,
}

impl<'a> GroupView<'a> {
    /// The group's id ([`crate::AmpOptimizer::param_groups`]).
    pub fn id(&self) -> usize {
        self.id
    }
    /// The group's learning rate.
    pub fn lr(&self) -> f64 {
        self.lr
    }
    /// The group's hyper-parameters (every key of [`UpdateRule::defaults`], with this group's
    /// values).
    pub fn hyper(&self) -> &HyperParams {
        self.hyper
    }
    /// Steps of this group so far, counting this one: Apex's fused optimizers keep one step
    /// count per group (`group["step"]`), incremented at every step of a group that has
    /// parameters, whether or not they have gradients.
    pub fn step(&self) -> u64 {
        self.step
    }
    /// The parameters with a gradient, in torch's order: the model's creation order with each
    /// module's weight before its bias (`model.parameters()`'s order in Python when the layers
    /// are created in the order the Python module registers them). Rules that combine
    /// parameters (LAMB's global gradient norm) combine them in this order, as torch.optim and
    /// Apex iterate a group.
    pub fn params(&self) -> &[ParamView<'a>] {
        &self.params
    }
    /// The parameters with a gradient, to update.
    pub fn params_mut(&mut self) -> &mut [ParamView<'a>] {
        &mut self.params
    }
}

/// An optimizer's update rule: what torch.optim's `Optimizer.step` computes, given the
/// parameter groups. Implement it for a rule of your own (a script's AdamW variant) and pass
/// it to [`crate::Amp::optimizer_with_rule`]; the built-ins ([`crate::OptimizerConfig`]:
/// torch.optim's SGD/Adam/AdamW/RMSprop, Apex's FusedSGD/FusedAdam/FusedLAMB/FusedNovoGrad/
/// FusedAdagrad) implement it too.
///
/// [`crate::AmpOptimizer`] keeps everything around the rule: the parameter groups with their
/// learning rates and hyper-parameters, the fp32 masters (O2) and the copy back into the
/// model, the skip after an overflow (the rule is not called then), clipping, the step counts,
/// and records/checkpoints of the hyper-parameters and of every [`ParamState`]. A rule keeps
/// all of its per-parameter state in [`ParamState`] (so checkpoints hold it) and only reads
/// itself.
///
/// ```
/// use tch::nn::{self, VarStore};
/// use tch::{Device, Kind, Tensor};
/// use tch_amp::{Amp, AmpConfig, OptLevel, UpdateRule};
/// use tch_amp::optim::{GroupView, HyperParams, StateSpec};
///
/// /// Plain SGD with a "decay" of the weights before the step.
/// #[derive(Debug)]
/// struct DecayedSgd { decay: f64 }
///
/// impl UpdateRule for DecayedSgd {
///     fn kind(&self) -> &str { "decayed_sgd" }
///     fn defaults(&self) -> HyperParams { HyperParams::new().with("decay", self.decay) }
///     fn state_spec(&self, _: &HyperParams) -> Vec<StateSpec> { Vec::new() }
///     fn step(&self, groups: &mut [GroupView<'_>]) -> tch_amp::Result<()> {
///         for g in groups.iter_mut() {
///             let (lr, decay) = (g.lr(), g.hyper().get("decay")?);
///             for p in g.params_mut() {
///                 let (param, grad, _) = p.parts();
///                 let mut param = param.shallow_clone();
///                 let _ = param.f_mul_scalar_(1.0 - decay)?; // TchError converts with `?`
///                 let _ = param.f_sub_(&(grad * lr))?;
///             }
///         }
///         Ok(())
///     }
/// }
///
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// let vs = VarStore::new(Device::Cpu);
/// let w = vs.root().var_copy("w", &Tensor::from_slice(&[1.0f32, 2.0]));
/// let mut amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0))?;
/// let mut opt = amp.optimizer_with_rule(&vs, DecayedSgd { decay: 0.5 }, 0.1, &[])?;
/// let loss = w.sum(Kind::Float);
/// amp.scale_loss(&loss, &mut [&mut opt], |l| l.backward())?;
/// opt.step()?;
/// assert_eq!(Vec::<f32>::try_from(&w).unwrap(), [0.4, 0.9]);
/// # Ok(())
/// # }
/// ```
pub trait UpdateRule: std::fmt::Debug + Send {
    /// The rule's name, recorded in checkpoints; a record loads only into an optimizer with
    /// the same name (e.g. `"adamw"`, `"fused_lamb"`, `"my_adamw"`).
    fn kind(&self) -> &str;

    /// torch.optim's `defaults` without `lr`: every hyper-parameter the rule reads, with the
    /// values of groups that do not override them. Groups may override only these keys, and a
    /// record loads only into an optimizer with the same defaults (bit for bit).
    fn defaults(&self) -> HyperParams;

    /// Checks a group's learning rate and hyper-parameters (as torch.optim's constructors raise
    /// `ValueError`). Called when an optimizer is built, a group added or changed, and a record
    /// loaded. The learning rate has already been checked to be finite and >= 0.
    ///
    /// # Errors
    /// Typically [`ConfigError::InvalidOption`] naming the bad value.
    fn validate(&self, lr: f64, hyper: &HyperParams) -> Result<()> {
        let _ = (lr, hyper);
        Ok(())
    }

    /// The state tensors a parameter of a group with these hyper-parameters has after its
    /// first update (none before). Records are checked against this.
    fn state_spec(&self, hyper: &HyperParams) -> Vec<StateSpec>;

    /// One update of every group: for each parameter with a gradient, update `param` in place
    /// and its state. Runs under a no_grad guard.
    ///
    /// # Errors
    /// Whatever goes wrong; the optimizer reports it from `step()`.
    fn step(&self, groups: &mut [GroupView<'_>]) -> Result<()>;
}
