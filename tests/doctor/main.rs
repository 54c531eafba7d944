//! The precision doctor (`tch_amp::doctor`): constructed models with known answers, the
//! statistics of one layer against PyTorch's hooks, the main job's CNN, the restored state, the
//! training hook.
#[path = "../common/mod.rs"]
mod common;

mod models;
mod cases;
