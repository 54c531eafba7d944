//! Raw bindings to the cast-policy engine (`src/shim/cast_policy.cpp`). Nothing here is public.
use std::ffi::{c_char, c_int, c_void, CStr};

use crate::error::Result;
use crate::ffi::{check, tch_amp_free_error};

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

/// Reads an `int` flag from the shim.
pub(crate) fn flag(f: unsafe extern "C" fn(*mut c_int) -> *mut c_char, what: &'static str) -> Result<bool> {
    let mut value: c_int = 0;
    // SAFETY: a plain out-pointer to a local.
    check(unsafe { f(&mut value) }, what)?;
    Ok(value != 0)
}
