//! Diagnostics for tests and debugging: what the cast engine registered, resolved and cached.
//! Not part of the stable API.
use crate::error::ConfigError;
use tch::Device;

use crate::error::{AmpError, Result};

pub use crate::cast::emulation::{emulated_op_class, emulated_ops};
pub use crate::cast::policy::aten_overloads;

/// Whether tch-amp's cast kernels are registered in this process (they stay once they are).
pub fn kernels_registered() -> bool {
    crate::cast::kernels_registered()
}

/// Whether the calling thread has a tch-amp cast policy active.
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) if the engine cannot be queried.
pub fn policy_active() -> Result<bool> {
    crate::cast::policy_active()
}

/// How many casts the calling thread's weight-cast cache holds.
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) if the engine cannot be queried.
pub fn cast_cache_len() -> Result<usize> {
    crate::cast::cast_cache_len()
}

/// How many ops the calling thread has run through the CPU emulation (computed in fp32 on the
/// 16-bit inputs, outputs rounded once) with inputs of `kind` (`Half` or `BFloat16`; 0 for any
/// other kind) since the thread started. Native kernels and CUDA ops are not counted; compare two
/// readings to see whether a region was emulated.
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) if the engine cannot be queried.
pub fn emulated_op_count(kind: tch::Kind) -> Result<u64> {
    let (half, bfloat16) = crate::sys::cast::emulated_count()?;
    Ok(match kind {
        tch::Kind::Half => half,
        tch::Kind::BFloat16 => bfloat16,
        _ => 0,
    })
}

/// The aten ops libtorch itself registers at the Autocast key of `device`'s type (captured before
/// tch-amp's kernels), as `"name"` or `"name.overload"`, sorted.
///
/// # Errors
/// [`ConfigError::InvalidOption`] for a device other than CPU/CUDA.
pub fn libtorch_autocast_ops(device: Device) -> Result<Vec<String>> {
    crate::cast::libtorch_autocast_ops(device)
}

/// Checks that `aten::<name>` exists, with an optional overload after a dot (`"mm"`,
/// `"add.Tensor"`).
///
/// # Errors
/// [`ConfigError::UnknownOp`] with libtorch's own message when the dispatcher has no such schema
/// (the C++ exception is caught in the shim, never an abort).
pub fn check_aten_op(name: &str) -> Result<()> {
    let (base, overload) = name.split_once('.').unwrap_or((name, ""));
    crate::sys::find_schema(base, overload).map_err(|e| match e {
        AmpError::Torch { source, .. } => {
            AmpError::Config(ConfigError::UnknownOp { name: name.to_string(), message: source.to_string() })
        }
        other => other,
    })
}

/// How many times the calling thread inspected gradients beyond the one overflow flag of a
/// `scale_loss` exit: per-parameter inf/NaN counts at an overflow, and the all-zero check at
/// the scale's floor. A clean pass above the floor adds nothing (tests check it).
pub fn gradient_scans() -> u64 {
    crate::counters::gradient_scans()
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
/// [`AmpError::Torch`](crate::AmpError::Torch) if libtorch's allocator cannot be wrapped.
pub fn track_cpu_memory() -> Result<()> {
    crate::sys::cpu::cpu_memory_tracking_install()
}

/// The counting allocator's current and peak bytes (zeros before [`track_cpu_memory`]).
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) if the counters cannot be read (not expected).
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

/// One Adam update (`adamw == false`) or AdamW update of `params` with libtorch's fused CPU/CUDA
/// kernel (`torch._fused_adam_`, what `torch.optim.Adam(fused=True)` runs), in place on
/// `params`, `exp_avgs` and `exp_avg_sqs`; `steps` are 0-dim fp32 tensors holding each
/// parameter's step count after this update. For hand-written loops that should run the very
/// update tch-amp runs (the benchmark's baseline).
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) when the lists differ in length or libtorch rejects the tensors.
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
    let h = crate::sys::FusedAdamHyper { beta1, beta2, wd: weight_decay, eps, amsgrad: false, adamw, maximize: false };
    crate::sys::fused_adam_(&args, lr, h)
}

/// Sets libtorch's TF32 switches for CUDA matmuls and cuDNN convolutions (PyTorch's
/// `torch.backends.cuda.matmul.allow_tf32` and `torch.backends.cudnn.allow_tf32`); no effect
/// on CPU computations.
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) if libtorch refuses (not expected).
pub fn set_allow_tf32(on: bool) -> Result<()> {
    crate::sys::set_allow_tf32(on)
}

/// How many times tch-amp has read a tensor value into host memory in this process (every
/// thread): the overflow flag of a dynamic `scale_loss`, the norm `clip_grad_norm` returns,
/// the finiteness check of each tensor of an optimizer record being loaded. On CUDA each is a
/// host sync; a training step with dynamic loss scaling makes exactly one, with a static
/// scale none. The benchmark reads the difference around each step.
pub fn host_reads() -> u64 {
    crate::counters::host_reads()
}
