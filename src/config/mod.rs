//! Configuration: Apex's opt levels and their property table (data in `opt_levels/`), the
//! [`AmpConfig`] builder with Apex's overrides, and the resolved [`Properties`].
//!
//! Dependencies point one way: `opt_level` (a leaf) <- `loss_scale` <- `table` <- `builder`
//! <- `rules` (which checks Apex's rules and produces `properties`).
mod builder;
mod loss_scale;
mod opt_level;
mod properties;
mod rules;
mod table;

pub use builder::AmpConfig;
pub use loss_scale::LossScale;
pub use opt_level::{OptLevel, ParseOptLevelError};
pub use properties::Properties;
pub use table::LevelDefaults;
