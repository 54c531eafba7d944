//! O0-O3 end to end: configuration and Apex's rules, initialize, the loss scaler and its state
//! dict, the optimizers, clipping, memory, several models and losses, checkpoints.
#[path = "../common/mod.rs"]
mod common;

mod apex_optimizers;
mod bad_calls;
mod bert_lamb;
mod checkpointing;
mod clip;
mod crash;
mod ema;
mod foundation;
mod fp16_utils;
mod fuzz;
mod initialize;
mod memory;
mod multi_input;
mod multiple_models;
mod opt_levels;
mod optim;
mod optim_bitwise;
mod param_groups;
mod partial_load;
mod reliability;
mod scaler;
mod soak;
mod state_dict;
mod unscale;
