//! torch.amp in tch-amp: GradScaler and autocast against PyTorch 2.13 bit for bit (each
//! scenario's Python script sits beside its Rust twin), the protocol's errors, and Lightning's
//! precision flags, and its checkpoints.
#[path = "../common/mod.rs"]
mod common;

mod autocast;
mod checkpoint;
mod grad_scaler;
mod lightning;
mod recipes;
mod support;
