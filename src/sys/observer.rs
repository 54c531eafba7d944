//! The op observer (`src/shim/observer.cpp`): a session on the calling thread reports each
//! top-level op (outputs, input dtypes, which inputs are the session's weights) and each backward
//! node that is the grad_fn of such an op's output (the gradients it receives) to a Rust handler.
//! Also the default generators' states, which a diagnostic run saves and restores.
use std::ffi::{c_char, c_int, c_void, CStr};
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

use super::{check, kind_from_code, ptr, ptrs};
use crate::error::Result;

/// What the shim saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ObservedKind {
    /// A top-level op finished: `tensors` are its floating outputs.
    Forward,
    /// A backward node of an op's output starts: `tensors` are the gradients it receives.
    Backward,
}

/// One observation (`tch_amp_observed`).
#[derive(Debug)]
pub(crate) struct Observed {
    pub(crate) kind: ObservedKind,
    /// The aten op without namespace (`"conv2d"`), or the node's name.
    pub(crate) name: String,
    /// The op's index since the session was opened or reset.
    pub(crate) op: usize,
    /// Indices (into the session's weights) of the inputs that are weights (forward only).
    pub(crate) weights: Vec<usize>,
    /// Dtypes of the floating tensor inputs (forward only).
    pub(crate) input_kinds: Vec<Kind>,
    pub(crate) tensors: Vec<Tensor>,
}

/// Receives the observations; may run on libtorch's backward threads.
pub(crate) type Handler = dyn Fn(Observed) + Send + Sync;

#[repr(C)]
struct RawObserved {
    kind: c_int,
    name: *const c_char,
    op: i64,
    weights: *const i64,
    nweights: c_int,
    dtypes: *const c_int,
    ndtypes: c_int,
    tensors: *mut *mut C_tensor,
    ntensors: c_int,
}

type Sink = unsafe extern "C" fn(ctx: *mut c_void, ev: *const RawObserved);

extern "C" {
    fn tch_amp_observer_start(
        weights: *const *mut C_tensor,
        n: c_int,
        ctx: *mut c_void,
        sink: Sink,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn tch_amp_observer_stop(session: *mut c_void) -> *mut c_char;
    fn tch_amp_observer_reset(session: *mut c_void) -> *mut c_char;
    fn tch_amp_observer_pause(paused: c_int, previous: *mut c_int) -> *mut c_char;
    fn tch_amp_rng_state(device_type: c_int, index: c_int, out: *mut *mut C_tensor) -> *mut c_char;
    fn tch_amp_set_rng_state(device_type: c_int, index: c_int, state: *mut C_tensor) -> *mut c_char;
}

/// `n` values at `p` (none for a null pointer).
///
/// # Safety
/// A non-null `p` points to `n` readable values.
unsafe fn slice<'a, T>(p: *const T, n: c_int) -> &'a [T] {
    if p.is_null() || n <= 0 {
        return &[];
    }
    // SAFETY: by the caller's contract.
    unsafe { std::slice::from_raw_parts(p, n as usize) }
}

unsafe extern "C" fn sink(ctx: *mut c_void, ev: *const RawObserved) {
    // SAFETY: `ctx` is the `Box<Arc<Handler>>` of a live `Observer`; `ev` is valid during the call.
    let (handler, ev) = unsafe { (&*(ctx as *const Arc<Handler>), &*ev) };
    // SAFETY: the shim hands over `ntensors` new handles; we own them from here on.
    let tensors: Vec<Tensor> =
        unsafe { slice(ev.tensors, ev.ntensors) }.iter().map(|&p| unsafe { Tensor::from_ptr(p) }).collect();
    // SAFETY: a NUL-terminated string valid during the call.
    let name = unsafe { CStr::from_ptr(ev.name) }.to_string_lossy().into_owned();
    // SAFETY: `nweights` / `ndtypes` values behind the pointers.
    let (weights, dtypes) = unsafe { (slice(ev.weights, ev.nweights), slice(ev.dtypes, ev.ndtypes)) };
    let observed = Observed {
        kind: if ev.kind == 0 { ObservedKind::Forward } else { ObservedKind::Backward },
        name,
        op: ev.op.max(0) as usize,
        weights: weights.iter().map(|&w| w.max(0) as usize).collect(),
        input_kinds: dtypes.iter().filter_map(|&d| kind_from_code(d).ok()).collect(),
        tensors,
    };
    // A panic must not cross into libtorch; the handler records its own failures.
    let _ = catch_unwind(AssertUnwindSafe(|| handler(observed)));
}

/// An open session on the calling thread (not `Send`: it is closed where it was opened).
/// Dropping it closes the session; a session opened on a thread that already has one hides
/// that one until then.
pub(crate) struct Observer {
    session: *mut c_void,
    handler: *mut Arc<Handler>,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer").finish_non_exhaustive()
    }
}

impl Observer {
    /// Opens a session that matches op inputs against `weights` (by identity: the same tensor,
    /// whatever its data becomes) and hands each observation to `handler`.
    pub(crate) fn start(weights: &[Tensor], handler: Arc<Handler>) -> Result<Self> {
        let (handles, n) = ptrs(weights, "observer_start")?;
        let boxed = Box::into_raw(Box::new(handler));
        let mut session = std::ptr::null_mut();
        // SAFETY: live handles for the call; `boxed` stays alive until this Observer is dropped,
        // after the session is closed (no call into `sink` can follow).
        let err = unsafe { tch_amp_observer_start(handles.as_ptr(), n, boxed as *mut c_void, sink, &mut session) };
        if let Err(e) = check(err, "opening the op observer") {
            // SAFETY: the shim did not keep `boxed`.
            drop(unsafe { Box::from_raw(boxed) });
            return Err(e);
        }
        Ok(Self { session, handler: boxed, _not_send: PhantomData })
    }

    /// Starts the op count again from 0 and forgets the graph nodes seen so far.
    pub(crate) fn reset(&self) -> Result<()> {
        // SAFETY: a live session.
        check(unsafe { tch_amp_observer_reset(self.session) }, "resetting the op observer")
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        // SAFETY: a live session, closed once, on its thread (the type is not Send).
        let _ = check(unsafe { tch_amp_observer_stop(self.session) }, "closing the op observer");
        // SAFETY: the box of `start`; the closed session no longer calls the sink.
        drop(unsafe { Box::from_raw(self.handler) });
    }
}

/// Stops (`true`) or resumes reporting the calling thread's top-level ops; returns the former
/// setting.
pub(crate) fn pause(paused: bool) -> Result<bool> {
    let mut previous: c_int = 0;
    // SAFETY: an out-pointer to a local.
    check(unsafe { tch_amp_observer_pause(c_int::from(paused), &mut previous) }, "pausing the op observer")?;
    Ok(previous != 0)
}

fn device_codes(device: Device) -> Result<(c_int, c_int)> {
    let index = match device {
        Device::Cuda(i) => i as c_int,
        _ => 0,
    };
    Ok((super::device_type_code(device)?, index))
}

/// The state of `device`'s default random generator (`torch.get_rng_state()`).
pub(crate) fn rng_state(device: Device) -> Result<Tensor> {
    let (ty, index) = device_codes(device)?;
    let mut out = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local.
    check(unsafe { tch_amp_rng_state(ty, index, &mut out) }, "reading the random generator's state")?;
    // SAFETY: a `new at::Tensor` we now own.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Restores a state read by [`rng_state`].
pub(crate) fn set_rng_state(device: Device, state: &Tensor) -> Result<()> {
    let (ty, index) = device_codes(device)?;
    // SAFETY: a live tensor handle for the call.
    check(unsafe { tch_amp_set_rng_state(ty, index, ptr(state)) }, "restoring the random generator's state")
}
