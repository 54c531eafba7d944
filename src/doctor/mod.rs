//! The precision doctor: which layer overflows, underflows or loses precision in fp16/bf16, and
//! what to do about it, from one batch.
//!
//! [`Doctor::run`] runs the model's forward and backward twice on the same weights and batch: in
//! fp32, then at the target set-up (Apex's O1/O2/O3 or torch.amp's autocast, fp16 or bf16, CPU or
//! CUDA), with libtorch's op observer on. Every top-level op the model's code calls is seen by
//! name, in call order, with its dtypes, its module (the VarStore path prefix of the weights it
//! reads) and, in backward, the gradients of its outputs. The [`DoctorReport`] holds, per op and
//! per module, max |x|, the smallest non-zero |x|, the shares that overflow, become zero or
//! subnormal in the 16-bit type, the relative error against fp32, where the first inf/NaN
//! appeared, the loss-scale window, and [`Finding`]s with evidence and the call to write.
//!
//! [`watch`] is the hook into training: an opt-in [`Watch`] that names the first inf/NaN of a
//! batch whose step a scaler skips. Nothing here runs unless called. Coverage, thresholds and
//! costs: `docs/doctor.md`.
mod advice;
mod record;
mod report;
mod run;
mod stats;
pub(crate) mod watch;

pub use crate::dtype::DtypeRange;
pub use advice::{PRECISION_ROUNDOFFS, UNDERFLOW_SHARE};
pub use report::{
    Advice, DoctorReport, Finding, FindingKind, Fp32Comparison, Losses, ModuleReport, NonFiniteOrigin, OpReport, Phase,
    ScaleWindow, Severity, TensorStats,
};
pub use run::{Doctor, Pass, Target};
pub use watch::{watch, Watch};
