//! Installing a [`CastPolicy`] in libtorch's dispatcher and activating it on a thread.
//!
//! Installing registers tch-amp's cast kernels at the AutocastCPU and AutocastCUDA dispatch
//! keys (once per process, refcounted across installs); activating makes the policy the
//! calling thread's and turns libtorch's autocast on for one device type, which is what routes
//! that thread's ops through the kernels. Threads without an active policy keep libtorch's own
//! autocast behaviour, exactly.
use std::ffi::{c_int, c_void, CString};
use std::marker::PhantomData;
use std::sync::Arc;

use tch::{Device, Kind};

use super::emulation::emulated_ops;
use super::ffi;
use super::policy::CastPolicy;
use super::settings::O1Settings;
use crate::autocast::AutocastGuard;
use crate::dtype::device_type_code;
use crate::error::{AmpError, Result};
use crate::ffi::check;

/// One installed policy in the engine; dropping the last reference removes it.
#[derive(Debug)]
struct Installed {
    ptr: *mut c_void,
    policy: CastPolicy,
    settings: O1Settings,
}

// SAFETY: the engine's policy object is immutable after install and shared through a
// std::shared_ptr; install/remove are serialized by the engine's mutex.
unsafe impl Send for Installed {}
// SAFETY: as above; nothing mutates the policy through a shared reference.
unsafe impl Sync for Installed {}

impl Drop for Installed {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from tch_amp_cast_policy_install and is removed exactly once.
        let _ = check(unsafe { ffi::tch_amp_cast_policy_remove(self.ptr) }, "cast_policy_remove");
    }
}

/// An installed cast policy. Clones share the installation; when the last clone and the last
/// [`ActivePolicyGuard`] are gone the policy is removed, and when no policy is left tch-amp's
/// kernels are unregistered: every op behaves exactly as plain libtorch (autocast) again.
#[must_use = "the policy is removed as soon as the handle is dropped"]
#[derive(Debug, Clone)]
pub struct PolicyHandle {
    inner: Arc<Installed>,
}

/// Installs `policy` with `settings` and returns its handle; the policy acts on a thread once
/// activated there ([`PolicyHandle::activate`]).
///
/// Several policies may be installed at once (one per model, one per thread...). Install and
/// remove (the last drop) change libtorch's process-wide dispatch tables, which libtorch does
/// not synchronize with ops running on other threads: install before, and drop after, any
/// concurrent autocast work.
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch::{nn, nn::Module, Device, Kind, Tensor};
/// use tch_amp::{install_policy, CastPolicy, O1Settings};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let linear = nn::linear(vs.root(), 4, 4, Default::default());
/// let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
/// let handle = install_policy(CastPolicy::apex(), O1Settings::default())?;
/// {
///     let _active = handle.activate(Device::Cpu)?;
///     let y = linear.forward(&x);
///     assert_eq!(y.kind(), Kind::Half); // linear is on Apex's fp16 list
///     assert_eq!(y.softmax(-1, None).kind(), Kind::Float); // softmax on its fp32 list
/// }
/// assert_eq!(linear.forward(&x).kind(), Kind::Float); // inactive: plain libtorch
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`AmpError::InvalidOption`] when `settings.low_dtype` is not `Half` or `BFloat16`;
/// [`AmpError::UnknownOp`] / [`AmpError::Parse`] when the policy does not resolve (see
/// [`CastPolicy::resolve`]); [`AmpError::Shim`] when libtorch refuses a registration.
pub fn install_policy(policy: CastPolicy, settings: O1Settings) -> Result<PolicyHandle> {
    if !matches!(settings.low_dtype, Kind::Half | Kind::BFloat16) {
        return Err(AmpError::InvalidOption {
            option: "low_dtype",
            value: format!("{:?}", settings.low_dtype),
            expected: "Kind::Half or Kind::BFloat16",
        });
    }
    let spec = engine_spec(&policy, settings)?;
    let c_spec =
        CString::new(spec).map_err(|e| AmpError::Parse { what: "cast policy".into(), message: e.to_string() })?;
    let mut ptr = std::ptr::null_mut();
    // SAFETY: a valid NUL-terminated string and an out-pointer to a local.
    check(
        unsafe { ffi::tch_amp_cast_policy_install(c_spec.as_ptr(), c_int::from(settings.allow_banned), &mut ptr) },
        "cast_policy_install",
    )?;
    Ok(PolicyHandle { inner: Arc::new(Installed { ptr, policy, settings }) })
}

/// The engine's line format: device, category, op name, overload (tab-separated).
fn engine_spec(policy: &CastPolicy, settings: O1Settings) -> Result<String> {
    let mut spec = String::new();
    let mut line = |device: &str, category: &str, op: &str| {
        let (name, overload) = op.split_once('.').unwrap_or((op, ""));
        spec.push_str(&format!("{device}\t{category}\t{name}\t{overload}\n"));
    };
    for (device_name, device) in [("cpu", Device::Cpu), ("cuda", Device::Cuda(0))] {
        for (op, cast) in policy.resolve(device)? {
            line(device_name, cast.code(), &op);
        }
    }
    if settings.emulate_cpu {
        for op in emulated_ops()? {
            line("cpu", "emulate", &op);
        }
    }
    Ok(spec)
}

impl PolicyHandle {
    /// Makes this policy the calling thread's policy for `device`'s type (CPU or CUDA) until the
    /// guard is dropped: libtorch's autocast is turned on for that device type with
    /// [`O1Settings::low_dtype`], and tch-amp's kernels cast every op by the policy's lists.
    /// Dropping the guard restores the previous policy and autocast state, also during a panic;
    /// when it leaves the thread with no policy it also empties the thread's weight-cast cache.
    ///
    /// A backward pass run while the guard is alive is not cast (as under Apex, whose casts
    /// never reached backward): its ops run in the dtypes the forward's casts gave them.
    ///
    /// # Errors
    /// [`AmpError::InvalidOption`] for a device other than CPU/CUDA; [`AmpError::Shim`] when
    /// libtorch refuses.
    pub fn activate(&self, device: Device) -> Result<ActivePolicyGuard> {
        device_type_code(device)?;
        let autocast = AutocastGuard::new(device, true, self.inner.settings.low_dtype)?;
        let mut saved = std::ptr::null_mut();
        // SAFETY: the policy pointer is alive (held by self); `saved` is an out-pointer.
        check(unsafe { ffi::tch_amp_cast_policy_activate(self.inner.ptr, &mut saved) }, "cast_policy_activate")?;
        Ok(ActivePolicyGuard {
            saved,
            _autocast: autocast,
            _installed: Arc::clone(&self.inner),
            _not_send: PhantomData,
        })
    }

    /// Runs `f` with this policy active on the calling thread for `device`'s type (see
    /// [`PolicyHandle::activate`]); restored afterwards, also when `f` panics.
    ///
    /// # Errors
    /// As [`PolicyHandle::activate`].
    pub fn run<T>(&self, device: Device, f: impl FnOnce() -> T) -> Result<T> {
        let _active = self.activate(device)?;
        Ok(f())
    }

    /// The installed policy.
    pub fn policy(&self) -> &CastPolicy {
        &self.inner.policy
    }

    /// The settings it was installed with.
    pub fn settings(&self) -> O1Settings {
        self.inner.settings
    }
}

/// A policy active on the current thread (see [`PolicyHandle::activate`]). Not `Send`:
/// activation is per thread, like libtorch's autocast state.
#[must_use = "the policy is deactivated as soon as the guard is dropped"]
#[derive(Debug)]
pub struct ActivePolicyGuard {
    saved: *mut c_void,
    _autocast: AutocastGuard,
    _installed: Arc<Installed>,
    _not_send: PhantomData<*const ()>,
}

impl Drop for ActivePolicyGuard {
    fn drop(&mut self) {
        let mut none_active: c_int = 0;
        // SAFETY: `saved` came from tch_amp_cast_policy_activate and is restored exactly once.
        let restored =
            check(unsafe { ffi::tch_amp_cast_policy_restore(self.saved, &mut none_active) }, "cast_policy_restore");
        if restored.is_ok() && none_active != 0 {
            let _ = super::cache::clear_cast_cache();
        }
        // `_autocast` restores libtorch's autocast state after this.
    }
}

/// Whether any cast policy is installed in this process (its kernels are registered).
pub fn policy_installed() -> bool {
    ffi::flag(ffi::tch_amp_cast_policy_installed, "cast_policy_installed").unwrap_or(false)
}

/// Whether the calling thread has a tch-amp policy active.
///
/// # Errors
/// [`AmpError::Shim`] if the engine cannot be queried.
pub fn policy_active() -> Result<bool> {
    ffi::flag(ffi::tch_amp_cast_policy_active, "cast_policy_active")
}

/// The aten ops libtorch itself registers at the Autocast key of `device`'s type (captured
/// before tch-amp's kernels when a policy is installed), as `"name"` or `"name.overload"`,
/// sorted. `opt_levels/o1_torch.toml` is these lists, by category.
///
/// # Errors
/// [`AmpError::InvalidOption`] for a device other than CPU/CUDA.
pub fn libtorch_autocast_ops(device: Device) -> Result<Vec<String>> {
    let code = device_type_code(device)?;
    let mut out = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local.
    let err = unsafe { ffi::tch_amp_libtorch_autocast_ops(code, &mut out) };
    let text = ffi::take_string(out);
    check(err, "libtorch_autocast_ops")?;
    Ok(text.lines().filter(|l| !l.is_empty()).map(str::to_string).collect())
}
