//! Raw bindings to the cast-policy engine (`src/shim/cast_policy.cpp`). Nothing here is public.
use std::ffi::{c_char, c_int, c_void};

use crate::error::Result;
use crate::ffi::check;
pub(crate) use crate::ffi::take_string;

extern "C" {
    pub(crate) fn tch_amp_aten_overloads(name: *const c_char, count: *mut c_int, out: *mut *mut c_char) -> *mut c_char;
    pub(crate) fn tch_amp_libtorch_autocast_ops(device_type: c_int, out: *mut *mut c_char) -> *mut c_char;
    pub(crate) fn tch_amp_cast_policy_install(
        spec: *const c_char,
        allow_banned: c_int,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    pub(crate) fn tch_amp_cast_policy_remove(handle: *mut c_void) -> *mut c_char;
    pub(crate) fn tch_amp_cast_policy_installed(installed: *mut c_int) -> *mut c_char;
    pub(crate) fn tch_amp_cast_policy_activate(handle: *mut c_void, saved: *mut *mut c_void) -> *mut c_char;
    pub(crate) fn tch_amp_cast_policy_restore(saved: *mut c_void, none_active: *mut c_int) -> *mut c_char;
    pub(crate) fn tch_amp_cast_policy_active(active: *mut c_int) -> *mut c_char;
    pub(crate) fn tch_amp_cast_cache_clear() -> *mut c_char;
    pub(crate) fn tch_amp_cast_cache_len(len: *mut usize) -> *mut c_char;
}

/// Reads an `int` flag from the shim.
pub(crate) fn flag(f: unsafe extern "C" fn(*mut c_int) -> *mut c_char, what: &'static str) -> Result<bool> {
    let mut value: c_int = 0;
    // SAFETY: a plain out-pointer to a local.
    check(unsafe { f(&mut value) }, what)?;
    Ok(value != 0)
}
