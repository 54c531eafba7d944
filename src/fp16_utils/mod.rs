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
//!     let outcome = optimizer.step()?; // Skipped after an overflow
//!     println!("stepped {}, loss scale {}", outcome.stepped(), optimizer.loss_scale());
//! }
//! assert_eq!(vs.variables()["fc1.weight"].kind(), Kind::Half);
//! assert_eq!(optimizer.loss_scale(), 1024.0); // no overflow, fewer than 500 passes
//! let state = optimizer.state_dict()?; // Apex's keys: loss_scaler, overflow, fp32_from_fp16, ...
//! optimizer.load_state_dict(state)?;
//! # Ok(())
//! # }
//! ```
//!
//! Where this differs from Apex, and why: `docs/fp16_utils.md`.
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
