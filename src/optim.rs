//! The optimizers tch-amp steps: SGD, Adam, AdamW and RMSprop with PyTorch's update rules,
//! configured by tch's own config structs. They are ours, not libtorch's C++ optimizers,
//! because tch gives no access to those optimizers' state (Adam's moments), and a checkpoint
//! that loses it cannot resume bit-exactly. By default they are torch.optim's single-tensor
//! algorithm op for op (bit for bit, tests/optim_bitwise.rs); Adam/AdamW can run libtorch's
//! fused kernel instead (torch's `fused=True`).
use std::collections::BTreeMap;

use tch::{nn, Kind, Tensor};

use std::ffi::c_int;


use crate::dtype::is_low_precision;
use crate::{ffi, optim_sys};

use crate::error::{AmpError, Result, TorchContext};

/// Which optimizer (tch's config structs hold its hyper-parameters; the learning rate is
/// passed separately, as in `tch::nn::OptimizerConfig::build`), plus the torch.optim flags
/// tch's structs lack: `maximize` and `fused`. Made from a tch config with `.into()` or
/// [`OptimizerConfig::from`]; `nn::Adam::default()` and friends are accepted wherever an
/// `impl Into<OptimizerConfig>` is.
///
/// By default every optimizer runs PyTorch's single-tensor algorithm (`foreach=False,
/// fused=False`, what torch.optim runs for CPU tensors): the same libtorch ops in the same
/// order, so a ported script's weights and optimizer state equal its Python run's bit for bit.
/// [`OptimizerConfig::fused`] selects libtorch's fused Adam/AdamW kernel instead (torch's
/// `fused=True`): one kernel per learning rate instead of about ten per parameter (2.5-15x
/// faster optimizer steps on CPU, more the more parameter tensors), equal to torch's
/// `fused=True` bit for bit but not to its default in the last bits.
///
/// ```
/// use tch::nn;
/// use tch_amp::{Algorithm, OptimizerConfig};
/// // torch.optim.Adam(params, lr, betas=(0.9, 0.999), maximize=True, fused=True)
/// let cfg = OptimizerConfig::from(nn::adam(0.9, 0.999, 0.0)).maximize(true).fused(true);
/// assert!(cfg.is_fused() && cfg.is_maximize());
/// assert!(matches!(cfg.algorithm(), Algorithm::Adam(_)));
/// ```
#[derive(Debug, Clone, Copy)]
pub struct OptimizerConfig {
    algorithm: Algorithm,
    maximize: bool,
    fused: bool,
}

/// The optimizer and its hyper-parameters, as tch's config structs.
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
}

impl From<Algorithm> for OptimizerConfig {
    fn from(algorithm: Algorithm) -> Self {
        OptimizerConfig { algorithm, maximize: false, fused: false }
    }
}
impl From<nn::Sgd> for OptimizerConfig {
    fn from(c: nn::Sgd) -> Self {
        Algorithm::Sgd(c).into()
    }
}
impl From<nn::Adam> for OptimizerConfig {
    fn from(c: nn::Adam) -> Self {
        Algorithm::Adam(c).into()
    }
}
impl From<nn::AdamW> for OptimizerConfig {
    fn from(c: nn::AdamW) -> Self {
        Algorithm::AdamW(c).into()
    }
}
impl From<nn::RmsProp> for OptimizerConfig {
    fn from(c: nn::RmsProp) -> Self {
        Algorithm::RmsProp(c).into()
    }
}

impl OptimizerConfig {
    /// torch.optim's `maximize`: step along the gradient instead of against it (every
    /// optimizer; default false).
    pub fn maximize(mut self, on: bool) -> Self {
        self.maximize = on;
        self
    }

    /// torch.optim's `fused=True` for Adam and AdamW: one libtorch `_fused_adam_` /
    /// `_fused_adamw_` call per learning rate instead of the single-tensor algorithm. Its
    /// results differ from the default's in the last bits (it computes the update in another
    /// order), as torch's do. Default false. Building an optimizer with `fused(true)` for SGD
    /// or RMSprop is [`crate::AmpError::InvalidOption`].
    pub fn fused(mut self, on: bool) -> Self {
        self.fused = on;
        self
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

    /// Names of the per-parameter state buffers this optimizer keeps.
    pub(crate) fn buffer_names(&self) -> &'static [&'static str] {
        match self.algorithm {
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
        if config.fused && !matches!(config.algorithm, Algorithm::Adam(_) | Algorithm::AdamW(_)) {
            return Err(AmpError::InvalidOption {
                option: "fused",
                value: format!("{:?}", config.algorithm),
                expected: "Adam or AdamW (tch-amp has no fused kernel for SGD or RMSprop): drop .fused(true)",
            });
        }
        let state = params.iter().map(|_| ParamState::default()).collect();
        Ok(Self { config, lr, group_lr: BTreeMap::new(), params, groups, state })
    }

    /// One update of every parameter that has a gradient (PyTorch skips the others too), in
    /// PyTorch's single-tensor algorithm, or Adam/AdamW's fused kernel when configured.
    pub(crate) fn step(&mut self) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let OptimizerConfig { algorithm, maximize, fused } = self.config;
        // fused: Adam/AdamW parameters are batched per learning rate into one kernel call.
        let mut batches: BTreeMap<u64, FusedBatch> = BTreeMap::new();
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
            let (p, grad) = if low {
                (param.f_to_kind(Kind::Float).ctx("fp32 update")?, grad.f_to_kind(Kind::Float).ctx("fp32 update")?)
            } else {
                (param.shallow_clone(), grad)
            };
            st.step += 1;
            match algorithm {
                Algorithm::Sgd(c) => sgd(&p, &grad, st, lr, c, maximize)?,
                Algorithm::RmsProp(c) => rmsprop(&p, &grad, st, lr, c, maximize)?,
                Algorithm::Adam(c) if !fused => {
                    let h = AdamHyper { beta1: c.beta1, beta2: c.beta2, eps: c.eps, wd: c.wd, amsgrad: c.amsgrad };
                    adam(&p, &grad, st, lr, h, false, maximize)?
                }
                Algorithm::AdamW(c) if !fused => {
                    let h = AdamHyper { beta1: c.beta1, beta2: c.beta2, eps: c.eps, wd: c.wd, amsgrad: c.amsgrad };
                    adam(&p, &grad, st, lr, h, true, maximize)?
                }
                Algorithm::Adam(nn::Adam { amsgrad, .. }) | Algorithm::AdamW(nn::AdamW { amsgrad, .. }) => {
                    let batch = batches.entry(lr.to_bits()).or_default();
                    batch.exp_avgs.push(st.buffer("exp_avg", &p)?);
                    batch.exp_avg_sqs.push(st.buffer("exp_avg_sq", &p)?);
                    if amsgrad {
                        batch.max_exp_avg_sqs.push(st.buffer("max_exp_avg_sq", &p)?);
                    }
                    let step = torch_step_value(st.step);
                    batch.steps.push(Tensor::f_scalar_tensor(step, (Kind::Float, p.device())).ctx("Adam step")?);
                    batch.params.push(p.shallow_clone());
                    batch.grads.push(grad);
                }
            }
            if low {
                write_back.push((param.shallow_clone(), p));
            }
        }
        for (lr_bits, batch) in batches {
            batch.run(algorithm, f64::from_bits(lr_bits), maximize)?;
        }
        for (mut target, p) in write_back {
            target.f_copy_(&p).ctx("rounding an fp32 update")?;
        }
        Ok(())
    }
}

/// The value torch.optim reads from a parameter's `step`: an fp32 tensor incremented by 1 per
/// update, so it counts exactly up to 2^24 and stays there (2^24 + 1 rounds back to 2^24).
fn torch_step_value(count: u64) -> f64 {
    count.min(1 << 24) as f64
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
        let (beta1, beta2, wd, eps, amsgrad, adamw) = match algorithm {
            Algorithm::Adam(c) => (c.beta1, c.beta2, c.wd, c.eps, c.amsgrad, false),
            Algorithm::AdamW(c) => (c.beta1, c.beta2, c.wd, c.eps, c.amsgrad, true),
            _ => return Ok(()),
        };
        let ptrs = |v: &[Tensor]| v.iter().map(crate::grads::ptr).collect::<Vec<_>>();
        let (p, g, m, v, mx, s) = (
            ptrs(&self.params),
            ptrs(&self.grads),
            ptrs(&self.exp_avgs),
            ptrs(&self.exp_avg_sqs),
            ptrs(&self.max_exp_avg_sqs),
            ptrs(&self.steps),
        );
        let n = c_int::try_from(p.len()).map_err(|_| AmpError::Usage("too many parameters for one fused step".into()))?;
        let mx_ptr = if amsgrad { mx.as_ptr() } else { std::ptr::null() };
        // SAFETY: every pointer is a live at::Tensor handle held by `self` for the call; the
        // lists have n entries each (max_exp_avg_sqs only with amsgrad, else NULL).
        ffi::check(
            unsafe {
                ffi::tch_amp_fused_adam_(
                    p.as_ptr(), g.as_ptr(), m.as_ptr(), v.as_ptr(), mx_ptr, s.as_ptr(), n, lr, beta1, beta2, wd, eps,
                    c_int::from(amsgrad), c_int::from(adamw), c_int::from(maximize),
                )
            },
            "fused_adam",
        )
    }
}

pub(crate) fn check_lr(lr: f64) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(())
    } else {
        Err(AmpError::InvalidOption { option: "lr", value: lr.to_string(), expected: "a finite number >= 0" })
    }
}

// The single-tensor updates below follow torch/optim/{sgd,adam,rmsprop}.py of PyTorch 2.13
// (`_single_tensor_*`, capturable=False, differentiable=False) op for op: the same libtorch
// kernels with the same scalars, so every intermediate rounds where torch's does. Python
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
        grad = optim_sys::add(&grad, p, c.wd)?;
    }
    if c.momentum != 0.0 {
        let buf = match st.buffers.get("momentum_buffer") {
            None => {
                let b = grad.f_detach_copy().ctx("SGD momentum buffer")?;
                st.buffers.insert("momentum_buffer", b.shallow_clone());
                b
            }
            Some(b) => {
                let mut b = b.shallow_clone();
                let _ = b.f_mul_scalar_(c.momentum).ctx("SGD momentum")?;
                optim_sys::add_(&b, &grad, 1.0 - c.dampening)?;
                b
            }
        };
        grad = if c.nesterov { optim_sys::add(&grad, &buf, c.momentum)? } else { buf };
    }
    optim_sys::add_(p, &grad, -lr)
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
            let _ = p.shallow_clone().f_mul_scalar_(1.0 - lr * h.wd).ctx("AdamW weight decay")?;
        } else {
            grad = optim_sys::add(&grad, p, h.wd)?;
        }
    }
    let mut exp_avg = st.buffer("exp_avg", p)?;
    let mut exp_avg_sq = st.buffer("exp_avg_sq", p)?;
    let _ = exp_avg.f_lerp_(&grad, 1.0 - h.beta1).ctx("Adam first moment")?;
    let _ = exp_avg_sq.f_mul_scalar_(h.beta2).ctx("Adam second moment")?;
    optim_sys::addcmul_(&exp_avg_sq, &grad, &grad, 1.0 - h.beta2)?;
    // Python floats: `beta ** step` and `x ** 0.5` are libm's pow, which black_box keeps the
    // compiler from turning into sqrt (pow(x, 0.5) is not always correctly rounded).
    let step = torch_step_value(st.step);
    let bias_correction1 = 1.0 - h.beta1.powf(step);
    let bias_correction2 = 1.0 - h.beta2.powf(step);
    let step_size = lr / bias_correction1;
    let bias_correction2_sqrt = bias_correction2.powf(std::hint::black_box(0.5));
    let second = if h.amsgrad {
        let max_exp_avg_sq = st.buffer("max_exp_avg_sq", p)?;
        let _ = max_exp_avg_sq.f_maximum_out(&max_exp_avg_sq, &exp_avg_sq).ctx("amsgrad maximum")?;
        max_exp_avg_sq
    } else {
        exp_avg_sq
    };
    let mut denom = second.f_sqrt().ctx("Adam denominator")?.f_div_scalar(bias_correction2_sqrt).ctx("Adam denominator")?;
    let _ = denom.f_add_scalar_(h.eps).ctx("Adam denominator")?;
    optim_sys::addcdiv_(p, &exp_avg, &denom, -step_size)
}

fn rmsprop(p: &Tensor, grad: &Tensor, st: &mut ParamState, lr: f64, c: nn::RmsProp, maximize: bool) -> Result<()> {
    let mut grad = signed_grad(grad, maximize)?;
    if c.wd != 0.0 {
        grad = optim_sys::add(&grad, p, c.wd)?;
    }
    let mut square_avg = st.buffer("square_avg", p)?;
    let _ = square_avg.f_mul_scalar_(c.alpha).ctx("RMSprop average")?;
    optim_sys::addcmul_(&square_avg, &grad, &grad, 1.0 - c.alpha)?;
    let mut avg = if c.centered {
        let mut grad_avg = st.buffer("grad_avg", p)?;
        let _ = grad_avg.f_lerp_(&grad, 1.0 - c.alpha).ctx("RMSprop centered")?;
        let mut v = optim_sys::addcmul(&square_avg, &grad_avg, &grad_avg, -1.0)?;
        let _ = v.f_sqrt_().ctx("RMSprop centered")?;
        v
    } else {
        square_avg.f_sqrt().ctx("RMSprop")?
    };
    let _ = avg.f_add_scalar_(c.eps).ctx("RMSprop eps")?;
    if c.momentum > 0.0 {
        let mut buf = st.buffer("momentum_buffer", p)?;
        let _ = buf.f_mul_scalar_(c.momentum).ctx("RMSprop momentum")?;
        optim_sys::addcdiv_(&buf, &grad, &avg, 1.0)?;
        optim_sys::add_(p, &buf, -lr)
    } else {
        optim_sys::addcdiv_(p, &grad, &avg, -lr)
    }
}
