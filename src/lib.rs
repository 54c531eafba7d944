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
//! - [`Amp`]: the loss scalers (one per loss, [`LossScaler`]) and `scale_loss`.
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
//! Each item has one path.
//! - **Configuration** (`src/config/`): [`AmpConfig`], [`OptLevel`] (and
//!   [`ParseOptLevelError`]), [`LevelDefaults`] (a row of Apex's table, from `opt_levels/`),
//!   [`LossScale`], [`Properties`] (the resolved options), [`CastSettings`] (the cast engine's
//!   switches), [`CpuKernels`] (native or emulated fp16/bf16 GEMMs on CPU).
//! - **Set-up** (`src/amp.rs`, `src/model.rs`): [`initialize`], [`Amp`], [`AmpModel`],
//!   [`CastReport`].
//! - **Loss scaling** (`src/scaling/`): [`Amp::scale_loss`] with [`ScaleLossOptions`] and
//!   [`ScaleLossOutcome`], [`LossScaler`] (with [`ScaleChange`], [`ScaleChangeReason`]),
//!   [`OverflowReport`] and [`NonFiniteGrad`] (which parameters overflowed),
//!   [`ScalerState`] and [`AmpState`] (`amp.state_dict()`), [`unscale_`].
//! - **Optimizers** (`src/optim/`): [`AmpOptimizer`], [`OptimizerConfig`] (torch.optim's
//!   SGD/Adam/AdamW/RMSprop by tch's configs, Apex's [`FusedSgd`], [`FusedAdam`], [`FusedLamb`],
//!   [`FusedNovoGrad`] ([`NovoGradNorm`]), [`FusedAdagrad`]), [`ParamGroup`] (torch's
//!   `param_groups` with their own hyper-parameters), [`UpdateRule`] (a user's own optimizer,
//!   with [`HyperParams`], [`ParamState`], [`GroupView`], [`ParamView`], [`StateSpec`],
//!   [`StateShape`]), [`StepOutcome`], [`MemoryReport`], [`OptimizerRecord`], [`GroupRecord`] and
//!   [`ParamRecord`] (what an optimizer saves).
//! - **Checkpoints** (`src/checkpoint.rs`): [`save_checkpoint`], [`load_checkpoint`], and the
//!   partial loads [`load_model_weights`] and [`load_optimizer_state`] ([`LoadReport`]).
//! - **Legacy API** (`src/fp16_utils/`): the module [`fp16_utils`], Apex's `apex.fp16_utils`
//!   (`FP16_Optimizer`, `network_to_half`, `prep_param_lists`, ...) for pre-amp scripts.
//! - **Casts** (`src/cast/`): [`CastPolicy`] (Apex's O1 lists as data, user casts),
//!   [`disable_casts`] / [`without_casts`] ([`DisableCastsGuard`]); the engine itself for custom
//!   set-ups in the module [`cast`].
//! - **PyTorch files** (`src/torch_io/`): the module [`torch_io`] reads every container
//!   `torch.save` has written (zip, legacy pickle stream, tar) into a [`torch_io::Value`] tree
//!   with tch tensors, and writes the zip format `torch.load` reads (`weights_only=True` too).
//! - **PyTorch/Apex checkpoints** (`src/torch_checkpoint/`): [`load_torch_checkpoint`] resumes
//!   from what an Apex script saved with `torch.save` (model, torch.optim and amp state dicts),
//!   [`save_torch_checkpoint`] writes what its resume code reads; options
//!   [`TorchLoadOptions`] / [`TorchSaveOptions`], the mapping of torch.optim's state dict to
//!   [`OptimizerRecord`] in the module [`torch_checkpoint`].
//! - **Errors** (`src/error.rs`): [`AmpError`], [`Result`].
//!
//! The C++ shim is in `src/shim/`; every unsafe call into it is in `src/sys/`.
//!
//! ## Where tch-amp differs from Apex, and why
//! - Resume is bit-exact: checkpoints hold the fp32 masters and the optimizer state (Apex
//!   rebuilds masters from the fp16 model, losing bits).
//! - The dynamic scale has a floor ([`LossScaler::DEFAULT_MIN_LOSS_SCALE`], 2^-24) when
//!   `min_loss_scale` is not given (Apex's could decay to denormals).
//! - `step()` returns [`StepOutcome`]; `clip_grad_norm` returns the norm, computed in fp32.
//! - Loading a state or checkpoint validates everything first and applies nothing on error.
//! - The update rules run in tch-amp on tch tensors, as PyTorch computes them (tch's libtorch
//!   optimizers expose no state to checkpoint); Adam and AdamW use libtorch's fused kernel.
//! - Everything runs on CPU too (Apex rejects CPU tensors).
#![deny(missing_docs)]

mod amp;
pub mod cast;
mod checkpoint;
mod config;
#[doc(hidden)]
pub mod diagnostics;
pub mod distributed;
mod dtype;
mod error;
pub mod fp16_utils;
mod model;
mod optim;
mod scaling;
mod sys;
pub mod torch_checkpoint;
pub mod torch_io;

pub use amp::{initialize, Amp, ScaleLossOptions, ScaleLossOutcome};
pub use cast::disable::{disable_casts, without_casts};
pub use cast::policy::CastPolicy;
pub use cast::settings::CastSettings;
pub use cast::CpuKernels;
pub use cast::DisableCastsGuard;
pub use checkpoint::{load_checkpoint, load_model_weights, load_optimizer_state, save_checkpoint, LoadReport};
pub use config::{AmpConfig, LevelDefaults, LossScale, OptLevel, ParseOptLevelError, Properties};
pub use error::{AmpError, Result};
pub use model::{AmpInputs, AmpModel, CastReport};
pub use optim::{
    non_finite_check_, unscale_, Algorithm, AmpOptimizer, FusedAdagrad, FusedAdam, FusedLamb, FusedNovoGrad, FusedSgd,
    GroupRecord, GroupView, HyperParams, MemoryReport, NovoGradNorm, OptimizerConfig, OptimizerRecord, ParamGroup,
    ParamRecord, ParamState, ParamView, StateShape, StateSpec, StepOutcome, UpdateRule,
};
pub use scaling::{AmpState, LossScaler, NonFiniteGrad, OverflowReport, ScaleChange, ScaleChangeReason, ScalerState};
pub use torch_checkpoint::{
    load_torch_checkpoint, save_torch_checkpoint, TorchLoadOptions, TorchLoadReport, TorchSaveOptions,
};

/// The README's Rust blocks, compiled and run as doc tests so the quick start stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
