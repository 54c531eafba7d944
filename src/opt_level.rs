//! Apex's opt levels.
use std::fmt;
use std::str::FromStr;

use crate::error::AmpError;

/// Apex's four optimization levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum OptLevel {
    /// Pure fp32 training: a baseline.
    O0,
    /// Mixed precision by a per-op cast policy; weights stay fp32.
    O1,
    /// fp16 model with fp32 batch norm and fp32 master weights, dynamic loss scaling.
    O2,
    /// Pure fp16 training: a speed baseline.
    O3,
}

impl fmt::Display for OptLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl FromStr for OptLevel {
    type Err = AmpError;
    fn from_str(s: &str) -> Result<Self, AmpError> {
        match s {
            "O0" => Ok(Self::O0),
            "O1" => Ok(Self::O1),
            "O2" => Ok(Self::O2),
            "O3" => Ok(Self::O3),
            _ => Err(AmpError::UnknownOptLevel { name: s.to_string() }),
        }
    }
}
