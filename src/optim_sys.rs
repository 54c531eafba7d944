//! Bindings to the optimizer ops of the shim (`src/shim/optim_ops.cpp`): libtorch's
//! `add(other, alpha)`, `addcmul(t1, t2, value)` and `addcdiv(t1, t2, value)`, which tch's
//! generated API has only without the scalar. They are one kernel with one rounding, as in
//! torch.optim; tch-amp's optimizers use them to reproduce torch's bits.
use std::ffi::c_char;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::error::Result;
use crate::ffi;
use crate::grads::ptr;

extern "C" {
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
}

/// Wraps a tensor the shim allocated with `new at::Tensor`.
fn owned(out: *mut C_tensor) -> Tensor {
    // SAFETY: on success the shim stored a fresh `new at::Tensor` in `out`; tch takes
    // ownership and frees it.
    unsafe { Tensor::from_ptr(out) }
}

/// `t.add_(other, alpha=alpha)`.
pub(crate) fn add_(t: &Tensor, other: &Tensor, alpha: f64) -> Result<()> {
    // SAFETY: both are live at::Tensor handles for the duration of the call.
    ffi::check(unsafe { tch_amp_optim_add_(ptr(t), ptr(other), alpha) }, "add_")
}

/// `t.add(other, alpha=alpha)`.
pub(crate) fn add(t: &Tensor, other: &Tensor, alpha: f64) -> Result<Tensor> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: live handles in; `out` receives a new at::Tensor on success.
    ffi::check(unsafe { tch_amp_optim_add(ptr(t), ptr(other), alpha, &mut out) }, "add")?;
    Ok(owned(out))
}

/// `t.addcmul_(t1, t2, value=value)`.
pub(crate) fn addcmul_(t: &Tensor, t1: &Tensor, t2: &Tensor, value: f64) -> Result<()> {
    // SAFETY: live at::Tensor handles for the duration of the call.
    ffi::check(
        unsafe { tch_amp_optim_addcmul_(ptr(t), ptr(t1), ptr(t2), value) },
        "addcmul_",
    )
}

/// `t.addcmul(t1, t2, value=value)`.
pub(crate) fn addcmul(t: &Tensor, t1: &Tensor, t2: &Tensor, value: f64) -> Result<Tensor> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: live handles in; `out` receives a new at::Tensor on success.
    ffi::check(
        unsafe { tch_amp_optim_addcmul(ptr(t), ptr(t1), ptr(t2), value, &mut out) },
        "addcmul",
    )?;
    Ok(owned(out))
}

/// `t.addcdiv_(t1, t2, value=value)`.
pub(crate) fn addcdiv_(t: &Tensor, t1: &Tensor, t2: &Tensor, value: f64) -> Result<()> {
    // SAFETY: live at::Tensor handles for the duration of the call.
    ffi::check(
        unsafe { tch_amp_optim_addcdiv_(ptr(t), ptr(t1), ptr(t2), value) },
        "addcdiv_",
    )
}
