//! Turning O1's casts off for a region (Apex's `disable_casts`).
use tch::Device;

use super::scope::{autocast_state, AutocastScope, Owner, PolicyChange};
use crate::error::Result;

/// While alive, the current thread runs with no cast policy and with libtorch's autocast off
/// for CPU and CUDA: every op runs in its inputs' dtypes, as in plain tch. Dropping it restores
/// the previous policy and autocast state, also during a panic (Apex's `disable_casts` had no
/// `finally` and left casts off after an exception).
#[must_use = "casts come back as soon as the guard is dropped"]
#[derive(Debug)]
pub struct DisableCastsGuard {
    // Field order is drop order: the CPU scope (which also cleared the policy) ends first.
    _cpu: AutocastScope,
    _cuda: AutocastScope,
}

/// Turns casts off on the current thread until the guard is dropped (see
/// [`DisableCastsGuard`]). The optimizer step runs this way, as in Apex.
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) when libtorch refuses the autocast change.
pub fn disable_casts() -> Result<DisableCastsGuard> {
    let off = |device: Device, policy| {
        AutocastScope::enter(device, false, autocast_state(device)?.dtype, None, policy, Owner::Engine, None)
    };
    let cuda = off(Device::Cuda(0), PolicyChange::Keep)?;
    let cpu = off(Device::Cpu, PolicyChange::Clear)?;
    Ok(DisableCastsGuard { _cpu: cpu, _cuda: cuda })
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
