//! Look-ups in libtorch's operator registry (the dispatcher).
use std::ffi::CString;

use crate::error::{AmpError, Result};
use crate::ffi;

/// Checks that `aten::<name>` exists, with an optional overload after a dot
/// (`"mm"`, `"add.Tensor"`).
///
/// # Errors
/// [`AmpError::UnknownOp`] with libtorch's own message when the dispatcher has no such
/// schema (the C++ exception is caught in the shim, never an abort).
pub fn check_aten_op(name: &str) -> Result<()> {
    let (base, overload) = name.split_once('.').unwrap_or((name, ""));
    let unknown = |message: String| AmpError::UnknownOp { name: name.to_string(), message };
    let c_base = CString::new(base).map_err(|e| unknown(e.to_string()))?;
    let c_overload = CString::new(overload).map_err(|e| unknown(e.to_string()))?;
    // SAFETY: two valid NUL-terminated strings that outlive the call.
    let err = unsafe { ffi::tch_amp_find_schema(c_base.as_ptr(), c_overload.as_ptr()) };
    ffi::check(err, "find_schema").map_err(|e| match e {
        AmpError::Shim { message, .. } => unknown(message),
        other => other,
    })
}
