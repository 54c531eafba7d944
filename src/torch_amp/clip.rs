//! `torch.nn.utils.clip_grad_norm_`, op for op as PyTorch 2.13 runs it on CPU, for the
//! "unscale_ then clip" recipe with any optimizer's parameters.
use tch::Tensor;

use crate::error::Result;
use crate::optim::{clip_grads, NonFiniteNorm};

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
/// [`ConfigError::InvalidOption`](crate::error::ConfigError::InvalidOption) for a `max_norm` that
/// is not finite and >= 0, or a `norm_type` that is not positive;
/// [`UsageError::CallOrder`](crate::error::UsageError::CallOrder) for fp16/bf16 parameters none of
/// which has a gradient (the Apex path's O2 keeps them on the fp32 masters: clip those).
pub fn clip_grad_norm_(params: &[Tensor], max_norm: f64, norm_type: f64) -> Result<Tensor> {
    clip_grads(params, max_norm, norm_type, NonFiniteNorm::Scale)
}
