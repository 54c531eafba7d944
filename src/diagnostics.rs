//! Diagnostics for tests and debugging: what the cast engine registered, resolved and cached.
//! Not part of the stable API.
use tch::Device;

use crate::error::{AmpError, Result};

pub use crate::cast::emulation::emulated_ops;
pub use crate::cast::policy::aten_overloads;

/// Whether tch-amp's cast kernels are registered in this process (they stay once they are).
pub fn kernels_registered() -> bool {
    crate::cast::kernels_registered()
}

/// Whether the calling thread has a tch-amp cast policy active.
///
/// # Errors
/// [`AmpError::Shim`] if the engine cannot be queried.
pub fn policy_active() -> Result<bool> {
    crate::cast::policy_active()
}

/// How many casts the calling thread's weight-cast cache holds.
///
/// # Errors
/// [`AmpError::Shim`] if the engine cannot be queried.
pub fn cast_cache_len() -> Result<usize> {
    crate::cast::cast_cache_len()
}

/// The aten ops libtorch itself registers at the Autocast key of `device`'s type (captured
/// before tch-amp's kernels), as `"name"` or `"name.overload"`, sorted.
///
/// # Errors
/// [`AmpError::InvalidOption`] for a device other than CPU/CUDA.
pub fn libtorch_autocast_ops(device: Device) -> Result<Vec<String>> {
    crate::cast::libtorch_autocast_ops(device)
}

/// Checks that `aten::<name>` exists, with an optional overload after a dot
/// (`"mm"`, `"add.Tensor"`).
///
/// # Errors
/// [`AmpError::UnknownOp`] with libtorch's own message when the dispatcher has no such
/// schema (the C++ exception is caught in the shim, never an abort).
pub fn check_aten_op(name: &str) -> Result<()> {
    let (base, overload) = name.split_once('.').unwrap_or((name, ""));
    crate::sys::find_schema(base, overload).map_err(|e| match e {
        AmpError::Shim { message, .. } => AmpError::UnknownOp { name: name.to_string(), message },
        other => other,
    })
}

/// How many times the calling thread inspected gradients beyond the one overflow flag of a
/// `scale_loss` exit: per-parameter inf/NaN counts at an overflow, and the all-zero check at
/// the scale's floor. A clean pass above the floor adds nothing (tests check it).
pub fn gradient_scans() -> u64 {
    crate::optim::gradient_scans()
}
