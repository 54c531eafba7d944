//! Apex's legacy API, `apex.fp16_utils`, as a thin layer over tch-amp's core, so that scripts
//! written before `amp` port line by line: [`Fp16Optimizer`] (`FP16_Optimizer`), the model
//! conversions [`network_to_half`], [`bn_convert_float`], [`convert_network`], [`fp16_model`]
//! (`FP16Model`), and the manual master-weight recipe [`prep_param_lists`],
//! [`model_grads_to_master_grads`], [`master_params_to_model_params`], [`to_python_float`],
//! [`clip_grad_norm`], and the stand-alone scalers [`StaticLossScaler`] (`LossScaler`) and
//! [`DynamicLossScaler`].
//!
//! ```
//! use tch::nn::{self, Module};
//! use tch::{Device, Kind, Tensor};
//! use tch_amp::fp16_utils::{network_to_half, DynamicLossArgs, Fp16Optimizer, Fp16OptimizerOptions};
//! # fn main() -> Result<(), tch_amp::AmpError> {
//! tch::manual_seed(0);
//! let vs = nn::VarStore::new(Device::Cpu);
//! let net = nn::seq()
//!     .add(nn::linear(vs.root() / "fc1", 16, 32, Default::default()))
//!     .add_fn(|x| x.relu())
//!     .add(nn::linear(vs.root() / "fc2", 32, 4, Default::default()));
//! // Apex: model = network_to_half(model)
//! let model = network_to_half(&vs, net)?;
//! // Apex: optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.01),
//! //     dynamic_loss_scale=True, dynamic_loss_args={'init_scale': 1024, 'scale_window': 500})
//! let mut optimizer = Fp16Optimizer::new(
//!     &vs,
//!     nn::Sgd { momentum: 0.9, ..Default::default() },
//!     0.01,
//!     Fp16OptimizerOptions::default()
//!         .dynamic_loss_scale(true)
//!         .dynamic_loss_args(DynamicLossArgs::default().init_scale(1024.0).scale_window(500))
//!         .verbose(false),
//! )?;
//! for _ in 0..3 {
//!     let x = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
//!     let y = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
//!     optimizer.zero_grad()?;
//!     let loss = model.forward(&x).to_kind(Kind::Float).mse_loss(&y, tch::Reduction::Mean);
//!     optimizer.backward(&loss)?; // was: loss.backward()
//!     let _norm = optimizer.clip_master_grads(1.0)?; // -1.0 after an overflow
//!     let stepped = optimizer.step()?; // false: skipped after an overflow
//!     println!("stepped {stepped}, loss scale {}", optimizer.loss_scale());
//! }
//! assert_eq!(vs.variables()["fc1.weight"].kind(), Kind::Half);
//! assert_eq!(optimizer.loss_scale(), 1024.0); // no overflow, fewer than 500 passes
//! let state = optimizer.state_dict()?; // Apex's keys: loss_scaler, overflow, fp32_from_fp16, ...
//! optimizer.load_state_dict(state)?;
//! # Ok(())
//! # }
//! ```
//!
//! Where this differs from Apex, and why:
//! - `FP16_Optimizer` wrapped a ready torch optimizer; here it is built from the optimizer's
//!   configuration, over every trainable variable of a `VarStore` (tch parameter groups are torch's
//!   `param_groups`, ascending).
//! - The dynamic scale is amp's `LossScaler`, as `FP16_Optimizer` used at e13873de (2^16, window
//!   2000, cap 2^24), not the legacy `DynamicLossScaler` class; `scale_factor` must be 2 (Apex
//!   ignored it); an unset `min_loss_scale` means tch-amp's floor of 2^-24 (Apex had none).
//! - `step()` returns whether it stepped and refuses to run without a fresh backward
//!   ([`UsageError::NoGradients`](crate::error::UsageError::NoGradients)) or after
//!   `backward_with(loss, false)` without `update_master_grads()`
//!   ([`UsageError::CallOrder`](crate::error::UsageError::CallOrder)); it releases the master
//!   gradients after the update (Apex kept them until `zero_grad`). The values stepped are the
//!   same: every fp16 gradient that exists (a zeroed one too) is copied to its master at each
//!   `update_master_grads`, and one never made leaves its master unstepped in both.
//! - `step(closure)` and `backward(retain_graph=True)` are not offered.
//! - The overflow check reads each gradient for inf/NaN (Apex's fused kernel; its Python fallback
//!   summed each gradient, which also flags a finite fp32 gradient whose sum overflows).
//! - `state_dict()` holds copies of the masters; `load_state_dict` validates everything first and
//!   changes nothing on error.
mod convert;
mod loss_scaler;
mod optimizer;
mod params;

pub use convert::{bn_convert_float, convert_network, fp16_model, network_to_half};
pub use loss_scaler::{DynamicLossScaler, StaticLossScaler};
pub use optimizer::{DynamicLossArgs, Fp16Optimizer, Fp16OptimizerOptions, Fp16OptimizerState, LegacyScalerState};
pub use params::{
    clip_grad_norm, master_params_to_model_params, model_grads_to_master_grads, model_params, prep_param_lists,
    to_python_float,
};
