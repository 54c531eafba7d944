//! Gradients: set, clear or take `.grad`, the fused unscale with an inf/NaN flag, and the one
//! gradient clip (the shim calls are in `crate::sys`).
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

/// What [`clip_grads`] does when the total norm is inf or NaN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NonFiniteNorm {
    /// Multiply anyway, as torch's `clip_grad_norm_(error_if_nonfinite=False)`: the gradients
    /// become non-finite.
    Scale,
    /// Leave the gradients as they are (the overflow check skips the step).
    Skip,
}

/// The one gradient clip: torch's `clip_grad_norm_` op for op. The total `norm_type`-norm of the
/// gradients of `params` (each per-tensor norm in fp32, then the norm of those, in the order
/// given), and every gradient multiplied in place by `clamp((total + 1e-6).reciprocal() *
/// max_norm, max=1)` (torch's `max_norm / (total_norm + 1e-6)`), moved to its device. Returns
/// the total norm before clipping, a 0-dim fp32 tensor (0 when no parameter has a gradient);
/// no host sync.
///
/// # Errors
/// [`ConfigError::InvalidOption`] for a `max_norm` that is not finite and >= 0 or a `norm_type`
/// that is not positive; [`UsageError::CallOrder`](crate::error::UsageError::CallOrder) when some
/// parameters are fp16/bf16 and none of those has a gradient (under O2 their gradients are on
/// the fp32 masters: clipping the model would clip nothing); [`AmpError::Torch`] if an op fails.
pub(crate) fn clip_grads(
    params: &[Tensor],
    max_norm: f64,
    norm_type: f64,
    non_finite: NonFiniteNorm,
) -> Result<Tensor> {
    check_clip_args(max_norm, norm_type)?;
    // fp16/bf16 parameters none of which has a gradient: O2's model after `scale_loss`.
    let low: Vec<&Tensor> = params.iter().filter(|p| crate::dtype::is_low_precision(p.kind())).collect();
    if !low.is_empty() && low.iter().all(|p| !p.grad().defined()) {
        return Err(AmpError::Usage(crate::error::UsageError::CallOrder {
            call: "clip_grad_norm",
            when: "on fp16/bf16 parameters without gradients (under O2 the gradients are on the fp32 masters)",
            remedy: "clip amp's master parameters (opt.clip_grad_norm, or opt.master_params())",
        }));
    }
    let grads: Vec<Tensor> = params.iter().map(Tensor::grad).filter(Tensor::defined).collect();
    if grads.is_empty() {
        return Tensor::f_zeros([], (tch::Kind::Float, tch::Device::Cpu)).ctx("clip");
    }
    let _no_grad = tch::no_grad_guard();
    let total = sys::total_norm(&grads, norm_type)?;
    scale_clipped(&grads, &total, max_norm, non_finite)?;
    Ok(total)
}

/// The clip of [`clip_grads`] given the total norm: every gradient multiplied in place by
/// `clamp((total + 1e-6).reciprocal() * max_norm, max=1)` (by 1 for a non-finite total with
/// [`NonFiniteNorm::Skip`]).
pub(crate) fn scale_clipped(grads: &[Tensor], total: &Tensor, max_norm: f64, non_finite: NonFiniteNorm) -> Result<()> {
    let _no_grad = tch::no_grad_guard();
    let mut coef = total
        .f_add_scalar(1e-6)
        .and_then(|t| t.f_reciprocal()?.f_mul_scalar(max_norm)?.f_clamp_max(1.0))
        .ctx("clip")?;
    if non_finite == NonFiniteNorm::Skip {
        coef = coef.f_where_self(&total.f_isfinite().ctx("clip")?, &coef.ones_like()).ctx("clip")?;
    }
    for g in grads {
        let _ = g.shallow_clone().f_mul_(&coef.f_to_device(g.device()).ctx("clip")?).ctx("clipping a gradient")?;
    }
    Ok(())
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
