//! O1's cast engine: Apex's lists as dispatcher kernels, the weight-cast cache, the CPU
//! emulation, RNNs, and the engine's behaviour across threads.
#[path = "../common/mod.rs"]
mod common;

mod cache;
mod casts;
mod emulation;
mod emulation_backward;
mod policy;
mod rnn;
mod threads;
