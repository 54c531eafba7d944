//! Every `extern "C"` declaration of the distributed shim (`src/shim/distributed.cpp`) and every
//! unsafe call into it, wrapped in safe functions that return the shim's message as the error.
//! The callers (`src/distributed/`) turn messages into `DistError`s.
use std::ffi::{c_char, c_int, c_void, CString};
use std::time::Duration;

use tch::Tensor;
use torch_sys::C_tensor;

use super::ptr;

/// The shim's error message (NULL on success, else an owned string).
pub(crate) type ShimResult<T> = std::result::Result<T, String>;

extern "C" {
    fn tch_amp_dist_has_nccl() -> c_int;
    fn tch_amp_dist_init(
        host: *const c_char,
        port: c_int,
        rank: c_int,
        world_size: c_int,
        is_server: c_int,
        timeout_ms: i64,
        backend: *const c_char,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn tch_amp_dist_free(h: *mut c_void);
    fn tch_amp_dist_set_timeout(h: *mut c_void, timeout_ms: i64) -> *mut c_char;
    fn tch_amp_dist_barrier(h: *mut c_void) -> *mut c_char;
    fn tch_amp_dist_broadcast(h: *mut c_void, ts: *const *mut C_tensor, n: c_int, root: c_int) -> *mut c_char;
    fn tch_amp_dist_broadcast_coalesced(
        h: *mut c_void,
        ts: *const *mut C_tensor,
        n: c_int,
        buffer_size: i64,
        root: c_int,
    ) -> *mut c_char;
    fn tch_amp_dist_allreduce(h: *mut c_void, ts: *const *mut C_tensor, n: c_int, op: c_int) -> *mut c_char;
    fn tch_amp_dist_allgather(h: *mut c_void, t: *mut C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
    fn tch_amp_grad_mode_enabled(enabled: *mut c_int) -> *mut c_char;
    fn tch_amp_randperm_seeded(n: i64, seed: u64, out: *mut *mut C_tensor) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    fn tch_amp_ddp_new(
        h: *mut c_void,
        params: *const *mut C_tensor,
        n: c_int,
        bucket_bytes: i64,
        first_bucket_bytes: i64,
        find_unused: c_int,
        always_fp32: c_int,
        predivide: f64,
        average: c_int,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn tch_amp_ddp_free(d: *mut c_void);
    fn tch_amp_ddp_pre_forward(d: *mut c_void, sync: c_int) -> *mut c_char;
    fn tch_amp_ddp_post_forward(d: *mut c_void, outputs: *const *mut C_tensor, n: c_int) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    fn tch_amp_sync_batch_norm(
        h: *mut c_void,
        input: *mut C_tensor,
        weight: *mut C_tensor,
        bias: *mut C_tensor,
        running_mean: *mut C_tensor,
        running_var: *mut C_tensor,
        eps: f64,
        momentum: f64,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
}

fn check(err: *mut c_char) -> ShimResult<()> {
    if err.is_null() {
        Ok(())
    } else {
        Err(super::take_string(err))
    }
}

fn ptrs(ts: &[Tensor]) -> Vec<*mut C_tensor> {
    ts.iter().map(ptr).collect()
}

fn count(n: usize) -> ShimResult<c_int> {
    c_int::try_from(n).map_err(|_| format!("too many tensors ({n}) for one call"))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// Takes ownership of a tensor the shim allocated with `new at::Tensor`.
fn owned(p: *mut C_tensor) -> ShimResult<Tensor> {
    if p.is_null() {
        return Err("the shim returned no tensor".into());
    }
    // SAFETY: a non-null pointer from the shim is a fresh heap at::Tensor that tch now owns.
    Ok(unsafe { Tensor::from_ptr(p) })
}

/// Whether the shim was compiled with the NCCL backend.
pub(crate) fn has_nccl() -> bool {
    // SAFETY: no arguments, no state.
    unsafe { tch_amp_dist_has_nccl() != 0 }
}

/// A c10d process group (and its TCPStore) owned by Rust.
#[derive(Debug)]
pub(crate) struct PgHandle(*mut c_void);

// SAFETY: c10d's ProcessGroup and its backends lock their own state and are used from any
// thread by torch.distributed; the handle itself is only freed once, in Drop.
unsafe impl Send for PgHandle {}
// SAFETY: as above; collectives issued from several threads must be ordered by the caller, as
// in torch.distributed, but they do not race inside c10d.
unsafe impl Sync for PgHandle {}

impl Drop for PgHandle {
    fn drop(&mut self) {
        // SAFETY: the pointer came from tch_amp_dist_init and is freed exactly once.
        unsafe { tch_amp_dist_free(self.0) }
    }
}

/// Rendezvous and process-group creation.
#[allow(clippy::too_many_arguments)]
pub(crate) fn init(
    host: &str,
    port: u16,
    rank: usize,
    world_size: usize,
    is_server: bool,
    timeout: Duration,
    backend: &str,
) -> ShimResult<PgHandle> {
    let host = CString::new(host).map_err(|_| format!("address {host:?} contains a NUL byte"))?;
    let backend = CString::new(backend).map_err(|_| "backend name contains a NUL byte".to_string())?;
    let rank = count(rank)?;
    let world = count(world_size)?;
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid C strings and an out-pointer that lives across the call.
    check(unsafe {
        tch_amp_dist_init(
            host.as_ptr(),
            c_int::from(port),
            rank,
            world,
            c_int::from(is_server),
            millis(timeout),
            backend.as_ptr(),
            &mut out,
        )
    })?;
    if out.is_null() {
        return Err("the shim created no process group".into());
    }
    Ok(PgHandle(out))
}

impl PgHandle {
    pub(crate) fn set_timeout(&self, timeout: Duration) -> ShimResult<()> {
        // SAFETY: a live handle.
        check(unsafe { tch_amp_dist_set_timeout(self.0, millis(timeout)) })
    }

    pub(crate) fn barrier(&self) -> ShimResult<()> {
        // SAFETY: a live handle.
        check(unsafe { tch_amp_dist_barrier(self.0) })
    }

    pub(crate) fn broadcast(&self, ts: &[Tensor], root: usize) -> ShimResult<()> {
        let p = ptrs(ts);
        // SAFETY: live tensor handles for the duration of the call.
        check(unsafe { tch_amp_dist_broadcast(self.0, p.as_ptr(), count(p.len())?, count(root)?) })
    }

    pub(crate) fn broadcast_coalesced(&self, ts: &[Tensor], buffer_bytes: usize, root: usize) -> ShimResult<()> {
        let p = ptrs(ts);
        let bytes = i64::try_from(buffer_bytes).unwrap_or(i64::MAX);
        // SAFETY: live tensor handles for the duration of the call.
        check(unsafe { tch_amp_dist_broadcast_coalesced(self.0, p.as_ptr(), count(p.len())?, bytes, count(root)?) })
    }

    /// op: 0 sum, 1 average, 2 max, 3 min, 4 product.
    pub(crate) fn allreduce(&self, ts: &[Tensor], op: c_int) -> ShimResult<()> {
        let p = ptrs(ts);
        // SAFETY: live tensor handles for the duration of the call.
        check(unsafe { tch_amp_dist_allreduce(self.0, p.as_ptr(), count(p.len())?, op) })
    }

    pub(crate) fn allgather(&self, t: &Tensor, world_size: usize) -> ShimResult<Vec<Tensor>> {
        let mut out: Vec<*mut C_tensor> = vec![std::ptr::null_mut(); world_size];
        // SAFETY: `out` has room for one pointer per rank (the group's size).
        check(unsafe { tch_amp_dist_allgather(self.0, ptr(t), out.as_mut_ptr()) })?;
        out.into_iter().map(owned).collect()
    }

    /// Training-mode SyncBatchNorm (autograd-recorded).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sync_batch_norm(
        &self,
        input: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        eps: f64,
        momentum: f64,
    ) -> ShimResult<Tensor> {
        let opt = |t: Option<&Tensor>| t.map_or(std::ptr::null_mut(), ptr);
        let mut out: *mut C_tensor = std::ptr::null_mut();
        // SAFETY: live handles (or NULL for absent ones) and an out-pointer.
        check(unsafe {
            tch_amp_sync_batch_norm(
                self.0,
                ptr(input),
                opt(weight),
                opt(bias),
                opt(running_mean),
                opt(running_var),
                eps,
                momentum,
                &mut out,
            )
        })?;
        owned(out)
    }
}

/// Whether autograd records operations on this thread.
pub(crate) fn grad_mode_enabled() -> ShimResult<bool> {
    let mut enabled: c_int = 0;
    // SAFETY: an out-pointer that lives across the call.
    check(unsafe { tch_amp_grad_mode_enabled(&mut enabled) })?;
    Ok(enabled != 0)
}

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))`.
pub(crate) fn randperm_seeded(n: i64, seed: u64) -> ShimResult<Tensor> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: an out-pointer that lives across the call.
    check(unsafe { tch_amp_randperm_seeded(n, seed, &mut out) })?;
    owned(out)
}

/// A c10d::Reducer (with tch-amp's Apex communication hook) owned by Rust.
#[derive(Debug)]
pub(crate) struct DdpHandle(*mut c_void);

// SAFETY: the Reducer locks its own state (autograd hooks call into it from autograd's threads
// in libtorch too); the handle is freed once, in Drop.
unsafe impl Send for DdpHandle {}

impl Drop for DdpHandle {
    fn drop(&mut self) {
        // SAFETY: the pointer came from tch_amp_ddp_new and is freed exactly once.
        unsafe { tch_amp_ddp_free(self.0) }
    }
}

/// Options of the Reducer as the shim takes them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReducerConfig {
    pub(crate) bucket_bytes: i64,
    pub(crate) first_bucket_bytes: i64,
    pub(crate) find_unused: bool,
    pub(crate) always_fp32: bool,
    pub(crate) predivide: f64,
    pub(crate) average: bool,
}

/// Checks the parameters' shapes across ranks (a collective) and builds the Reducer.
pub(crate) fn ddp_new(pg: &PgHandle, params: &[Tensor], cfg: ReducerConfig) -> ShimResult<DdpHandle> {
    let p = ptrs(params);
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: a live process group, live parameter handles, an out-pointer.
    check(unsafe {
        tch_amp_ddp_new(
            pg.0,
            p.as_ptr(),
            count(p.len())?,
            cfg.bucket_bytes,
            cfg.first_bucket_bytes,
            c_int::from(cfg.find_unused),
            c_int::from(cfg.always_fp32),
            cfg.predivide,
            c_int::from(cfg.average),
            &mut out,
        )
    })?;
    if out.is_null() {
        return Err("the shim created no reducer".into());
    }
    Ok(DdpHandle(out))
}

impl DdpHandle {
    pub(crate) fn pre_forward(&self, sync: bool) -> ShimResult<()> {
        // SAFETY: a live reducer.
        check(unsafe { tch_amp_ddp_pre_forward(self.0, c_int::from(sync)) })
    }

    pub(crate) fn post_forward(&self, outputs: &[Tensor]) -> ShimResult<()> {
        let p = ptrs(outputs);
        // SAFETY: a live reducer and live output handles.
        check(unsafe { tch_amp_ddp_post_forward(self.0, p.as_ptr(), count(p.len())?) })
    }
}
