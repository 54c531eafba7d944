//! The model under AMP: O0/O2/O3's cast of the `VarStore` in place (batch norm optionally
//! kept fp32) and the wrapper `initialize` returns, whose floating inputs go in as the model's
//! dtype and floating outputs come back as fp32 (or `cast_model_outputs`).
//!
//! [`crate::AmpModel`] is the wrapper; [`AmpInputs`] says which inputs it casts, and
//! [`CastReport`] what [`crate::Amp::cast_model`] did to each variable.
pub(crate) mod wrapper;

pub(crate) use wrapper::{
    batchnorm_modules, cast_var_store, cast_var_store_as, parent_path, set_kind, AmpModel, BatchNormCast,
};
pub use wrapper::{AmpInputs, CastReport};
