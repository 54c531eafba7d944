//! Distributed training on two processes over 127.0.0.1 (Gloo): the process group and its
//! collectives, data parallel under AMP, SyncBatchNorm, a mixed Rust/Python group, the imagenet
//! example under torchrun's environment, and (with `cuda-tests`) NCCL.
#[allow(dead_code)]
mod support;

#[cfg(feature = "cuda-tests")]
mod cuda;
mod ddp;
mod example;
mod group;
mod python;
mod syncbn;
