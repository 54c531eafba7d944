//! FP8 training of linear layers: torchao's float8 training (`Float8LinearConfig`,
//! `convert_to_float8_training`, its tensorwise, rowwise and rowwise_with_gw_hp recipes) with
//! the same numerics, op for op, and Transformer Engine's delayed scaling
//! (`DelayedScaling`: amax history, margin, `max` or `most_recent`) as an option.
//!
//! - [`Float8Training`]: the conversion. The model makes its linear layers through
//!   [`Float8Training::linear`] (or hands them to [`Float8Training::convert`]); the
//!   [`LayerFilter`] picks them by VarStore path; layers that cannot run in float8 are skipped
//!   and listed in the [`ConversionReport`].
//! - [`Float8Linear`]: the layer: three float8 GEMMs (output, grad_input, grad_weight) through
//!   `_scaled_mm`, weights kept in their own dtype. It composes with autocast (the output takes
//!   autocast's dtype, as in torchao) and with the opt levels' fp32 master weights.
//! - [`Float8LinearConfig`], [`DelayedScaling`]: the recipes (serde; unknown fields refused).
//!
//! Details, the differences from torchao and TE, and what a non-finite amax does:
//! `docs/float8.md`.
mod cast;
mod config;
mod delayed;
mod linear;
mod training;

pub use config::{
    AmaxComputeAlgo, CastConfig, DelayedScaling, Float8Dtype, Float8LinearConfig, Fp8Format, GemmConfig,
    ScalingGranularity, ScalingType,
};
pub use linear::{Float8Linear, Float8Scales};
pub use training::{ConversionReport, Float8Training, LayerFilter, SkipReason};
