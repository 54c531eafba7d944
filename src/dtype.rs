//! Dtype predicates shared by the model cast, the optimizers and checkpoints.
use tch::Kind;

/// True for the 16-bit floating kinds.
pub(crate) fn is_low_precision(kind: Kind) -> bool {
    matches!(kind, Kind::Half | Kind::BFloat16)
}

/// True for the floating kinds tch-amp manages (fp16, bf16, fp32, fp64).
pub(crate) fn is_floating(kind: Kind) -> bool {
    matches!(kind, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double)
}
