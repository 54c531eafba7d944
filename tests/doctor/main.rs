//! The precision doctor (`tch_amp::doctor`): constructed models with known answers, the
//! statistics of one layer against PyTorch's hooks, the main job's CNN, the restored state.
#[path = "../common/mod.rs"]
mod common;

mod cases;
mod main_job;
mod models;
mod reference;
mod state;
