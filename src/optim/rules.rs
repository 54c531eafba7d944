//! The built-in update rules: torch.optim's SGD, Adam, AdamW and RMSprop, configured by tch's
//! own config structs, and Apex's fused optimizers (`super::apex`), computed on tch tensors
//! (tch's libtorch optimizers give no access to their state, and a checkpoint that loses
//! Adam's moments cannot resume bit-exactly). torch.optim's rules are its single-tensor
//! algorithm op for op (bit for bit, tests/amp/optim_bitwise.rs); Adam/AdamW can run libtorch's
//! fused kernel instead (torch's `fused=True`). [`OptimizerConfig`] names a built-in rule and
//! implements [`UpdateRule`] through [`BuiltinRule`].
use crate::error::ConfigError;
use std::collections::BTreeMap;

use tch::{nn, Kind, Tensor};

use super::apex::{self, FusedAdagrad, FusedAdam, FusedLamb, FusedNovoGrad, FusedSgd};
use super::rule::{GroupView, HyperParams, ParamState, StateSpec, UpdateRule};
use crate::error::{AmpError, Result, TorchContext};
use crate::sys::{self, FusedAdamHyper};

/// Which built-in optimizer and its hyper-parameters (tch's config structs for torch.optim's,
/// [`FusedSgd`] and friends for Apex's; the learning rate is passed separately, as in
/// `tch::nn::OptimizerConfig::build`), plus the torch.optim flags tch's structs lack:
/// `maximize` and `fused`. Made with `.into()` or [`OptimizerConfig::from`];
/// `nn::Adam::default()`, `FusedLamb::default()` and friends are accepted wherever an
/// `impl Into<OptimizerConfig>` is.
///
/// By default torch.optim's optimizers run PyTorch's single-tensor algorithm (`foreach=False,
/// fused=False`, what torch.optim runs for CPU tensors): the same libtorch ops in the same
/// order, so a ported script's weights and optimizer state equal its Python run's bit for bit.
/// [`OptimizerConfig::fused`] selects libtorch's fused Adam/AdamW kernel instead (torch's
/// `fused=True`): one kernel per learning rate instead of about ten per parameter (the
/// saving grows with the number of parameter tensors), equal to torch's
/// `fused=True` bit for bit but not to its default in the last bits. Apex's optimizers are
/// described in [`FusedSgd`], [`FusedAdam`], [`FusedLamb`], [`FusedNovoGrad`] and
/// [`FusedAdagrad`].
///
/// ```
/// use tch::nn;
/// use tch_amp::{FusedLamb, OptimizerConfig};
/// use tch_amp::optim::Algorithm;
/// // torch.optim.Adam(params, lr, betas=(0.9, 0.999), maximize=True, fused=True)
/// let cfg = OptimizerConfig::from(nn::adam(0.9, 0.999, 0.0)).maximize(true).fused(true);
/// assert!(cfg.is_fused() && cfg.is_maximize());
/// assert!(matches!(cfg.algorithm(), Algorithm::Adam(_)));
/// // apex.optimizers.FusedLAMB(params, lr, weight_decay=0.01, max_grad_norm=1.0)
/// let lamb = OptimizerConfig::from(FusedLamb { weight_decay: 0.01, ..Default::default() });
/// assert_eq!(lamb.name(), "fused_lamb");
/// ```
#[derive(Debug, Clone, Copy)]
pub struct OptimizerConfig {
    algorithm: Algorithm,
    maximize: bool,
    fused: bool,
    state_dtype: Option<Kind>,
}

/// The optimizer and its hyper-parameters.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Algorithm {
    /// `torch.optim.SGD` (momentum, dampening, weight decay, Nesterov).
    Sgd(nn::Sgd),
    /// `torch.optim.Adam` (L2 weight decay added to the gradient; amsgrad).
    Adam(nn::Adam),
    /// `torch.optim.AdamW` (decoupled weight decay; amsgrad).
    AdamW(nn::AdamW),
    /// `torch.optim.RMSprop` (alpha, momentum, centered).
    RmsProp(nn::RmsProp),
    /// `apex.optimizers.FusedSGD`.
    FusedSgd(FusedSgd),
    /// `apex.optimizers.FusedAdam`.
    FusedAdam(FusedAdam),
    /// `apex.optimizers.FusedLAMB`.
    FusedLamb(FusedLamb),
    /// `apex.optimizers.FusedNovoGrad`.
    FusedNovoGrad(FusedNovoGrad),
    /// `apex.optimizers.FusedAdagrad`.
    FusedAdagrad(FusedAdagrad),
}

impl From<Algorithm> for OptimizerConfig {
    fn from(algorithm: Algorithm) -> Self {
        OptimizerConfig { algorithm, maximize: false, fused: false, state_dtype: None }
    }
}
macro_rules! config_from {
    ($($ty:ty => $variant:ident),*) => {$(
        impl From<$ty> for OptimizerConfig {
            fn from(c: $ty) -> Self {
                Algorithm::$variant(c).into()
            }
        }
    )*};
}
config_from!(nn::Sgd => Sgd, nn::Adam => Adam, nn::AdamW => AdamW, nn::RmsProp => RmsProp,
    FusedSgd => FusedSgd, FusedAdam => FusedAdam, FusedLamb => FusedLamb, FusedNovoGrad => FusedNovoGrad,
    FusedAdagrad => FusedAdagrad);

impl OptimizerConfig {
    /// torch.optim's `maximize`: step along the gradient instead of against it (torch.optim's
    /// optimizers; default false; Apex's have no such option and refuse it).
    pub fn maximize(mut self, on: bool) -> Self {
        self.maximize = on;
        self
    }

    /// torch.optim's `fused=True` for Adam and AdamW: one libtorch `_fused_adam_` / `_fused_adamw_`
    /// call per parameter group instead of the single-tensor algorithm. Its results differ from the
    /// default's in the last bits (it computes the update in another order), as torch's do. Default
    /// false. Building an optimizer with `fused(true)` for any other optimizer is
    /// [`ConfigError::InvalidOption`].
    pub fn fused(mut self, on: bool) -> Self {
        self.fused = on;
        self
    }

    /// Keep the state tensors shaped like their parameter (Adam's `exp_avg` and `exp_avg_sq`,
    /// momentum buffers, ...) in `kind` between steps: `Kind::BFloat16` halves their memory (Adam:
    /// 4 bytes per parameter instead of 8). The update itself runs in fp32: before a parameter's
    /// update its state is widened to fp32, afterwards rounded (to nearest) back, so each step
    /// rounds the state once; fp16/bf16 parameters without masters are then updated in fp32
    /// copies too. The rule runs one parameter at a time (LAMB gets its global gradient norm), so
    /// the fp32 copies of one parameter's state exist at once. Default: the dtype the state is
    /// computed in (fp32 for fp32 parameters and masters). `Kind::Float` restores the default;
    /// any other dtype is [`ConfigError::InvalidOption`] when the optimizer is built (fp16's
    /// range would flush Adam's second moments to zero). Records and checkpoints hold the state
    /// in `kind`; a torch file's fp32 state loads rounded to it.
    pub fn state_dtype(mut self, kind: Kind) -> Self {
        self.state_dtype = if kind == Kind::Float { None } else { Some(kind) };
        self
    }

    /// The dtype state is stored in between steps (`None`: the dtype it is computed in).
    pub fn stored_state_dtype(&self) -> Option<Kind> {
        self.state_dtype
    }

    /// The optimizer and its hyper-parameters.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Whether `maximize` is on.
    pub fn is_maximize(&self) -> bool {
        self.maximize
    }

    /// Whether the fused Adam/AdamW kernel is selected.
    pub fn is_fused(&self) -> bool {
        self.fused
    }

    /// The optimizer's kind as records name it: `"sgd"`, `"adam"`, `"adamw"`, `"rmsprop"`,
    /// `"fused_sgd"`, `"fused_adam"`, `"fused_lamb"`, `"fused_novograd"` or `"fused_adagrad"`.
    pub fn name(&self) -> &'static str {
        match self.algorithm {
            Algorithm::Sgd(_) => "sgd",
            Algorithm::Adam(_) => "adam",
            Algorithm::AdamW(_) => "adamw",
            Algorithm::RmsProp(_) => "rmsprop",
            Algorithm::FusedSgd(_) => "fused_sgd",
            Algorithm::FusedAdam(_) => "fused_adam",
            Algorithm::FusedLamb(_) => "fused_lamb",
            Algorithm::FusedNovoGrad(_) => "fused_novograd",
            Algorithm::FusedAdagrad(_) => "fused_adagrad",
        }
    }

    fn is_apex(&self) -> bool {
        matches!(
            self.algorithm,
            Algorithm::FusedSgd(_)
                | Algorithm::FusedAdam(_)
                | Algorithm::FusedLamb(_)
                | Algorithm::FusedNovoGrad(_)
                | Algorithm::FusedAdagrad(_)
        )
    }

    /// The hyper-parameters besides the learning rate, by torch.optim's (or Apex's) names
    /// (`momentum`, `dampening`, `weight_decay`, `nesterov`, `beta1`, `beta2`, `eps`,
    /// `amsgrad`, `alpha`, `centered`, `maximize`; Apex's `bias_correction`, `adam_w_mode`,
    /// `grad_averaging`, `max_grad_norm`, `use_nvlamb`, ...; flags as 0 or 1). These are the
    /// optimizer's defaults, which parameter groups may override; checkpoints record them, and
    /// a checkpoint made with other values does not load.
    pub fn hyper_parameters(&self) -> BTreeMap<&'static str, f64> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let pairs: Vec<(&'static str, f64)> = match self.algorithm {
            Algorithm::Sgd(c) => vec![
                ("momentum", c.momentum),
                ("dampening", c.dampening),
                ("weight_decay", c.wd),
                ("nesterov", flag(c.nesterov)),
            ],
            Algorithm::Adam(nn::Adam { beta1, beta2, wd, eps, amsgrad })
            | Algorithm::AdamW(nn::AdamW { beta1, beta2, wd, eps, amsgrad }) => {
                vec![("beta1", beta1), ("beta2", beta2), ("eps", eps), ("weight_decay", wd), ("amsgrad", flag(amsgrad))]
            }
            Algorithm::RmsProp(c) => vec![
                ("alpha", c.alpha),
                ("eps", c.eps),
                ("weight_decay", c.wd),
                ("momentum", c.momentum),
                ("centered", flag(c.centered)),
            ],
            _ => return self.defaults().iter().filter_map(|(k, v)| static_key(k).map(|k| (k, v))).collect(),
        };
        pairs.into_iter().chain([("maximize", flag(self.maximize))]).collect()
    }

    /// [`Self::hyper_parameters`] as [`HyperParams`] (the rule's defaults).
    pub(crate) fn defaults(&self) -> HyperParams {
        match self.algorithm {
            Algorithm::FusedSgd(c) => c.hyper(),
            Algorithm::FusedAdam(c) => c.hyper(),
            Algorithm::FusedLamb(c) => c.hyper(),
            Algorithm::FusedNovoGrad(c) => c.hyper(),
            Algorithm::FusedAdagrad(c) => c.hyper(),
            _ => self.hyper_parameters().into_iter().collect(),
        }
    }

    /// This configuration with a group's hyper-parameters.
    fn with_hyper(&self, h: &HyperParams) -> Result<OptimizerConfig> {
        let algorithm = match self.algorithm {
            Algorithm::Sgd(_) => Algorithm::Sgd(nn::Sgd {
                momentum: h.get("momentum")?,
                dampening: h.get("dampening")?,
                wd: h.get("weight_decay")?,
                nesterov: h.flag("nesterov")?,
            }),
            Algorithm::Adam(_) => Algorithm::Adam(nn::Adam {
                beta1: h.get("beta1")?,
                beta2: h.get("beta2")?,
                wd: h.get("weight_decay")?,
                eps: h.get("eps")?,
                amsgrad: h.flag("amsgrad")?,
            }),
            Algorithm::AdamW(_) => Algorithm::AdamW(nn::AdamW {
                beta1: h.get("beta1")?,
                beta2: h.get("beta2")?,
                wd: h.get("weight_decay")?,
                eps: h.get("eps")?,
                amsgrad: h.flag("amsgrad")?,
            }),
            Algorithm::RmsProp(_) => Algorithm::RmsProp(nn::RmsProp {
                alpha: h.get("alpha")?,
                eps: h.get("eps")?,
                wd: h.get("weight_decay")?,
                momentum: h.get("momentum")?,
                centered: h.flag("centered")?,
            }),
            Algorithm::FusedSgd(_) => Algorithm::FusedSgd(FusedSgd::from_hyper(h)?),
            Algorithm::FusedAdam(_) => Algorithm::FusedAdam(FusedAdam::from_hyper(h)?),
            Algorithm::FusedLamb(_) => Algorithm::FusedLamb(FusedLamb::from_hyper(h)?),
            Algorithm::FusedNovoGrad(_) => Algorithm::FusedNovoGrad(FusedNovoGrad::from_hyper(h)?),
            Algorithm::FusedAdagrad(_) => Algorithm::FusedAdagrad(FusedAdagrad::from_hyper(h)?),
        };
        let maximize = if self.is_apex() { false } else { h.flag("maximize")? };
        Ok(OptimizerConfig { algorithm, maximize, fused: self.fused, state_dtype: self.state_dtype })
    }

    /// The hyper-parameters Apex reads from the optimizer, not from a group (`adam_w_mode`,
    /// LAMB's `max_grad_norm` and `use_nvlamb`, ...): groups cannot override them.
    fn optimizer_wide(&self) -> &'static [&'static str] {
        match self.algorithm {
            Algorithm::FusedSgd(_) => FusedSgd::GLOBAL,
            Algorithm::FusedAdam(_) => FusedAdam::GLOBAL,
            Algorithm::FusedLamb(_) => FusedLamb::GLOBAL,
            Algorithm::FusedNovoGrad(_) => FusedNovoGrad::GLOBAL,
            Algorithm::FusedAdagrad(_) => FusedAdagrad::GLOBAL,
            _ => &[],
        }
    }

    /// The state tensors of a parameter of a group with hyper-parameters `h`.
    fn state_spec(&self, h: &HyperParams) -> Vec<StateSpec> {
        let Ok(c) = self.with_hyper(h) else { return Vec::new() };
        let names: &[&str] = match c.algorithm {
            Algorithm::Sgd(c) if c.momentum != 0.0 => &["momentum_buffer"],
            Algorithm::Sgd(_) => &[],
            Algorithm::Adam(nn::Adam { amsgrad: true, .. }) | Algorithm::AdamW(nn::AdamW { amsgrad: true, .. }) => {
                &["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
            }
            Algorithm::Adam(_) | Algorithm::AdamW(_) => &["exp_avg", "exp_avg_sq"],
            Algorithm::RmsProp(c) => match (c.momentum != 0.0, c.centered) {
                (true, true) => &["square_avg", "momentum_buffer", "grad_avg"],
                (true, false) => &["square_avg", "momentum_buffer"],
                (false, true) => &["square_avg", "grad_avg"],
                (false, false) => &["square_avg"],
            },
            Algorithm::FusedSgd(_) => return apex::sgd_state(h),
            Algorithm::FusedAdam(_) => return apex::adam_state(),
            Algorithm::FusedLamb(_) => return apex::lamb_state(),
            Algorithm::FusedNovoGrad(_) => return apex::novograd_state(),
            Algorithm::FusedAdagrad(_) => return apex::adagrad_state(),
        };
        names.iter().map(|n| StateSpec::like_param(*n)).collect()
    }

    /// Checks `lr` and the hyper-parameters as torch.optim's constructors do (their `ValueError`s):
    /// lr >= 0; SGD momentum >= 0, weight_decay >= 0, Nesterov only with momentum > 0 and dampening
    /// 0; Adam/AdamW eps >= 0, 0 <= beta1 < 1, 0 <= beta2 < 1, weight_decay >= 0; RMSprop lr, eps,
    /// momentum, weight_decay, alpha >= 0. Apex's optimizers as Apex's constructors do (FusedSGD as
    /// torch's SGD; `amsgrad` refused; NovoGrad's `norm_type` 2 or 0), with betas in [0, 1), eps
    /// and weight decay >= 0 and LAMB's `max_grad_norm` > 0. Stricter than torch: every value must
    /// also be finite (torch accepts an infinite lr and a NaN SGD momentum or dampening, which turn
    /// the weights NaN at the first step). `fused` only for Adam/AdamW, `maximize` not for Apex's
    /// optimizers.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] naming the first bad value, with torch's wording.
    pub fn validate(&self, lr: f64) -> Result<()> {
        fn check(ok: bool, option: &'static str, value: f64, expected: &'static str) -> Result<()> {
            if ok && value.is_finite() {
                Ok(())
            } else {
                Err(AmpError::Config(ConfigError::InvalidOption { option, value: value.to_string(), expected }))
            }
        }
        let non_negative = |option: &'static str, v: f64| check(v >= 0.0, option, v, "a finite number >= 0");
        let beta = |option: &'static str, v: f64| {
            check((0.0..1.0).contains(&v), option, v, "a number in [0, 1) (torch: \"Invalid beta parameter\")")
        };
        non_negative("lr", lr)?;
        if self.fused && !matches!(self.algorithm, Algorithm::Adam(_) | Algorithm::AdamW(_)) {
            return Err(AmpError::Config(ConfigError::InvalidOption {
                option: "fused",
                value: format!("{:?}", self.algorithm),
                expected: "Adam or AdamW (tch-amp has no fused kernel for SGD or RMSprop; Apex's optimizers run \
                           their own algorithm): drop .fused(true)",
            }));
        }
        if let Some(kind) = self.state_dtype.filter(|k| *k != Kind::BFloat16) {
            return Err(AmpError::Config(ConfigError::InvalidOption {
                option: "state_dtype",
                value: format!("{kind:?}"),
                expected: "Kind::BFloat16 (stored state, fp32 arithmetic) or Kind::Float (the default)",
            }));
        }
        if self.maximize && self.is_apex() {
            return Err(AmpError::Config(ConfigError::InvalidOption {
                option: "maximize",
                value: "true".into(),
                expected: "false: Apex's optimizers have no maximize option",
            }));
        }
        match self.algorithm {
            Algorithm::Sgd(c) => {
                non_negative("momentum", c.momentum)?;
                check(c.dampening.is_finite(), "dampening", c.dampening, "a finite number")?;
                non_negative("weight_decay", c.wd)?;
                if c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0) {
                    return Err(AmpError::Config(ConfigError::InvalidOption {
                        option: "nesterov",
                        value: format!("true with momentum {} and dampening {}", c.momentum, c.dampening),
                        expected: "momentum > 0 and dampening 0 (torch: \"Nesterov momentum requires a momentum and \
                                   zero dampening\")",
                    }));
                }
            }
            Algorithm::Adam(nn::Adam { beta1, beta2, wd, eps, .. })
            | Algorithm::AdamW(nn::AdamW { beta1, beta2, wd, eps, .. }) => {
                non_negative("eps", eps)?;
                beta("beta1", beta1)?;
                beta("beta2", beta2)?;
                non_negative("weight_decay", wd)?;
            }
            Algorithm::RmsProp(c) => {
                non_negative("eps", c.eps)?;
                non_negative("momentum", c.momentum)?;
                non_negative("weight_decay", c.wd)?;
                non_negative("alpha", c.alpha)?;
            }
            Algorithm::FusedSgd(c) => apex::validate_sgd(&c)?,
            Algorithm::FusedAdam(c) => apex::validate_adam(&c)?,
            Algorithm::FusedLamb(c) => apex::validate_lamb(&c)?,
            Algorithm::FusedNovoGrad(c) => apex::validate_novograd(&c)?,
            Algorithm::FusedAdagrad(c) => apex::validate_adagrad(&c)?,
        }
        Ok(())
    }

    /// The rule that runs this configuration.
    pub(crate) fn rule(self) -> BuiltinRule {
        BuiltinRule { config: self }
    }
}

/// The `&'static str` of a known hyper-parameter name.
fn static_key(k: &str) -> Option<&'static str> {
    const KEYS: &[&str] = &[
        "momentum",
        "dampening",
        "weight_decay",
        "nesterov",
        "wd_after_momentum",
        "beta1",
        "beta2",
        "eps",
        "adam_w_mode",
        "bias_correction",
        "grad_averaging",
        "max_grad_norm",
        "use_nvlamb",
        "reg_inside_moment",
        "norm_type",
        "init_zero",
        "adagrad_w_mode",
    ];
    KEYS.iter().copied().find(|s| *s == k)
}

/// A built-in configuration as an [`UpdateRule`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct BuiltinRule {
    config: OptimizerConfig,
}

impl UpdateRule for BuiltinRule {
    fn kind(&self) -> &str {
        self.config.name()
    }

    fn defaults(&self) -> HyperParams {
        self.config.defaults()
    }

    fn validate(&self, lr: f64, hyper: &HyperParams) -> Result<()> {
        // The optimizer as constructed (e.g. Apex's amsgrad refusal), then the group.
        self.config.validate(lr)?;
        let defaults = self.config.defaults();
        for key in self.config.optimizer_wide() {
            if hyper.get(key)?.to_bits() != defaults.get(key)?.to_bits() {
                return Err(AmpError::Config(ConfigError::InvalidOption {
                    option: "param group",
                    value: format!("{key} = {} in a group, {} for the optimizer", hyper.get(key)?, defaults.get(key)?),
                    expected: "the optimizer's value: Apex reads this option from the optimizer, not from its groups \
                               (set it on the optimizer's config)",
                }));
            }
        }
        self.config.with_hyper(hyper)?.validate(lr)
    }

    fn state_spec(&self, hyper: &HyperParams) -> Vec<StateSpec> {
        self.config.state_spec(hyper)
    }

    fn step(&self, groups: &mut [GroupView<'_>]) -> Result<()> {
        match self.config.algorithm {
            Algorithm::FusedSgd(c) => return apex::sgd_step(groups, c.wd_after_momentum),
            Algorithm::FusedAdam(c) => return apex::adam_step(groups, c.adam_w_mode),
            Algorithm::FusedLamb(c) => return apex::lamb_step(groups, &c),
            Algorithm::FusedNovoGrad(c) => return apex::novograd_step(groups, c.reg_inside_moment),
            Algorithm::FusedAdagrad(c) => return apex::adagrad_step(groups, c.adagrad_w_mode),
            _ => {}
        }
        for g in groups.iter_mut() {
            let OptimizerConfig { algorithm, maximize, fused, .. } = self.config.with_hyper(g.hyper())?;
            let lr = g.lr();
            // fused: the group's Adam/AdamW parameters in one kernel call.
            let mut batch = FusedBatch::default();
            for view in g.params_mut() {
                let (p, grad, st) = view.parts();
                let grad = grad.shallow_clone();
                match algorithm {
                    Algorithm::Sgd(c) => sgd(p, &grad, st, lr, c, maximize)?,
                    Algorithm::RmsProp(c) => rmsprop(p, &grad, st, lr, c, maximize)?,
                    Algorithm::Adam(c) if !fused => {
                        let h = AdamHyper { beta1: c.beta1, beta2: c.beta2, eps: c.eps, wd: c.wd, amsgrad: c.amsgrad };
                        adam(p, &grad, st, lr, h, false, maximize)?
                    }
                    Algorithm::AdamW(c) if !fused => {
                        let h = AdamHyper { beta1: c.beta1, beta2: c.beta2, eps: c.eps, wd: c.wd, amsgrad: c.amsgrad };
                        adam(p, &grad, st, lr, h, true, maximize)?
                    }
                    Algorithm::Adam(nn::Adam { amsgrad, .. }) | Algorithm::AdamW(nn::AdamW { amsgrad, .. }) => {
                        let exp_avg = st.buffer_or_zeros("exp_avg", p)?;
                        let exp_avg_sq = st.buffer_or_zeros("exp_avg_sq", p)?;
                        let max_exp_avg_sq =
                            if amsgrad { Some(st.buffer_or_zeros("max_exp_avg_sq", p)?) } else { None };
                        let step = torch_step_value(st.step());
                        let step = Tensor::f_scalar_tensor(step, (Kind::Float, p.device())).ctx("Adam step")?;
                        batch.exp_avgs.push(exp_avg);
                        batch.exp_avg_sqs.push(exp_avg_sq);
                        batch.max_exp_avg_sqs.extend(max_exp_avg_sq);
                        batch.steps.push(step);
                        batch.params.push(p.shallow_clone());
                        batch.grads.push(grad);
                    }
                    _ => {}
                }
            }
            if !batch.params.is_empty() {
                batch.run(algorithm, lr, maximize)?;
            }
        }
        Ok(())
    }
}

/// The value torch.optim reads from a parameter's `step`: an fp32 tensor incremented by 1 per
/// update, so it counts exactly up to 2^24 and stays there (2^24 + 1 rounds back to 2^24).
pub(crate) fn torch_step_value(count: u64) -> f64 {
    count.min(1 << 24) as f64
}

impl FusedAdamHyper {
    /// The kernel's arguments for torch.optim's Adam or AdamW (`None` for another algorithm).
    fn of(algorithm: Algorithm, maximize: bool) -> Option<Self> {
        match algorithm {
            Algorithm::Adam(nn::Adam { beta1, beta2, wd, eps, amsgrad }) => {
                Some(FusedAdamHyper { beta1, beta2, wd, eps, amsgrad, adamw: false, maximize })
            }
            Algorithm::AdamW(nn::AdamW { beta1, beta2, wd, eps, amsgrad }) => {
                Some(FusedAdamHyper { beta1, beta2, wd, eps, amsgrad, adamw: true, maximize })
            }
            _ => None,
        }
    }
}

/// Parameters of one fused Adam/AdamW call.
#[derive(Default)]
struct FusedBatch {
    params: Vec<Tensor>,
    grads: Vec<Tensor>,
    exp_avgs: Vec<Tensor>,
    exp_avg_sqs: Vec<Tensor>,
    max_exp_avg_sqs: Vec<Tensor>,
    steps: Vec<Tensor>,
}

impl FusedBatch {
    fn run(&self, algorithm: Algorithm, lr: f64, maximize: bool) -> Result<()> {
        let Some(h) = FusedAdamHyper::of(algorithm, maximize) else { return Ok(()) };
        let args = sys::FusedAdamArgs {
            params: &self.params,
            grads: &self.grads,
            exp_avgs: &self.exp_avgs,
            exp_avg_sqs: &self.exp_avg_sqs,
            max_exp_avg_sqs: &self.max_exp_avg_sqs,
            steps: &self.steps,
        };
        sys::fused_adam_(&args, lr, h)
    }
}

// The single-tensor updates below follow torch/optim/{sgd,adam,rmsprop}.py of PyTorch 2.13
// (`_single_tensor_*`, capturable=False, differentiable=False) op for op: the same libtorch
// kernels with the same scalars, so every intermediate rounds where torch's does (a Python
// float operand goes in as a wrapped number, as torch's argument parser passes it). Python
// floats are f64 here; the kernels round them to the tensor's dtype as torch does.

/// `-grad` under `maximize`, else the gradient itself.
fn signed_grad(grad: &Tensor, maximize: bool) -> Result<Tensor> {
    if maximize {
        grad.f_neg().ctx("maximize")
    } else {
        Ok(grad.shallow_clone())
    }
}

fn sgd(p: &Tensor, grad: &Tensor, st: &mut ParamState, lr: f64, c: nn::Sgd, maximize: bool) -> Result<()> {
    let mut grad = signed_grad(grad, maximize)?;
    if c.wd != 0.0 {
        grad = sys::add(&grad, p, c.wd)?;
    }
    if c.momentum != 0.0 {
        grad = super::sgd::sgd_momentum(&grad, st, c.momentum, c.dampening, c.nesterov)?;
    }
    sys::add_(p, &grad, -lr)
}

/// Adam's and AdamW's hyper-parameters.
#[derive(Clone, Copy)]
struct AdamHyper {
    beta1: f64,
    beta2: f64,
    eps: f64,
    wd: f64,
    amsgrad: bool,
}

fn adam(
    p: &Tensor,
    grad: &Tensor,
    st: &mut ParamState,
    lr: f64,
    h: AdamHyper,
    decoupled: bool,
    maximize: bool,
) -> Result<()> {
    let mut grad = signed_grad(grad, maximize)?;
    if h.wd != 0.0 {
        if decoupled {
            sys::mul_float_(p, 1.0 - lr * h.wd)?;
        } else {
            grad = sys::add(&grad, p, h.wd)?;
        }
    }
    let mut exp_avg = st.buffer_or_zeros("exp_avg", p)?;
    let exp_avg_sq = st.buffer_or_zeros("exp_avg_sq", p)?;
    let _ = exp_avg.f_lerp_(&grad, 1.0 - h.beta1).ctx("Adam first moment")?;
    sys::mul_float_(&exp_avg_sq, h.beta2)?;
    sys::addcmul_(&exp_avg_sq, &grad, &grad, 1.0 - h.beta2)?;
    // Python floats: `beta ** step` and `x ** 0.5` are libm's pow, which black_box keeps the
    // compiler from turning into sqrt (pow(x, 0.5) is not always correctly rounded).
    let step = torch_step_value(st.step());
    let bias_correction1 = 1.0 - h.beta1.powf(step);
    let bias_correction2 = 1.0 - h.beta2.powf(step);
    let step_size = lr / bias_correction1;
    let bias_correction2_sqrt = bias_correction2.powf(std::hint::black_box(0.5));
    let second = if h.amsgrad {
        let max_exp_avg_sq = st.buffer_or_zeros("max_exp_avg_sq", p)?;
        let _ = max_exp_avg_sq.f_maximum_out(&max_exp_avg_sq, &exp_avg_sq).ctx("amsgrad maximum")?;
        max_exp_avg_sq
    } else {
        exp_avg_sq
    };
    let denom = sys::div_float(&second.f_sqrt().ctx("Adam denominator")?, bias_correction2_sqrt)?;
    sys::add_float_(&denom, h.eps)?;
    sys::addcdiv_(p, &exp_avg, &denom, -step_size)
}

fn rmsprop(p: &Tensor, grad: &Tensor, st: &mut ParamState, lr: f64, c: nn::RmsProp, maximize: bool) -> Result<()> {
    let mut grad = signed_grad(grad, maximize)?;
    if c.wd != 0.0 {
        grad = sys::add(&grad, p, c.wd)?;
    }
    let square_avg = st.buffer_or_zeros("square_avg", p)?;
    sys::mul_float_(&square_avg, c.alpha)?;
    sys::addcmul_(&square_avg, &grad, &grad, 1.0 - c.alpha)?;
    let avg = if c.centered {
        let mut grad_avg = st.buffer_or_zeros("grad_avg", p)?;
        let _ = grad_avg.f_lerp_(&grad, 1.0 - c.alpha).ctx("RMSprop centered")?;
        let mut v = sys::addcmul(&square_avg, &grad_avg, &grad_avg, -1.0)?;
        let _ = v.f_sqrt_().ctx("RMSprop centered")?;
        v
    } else {
        square_avg.f_sqrt().ctx("RMSprop")?
    };
    sys::add_float_(&avg, c.eps)?;
    if c.momentum > 0.0 {
        let buf = st.buffer_or_zeros("momentum_buffer", p)?;
        sys::mul_float_(&buf, c.momentum)?;
        sys::addcdiv_(&buf, &grad, &avg, 1.0)?;
        sys::add_(p, &buf, -lr)
    } else {
        sys::addcdiv_(p, &grad, &avg, -lr)
    }
}
