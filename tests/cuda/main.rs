//! GPU-only tests: `cargo test --features cuda-tests`. They fail (never skip) when no CUDA
//! device is present, so a run that claims GPU coverage really had one.
#![cfg(feature = "cuda-tests")]
#[path = "../common/mod.rs"]
mod common;

mod amp;
mod float8;
mod o1;
mod torch_amp;
