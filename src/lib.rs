//! # tch-amp
//!
//! NVIDIA Apex's automatic mixed precision for [tch](https://docs.rs/tch) (libtorch 2.13).
#![deny(missing_docs)]

mod amp;
mod amp_optimizer;
mod amp_state;
mod aten;
mod autocast;
mod cast_model;
mod checkpoint;
mod config;
mod dtype;
mod error;
mod ffi;
mod grads;
mod master_weights;
mod model;
mod opt_level;
mod optim;
mod properties;
mod scaler;
// O1 cast policy
pub mod o1;

pub use amp::{initialize, Amp, ScaleLossOptions, ScaleLossOutcome};
pub use amp_optimizer::{AmpOptimizer, StepOutcome};
pub use amp_state::AmpState;
pub use aten::check_aten_op;
pub use autocast::{autocast, autocast_state, clear_autocast_cache, AutocastGuard, AutocastState};
pub use cast_model::CastReport;
pub use checkpoint::{load_checkpoint, save_checkpoint};
pub use config::{AmpConfig, DEFAULT_MAX_LOSS_SCALE, DEFAULT_MIN_LOSS_SCALE};
pub use error::{AmpError, Result};
pub use model::AmpModel;
pub use opt_level::{LevelDefaults, OptLevel};
pub use optim::OptimizerConfig;
pub use properties::{LossScale, Properties};
pub use scaler::{LossScaler, ScaleChange, ScaleChangeReason, ScalerState, GROWTH_INTERVAL, INITIAL_DYNAMIC_SCALE};
