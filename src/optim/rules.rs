//! The update rules tch-amp steps with: SGD, Adam, AdamW and RMSprop, configured by tch's own
//! config structs, computed on tch tensors (tch's libtorch optimizers give no access to their
//! state, and a checkpoint that loses Adam's moments cannot resume bit-exactly). By default
//! they are torch.optim's single-tensor algorithm op for op (bit for bit,
//! tests/amp/optim_bitwise.rs); Adam/AdamW can run libtorch's fused kernel instead (torch's
//! `fused=True`).
use std::collections::BTreeMap;

use tch::{nn, Kind, Tensor};

use crate::dtype::is_low_precision;
use crate::error::{AmpError, Result, TorchContext};
use crate::sys;

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

    /// The optimizer's kind as records name it: `"sgd"`, `"adam"`, `"adamw"` or `"rmsprop"`.
    pub fn name(&self) -> &'static str {
        match self.algorithm {
            Algorithm::Sgd(_) => "sgd",
            Algorithm::Adam(_) => "adam",
            Algorithm::AdamW(_) => "adamw",
            Algorithm::RmsProp(_) => "rmsprop",
        }
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

impl OptimizerConfig {
    /// The hyper-parameters besides the learning rate, by torch.optim's names (`momentum`,
    /// `dampening`, `weight_decay`, `nesterov`, `beta1`, `beta2`, `eps`, `amsgrad`, `alpha`,
    /// `centered`, `maximize`; flags as 0 or 1). Checkpoints record them, and a checkpoint made with other
    /// values does not load.
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
        };
        pairs.into_iter().chain([("maximize", flag(self.maximize))]).collect()
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
        match self.algorithm {
            Algorithm::Sgd(c) => {
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
        }
        Ok(())
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
    /// fp16/bf16 parameters are updated in fp32 with fp32 state (else in their own dtype, as
    /// torch.optim and Apex's O3 do).
    fp32_state: bool,
}

impl Optimizer {
    pub(crate) fn new(
        config: OptimizerConfig,
        lr: f64,
        params: Vec<Tensor>,
        groups: Vec<usize>,
        fp32_state: bool,
    ) -> Result<Self> {
        check_lr(lr)?;
        if config.fused && !matches!(config.algorithm, Algorithm::Adam(_) | Algorithm::AdamW(_)) {
            return Err(AmpError::InvalidOption {
                option: "fused",
                value: format!("{:?}", config.algorithm),
                expected: "Adam or AdamW (tch-amp has no fused kernel for SGD or RMSprop): drop .fused(true)",
            });
        }
        let state = params.iter().map(|_| ParamState::default()).collect();
        Ok(Self { config, lr, group_lr: BTreeMap::new(), params, groups, state, fp32_state })
    }

    pub(crate) fn config(&self) -> OptimizerConfig {
        self.config
    }

    /// The dtype of the optimizer state of a parameter of `param_kind`: its own, or fp32 for
    /// fp16/bf16 parameters when the state is kept in fp32.
    pub(crate) fn state_kind(&self, param_kind: Kind) -> Kind {
        if self.fp32_state && is_low_precision(param_kind) {
            Kind::Float
        } else {
            param_kind
        }
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
            // fp16/bf16 parameters without masters (O3) run in their own dtype as in torch.optim
            // and Apex, or, with fp32_optimizer_state, in fp32 with fp32 state, rounded once: in
            // fp16, Adam's eps (1e-8) rounds to 0 and tiny squared gradients underflow, so the
            // fp16 update divides by zero.
            let low = self.fp32_state && is_low_precision(param.kind());
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
        let args = sys::FusedAdamArgs {
            params: &self.params,
            grads: &self.grads,
            exp_avgs: &self.exp_avgs,
            exp_avg_sqs: &self.exp_avg_sqs,
            max_exp_avg_sqs: &self.max_exp_avg_sqs,
            steps: &self.steps,
        };
        sys::fused_adam_(&args, lr, (beta1, beta2), wd, eps, amsgrad, adamw, maximize)
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
        let buf = match st.buffers.get("momentum_buffer") {
            None => {
                let b = grad.f_detach_copy().ctx("SGD momentum buffer")?;
                st.buffers.insert("momentum_buffer", b.shallow_clone());
                b
            }
            Some(b) => {
                let b = b.shallow_clone();
                sys::mul_float_(&b, c.momentum)?;
                sys::add_(&b, &grad, 1.0 - c.dampening)?;
                b
            }
        };
        grad = if c.nesterov { sys::add(&grad, &buf, c.momentum)? } else { buf };
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
    let mut exp_avg = st.buffer("exp_avg", p)?;
    let exp_avg_sq = st.buffer("exp_avg_sq", p)?;
    let _ = exp_avg.f_lerp_(&grad, 1.0 - h.beta1).ctx("Adam first moment")?;
    sys::mul_float_(&exp_avg_sq, h.beta2)?;
    sys::addcmul_(&exp_avg_sq, &grad, &grad, 1.0 - h.beta2)?;
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
    let denom = sys::div_float(&second.f_sqrt().ctx("Adam denominator")?, bias_correction2_sqrt)?;
    sys::add_float_(&denom, h.eps)?;
    sys::addcdiv_(p, &exp_avg, &denom, -step_size)
}

fn rmsprop(p: &Tensor, grad: &Tensor, st: &mut ParamState, lr: f64, c: nn::RmsProp, maximize: bool) -> Result<()> {
    let mut grad = signed_grad(grad, maximize)?;
    if c.wd != 0.0 {
        grad = sys::add(&grad, p, c.wd)?;
    }
    let square_avg = st.buffer("square_avg", p)?;
    sys::mul_float_(&square_avg, c.alpha)?;
    sys::addcmul_(&square_avg, &grad, &grad, 1.0 - c.alpha)?;
    let avg = if c.centered {
        let mut grad_avg = st.buffer("grad_avg", p)?;
        let _ = grad_avg.f_lerp_(&grad, 1.0 - c.alpha).ctx("RMSprop centered")?;
        let mut v = sys::addcmul(&square_avg, &grad_avg, &grad_avg, -1.0)?;
        let _ = v.f_sqrt_().ctx("RMSprop centered")?;
        v
    } else {
        square_avg.f_sqrt().ctx("RMSprop")?
    };
    sys::add_float_(&avg, c.eps)?;
    if c.momentum > 0.0 {
        let buf = st.buffer("momentum_buffer", p)?;
        sys::mul_float_(&buf, c.momentum)?;
        sys::addcdiv_(&buf, &grad, &avg, 1.0)?;
        sys::add_(p, &buf, -lr)
    } else {
        sys::addcdiv_(p, &grad, &avg, -lr)
    }
}

// ---- Updating one parameter slice by slice -----------------------------------------------------
// O2's step materializes each fp32 master gradient a slice at a time, right before its update
// (src/optim/amp_optimizer.rs), so that no full-size fp32 gradient exists. Every rule here is
// elementwise, so updating a parameter slice by slice gives its whole-tensor update bit for bit.
// What this needs from the rules: a per-parameter update callable on views (`param`, `grad`
// and a `ParamState` whose buffers are views), which creates missing buffers the way the
// whole-tensor update does.

/// One slice of a parameter's gradient for [`Optimizer::update_in_slices`]: the fp32 gradient
/// of the flat elements `[start, start + grad.numel())`.
pub(crate) struct GradSlice {
    pub(crate) start: i64,
    pub(crate) grad: Tensor,
}

impl Optimizer {
    /// Updates parameter `i` (contiguous, fp32 or fp64) from its gradient given slice by slice:
    /// `next` yields the slices in order until the parameter is covered (`None` ends it), and
    /// `done(start, len)` runs after each slice's update (O2 rounds the updated master slice into
    /// the model there). The step count goes up once. Buffers the rule creates at a
    /// parameter's first update are created full-size and filled slice by slice.
    pub(crate) fn update_in_slices(
        &mut self,
        i: usize,
        next: &mut dyn FnMut() -> Result<Option<GradSlice>>,
        done: &mut dyn FnMut(i64, i64) -> Result<()>,
    ) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let lr = self.group_lr(self.groups[i]);
        let config = self.config;
        let param = self.params[i].shallow_clone();
        let st = &mut self.state[i];
        st.step += 1;
        let existing: Vec<&'static str> = st.buffers.keys().copied().collect();
        let flat = |t: &Tensor| t.f_view([-1]).ctx("a parameter slice");
        let param_flat = flat(&param)?;
        let state_flat: Vec<(&'static str, Tensor)> =
            existing.iter().map(|name| Ok((*name, flat(&st.buffers[name])?))).collect::<Result<_>>()?;
        let adam_step =
            Tensor::f_scalar_tensor(torch_step_value(st.step), (Kind::Float, param.device())).ctx("Adam step")?;
        let numel = param_flat.numel() as i64;
        while let Some(GradSlice { start, grad }) = next()? {
            let len = grad.numel() as i64;
            let slice = |t: &Tensor| {
                if len == numel {
                    Ok(t.shallow_clone())
                } else {
                    t.f_narrow(0, start, len).ctx("a parameter slice")
                }
            };
            let p = slice(&param_flat)?;
            let mut view = ParamState { step: st.step, buffers: BTreeMap::new() };
            for (name, t) in &state_flat {
                view.buffers.insert(*name, slice(t)?);
            }
            let OptimizerConfig { algorithm, maximize, fused } = config;
            match algorithm {
                Algorithm::Sgd(c) => sgd(&p, &grad, &mut view, lr, c, maximize)?,
                Algorithm::RmsProp(c) => rmsprop(&p, &grad, &mut view, lr, c, maximize)?,
                Algorithm::Adam(c) if !fused => {
                    let h = AdamHyper { beta1: c.beta1, beta2: c.beta2, eps: c.eps, wd: c.wd, amsgrad: c.amsgrad };
                    adam(&p, &grad, &mut view, lr, h, false, maximize)?
                }
                Algorithm::AdamW(c) if !fused => {
                    let h = AdamHyper { beta1: c.beta1, beta2: c.beta2, eps: c.eps, wd: c.wd, amsgrad: c.amsgrad };
                    adam(&p, &grad, &mut view, lr, h, true, maximize)?
                }
                Algorithm::Adam(nn::Adam { amsgrad, .. }) | Algorithm::AdamW(nn::AdamW { amsgrad, .. }) => {
                    let mut batch = FusedBatch::default();
                    batch.exp_avgs.push(view.buffer("exp_avg", &p)?);
                    batch.exp_avg_sqs.push(view.buffer("exp_avg_sq", &p)?);
                    if amsgrad {
                        batch.max_exp_avg_sqs.push(view.buffer("max_exp_avg_sq", &p)?);
                    }
                    batch.steps.push(adam_step.shallow_clone());
                    batch.params.push(p.shallow_clone());
                    batch.grads.push(grad.shallow_clone());
                    batch.run(algorithm, lr, maximize)?;
                }
            }
            // Buffers created for this slice (the parameter's first update): into full-size state.
            for (name, slice) in view.buffers {
                if existing.contains(&name) {
                    continue;
                }
                if !st.buffers.contains_key(name) {
                    st.buffers.insert(name, param.f_empty_like().ctx("allocating optimizer state")?);
                }
                flat(&st.buffers[name])?
                    .f_narrow(0, start, len)
                    .and_then(|mut t| t.f_copy_(&slice))
                    .ctx("optimizer state slice")?;
            }
            done(start, len)?;
        }
        Ok(())
    }
}
