//! The switches of the cast engine, resolved once: the same names as [`crate::AmpConfig`]'s
//! setters, carried by [`crate::Properties`] and handed to [`crate::cast::install_policy`].
use tch::Kind;

/// How an installed [`crate::CastPolicy`] behaves.
///
/// ```
/// use tch::Kind;
/// use tch_amp::CastSettings;
/// let bf16 = CastSettings::default().low_precision_dtype(Kind::BFloat16).allow_banned(true);
/// assert_eq!(bf16.low_precision_dtype, Kind::BFloat16);
/// assert!(bf16.emulate_low_precision_on_cpu);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CastSettings {
    /// The dtype of the low-precision list: `Kind::Half` (Apex's only choice) or
    /// `Kind::BFloat16` (bf16 keeps fp32's exponent range, so it needs no loss scaling).
    pub low_precision_dtype: Kind,
    /// Run banned ops (binary_cross_entropy) in fp32 instead of refusing fp16/bf16 inputs;
    /// Apex's `allow_banned`.
    pub allow_banned: bool,
    /// Emulate fp16/bf16 GEMMs and convolutions on the CPU: compute in fp32 from the rounded
    /// inputs and round the outputs (`opt_levels/emulate_cpu.toml` lists the ops and states the
    /// numerical contract). On by default: a CPU without fp16/bf16 matrix units runs native
    /// fp16 GEMMs 50-170x slower than fp32 and gets the same rounding this way. Off gives
    /// libtorch's native low-precision kernels. Has no effect on CUDA.
    pub emulate_low_precision_on_cpu: bool,
}

impl Default for CastSettings {
    /// fp16, banned ops refused, CPU emulation on.
    fn default() -> Self {
        Self { low_precision_dtype: Kind::Half, allow_banned: false, emulate_low_precision_on_cpu: true }
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

    /// Sets [`CastSettings::emulate_low_precision_on_cpu`].
    pub fn emulate_low_precision_on_cpu(mut self, emulate: bool) -> Self {
        self.emulate_low_precision_on_cpu = emulate;
        self
    }
}
