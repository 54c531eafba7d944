//! libtorch's fused Adam/AdamW kernels (`src/shim/optim.cpp`).
use std::ffi::{c_char, c_int};

use tch::Tensor;
use torch_sys::C_tensor;

use super::{check, ptrs};
use crate::error::{AmpError, Result};

extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn tch_amp_fused_adam_(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        max_exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: c_int,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        amsgrad: c_int,
        adamw: c_int,
    ) -> *mut c_char;
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

/// One fused Adam (`adamw == false`) or AdamW update (libtorch's `_fused_adam(w)_`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn fused_adam_(
    t: &FusedAdamArgs<'_>,
    lr: f64,
    beta1: f64,
    beta2: f64,
    weight_decay: f64,
    eps: f64,
    amsgrad: bool,
    adamw: bool,
) -> Result<()> {
    let (p, n) = ptrs(t.params, "fused_adam")?;
    let lists = [t.grads, t.exp_avgs, t.exp_avg_sqs, t.steps];
    if lists.iter().any(|l| l.len() != t.params.len()) || (amsgrad && t.max_exp_avg_sqs.len() != t.params.len()) {
        return Err(AmpError::Shim { what: "fused_adam", message: "tensor lists of different lengths".into() });
    }
    let (g, _) = ptrs(t.grads, "fused_adam")?;
    let (m, _) = ptrs(t.exp_avgs, "fused_adam")?;
    let (v, _) = ptrs(t.exp_avg_sqs, "fused_adam")?;
    let (mx, _) = ptrs(t.max_exp_avg_sqs, "fused_adam")?;
    let (s, _) = ptrs(t.steps, "fused_adam")?;
    let mx_ptr = if amsgrad { mx.as_ptr() } else { std::ptr::null() };
    // SAFETY: every pointer is a live at::Tensor handle held by `t` for the call; the lists have
    // n entries each (checked above; max_exp_avg_sqs only with amsgrad, else NULL).
    check(
        unsafe {
            tch_amp_fused_adam_(
                p.as_ptr(),
                g.as_ptr(),
                m.as_ptr(),
                v.as_ptr(),
                mx_ptr,
                s.as_ptr(),
                n,
                lr,
                beta1,
                beta2,
                weight_decay,
                eps,
                c_int::from(amsgrad),
                c_int::from(adamw),
            )
        },
        "fused_adam",
    )
}
