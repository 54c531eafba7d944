//! Apex's four opt levels: a leaf type with its own parse error.
use std::fmt;
use std::str::FromStr;

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

impl OptLevel {
    /// All four levels, in order.
    pub const ALL: [OptLevel; 4] = [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3];
}

impl fmt::Display for OptLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A name that is not an opt level. Converts into
/// [`ConfigError::UnknownOptLevel`](crate::error::ConfigError::UnknownOptLevel) (so `?` works in
/// functions returning tch-amp's `Result`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown opt level {name:?}: expected \"O0\", \"O1\", \"O2\" or \"O3\" (the letter O, not the number zero)")]
pub struct ParseOptLevelError {
    name: String,
}

impl ParseOptLevelError {
    /// The name that was given.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl FromStr for OptLevel {
    type Err = ParseOptLevelError;
    /// `"O0"` .. `"O3"` (the letter O).
    fn from_str(s: &str) -> Result<Self, ParseOptLevelError> {
        match s {
            "O0" => Ok(Self::O0),
            "O1" => Ok(Self::O1),
            "O2" => Ok(Self::O2),
            "O3" => Ok(Self::O3),
            _ => Err(ParseOptLevelError { name: s.to_string() }),
        }
    }
}
