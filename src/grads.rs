//! Gradient plumbing through the shim: set or clear `.grad`, the fused unscale with an
//! inf/NaN flag, and the fp32 total norm.
use std::ffi::c_int;

use tch::{Kind, Tensor};
use torch_sys::C_tensor;

use crate::error::{AmpError, Result};
use crate::ffi;

/// The shim-side handle of a tensor (tch's `C_tensor`, an `at::Tensor*`).
pub(crate) fn ptr(t: &Tensor) -> *mut C_tensor {
    t.as_ptr() as *mut C_tensor
}

/// Sets `t.grad` to `grad` (shares it, no copy).
pub(crate) fn set_grad(t: &Tensor, grad: &Tensor) -> Result<()> {
    // SAFETY: both pointers are live at::Tensor handles owned by `t` and `grad`.
    ffi::check(unsafe { ffi::tch_amp_set_grad(ptr(t), ptr(grad)) }, "set_grad")
}

/// Sets `t.grad` to None, releasing its memory.
pub(crate) fn clear_grad(t: &Tensor) -> Result<()> {
    // SAFETY: `t` is a live handle; NULL means "undefined".
    ffi::check(unsafe { ffi::tch_amp_set_grad(ptr(t), std::ptr::null_mut()) }, "set_grad")
}

/// Takes `t.grad` out (None when it has none), leaving `t.grad` as None.
pub(crate) fn take_grad(t: &Tensor) -> Result<Option<Tensor>> {
    let g = t.grad();
    if !g.defined() {
        return Ok(None);
    }
    clear_grad(t)?;
    Ok(Some(g))
}

/// In place `g *= inv_scale` for every tensor of `grads`, and `found_inf` (a 1-element fp32
/// tensor on the grads' device) set to 1.0 when any element is inf or NaN: one fused pass per
/// dtype group (libtorch's `_amp_foreach_non_finite_check_and_unscale_`), no host sync. This is
/// what `scale_loss` runs at exit; it is public for custom training loops and benchmarks.
///
/// # Errors
/// [`AmpError::Shim`] when libtorch rejects the inputs (e.g. tensors on different devices).
pub fn unscale_(grads: &[Tensor], found_inf: &Tensor, inv_scale: &Tensor) -> Result<()> {
    if grads.is_empty() {
        return Ok(());
    }
    let n = c_int::try_from(grads.len())
        .map_err(|_| AmpError::Usage(format!("too many gradients ({}) for one unscale", grads.len())))?;
    let ptrs: Vec<*mut C_tensor> = grads.iter().map(ptr).collect();
    // SAFETY: `ptrs` holds live handles for the duration of the call.
    ffi::check(unsafe { ffi::tch_amp_unscale_(ptrs.as_ptr(), n, ptr(found_inf), ptr(inv_scale)) }, "unscale")
}

/// The total `norm_type`-norm of `tensors` as a 0-dim fp32 tensor (0 for an empty list),
/// every per-tensor norm computed in fp32.
pub(crate) fn total_norm(tensors: &[Tensor], norm_type: f64) -> Result<Tensor> {
    let n = c_int::try_from(tensors.len())
        .map_err(|_| AmpError::Usage(format!("too many tensors ({}) for one norm", tensors.len())))?;
    let ptrs: Vec<*mut C_tensor> = tensors.iter().map(ptr).collect();
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: live handles in; `out` receives a new at::Tensor we own.
    ffi::check(unsafe { ffi::tch_amp_total_norm(ptrs.as_ptr(), n, norm_type, &mut out) }, "total_norm")?;
    // SAFETY: `out` was allocated by the shim with `new at::Tensor`, which tch frees.
    let t = unsafe { Tensor::from_ptr(out) };
    debug_assert_eq!(t.kind(), Kind::Float);
    Ok(t)
}
