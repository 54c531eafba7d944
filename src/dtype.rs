//! Mapping between tch's [`Kind`] / [`Device`] and the codes the C++ shim speaks
//! (`c10::ScalarType`, `c10::DeviceType`).
use tch::{Device, Kind};

use crate::error::{AmpError, Result};

/// `c10::ScalarType` code of a floating kind tch-amp casts to or from.
pub(crate) fn scalar_type_code(kind: Kind) -> Result<i32> {
    Ok(match kind {
        Kind::Half => 5,
        Kind::Float => 6,
        Kind::Double => 7,
        Kind::BFloat16 => 15,
        other => {
            return Err(AmpError::InvalidOption {
                option: "dtype",
                value: format!("{other:?}"),
                expected: "Half, BFloat16, Float or Double",
            })
        }
    })
}

/// The kind of a `c10::ScalarType` code handed back by the shim.
pub(crate) fn kind_from_code(code: i32) -> Result<Kind> {
    Ok(match code {
        5 => Kind::Half,
        6 => Kind::Float,
        7 => Kind::Double,
        15 => Kind::BFloat16,
        other => {
            return Err(AmpError::Shim {
                what: "dtype",
                message: format!("unexpected c10::ScalarType code {other}"),
            })
        }
    })
}

/// `c10::DeviceType` code of a device (CPU = 0, CUDA = 1).
pub(crate) fn device_type_code(device: Device) -> Result<i32> {
    match device {
        Device::Cpu => Ok(0),
        Device::Cuda(_) => Ok(1),
        other => Err(AmpError::InvalidOption {
            option: "device",
            value: format!("{other:?}"),
            expected: "Device::Cpu or Device::Cuda(_)",
        }),
    }
}

/// True for the 16-bit floating kinds.
pub(crate) fn is_low_precision(kind: Kind) -> bool {
    matches!(kind, Kind::Half | Kind::BFloat16)
}

/// True for the floating kinds tch-amp manages (fp16, bf16, fp32, fp64).
pub(crate) fn is_floating(kind: Kind) -> bool {
    matches!(kind, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double)
}
