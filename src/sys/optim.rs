//! The optimizers' libtorch calls tch's generated API lacks: the fused Adam/AdamW kernels
//! (`src/shim/optim.cpp`), and `add(other, alpha)`, `addcmul(t1, t2, value)` and
//! `addcdiv(t1, t2, value)` with their scalar (`src/shim/optim_ops.cpp`): one kernel with one
//! rounding, as in torch.optim, so tch-amp's updates reproduce torch's bits.
use std::ffi::{c_char, c_int};

use tch::Tensor;
use torch_sys::C_tensor;

use super::{check, ptr, ptrs};
use crate::error::{AmpError, Result};

extern "C" {
    fn tch_amp_fused_adam_(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        max_exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: c_int,
        h: *const AdamScalars,
    ) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::too_many_arguments)]
    fn tch_amp_optim_add_(self_: *mut C_tensor, other: *mut C_tensor, alpha: f64) -> *mut c_char;
    fn tch_amp_optim_add(
        self_: *mut C_tensor,
        other: *mut C_tensor,
        alpha: f64,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    fn tch_amp_optim_addcmul_(self_: *mut C_tensor, t1: *mut C_tensor, t2: *mut C_tensor, value: f64) -> *mut c_char;
    fn tch_amp_optim_addcmul(
        self_: *mut C_tensor,
        t1: *mut C_tensor,
        t2: *mut C_tensor,
        value: f64,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    fn tch_amp_optim_addcdiv_(self_: *mut C_tensor, t1: *mut C_tensor, t2: *mut C_tensor, value: f64) -> *mut c_char;
    fn tch_amp_optim_mul_float_(self_: *mut C_tensor, value: f64) -> *mut c_char;
    fn tch_amp_optim_add_float_(self_: *mut C_tensor, value: f64) -> *mut c_char;
    fn tch_amp_optim_div_float(self_: *mut C_tensor, value: f64, out: *mut *mut C_tensor) -> *mut c_char;
}

/// The scalar arguments of libtorch's fused Adam/AdamW kernel for one group.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FusedAdamHyper {
    pub(crate) beta1: f64,
    pub(crate) beta2: f64,
    pub(crate) wd: f64,
    pub(crate) eps: f64,
    pub(crate) amsgrad: bool,
    /// AdamW (decoupled weight decay) rather than Adam.
    pub(crate) adamw: bool,
    pub(crate) maximize: bool,
}

/// The scalar arguments of an Adam/AdamW update as the shim takes them
/// (`tch_amp_adam_scalars`, src/shim/amp_shim.h).
#[repr(C)]
struct AdamScalars {
    lr: f64,
    beta1: f64,
    beta2: f64,
    weight_decay: f64,
    eps: f64,
    amsgrad: c_int,
    adamw: c_int,
    maximize: c_int,
}

impl AdamScalars {
    fn new(lr: f64, h: FusedAdamHyper) -> Self {
        AdamScalars {
            lr,
            beta1: h.beta1,
            beta2: h.beta2,
            weight_decay: h.wd,
            eps: h.eps,
            amsgrad: c_int::from(h.amsgrad),
            adamw: c_int::from(h.adamw),
            maximize: c_int::from(h.maximize),
        }
    }
}

/// The tensors of one fused Adam/AdamW call; every list has one entry per parameter
/// (`max_exp_avg_sqs` only with amsgrad).
pub(crate) struct FusedAdamArgs<'a> {
    pub(crate) params: &'a [Tensor],
    pub(crate) grads: &'a [Tensor],
    pub(crate) exp_avgs: &'a [Tensor],
    pub(crate) exp_avg_sqs: &'a [Tensor],
    pub(crate) max_exp_avg_sqs: &'a [Tensor],
    pub(crate) steps: &'a [Tensor],
}

/// One fused Adam or AdamW update (`h.adamw`) with libtorch's `_fused_adam(w)_`.
pub(crate) fn fused_adam_(t: &FusedAdamArgs<'_>, lr: f64, h: FusedAdamHyper) -> Result<()> {
    let (p, n) = ptrs(t.params, "fused_adam")?;
    let lists = [t.grads, t.exp_avgs, t.exp_avg_sqs, t.steps];
    if lists.iter().any(|l| l.len() != t.params.len()) || (h.amsgrad && t.max_exp_avg_sqs.len() != t.params.len()) {
        return Err(AmpError::torch("fused_adam", "tensor lists of different lengths"));
    }
    let (g, _) = ptrs(t.grads, "fused_adam")?;
    let (m, _) = ptrs(t.exp_avgs, "fused_adam")?;
    let (v, _) = ptrs(t.exp_avg_sqs, "fused_adam")?;
    let (mx, _) = ptrs(t.max_exp_avg_sqs, "fused_adam")?;
    let (s, _) = ptrs(t.steps, "fused_adam")?;
    let mx_ptr = if h.amsgrad { mx.as_ptr() } else { std::ptr::null() };
    let scalars = AdamScalars::new(lr, h);
    // SAFETY: every pointer is a live at::Tensor handle held by `t` for the call; the lists have
    // n entries each (checked above; max_exp_avg_sqs only with amsgrad, else NULL); `scalars`
    // lives through the call.
    check(
        unsafe { tch_amp_fused_adam_(p.as_ptr(), g.as_ptr(), m.as_ptr(), v.as_ptr(), mx_ptr, s.as_ptr(), n, &scalars) },
        "fused_adam",
    )
}

/// Wraps a tensor the shim allocated with `new at::Tensor`.
fn owned(out: *mut C_tensor) -> Tensor {
    // SAFETY: on success the shim stored a fresh `new at::Tensor` in `out`; tch takes ownership
    // and frees it.
    unsafe { Tensor::from_ptr(out) }
}

/// `t.add_(other, alpha=alpha)`.
pub(crate) fn add_(t: &Tensor, other: &Tensor, alpha: f64) -> Result<()> {
    // SAFETY: both are live at::Tensor handles for the duration of the call.
    check(unsafe { tch_amp_optim_add_(ptr(t), ptr(other), alpha) }, "add_")
}

/// `t.add(other, alpha=alpha)`.
pub(crate) fn add(t: &Tensor, other: &Tensor, alpha: f64) -> Result<Tensor> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: live handles in; `out` receives a new at::Tensor on success.
    check(unsafe { tch_amp_optim_add(ptr(t), ptr(other), alpha, &mut out) }, "add")?;
    Ok(owned(out))
}

/// `t.addcmul_(t1, t2, value=value)`.
pub(crate) fn addcmul_(t: &Tensor, t1: &Tensor, t2: &Tensor, value: f64) -> Result<()> {
    // SAFETY: live at::Tensor handles for the duration of the call.
    check(unsafe { tch_amp_optim_addcmul_(ptr(t), ptr(t1), ptr(t2), value) }, "addcmul_")
}

/// `t.addcmul(t1, t2, value=value)`.
pub(crate) fn addcmul(t: &Tensor, t1: &Tensor, t2: &Tensor, value: f64) -> Result<Tensor> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: live handles in; `out` receives a new at::Tensor on success.
    check(unsafe { tch_amp_optim_addcmul(ptr(t), ptr(t1), ptr(t2), value, &mut out) }, "addcmul")?;
    Ok(owned(out))
}

/// `t.addcdiv_(t1, t2, value=value)`.
pub(crate) fn addcdiv_(t: &Tensor, t1: &Tensor, t2: &Tensor, value: f64) -> Result<()> {
    // SAFETY: live at::Tensor handles for the duration of the call.
    check(unsafe { tch_amp_optim_addcdiv_(ptr(t), ptr(t1), ptr(t2), value) }, "addcdiv_")
}

/// `t.mul_(value)` with `value` passed as Python passes a float (a wrapped number, kept in full
/// precision into the kernel's math; tch's `mul_scalar_` rounds it to an fp16 tensor's dtype).
pub(crate) fn mul_float_(t: &Tensor, value: f64) -> Result<()> {
    // SAFETY: a live at::Tensor handle for the duration of the call.
    check(unsafe { tch_amp_optim_mul_float_(ptr(t), value) }, "mul_")
}

/// `t.add_(value)` with `value` passed as Python passes a float.
pub(crate) fn add_float_(t: &Tensor, value: f64) -> Result<()> {
    // SAFETY: a live at::Tensor handle for the duration of the call.
    check(unsafe { tch_amp_optim_add_float_(ptr(t), value) }, "add_")
}

/// `t / value` with `value` passed as Python passes a float.
pub(crate) fn div_float(t: &Tensor, value: f64) -> Result<Tensor> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: a live handle in; `out` receives a new at::Tensor on success.
    check(unsafe { tch_amp_optim_div_float(ptr(t), value, &mut out) }, "div")?;
    Ok(owned(out))
}
