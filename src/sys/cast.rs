//! The cast engine's C boundary (`src/shim/cast_engine.cpp`, `cast_policy.h`): policies as
//! arrays of `#[repr(C)]` entries with numeric categories, lists handed back through a
//! callback, and owned handles for installed and saved policies.
use crate::error::ConfigError;
use std::ffi::{c_char, c_int, c_void, CStr, CString};

use tch::{Device, Kind};

use super::{check, device_type_code, kind_from_code, take_string};
use crate::error::{AmpError, Result};

/// A category as the engine numbers it (`Category` and `kEmulate` in `cast_policy.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum EngineCategory {
    /// Registered only: no cast under this policy.
    Passthrough = 0,
    LowPrecision = 1,
    Fp32 = 2,
    Promote = 3,
    Banned = 4,
    /// CPU emulation of a low-precision GEMM/convolution.
    Emulate = 5,
}

/// `tch_amp_cast_entry`.
#[repr(C)]
struct CastEntry {
    device: c_int,
    category: c_int,
    name: *const c_char,
    overload: *const c_char,
    emulate: c_int,
}

type StringSink = unsafe extern "C" fn(ctx: *mut c_void, s: *const c_char);

extern "C" {
    fn tch_amp_aten_overloads(name: *const c_char, ctx: *mut c_void, sink: StringSink) -> *mut c_char;
    fn tch_amp_libtorch_autocast_ops(device: c_int, ctx: *mut c_void, sink: StringSink) -> *mut c_char;
    fn tch_amp_cast_policy_install(
        entries: *const CastEntry,
        n: c_int,
        allow_banned: c_int,
        torch_autocast: c_int,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn tch_amp_cast_policy_release(handle: *mut c_void) -> *mut c_char;
    fn tch_amp_cast_kernels_registered(registered: *mut c_int) -> *mut c_char;
    fn tch_amp_cast_policy_activate(handle: *mut c_void, saved: *mut *mut c_void) -> *mut c_char;
    fn tch_amp_cast_policy_restore(saved: *mut c_void, none_active: *mut c_int) -> *mut c_char;
    fn tch_amp_cast_policy_active(active: *mut c_int) -> *mut c_char;
    fn tch_amp_cast_cache_clear() -> *mut c_char;
    fn tch_amp_cast_cache_len(len: *mut usize) -> *mut c_char;
    fn tch_amp_cast_emulated_count(half: *mut u64, bfloat16: *mut u64) -> *mut c_char;
    fn tch_amp_cast_take_refusal(
        code: *mut c_int,
        dtype: *mut c_int,
        op: *mut *mut c_char,
        message: *mut *mut c_char,
    ) -> *mut c_char;
}

/// Appends each string the shim hands over to the `Vec<String>` behind `ctx`.
unsafe extern "C" fn collect(ctx: *mut c_void, s: *const c_char) {
    // SAFETY: `ctx` is the `&mut Vec<String>` passed by `strings` below, alive for the call;
    // `s` is a NUL-terminated string valid during this callback.
    let (out, s) = unsafe { (&mut *(ctx as *mut Vec<String>), CStr::from_ptr(s)) };
    out.push(s.to_string_lossy().into_owned());
}

/// Runs a shim function that reports a list through the callback.
fn strings(what: &'static str, f: impl FnOnce(*mut c_void, StringSink) -> *mut c_char) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    let err = f(&mut out as *mut Vec<String> as *mut c_void, collect);
    check(err, what)?;
    Ok(out)
}

/// The overload names of `aten::<name>` without `out=` arguments (`""` for the unnamed one).
pub(crate) fn aten_overloads(name: &str) -> Result<Vec<String>> {
    let c_name = CString::new(name)
        .map_err(|e| AmpError::Config(ConfigError::UnknownOp { name: name.to_string(), message: e.to_string() }))?;
    // SAFETY: a valid NUL-terminated string; `ctx`/`sink` come from `strings`.
    strings("aten_overloads", |ctx, sink| unsafe { tch_amp_aten_overloads(c_name.as_ptr(), ctx, sink) })
}

/// The aten ops libtorch registers at `device`'s Autocast key.
pub(crate) fn libtorch_autocast_ops(device: Device) -> Result<Vec<String>> {
    let dev = device_type_code(device)?;
    // SAFETY: `ctx`/`sink` come from `strings`.
    strings("libtorch_autocast_ops", |ctx, sink| unsafe { tch_amp_libtorch_autocast_ops(dev, ctx, sink) })
}

/// One op of a policy: device, category, `"name"` or `"name.overload"`, and for
/// [`EngineCategory::Emulate`] the emulation bits ([`EMULATE_HALF`] | [`EMULATE_BFLOAT16`] |
/// [`EMULATE_RECOMPUTE`]; 0 for other categories).
pub(crate) type PolicyEntry<'a> = (Device, EngineCategory, &'a str, c_int);

/// An installed policy in the engine. Immutable after install and shared through a
/// `std::shared_ptr`; dropping the handle releases it (the kernels stay registered).
#[derive(Debug)]
pub(crate) struct PolicyPtr(*mut c_void);

// SAFETY: the engine's policy object is immutable after install and reference counted by a
// std::shared_ptr; the engine's registry is guarded by its mutex.
unsafe impl Send for PolicyPtr {}
// SAFETY: as above; nothing mutates the policy through a shared reference.
unsafe impl Sync for PolicyPtr {}

impl Drop for PolicyPtr {
    fn drop(&mut self) {
        // SAFETY: the handle came from tch_amp_cast_policy_install and is released exactly once.
        let _ = check(unsafe { tch_amp_cast_policy_release(self.0) }, "cast_policy_release");
    }
}

/// Bits of an emulated op's entry (`kEmulateHalf`, `kEmulateBFloat16`, `kEmulateRecompute` in
/// `cast_policy.h`): emulated for fp16 inputs.
pub(crate) const EMULATE_HALF: c_int = 1;
/// Emulated for bf16 inputs.
pub(crate) const EMULATE_BFLOAT16: c_int = 2;
/// Backward reruns the fp32 op instead of replaying its recorded graph.
pub(crate) const EMULATE_RECOMPUTE: c_int = 4;

/// Builds a policy from `entries`, registering tch-amp's kernels for ops that have none yet.
/// `torch_autocast`: torch.amp's autocast with CPU emulation (libtorch's own autocast kernels
/// for every op but the emulated ones; `entries` hold libtorch's CPU lists).
pub(crate) fn install(entries: &[PolicyEntry<'_>], allow_banned: bool, torch_autocast: bool) -> Result<PolicyPtr> {
    let mut names = Vec::with_capacity(entries.len());
    for &(_, _, op, _) in entries {
        let (name, overload) = op.split_once('.').unwrap_or((op, ""));
        let c = |s: &str| {
            CString::new(s)
                .map_err(|e| AmpError::Config(ConfigError::UnknownOp { name: op.to_string(), message: e.to_string() }))
        };
        names.push((c(name)?, c(overload)?));
    }
    let raw = entries
        .iter()
        .zip(&names)
        .map(|(&(device, category, _, emulate), (name, overload))| {
            Ok(CastEntry {
                device: device_type_code(device)?,
                category: category as c_int,
                name: name.as_ptr(),
                overload: overload.as_ptr(),
                emulate,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let n = c_int::try_from(raw.len()).map_err(|_| {
        AmpError::torch("cast_policy_install", format!("too many cast entries ({}) for one call", raw.len()))
    })?;
    let mut out = std::ptr::null_mut();
    // SAFETY: `raw` holds n entries whose strings (`names`) outlive the call; `out` is an
    // out-pointer to a local.
    check(
        unsafe {
            tch_amp_cast_policy_install(
                raw.as_ptr(),
                n,
                c_int::from(allow_banned),
                c_int::from(torch_autocast),
                &mut out,
            )
        },
        "cast_policy_install",
    )?;
    Ok(PolicyPtr(out))
}

/// The thread's previous policy, saved by [`activate`]; restored by [`SavedPolicy::restore`] or
/// on drop.
#[derive(Debug)]
pub(crate) struct SavedPolicy(*mut c_void);

/// Makes `policy` (None: no policy) the calling thread's active policy.
pub(crate) fn activate(policy: Option<&PolicyPtr>) -> Result<SavedPolicy> {
    let mut saved = std::ptr::null_mut();
    let handle = policy.map_or(std::ptr::null_mut(), |p| p.0);
    // SAFETY: `handle` is NULL or a live policy handle; `saved` is an out-pointer to a local.
    check(unsafe { tch_amp_cast_policy_activate(handle, &mut saved) }, "cast_policy_activate")?;
    Ok(SavedPolicy(saved))
}

impl SavedPolicy {
    /// Restores the saved policy; true when the thread is left with none.
    pub(crate) fn restore(mut self) -> Result<bool> {
        let saved = std::mem::replace(&mut self.0, std::ptr::null_mut());
        restore_raw(saved)
    }
}

fn restore_raw(saved: *mut c_void) -> Result<bool> {
    if saved.is_null() {
        return Ok(false);
    }
    let mut none_active: c_int = 0;
    // SAFETY: `saved` came from tch_amp_cast_policy_activate and is restored exactly once (the
    // owner's pointer is nulled first).
    check(unsafe { tch_amp_cast_policy_restore(saved, &mut none_active) }, "cast_policy_restore")?;
    Ok(none_active != 0)
}

impl Drop for SavedPolicy {
    fn drop(&mut self) {
        let _ = restore_raw(std::mem::replace(&mut self.0, std::ptr::null_mut()));
    }
}

fn flag(f: unsafe extern "C" fn(*mut c_int) -> *mut c_char, what: &'static str) -> Result<bool> {
    let mut value: c_int = 0;
    // SAFETY: a plain out-pointer to a local.
    check(unsafe { f(&mut value) }, what)?;
    Ok(value != 0)
}

/// Whether tch-amp's kernels are registered in this process.
pub(crate) fn kernels_registered() -> Result<bool> {
    flag(tch_amp_cast_kernels_registered, "cast_kernels_registered")
}

/// Which policy the calling thread has active.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ActiveKind {
    /// None: libtorch's own behaviour.
    None,
    /// A cast policy: Apex's lists, or the CPU emulation of O2/O3.
    Cast,
    /// torch.amp's autocast with CPU emulation.
    TorchAutocast,
}

/// Which policy the calling thread has active.
pub(crate) fn active_kind() -> Result<ActiveKind> {
    let mut value: c_int = 0;
    // SAFETY: a plain out-pointer to a local.
    check(unsafe { tch_amp_cast_policy_active(&mut value) }, "cast_policy_active")?;
    Ok(match value {
        0 => ActiveKind::None,
        2 => ActiveKind::TorchAutocast,
        _ => ActiveKind::Cast,
    })
}

/// Empties the calling thread's weight-cast cache.
pub(crate) fn cache_clear() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { tch_amp_cast_cache_clear() }, "cast_cache_clear")
}

/// Entries in the calling thread's weight-cast cache.
pub(crate) fn cache_len() -> Result<usize> {
    let mut len = 0usize;
    // SAFETY: an out-pointer to a local.
    check(unsafe { tch_amp_cast_cache_len(&mut len) }, "cast_cache_len")?;
    Ok(len)
}

/// Ops the calling thread has run through the CPU emulation: (fp16 inputs, bf16 inputs).
pub(crate) fn emulated_count() -> Result<(u64, u64)> {
    let (mut half, mut bfloat16) = (0u64, 0u64);
    // SAFETY: out-pointers to locals.
    check(unsafe { tch_amp_cast_emulated_count(&mut half, &mut bfloat16) }, "cast_emulated_count")?;
    Ok((half, bfloat16))
}

/// Why the cast kernel refused an op (`RefusalCode` in `cast_policy.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RefusalCode {
    BannedOp,
    InPlaceFp32,
}

/// A refusal the calling thread's cast kernel raised: its code, op, the tensor's dtype and the
/// exact message of the error it threw.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) code: RefusalCode,
    pub(crate) op: String,
    pub(crate) dtype: Kind,
    pub(crate) message: String,
}

/// Takes the calling thread's last refusal (the next call returns `None` until another).
pub(crate) fn take_refusal() -> Result<Option<Refusal>> {
    let (mut code, mut dtype) = (0, 0);
    let (mut op, mut message) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: out-pointers to locals; the strings written are strdup'd and owned by us.
    check(unsafe { tch_amp_cast_take_refusal(&mut code, &mut dtype, &mut op, &mut message) }, "cast_take_refusal")?;
    let (op, message) = (take_string(op), take_string(message));
    let code = match code {
        0 => return Ok(None),
        1 => RefusalCode::BannedOp,
        2 => RefusalCode::InPlaceFp32,
        other => return Err(AmpError::torch("cast_take_refusal", format!("unknown refusal code {other}"))),
    };
    Ok(Some(Refusal { code, op, dtype: kind_from_code(dtype)?, message }))
}
