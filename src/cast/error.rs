//! Turning the cast engine's refusals, which reach the caller as tch errors, into typed errors.
use tch::{Kind, TchError};

use crate::error::AmpError;

/// Classifies an error returned by a tch `f_*` call made under an O1 policy: the engine's
/// refusals become [`AmpError::BannedOp`] or [`AmpError::InPlaceFp32OnHalf`]; anything else is
/// kept as [`AmpError::Torch`].
///
/// The engine runs inside libtorch's dispatcher, so its refusals travel through tch as
/// `TchError::Torch` messages; this recovers the type.
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch::{Device, Kind, Reduction, Tensor};
/// use tch_amp::cast::{classify_torch_error, install_policy};
/// use tch_amp::{AmpError, CastPolicy};
/// use tch_amp::cast::CastSettings;
/// let handle = install_policy(CastPolicy::apex(), CastSettings::default())?;
/// let _active = handle.activate(Device::Cpu)?;
/// let p = Tensor::full([4], 0.5, (Kind::Half, Device::Cpu));
/// let err = p.f_binary_cross_entropy(&p.to_kind(Kind::Float), None::<Tensor>, Reduction::Mean).unwrap_err();
/// assert!(matches!(classify_torch_error(err), AmpError::BannedOp { .. }));
/// # Ok(())
/// # }
/// ```
pub fn classify_torch_error(err: TchError) -> AmpError {
    let message = err.to_string();
    if let Some(rest) = after(&message, "tch-amp O1 [banned op ") {
        if let Some(op) = rest.split(']').next() {
            return AmpError::BannedOp { op: op.to_string() };
        }
    }
    if let Some(rest) = after(&message, "tch-amp O1 [in-place fp32 op ") {
        if let Some(head) = rest.split(']').next() {
            if let Some((op, dtype)) = head.split_once(" on ") {
                let dtype = if dtype == "BFloat16" { Kind::BFloat16 } else { Kind::Half };
                return AmpError::InPlaceFp32OnHalf { op: op.to_string(), dtype };
            }
        }
    }
    AmpError::Torch { context: "running an op under an O1 cast policy", source: err }
}

fn after<'a>(text: &'a str, marker: &str) -> Option<&'a str> {
    text.find(marker).map(|i| &text[i + marker.len()..])
}
