//! The optimizers' libtorch calls tch's generated API lacks: the fused Adam/AdamW kernels
//! (`src/shim/optim.cpp`), and `add(other, alpha)`, `addcmul(t1, t2, value)` and
//! `addcdiv(t1, t2, value)` with their scalar (`src/shim/optim_ops.cpp`): one kernel with one
//! rounding, as in torch.optim, so tch-amp's updates reproduce torch's bits.
use std::ffi::{c_char, c_int};

use tch::Tensor;
use torch_sys::C_tensor;

use super::{check, ptr, ptrs};
use crate::error::{AmpError, Result};
use crate::optim::FusedAdamHyper;

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
    fn tch_amp_o2_fused_adam_(
        model: *mut C_tensor,
        grad: *mut C_tensor,
        master: *mut C_tensor,
        exp_avg: *mut C_tensor,
        exp_avg_sq: *mut C_tensor,
        max_exp_avg_sq: *mut C_tensor,
        step: *mut C_tensor,
        inv_scale: *mut C_tensor,
        h: *const AdamScalars,
        applied: *mut c_int,
    ) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    fn tch_amp_o1_fused_adam_(
        param: *mut C_tensor,
        grad: *mut C_tensor,
        exp_avg: *mut C_tensor,
        exp_avg_sq: *mut C_tensor,
        max_exp_avg_sq: *mut C_tensor,
        step: *mut C_tensor,
        h: *const AdamScalars,
        applied: *mut c_int,
    ) -> *mut c_char;
    fn tch_amp_o2_adam_form(
        adamw: c_int,
        found: *mut c_int,
        sq: *mut c_int,
        wd: *mut c_int,
        width: *mut c_int,
    ) -> *mut c_char;
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

/// The tensors of one O2 fused Adam/AdamW update from an fp16/bf16 gradient (see
/// [`o2_fused_adam_`]).
pub(crate) struct O2AdamTensors<'a> {
    pub(crate) model: &'a Tensor,
    pub(crate) grad: &'a Tensor,
    pub(crate) master: &'a Tensor,
    pub(crate) exp_avg: &'a Tensor,
    pub(crate) exp_avg_sq: &'a Tensor,
    /// With amsgrad only.
    pub(crate) max_exp_avg_sq: Option<&'a Tensor>,
    /// This update's step count (a 0-dim fp32 tensor).
    pub(crate) step: &'a Tensor,
    pub(crate) inv_scale: &'a Tensor,
}

/// One parameter's O2 Adam/AdamW update in a single pass (`src/shim/o2_adam.cpp`): the fp16/bf16
/// gradient unscaled into fp32, the master and its state updated with libtorch's fused kernel's
/// arithmetic, the master rounded into the model weight. `Ok(false)`, nothing changed, where no
/// form of the pass reproduces libtorch's kernel bit for bit (checked once per mode).
pub(crate) fn o2_fused_adam_(t: &O2AdamTensors<'_>, lr: f64, h: FusedAdamHyper) -> Result<bool> {
    let max = t.max_exp_avg_sq.map_or(std::ptr::null_mut(), ptr);
    let scalars = AdamScalars::new(lr, h);
    let mut applied: c_int = 0;
    // SAFETY: live at::Tensor handles (or NULL for an absent max_exp_avg_sq) and a live
    // `scalars` for the call; `applied` is a plain out-pointer.
    let err = unsafe {
        tch_amp_o2_fused_adam_(
            ptr(t.model),
            ptr(t.grad),
            ptr(t.master),
            ptr(t.exp_avg),
            ptr(t.exp_avg_sq),
            max,
            ptr(t.step),
            ptr(t.inv_scale),
            &scalars,
            &mut applied,
        )
    };
    check(err, "o2_fused_adam")?;
    Ok(applied == 1)
}

/// The tensors of one O1 fused Adam/AdamW update of an fp32 weight (see [`o1_fused_adam_`]).
pub(crate) struct O1AdamTensors<'a> {
    pub(crate) param: &'a Tensor,
    pub(crate) grad: &'a Tensor,
    pub(crate) exp_avg: &'a Tensor,
    pub(crate) exp_avg_sq: &'a Tensor,
    /// With amsgrad only.
    pub(crate) max_exp_avg_sq: Option<&'a Tensor>,
    /// This update's step count (a 0-dim fp32 tensor).
    pub(crate) step: &'a Tensor,
}

/// One fp32 weight's Adam/AdamW update in a single pass that also writes the weight's copy
/// rounded to fp16/bf16 for O1's next forward (`src/shim/weight_copies.h`), with libtorch's
/// fused kernel's arithmetic. `Ok(false)`, nothing changed, where O1 wants no copy of this
/// weight or the single pass does not apply (the caller runs libtorch's kernel).
pub(crate) fn o1_fused_adam_(t: &O1AdamTensors<'_>, lr: f64, h: FusedAdamHyper) -> Result<bool> {
    let max = t.max_exp_avg_sq.map_or(std::ptr::null_mut(), ptr);
    let scalars = AdamScalars::new(lr, h);
    let mut applied: c_int = 0;
    // SAFETY: live at::Tensor handles (or NULL for an absent max_exp_avg_sq) and a live
    // `scalars` for the call; `applied` is a plain out-pointer.
    let err = unsafe {
        tch_amp_o1_fused_adam_(
            ptr(t.param),
            ptr(t.grad),
            ptr(t.exp_avg),
            ptr(t.exp_avg_sq),
            max,
            ptr(t.step),
            &scalars,
            &mut applied,
        )
    };
    check(err, "o1_fused_adam")?;
    Ok(applied == 1)
}

/// The single-pass O2 update's form for Adam or AdamW that reproduces libtorch's kernel on this
/// machine (found at the first call): `(sq, wd, width)` as `src/shim/o2_adam.cpp` numbers them,
/// `None` when there is none.
pub(crate) fn o2_adam_form(adamw: bool) -> Result<Option<(i32, i32, i32)>> {
    let (mut found, mut sq, mut wd, mut width): (c_int, c_int, c_int, c_int) = (0, 0, 0, 0);
    // SAFETY: plain out-pointers to locals.
    check(
        unsafe { tch_amp_o2_adam_form(c_int::from(adamw), &mut found, &mut sq, &mut wd, &mut width) },
        "o2_adam_form",
    )?;
    Ok((found == 1).then_some((sq, wd, width)))
}

/// One fused Adam or AdamW update (`h.adamw`) with libtorch's `_fused_adam(w)_`.
pub(crate) fn fused_adam_(t: &FusedAdamArgs<'_>, lr: f64, h: FusedAdamHyper) -> Result<()> {
    let (p, n) = ptrs(t.params, "fused_adam")?;
    let lists = [t.grads, t.exp_avgs, t.exp_avg_sqs, t.steps];
    if lists.iter().any(|l| l.len() != t.params.len()) || (h.amsgrad && t.max_exp_avg_sqs.len() != t.params.len()) {
        return Err(AmpError::Shim { what: "fused_adam", message: "tensor lists of different lengths".into() });
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
