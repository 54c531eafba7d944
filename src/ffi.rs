//! Raw bindings to the C++ shim (`src/shim/*.cpp`) and the conversion of its error channel
//! into [`AmpError::Shim`]. Nothing here is public API.
use std::ffi::{c_char, c_int, CStr};

use crate::error::AmpError;

extern "C" {
    pub(crate) fn tch_amp_free_error(err: *mut c_char);
    pub(crate) fn tch_amp_autocast_get(device_type: c_int, enabled: *mut c_int, dtype: *mut c_int) -> *mut c_char;
    pub(crate) fn tch_amp_autocast_set(
        device_type: c_int,
        enabled: c_int,
        dtype: c_int,
        prev_enabled: *mut c_int,
        prev_dtype: *mut c_int,
    ) -> *mut c_char;
    pub(crate) fn tch_amp_autocast_clear_cache() -> *mut c_char;
    pub(crate) fn tch_amp_find_schema(name: *const c_char, overload: *const c_char) -> *mut c_char;
}

/// Turns the shim's return value (NULL or an owned message) into a `Result`.
pub(crate) fn check(err: *mut c_char, what: &'static str) -> Result<(), AmpError> {
    if err.is_null() {
        return Ok(());
    }
    Err(AmpError::Shim { what, message: take_string(err) })
}

/// Takes ownership of a string the shim allocated (strdup) and frees it.
pub(crate) fn take_string(ptr: *mut c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: a non-null pointer from the shim is a NUL-terminated strdup'd string we own.
    let s = unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned();
    // SAFETY: allocated with strdup (malloc); tch_amp_free_error is `free`.
    unsafe { tch_amp_free_error(ptr) };
    s
}

use torch_sys::C_tensor;

extern "C" {
    pub(crate) fn tch_amp_set_grad(tensor: *mut C_tensor, grad: *mut C_tensor) -> *mut c_char;
    pub(crate) fn tch_amp_unscale_(
        grads: *const *mut C_tensor,
        n: c_int,
        found_inf: *mut C_tensor,
        inv_scale: *mut C_tensor,
    ) -> *mut c_char;
    pub(crate) fn tch_amp_total_norm(
        tensors: *const *mut C_tensor,
        n: c_int,
        norm_type: f64,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
}

extern "C" {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn tch_amp_fused_adam_(
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
        maximize: c_int,
    ) -> *mut c_char;
}
