//! Installing a [`CastPolicy`] in libtorch's dispatcher and activating it on a thread.
//!
//! tch-amp's cast kernels sit at the AutocastCPU and AutocastCUDA dispatch keys. They are
//! registered once per process, by the first install, and stay registered: libtorch does not
//! synchronise changes of its dispatch tables with ops running on other threads, so tch-amp
//! changes them as rarely as it can (the first install registers every op of the standard
//! lists; only a user cast naming an op outside them registers more). Installing a policy
//! after that only builds it; activating it makes it the calling thread's policy and turns
//! libtorch's autocast on for one device type, which is what routes that thread's ops through
//! the kernels. Threads without an active policy keep libtorch's own behaviour, exactly.
use crate::error::{ConfigError, UsageError};
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::{Arc, Mutex};

use once_cell::sync::{Lazy, OnceCell};
use tch::{Device, Kind};

use super::cpu::{CpuKernelChoice, CpuKernels, OpClass};
use super::emulation::emulated_op_table;
use super::policy::CastPolicy;
use super::scope::{torch_autocast_active, AutocastScope, Owner, PolicyChange};
use super::settings::CastSettings;
use crate::error::{AmpError, Result};
use crate::sys::cast::{self as engine, EngineCategory, PolicyEntry, PolicyPtr};

/// One op of a policy being built: device, category, op, emulation bits.
type OwnedEntry = (Device, EngineCategory, String, c_int);

/// One installed policy; dropping the last reference releases it.
#[derive(Debug)]
struct Installed {
    ptr: PolicyPtr,
    policy: CastPolicy,
    settings: CastSettings,
}

/// An installed cast policy. Clones share it; it is released when the last clone and the last
/// [`AutocastScope`] activating it are gone (tch-amp's kernels stay registered).
#[must_use = "the policy is released as soon as the handle is dropped"]
#[derive(Debug, Clone)]
pub struct PolicyHandle {
    inner: Arc<Installed>,
}

/// Every op of the standard lists (Apex's and libtorch's for CPU and CUDA, and the CPU
/// emulation list), registered at the first install so that later installs register nothing.
fn standard_ops() -> Result<Vec<(Device, String)>> {
    let mut ops = Vec::new();
    for policy in [CastPolicy::apex(), CastPolicy::torch_native()] {
        for device in [Device::Cpu, Device::Cuda(0)] {
            ops.extend(policy.resolve(device)?.into_keys().map(|op| (device, op)));
        }
    }
    ops.extend(emulated_op_table()?.into_iter().map(|e| (Device::Cpu, e.op)));
    Ok(ops)
}

/// Set once the standard ops are registered.
static STANDARD_REGISTERED: OnceCell<()> = OnceCell::new();

/// Installs `policy` with `settings` and returns its handle; the policy acts on a thread once
/// activated there ([`PolicyHandle::activate`]).
///
/// Several policies may be installed at once (one per model, one per thread...). The first install
/// in a process registers tch-amp's kernels for good; do it before starting threads that run
/// libtorch autocast concurrently, and keep user casts of ops outside the standard lists (which
/// register more) to start-up as well.
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch::{nn, nn::Module, Device, Kind, Tensor};
/// use tch_amp::cast::install_policy;
/// use tch_amp::CastPolicy;
/// use tch_amp::cast::CastSettings;
/// let vs = nn::VarStore::new(Device::Cpu);
/// let linear = nn::linear(vs.root(), 4, 4, Default::default());
/// let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
/// let handle = install_policy(CastPolicy::apex(), CastSettings::default())?;
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
/// [`ConfigError::InvalidOption`] when `settings.low_precision_dtype` is not `Half` or `BFloat16`;
/// [`ConfigError::UnknownOp`] / [`ConfigError::Parse`] when the policy does not resolve (see
/// [`CastPolicy::resolve`]); [`AmpError::Torch`](crate::AmpError::Torch) when libtorch refuses a
/// registration (nothing is registered then).
pub fn install_policy(policy: CastPolicy, settings: CastSettings) -> Result<PolicyHandle> {
    if !matches!(settings.low_precision_dtype, Kind::Half | Kind::BFloat16) {
        return Err(AmpError::Config(ConfigError::InvalidOption {
            option: "low_precision_dtype",
            value: format!("{:?}", settings.low_precision_dtype),
            expected: "Kind::Half or Kind::BFloat16",
        }));
    }
    let mut owned: Vec<OwnedEntry> = Vec::new();
    for device in [Device::Cpu, Device::Cuda(0)] {
        owned.extend(policy.resolve(device)?.into_iter().map(|(op, cast)| (device, cast.engine_category(), op, 0)));
    }
    let settings = settings.resolved();
    owned.extend(emulation_entries(|class| {
        [(Kind::Half, engine::EMULATE_HALF), (Kind::BFloat16, engine::EMULATE_BFLOAT16)]
            .into_iter()
            .filter(|(kind, _)| settings.emulates_class(*kind, class))
            .fold(0, |bits, (_, bit)| bits | bit)
    })?);
    let ptr = install_entries(owned, settings.allow_banned, false)?;
    Ok(PolicyHandle { inner: Arc::new(Installed { ptr, policy, settings }) })
}

/// The emulation list's entries for the classes to which `dtypes` gives a nonzero mask
/// ([`engine::EMULATE_HALF`] | [`engine::EMULATE_BFLOAT16`]).
fn emulation_entries(dtypes: impl Fn(OpClass) -> c_int) -> Result<Vec<OwnedEntry>> {
    Ok(emulated_op_table()?
        .into_iter()
        .filter_map(|e| {
            let mask = dtypes(e.class);
            let recompute = if e.recompute { engine::EMULATE_RECOMPUTE } else { 0 };
            (mask != 0).then_some((Device::Cpu, EngineCategory::Emulate, e.op, mask | recompute))
        })
        .collect())
}

/// Installs a policy of `owned` entries; the first install of the process also registers the
/// standard ops.
fn install_entries(mut owned: Vec<OwnedEntry>, allow_banned: bool, torch_autocast: bool) -> Result<PolicyPtr> {
    let first = STANDARD_REGISTERED.get().is_none();
    if first {
        owned.extend(standard_ops()?.into_iter().map(|(device, op)| (device, EngineCategory::Passthrough, op, 0)));
    }
    let entries: Vec<PolicyEntry<'_>> = owned.iter().map(|(d, c, op, e)| (*d, *c, op.as_str(), *e)).collect();
    let ptr = engine::install(&entries, allow_banned, torch_autocast)?;
    if first {
        let _ = STANDARD_REGISTERED.set(());
    }
    Ok(ptr)
}

/// torch.amp's autocast with the classes that `choice` (resolved) emulates of `kind`'s (`Half`
/// or `BFloat16`) CPU ops: libtorch's own autocast kernels for every other op. `None` when
/// `choice` emulates no class (libtorch's own kernels throughout: no policy). Installed once per
/// type and set of emulated classes, for the life of the process (at most 14).
pub(crate) fn torch_autocast_policy(kind: Kind, choice: CpuKernelChoice) -> Result<Option<&'static PolicyPtr>> {
    /// Keyed by (fp16?, which classes are emulated).
    type Policies = HashMap<(bool, [bool; 3]), &'static PolicyPtr>;
    static POLICIES: Lazy<Mutex<Policies>> = Lazy::new(Default::default);
    let emulated = OpClass::ALL.map(|c| choice.get(c) == CpuKernels::Emulate);
    if !emulated.contains(&true) {
        return Ok(None);
    }
    let key = (kind == Kind::Half, emulated);
    let mut policies = POLICIES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = policies.get(&key) {
        return Ok(Some(*p));
    }
    let bit = if kind == Kind::Half { engine::EMULATE_HALF } else { engine::EMULATE_BFLOAT16 };
    let mut owned: Vec<OwnedEntry> = CastPolicy::torch_native()
        .resolve(Device::Cpu)?
        .into_iter()
        .map(|(op, cast)| (Device::Cpu, cast.engine_category(), op, 0))
        .collect();
    owned.extend(emulation_entries(|class| if choice.get(class) == CpuKernels::Emulate { bit } else { 0 })?);
    // Kept for the life of the process (one per key), so activations may borrow it.
    let ptr: &'static PolicyPtr = Box::leak(Box::new(install_entries(owned, false, true)?));
    policies.insert(key, ptr);
    Ok(Some(ptr))
}

impl PolicyHandle {
    /// Makes this policy the calling thread's policy for `device`'s type (CPU or CUDA) until the
    /// guard is dropped: libtorch's autocast is turned on for that device type with
    /// [`CastSettings::low_precision_dtype`], and tch-amp's kernels cast every op by the policy's
    /// lists. Dropping the guard restores the previous policy and autocast state, also during a
    /// panic; when it leaves the thread with no policy it also empties the thread's weight-cast
    /// cache.
    ///
    /// A backward pass run while the guard is alive is not cast (as under Apex, whose casts never
    /// reached backward): its ops run in the dtypes the forward's casts gave them.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a device other than CPU/CUDA;
    /// [`AmpError::Torch`](crate::AmpError::Torch) when libtorch refuses;
    /// [`UsageError::AutocastConflict`] while a torch.amp autocast scope
    /// ([`crate::AutocastScope`]) is alive on this thread.
    pub fn activate(&self, device: Device) -> Result<AutocastScope> {
        if torch_autocast_active() {
            return Err(AmpError::Usage(UsageError::AutocastConflict {
                entering: "tch-amp's Apex cast policy",
                active: "torch.amp autocast",
            }));
        }
        let keep: Arc<Installed> = Arc::clone(&self.inner);
        AutocastScope::enter(
            device,
            true,
            self.inner.settings.low_precision_dtype,
            None,
            PolicyChange::Activate(&self.inner.ptr),
            Owner::Engine,
            Some(keep),
        )
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
    pub fn settings(&self) -> CastSettings {
        self.inner.settings
    }
}

/// Whether tch-amp's kernels are registered in this process (they stay once they are).
pub(crate) fn kernels_registered() -> bool {
    engine::kernels_registered().unwrap_or(false)
}

/// Whether the calling thread has a tch-amp cast policy active (Apex's lists, or the CPU
/// emulation of O2/O3; not torch.amp's autocast).
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) if the engine cannot be queried.
pub(crate) fn policy_active() -> Result<bool> {
    Ok(engine::active_kind()? == engine::ActiveKind::Cast)
}

/// The aten ops libtorch itself registers at the Autocast key of `device`'s type (captured before
/// tch-amp's kernels), as `"name"` or `"name.overload"`, sorted. `opt_levels/o1_torch.toml` is
/// these lists, by category.
///
/// # Errors
/// [`ConfigError::InvalidOption`] for a device other than CPU/CUDA.
pub(crate) fn libtorch_autocast_ops(device: Device) -> Result<Vec<String>> {
    engine::libtorch_autocast_ops(device)
}
