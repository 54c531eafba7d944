//! The cast engine: O1's per-op casts (Apex's cast lists as a libtorch dispatcher policy) and the
//! CPU emulation of fp16/bf16 GEMMs, convolutions and attention (O1, O2, O3 and torch.amp's CPU
//! autocast).
//!
//! Apex's O1 monkey-patched Python functions (`torch.nn.functional.linear`, `torch.exp`,
//! `Tensor.__add__`, ...) so that their inputs were cast before they ran. tch programs call
//! libtorch directly, so tch-amp casts one level down, at libtorch's Autocast dispatch keys
//! (AutocastCPU, AutocastCUDA): they sit above autograd and see every op a thread runs while
//! autocast is on, whichever Rust code makes the call. tch-amp registers one generic (boxed) kernel
//! per listed aten op there, once per process; the lists are data ([`CastPolicy`]), so any op can
//! be listed without code.
//!
//! Most programs never touch this module: [`crate::Amp`] installs and activates what its opt level
//! needs. It is public for custom set-ups:
//! - [`install_policy`] builds a policy and returns a [`PolicyHandle`]; [`PolicyHandle::activate`]
//!   makes it the current thread's and turns autocast on for one device type, in the same guard
//!   torch.amp's [`crate::Autocast`] enters ([`crate::AutocastScope`]); other threads are
//!   untouched (plain autocast there behaves exactly as in libtorch).
//! - [`crate::disable_casts`] / [`crate::without_casts`] turn casts off for a region.
//! - [`clear_cast_cache`] empties the weight-cast cache (the rules are in `cache.rs`).
//! - [`classify_torch_error`] recovers the engine's typed refusals from tch errors.
//!
//! Where the engine differs from Apex, and why: `docs/cast.md`.
pub(crate) mod autocast;
mod cache;
pub(crate) mod cpu;
pub(crate) mod disable;
pub(crate) mod emulation;
mod engine;
mod error;
pub(crate) mod policy;
pub(crate) mod scope;
pub(crate) mod settings;

pub(crate) use cache::cast_cache_len;
pub use cache::clear_cast_cache;
pub(crate) use cpu::warn_if_slow as warn_if_slow_cpu_kernels;
pub use cpu::{freed_cpu_memory_kept, keep_freed_cpu_memory, CpuFeatures};
pub(crate) use cpu::{CpuKernelChoice, CpuKernels, OpClass};
pub use disable::DisableCastsGuard;
pub use engine::{install_policy, PolicyHandle};
pub(crate) use engine::{kernels_registered, libtorch_autocast_ops, policy_active};
pub use error::classify_torch_error;
pub(crate) use policy::CastPolicy;
pub use policy::{Cast, CastLists, UserCasts};
pub use scope::AutocastState;
pub use settings::CastSettings;
