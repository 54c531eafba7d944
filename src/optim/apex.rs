//! Apex's optimizers (`apex.optimizers`): [`FusedSgd`], [`FusedAdam`], [`FusedLamb`],
//! [`FusedNovoGrad`] and [`FusedAdagrad`], with Apex's constructor arguments and defaults.
//!
//! Apex runs them as multi-tensor CUDA kernels (`csrc/multi_tensor_*.cu`), which cannot run
//! here. tch-amp runs the algorithm those kernels compute, written as libtorch ops in the
//! kernels' order: every operand loaded into fp32, one fp32 libtorch operation (one rounding)
//! per arithmetic operation of the kernel, host-side constants (bias corrections, `1 - beta`)
//! computed as the kernels' host code computes them (in `float`, `std::pow` in double), and
//! results stored rounded to each tensor's dtype. Those operations are libtorch's CPU kernels,
//! not IEEE-exact ones everywhere: the vectorized square root is not correctly rounded for
//! every input (one ulp off on a small fraction of them). LAMB's global gradient norm is the
//! norm of the per-tensor norms (`torch.linalg.vector_norm` of each gradient, then of the
//! stacked norms), where Apex's `multi_tensor_l2norm` takes one sum of squares over every
//! tensor. The reference implementation in torch ops is
//! scripts/reference/apex_optim_fixtures.py; tests/amp/apex_optimizers.rs checks tch-amp against
//! it bit for bit at every step.
//!
//! Where a GPU run of Apex differs: Apex compiles these kernels with `--use_fast_math`
//! (approximate division and square root, denormals flushed to zero), nvcc contracts
//! `a * b + c` into fused multiply-adds (one rounding instead of two), and Apex's l2-norm kernel
//! sums the squares in blocks in another order, so Apex's own results differ from this algorithm
//! in the last bits of some elements (and where a value is denormal). [`FusedSgd`] runs
//! torch.optim.SGD's single-tensor ops, which Apex documents as its equivalent (its
//! `add(.., alpha)` rounds `a + alpha * b` once), so it equals `torch.optim.SGD` bit for bit,
//! not Apex's kernel.
use crate::error::ConfigError;
use tch::{Kind, Tensor};

use super::rule::{GroupView, HyperParams, ParamState, StateSpec};
use crate::error::{AmpError, Result, TorchContext};
use crate::sys;

/// `apex.optimizers.FusedSGD(params, lr, momentum=0, dampening=0, weight_decay=0,
/// nesterov=False, wd_after_momentum=False)`: SGD with momentum, as torch.optim.SGD computes
/// it (Apex documents FusedSGD as a drop-in replacement for it), plus Apex's
/// `wd_after_momentum` (weight decay added to the update after the momentum instead of to the
/// gradient before it). The learning rate is passed beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedSgd {
    /// Momentum factor (0: none).
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the momentum.
    pub dampening: f64,
    /// L2 weight decay.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0).
    pub nesterov: bool,
    /// Add the weight decay after the momentum (optimizer-wide in Apex).
    pub wd_after_momentum: bool,
}

impl Default for FusedSgd {
    fn default() -> Self {
        Self { momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false, wd_after_momentum: false }
    }
}

/// `apex.optimizers.FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
/// eps=1e-8, adam_w_mode=True, weight_decay=0., amsgrad=False)`. With `adam_w_mode` (Apex's
/// default) the weight decay is decoupled (AdamW); without, it is added to the gradient
/// (Adam's L2). The moments are fp32 whatever the parameters' dtype. `amsgrad=true` is refused
/// as Apex refuses it. The learning rate is passed beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedAdam {
    /// Coefficient of the first moment's running average.
    pub beta1: f64,
    /// Coefficient of the second moment's running average.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay (decoupled with `adam_w_mode`, L2 without).
    pub weight_decay: f64,
    /// Decoupled weight decay (optimizer-wide in Apex).
    pub adam_w_mode: bool,
    /// Divide the moments by `1 - beta^step`.
    pub bias_correction: bool,
    /// Not supported (Apex raises "FusedAdam does not support the AMSGrad variant.").
    pub amsgrad: bool,
}

impl Default for FusedAdam {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            adam_w_mode: true,
            bias_correction: true,
            amsgrad: false,
        }
    }
}

/// `apex.optimizers.FusedLAMB(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
/// eps=1e-6, weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
/// max_grad_norm=1.0, use_nvlamb=False)`: LAMB (You et al., the BERT-in-76-minutes optimizer).
///
/// Each step: the global gradient norm over every parameter of every group; gradients divided
/// by `norm / max_grad_norm` when the norm exceeds `max_grad_norm`; per parameter Adam's
/// update (`m / (1 - beta1^t)` over `sqrt(v / (1 - beta2^t)) + eps`, the weight decay added to
/// it with `adam_w_mode`, to the gradient without); then the update scaled by the trust ratio
/// `||w|| / ||update||` (when both are non-zero) for parameters with weight decay, or for all
/// with `use_nvlamb`. `grad_averaging` weights the gradient by `1 - beta1` in the first moment.
/// `adam_w_mode`, `max_grad_norm` and `use_nvlamb` are optimizer-wide, as in Apex (a group
/// cannot override them). The learning rate is passed beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedLamb {
    /// Coefficient of the first moment's running average.
    pub beta1: f64,
    /// Coefficient of the second moment's running average.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay (set 0.0 for biases and LayerNorm in a group: the `no_decay` pattern).
    pub weight_decay: f64,
    /// Divide the moments by `1 - beta^step`.
    pub bias_correction: bool,
    /// Decoupled weight decay (optimizer-wide).
    pub adam_w_mode: bool,
    /// Weight the gradient by `1 - beta1` in the first moment.
    pub grad_averaging: bool,
    /// Global gradient-norm clipping threshold (optimizer-wide; must be > 0).
    pub max_grad_norm: f64,
    /// Apply the trust ratio to parameters without weight decay too (optimizer-wide).
    pub use_nvlamb: bool,
    /// Not supported (Apex raises "FusedLAMB does not support the AMSGrad variant.").
    pub amsgrad: bool,
}

impl Default for FusedLamb {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.01,
            bias_correction: true,
            adam_w_mode: true,
            grad_averaging: true,
            max_grad_norm: 1.0,
            use_nvlamb: false,
            amsgrad: false,
        }
    }
}

/// Which per-tensor norm [`FusedNovoGrad`] keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NovoGradNorm {
    /// The l2 norm (Apex's `norm_type=2`), blended as `sqrt(beta2 * v^2 + (1 - beta2) * n^2)`.
    L2,
    /// The max norm (Apex's `norm_type=0`), blended as `beta2 * v + (1 - beta2) * n`.
    Inf,
}

/// `apex.optimizers.FusedNovoGrad(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
/// eps=1e-8, weight_decay=0., amsgrad=False, reg_inside_moment=False, grad_averaging=True,
/// norm_type=2, init_zero=False)`: NovoGrad (Jasper), whose second moment is one number per
/// parameter tensor: the running average of the gradient's norm (stored as the norm, not its
/// square; the state `exp_avg_sq`, a 0-dim fp32 tensor per parameter where Apex keeps one
/// vector per group). `init_zero=false` starts it at the first gradient's norm. With
/// `reg_inside_moment` the gradient is normalized and decayed before entering the first moment
/// (the paper's form); without, the weight decay is added to the update (optimizer-wide in
/// Apex). The learning rate is passed beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedNovoGrad {
    /// Coefficient of the first moment's running average.
    pub beta1: f64,
    /// Coefficient of the norm's running average.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// Divide the moments by `1 - beta1^step` and `sqrt(1 - beta2^step)`.
    pub bias_correction: bool,
    /// Normalize and decay the gradient inside the first moment (optimizer-wide).
    pub reg_inside_moment: bool,
    /// Weight the gradient by `1 - beta1` in the first moment.
    pub grad_averaging: bool,
    /// The per-tensor norm.
    pub norm_type: NovoGradNorm,
    /// Start the norm's average at 0 instead of the first gradient's norm.
    pub init_zero: bool,
    /// Not supported (Apex raises "FusedNovoGrad does not support the AMSGrad variant.").
    pub amsgrad: bool,
}

impl Default for FusedNovoGrad {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            bias_correction: true,
            reg_inside_moment: false,
            grad_averaging: true,
            norm_type: NovoGradNorm::L2,
            init_zero: false,
            amsgrad: false,
        }
    }
}

/// `apex.optimizers.FusedAdagrad(params, lr=1e-2, eps=1e-10, weight_decay=0.,
/// adagrad_w_mode=False)`: Adagrad (the sum of squared gradients in the state `sum`), with the
/// weight decay added to the gradient, or to the update with `adagrad_w_mode`
/// (optimizer-wide). The learning rate is passed beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedAdagrad {
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// Decoupled weight decay (optimizer-wide).
    pub adagrad_w_mode: bool,
}

impl Default for FusedAdagrad {
    fn default() -> Self {
        Self { eps: 1e-10, weight_decay: 0.0, adagrad_w_mode: false }
    }
}

fn flag(b: bool) -> f64 {
    if b {
        1.0
    } else {
        0.0
    }
}

impl FusedSgd {
    pub(crate) fn hyper(&self) -> HyperParams {
        HyperParams::new()
            .with("momentum", self.momentum)
            .with("dampening", self.dampening)
            .with("weight_decay", self.weight_decay)
            .with("nesterov", flag(self.nesterov))
            .with("wd_after_momentum", flag(self.wd_after_momentum))
    }
    pub(crate) fn from_hyper(h: &HyperParams) -> Result<Self> {
        Ok(Self {
            momentum: h.get("momentum")?,
            dampening: h.get("dampening")?,
            weight_decay: h.get("weight_decay")?,
            nesterov: h.flag("nesterov")?,
            wd_after_momentum: h.flag("wd_after_momentum")?,
        })
    }
    pub(crate) const GLOBAL: &'static [&'static str] = &["wd_after_momentum"];
}

impl FusedAdam {
    pub(crate) fn hyper(&self) -> HyperParams {
        HyperParams::new()
            .with("beta1", self.beta1)
            .with("beta2", self.beta2)
            .with("eps", self.eps)
            .with("weight_decay", self.weight_decay)
            .with("adam_w_mode", flag(self.adam_w_mode))
            .with("bias_correction", flag(self.bias_correction))
    }
    pub(crate) fn from_hyper(h: &HyperParams) -> Result<Self> {
        Ok(Self {
            beta1: h.get("beta1")?,
            beta2: h.get("beta2")?,
            eps: h.get("eps")?,
            weight_decay: h.get("weight_decay")?,
            adam_w_mode: h.flag("adam_w_mode")?,
            bias_correction: h.flag("bias_correction")?,
            amsgrad: false,
        })
    }
    pub(crate) const GLOBAL: &'static [&'static str] = &["adam_w_mode"];
}

impl FusedLamb {
    pub(crate) fn hyper(&self) -> HyperParams {
        HyperParams::new()
            .with("beta1", self.beta1)
            .with("beta2", self.beta2)
            .with("eps", self.eps)
            .with("weight_decay", self.weight_decay)
            .with("bias_correction", flag(self.bias_correction))
            .with("adam_w_mode", flag(self.adam_w_mode))
            .with("grad_averaging", flag(self.grad_averaging))
            .with("max_grad_norm", self.max_grad_norm)
            .with("use_nvlamb", flag(self.use_nvlamb))
    }
    pub(crate) fn from_hyper(h: &HyperParams) -> Result<Self> {
        Ok(Self {
            beta1: h.get("beta1")?,
            beta2: h.get("beta2")?,
            eps: h.get("eps")?,
            weight_decay: h.get("weight_decay")?,
            bias_correction: h.flag("bias_correction")?,
            adam_w_mode: h.flag("adam_w_mode")?,
            grad_averaging: h.flag("grad_averaging")?,
            max_grad_norm: h.get("max_grad_norm")?,
            use_nvlamb: h.flag("use_nvlamb")?,
            amsgrad: false,
        })
    }
    pub(crate) const GLOBAL: &'static [&'static str] = &["adam_w_mode", "max_grad_norm", "use_nvlamb"];
}

impl FusedNovoGrad {
    pub(crate) fn hyper(&self) -> HyperParams {
        HyperParams::new()
            .with("beta1", self.beta1)
            .with("beta2", self.beta2)
            .with("eps", self.eps)
            .with("weight_decay", self.weight_decay)
            .with("bias_correction", flag(self.bias_correction))
            .with("reg_inside_moment", flag(self.reg_inside_moment))
            .with("grad_averaging", flag(self.grad_averaging))
            .with("norm_type", if self.norm_type == NovoGradNorm::L2 { 2.0 } else { 0.0 })
            .with("init_zero", flag(self.init_zero))
    }
    pub(crate) fn from_hyper(h: &HyperParams) -> Result<Self> {
        let norm = h.get("norm_type")?;
        Ok(Self {
            beta1: h.get("beta1")?,
            beta2: h.get("beta2")?,
            eps: h.get("eps")?,
            weight_decay: h.get("weight_decay")?,
            bias_correction: h.flag("bias_correction")?,
            reg_inside_moment: h.flag("reg_inside_moment")?,
            grad_averaging: h.flag("grad_averaging")?,
            norm_type: if norm == 2.0 {
                NovoGradNorm::L2
            } else if norm == 0.0 {
                NovoGradNorm::Inf
            } else {
                return Err(AmpError::Config(ConfigError::InvalidOption {
                    option: "norm_type",
                    value: norm.to_string(),
                    expected: "2 (l2) or 0 (max norm) (Apex: \"FusedNovoGrad only support l2/inf norm now.\")",
                }));
            },
            init_zero: h.flag("init_zero")?,
            amsgrad: false,
        })
    }
    pub(crate) const GLOBAL: &'static [&'static str] = &["reg_inside_moment"];
}

impl FusedAdagrad {
    pub(crate) fn hyper(&self) -> HyperParams {
        HyperParams::new()
            .with("eps", self.eps)
            .with("weight_decay", self.weight_decay)
            .with("adagrad_w_mode", flag(self.adagrad_w_mode))
    }
    pub(crate) fn from_hyper(h: &HyperParams) -> Result<Self> {
        Ok(Self { eps: h.get("eps")?, weight_decay: h.get("weight_decay")?, adagrad_w_mode: h.flag("adagrad_w_mode")? })
    }
    pub(crate) const GLOBAL: &'static [&'static str] = &["adagrad_w_mode"];
}

fn check(ok: bool, option: &'static str, value: f64, expected: &'static str) -> Result<()> {
    if ok && value.is_finite() {
        Ok(())
    } else {
        Err(AmpError::Config(ConfigError::InvalidOption { option, value: value.to_string(), expected }))
    }
}

fn non_negative(option: &'static str, v: f64) -> Result<()> {
    check(v >= 0.0, option, v, "a finite number >= 0")
}

fn beta(option: &'static str, v: f64) -> Result<()> {
    check((0.0..1.0).contains(&v), option, v, "a number in [0, 1)")
}

fn no_amsgrad(amsgrad: bool, what: &'static str) -> Result<()> {
    if amsgrad {
        return Err(AmpError::Config(ConfigError::InvalidOption {
            option: "amsgrad",
            value: "true".into(),
            expected: match what {
                "FusedAdam" => {
                    "false: FusedAdam does not support the AMSGrad variant (Apex raises RuntimeError); use \
                     nn::Adam { amsgrad: true, .. } (torch.optim.Adam) instead"
                }
                "FusedLAMB" => "false: FusedLAMB does not support the AMSGrad variant (Apex raises RuntimeError)",
                _ => "false: FusedNovoGrad does not support the AMSGrad variant (Apex raises RuntimeError)",
            },
        }));
    }
    Ok(())
}

/// Checks a configuration as Apex's constructors do (FusedSGD's `ValueError`s, the AMSGrad
/// refusals, NovoGrad's norm types), and more strictly: every value finite, betas in [0, 1),
/// eps and weight decay >= 0, LAMB's `max_grad_norm` > 0.
pub(crate) fn validate_sgd(c: &FusedSgd) -> Result<()> {
    non_negative("momentum", c.momentum)?;
    check(c.dampening.is_finite(), "dampening", c.dampening, "a finite number")?;
    non_negative("weight_decay", c.weight_decay)?;
    if c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0) {
        return Err(AmpError::Config(ConfigError::InvalidOption {
            option: "nesterov",
            value: format!("true with momentum {} and dampening {}", c.momentum, c.dampening),
            expected: "momentum > 0 and dampening 0 (Apex: \"Nesterov momentum requires a momentum and zero \
                       dampening\")",
        }));
    }
    Ok(())
}

pub(crate) fn validate_adam(c: &FusedAdam) -> Result<()> {
    no_amsgrad(c.amsgrad, "FusedAdam")?;
    beta("beta1", c.beta1)?;
    beta("beta2", c.beta2)?;
    non_negative("eps", c.eps)?;
    non_negative("weight_decay", c.weight_decay)
}

pub(crate) fn validate_lamb(c: &FusedLamb) -> Result<()> {
    no_amsgrad(c.amsgrad, "FusedLAMB")?;
    beta("beta1", c.beta1)?;
    beta("beta2", c.beta2)?;
    non_negative("eps", c.eps)?;
    non_negative("weight_decay", c.weight_decay)?;
    check(
        c.max_grad_norm > 0.0,
        "max_grad_norm",
        c.max_grad_norm,
        "a finite number > 0 (gradients are divided by norm / max_grad_norm)",
    )
}

pub(crate) fn validate_novograd(c: &FusedNovoGrad) -> Result<()> {
    no_amsgrad(c.amsgrad, "FusedNovoGrad")?;
    beta("beta1", c.beta1)?;
    beta("beta2", c.beta2)?;
    non_negative("eps", c.eps)?;
    non_negative("weight_decay", c.weight_decay)
}

pub(crate) fn validate_adagrad(c: &FusedAdagrad) -> Result<()> {
    non_negative("eps", c.eps)?;
    non_negative("weight_decay", c.weight_decay)
}

/// `value` rounded to fp32, as a C `float` holds it.
fn f32r(value: f64) -> f64 {
    value as f32 as f64
}

/// `1 - beta` in fp32 arithmetic from the fp32 `beta` (the kernels' `1 - beta1`).
fn one_minus(beta: f64) -> f64 {
    (1.0f32 - beta as f32) as f64
}

/// The host code's `float bc = 1 - std::pow(beta, step)`: `beta` a float promoted to double,
/// the power and the difference in double, the result stored as a float. (`powf` is libm's
/// `pow`, which C++'s `std::pow(float, int)` calls after promoting both to double.)
fn bias_correction(beta: f64, step: u64) -> f64 {
    f32r(1.0 - f32r(beta).powf(step as f64))
}

/// fp32 working copy of `t` (the tensor itself when already fp32: updates then land in place).
fn up(t: &Tensor) -> Result<Tensor> {
    t.f_to_kind(Kind::Float).ctx("fp32 working copy")
}

/// Stores `value` (fp32) into `target`, rounded to `target`'s dtype.
fn store(target: &Tensor, value: &Tensor) -> Result<()> {
    let mut t = target.shallow_clone();
    t.f_copy_(value).ctx("storing an optimizer result")
}

fn state_like(st: &mut ParamState, name: &str, like: &Tensor, kind: Kind) -> Result<Tensor> {
    if let Some(t) = st.buffer(name) {
        return Ok(t.shallow_clone());
    }
    let t = like.f_zeros_like().and_then(|t| t.f_to_kind(kind)).ctx("allocating optimizer state")?;
    st.set_buffer(name, t.shallow_clone());
    Ok(t)
}

fn mul(t: &Tensor, s: f64) -> Result<Tensor> {
    t.f_mul_scalar(s).ctx("Apex optimizer")
}
fn div(t: &Tensor, s: f64) -> Result<Tensor> {
    t.f_div_scalar(s).ctx("Apex optimizer")
}
fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.f_add(b).ctx("Apex optimizer")
}
fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.f_sub(b).ctx("Apex optimizer")
}
fn tmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.f_mul(b).ctx("Apex optimizer")
}
fn tdiv(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.f_div(b).ctx("Apex optimizer")
}

/// FusedSGD's step: torch.optim.SGD's single-tensor ops, with the weight decay before or after
/// the momentum.
pub(crate) fn sgd_step(groups: &mut [GroupView<'_>], wd_after_momentum: bool) -> Result<()> {
    for g in groups.iter_mut() {
        let c = FusedSgd::from_hyper(g.hyper())?;
        let lr = g.lr();
        for view in g.params_mut() {
            let (p, grad, st) = view.parts();
            let mut grad = grad.shallow_clone();
            if c.weight_decay != 0.0 && !wd_after_momentum {
                grad = sys::add(&grad, p, c.weight_decay)?;
            }
            if c.momentum != 0.0 {
                grad = super::sgd::sgd_momentum(&grad, st, c.momentum, c.dampening, c.nesterov)?;
            }
            if c.weight_decay != 0.0 && wd_after_momentum {
                grad = sys::add(&grad, p, c.weight_decay)?;
            }
            sys::add_(p, &grad, -lr)?;
        }
    }
    Ok(())
}

pub(crate) fn sgd_state(h: &HyperParams) -> Vec<StateSpec> {
    if h.get("momentum").unwrap_or(0.0) != 0.0 {
        vec![StateSpec::like_param("momentum_buffer")]
    } else {
        Vec::new()
    }
}

/// FusedAdam's step (`multi_tensor_adam`, AdamFunctor).
pub(crate) fn adam_step(groups: &mut [GroupView<'_>], adam_w_mode: bool) -> Result<()> {
    for g in groups.iter_mut() {
        let c = FusedAdam::from_hyper(g.hyper())?;
        let (lr, step) = (g.lr(), g.step());
        let (bc1, bc2) = if c.bias_correction {
            (bias_correction(c.beta1, step), bias_correction(c.beta2, step))
        } else {
            (1.0, 1.0)
        };
        let (omb1, omb2) = (one_minus(c.beta1), one_minus(c.beta2));
        for view in g.params_mut() {
            let (p, grad, st) = view.parts();
            let p32 = up(p)?;
            let mut g32 = up(grad)?;
            let m = state_like(st, "exp_avg", p, Kind::Float)?;
            let v = state_like(st, "exp_avg_sq", p, Kind::Float)?;
            if !adam_w_mode {
                g32 = add(&g32, &mul(&p32, c.weight_decay)?)?;
            }
            let m_new = add(&mul(&m, c.beta1)?, &mul(&g32, omb1)?)?;
            let v_new = add(&mul(&v, c.beta2)?, &tmul(&mul(&g32, omb2)?, &g32)?)?;
            let m_hat = div(&m_new, bc1)?;
            let v_hat = div(&v_new, bc2)?;
            let denom = v_hat.f_sqrt().and_then(|d| d.f_add_scalar(c.eps)).ctx("Adam denominator")?;
            let mut update = tdiv(&m_hat, &denom)?;
            if adam_w_mode {
                update = add(&update, &mul(&p32, c.weight_decay)?)?;
            }
            let p_new = sub(&p32, &mul(&update, lr)?)?;
            store(&m, &m_new)?;
            store(&v, &v_new)?;
            store(p, &p_new)?;
        }
    }
    Ok(())
}

pub(crate) fn adam_state() -> Vec<StateSpec> {
    vec![StateSpec::like_param("exp_avg").fp32(), StateSpec::like_param("exp_avg_sq").fp32()]
}

/// FusedLAMB's step (`multi_tensor_l2norm` for the global gradient norm, `multi_tensor_lamb`:
/// LAMBStage1Functor, per-tensor norms, LAMBStage2Functor).
pub(crate) fn lamb_step(groups: &mut [GroupView<'_>], global: &FusedLamb) -> Result<()> {
    let grads: Vec<Tensor> = groups.iter().flat_map(|g| g.params().iter().map(|p| p.grad().shallow_clone())).collect();
    if grads.is_empty() {
        return Ok(());
    }
    // Given when this call sees only some of the parameters (a sharded optimizer, or one
    // parameter at a time): the same norm of the same per-tensor norms in the same order.
    let global_norm = match groups.first().and_then(|g| g.global_grad_norm.as_ref()) {
        Some(n) => n.shallow_clone(),
        None => sys::total_norm(&grads, 2.0)?,
    };
    // clipped_global_grad_norm = norm > max ? norm / max : 1
    let over = global_norm.f_gt(global.max_grad_norm).ctx("LAMB clipping")?;
    let clip = div(&global_norm, global.max_grad_norm)?
        .f_where_self(&over, &global_norm.f_ones_like().ctx("LAMB clipping")?)
        .ctx("LAMB clipping")?;
    for g in groups.iter_mut() {
        let c = FusedLamb::from_hyper(g.hyper())?;
        let (lr, step) = (g.lr(), g.step());
        let (bc1, bc2) = if c.bias_correction {
            (bias_correction(c.beta1, step), bias_correction(c.beta2, step))
        } else {
            (1.0, 1.0)
        };
        let beta3 = if c.grad_averaging { one_minus(c.beta1) } else { 1.0 };
        let omb2 = one_minus(c.beta2);
        let decay = c.weight_decay;
        for view in g.params_mut() {
            let (p, grad, st) = view.parts();
            let param_norm = sys::vector_norm(p, 2.0)?;
            let p32 = up(p)?;
            let m = state_like(st, "exp_avg", p, p.kind())?;
            let v = state_like(st, "exp_avg_sq", p, p.kind())?;
            let (m32, v32) = (up(&m)?, up(&v)?);
            // Stage 1 (the kernel reads p as 0 when decay == 0).
            let mut scaled = tdiv(&up(grad)?, &clip)?;
            if !global.adam_w_mode {
                scaled = add(&scaled, &mul(&p32, decay)?)?;
            }
            let m_new = add(&mul(&m32, c.beta1)?, &mul(&scaled, beta3)?)?;
            let v_new = add(&mul(&v32, c.beta2)?, &tmul(&mul(&scaled, omb2)?, &scaled)?)?;
            let m_hat = div(&m_new, bc1)?;
            let v_hat = div(&v_new, bc2)?;
            let denom = v_hat.f_sqrt().and_then(|d| d.f_add_scalar(c.eps)).ctx("LAMB denominator")?;
            let mut update = tdiv(&m_hat, &denom)?;
            if global.adam_w_mode {
                update = add(&update, &mul(&p32, decay)?)?;
            }
            // The kernel stores the update in the gradient's buffer, of the parameter's dtype.
            if grad.kind() != Kind::Float {
                update = update.f_to_kind(grad.kind()).and_then(|u| u.f_to_kind(Kind::Float)).ctx("LAMB update")?;
            }
            store(&m, &m_new)?;
            store(&v, &v_new)?;
            // Stage 2: the trust ratio.
            let update_norm = sys::vector_norm(&update, 2.0)?;
            let ratio = if global.use_nvlamb || decay != 0.0 {
                let both = update_norm
                    .f_ne(0.0)
                    .and_then(|a| a.f_logical_and(&param_norm.f_ne(0.0)?))
                    .ctx("LAMB trust ratio")?;
                let lr_t = param_norm.f_full_like(lr).ctx("LAMB trust ratio")?;
                mul(&tdiv(&param_norm, &update_norm)?, lr)?.f_where_self(&both, &lr_t).ctx("LAMB trust ratio")?
            } else {
                param_norm.f_full_like(lr).ctx("LAMB trust ratio")?
            };
            let p_new = sub(&p32, &tmul(&update, &ratio)?)?;
            store(p, &p_new)?;
        }
    }
    Ok(())
}

pub(crate) fn lamb_state() -> Vec<StateSpec> {
    vec![StateSpec::like_param("exp_avg"), StateSpec::like_param("exp_avg_sq")]
}

/// FusedNovoGrad's step (`multi_tensor_norm_out` blending the per-tensor norms,
/// NovoGradFunctor).
pub(crate) fn novograd_step(groups: &mut [GroupView<'_>], reg_inside_moment: bool) -> Result<()> {
    for g in groups.iter_mut() {
        let c = FusedNovoGrad::from_hyper(g.hyper())?;
        let (lr, step) = (g.lr(), g.step());
        let (bc1, bc2) = if c.bias_correction {
            (bias_correction(c.beta1, step), f32r((1.0 - f32r(c.beta2).powf(step as f64)).sqrt()))
        } else {
            (1.0, 1.0)
        };
        let beta3 = if c.grad_averaging { one_minus(c.beta1) } else { 1.0 };
        let omb2 = one_minus(c.beta2);
        for view in g.params_mut() {
            let (p, grad, st) = view.parts();
            let p32 = up(p)?;
            let g32 = up(grad)?;
            let m = state_like(st, "exp_avg", p, p.kind())?;
            let m32 = up(&m)?;
            let new_norm = match c.norm_type {
                NovoGradNorm::L2 => g32.f_pow_tensor_scalar(2).and_then(|s| s.f_sum(Kind::Float)),
                NovoGradNorm::Inf => g32.f_abs().and_then(|a| a.f_max()),
            }
            .ctx("NovoGrad gradient norm")?;
            let v = match st.buffer("exp_avg_sq") {
                Some(v) => v.shallow_clone(),
                None => {
                    // Apex: zeros with init_zero, else the first gradient's norm, so that the
                    // first blend leaves it (about) unchanged.
                    let v0 = if c.init_zero {
                        new_norm.f_zeros_like().ctx("NovoGrad state")?
                    } else if c.norm_type == NovoGradNorm::L2 {
                        new_norm.f_sqrt().ctx("NovoGrad state")?
                    } else {
                        new_norm.copy()
                    };
                    st.set_buffer("exp_avg_sq", v0.shallow_clone());
                    v0
                }
            };
            // gn = sqrt(a * gn * gn + b * n^2) (l2) or a * gn + b * n (max).
            let v_new = match c.norm_type {
                NovoGradNorm::L2 => {
                    add(&tmul(&mul(&v, c.beta2)?, &v)?, &mul(&new_norm, omb2)?)?.f_sqrt().ctx("NovoGrad norm")?
                }
                NovoGradNorm::Inf => add(&mul(&v, c.beta2)?, &mul(&new_norm, omb2)?)?,
            };
            let denom = div(&v_new, bc2)?.f_add_scalar(c.eps).ctx("NovoGrad denominator")?;
            let (m_new, p_new) = if reg_inside_moment {
                let g2 = add(&tdiv(&g32, &denom)?, &mul(&p32, c.weight_decay)?)?;
                let m_new = add(&mul(&m32, c.beta1)?, &mul(&g2, beta3)?)?;
                let m_hat = div(&m_new, bc1)?;
                let p_new = sub(&p32, &mul(&m_hat, lr)?)?;
                (m_new, p_new)
            } else {
                let m_new = add(&mul(&m32, c.beta1)?, &mul(&g32, beta3)?)?;
                let m_hat = div(&m_new, bc1)?;
                let update = add(&tdiv(&m_hat, &denom)?, &mul(&p32, c.weight_decay)?)?;
                let p_new = sub(&p32, &mul(&update, lr)?)?;
                (m_new, p_new)
            };
            store(&v, &v_new)?;
            store(&m, &m_new)?;
            store(p, &p_new)?;
        }
    }
    Ok(())
}

pub(crate) fn novograd_state() -> Vec<StateSpec> {
    vec![StateSpec::like_param("exp_avg"), StateSpec::scalar("exp_avg_sq")]
}

/// FusedAdagrad's step (AdagradFunctor).
pub(crate) fn adagrad_step(groups: &mut [GroupView<'_>], w_mode: bool) -> Result<()> {
    for g in groups.iter_mut() {
        let c = FusedAdagrad::from_hyper(g.hyper())?;
        let lr = g.lr();
        for view in g.params_mut() {
            let (p, grad, st) = view.parts();
            let p32 = up(p)?;
            let mut g32 = up(grad)?;
            let h = state_like(st, "sum", p, p.kind())?;
            let h32 = up(&h)?;
            if !w_mode {
                g32 = add(&g32, &mul(&p32, c.weight_decay)?)?;
            }
            let h_new = add(&h32, &tmul(&g32, &g32)?)?;
            let denom = h_new.f_sqrt().and_then(|d| d.f_add_scalar(c.eps)).ctx("Adagrad denominator")?;
            let mut update = tdiv(&g32, &denom)?;
            if w_mode {
                update = add(&update, &mul(&p32, c.weight_decay)?)?;
            }
            let p_new = sub(&p32, &mul(&update, lr)?)?;
            store(&h, &h_new)?;
            store(p, &p_new)?;
        }
    }
    Ok(())
}

pub(crate) fn adagrad_state() -> Vec<StateSpec> {
    vec![StateSpec::like_param("sum")]
}
