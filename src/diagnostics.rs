//! Diagnostics for tests and debugging: what the cast engine registered, resolved and cached.
//! Not part of the stable API.
use tch::Device;

use crate::error::{AmpError, Result};

pub use crate::cast::emulation::emulated_ops;
pub use crate::cast::policy::aten_overloads;

/// Whether tch-amp's cast kernels are registered in this process (they stay once they are).
pub fn kernels_registered() -> bool {
    crate::cast::kernels_registered()
}

/// Whether the calling thread has a tch-amp cast policy active.
///
/// # Errors
/// [`AmpError::Shim`] if the engine cannot be queried.
pub fn policy_active() -> Result<bool> {
    crate::cast::policy_active()
}

/// How many casts the calling thread's weight-cast cache holds.
///
/// # Errors
/// [`AmpError::Shim`] if the engine cannot be queried.
pub fn cast_cache_len() -> Result<usize> {
    crate::cast::cast_cache_len()
}

/// The aten ops libtorch itself registers at the Autocast key of `device`'s type (captured
/// before tch-amp's kernels), as `"name"` or `"name.overload"`, sorted.
///
/// # Errors
/// [`AmpError::InvalidOption`] for a device other than CPU/CUDA.
pub fn libtorch_autocast_ops(device: Device) -> Result<Vec<String>> {
    crate::cast::libtorch_autocast_ops(device)
}

/// Checks that `aten::<name>` exists, with an optional overload after a dot
/// (`"mm"`, `"add.Tensor"`).
///
/// # Errors
/// [`AmpError::UnknownOp`] with libtorch's own message when the dispatcher has no such
/// schema (the C++ exception is caught in the shim, never an abort).
pub fn check_aten_op(name: &str) -> Result<()> {
    let (base, overload) = name.split_once('.').unwrap_or((name, ""));
    crate::sys::find_schema(base, overload).map_err(|e| match e {
        AmpError::Shim { message, .. } => AmpError::UnknownOp { name: name.to_string(), message },
        other => other,
    })
}

/// How many times the calling thread inspected gradients beyond the one overflow flag of a
/// `scale_loss` exit: per-parameter inf/NaN counts at an overflow, and the all-zero check at
/// the scale's floor. A clean pass above the floor adds nothing (tests check it).
pub fn gradient_scans() -> u64 {
    crate::optim::gradient_scans()
}

/// Bytes held by libtorch's CPU allocator since [`track_cpu_memory`] wrapped it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuMemory {
    /// Bytes allocated and not yet freed.
    pub current: i64,
    /// The most held at once since the last [`reset_cpu_memory_peak`] (or since tracking began).
    pub peak: i64,
}

/// Wraps libtorch's CPU allocator in a counting one, for the rest of the process (the first call
/// installs it; later calls do nothing). Only tensors allocated afterwards are counted. Each
/// allocation then costs a mutex and a hash-map update: for tests and benchmarks, not training.
///
/// # Errors
/// [`AmpError::Shim`] if libtorch's allocator cannot be wrapped.
pub fn track_cpu_memory() -> Result<()> {
    crate::sys::cpu::cpu_memory_tracking_install()
}

/// The counting allocator's current and peak bytes (zeros before [`track_cpu_memory`]).
///
/// # Errors
/// [`AmpError::Shim`] if the counters cannot be read (not expected).
pub fn cpu_memory() -> Result<CpuMemory> {
    let (current, peak) = crate::sys::cpu::cpu_memory(false)?;
    Ok(CpuMemory { current, peak })
}

/// Reads the counters like [`cpu_memory`], then starts a new peak from the current value.
///
/// # Errors
/// As [`cpu_memory`].
pub fn reset_cpu_memory_peak() -> Result<CpuMemory> {
    let (current, peak) = crate::sys::cpu::cpu_memory(true)?;
    Ok(CpuMemory { current, peak })
}

/// Where the cast kernels of the calling thread spent their time since the last
/// [`take_cast_profile`], while [`set_cast_profiling`] was on. Backward ops are not cast and
/// not counted (autograd runs the casts' backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CastProfile {
    /// O1's policy casts (including weight-cast cache hits).
    pub policy_casts: std::time::Duration,
    /// Emulated ops: converting their fp16/bf16 inputs to fp32.
    pub emulated_inputs: std::time::Duration,
    /// Emulated ops: the fp32 op itself.
    pub emulated_ops: std::time::Duration,
    /// Emulated ops: rounding their outputs to fp16/bf16.
    pub emulated_outputs: std::time::Duration,
    /// Number of emulated calls.
    pub emulated_calls: u64,
}

/// Turns the cast kernels' phase timers on or off (for every thread).
///
/// # Errors
/// [`AmpError::Shim`] if the engine cannot be reached (not expected).
pub fn set_cast_profiling(on: bool) -> Result<()> {
    crate::sys::cast::set_profiling(on)
}

/// The calling thread's [`CastProfile`] since the last call; resets it.
///
/// # Errors
/// As [`set_cast_profiling`].
pub fn take_cast_profile() -> Result<CastProfile> {
    let [cast, inputs, op, outputs, calls] = crate::sys::cast::take_profile()?;
    let d = |ns: i64| std::time::Duration::from_nanos(ns.max(0) as u64);
    Ok(CastProfile {
        policy_casts: d(cast),
        emulated_inputs: d(inputs),
        emulated_ops: d(op),
        emulated_outputs: d(outputs),
        emulated_calls: calls.max(0) as u64,
    })
}

/// One Adam update (`adamw == false`) or AdamW update of `params` with libtorch's fused CPU/CUDA
/// kernel (`torch._fused_adam_`, what `torch.optim.Adam(fused=True)` runs), in place on
/// `params`, `exp_avgs` and `exp_avg_sqs`; `steps` are 0-dim fp32 tensors holding each
/// parameter's step count after this update. For hand-written loops that should run the very
/// update tch-amp runs (the benchmark's baseline).
///
/// # Errors
/// [`AmpError::Shim`] when the lists differ in length or libtorch rejects the tensors.
#[allow(clippy::too_many_arguments)]
pub fn fused_adam_(
    params: &[tch::Tensor],
    grads: &[tch::Tensor],
    exp_avgs: &[tch::Tensor],
    exp_avg_sqs: &[tch::Tensor],
    steps: &[tch::Tensor],
    lr: f64,
    beta1: f64,
    beta2: f64,
    weight_decay: f64,
    eps: f64,
    adamw: bool,
) -> Result<()> {
    let args = crate::sys::FusedAdamArgs { params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs: &[], steps };
    let h =
        crate::optim::FusedAdamHyper { beta1, beta2, wd: weight_decay, eps, amsgrad: false, adamw, maximize: false };
    crate::sys::fused_adam_(&args, lr, h)
}

/// Sets libtorch's TF32 switches for CUDA matmuls and cuDNN convolutions (PyTorch's
/// `torch.backends.cuda.matmul.allow_tf32` and `torch.backends.cudnn.allow_tf32`); no effect
/// on CPU computations.
///
/// # Errors
/// [`AmpError::Shim`] if libtorch refuses (not expected).
pub fn set_allow_tf32(on: bool) -> Result<()> {
    crate::sys::set_allow_tf32(on)
}

/// Sets the largest slice (elements) of an fp32 master gradient that O2's `step` makes at once
/// from the model's fp16 gradient (default 64 Ki); 0 turns the slice-wise path off, so that
/// every master gradient is made full-size at `scale_loss` exit (18 bytes per parameter at the
/// peak with Adam instead of 16). Process-wide; returns the previous value. For tests and
/// benchmarks.
pub fn set_master_grad_slice(elements: i64) -> i64 {
    crate::optim::set_master_grad_slice(elements)
}

/// Turns O2's single-pass Adam/AdamW update on or off (default on; process-wide) and returns
/// the previous setting. The single pass (libtorch's fused Adam/AdamW with
/// `OptimizerConfig::fused(true)`, fp16 or bf16 model, fp32 masters, contiguous CPU tensors)
/// unscales each fp16 (bf16) gradient element, updates the master and its state and rounds the master into the
/// model in one pass over memory; off, `step` makes the fp32 gradient a slice at a time, runs
/// libtorch's kernel on it and rounds the slice back (three passes, the same bits). For tests
/// and benchmarks.
pub fn set_o2_single_pass(on: bool) -> bool {
    crate::optim::set_o2_single_pass(on)
}

/// How many parameter updates O2's single pass ([`set_o2_single_pass`]) has made on the calling
/// thread (`step` runs on its caller's thread); the others took the slice-wise path.
pub fn o2_single_pass_updates() -> u64 {
    crate::optim::o2_single_pass_updates()
}

/// The form of O2's single-pass Adam (`adamw == false`) or AdamW update that reproduces
/// libtorch's fused kernel bit for bit on this machine, found on a probe at the first call
/// (once per process and mode): a description such as `"v: fma(v, beta2, (1-beta2)*g*g); L2:
/// fma(p, wd, g); vector width 8"`, or `None` when no form matches (another libtorch build, a
/// CPU without AVX2/FMA/F16C), in which case `step` takes the slice-wise path.
///
/// # Errors
/// [`AmpError::Shim`] if the probe itself fails (not expected).
pub fn o2_single_pass_form(adamw: bool) -> Result<Option<String>> {
    Ok(crate::sys::o2_adam_form(adamw)?.map(|(sq, wd, width)| {
        let sq = match sq {
            1 => "fma(v, beta2, (1-beta2)*g*g)",
            2 => "fma((1-beta2)*g, g, v*beta2)",
            _ => "v*beta2 + (1-beta2)*g*g",
        };
        let wd = if adamw {
            "decoupled (p * (1 - lr*wd))"
        } else if wd == 1 {
            "fma(p, wd, g)"
        } else {
            "g + p*wd"
        };
        format!("v: {sq}; weight decay: {wd}; vector width {width}")
    }))
}

/// O1's rounding of weights for emulated ops (CPU emulation), as [`o1_weight_copies`] reports it.
///
/// Under O1 with CPU emulation every fp32 weight of an emulated GEMM or convolution enters it as
/// the fp32 tensor of its fp16 (bf16) values. A weight that the previous forward (the previous
/// `scale_loss`) used exactly once gets that tensor from one rounding node, whose backward
/// rounds the gradient once, instead of a cast to fp16 and a conversion back each way; the
/// values, forward and backward, are the two casts' bit for bit, and a weight used again in the
/// same forward has its node rewired into a cast, so that the gradients of its uses still add up
/// in fp16, as under Apex. With [`set_o1_weight_copies`] on (the default), tch-amp's fused
/// Adam/AdamW (`OptimizerConfig::fused(true)`) also writes each such weight's rounded values in
/// the same pass as its update, and the next forward reads them instead of rounding: 4 more
/// bytes per weight element kept between steps (20 bytes per parameter at the step with Adam
/// instead of 16), for a step 3-5% faster on the MLP benchmark (BENCHMARKS.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct O1WeightCopies {
    /// Copies kept now (a dropped weight's until the next O1 forward on any thread ends).
    pub copies: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Forward uses on the calling thread (since it started) served from a copy.
    pub served: u64,
    /// Forward uses on the calling thread given one rounding node made in the forward (no
    /// current copy: the weight changed since, or its optimizer writes none).
    pub rounded: u64,
    /// Weights the calling thread gave a rounding node that the same forward used again
    /// (rewired into a cast).
    pub demoted: u64,
    /// Gradients the calling thread's backward passes rounded in place (the backward of a
    /// weight's or an activation's rounding node, when nothing else can see the gradient's
    /// memory: no second reference to it, no create_graph); the others are rounded into a
    /// new tensor, the same values.
    pub gradients_in_place: u64,
}

/// Turns O1's rounded weight copies ([`O1WeightCopies`]) on or off (process-wide; on by
/// default) and returns the previous setting. Off, no copy is written and those kept are
/// dropped; weights used once still take one rounding node. The results are the same bits
/// either way.
///
/// # Errors
/// [`AmpError::Shim`] if the shim fails (not expected).
pub fn set_o1_weight_copies(on: bool) -> Result<bool> {
    crate::sys::cast::set_weight_copies(on)
}

/// What O1's rounded weight copies hold and have served ([`O1WeightCopies`]).
///
/// # Errors
/// [`AmpError::Shim`] if the shim fails (not expected).
pub fn o1_weight_copies() -> Result<O1WeightCopies> {
    let [copies, bytes, served, rounded, demoted, in_place] = crate::sys::cast::weight_copies_stats()?;
    let u = |v: i64| v.max(0) as u64;
    Ok(O1WeightCopies {
        copies: u(copies),
        bytes: u(bytes),
        served: u(served),
        rounded: u(rounded),
        demoted: u(demoted),
        gradients_in_place: u(in_place),
    })
}

/// O1's output handoff with CPU emulation of fp16, as [`o1_output_handoffs`] counts it.
///
/// An emulated GEMM or convolution computes in fp32 and hands back an fp16 tensor, as under
/// Apex; the next op often converts that tensor straight back to fp32 (an fp32-list op such as
/// GELU or softmax, an add with an fp32 tensor, another emulated op). When nothing else holds
/// the fp32 result, one pass writes the fp16 tensor and rounds the result in place, and that
/// conversion takes the rounded result instead of making a new tensor; the backward does the
/// same for the gradient when the fp16 tensor's gradient comes from that conversion alone. The
/// values are those of the two conversions, bit for bit; only passes over memory and
/// allocations are saved. [`set_o1_output_handoff`] turns it off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct O1OutputHandoffs {
    /// Conversions to fp32 on the calling thread (since it started) that took an emulated op's
    /// rounded result.
    pub forward: u64,
    /// Gradients on the calling thread handed on the same way in backward.
    pub backward: u64,
}

/// Turns O1's output handoff ([`O1OutputHandoffs`]) on or off (process-wide; on by default) and
/// returns the previous setting. The results are the same bits either way.
///
/// # Errors
/// [`AmpError::Shim`] if the shim fails (not expected).
pub fn set_o1_output_handoff(on: bool) -> Result<bool> {
    Ok(crate::sys::cast::output_handoff(Some(on))?.0)
}

/// The calling thread's output handoffs so far ([`O1OutputHandoffs`]).
///
/// # Errors
/// [`AmpError::Shim`] if the shim fails (not expected).
pub fn o1_output_handoffs() -> Result<O1OutputHandoffs> {
    let (_, [forward, backward]) = crate::sys::cast::output_handoff(None)?;
    Ok(O1OutputHandoffs { forward: forward.max(0) as u64, backward: backward.max(0) as u64 })
}

/// The rounded copy O1 keeps of weight `w` (a detached tensor sharing its storage), when one
/// is current: written by the last update of `w`, which nothing has changed since.
///
/// # Errors
/// [`AmpError::Shim`] if the shim fails (not expected).
pub fn o1_weight_copy(w: &tch::Tensor) -> Result<Option<tch::Tensor>> {
    crate::sys::cast::weight_copy(w)
}

/// Whether O1's emulation rounds fp32 tensors to fp16 with the shim's vector code (x86-64 with
/// AVX2, FMA and F16C) rather than its portable loop, which is several times slower.
///
/// # Errors
/// [`AmpError::Shim`] if the shim fails (not expected).
pub fn o1_rounding_vectorized() -> Result<bool> {
    crate::sys::cast::rounding_vectorized()
}

static HOST_READS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts one read of a tensor value into host memory by tch-amp (on CUDA: a host sync).
pub(crate) fn note_host_read() {
    HOST_READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// How many times tch-amp has read a tensor value into host memory in this process (every
/// thread): the overflow flag of a dynamic `scale_loss`, the norm `clip_grad_norm` returns,
/// the finiteness check of each tensor of an optimizer record being loaded. On CUDA each is a
/// host sync; a training step with dynamic loss scaling makes exactly one, with a static
/// scale none. The benchmark reads the difference around each step.
pub fn host_reads() -> u64 {
    HOST_READS.load(std::sync::atomic::Ordering::Relaxed)
}
