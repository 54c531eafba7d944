//! Float8 training (`tch_amp::float8`): torchao's recipes and Transformer Engine's delayed
//! scaling against their Python references bit for bit, checkpoints, bad input.
#[path = "../common/mod.rs"]
mod common;

mod bad_input;
mod bitwise;
mod checkpoint;
mod models;
mod reference;
