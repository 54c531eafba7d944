//! Every `extern "C"` declaration of the C++ shim (`src/shim/*.cpp`) and every unsafe call into
//! it, each wrapped once in a safe function. Nothing here is public API; the rest of the crate
//! has no `unsafe`.
//!
//! The shim's error channel: every shim function returns NULL on success or a heap-allocated
//! message (a caught C++ exception), which [`check`] turns into [`AmpError::Torch`](crate::AmpError::Torch). Tensors
//! cross as tch's `C_tensor` (an `at::Tensor*`).
use crate::error::ConfigError;
use std::ffi::{c_char, c_int, CStr};

use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

use crate::error::{AmpError, Result};

mod autocast;
pub(crate) mod autograd;
pub(crate) mod cast;
pub(crate) mod cpu;
pub(crate) mod distributed;
mod grads;
mod optim;

pub(crate) use autocast::{
    autocast_cache_enabled, autocast_clear_cache, autocast_get, autocast_nesting, autocast_set, find_schema,
    set_allow_tf32,
};
pub(crate) use grads::{backward, non_finite_check_, set_grad, total_norm, unscale_, vector_norm};
pub(crate) use optim::{
    add, add_, add_float_, addcdiv_, addcmul, addcmul_, div_float, fused_adam_, mul_float_, FusedAdamArgs,
    FusedAdamHyper,
};

extern "C" {
    fn tch_amp_free_error(err: *mut c_char);
    fn tch_amp_storage_offset(t: *const C_tensor, out: *mut i64) -> *mut c_char;
}

/// Turns the shim's return value (NULL or an owned message) into a `Result`.
fn check(err: *mut c_char, what: &'static str) -> Result<()> {
    if err.is_null() {
        return Ok(());
    }
    Err(AmpError::torch(what, take_string(err)))
}

/// Takes ownership of a string the shim allocated (strdup) and frees it.
fn take_string(ptr: *mut c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: a non-null pointer from the shim is a NUL-terminated strdup'd string we own.
    let s = unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned();
    // SAFETY: allocated with strdup (malloc); tch_amp_free_error is `free`.
    unsafe { tch_amp_free_error(ptr) };
    s
}

/// The shim-side handle of a tensor (tch's `C_tensor`, an `at::Tensor*`).
fn ptr(t: &Tensor) -> *mut C_tensor {
    t.as_ptr() as *mut C_tensor
}

/// The offset of `t`'s first element in its storage, in elements (`Tensor::storage_offset`,
/// which tch 0.24 lacks); libtorch's message as a [`tch::TchError::Torch`] otherwise.
pub(crate) fn storage_offset(t: &Tensor) -> std::result::Result<i64, tch::TchError> {
    let mut out = 0i64;
    // SAFETY: a live tensor handle and a valid out-pointer for the duration of the call.
    let err = unsafe { tch_amp_storage_offset(t.as_ptr(), &mut out) };
    if err.is_null() {
        Ok(out)
    } else {
        Err(tch::TchError::Torch(take_string(err)))
    }
}

/// Handles of `tensors`, and their count as the shim's `int`.
fn ptrs(tensors: &[Tensor], what: &'static str) -> Result<(Vec<*mut C_tensor>, c_int)> {
    let n = c_int::try_from(tensors.len())
        .map_err(|_| AmpError::torch(what, format!("too many tensors ({}) for one call", tensors.len())))?;
    Ok((tensors.iter().map(ptr).collect(), n))
}

/// `c10::ScalarType` code of a floating kind the shim casts to or from. (tch's own
/// `Kind::c_int` is not public in tch 0.26.)
fn scalar_type_code(kind: Kind) -> Result<c_int> {
    Ok(match kind {
        Kind::Half => 5,
        Kind::Float => 6,
        Kind::Double => 7,
        Kind::BFloat16 => 15,
        other => {
            return Err(AmpError::Config(ConfigError::InvalidOption {
                option: "dtype",
                value: format!("{other:?}"),
                expected: "Half, BFloat16, Float or Double",
            }))
        }
    })
}

/// The kind of a `c10::ScalarType` code handed back by the shim.
fn kind_from_code(code: c_int) -> Result<Kind> {
    Ok(match code {
        5 => Kind::Half,
        6 => Kind::Float,
        7 => Kind::Double,
        15 => Kind::BFloat16,
        other => return Err(AmpError::torch("dtype", format!("unexpected c10::ScalarType code {other}"))),
    })
}

/// `c10::DeviceType` code of a device (CPU = 0, CUDA = 1).
pub(crate) fn device_type_code(device: Device) -> Result<c_int> {
    match device {
        Device::Cpu => Ok(0),
        Device::Cuda(_) => Ok(1),
        other => Err(AmpError::Config(ConfigError::InvalidOption {
            option: "device",
            value: format!("{other:?}"),
            expected: "Device::Cpu or Device::Cuda(_)",
        })),
    }
}
