//! The CPU low-precision emulation list (`opt_levels/emulate_cpu.toml`), as data: the emulated
//! ops by operation class, and how each one's backward runs.
use crate::error::ConfigError;
use serde::Deserialize;

use super::cpu::OpClass;
use super::policy::aten_overloads;
use crate::error::{AmpError, Result};

const EMULATE_TOML: &str = include_str!("../../opt_levels/emulate_cpu.toml");

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ClassList {
    #[serde(default)]
    ops: Vec<String>,
    #[serde(default)]
    recompute_ops: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EmulationList {
    gemm: ClassList,
    convolution: ClassList,
    attention: ClassList,
}

/// One emulated aten overload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EmulatedOp {
    /// `"name"` or `"name.overload"`.
    pub(crate) op: String,
    pub(crate) class: OpClass,
    /// Backward reruns the fp32 op instead of replaying the graph the forward recorded.
    pub(crate) recompute: bool,
}

/// Every emulated overload with its class, sorted by name.
///
/// # Errors
/// As [`emulated_ops`].
pub(crate) fn emulated_op_table() -> Result<Vec<EmulatedOp>> {
    let list: EmulationList = toml::from_str(EMULATE_TOML).map_err(|e| {
        AmpError::Config(ConfigError::Parse { what: "opt_levels/emulate_cpu.toml".to_string(), message: e.to_string() })
    })?;
    let mut table = Vec::new();
    for (class, entries) in
        [(OpClass::Gemm, &list.gemm), (OpClass::Convolution, &list.convolution), (OpClass::Attention, &list.attention)]
    {
        for (names, recompute) in [(&entries.ops, false), (&entries.recompute_ops, true)] {
            for entry in names {
                table.extend(aten_overloads(entry)?.into_iter().map(|op| EmulatedOp { op, class, recompute }));
            }
        }
    }
    table.sort_by(|a, b| a.op.cmp(&b.op));
    table.dedup_by(|a, b| a.op == b.op);
    Ok(table)
}

/// The exact aten overloads whose fp16/bf16 CPU calls can be emulated in fp32 (GEMMs,
/// convolutions and attention, see `opt_levels/emulate_cpu.toml` for the list and the numerical
/// contract), sorted; [`emulated_op_class`] says which class each belongs to.
///
/// # Errors
/// [`ConfigError::Parse`] or [`ConfigError::UnknownOp`] if the embedded list does not match the
/// linked libtorch (a packaging error, covered by the crate's tests).
pub fn emulated_ops() -> Result<Vec<String>> {
    Ok(emulated_op_table()?.into_iter().map(|e| e.op).collect())
}

/// The operation class of an emulated overload (`"name"` or `"name.overload"`, as
/// [`emulated_ops`] lists them); `None` for an op the emulation does not cover.
///
/// # Errors
/// As [`emulated_ops`].
pub fn emulated_op_class(op: &str) -> Result<Option<OpClass>> {
    Ok(emulated_op_table()?.into_iter().find(|e| e.op == op).map(|e| e.class))
}
