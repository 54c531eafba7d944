//! The CPU's capabilities as ATen detects them, oneDNN's low-precision checks, and the counting
//! CPU allocator (`src/shim/cpu.cpp`).
use std::ffi::{c_char, c_int, c_void, CStr};

use super::check;
use crate::error::Result;

type StringSink = unsafe extern "C" fn(ctx: *mut c_void, s: *const c_char);

extern "C" {
    fn tch_amp_cpu_capabilities(ctx: *mut c_void, sink: StringSink) -> *mut c_char;
    fn tch_amp_cpu_memory_tracking_install() -> *mut c_char;
    fn tch_amp_cpu_memory(current: *mut i64, peak: *mut i64, reset_peak: c_int) -> *mut c_char;
    fn tch_amp_keep_freed_memory(applied: *mut c_int) -> *mut c_char;
}

/// Appends each string the shim hands over to the `Vec<String>` behind `ctx`.
unsafe extern "C" fn collect(ctx: *mut c_void, s: *const c_char) {
    // SAFETY: `ctx` is the `&mut Vec<String>` passed by `cpu_capabilities`, alive for the call;
    // `s` is a NUL-terminated string valid during this callback.
    let (out, s) = unsafe { (&mut *(ctx as *mut Vec<String>), CStr::from_ptr(s)) };
    out.push(s.to_string_lossy().into_owned());
}

/// `key=value` lines: `at::cpu::get_cpu_capabilities()` (booleans as 0/1) and oneDNN's
/// `mkldnn`, `mkldnn_enabled`, `mkldnn_bf16`, `mkldnn_fp16`.
pub(crate) fn cpu_capabilities() -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    // SAFETY: `ctx` is a live `Vec<String>` for the duration of the call; `collect` matches
    // the sink signature.
    let err = unsafe { tch_amp_cpu_capabilities(&mut out as *mut Vec<String> as *mut c_void, collect) };
    check(err, "cpu_capabilities")?;
    Ok(out)
}

/// Installs the counting CPU allocator (idempotent).
pub(crate) fn cpu_memory_tracking_install() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { tch_amp_cpu_memory_tracking_install() }, "cpu_memory_tracking_install")
}

/// (current, peak) bytes of the counting allocator; `reset_peak` then sets peak = current.
pub(crate) fn cpu_memory(reset_peak: bool) -> Result<(i64, i64)> {
    let (mut current, mut peak) = (0i64, 0i64);
    // SAFETY: plain out-pointers to locals.
    check(unsafe { tch_amp_cpu_memory(&mut current, &mut peak, c_int::from(reset_peak)) }, "cpu_memory")?;
    Ok((current, peak))
}

/// glibc's malloc set to keep freed memory for reuse (`mallopt`); whether it took effect.
pub(crate) fn keep_freed_memory() -> Result<bool> {
    let mut applied: c_int = 0;
    // SAFETY: a plain out-pointer to a local.
    check(unsafe { tch_amp_keep_freed_memory(&mut applied) }, "keep_freed_memory")?;
    Ok(applied == 1)
}
