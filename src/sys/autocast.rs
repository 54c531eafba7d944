//! libtorch's autocast state and dispatcher schema look-ups (`src/shim/core.cpp`).
use std::ffi::{c_char, c_int, CString};

use tch::{Device, Kind};

use super::{check, device_type_code, kind_from_code, scalar_type_code};
use crate::error::{AmpError, Result};

extern "C" {
    fn tch_amp_autocast_get(device_type: c_int, enabled: *mut c_int, dtype: *mut c_int) -> *mut c_char;
    fn tch_amp_autocast_set(
        device_type: c_int,
        enabled: c_int,
        dtype: c_int,
        prev_enabled: *mut c_int,
        prev_dtype: *mut c_int,
    ) -> *mut c_char;
    fn tch_amp_autocast_clear_cache() -> *mut c_char;
    fn tch_amp_autocast_cache_enabled(set: c_int, value: c_int, prev: *mut c_int) -> *mut c_char;
    fn tch_amp_autocast_nesting(delta: c_int, out: *mut c_int) -> *mut c_char;
    fn tch_amp_find_schema(name: *const c_char, overload: *const c_char) -> *mut c_char;
    fn tch_amp_set_allow_tf32(on: c_int) -> *mut c_char;
}

/// libtorch's TF32 switches (cuBLAS matmuls and cuDNN convolutions).
pub(crate) fn set_allow_tf32(on: bool) -> Result<()> {
    // SAFETY: a plain integer argument.
    check(unsafe { tch_amp_set_allow_tf32(c_int::from(on)) }, "set_allow_tf32")
}

/// Autocast's (enabled, dtype) for `device`'s type on this thread.
pub(crate) fn autocast_get(device: Device) -> Result<(bool, Kind)> {
    let dev = device_type_code(device)?;
    let (mut enabled, mut dtype) = (0, 0);
    // SAFETY: plain out-pointers to locals.
    check(unsafe { tch_amp_autocast_get(dev, &mut enabled, &mut dtype) }, "autocast_get")?;
    Ok((enabled != 0, kind_from_code(dtype)?))
}

/// Sets autocast's (enabled, dtype) for `device`'s type on this thread; returns the previous.
pub(crate) fn autocast_set(device: Device, enabled: bool, dtype: Kind) -> Result<(bool, Kind)> {
    let dev = device_type_code(device)?;
    let code = scalar_type_code(dtype)?;
    let (mut prev_enabled, mut prev_dtype) = (0, 0);
    // SAFETY: plain out-pointers to locals.
    check(
        unsafe { tch_amp_autocast_set(dev, c_int::from(enabled), code, &mut prev_enabled, &mut prev_dtype) },
        "autocast_set",
    )?;
    Ok((prev_enabled != 0, kind_from_code(prev_dtype)?))
}

/// Empties libtorch's autocast weight-cast cache on this thread.
pub(crate) fn autocast_clear_cache() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { tch_amp_autocast_clear_cache() }, "autocast_clear_cache")
}

/// Autocast's weight-cast-cache flag on this thread; set to `value` when given. Returns the
/// flag as it was before.
pub(crate) fn autocast_cache_enabled(value: Option<bool>) -> Result<bool> {
    let mut prev = 0;
    let (set, v) = (c_int::from(value.is_some()), c_int::from(value.unwrap_or(false)));
    // SAFETY: a plain out-pointer to a local.
    check(unsafe { tch_amp_autocast_cache_enabled(set, v, &mut prev) }, "autocast_cache_enabled")?;
    Ok(prev != 0)
}

/// Autocast's nesting counter on this thread, incremented (`up`) or decremented; the new count.
pub(crate) fn autocast_nesting(up: bool) -> Result<i64> {
    let mut out = 0;
    // SAFETY: a plain out-pointer to a local.
    check(unsafe { tch_amp_autocast_nesting(if up { 1 } else { -1 }, &mut out) }, "autocast_nesting")?;
    Ok(i64::from(out))
}

/// Checks that `aten::<name>` with `overload` ("" for the default) exists; libtorch's message
/// otherwise.
pub(crate) fn find_schema(name: &str, overload: &str) -> Result<()> {
    let shim = |e: std::ffi::NulError| AmpError::torch("find_schema", e.to_string());
    let (c_name, c_overload) = (CString::new(name).map_err(shim)?, CString::new(overload).map_err(shim)?);
    // SAFETY: two valid NUL-terminated strings that outlive the call.
    check(unsafe { tch_amp_find_schema(c_name.as_ptr(), c_overload.as_ptr()) }, "find_schema")
}
