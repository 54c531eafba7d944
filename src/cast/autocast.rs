//! libtorch's autocast switch for any device type, as an RAII guard.
//!
//! tch's own `tch::autocast` only touches CUDA and does not restore its state when the
//! closure panics. [`AutocastGuard`] sets autocast's enabled flag and low-precision dtype for
//! one device type (CPU or CUDA) and restores both on drop, also while unwinding.
//! Autocast state is per thread in libtorch, so the guard is neither `Send` nor `Sync`.
use std::cell::Cell;
use std::marker::PhantomData;

use tch::{Device, Kind};

use crate::error::Result;
use crate::sys;

/// Autocast's state for one device type on the current thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutocastState {
    /// Whether autocast is on.
    pub enabled: bool,
    /// The low-precision dtype (`Kind::Half` or `Kind::BFloat16`).
    pub dtype: Kind,
}

/// Reads autocast's state for `device`'s type on this thread.
///
/// # Errors
/// [`ConfigError::InvalidOption`](crate::error::ConfigError::InvalidOption) for a device other than
/// CPU/CUDA.
pub fn autocast_state(device: Device) -> Result<AutocastState> {
    let (enabled, dtype) = sys::autocast_get(device)?;
    Ok(AutocastState { enabled, dtype })
}

/// Sets autocast's state for `device`'s type on this thread and returns the previous state.
fn set_state(device: Device, state: AutocastState) -> Result<AutocastState> {
    let (enabled, dtype) = sys::autocast_set(device, state.enabled, state.dtype)?;
    Ok(AutocastState { enabled, dtype })
}

fn clear_autocast_cache() -> Result<()> {
    sys::autocast_clear_cache()
}

/// Turns autocast on (or off) for one device type until dropped, then restores the previous
/// enabled flag and dtype, even when dropped during a panic.
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch::{nn, nn::Module, Device, Kind, Tensor};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let linear = nn::linear(vs.root(), 4, 2, Default::default());
/// let x = Tensor::ones([3, 4], (Kind::Float, Device::Cpu));
/// {
///     let _guard = tch_amp::cast::AutocastGuard::new(Device::Cpu, true, Kind::BFloat16)?;
///     assert_eq!(linear.forward(&x).kind(), Kind::BFloat16);
/// }
/// assert_eq!(linear.forward(&x).kind(), Kind::Float);
/// # Ok(())
/// # }
/// ```
#[must_use = "autocast is restored as soon as the guard is dropped"]
#[derive(Debug)]
pub struct AutocastGuard {
    device: Device,
    previous: AutocastState,
    _not_send: PhantomData<*const ()>,
}

impl AutocastGuard {
    /// Sets autocast for `device`'s type to `enabled` with low-precision `dtype` (`Kind::Half` or
    /// `Kind::BFloat16`).
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`](crate::error::ConfigError::InvalidOption) for a device other
    /// than CPU/CUDA or an unsupported dtype; [`AmpError::Torch`](crate::AmpError::Torch) when
    /// libtorch refuses.
    pub fn new(device: Device, enabled: bool, dtype: Kind) -> Result<Self> {
        let previous = set_state(device, AutocastState { enabled, dtype })?;
        Ok(Self { device, previous, _not_send: PhantomData })
    }

    /// The state that was in force before this guard and that drop restores.
    pub fn previous(&self) -> AutocastState {
        self.previous
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        // Restoring a state that was read from libtorch cannot be refused.
        let _ = set_state(self.device, self.previous);
        if !self.previous.enabled {
            let _ = clear_autocast_cache();
        }
    }
}

/// Runs `f` with autocast on for `device`'s type in `dtype`; the previous state is restored
/// afterwards, also when `f` panics.
///
/// # Errors
/// As [`AutocastGuard::new`].
pub fn autocast<T>(device: Device, dtype: Kind, f: impl FnOnce() -> T) -> Result<T> {
    let _guard = AutocastGuard::new(device, true, dtype)?;
    Ok(f())
}

thread_local! {
    /// How many torch.amp autocast scopes ([`crate::AutocastScope`]) are alive on this thread.
    static TORCH_AUTOCAST_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Whether a torch.amp autocast scope is alive on this thread (then no tch-amp cast policy may
/// be activated here).
pub(crate) fn torch_autocast_active() -> bool {
    TORCH_AUTOCAST_DEPTH.with(|d| d.get() > 0)
}

/// Counts a torch.amp autocast scope in (`entering`) or out on this thread.
pub(crate) fn count_torch_autocast(entering: bool) {
    TORCH_AUTOCAST_DEPTH.with(|d| d.set(if entering { d.get().saturating_add(1) } else { d.get().saturating_sub(1) }));
}
