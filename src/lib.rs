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
//! ## The public API, by concept
//! The crate root holds what a ported script types; everything else lives in the module of its
//! concept. Each item has one path.
//! - **Root**: [`initialize`], [`Amp`], [`AmpConfig`], [`OptLevel`], [`LossScale`],
//!   [`Properties`], [`AmpModel`], [`AmpOptimizer`], [`StepOutcome`], [`OptimizerConfig`]
//!   (torch.optim's SGD/Adam/AdamW/RMSprop by tch's configs), Apex's [`FusedSgd`],
//!   [`FusedAdam`], [`FusedLamb`], [`FusedNovoGrad`], [`FusedAdagrad`], [`ParamGroup`] (torch's
//!   `param_groups`), [`UpdateRule`] (a user's own optimizer), [`ScaleLossOptions`],
//!   [`save_checkpoint`] / [`load_checkpoint`], [`load_torch_checkpoint`] /
//!   [`save_torch_checkpoint`], [`CastPolicy`], [`disable_casts`] / [`without_casts`],
//!   [`CpuKernels`] / [`CpuKernelChoice`] / [`OpClass`], [`AmpError`], [`Result`]; PyTorch's
//!   own mixed precision: [`GradScaler`], [`autocast`] / [`AutocastScope`].
//! - [`config`] (`src/config/`): [`config::LevelDefaults`] (a row of Apex's table),
//!   [`config::ParseOptLevelError`].
//! - [`model`] (`src/model/`): [`model::AmpInputs`] (what the wrapper casts),
//!   [`model::CastReport`].
//! - [`scaling`] (`src/scaling/`): [`scaling::LossScaler`] and its history
//!   ([`scaling::ScaleChange`]), [`scaling::ScaleLossOutcome`], [`scaling::OverflowReport`]
//!   (which parameters overflowed), [`scaling::AmpState`] (`amp.state_dict()`).
//! - [`optim`] (`src/optim/`): what an [`UpdateRule`] works on ([`optim::HyperParams`],
//!   [`optim::GroupView`], [`optim::ParamView`], [`optim::StateSpec`]), what an optimizer
//!   saves ([`optim::OptimizerRecord`]), [`optim::MemoryReport`], [`optim::unscale_`].
//! - [`checkpoint`] (`src/checkpoint/`): the partial loads [`checkpoint::load_model_weights`]
//!   and [`checkpoint::load_optimizer_state`].
//! - [`cast`] (`src/cast/`): the cast engine for custom set-ups, [`cast::CastSettings`],
//!   [`cast::CpuFeatures`], libtorch's own autocast ([`cast::AutocastGuard`]).
//! - [`fp16_utils`] (`src/fp16_utils/`): Apex's `apex.fp16_utils` (`FP16_Optimizer`,
//!   `network_to_half`, `prep_param_lists`, ...) for pre-amp scripts.
//! - [`torch_io`] (`src/torch_io/`): reads what `torch.save` writes into a
//!   [`torch_io::Value`] tree with tch tensors, and writes the zip format `torch.load` reads
//!   (`weights_only=True` too).
//! - [`torch_checkpoint`] (`src/torch_checkpoint/`): the options and mappings of PyTorch/Apex
//!   checkpoints ([`torch_checkpoint::TorchLoadOptions`], torch.optim's state dict as an
//!   [`optim::OptimizerRecord`]), and their errors.
//! - [`distributed`] (`src/distributed/`): DDP, SyncBatchNorm and samplers on libtorch's c10d.
//! - [`ema`] (`src/ema.rs`): [`ema::ModelEma`], timm's `ModelEmaV2` over the fp32 masters.
//! - [`torch_amp`] (`src/torch_amp/`): torch.amp rather than Apex: autocast's options
//!   ([`torch_amp::Autocast`]), the scaler's ([`torch_amp::GradScalerOptions`],
//!   [`torch_amp::ScalerStep`], [`torch_amp::ScalerOptimizer`] for any optimizer),
//!   [`torch_amp::clip_grad_norm_`], Lightning's precision flags ([`torch_amp::Precision`]).
//! - [`error`] (`src/error/`): the groups of [`AmpError`], one per thing a caller can do
//!   ([`error::ConfigError`], [`error::UsageError`], [`error::OpRefused`],
//!   [`error::Divergence`], [`error::StateError`]).
//! - Errors: [`AmpError`] at the bottom; [`torch_io`], [`torch_checkpoint`] and
//!   [`distributed`] and [`torch_amp`] have their own error types, which wrap [`AmpError`] where
//!   they need to.
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
mod dtype;
pub mod ema;
pub mod error;
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
pub use cast::cpu::{CpuKernelChoice, CpuKernels, OpClass};
pub use cast::disable::{disable_casts, without_casts};
pub use cast::policy::CastPolicy;
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
pub use torch_amp::autocast::{autocast, AutocastScope};
pub use torch_amp::grad_scaler::GradScaler;
pub use torch_checkpoint::file::{load_torch_checkpoint, save_torch_checkpoint};

/// The README's Rust blocks, compiled and run as doc tests so the quick start stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
