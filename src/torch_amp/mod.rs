//! torch.amp for tch: torch.amp.GradScaler ([`crate::GradScaler`]) beside the one autocast
//! ([`crate::Autocast`]), plus Lightning's precision flags ([`Precision`]). This is PyTorch's mixed precision, not Apex's: no opt levels, no master
//! weights, fp32 parameters with per-op casts by libtorch's lists (see the crate root for the
//! Apex path).
//!
//! | torch.amp / Lightning | tch-amp |
//! |---|---|
//! | `torch.autocast("cpu")` / `torch.autocast("cuda", dtype=...)` | [`crate::autocast`]`(device, ..)`, [`crate::Autocast::new`]`(device).dtype(..)` |
//! | `torch.amp.GradScaler("cuda")` | [`crate::GradScaler::new`]`(Device::Cuda(0))` |
//! | `scaler.scale(loss).backward()` | `scaler.scale(&loss)?.backward()` |
//! | `scaler.unscale_(opt)`, `scaler.step(opt)`, `scaler.update()` | the same names, `?` |
//! | `scaler.state_dict()` / `torch.save` | [`crate::GradScaler::state_dict`] / [`crate::GradScaler::save`] |
//! | `Trainer(precision="16-mixed")` | [`Precision::parse`] |
//!
//! Any [`crate::optim::Optimizer`] works with the scaler: tch's `nn::Optimizer`, a plain
//! [`crate::AmpOptimizer::new`] (torch.optim's and Apex's rules, parameter groups, a user's
//! [`crate::UpdateRule`]), or a type of your own.
//!
//! On CUDA, and on CPUs with fast units for the type, autocast runs libtorch's kernels, bit for
//! bit torch.autocast's. Elsewhere on the CPU it emulates the GEMMs and convolutions in fp32 as
//! the Apex path does ([`crate::Autocast::cpu_kernels`]; [`crate::CpuKernels::Native`] keeps
//! libtorch's).
//!
//! Autocast and the Apex path's O1 policy both drive libtorch's autocast state: on one thread
//! only one of them may be active at a time
//! ([`UsageError::AutocastConflict`](crate::error::UsageError::AutocastConflict)).
mod clip;
pub(crate) mod grad_scaler;
mod lightning;

pub use clip::clip_grad_norm_;
pub use grad_scaler::GradScalerOptions;
pub use lightning::Precision;
