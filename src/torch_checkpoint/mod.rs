//! Resuming PyTorch/Apex checkpoints in Rust, and writing checkpoints a Python script resumes.
//!
//! [`crate::load_torch_checkpoint`] reads what an Apex script saved — Apex's README recipe,
//! `torch.save({'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'amp':
//! amp.state_dict(), 'epoch': e}, path)`, or Apex's imagenet example (`main_amp.py`:
//! `{'epoch', 'arch', 'state_dict', 'best_prec1', 'optimizer'}`, with [`TorchLoadOptions::main_amp`])
//! — or what a torch.amp script saved (`{'model', 'optimizer', 'scaler': scaler.state_dict()}`),
//! in any container `torch.save` has written (zip or legacy; see [`crate::torch_io`]) into
//! a VarStore, [`crate::AmpOptimizer`]s and the loss scalers: an [`crate::Amp`], torch.amp's
//! [`crate::GradScaler`]s, or none ([`crate::scaling::CheckpointScalers`]). [`crate::save_torch_checkpoint`] writes the mirror:
//! the dict the Python script's resume code reads with `model.load_state_dict`,
//! `optimizer.load_state_dict` and `amp.load_state_dict`, loadable with
//! `torch.load(path, weights_only=True)`, written atomically.
//!
//! ```
//! use tch::nn::{self, VarStore};
//! use tch::Device;
//! use tch_amp::torch_checkpoint::{TorchLoadOptions, TorchSaveOptions};
//! use tch_amp::{load_torch_checkpoint, save_torch_checkpoint};
//! use tch_amp::{Amp, AmpConfig, OptLevel};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let vs = VarStore::new(Device::Cpu);
//! let net = nn::linear(vs.root() / "fc", 4, 2, Default::default());
//! let mut amp = Amp::new(&AmpConfig::new(OptLevel::O2).verbosity(0))?;
//! let _model = amp.cast_model(&vs, net)?;
//! let sgd = nn::Sgd { momentum: 0.9, ..Default::default() };
//! let mut opt = amp.optimizer(&vs, sgd, 0.1)?;
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("checkpoint.pt");
//! // Python: torch.save({'model': ..., 'optimizer': ..., 'amp': ..., 'epoch': 3}, path)
//! save_torch_checkpoint(&path, &vs, &[&opt], &amp, &TorchSaveOptions::new().entry("epoch", 3i64))?;
//! // Python: model.load_state_dict(ckpt['model']); optimizer.load_state_dict(ckpt['optimizer']); ...
//! let report = load_torch_checkpoint(&path, &vs, &mut [&mut opt], &mut amp, &TorchLoadOptions::new())?;
//! assert_eq!(report.entries.get_str("epoch").map(|v| v.type_name()), Some("int"));
//! # Ok(())
//! # }
//! ```
//!
//! What loading checks and takes, what saving writes, and how a resumed run differs from
//! Apex's own resume: `docs/torch_checkpoint.md`.

mod error;
mod model;
mod optim;
mod options;

pub(crate) mod file;

pub use file::{
    load_torch_checkpoint_value, optimizer_config, optimizer_record_from_torch, optimizer_record_to_torch,
    param_order_from_torch, torch_checkpoint_value, TorchLoadReport,
};
pub use optim::default_param_order;
pub use options::{KeyPrefix, TorchLoadOptions, TorchParamOrder, TorchSaveOptions};
