//! Optimizers under AMP: [`AmpOptimizer`] (skips after an overflow, clips and steps the fp32
//! masters, copies them back), the open [`UpdateRule`] trait and what it works on (`rule`), the
//! built-in rules of torch.optim (`rules`) and Apex (`apex`), parameter groups with their own
//! hyper-parameters (`groups`, run by `engine`), the parameter entries with their masters
//! (`params`), gradient plumbing (`grads`) and the [`OptimizerRecord`] it saves and restores
//! (`record`).
mod amp_optimizer;
mod apex;
mod engine;
mod grads;
mod groups;
mod params;
mod record;
mod rule;
mod rules;

pub(crate) use amp_optimizer::{gradient_scans, set_master_grad_slice, CollapseInfo, Layout, OptimizerSetup};
pub use amp_optimizer::{AmpOptimizer, MemoryReport, StepOutcome};
pub use apex::{FusedAdagrad, FusedAdam, FusedLamb, FusedNovoGrad, FusedSgd, NovoGradNorm};
pub(crate) use engine::{o2_single_pass_updates, set_o2_single_pass};
pub(crate) use grads::check_clip_args;
pub use grads::{non_finite_check_, unscale_};
pub(crate) use groups::resolve;
pub use groups::ParamGroup;
pub(crate) use params::build_entries;
pub use record::{GroupRecord, OptimizerRecord, ParamRecord};
pub use rule::{GroupView, HyperParams, ParamState, ParamView, StateShape, StateSpec, UpdateRule};
pub(crate) use rules::FusedAdamHyper;
pub use rules::{Algorithm, OptimizerConfig};
