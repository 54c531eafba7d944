//! Optimizers under AMP: [`AmpOptimizer`] (skips after an overflow, clips and steps the fp32
//! masters, copies them back), the open [`UpdateRule`] trait and what it works on (`rule`), the
//! built-in rules of torch.optim (`rules`) and Apex (`apex`), parameter groups with their own
//! hyper-parameters (`groups`, run by `engine`), the parameter entries with their masters
//! (`params`), gradient plumbing (`grads`) and the [`OptimizerRecord`] it saves and restores
//! (`record`).
pub(crate) mod amp_optimizer;
pub(crate) mod apex;
mod engine;
mod grads;
pub(crate) mod groups;
pub(crate) mod params;
mod plain;
mod record;
pub(crate) mod rule;
pub(crate) mod rules;
mod sgd;

pub use amp_optimizer::MemoryReport;
pub(crate) use amp_optimizer::{AmpOptimizer, Collectives, StepOutcome};
pub(crate) use amp_optimizer::{CollapseInfo, Layout, OptimizerSetup};
pub use apex::NovoGradNorm;
pub use grads::{backward, non_finite_check_, unscale_};
pub(crate) use grads::{clip_grads, NonFiniteNorm};
pub(crate) use groups::ParamGroup;
pub(crate) use params::{build_entries, torch_param_order};
pub use plain::Optimizer;
pub use record::{GroupRecord, OptimizerRecord, ParamRecord};
pub(crate) use rule::UpdateRule;
pub use rule::{GroupView, HyperParams, ParamState, ParamView, StateShape, StateSpec};
pub use rules::Algorithm;
pub(crate) use rules::OptimizerConfig;
