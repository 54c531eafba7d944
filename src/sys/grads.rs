//! Gradient plumbing (`src/shim/grads.cpp`): set or clear `.grad`, the fused unscale with an
//! inf/NaN flag, and the fp32 total and per-tensor norms.
use std::ffi::{c_char, c_int};

use tch::Tensor;
use torch_sys::C_tensor;

use super::{check, ptr, ptrs};
use crate::error::{Result, TorchContext};

extern "C" {
    fn tch_amp_set_grad(tensor: *mut C_tensor, grad: *mut C_tensor) -> *mut c_char;
    fn tch_amp_backward(tensor: *mut C_tensor, keep_graph: c_int) -> *mut c_char;
    fn tch_amp_unscale_(
        grads: *const *mut C_tensor,
        n: c_int,
        found_inf: *mut C_tensor,
        inv_scale: *mut C_tensor,
    ) -> *mut c_char;
    fn tch_amp_total_norm(
        tensors: *const *mut C_tensor,
        n: c_int,
        norm_type: f64,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    fn tch_amp_vector_norm(tensor: *mut C_tensor, ord: f64, out: *mut *mut C_tensor) -> *mut c_char;
}

/// Sets `t.grad` to `grad` (shared, no copy), or to None (freeing it) for `None`.
pub(crate) fn set_grad(t: &Tensor, grad: Option<&Tensor>) -> Result<()> {
    let g = grad.map_or(std::ptr::null_mut(), ptr);
    // SAFETY: `t` (and `grad` when given) are live at::Tensor handles; NULL means undefined.
    check(unsafe { tch_amp_set_grad(ptr(t), g) }, "set_grad")
}

/// `t.backward(retain_graph=keep_graph)` (see [`crate::optim::backward`]); libtorch's message as
/// a [`tch::TchError::Torch`].
pub(crate) fn backward(t: &Tensor, keep_graph: bool) -> std::result::Result<(), tch::TchError> {
    // SAFETY: `t` is a live at::Tensor handle for the duration of the call.
    let err = unsafe { tch_amp_backward(ptr(t), c_int::from(keep_graph)) };
    if err.is_null() {
        Ok(())
    } else {
        Err(tch::TchError::Torch(super::take_string(err)))
    }
}

/// libtorch's `_amp_foreach_non_finite_check_and_unscale_` over `grads` (see
/// [`crate::optim::unscale_`]).
pub(crate) fn unscale_(grads: &[Tensor], found_inf: &Tensor, inv_scale: &Tensor) -> Result<()> {
    if grads.is_empty() {
        return Ok(());
    }
    let (handles, n) = ptrs(grads, "unscale")?;
    // SAFETY: `handles` holds live handles for the duration of the call.
    check(unsafe { tch_amp_unscale_(handles.as_ptr(), n, ptr(found_inf), ptr(inv_scale)) }, "unscale")
}

/// `found_inf` set to 1 when any element of `grads` is inf or NaN: [`unscale_`] with an
/// `inv_scale` of exactly 1, which leaves every value as it is.
pub(crate) fn non_finite_check_(grads: &[Tensor], found_inf: &Tensor) -> Result<()> {
    if grads.is_empty() {
        return Ok(());
    }
    let one = Tensor::f_ones([1], (tch::Kind::Float, found_inf.device())).ctx("non_finite_check")?;
    unscale_(grads, found_inf, &one)
}

/// The total `norm_type`-norm of `tensors` as a 0-dim fp32 tensor (0 for an empty list), every
/// per-tensor norm computed in fp32.
pub(crate) fn total_norm(tensors: &[Tensor], norm_type: f64) -> Result<Tensor> {
    let (handles, n) = ptrs(tensors, "total_norm")?;
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: live handles in; `out` receives a new at::Tensor we own.
    check(unsafe { tch_amp_total_norm(handles.as_ptr(), n, norm_type, &mut out) }, "total_norm")?;
    // SAFETY: `out` was allocated by the shim with `new at::Tensor`, which tch frees.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// `torch.linalg.vector_norm(t, ord, dtype=torch.float32)`: a 0-dim fp32 tensor.
pub(crate) fn vector_norm(t: &Tensor, ord: f64) -> Result<Tensor> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: a live handle in; `out` receives a new at::Tensor we own.
    check(unsafe { tch_amp_vector_norm(ptr(t), ord, &mut out) }, "vector_norm")?;
    // SAFETY: `out` was allocated by the shim with `new at::Tensor`, which tch frees.
    Ok(unsafe { Tensor::from_ptr(out) })
}
