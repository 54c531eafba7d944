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
//! ## Where tch-amp differs from Apex, and why
//! - Resume is bit-exact: checkpoints hold the fp32 masters and the optimizer state (Apex
//!   rebuilds masters from the fp16 model, losing bits).
//! - The dynamic scale has a floor ([`DEFAULT_MIN_LOSS_SCALE`], 2^-24) when `min_loss_scale` is
//!   not given (Apex's could decay to denormals).
//! - `step()` returns [`StepOutcome`]; `clip_grad_norm` returns the norm, computed in fp32.
//! - Loading a state or checkpoint validates everything first and applies nothing on error.
//! - The optimizers are tch-amp's own implementations of PyTorch's update rules (tch's
//!   libtorch optimizers expose no state to checkpoint).
//! - Everything runs on CPU too (Apex rejects CPU tensors).
#![deny(missing_docs)]

mod amp;
mod amp_optimizer;
mod amp_state;
mod aten;
mod autocast;
mod cast_model;
mod checkpoint;
mod config;
mod dtype;
mod error;
mod ffi;
mod grads;
mod master_weights;
mod model;
mod opt_level;
mod optim;
mod properties;
mod scaler;
pub mod o1;
pub mod distributed;

pub use amp::{initialize, Amp, ScaleLossOptions, ScaleLossOutcome};
pub use amp_optimizer::{AmpOptimizer, MemoryReport, StepOutcome};
pub use amp_state::AmpState;
pub use aten::check_aten_op;
pub use autocast::{autocast, autocast_state, clear_autocast_cache, AutocastGuard, AutocastState};
pub use cast_model::CastReport;
pub use checkpoint::{load_checkpoint, save_checkpoint};
pub use config::{AmpConfig, DEFAULT_MAX_LOSS_SCALE, DEFAULT_MIN_LOSS_SCALE};
pub use error::{AmpError, Result};
pub use grads::unscale_;
pub use model::AmpModel;
pub use opt_level::{LevelDefaults, OptLevel};
pub use optim::OptimizerConfig;
pub use properties::{LossScale, Properties};
pub use scaler::{LossScaler, ScaleChange, ScaleChangeReason, ScalerState, GROWTH_INTERVAL, INITIAL_DYNAMIC_SCALE};

pub use o1::{
    aten_overloads, cast_cache_len, classify_torch_error, clear_cast_cache, disable_casts, emulated_ops,
    install_policy, libtorch_autocast_ops, policy_active, policy_installed, without_casts, ActivePolicyGuard, Cast,
    CastLists, CastPolicy, DisableCastsGuard, O1Settings, PolicyHandle, UserCasts,
};
