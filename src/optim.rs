//! The optimizers tch-amp steps: SGD, Adam, AdamW and RMSprop with PyTorch's update rules,
//! configured by tch's own config structs. They are ours, not libtorch's C++ optimizers,
//! because tch gives no access to those optimizers' state (Adam's moments), and a checkpoint
//! that loses it cannot resume bit-exactly.
use std::collections::BTreeMap;

use tch::{nn, Kind, Tensor};

use crate::dtype::is_low_precision;

use crate::error::{AmpError, Result, TorchContext};

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
    pub(crate) step: u64,
    pub(crate) buffers: BTreeMap<&'static str, Tensor>,
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

/// An optimizer over a fixed list of parameters (fp32 masters under O2).
#[derive(Debug)]
pub(crate) struct Optimizer {
    pub(crate) config: OptimizerConfig,
    /// Learning rate of every group without its own.
    pub(crate) lr: f64,
    /// Per-group learning rates (tch's `Path::set_group`), overriding `lr`.
    pub(crate) group_lr: BTreeMap<usize, f64>,
    pub(crate) params: Vec<Tensor>,
    pub(crate) groups: Vec<usize>,
    pub(crate) state: Vec<ParamState>,
}

impl Optimizer {
    pub(crate) fn new(config: OptimizerConfig, lr: f64, params: Vec<Tensor>, groups: Vec<usize>) -> Result<Self> {
        check_lr(lr)?;
        let state = params.iter().map(|_| ParamState::default()).collect();
        Ok(Self { config, lr, group_lr: BTreeMap::new(), params, groups, state })
    }

    /// One update of every parameter that has a gradient (PyTorch skips the others too).
    pub(crate) fn step(&mut self) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        for ((param, st), group) in self.params.iter().zip(self.state.iter_mut()).zip(&self.groups) {
            let lr = self.group_lr.get(group).copied().unwrap_or(self.lr);
            let p = param;
            let grad = p.grad();
            if !grad.defined() {
                continue;
            }
            // fp16/bf16 parameters (O3, or no master weights) are updated in fp32 with fp32
            // state, then rounded once: in fp16, Adam's eps (1e-8) rounds to 0 and tiny squared
            // gradients underflow, so PyTorch's Adam on fp16 parameters divides by zero.
            let low = is_low_precision(p.kind());
            let (mut p, grad) = if low {
                (p.f_to_kind(Kind::Float).ctx("fp32 update")?, grad.f_to_kind(Kind::Float).ctx("fp32 update")?)
            } else {
                (p.shallow_clone(), grad)
            };
            st.step += 1;
            match self.config {
                OptimizerConfig::Sgd(c) => sgd(&mut p, &grad, st, lr, c)?,
                OptimizerConfig::Adam(c) => {
                    let grad = if c.wd != 0.0 { (&grad + &p * c.wd).shallow_clone() } else { grad };
                    adam(&mut p, &grad, st, lr, c.beta1, c.beta2, c.eps, c.amsgrad)?
                }
                OptimizerConfig::AdamW(c) => {
                    if c.wd != 0.0 {
                        let _ = p.f_mul_scalar_(1.0 - lr * c.wd).ctx("AdamW weight decay")?;
                    }
                    adam(&mut p, &grad, st, lr, c.beta1, c.beta2, c.eps, c.amsgrad)?
                }
                OptimizerConfig::RmsProp(c) => rmsprop(&mut p, &grad, st, lr, c)?,
            }
            if low {
                let mut target = param.shallow_clone();
                target.f_copy_(&p).ctx("rounding an fp32 update")?;
            }
        }
        Ok(())
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

#[allow(clippy::too_many_arguments)]
fn adam(p: &mut Tensor, grad: &Tensor, st: &mut ParamState, lr: f64, beta1: f64, beta2: f64, eps: f64, amsgrad: bool) -> Result<()> {
    let mut exp_avg = st.buffer("exp_avg", p)?;
    let mut exp_avg_sq = st.buffer("exp_avg_sq", p)?;
    let _ = exp_avg.f_lerp_(grad, 1.0 - beta1).ctx("Adam first moment")?;
    let _ = exp_avg_sq.f_mul_scalar_(beta2).ctx("Adam second moment")?;
    let _ = exp_avg_sq.f_add_(&(grad * grad * (1.0 - beta2))).ctx("Adam second moment")?;
    let step = st.step as i32;
    let bias_correction1 = 1.0 - beta1.powi(step);
    let bias_correction2_sqrt = (1.0 - beta2.powi(step)).sqrt();
    let step_size = lr / bias_correction1;
    let second = if amsgrad {
        let mut max_sq = st.buffer("max_exp_avg_sq", p)?;
        let m = max_sq.f_maximum(&exp_avg_sq).ctx("amsgrad")?;
        max_sq.f_copy_(&m).ctx("amsgrad")?;
        max_sq
    } else {
        exp_avg_sq
    };
    let denom = second.f_sqrt().ctx("Adam denominator")? / bias_correction2_sqrt + eps;
    let _ = p.f_sub_(&(exp_avg / denom * step_size)).ctx("Adam update")?;
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
