//! The switches of an installed O1 policy.
use tch::Kind;

/// How an installed [`crate::CastPolicy`] behaves.
///
/// ```
/// use tch::Kind;
/// let bf16 = tch_amp::O1Settings::default().low_dtype(Kind::BFloat16).allow_banned(true);
/// assert_eq!(bf16.low_dtype, Kind::BFloat16);
/// assert!(bf16.emulate_cpu);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct O1Settings {
    /// The low-precision dtype of the low-precision list: `Kind::Half` (Apex's only choice) or
    /// `Kind::BFloat16` (bf16 keeps fp32's exponent range, so it needs no loss scaling).
    pub low_dtype: Kind,
    /// Run banned ops (binary_cross_entropy) in fp32 instead of refusing fp16/bf16 inputs;
    /// Apex's `allow_banned`.
    pub allow_banned: bool,
    /// Emulate fp16/bf16 GEMMs and convolutions on the CPU: compute in fp32 from the rounded
    /// inputs and round the outputs (`opt_levels/emulate_cpu.toml` lists the ops and states the
    /// numerical contract). On by default: a CPU without fp16/bf16 matrix units runs native
    /// fp16 GEMMs 50-170x slower than fp32 and gets the same rounding this way. Off gives
    /// libtorch's native low-precision kernels. Has no effect on CUDA.
    pub emulate_cpu: bool,
}

impl Default for O1Settings {
    /// fp16, banned ops refused, CPU emulation on.
    fn default() -> Self {
        Self { low_dtype: Kind::Half, allow_banned: false, emulate_cpu: true }
    }
}

impl O1Settings {
    /// Sets [`O1Settings::low_dtype`].
    pub fn low_dtype(mut self, kind: Kind) -> Self {
        self.low_dtype = kind;
        self
    }

    /// Sets [`O1Settings::allow_banned`].
    pub fn allow_banned(mut self, allow: bool) -> Self {
        self.allow_banned = allow;
        self
    }

    /// Sets [`O1Settings::emulate_cpu`].
    pub fn emulate_cpu(mut self, emulate: bool) -> Self {
        self.emulate_cpu = emulate;
        self
    }
}
