//! A custom autograd function with a Rust backward (`src/shim/autograd.cpp`): the one
//! mechanism tch-amp uses where PyTorch code defines a `torch.autograd.Function`.
use std::ffi::{c_char, c_int, c_void, CString};
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};

use tch::Tensor;
use torch_sys::C_tensor;

use super::{check, ptr};
use crate::error::{AmpError, Result};

/// What a backward receives: the gradients of the outputs (`None` where libtorch has none),
/// the tensors saved in the forward, and which inputs need a gradient.
pub(crate) struct BackwardArgs {
    pub grads: Vec<Option<Tensor>>,
    pub saved: Vec<Tensor>,
    pub needs_input_grad: Vec<bool>,
}

/// A backward: one gradient (or `None`) per forward input. It may run on another thread than
/// the forward (libtorch's CUDA backward threads), hence `Send`.
pub(crate) type Backward = Box<dyn FnMut(BackwardArgs) -> Result<Vec<Option<Tensor>>> + Send>;

type BackwardFn = unsafe extern "C" fn(
    state: *mut c_void,
    grads: *mut *mut C_tensor,
    n_grads: c_int,
    saved: *mut *mut C_tensor,
    n_saved: c_int,
    needs: *const c_int,
    out: *mut *mut C_tensor,
    n_inputs: c_int,
) -> *const c_char;
type DropFn = unsafe extern "C" fn(state: *mut c_void);

extern "C" {
    fn tch_amp_custom_function(
        inputs: *const *mut C_tensor,
        n_inputs: c_int,
        outputs: *const *mut C_tensor,
        n_outputs: c_int,
        saved: *const *mut C_tensor,
        n_saved: c_int,
        state: *mut c_void,
        backward: BackwardFn,
        drop: DropFn,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
}

/// The state behind the node: the backward and the last error message (kept until the next
/// call, the shim copies it at once).
struct State {
    backward: Backward,
    error: CString,
}

/// Owned tensors from `n` handles the shim allocated (NULL: `None`).
///
/// # Safety
/// `handles` points to `n` handles that are NULL or owned by the caller.
unsafe fn take_handles(handles: *mut *mut C_tensor, n: c_int) -> Vec<Option<Tensor>> {
    (0..n.max(0) as usize)
        .map(|i| {
            // SAFETY: in bounds by the caller's contract.
            let p = unsafe { *handles.add(i) };
            // SAFETY: a non-null handle is a `new at::Tensor` whose ownership passes to us.
            (!p.is_null()).then(|| unsafe { Tensor::from_ptr(p) })
        })
        .collect()
}

unsafe extern "C" fn backward_trampoline(
    state: *mut c_void,
    grads: *mut *mut C_tensor,
    n_grads: c_int,
    saved: *mut *mut C_tensor,
    n_saved: c_int,
    needs: *const c_int,
    out: *mut *mut C_tensor,
    n_inputs: c_int,
) -> *const c_char {
    // SAFETY: `state` is the `Box<State>` leaked by `custom_function`, alive until the drop.
    let state = unsafe { &mut *(state as *mut State) };
    // SAFETY: the shim hands over `n_grads` and `n_saved` owned handles.
    let grads = unsafe { take_handles(grads, n_grads) };
    // SAFETY: as above.
    let saved: Vec<Tensor> = unsafe { take_handles(saved, n_saved) }.into_iter().flatten().collect();
    let n = n_inputs.max(0) as usize;
    // SAFETY: `needs` holds `n_inputs` flags.
    let needs_input_grad = (0..n).map(|i| unsafe { *needs.add(i) } != 0).collect();
    let args = BackwardArgs { grads, saved, needs_input_grad };
    let result = catch_unwind(AssertUnwindSafe(|| (state.backward)(args)));
    let message = match result {
        Ok(Ok(grads)) if grads.len() == n => {
            for (i, g) in grads.into_iter().enumerate() {
                let handle = g.map_or(std::ptr::null_mut(), |t| ManuallyDrop::new(t).as_mut_ptr());
                // SAFETY: `out` has `n_inputs` slots; the shim takes ownership of each handle.
                unsafe { *out.add(i) = handle };
            }
            return std::ptr::null();
        }
        Ok(Ok(grads)) => format!("a custom backward returned {} gradients for {n} inputs", grads.len()),
        Ok(Err(e)) => e.to_string(),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            format!("a custom backward panicked: {what}")
        }
    };
    state.error = CString::new(message.replace('\0', " ")).unwrap_or_default();
    state.error.as_ptr()
}

unsafe extern "C" fn drop_trampoline(state: *mut c_void) {
    // SAFETY: the leaked `Box<State>` of `custom_function`, dropped once by the shim.
    drop(unsafe { Box::from_raw(state as *mut State) });
}

/// Records one autograd node from `inputs` to `outputs`, whose backward is `backward` with the
/// `saved` tensors; returns the outputs as the graph sees them (with a grad_fn when grad mode
/// is on and an input requires grad). `outputs` must be computed by the caller under no_grad
/// and must not be inputs.
pub(crate) fn custom_function(
    inputs: &[&Tensor],
    outputs: &[Tensor],
    saved: &[Tensor],
    backward: Backward,
) -> Result<Vec<Tensor>> {
    let count =
        |n: usize| c_int::try_from(n).map_err(|_| AmpError::torch("custom autograd function", "too many tensors"));
    let (n_in, n_out, n_saved) = (count(inputs.len())?, count(outputs.len())?, count(saved.len())?);
    let ins: Vec<*mut C_tensor> = inputs.iter().map(|t| ptr(t)).collect();
    let outs: Vec<*mut C_tensor> = outputs.iter().map(ptr).collect();
    let keep: Vec<*mut C_tensor> = saved.iter().map(ptr).collect();
    let state = Box::into_raw(Box::new(State { backward, error: CString::default() })) as *mut c_void;
    let mut result: Vec<*mut C_tensor> = vec![std::ptr::null_mut(); outputs.len()];
    // SAFETY: live handles for the duration of the call; the shim owns `state` from here on and
    // frees it through `drop_trampoline`; `result` has one slot per output.
    let err = unsafe {
        tch_amp_custom_function(
            ins.as_ptr(),
            n_in,
            outs.as_ptr(),
            n_out,
            keep.as_ptr(),
            n_saved,
            state,
            backward_trampoline,
            drop_trampoline,
            result.as_mut_ptr(),
        )
    };
    check(err, "recording a custom autograd function")?;
    // SAFETY: on success every slot holds a `new at::Tensor` we now own.
    Ok(result.into_iter().map(|p| unsafe { Tensor::from_ptr(p) }).collect())
}
