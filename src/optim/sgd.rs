//! torch.optim.SGD's momentum update, shared by torch's SGD and Apex's FusedSGD (which runs
//! torch.optim.SGD's single-tensor ops).
use tch::Tensor;

use super::rule::ParamState;
use crate::error::{Result, TorchContext};
use crate::sys;

/// torch.optim.SGD's momentum (single-tensor path): the `momentum_buffer` is the first
/// gradient, then `buf * momentum + grad * (1 - dampening)`; returns the direction to step
/// along (`grad + buf * momentum` with Nesterov, else the buffer). Shared by `nn::Sgd` and
/// Apex's FusedSGD.
pub(crate) fn sgd_momentum(
    grad: &Tensor,
    st: &mut ParamState,
    momentum: f64,
    dampening: f64,
    nesterov: bool,
) -> Result<Tensor> {
    let buf = match st.buffer("momentum_buffer") {
        None => {
            let b = grad.f_detach_copy().ctx("SGD momentum buffer")?;
            st.set_buffer("momentum_buffer", b.shallow_clone());
            b
        }
        Some(b) => {
            let b = b.shallow_clone();
            sys::mul_float_(&b, momentum)?;
            sys::add_(&b, grad, 1.0 - dampening)?;
            b
        }
    };
    if nesterov {
        sys::add(grad, &buf, momentum)
    } else {
        Ok(buf)
    }
}
