//! The switches of the cast engine, resolved once: the same names as [`crate::AmpConfig`]'s
//! setters, carried by [`crate::Properties`] and handed to [`crate::cast::install_policy`].
use tch::Kind;

use super::cpu::{resolve, CpuKernelChoice, CpuKernels, OpClass};

/// How an installed [`crate::CastPolicy`] behaves.
///
/// ```
/// use tch::Kind;
/// use tch_amp::CpuKernels;
/// use tch_amp::cast::CastSettings;
/// use tch_amp::{CpuKernelChoice, OpClass};
/// let bf16 = CastSettings::default().low_precision_dtype(Kind::BFloat16).allow_banned(true);
/// assert_eq!(bf16.low_precision_dtype, Kind::BFloat16);
/// assert_eq!(bf16.cpu_bf16, CpuKernelChoice::default()); // every class decided from the CPU
/// let emulated = bf16.cpu_kernels(CpuKernels::Emulate);
/// assert!(emulated.emulates_class(Kind::BFloat16, OpClass::Attention) && emulated.emulates(Kind::Half));
/// let conv = bf16.cpu_kernels_class(OpClass::Convolution, CpuKernels::Native);
/// assert!(!conv.emulates_class(Kind::Half, OpClass::Convolution));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CastSettings {
    /// The dtype of the low-precision list: `Kind::Half` (Apex's only choice) or
    /// `Kind::BFloat16` (bf16 keeps fp32's exponent range, so it needs no loss scaling).
    pub low_precision_dtype: Kind,
    /// Run banned ops (binary_cross_entropy) in fp32 instead of refusing fp16/bf16 inputs;
    /// Apex's `allow_banned`.
    pub allow_banned: bool,
    /// How fp16 GEMMs, convolutions and attention run on the CPU, per class
    /// ([`CpuKernelChoice`]; `Auto` for every class by default). In the [`crate::Properties`]
    /// of an `initialize`, `Auto` is already resolved.
    pub cpu_fp16: CpuKernelChoice,
    /// How bf16 ops run on the CPU, as [`CastSettings::cpu_fp16`].
    pub cpu_bf16: CpuKernelChoice,
}

impl Default for CastSettings {
    /// fp16, banned ops refused, CPU kernels chosen from the CPU.
    fn default() -> Self {
        Self {
            low_precision_dtype: Kind::Half,
            allow_banned: false,
            cpu_fp16: CpuKernelChoice::default(),
            cpu_bf16: CpuKernelChoice::default(),
        }
    }
}

impl CastSettings {
    /// Sets [`CastSettings::low_precision_dtype`].
    pub fn low_precision_dtype(mut self, kind: Kind) -> Self {
        self.low_precision_dtype = kind;
        self
    }

    /// Sets [`CastSettings::allow_banned`].
    pub fn allow_banned(mut self, allow: bool) -> Self {
        self.allow_banned = allow;
        self
    }

    /// Sets how every class of fp16 and bf16 ops runs on the CPU.
    pub fn cpu_kernels(mut self, mode: CpuKernels) -> Self {
        self.cpu_fp16 = CpuKernelChoice::all(mode);
        self.cpu_bf16 = CpuKernelChoice::all(mode);
        self
    }

    /// Sets how every class of `kind`'s (`Half` or `BFloat16`) ops runs on the CPU; other kinds
    /// change nothing.
    pub fn cpu_kernels_for(self, kind: Kind, mode: CpuKernels) -> Self {
        self.cpu_kernel_choice(kind, CpuKernelChoice::all(mode))
    }

    /// Sets how `class`'s ops run on the CPU, for fp16 and bf16.
    pub fn cpu_kernels_class(mut self, class: OpClass, mode: CpuKernels) -> Self {
        self.cpu_fp16 = self.cpu_fp16.with(class, mode);
        self.cpu_bf16 = self.cpu_bf16.with(class, mode);
        self
    }

    /// Sets `kind`'s (`Half` or `BFloat16`) choice for every class; other kinds change nothing.
    pub fn cpu_kernel_choice(mut self, kind: Kind, choice: CpuKernelChoice) -> Self {
        match kind {
            Kind::Half => self.cpu_fp16 = choice,
            Kind::BFloat16 => self.cpu_bf16 = choice,
            _ => {}
        }
        self
    }

    /// `true`: [`CpuKernels::Emulate`] for every class and both types; `false`:
    /// [`CpuKernels::Native`].
    pub fn emulate_low_precision_on_cpu(self, emulate: bool) -> Self {
        self.cpu_kernels(if emulate { CpuKernels::Emulate } else { CpuKernels::Native })
    }

    /// The choice set for `kind` (`Auto` unless set or resolved); every class `Native` for other
    /// kinds.
    pub fn cpu_kernels_of(&self, kind: Kind) -> CpuKernelChoice {
        match kind {
            Kind::Half => self.cpu_fp16,
            Kind::BFloat16 => self.cpu_bf16,
            _ => CpuKernelChoice::all(CpuKernels::Native),
        }
    }

    /// Whether some class of `kind`'s ops is emulated on this CPU (`Auto` resolved).
    pub fn emulates(&self, kind: Kind) -> bool {
        OpClass::ALL.iter().any(|c| self.emulates_class(kind, *c))
    }

    /// Whether `class`'s ops in `kind` are emulated on this CPU (`Auto` resolved).
    pub fn emulates_class(&self, kind: Kind, class: OpClass) -> bool {
        matches!(kind, Kind::Half | Kind::BFloat16)
            && resolve(self.cpu_kernels_of(kind), kind).get(class) == CpuKernels::Emulate
    }

    /// These settings with `Auto` replaced by this CPU's choice for each type and class.
    pub fn resolved(self) -> Self {
        Self { cpu_fp16: resolve(self.cpu_fp16, Kind::Half), cpu_bf16: resolve(self.cpu_bf16, Kind::BFloat16), ..self }
    }
}
