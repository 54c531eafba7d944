//! # tch-amp
//!
//! NVIDIA Apex's automatic mixed precision (`apex.amp`) for [tch](https://docs.rs/tch), the
//! Rust bindings to libtorch 2.13, on CPU and CUDA. A script ported from Apex keeps its shape:
//! pick an opt level, [`initialize`], wrap backward in [`Amp::scale_loss`], clip on the fp32
//! master parameters, [`AmpOptimizer::step`], save and resume with [`save_checkpoint`] /
//! [`load_checkpoint`].
//!
//! The types met first:
//! - [`AmpConfig`]: an [`OptLevel`] (O0 fp32, O1 per-op casts, O2 fp16 model with fp32 masters,
//!   O3 pure fp16) plus Apex's overrides; [`AmpConfig::build`] checks Apex's rules and gives
//!   [`Properties`].
//! - [`Amp`]: the loss scalers (one per loss, [`scaling::LossScaler`]) and `scale_loss`.
//! - [`AmpModel`]: the model wrapper (inputs to fp16, outputs to fp32 under O2/O3).
//! - [`AmpOptimizer`]: SGD/Adam/AdamW/RMSprop (tch's configs) stepping the fp32 masters;
//!   `step()` says whether it stepped or skipped after an overflow.
//!
//! ```
//! use tch::nn::{self, ModuleT};
//! use tch::{Device, Kind, Tensor};
//! use tch_amp::{AmpConfig, OptLevel, StepOutcome};
//! # fn main() -> Result<(), tch_amp::AmpError> {
//! let vs = nn::VarStore::new(Device::Cpu);
//! let net = nn::seq_t()
//!     .add(nn::linear(vs.root() / "fc1", 16, 32, Default::default()))
//!     .add_fn(|x| x.relu())
//!     .add(nn::linear(vs.root() / "fc2", 32, 4, Default::default()));
//! // Apex: model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
//! let (model, mut opt, mut amp) =
//!     tch_amp::initialize(&vs, net, nn::Adam::default(), 1e-3, &AmpConfig::new(OptLevel::O2))?;
//! for _ in 0..3 {
//!     let x = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
//!     let y = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
//!     let loss = model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
//!     opt.zero_grad()?;
//!     // Apex: with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()
//!     amp.scale_loss(&loss, &mut [&mut opt], |scaled| scaled.backward())?;
//!     // Apex: clip_grad_norm_(amp.master_params(optimizer), 1.0)
//!     let _norm = opt.clip_grad_norm(1.0, 2.0)?;
//!     match opt.step()? {
//!         StepOutcome::Stepped => {}
//!         StepOutcome::Skipped { loss_scale, .. } => println!("overflow, scale now {loss_scale}"),
//!     }
//! }
//! assert_eq!(vs.variables()["fc1.weight"].kind(), Kind::Half);
//! let path = std::env::temp_dir().join(format!("tch-amp-doc-{}.safetensors", std::process::id()));
//! tch_amp::save_checkpoint(&path, &vs, &[&opt], &amp)?;
//! tch_amp::load_checkpoint(&path, &vs, &mut [&mut opt], &mut amp)?;
//! # std::fs::remove_file(&path).ok();
//! # Ok(())
//! # }
//! ```
//!
//! ## The public API
//! ### What a ported script calls (the crate root)
//! - Apex's `amp`: [`initialize`], [`AmpConfig`] / [`OptLevel`] / [`LossScale`] (and the
//!   resolved [`Properties`]), [`Amp`] (`scale_loss`, with [`ScaleLossOptions`]), [`AmpModel`],
//!   [`AmpOptimizer`] (`step` returns [`StepOutcome`]; `clip_grad_norm` on the masters),
//!   [`disable_casts`] / [`without_casts`], [`CastPolicy`], [`CpuKernels`] (per operation
//!   class: [`CpuKernelChoice`], [`OpClass`]).
//! - torch.amp: [`Autocast`] / [`autocast`] / [`AutocastScope`] (the one autocast guard, also
//!   under Apex's O1 policy), [`fp32_region`] (`custom_fwd(cast_inputs=torch.float32)`),
//!   [`GradScaler`]; a plain torch.optim optimizer is [`AmpOptimizer::new`].
//! - Optimizers: [`OptimizerConfig`] (torch.optim's SGD/Adam/AdamW/RMSprop by tch's configs),
//!   Apex's [`FusedSgd`], [`FusedAdam`], [`FusedLamb`], [`FusedNovoGrad`], [`FusedAdagrad`],
//!   [`ParamGroup`] (torch's `param_groups`), [`UpdateRule`] (a rule of your own).
//! - Checkpoints: [`save_checkpoint`] / [`load_checkpoint`] (tch-amp's, bit-exact resume),
//!   [`save_torch_checkpoint`] / [`load_torch_checkpoint`] (`torch.save` files both ways).
//! - Errors: [`AmpError`] (grouped by what the caller can do, [`error`]) and [`Result`].
//!
//! ### Advanced: one module per concept
//! [`config`] (Apex's table), [`model`] (what the wrapper casts), [`scaling`] (the loss scaler
//! and its history, overflow reports), [`optim`] (the plain [`optim::Optimizer`] trait that
//! [`GradScaler`] and [`ema::ModelEma`] work with; what an [`UpdateRule`] sees; records;
//! [`optim::backward`] with `retain_graph`), [`checkpoint`] (partial loads), [`cast`] (the cast
//! engine for custom set-ups), [`fp16_utils`] (Apex's `apex.fp16_utils` for pre-amp scripts),
//! [`torch_io`] (`torch.save`/`torch.load` files, its own [`torch_io::TorchIoError`]),
//! [`torch_checkpoint`] (the options of torch checkpoints), [`distributed`] (DDP, SyncBatchNorm,
//! samplers on libtorch's c10d, with its own [`distributed::DistError`]), [`ema`] (timm's
//! `ModelEmaV2`), [`doctor`] (the precision doctor: which layer overflows, underflows or loses
//! precision, from one batch, and what to do), [`float8`] (torchao's float8 training and
//! Transformer Engine's delayed scaling), [`torch_amp`] (GradScaler's options, torch's
//! `clip_grad_norm_`, Lightning's precision flags). Each item has one path; the public API is
//! listed in `.ci/public-api.txt`, which `make lint` checks.
//!
//! The C++ shim is in `src/shim/`; every unsafe call into it is in `src/sys/`.
//!
//! ## Where tch-amp differs from Apex, and why
//! - Resume is bit-exact: checkpoints hold the fp32 masters and the optimizer state (Apex
//!   rebuilds masters from the fp16 model, losing bits).
//! - The dynamic scale has a floor ([`scaling::LossScaler::DEFAULT_MIN_LOSS_SCALE`], 2^-24) when
//!   `min_loss_scale` is not given (Apex's could decay to denormals).
//! - `step()` returns [`StepOutcome`]; `clip_grad_norm` returns the norm, computed in fp32.
//! - Loading a state or checkpoint validates everything first and applies nothing on error.
//! - The update rules run in tch-amp on tch tensors, as PyTorch computes them (tch's libtorch
//!   optimizers expose no state to checkpoint); Adam and AdamW use libtorch's fused kernel.
//! - Everything runs on CPU too (Apex rejects CPU tensors).
#![deny(missing_docs)]
#![deny(unsafe_code)]

mod amp;
mod atomic_file;
pub mod cast;
pub mod checkpoint;
pub mod config;
mod counters;
#[doc(hidden)]
pub mod diagnostics;
pub mod distributed;
pub mod doctor;
mod dtype;
pub mod ema;
pub mod error;
pub mod float8;
pub mod fp16_utils;
pub mod model;
pub mod optim;
pub mod scaling;
#[allow(unsafe_code)]
mod sys;
pub mod torch_amp;
pub mod torch_checkpoint;
pub mod torch_io;

pub use amp::{initialize, Amp};
pub use cast::autocast::{autocast, fp32_region, Autocast};
pub use cast::cpu::{CpuKernelChoice, CpuKernels, OpClass};
pub use cast::disable::{disable_casts, without_casts};
pub use cast::policy::CastPolicy;
pub use cast::scope::AutocastScope;
pub use checkpoint::file::{load_checkpoint, save_checkpoint};
pub use config::builder::AmpConfig;
pub use config::loss_scale::LossScale;
pub use config::opt_level::OptLevel;
pub use config::properties::Properties;
pub use error::amp_error::{AmpError, Result};
pub use model::wrapper::AmpModel;
pub use optim::amp_optimizer::{AmpOptimizer, StepOutcome};
pub use optim::apex::{FusedAdagrad, FusedAdam, FusedLamb, FusedNovoGrad, FusedSgd};
pub use optim::groups::ParamGroup;
pub use optim::rule::UpdateRule;
pub use optim::rules::OptimizerConfig;
pub use scaling::scale_loss::ScaleLossOptions;
pub use torch_amp::grad_scaler::GradScaler;
pub use torch_checkpoint::file::{load_torch_checkpoint, save_torch_checkpoint};

/// The README's Rust blocks, compiled and run as doc tests so the quick start stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
