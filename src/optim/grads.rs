//! Gradients: set, clear or take `.grad`, the fused unscale with an inf/NaN flag, and the fp32
//! total norm (the shim calls are in `crate::sys`).
use crate::error::ConfigError;
use tch::Tensor;

use crate::error::{AmpError, Result, TorchContext};
use crate::sys;

/// Sets `t.grad` to `grad` (shares it, no copy).
pub(crate) fn set_grad(t: &Tensor, grad: &Tensor) -> Result<()> {
    sys::set_grad(t, Some(grad))
}

/// Sets `t.grad` to None, releasing its memory.
pub(crate) fn clear_grad(t: &Tensor) -> Result<()> {
    sys::set_grad(t, None)
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

/// torch's `tensor.backward(retain_graph=retain_graph)`: the gradients of `tensor` (a single
/// value) accumulate into the leaves' `.grad`; with `retain_graph` the graph is kept for another
/// backward through it (tch's `Tensor::backward` always frees it). For two losses of one forward
/// inside [`crate::Amp::f_scale_loss_with`]: `|s| tch_amp::optim::backward(s, true)` for the
/// first, as Apex's `scaled_loss.backward(retain_graph=True)`.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// # fn main() -> Result<(), tch::TchError> {
/// let w = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
/// let y = (&w * &w).sum(Kind::Float); // its backward needs the saved `w`
/// tch_amp::optim::backward(&y, true)?;
/// tch_amp::optim::backward(&y, false)?; // the graph was kept; now it is freed
/// assert_eq!(w.grad().double_value(&[0]), 4.0); // 2w, twice
/// assert!(tch_amp::optim::backward(&y, false).is_err());
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// libtorch's message as [`tch::TchError::Torch`] (a tensor that does not require grad, a
/// graph already freed, ...).
pub fn backward(tensor: &Tensor, retain_graph: bool) -> std::result::Result<(), tch::TchError> {
    sys::backward(tensor, retain_graph)
}

/// In place `g *= inv_scale` for every tensor of `grads`, and `found_inf` (a 1-element fp32
/// tensor on the grads' device) set to 1.0 when any element is inf or NaN: one fused pass per
/// dtype group (libtorch's `_amp_foreach_non_finite_check_and_unscale_`), no host sync. This is
/// what `scale_loss` runs at exit; it is public for custom training loops and benchmarks.
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) when libtorch rejects the inputs (e.g. tensors on different
/// devices); [`AmpError::Torch`](crate::AmpError::Torch) beyond `i32::MAX` tensors.
pub fn unscale_(grads: &[Tensor], found_inf: &Tensor, inv_scale: &Tensor) -> Result<()> {
    sys::unscale_(grads, found_inf, inv_scale)
}

/// What [`unscale_`] flags with an `inv_scale` of exactly 1: `found_inf` (a 1-element fp32
/// tensor) set to 1.0 when any element of `grads` is inf or NaN, every value left as it is
/// (libtorch's check-and-unscale multiplying by 1). What `scale_loss` runs at exit on O2's
/// fp16 gradients, which `step` unscales; public for custom training loops.
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) when libtorch rejects the inputs (e.g. tensors on different
/// devices); [`AmpError::Torch`](crate::AmpError::Torch) beyond `i32::MAX` tensors.
pub fn non_finite_check_(grads: &[Tensor], found_inf: &Tensor) -> Result<()> {
    sys::non_finite_check_(grads, found_inf)
}

/// The total `norm_type`-norm of `tensors` as a 0-dim fp32 tensor, every per-tensor norm
/// computed in fp32.
pub(crate) fn total_norm(tensors: &[Tensor], norm_type: f64) -> Result<Tensor> {
    sys::total_norm(tensors, norm_type)
}

/// torch's clip coefficient for a total norm `total` (a 0-dim fp32 tensor): `max_norm / (total +
/// 1e-6)` clamped to at most 1, computed as torch computes it (`(total + 1e-6).reciprocal() *
/// max_norm`, a Python number divided by a tensor).
pub(crate) fn clip_coef(total: &Tensor, max_norm: f64) -> Result<Tensor> {
    total
        .f_add_scalar(1e-6)
        .and_then(|t| t.f_reciprocal())
        .and_then(|t| t.f_mul_scalar(max_norm))
        .and_then(|t| t.f_clamp_max(1.0))
        .ctx("the clip coefficient")
}

/// The arguments of a gradient clip, checked as torch's `clip_grad_norm_` would use them: a
/// finite `max_norm >= 0` and a positive `norm_type` (`f64::INFINITY` for the max-norm).
pub(crate) fn check_clip_args(max_norm: f64, norm_type: f64) -> Result<()> {
    if !(max_norm.is_finite() && max_norm >= 0.0) {
        return Err(AmpError::Config(ConfigError::InvalidOption {
            option: "max_norm",
            value: max_norm.to_string(),
            expected: "a finite number >= 0",
        }));
    }
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(AmpError::Config(ConfigError::InvalidOption {
            option: "norm_type",
            value: norm_type.to_string(),
            expected: "a positive number or f64::INFINITY",
        }));
    }
    Ok(())
}
