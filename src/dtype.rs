//! Dtype predicates shared by the model cast, the optimizers and checkpoints, and the ranges of
//! the 16-bit types (from `half`) the precision doctor measures against.
use tch::Kind;

/// True for the 16-bit floating kinds.
pub(crate) fn is_low_precision(kind: Kind) -> bool {
    matches!(kind, Kind::Half | Kind::BFloat16)
}

/// True for the floating kinds tch-amp manages (fp16, bf16, fp32, fp64).
pub(crate) fn is_floating(kind: Kind) -> bool {
    matches!(kind, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double)
}

/// The range of a 16-bit floating dtype, from `half`'s constants: what an fp16/bf16 tensor can
/// hold, and where rounding a wider value to it (round to nearest, ties to even) gives
/// infinity, zero or a subnormal.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DtypeRange {
    /// `"fp16"` or `"bf16"`.
    pub dtype: &'static str,
    /// The largest finite value (`MAX`).
    pub max: f64,
    /// The smallest positive normal value (`MIN_POSITIVE`).
    pub min_normal: f64,
    /// The smallest positive subnormal value (`MIN_POSITIVE_SUBNORMAL`).
    pub min_subnormal: f64,
    /// Magnitudes at or above this round to infinity: `max` plus half the spacing below it.
    pub overflow_at: f64,
    /// Non-zero magnitudes at or below this round to zero: half of `min_subnormal`.
    pub zero_at: f64,
    /// Magnitudes above `zero_at` and below this round to a subnormal: `min_normal` less half
    /// of `min_subnormal` (the values just below round up to `min_normal`).
    pub subnormal_below: f64,
}

impl DtypeRange {
    /// fp16's range (`half::f16`).
    pub fn fp16() -> Self {
        use half::f16;
        let below_max = f16::from_bits(f16::MAX.to_bits() - 1).to_f64();
        Self::from_constants(
            "fp16",
            f16::MAX.to_f64(),
            below_max,
            f16::MIN_POSITIVE.to_f64(),
            f16::MIN_POSITIVE_SUBNORMAL.to_f64(),
        )
    }

    /// bf16's range (`half::bf16`).
    pub fn bf16() -> Self {
        use half::bf16;
        let below_max = bf16::from_bits(bf16::MAX.to_bits() - 1).to_f64();
        Self::from_constants(
            "bf16",
            bf16::MAX.to_f64(),
            below_max,
            bf16::MIN_POSITIVE.to_f64(),
            bf16::MIN_POSITIVE_SUBNORMAL.to_f64(),
        )
    }

    fn from_constants(dtype: &'static str, max: f64, below_max: f64, min_normal: f64, min_subnormal: f64) -> Self {
        Self {
            dtype,
            max,
            min_normal,
            min_subnormal,
            overflow_at: max + (max - below_max) / 2.0,
            zero_at: min_subnormal / 2.0,
            subnormal_below: min_normal - min_subnormal / 2.0,
        }
    }

    /// The range of `kind` when it is `Half` or `BFloat16`.
    pub fn of(kind: Kind) -> Option<Self> {
        match kind {
            Kind::Half => Some(Self::fp16()),
            Kind::BFloat16 => Some(Self::bf16()),
            _ => None,
        }
    }
}

/// A short dtype name: `fp16`, `bf16`, `fp32`, `fp64`, or tch's name for other kinds.
pub(crate) fn dtype_name(kind: Kind) -> String {
    match kind {
        Kind::Half => "fp16".into(),
        Kind::BFloat16 => "bf16".into(),
        Kind::Float => "fp32".into(),
        Kind::Double => "fp64".into(),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::DtypeRange;
    use half::{bf16, f16};

    /// The thresholds are where the rounding of an fp32 value (the reference values the doctor
    /// measures are fp32; round to nearest even, as libtorch's casts) changes its answer. In f32
    /// steps: half's `from_f64` rounds through f32 (twice), so f64 neighbours would test that.
    #[test]
    fn thresholds_match_half_rounding() {
        let next_down = |x: f64| f32::from_bits((x as f32).to_bits() - 1);
        let next_up = |x: f64| f32::from_bits((x as f32).to_bits() + 1);
        let at = |x: f64| x as f32;
        let r = DtypeRange::fp16();
        assert_eq!((r.max, r.min_normal, r.min_subnormal), (65504.0, 2f64.powi(-14), 2f64.powi(-24)));
        assert_eq!(r.overflow_at, 65520.0);
        assert!(f16::from_f32(at(r.overflow_at)).is_infinite());
        assert_eq!(f16::from_f32(next_down(r.overflow_at)), f16::MAX);
        assert_eq!(f16::from_f32(at(r.zero_at)).to_f64(), 0.0);
        assert_eq!(f16::from_f32(next_up(r.zero_at)), f16::MIN_POSITIVE_SUBNORMAL);
        let sub = f16::from_f32(next_down(r.subnormal_below));
        assert!(!sub.is_normal() && sub.to_f64() > 0.0);
        assert_eq!(f16::from_f32(at(r.subnormal_below)), f16::MIN_POSITIVE);

        let b = DtypeRange::bf16();
        assert_eq!(b.max, bf16::MAX.to_f64());
        assert!(bf16::from_f32(at(b.overflow_at)).is_infinite());
        assert_eq!(bf16::from_f32(next_down(b.overflow_at)), bf16::MAX);
        assert_eq!(bf16::from_f32(at(b.zero_at)).to_f64(), 0.0);
        assert_eq!(bf16::from_f32(next_up(b.zero_at)), bf16::MIN_POSITIVE_SUBNORMAL);
        let sub = bf16::from_f32(next_down(b.subnormal_below));
        assert!(!sub.is_normal() && sub.to_f64() > 0.0);
        assert_eq!(bf16::from_f32(at(b.subnormal_below)), bf16::MIN_POSITIVE);
    }
}
