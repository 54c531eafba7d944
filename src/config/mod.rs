//! Configuration: Apex's opt levels and their property table (a const in `table.rs`), the
//! [`AmpConfig`] builder with Apex's overrides, and the resolved [`Properties`].
//!
//! Dependencies point one way: `opt_level` (a leaf) <- `loss_scale` <- `table` <- `builder`
//! <- `rules` (which checks Apex's rules and produces `properties`).
pub(crate) mod builder;
pub(crate) mod loss_scale;
pub(crate) mod opt_level;
pub(crate) mod properties;
pub(crate) mod rules;
mod table;

pub(crate) use builder::AmpConfig;
pub(crate) use loss_scale::scale_constants;
pub(crate) use loss_scale::LossScale;
pub(crate) use opt_level::OptLevel;
pub use opt_level::ParseOptLevelError;
pub(crate) use properties::Properties;
pub use table::LevelDefaults;
