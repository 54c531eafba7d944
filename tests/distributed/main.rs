//! Distributed training on two and four processes over 127.0.0.1 (Gloo): the process group and
//! its collectives, data parallel under AMP, the sharded optimizer, SyncBatchNorm, mixed
//! Rust/Python groups, the imagenet example under torchrun's environment, and (with
//! `cuda-tests`) NCCL.
#[allow(dead_code)]
mod support;

#[cfg(feature = "cuda-tests")]
mod cuda;
mod ddp;
mod example;
mod group;
mod python;
mod syncbn;
mod zero;
