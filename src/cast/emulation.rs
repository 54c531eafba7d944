//! The CPU low-precision emulation list (`opt_levels/emulate_cpu.toml`), as data.
use crate::error::ConfigError;
use serde::Deserialize;

use super::policy::aten_overloads;
use crate::error::{AmpError, Result};

const EMULATE_TOML: &str = include_str!("../../opt_levels/emulate_cpu.toml");

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EmulationList {
    ops: Vec<String>,
}

/// The exact aten overloads whose fp16/bf16 CPU calls are emulated in fp32 when
/// [`crate::cast::CastSettings::emulates`] the type (GEMMs and convolutions, see
/// `opt_levels/emulate_cpu.toml` for the list and the numerical contract).
///
/// # Errors
/// [`ConfigError::Parse`] or [`ConfigError::UnknownOp`] if the embedded list does not match the
/// linked libtorch (a packaging error, covered by the crate's tests).
pub fn emulated_ops() -> Result<Vec<String>> {
    let list: EmulationList = toml::from_str(EMULATE_TOML).map_err(|e| {
        AmpError::Config(ConfigError::Parse { what: "opt_levels/emulate_cpu.toml".to_string(), message: e.to_string() })
    })?;
    let mut ops = Vec::new();
    for entry in &list.ops {
        ops.extend(aten_overloads(entry)?);
    }
    ops.sort();
    ops.dedup();
    Ok(ops)
}
