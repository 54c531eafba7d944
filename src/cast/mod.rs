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
//!   makes it the current thread's and turns autocast on for one device type; other threads are
//!   untouched (plain autocast there behaves exactly as in libtorch).
//! - [`crate::disable_casts`] / [`crate::without_casts`] turn casts off for a region.
//! - [`clear_cast_cache`] empties the weight-cast cache (the rules are in `cache.rs`).
//! - [`AutocastGuard`] / [`autocast`] drive libtorch's own autocast for CPU and CUDA.
//! - [`classify_torch_error`] recovers the engine's typed refusals from tch errors.
//!
//! # Differences from Apex, and why
//! - Casts happen for aten operators, not Python functions; `opt_levels/o1_apex.toml` maps each
//!   Apex name to the aten ops tch reaches (`F.cross_entropy` is `cross_entropy_loss`, `@` is
//!   `matmul`, `Tensor.__rsub__` is `rsub`, ...). A dispatcher policy cannot tell `F.softmax` from
//!   `torch.softmax` (the same aten op). Composite ops that are in no list (einsum on CPU, say)
//!   decompose below the Autocast key and their parts follow the policy, as under libtorch's
//!   autocast; Apex left C++ composites alone but cast Python ones.
//! - Ops libtorch's own autocast lists cast but Apex's do not (linalg_vecdot, cdist,
//!   scaled_dot_product_attention, ...) run in their inputs' dtypes under the Apex policy, as they
//!   did under Apex.
//! - CPU tensors are cast too (Apex cast only CUDA tensors); fp64 tensors are never cast (Apex cast
//!   them to fp16 on the fp16 list); promote picks the widest floating type among all inputs, fp64
//!   included (Apex raised on anything but fp16+fp32).
//! - The in-place rule for fp32-list ops (an error on a low-precision self) covers every op of the
//!   fp32 list; Apex applied it to `torch.*`/`Tensor.*` functions only.
//! - The weight-cast cache recasts a weight changed in place, is correct after `no_grad` evaluation
//!   and supports a weight used twice in one forward.
//! - bf16 can be the low-precision type ([`CastSettings::low_precision_dtype`]).
//! - On CPU, fp16/bf16 GEMMs, convolutions and attention run libtorch's native kernels where the
//!   CPU has fast ones for the class and type and are emulated in fp32 elsewhere
//!   ([`crate::CpuKernels`], [`CpuFeatures`], docs/cpu_emulation.md).
//! - Errors raised inside the dispatcher reach the caller as tch errors; [`classify_torch_error`]
//!   turns them into [`OpRefused::BannedOp`](crate::error::OpRefused::BannedOp) and
//!   [`OpRefused::InPlaceFp32OnHalf`](crate::error::OpRefused::InPlaceFp32OnHalf).
mod autocast;
mod cache;
pub(crate) mod cpu;
pub(crate) mod disable;
pub(crate) mod emulation;
mod engine;
mod error;
pub(crate) mod policy;
pub(crate) mod settings;

pub(crate) use autocast::count_torch_autocast;
pub use autocast::{autocast, autocast_state, AutocastGuard, AutocastState};
pub(crate) use cache::cast_cache_len;
pub use cache::clear_cast_cache;
pub use cpu::{freed_cpu_memory_kept, keep_freed_cpu_memory, CpuFeatures};
pub(crate) use cpu::{resolve as resolve_cpu_kernels, warn_if_slow as warn_if_slow_cpu_kernels};
pub(crate) use cpu::{CpuKernelChoice, CpuKernels, OpClass};
pub use disable::DisableCastsGuard;
pub(crate) use engine::{
    activate_torch_autocast, kernels_registered, libtorch_autocast_ops, policy_active, SavedPolicy,
};
pub use engine::{install_policy, ActivePolicyGuard, PolicyHandle};
pub use error::classify_torch_error;
pub(crate) use policy::CastPolicy;
pub use policy::{Cast, CastLists, UserCasts};
pub use settings::CastSettings;
