//! The one autocast guard, as torch's `autocast_mode.py` keeps it: entering saves libtorch's
//! autocast state for one device type (enabled flag, dtype, cache flag), sets the scope's, counts
//! the scope in libtorch's nesting counter and may switch the thread's cast policy; dropping it
//! restores all of that, also while unwinding. torch.amp's [`crate::Autocast`], an activated
//! Apex policy ([`crate::cast::PolicyHandle::activate`]) and [`crate::disable_casts`] are all
//! this guard with different policies.
use std::any::Any;
use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;

use tch::{Device, Kind};

use crate::error::Result;
use crate::sys;
use crate::sys::cast::{PolicyPtr, SavedPolicy};

/// Autocast's state for one device type on the current thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutocastState {
    /// Whether autocast is on.
    pub enabled: bool,
    /// The low-precision dtype (`Kind::Half` or `Kind::BFloat16`).
    pub dtype: Kind,
}

/// Reads autocast's state for `device`'s type on this thread.
pub(crate) fn autocast_state(device: Device) -> Result<AutocastState> {
    let (enabled, dtype) = sys::autocast_get(device)?;
    Ok(AutocastState { enabled, dtype })
}

thread_local! {
    /// How many torch.amp autocast scopes are alive on this thread.
    static TORCH_AUTOCAST_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Whether a torch.amp autocast scope is alive on this thread (then no tch-amp cast policy may
/// be activated here).
pub(crate) fn torch_autocast_active() -> bool {
    TORCH_AUTOCAST_DEPTH.with(|d| d.get() > 0)
}

/// What a scope does to the thread's cast policy.
pub(crate) enum PolicyChange<'a> {
    /// Leaves it as it is.
    Keep,
    /// Makes this policy the thread's until the scope ends.
    Activate(&'a PolicyPtr),
    /// No policy until the scope ends.
    Clear,
}

/// Who enters a scope: torch.amp's autocast (counted for the conflict with Apex's policies) or
/// tch-amp's own policy machinery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    /// torch.amp's `autocast`.
    Torch,
    /// An Apex cast policy, or casts turned off.
    Engine,
}

/// A live autocast scope on this thread. Dropping it restores the previous enabled flag, dtype,
/// cache flag and cast policy, and empties libtorch's weight-cast cache when it was the
/// outermost scope (torch's `__exit__`). Not `Send`: autocast is per thread.
#[must_use = "autocast ends as soon as the scope is dropped"]
#[derive(Debug)]
pub struct AutocastScope {
    device: Device,
    previous: AutocastState,
    // What entering changed, so that drop undoes exactly that (entering stops at a failure).
    previous_cache: Option<bool>,
    nested: bool,
    counted: bool,
    // The thread's previous cast policy, when this scope changed it.
    policy: Option<SavedPolicy>,
    // Keeps an activated policy alive while the scope is.
    _keep: Option<Arc<dyn Any + Send + Sync>>,
    _not_send: PhantomData<*const ()>,
}

impl AutocastScope {
    /// Enters a scope for `device`'s type: autocast `enabled` in `dtype`, the cache flag set when
    /// given, the policy changed as asked.
    pub(crate) fn enter(
        device: Device,
        enabled: bool,
        dtype: Kind,
        cache: Option<bool>,
        policy: PolicyChange<'_>,
        owner: Owner,
        keep: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Self> {
        // The autocast state first: it is the step that can be refused (a device or dtype).
        let (was_enabled, was_dtype) = sys::autocast_set(device, enabled, dtype)?;
        let mut scope = Self {
            device,
            previous: AutocastState { enabled: was_enabled, dtype: was_dtype },
            previous_cache: None,
            nested: false,
            counted: false,
            policy: None,
            _keep: keep,
            _not_send: PhantomData,
        };
        // A failure from here on (not expected) drops `scope`, which undoes what was set.
        scope.previous_cache = Some(sys::autocast_cache_enabled(cache)?);
        sys::autocast_nesting(true)?;
        scope.nested = true;
        if owner == Owner::Torch {
            TORCH_AUTOCAST_DEPTH.with(|d| d.set(d.get().saturating_add(1)));
            scope.counted = true;
        }
        scope.policy = match policy {
            PolicyChange::Keep => None,
            PolicyChange::Activate(p) => Some(sys::cast::activate(Some(p))?),
            PolicyChange::Clear => Some(sys::cast::activate(None)?),
        };
        Ok(scope)
    }

    /// The state that was in force before this scope and that drop restores.
    pub fn previous(&self) -> AutocastState {
        self.previous
    }
}

impl Drop for AutocastScope {
    fn drop(&mut self) {
        // Restoring values read from libtorch cannot be refused.
        if let Some(saved) = self.policy.take() {
            if saved.restore().unwrap_or(false) {
                // The cast engine's cached casts of leaf weights (O1's, or the emulation's fp32
                // copies) go with the last policy.
                let _ = sys::cast::cache_clear();
            }
        }
        if self.counted {
            TORCH_AUTOCAST_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        }
        if self.nested && matches!(sys::autocast_nesting(false), Ok(0)) {
            let _ = sys::autocast_clear_cache();
        }
        let _ = sys::autocast_set(self.device, self.previous.enabled, self.previous.dtype);
        if let Some(cache) = self.previous_cache {
            let _ = sys::autocast_cache_enabled(Some(cache));
        }
    }
}
