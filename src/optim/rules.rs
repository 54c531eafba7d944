//! The update rules tch-amp steps with: SGD, Adam, AdamW and RMSprop as PyTorch computes them,
//! configured by tch's own config structs. tch's libtorch optimizers give no access to their
//! state (Adam's moments), and a checkpoint that loses it cannot resume bit-exactly, so the
//! rules run here, on tch tensors (Adam/AdamW through libtorch's fused kernel).
use std::collections::BTreeMap;

use tch::{nn, Kind, Tensor};

use crate::dtype::is_low_precision;
use crate::error::{AmpError, Result, TorchContext};
use crate::sys;

/// Which optimizer and its hyper-parameters (tch's config structs; the learning rate is
/// passed separately, as in `tch::nn::OptimizerConfig::build`).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum OptimizerConfig {
    /// `torch.optim.SGD` (momentum, dampening, weight decay, Nesterov).
    Sgd(nn::Sgd),
    /// `torch.optim.Adam` (L2 weight decay added to the gradient; amsgrad).
    Adam(nn::Adam),
    /// `torch.optim.AdamW` (decoupled weight decay; amsgrad).
    AdamW(nn::AdamW),
    /// `torch.optim.RMSprop` (alpha, momentum, centered).
    RmsProp(nn::RmsProp),
}

impl From<nn::Sgd> for OptimizerConfig {
    fn from(c: nn::Sgd) -> Self {
        OptimizerConfig::Sgd(c)
    }
}
impl From<nn::Adam> for OptimizerConfig {
    fn from(c: nn::Adam) -> Self {
        OptimizerConfig::Adam(c)
    }
}
impl From<nn::AdamW> for OptimizerConfig {
    fn from(c: nn::AdamW) -> Self {
        OptimizerConfig::AdamW(c)
    }
}
impl From<nn::RmsProp> for OptimizerConfig {
    fn from(c: nn::RmsProp) -> Self {
        OptimizerConfig::RmsProp(c)
    }
}

impl OptimizerConfig {
    /// The optimizer's kind as records name it: `"sgd"`, `"adam"`, `"adamw"` or `"rmsprop"`.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerConfig::Sgd(_) => "sgd",
            OptimizerConfig::Adam(_) => "adam",
            OptimizerConfig::AdamW(_) => "adamw",
            OptimizerConfig::RmsProp(_) => "rmsprop",
        }
    }

    /// Names of the per-parameter state buffers this optimizer keeps.
    pub(crate) fn buffer_names(&self) -> &'static [&'static str] {
        match self {
            OptimizerConfig::Sgd(c) if c.momentum != 0.0 => &["momentum_buffer"],
            OptimizerConfig::Sgd(_) => &[],
            OptimizerConfig::Adam(nn::Adam { amsgrad: true, .. })
            | OptimizerConfig::AdamW(nn::AdamW { amsgrad: true, .. }) => &["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
            OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_) => &["exp_avg", "exp_avg_sq"],
            OptimizerConfig::RmsProp(c) => match (c.momentum != 0.0, c.centered) {
                (true, true) => &["square_avg", "momentum_buffer", "grad_avg"],
                (true, false) => &["square_avg", "momentum_buffer"],
                (false, true) => &["square_avg", "grad_avg"],
                (false, false) => &["square_avg"],
            },
        }
    }
}

impl OptimizerConfig {
    /// The hyper-parameters besides the learning rate, by torch.optim's names (`momentum`,
    /// `dampening`, `weight_decay`, `nesterov`, `beta1`, `beta2`, `eps`, `amsgrad`, `alpha`,
    /// `centered`; flags as 0 or 1). Checkpoints record them, and a checkpoint made with other
    /// values does not load.
    pub fn hyper_parameters(&self) -> BTreeMap<&'static str, f64> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let pairs: Vec<(&'static str, f64)> = match *self {
            OptimizerConfig::Sgd(c) => vec![
                ("momentum", c.momentum),
                ("dampening", c.dampening),
                ("weight_decay", c.wd),
                ("nesterov", flag(c.nesterov)),
            ],
            OptimizerConfig::Adam(nn::Adam { beta1, beta2, wd, eps, amsgrad })
            | OptimizerConfig::AdamW(nn::AdamW { beta1, beta2, wd, eps, amsgrad }) => {
                vec![("beta1", beta1), ("beta2", beta2), ("eps", eps), ("weight_decay", wd), ("amsgrad", flag(amsgrad))]
            }
            OptimizerConfig::RmsProp(c) => vec![
                ("alpha", c.alpha),
                ("eps", c.eps),
                ("weight_decay", c.wd),
                ("momentum", c.momentum),
                ("centered", flag(c.centered)),
            ],
        };
        pairs.into_iter().collect()
    }

    /// Checks `lr` and the hyper-parameters as torch.optim's constructors do (their
    /// `ValueError`s): lr >= 0; SGD momentum >= 0, weight_decay >= 0, Nesterov only with
    /// momentum > 0 and dampening 0; Adam/AdamW eps >= 0, 0 <= beta1 < 1, 0 <= beta2 < 1,
    /// weight_decay >= 0; RMSprop lr, eps, momentum, weight_decay, alpha >= 0. Stricter than
    /// torch: every value must also be finite (torch accepts an infinite lr and a NaN SGD
    /// momentum or dampening, which turn the weights NaN at the first step).
    ///
    /// # Errors
    /// [`AmpError::InvalidOption`] naming the first bad value, with torch's wording.
    pub fn validate(&self, lr: f64) -> Result<()> {
        fn check(ok: bool, option: &'static str, value: f64, expected: &'static str) -> Result<()> {
            if ok && value.is_finite() {
                Ok(())
            } else {
                Err(AmpError::InvalidOption { option, value: value.to_string(), expected })
            }
        }
        let non_negative = |option: &'static str, v: f64| check(v >= 0.0, option, v, "a finite number >= 0");
        let beta = |option: &'static str, v: f64| {
            check((0.0..1.0).contains(&v), option, v, "a number in [0, 1) (torch: \"Invalid beta parameter\")")
        };
        non_negative("lr", lr)?;
        match *self {
            OptimizerConfig::Sgd(c) => {
                non_negative("momentum", c.momentum)?;
                check(c.dampening.is_finite(), "dampening", c.dampening, "a finite number")?;
                non_negative("weight_decay", c.wd)?;
                if c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0) {
                    return Err(AmpError::InvalidOption {
                        option: "nesterov",
                        value: format!("true with momentum {} and dampening {}", c.momentum, c.dampening),
                        expected: "momentum > 0 and dampening 0 (torch: \"Nesterov momentum requires a momentum and \
                                   zero dampening\")",
                    });
                }
            }
            OptimizerConfig::Adam(nn::Adam { beta1, beta2, wd, eps, .. })
            | OptimizerConfig::AdamW(nn::AdamW { beta1, beta2, wd, eps, .. }) => {
                non_negative("eps", eps)?;
                beta("beta1", beta1)?;
                beta("beta2", beta2)?;
                non_negative("weight_decay", wd)?;
            }
            OptimizerConfig::RmsProp(c) => {
                non_negative("eps", c.eps)?;
                non_negative("momentum", c.momentum)?;
                non_negative("weight_decay", c.wd)?;
                non_negative("alpha", c.alpha)?;
            }
        }
        Ok(())
    }
}

/// The dtype of a parameter's optimizer state: fp32 for fp16/bf16 parameters, else its own.
pub(crate) fn state_kind(param_kind: Kind) -> Kind {
    if is_low_precision(param_kind) {
        Kind::Float
    } else {
        param_kind
    }
}

/// Per-parameter state: the step count and the named buffers.
#[derive(Debug, Default)]
pub(crate) struct ParamState {
    step: u64,
    buffers: BTreeMap<&'static str, Tensor>,
}

impl ParamState {
    fn buffer(&mut self, name: &'static str, like: &Tensor) -> Result<Tensor> {
        if let Some(t) = self.buffers.get(name) {
            return Ok(t.shallow_clone());
        }
        let t = like.f_zeros_like().ctx("allocating optimizer state")?;
        self.buffers.insert(name, t.shallow_clone());
        Ok(t)
    }
}

impl ParamState {
    /// Updates applied to this parameter so far.
    pub(crate) fn step(&self) -> u64 {
        self.step
    }
    /// The named buffers (empty before the first update).
    pub(crate) fn buffers(&self) -> &BTreeMap<&'static str, Tensor> {
        &self.buffers
    }
}

/// An optimizer over a fixed list of parameters (fp32 masters under O2).
#[derive(Debug)]
pub(crate) struct Optimizer {
    config: OptimizerConfig,
    /// Learning rate of every group without its own.
    lr: f64,
    /// Per-group learning rates (tch's `Path::set_group`), overriding `lr`.
    group_lr: BTreeMap<usize, f64>,
    params: Vec<Tensor>,
    groups: Vec<usize>,
    state: Vec<ParamState>,
}

impl Optimizer {
    pub(crate) fn new(config: OptimizerConfig, lr: f64, params: Vec<Tensor>, groups: Vec<usize>) -> Result<Self> {
        check_lr(lr)?;
        let state = params.iter().map(|_| ParamState::default()).collect();
        Ok(Self { config, lr, group_lr: BTreeMap::new(), params, groups, state })
    }

    pub(crate) fn config(&self) -> OptimizerConfig {
        self.config
    }

    /// The learning rate of groups without their own.
    pub(crate) fn lr(&self) -> f64 {
        self.lr
    }

    /// Sets the learning rate of every group (per-group rates are dropped).
    pub(crate) fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_lr(lr)?;
        self.lr = lr;
        self.group_lr.clear();
        Ok(())
    }

    /// Sets the learning rate of one group.
    pub(crate) fn set_group_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        check_lr(lr)?;
        self.group_lr.insert(group, lr);
        Ok(())
    }

    /// The learning rate of `group`.
    pub(crate) fn group_lr(&self, group: usize) -> f64 {
        self.group_lr.get(&group).copied().unwrap_or(self.lr)
    }

    /// The per-group learning rates that override [`Self::lr`].
    pub(crate) fn group_lrs(&self) -> &BTreeMap<usize, f64> {
        &self.group_lr
    }

    /// The state of every parameter, in order.
    pub(crate) fn states(&self) -> &[ParamState] {
        &self.state
    }

    /// Replaces learning rates and per-parameter state (already validated by the caller).
    pub(crate) fn restore(
        &mut self,
        lr: f64,
        group_lr: BTreeMap<usize, f64>,
        states: Vec<(u64, BTreeMap<&'static str, Tensor>)>,
    ) {
        self.lr = lr;
        self.group_lr = group_lr;
        for (st, (step, buffers)) in self.state.iter_mut().zip(states) {
            st.step = step;
            st.buffers = buffers;
        }
    }

    /// One update of every parameter that has a gradient (PyTorch skips the others too).
    pub(crate) fn step(&mut self) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        // Adam/AdamW parameters go through libtorch's fused multi-tensor kernel, one call per
        // learning rate; fp16/bf16 parameters are written back after their fp32 update.
        let mut fused: BTreeMap<u64, FusedBatch> = BTreeMap::new();
        let mut write_back: Vec<(Tensor, Tensor)> = Vec::new();
        for ((param, st), group) in self.params.iter().zip(self.state.iter_mut()).zip(&self.groups) {
            let lr = self.group_lr.get(group).copied().unwrap_or(self.lr);
            let grad = param.grad();
            if !grad.defined() {
                continue;
            }
            // fp16/bf16 parameters (O3, or no master weights) are updated in fp32 with fp32
            // state, then rounded once: in fp16, Adam's eps (1e-8) rounds to 0 and tiny squared
            // gradients underflow, so PyTorch's Adam on fp16 parameters divides by zero.
            let low = is_low_precision(param.kind());
            let (mut p, grad) = if low {
                (param.f_to_kind(Kind::Float).ctx("fp32 update")?, grad.f_to_kind(Kind::Float).ctx("fp32 update")?)
            } else {
                (param.shallow_clone(), grad)
            };
            st.step += 1;
            match self.config {
                OptimizerConfig::Sgd(c) => sgd(&mut p, &grad, st, lr, c)?,
                OptimizerConfig::RmsProp(c) => rmsprop(&mut p, &grad, st, lr, c)?,
                OptimizerConfig::Adam(nn::Adam { amsgrad, .. }) | OptimizerConfig::AdamW(nn::AdamW { amsgrad, .. }) => {
                    let batch = fused.entry(lr.to_bits()).or_default();
                    batch.exp_avgs.push(st.buffer("exp_avg", &p)?);
                    batch.exp_avg_sqs.push(st.buffer("exp_avg_sq", &p)?);
                    if amsgrad {
                        batch.max_exp_avg_sqs.push(st.buffer("max_exp_avg_sq", &p)?);
                    }
                    batch
                        .steps
                        .push(Tensor::f_scalar_tensor(st.step as f64, (Kind::Float, p.device())).ctx("Adam step")?);
                    batch.params.push(p.shallow_clone());
                    batch.grads.push(grad);
                }
            }
            if low {
                write_back.push((param.shallow_clone(), p));
            }
        }
        for (lr_bits, batch) in fused {
            batch.run(self.config, f64::from_bits(lr_bits))?;
        }
        for (mut target, p) in write_back {
            target.f_copy_(&p).ctx("rounding an fp32 update")?;
        }
        Ok(())
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
    fn run(&self, config: OptimizerConfig, lr: f64) -> Result<()> {
        let (beta1, beta2, wd, eps, amsgrad, adamw) = match config {
            OptimizerConfig::Adam(c) => (c.beta1, c.beta2, c.wd, c.eps, c.amsgrad, false),
            OptimizerConfig::AdamW(c) => (c.beta1, c.beta2, c.wd, c.eps, c.amsgrad, true),
            _ => return Ok(()),
        };
        let args = sys::FusedAdamArgs {
            params: &self.params,
            grads: &self.grads,
            exp_avgs: &self.exp_avgs,
            exp_avg_sqs: &self.exp_avg_sqs,
            max_exp_avg_sqs: &self.max_exp_avg_sqs,
            steps: &self.steps,
        };
        sys::fused_adam_(&args, lr, beta1, beta2, wd, eps, amsgrad, adamw)
    }
}

pub(crate) fn check_lr(lr: f64) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(())
    } else {
        Err(AmpError::InvalidOption { option: "lr", value: lr.to_string(), expected: "a finite number >= 0" })
    }
}

fn sgd(p: &mut Tensor, grad: &Tensor, st: &mut ParamState, lr: f64, c: nn::Sgd) -> Result<()> {
    let mut d_p = if c.wd != 0.0 { grad + &*p * c.wd } else { grad.shallow_clone() };
    if c.momentum != 0.0 {
        let buf = if !st.buffers.contains_key("momentum_buffer") {
            let b = d_p.f_detach_copy().ctx("SGD momentum buffer")?;
            st.buffers.insert("momentum_buffer", b.shallow_clone());
            b
        } else {
            let mut b = st.buffer("momentum_buffer", p)?;
            let _ = b.f_mul_scalar_(c.momentum).ctx("SGD momentum")?;
            let _ = b.f_add_(&(&d_p * (1.0 - c.dampening))).ctx("SGD momentum")?;
            b
        };
        d_p = if c.nesterov { &d_p + &buf * c.momentum } else { buf };
    }
    let _ = p.f_sub_(&(d_p * lr)).ctx("SGD update")?;
    Ok(())
}

fn rmsprop(p: &mut Tensor, grad: &Tensor, st: &mut ParamState, lr: f64, c: nn::RmsProp) -> Result<()> {
    let grad = if c.wd != 0.0 { grad + &*p * c.wd } else { grad.shallow_clone() };
    let mut square_avg = st.buffer("square_avg", p)?;
    let _ = square_avg.f_mul_scalar_(c.alpha).ctx("RMSprop average")?;
    let _ = square_avg.f_add_(&(&grad * &grad * (1.0 - c.alpha))).ctx("RMSprop average")?;
    let avg = if c.centered {
        let mut grad_avg = st.buffer("grad_avg", p)?;
        let _ = grad_avg.f_lerp_(&grad, 1.0 - c.alpha).ctx("RMSprop centered")?;
        (&square_avg - &grad_avg * &grad_avg).f_sqrt().ctx("RMSprop centered")? + c.eps
    } else {
        square_avg.f_sqrt().ctx("RMSprop")? + c.eps
    };
    if c.momentum > 0.0 {
        let mut buf = st.buffer("momentum_buffer", p)?;
        let _ = buf.f_mul_scalar_(c.momentum).ctx("RMSprop momentum")?;
        let _ = buf.f_add_(&(&grad / &avg)).ctx("RMSprop momentum")?;
        let _ = p.f_sub_(&(buf * lr)).ctx("RMSprop update")?;
    } else {
        let _ = p.f_sub_(&(grad / avg * lr)).ctx("RMSprop update")?;
    }
    Ok(())
}
