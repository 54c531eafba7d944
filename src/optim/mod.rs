//! Optimizers under AMP: [`AmpOptimizer`] (skips after an overflow, clips and steps the fp32
//! masters, copies them back), the update rules it runs (`rules`), the parameter entries with
//! their masters (`params`), gradient plumbing (`grads`) and the [`OptimizerRecord`] it saves
//! and restores (`record`).
mod amp_optimizer;
mod grads;
mod params;
mod record;
mod rules;

pub(crate) use amp_optimizer::{gradient_scans, set_master_grad_slice, CollapseInfo, OptimizerSetup};
pub use amp_optimizer::{AmpOptimizer, MemoryReport, StepOutcome};
pub use grads::unscale_;
pub(crate) use params::build_entries;
pub use record::{OptimizerRecord, ParamRecord};
pub use rules::{Algorithm, OptimizerConfig};
