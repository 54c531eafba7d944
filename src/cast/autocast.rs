//! torch.autocast for tch: [`Autocast`] (torch's `device_type`, `dtype`, `enabled`,
//! `cache_enabled`), [`autocast`] for the common case, and [`fp32_region`] (torch's
//! `custom_fwd(cast_inputs=torch.float32)`). Each enters the one autocast guard,
//! [`AutocastScope`]: per thread, nestable, restored on drop and on panic.
use tch::{Device, Kind, Tensor};

use super::cpu::{resolve as resolve_cpu_kernels, CpuKernels};
use super::engine::{policy_active, torch_autocast_policy};
use super::scope::{autocast_state, AutocastScope, AutocastState, Owner, PolicyChange};
use crate::error::{AmpError, ConfigError, Result, TorchContext, UsageError};

/// torch.autocast's arguments: `device_type`, `dtype`, `enabled`, `cache_enabled`.
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch::{nn, nn::Module, Device, Kind, Tensor};
/// use tch_amp::Autocast;
/// let vs = nn::VarStore::new(Device::Cpu);
/// let linear = nn::linear(vs.root() / "linear", 4, 2, Default::default());
/// let head = nn::linear(vs.root() / "head", 2, 2, Default::default());
/// let x = Tensor::ones([3, 4], (Kind::Float, Device::Cpu));
/// let y = Autocast::new(Device::Cpu).run(|| {
///     let y = linear.forward(&x); // bf16: linear is on libtorch's CPU low-precision list
///     // A region that must run in fp32 (torch's custom_fwd(cast_inputs=torch.float32)):
///     let z = tch_amp::fp32_region(Device::Cpu, &[&y], |t| head.forward(&t[0]));
///     (y, z)
/// })?;
/// assert_eq!((y.0.kind(), y.1?.kind()), (Kind::BFloat16, Kind::Float));
/// # Ok(())
/// # }
/// ```
///
/// # CPU kernels
/// On CUDA, and on a CPU with fast units for the type (bf16: AVX512_BF16 or AMX; see
/// [`crate::cast::CpuFeatures::native_is_fast`]), autocast runs libtorch's own fp16/bf16
/// kernels, so forward and backward are torch.autocast's bit for bit. Elsewhere libtorch's
/// fp16/bf16 CPU GEMMs and convolutions are many times slower than fp32, and autocast makes the
/// Apex path's choice ([`Autocast::cpu_kernels`], [`CpuKernels::Auto`] by default): the ops of
/// `opt_levels/emulate_cpu.toml` are cast as libtorch casts them (its weight cache included),
/// computed in fp32 and their outputs rounded once to the autocast dtype, forward and backward
/// (the contract of that file; results are within an ulp of libtorch's native kernels, plus
/// fp32 summation order). Every other op, composites such as scaled_dot_product_attention
/// included, runs libtorch's autocast kernel. [`CpuKernels::Native`] gives torch.autocast's
/// kernels everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Autocast {
    device: Device,
    dtype: Option<Kind>,
    enabled: bool,
    cache_enabled: Option<bool>,
    cpu_kernels: CpuKernels,
}

impl Autocast {
    /// Autocast for `device`'s type (CPU or CUDA; the index is ignored, as torch's
    /// `device_type`), enabled, in the thread's current autocast dtype for that type (bf16 on
    /// CPU and fp16 on CUDA unless an enclosing scope set another), the cache flag unchanged.
    pub fn new(device: Device) -> Self {
        Self { device, dtype: None, enabled: true, cache_enabled: None, cpu_kernels: CpuKernels::Auto }
    }

    /// How the CPU's fp16/bf16 GEMMs and convolutions run inside the scope (see "CPU kernels"
    /// above): [`CpuKernels::Auto`] (the default) emulates them where the CPU has no fast
    /// units for the dtype, [`CpuKernels::Native`] always runs libtorch's kernels (bit for bit
    /// torch.autocast), [`CpuKernels::Emulate`] always emulates. No effect on CUDA.
    pub fn cpu_kernels(mut self, mode: CpuKernels) -> Self {
        self.cpu_kernels = mode;
        self
    }

    /// The device type it acts on.
    pub(crate) fn device(&self) -> Device {
        self.device
    }

    /// The dtype the scope would take on this thread: the one set, else the thread's current.
    pub(crate) fn resolved_dtype(&self) -> Result<Kind> {
        Ok(match self.dtype {
            Some(d) => d,
            None => autocast_state(self.device)?.dtype,
        })
    }

    /// The low-precision dtype: `Kind::BFloat16` or `Kind::Half`.
    pub fn dtype(mut self, dtype: Kind) -> Self {
        self.dtype = Some(dtype);
        self
    }

    /// `enabled=False` turns autocast off inside (a region that must run in fp32; cast its
    /// inputs to fp32 yourself, as torch's `custom_fwd(cast_inputs=torch.float32)` does).
    pub fn enabled(mut self, enabled: bool) -> Self {
        self.enabled = enabled;
        self
    }

    /// Whether libtorch caches the low-precision copies of leaf weights inside the scope
    /// (torch's `cache_enabled`; the cache is emptied when the outermost scope ends).
    pub fn cache_enabled(mut self, on: bool) -> Self {
        self.cache_enabled = Some(on);
        self
    }

    /// Enters the scope: torch's `__enter__`. The returned guard restores the previous state
    /// (enabled flag, dtype, cache flag) when dropped, also during a panic.
    ///
    /// As torch, CUDA autocast on a machine without CUDA is entered disabled (with a `log`
    /// warning).
    ///
    /// # Errors
    /// [`UsageError::AutocastConflict`] while a tch-amp cast policy (Apex's O1, or the CPU
    /// emulation under O2/O3) is active on this thread; [`ConfigError::InvalidOption`] for a
    /// dtype other than fp16/bf16 (torch warns and disables) or a device other than CPU/CUDA.
    pub fn enter(&self) -> Result<AutocastScope> {
        if !matches!(self.device, Device::Cpu | Device::Cuda(_)) {
            return Err(AmpError::Config(ConfigError::InvalidOption {
                option: "device",
                value: format!("{:?}", self.device),
                expected: "Device::Cpu or Device::Cuda(_)",
            }));
        }
        if policy_active()? {
            return Err(AmpError::Usage(UsageError::AutocastConflict {
                entering: "torch.amp autocast",
                active: "tch-amp's Apex cast policy (O1, or the CPU emulation under O2/O3)",
            }));
        }
        let previous = autocast_state(self.device)?;
        let dtype = self.dtype.unwrap_or(previous.dtype);
        if !matches!(dtype, Kind::Half | Kind::BFloat16) {
            return Err(AmpError::Config(ConfigError::InvalidOption {
                option: "dtype",
                value: format!("{dtype:?}"),
                expected: "Kind::Half or Kind::BFloat16",
            }));
        }
        let mut enabled = self.enabled;
        if enabled && matches!(self.device, Device::Cuda(_)) && !tch::Cuda::is_available() {
            log::warn!("autocast: device type CUDA was given, but CUDA is not available. Disabling.");
            enabled = false;
        }
        // A CPU scope decides the CPU kernels (an inner scope may change them); a disabled or
        // CUDA scope leaves them as they are.
        let policy = if enabled && self.device == Device::Cpu {
            match resolve_cpu_kernels(self.cpu_kernels, dtype) {
                CpuKernels::Emulate => PolicyChange::Activate(torch_autocast_policy(dtype)?),
                _ => PolicyChange::Clear,
            }
        } else {
            PolicyChange::Keep
        };
        AutocastScope::enter(self.device, enabled, dtype, self.cache_enabled, policy, Owner::Torch, None)
    }

    /// torch's `torch.is_autocast_enabled(device_type)` and `torch.get_autocast_dtype(device_type)`
    /// on this thread.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a device other than CPU/CUDA.
    pub fn state(device: Device) -> Result<AutocastState> {
        autocast_state(device)
    }

    /// Runs `f` inside the scope (torch's `with torch.autocast(..):`); the previous state is
    /// restored afterwards, also when `f` panics.
    ///
    /// # Errors
    /// As [`Self::enter`].
    pub fn run<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let _scope = self.enter()?;
        Ok(f())
    }
}

/// `with torch.autocast(device_type):` around `f`, in the device type's default dtype (bf16 on
/// CPU, fp16 on CUDA); see [`Autocast`] for the other arguments.
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch::{Device, Kind, Tensor};
/// let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
/// assert_eq!(tch_amp::autocast(Device::Cpu, || a.mm(&a))?.kind(), Kind::BFloat16);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// As [`Autocast::enter`].
pub fn autocast<T>(device: Device, f: impl FnOnce() -> T) -> Result<T> {
    Autocast::new(device).run(f)
}

/// torch's `custom_fwd(cast_inputs=torch.float32)`: when autocast is on for `device`'s type, runs
/// `f` with it off (and no cast policy: Apex's O1 lists do not apply either), on `inputs` cast to
/// fp32 (floating tensors only; others unchanged), so a
/// region that must run in fp32 does; when autocast is off, runs `f` on the inputs as they are.
/// The previous state comes back afterwards, also when `f` panics.
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch::{Device, Kind, Tensor};
/// let x = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
/// let (inside, outside) = tch_amp::autocast(Device::Cpu, || {
///     let h = x.mm(&x); // bf16 under CPU autocast
///     let y = tch_amp::fp32_region(Device::Cpu, &[&h], |t| t[0].mm(&t[0]))?;
///     Ok::<_, tch_amp::AmpError>((y.kind(), h.kind()))
/// })??;
/// assert_eq!((inside, outside), (Kind::Float, Kind::BFloat16));
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`ConfigError::InvalidOption`] for a device other than CPU/CUDA;
/// [`AmpError::Torch`](crate::AmpError::Torch) if a cast fails.
pub fn fp32_region<T>(device: Device, inputs: &[&Tensor], f: impl FnOnce(&[Tensor]) -> T) -> Result<T> {
    let state = autocast_state(device)?;
    if !state.enabled {
        return Ok(f(&inputs.iter().map(|t| t.shallow_clone()).collect::<Vec<_>>()));
    }
    let cast = inputs
        .iter()
        .map(
            |t| if t.is_floating_point() { t.f_to_kind(Kind::Float).ctx("fp32_region") } else { Ok(t.shallow_clone()) },
        )
        .collect::<Result<Vec<_>>>()?;
    // Off for this device type, with no cast policy (torch.amp's emulation or Apex's O1).
    let _off = AutocastScope::enter(device, false, state.dtype, None, PolicyChange::Clear, Owner::Engine, None)?;
    Ok(f(&cast))
}
