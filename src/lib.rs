//! # tch-amp
//!
//! NVIDIA Apex's automatic mixed precision for [tch](https://docs.rs/tch) (libtorch 2.13).
#![deny(missing_docs)]

mod aten;
mod autocast;
mod dtype;
mod error;
mod ffi;
mod opt_level;

pub use aten::check_aten_op;
pub use autocast::{autocast, autocast_state, clear_autocast_cache, AutocastGuard, AutocastState};
pub use error::{AmpError, Result};
pub use opt_level::OptLevel;

// O1 cast policy
pub mod o1;
pub use o1::{
    aten_overloads, cast_cache_len, classify_torch_error, clear_cast_cache, disable_casts, emulated_ops,
    install_policy, libtorch_autocast_ops, policy_active, policy_installed, without_casts, ActivePolicyGuard, Cast,
    CastLists, CastPolicy, DisableCastsGuard, O1Settings, PolicyHandle, UserCasts,
};
