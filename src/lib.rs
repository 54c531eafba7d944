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
