//! `torch.nn.utils.clip_grad_norm_`, op for op as PyTorch 2.13 runs it on CPU, for the
//! "unscale_ then clip" recipe with any optimizer's parameters.
use tch::{Kind, Tensor};

use super::error::Result;
#[cfg(doc)]
use super::error::TorchAmpError;
use crate::optim::{check_clip_args, clip_coef};
use crate::sys;

/// torch's `clip_grad_norm_(params, max_norm, norm_type)`: the total `norm_type`-norm of the
/// gradients of `params` (each gradient's norm, then the norm of those), and when it exceeds
/// `max_norm` every gradient multiplied in place by `max_norm / (total + 1e-6)` (clamped to 1,
/// computed as torch does: `(total + 1e-6).reciprocal() * max_norm`). Returns the total norm before
/// clipping, a 0-dim fp32 tensor (0 when no parameter has a gradient); a non-finite norm makes the
/// gradients non-finite, as in torch (`error_if_nonfinite=False`). No host sync.
///
/// Call it after [`crate::GradScaler::unscale_`], so the norm is the true gradient's. Give the
/// parameters in torch's order (`model.parameters()`: each weight before its bias; tch's `VarStore`
/// creates the bias first): the per-tensor norms are summed in that order. Norms are computed in
/// fp32 (torch computes an fp16/bf16 gradient's norm in its own dtype).
///
/// # Errors
/// [`ConfigError::InvalidOption`](crate::error::ConfigError::InvalidOption) (as
/// [`TorchAmpError::Amp`]) for a `max_norm` that is not finite and >= 0, or a `norm_type` that is
/// not positive.
pub fn clip_grad_norm_(params: &[Tensor], max_norm: f64, norm_type: f64) -> Result<Tensor> {
    check_clip_args(max_norm, norm_type)?;
    let grads: Vec<Tensor> = params.iter().map(Tensor::grad).filter(Tensor::defined).collect();
    if grads.is_empty() {
        return Ok(Tensor::f_zeros([], (Kind::Float, tch::Device::Cpu))?);
    }
    let _no_grad = tch::no_grad_guard();
    let total = sys::total_norm(&grads, norm_type)?;
    let coef = clip_coef(&total, max_norm)?;
    for g in &grads {
        let _ = g.shallow_clone().f_mul_(&coef.f_to_device(g.device())?)?;
    }
    Ok(total)
}
