//! The switches of the cast engine, resolved once: the same names as [`crate::AmpConfig`]'s
//! setters, carried by [`crate::Properties`] and handed to [`crate::cast::install_policy`].
use tch::Kind;

use super::cpu::{resolve, CpuKernels};

/// How an installed [`crate::CastPolicy`] behaves.
///
/// ```
/// use tch::Kind;
/// use tch_amp::CpuKernels;
/// use tch_amp::cast::CastSettings;
/// let bf16 = CastSettings::default().low_precision_dtype(Kind::BFloat16).allow_banned(true);
/// assert_eq!(bf16.low_precision_dtype, Kind::BFloat16);
/// assert_eq!(bf16.cpu_bf16, CpuKernels::Auto); // decided from the CPU when installed
/// let emulated = bf16.cpu_kernels(CpuKernels::Emulate);
/// assert!(emulated.emulates(Kind::BFloat16) && emulated.emulates(Kind::Half));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CastSettings {
    /// The dtype of the low-precision list: `Kind::Half` (Apex's only choice) or
    /// `Kind::BFloat16` (bf16 keeps fp32's exponent range, so it needs no loss scaling).
    pub low_precision_dtype: Kind,
    /// Run banned ops (binary_cross_entropy) in fp32 instead of refusing fp16/bf16 inputs;
    /// Apex's `allow_banned`.
    pub allow_banned: bool,
    /// How fp16 GEMMs and convolutions run on the CPU ([`CpuKernels`]; `Auto` by default). In
    /// the [`crate::Properties`] of an `initialize`, `Auto` is already resolved.
    pub cpu_fp16: CpuKernels,
    /// How bf16 GEMMs and convolutions run on the CPU, as [`CastSettings::cpu_fp16`].
    pub cpu_bf16: CpuKernels,
}

impl Default for CastSettings {
    /// fp16, banned ops refused, CPU kernels chosen from the CPU.
    fn default() -> Self {
        Self {
            low_precision_dtype: Kind::Half,
            allow_banned: false,
            cpu_fp16: CpuKernels::Auto,
            cpu_bf16: CpuKernels::Auto,
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

    /// Sets how both fp16 and bf16 GEMMs and convolutions run on the CPU.
    pub fn cpu_kernels(mut self, mode: CpuKernels) -> Self {
        self.cpu_fp16 = mode;
        self.cpu_bf16 = mode;
        self
    }

    /// Sets how `kind`'s (`Half` or `BFloat16`) GEMMs and convolutions run on the CPU; other
    /// kinds change nothing.
    pub fn cpu_kernels_for(mut self, kind: Kind, mode: CpuKernels) -> Self {
        match kind {
            Kind::Half => self.cpu_fp16 = mode,
            Kind::BFloat16 => self.cpu_bf16 = mode,
            _ => {}
        }
        self
    }

    /// `true`: [`CpuKernels::Emulate`] for both types; `false`: [`CpuKernels::Native`].
    pub fn emulate_low_precision_on_cpu(self, emulate: bool) -> Self {
        self.cpu_kernels(if emulate { CpuKernels::Emulate } else { CpuKernels::Native })
    }

    /// The mode set for `kind` (`Auto` unless set or resolved); `Native` for other kinds.
    pub fn cpu_kernels_of(&self, kind: Kind) -> CpuKernels {
        match kind {
            Kind::Half => self.cpu_fp16,
            Kind::BFloat16 => self.cpu_bf16,
            _ => CpuKernels::Native,
        }
    }

    /// Whether `kind`'s GEMMs and convolutions are emulated on this CPU (`Auto` resolved).
    pub fn emulates(&self, kind: Kind) -> bool {
        resolve(self.cpu_kernels_of(kind), kind) == CpuKernels::Emulate
    }

    /// These settings with `Auto` replaced by this CPU's choice for each type.
    pub fn resolved(self) -> Self {
        Self { cpu_fp16: resolve(self.cpu_fp16, Kind::Half), cpu_bf16: resolve(self.cpu_bf16, Kind::BFloat16), ..self }
    }
}
