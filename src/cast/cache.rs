//! O1's weight-cast cache.
//!
//! Under an active policy each fp32 leaf tensor that requires grad (a model weight) is cast to
//! the low-precision dtype once and reused, per thread, keyed by the weight and the target
//! dtype. An entry remembers the weight's version counter: a weight changed in place (an
//! optimizer step) is cast again. Entries are made only while grad mode is on, so a cast made
//! under `no_grad` (evaluation), which has no autograd edge back to the weight, never reaches a
//! later training forward, which would leave the weight without a gradient (Apex cached such
//! casts and dropped them again by comparing `requires_grad` flags). A weight used twice in one
//! forward (tied weights, a layer applied twice, RNN cells over time) shares one cast; Apex's
//! cache raised `IndexError` there on PyTorch 2.x.
use crate::error::Result;
use crate::sys;

/// Empties the calling thread's weight-cast caches: tch-amp's and libtorch's autocast cache.
/// Apex clears its cache at each `scale_loss` exit; tch-amp's `scale_loss` does the same, and
/// so does the drop of the last active policy guard on a thread.
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) if libtorch fails (it does not in practice).
pub fn clear_cast_cache() -> Result<()> {
    sys::cast::cache_clear()?;
    sys::autocast_clear_cache()
}

/// How many casts the calling thread's cache holds (diagnostics and tests).
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) if the engine cannot be queried.
pub(crate) fn cast_cache_len() -> Result<usize> {
    sys::cast::cache_len()
}
