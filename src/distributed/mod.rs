//! Distributed data parallel training on libtorch's c10d (Apex's `apex.parallel`): a process
//! group launched by torchrun, gradient averaging that overlaps with backward, SyncBatchNorm,
//! per-rank data shards, rank-0 checkpoints.
//!
//! - [`ProcessGroup`]: `torch.distributed.init_process_group` from torchrun's environment
//!   ([`ProcessGroup::init_from_env`]) or explicit [`InitOptions`]; TCPStore rendezvous, Gloo
//!   on CPU (NCCL on CUDA in builds with the `nccl` feature); `barrier`, `broadcast_`,
//!   `all_reduce_` (sum, avg, max, min, product), `all_gather`. Every operation is bounded by
//!   the group's timeout: a peer that never shows up or dies gives a [`DistError`], not a hang.
//! - [`DistributedDataParallel`]: Apex's / torch's DDP over a tch `VarStore` on
//!   `c10d::Reducer`, with Apex's options ([`DdpOptions`]) and `no_sync`.
//! - [`SyncBatchNorm`] ([`sync_batch_norm`]): Apex's `convert_syncbn_model`, one layer at a time.
//! - [`DistributedSampler`]: torch's per-rank index rule, the same indices as torch.
//! - [`save_checkpoint_on_rank0`] / [`load_checkpoint_on_all`].
//! - The sharded optimizer (ZeRO stage 1, torch's `ZeroRedundancyOptimizer`, Apex's
//!   `DistributedFusedAdam`/`LAMB`): [`crate::AmpOptimizer::sharded`],
//!   [`crate::Amp::sharded_optimizer`]; docs/distributed.md.
//!
//! A training script under `torchrun --no-python --nproc-per-node 2 target/release/my_trainer`:
//!
//! ```no_run
//! use tch::nn::{self, ModuleT};
//! use tch_amp::distributed::{DdpOptions, DistributedDataParallel, DistributedSampler, ProcessGroup};
//! use tch_amp::{AmpConfig, OptLevel};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pg = ProcessGroup::init_from_env()?; // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let net = nn::seq_t().add(nn::linear(vs.root() / "fc", 16, 4, Default::default()));
//! let (model, mut opt, mut amp) =
//!     tch_amp::initialize(&vs, net, nn::Sgd::default(), 0.1, &AmpConfig::new(OptLevel::O2))?;
//! // Apex: model = DDP(model), after amp.initialize
//! let model = DistributedDataParallel::new(&pg, &vs, model, &mut [&mut opt], DdpOptions::default())?;
//! let data = tch::Tensor::randn([1000, 16], (tch::Kind::Float, tch::Device::Cpu));
//! let target = tch::Tensor::randn([1000, 4], (tch::Kind::Float, tch::Device::Cpu));
//! let mut sampler = DistributedSampler::for_group(1000, &pg)?;
//! for epoch in 0..2 {
//!     sampler.set_epoch(epoch);
//!     for batch in sampler.indices()?.chunks(32) {
//!         let idx = tch::Tensor::from_slice(batch);
//!         let loss = model.forward_t(&data.index_select(0, &idx), true).mse_loss(&target.index_select(0, &idx), tch::Reduction::Mean);
//!         opt.zero_grad()?;
//!         amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward())?; // gradients averaged here
//!         opt.step()?; // every rank steps or skips together
//!     }
//! }
//! tch_amp::distributed::save_checkpoint_on_rank0(&pg, "ckpt.safetensors", &vs, &[&opt], &amp)?;
//! # Ok(())
//! # }
//! ```
//!
//! Where this differs from Apex and torch, and why: `docs/distributed.md`.
mod checkpoint;
mod ddp;
mod error;
mod process_group;
mod sampler;
mod sync_bn;
mod zero;
use crate::sys::distributed as sys;

pub use checkpoint::{load_checkpoint_on_all, save_checkpoint_on_rank0};
pub use ddp::{DdpOptions, DistributedDataParallel, NoSyncGuard, BROADCAST_BUCKET_BYTES, DEFAULT_MESSAGE_SIZE};
pub use error::{DistError, Result};
pub use process_group::{Backend, InitOptions, ProcessGroup, ReduceOp, DEFAULT_TIMEOUT};
pub use sampler::DistributedSampler;
pub use sync_bn::{sync_batch_norm, SyncBatchNorm};
