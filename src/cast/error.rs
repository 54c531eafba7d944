//! Turning the cast engine's refusals, which reach the caller as tch errors, into typed errors.
use tch::TchError;

use crate::error::{AmpError, OpRefused};
use crate::sys::cast::RefusalCode;

/// Classifies an error returned by a tch `f_*` call made under an O1 policy: the engine's refusals
/// become [`OpRefused::BannedOp`] or [`OpRefused::InPlaceFp32OnHalf`]; anything else is kept as
/// [`AmpError::Torch`].
///
/// The engine runs inside libtorch's dispatcher, so its refusals travel through tch as
/// `TchError::Torch` messages. The engine also keeps the calling thread's last refusal as a code
/// (with the op, the dtype and the message it threw); this takes it and returns it typed when `err`
/// is that refusal. Call it on the thread that ran the op.
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch::{Device, Kind, Reduction, Tensor};
/// use tch_amp::cast::{classify_torch_error, install_policy};
/// use tch_amp::error::OpRefused;
/// use tch_amp::{AmpError, CastPolicy};
/// use tch_amp::cast::CastSettings;
/// let handle = install_policy(CastPolicy::apex(), CastSettings::default())?;
/// let _active = handle.activate(Device::Cpu)?;
/// let p = Tensor::full([4], 0.5, (Kind::Half, Device::Cpu));
/// let err = p.f_binary_cross_entropy(&p.to_kind(Kind::Float), None::<Tensor>, Reduction::Mean).unwrap_err();
/// assert!(matches!(classify_torch_error(err), AmpError::OpRefused(OpRefused::BannedOp { .. })));
/// # Ok(())
/// # }
/// ```
pub fn classify_torch_error(err: TchError) -> AmpError {
    let refusal = match crate::sys::cast::take_refusal() {
        Ok(refusal) => refusal,
        Err(e) => return e,
    };
    // The refusal recorded on this thread is this error's only if the error carries its
    // message (tch adds libtorch's context around it); an older refusal that its caller
    // dropped is discarded here.
    match refusal {
        Some(r) if err.to_string().contains(&r.message) => match r.code {
            RefusalCode::BannedOp => AmpError::OpRefused(OpRefused::BannedOp { op: r.op }),
            RefusalCode::InPlaceFp32 => AmpError::OpRefused(OpRefused::InPlaceFp32OnHalf { op: r.op, dtype: r.dtype }),
        },
        _ => AmpError::Torch { context: "running an op under an O1 cast policy", source: err },
    }
}
