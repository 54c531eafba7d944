//! Turning O1's casts off for a region (Apex's `disable_casts`).
use std::marker::PhantomData;

use tch::Device;

use super::autocast::{autocast_state, AutocastGuard};
use crate::error::Result;
use crate::sys::cast::{self as engine, SavedPolicy};

/// While alive, the current thread runs with no cast policy and with libtorch's autocast off
/// for CPU and CUDA: every op runs in its inputs' dtypes, as in plain tch. Dropping it restores
/// the previous policy and autocast state, also during a panic (Apex's `disable_casts` had no
/// `finally` and left casts off after an exception).
#[must_use = "casts come back as soon as the guard is dropped"]
#[derive(Debug)]
pub struct DisableCastsGuard {
    // Field order is drop order: the policy comes back first, then autocast.
    _saved: SavedPolicy,
    _cpu: AutocastGuard,
    _cuda: AutocastGuard,
    _not_send: PhantomData<*const ()>,
}

/// Turns casts off on the current thread until the guard is dropped (see
/// [`DisableCastsGuard`]). The optimizer step runs this way, as in Apex.
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) when libtorch refuses the autocast change.
pub fn disable_casts() -> Result<DisableCastsGuard> {
    let cpu = AutocastGuard::new(Device::Cpu, false, autocast_state(Device::Cpu)?.dtype)?;
    let cuda = AutocastGuard::new(Device::Cuda(0), false, autocast_state(Device::Cuda(0))?.dtype)?;
    let saved = engine::activate(None)?;
    Ok(DisableCastsGuard { _saved: saved, _cpu: cpu, _cuda: cuda, _not_send: PhantomData })
}

/// Runs `f` with casts off (see [`disable_casts`]); they come back afterwards, also when `f`
/// panics.
///
/// # Errors
/// As [`disable_casts`].
pub fn without_casts<T>(f: impl FnOnce() -> T) -> Result<T> {
    let _off = disable_casts()?;
    Ok(f())
}
