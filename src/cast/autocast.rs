//! torch.autocast for tch: [`Autocast`] (torch's `device_type`, `dtype`, `enabled`,
//! `cache_enabled`), [`autocast`] for the common case, and [`fp32_region`] (torch's
//! `custom_fwd(cast_inputs=torch.float32)`). Each enters the one autocast guard,
//! [`AutocastScope`]: per thread, nestable, restored on drop and on panic.
use tch::{Device, Kind, Tensor};

use super::cpu::{resolve as resolve_cpu_kernels, warn_if_slow, CpuKernelChoice, CpuKernels, OpClass};
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
/// On CUDA, autocast runs libtorch's own fp16/bf16 kernels, so forward and backward are
/// torch.autocast's bit for bit. On the CPU it makes the Apex path's choice per operation class
/// (GEMMs, convolutions, attention; [`Autocast::cpu_kernels`], [`CpuKernels::Auto`] by default,
/// see [`crate::cast::CpuFeatures::native_is_fast`]): where libtorch's fp16/bf16 kernels of a
/// class are slower than fp32 on this kind of CPU, its ops (`opt_levels/emulate_cpu.toml`) are
/// cast as libtorch casts them (its weight cache included), computed in fp32 and their outputs
/// rounded once to the autocast dtype, forward and backward (the contract of that file; results
/// are within an ulp of libtorch's native kernels, plus fp32 summation order). Every other op
/// runs libtorch's autocast kernel. Only [`CpuKernels::Native`] for every class reproduces
/// torch.autocast's CPU results bit for bit on every CPU; the default does so on a CPU only
/// where `Auto` picks native kernels for every class the model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Autocast {
    device: Device,
    dtype: Option<Kind>,
    enabled: bool,
    cache_enabled: Option<bool>,
    cpu_kernels: CpuKernelChoice,
}

impl Autocast {
    /// Autocast for `device`'s type (CPU or CUDA; the index is ignored, as torch's
    /// `device_type`), enabled, in the thread's current autocast dtype for that type (bf16 on
    /// CPU and fp16 on CUDA unless an enclosing scope set another), the cache flag unchanged.
    pub fn new(device: Device) -> Self {
        Self { device, dtype: None, enabled: true, cache_enabled: None, cpu_kernels: CpuKernelChoice::default() }
    }

    /// How the CPU's fp16/bf16 GEMMs, convolutions and attention run inside the scope (see "CPU
    /// kernels" above), every class alike: [`CpuKernels::Auto`] (the default) emulates a class
    /// where libtorch's kernels for it are slow on this CPU, [`CpuKernels::Native`] always runs
    /// libtorch's kernels (bit for bit torch.autocast), [`CpuKernels::Emulate`] always emulates.
    /// No effect on CUDA.
    pub fn cpu_kernels(mut self, mode: CpuKernels) -> Self {
        self.cpu_kernels = CpuKernelChoice::all(mode);
        self
    }

    /// [`Self::cpu_kernels`] for one operation class; the others keep what was set.
    pub fn cpu_kernels_class(mut self, class: OpClass, mode: CpuKernels) -> Self {
        self.cpu_kernels = self.cpu_kernels.with(class, mode);
        self
    }

    /// Every class's mode at once (e.g. parsed from `"native,attention=emulate"`).
    pub fn cpu_kernel_choice(mut self, choice: CpuKernelChoice) -> Self {
        self.cpu_kernels = choice;
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
            let choice = resolve_cpu_kernels(self.cpu_kernels, dtype);
            warn_if_slow(choice, dtype);
            match torch_autocast_policy(dtype, choice)? {
                Some(policy) => PolicyChange::Activate(policy),
                None => PolicyChange::Clear,
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
