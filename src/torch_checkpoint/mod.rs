//! Resuming PyTorch/Apex checkpoints in Rust, and writing checkpoints a Python script resumes.
//!
//! [`crate::load_torch_checkpoint`] reads what an Apex script saved — Apex's README recipe,
//! `torch.save({'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'amp':
//! amp.state_dict(), 'epoch': e}, path)`, or Apex's imagenet example (`main_amp.py`:
//! `{'epoch', 'arch', 'state_dict', 'best_prec1', 'optimizer'}`, with [`TorchLoadOptions::main_amp`])
//! — or what a torch.amp script saved (`{'model', 'optimizer', 'scaler': scaler.state_dict()}`),
//! in any container `torch.save` has written (zip, legacy, tar; see [`crate::torch_io`]) into
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
//! ## What loading does
//! Everything is read and checked first, then applied; on any error nothing has changed.
//! - **Model**: each entry of the model state dict goes to the VarStore variable of the same
//!   name (dotted paths, as tch's layers and torch's modules both name them). Prefixes
//!   `module.` (`nn.DataParallel` / `DistributedDataParallel` state dicts) and `_orig_mod.` (a
//!   `torch.compile`d model's) on every key are stripped, stacked or alone ([`KeyPrefix`]).
//!   Shapes must match. Strict by default, like `load_state_dict(strict=True)`: missing and
//!   unexpected keys are
//!   [`TorchCheckpointError::KeysMismatch`] listing both; with `strict(false)` the names both
//!   have are loaded and the others reported. dtypes convert as torch's `copy_` does (fp32 state
//!   dict into O2's fp16 model: rounded once), and the report lists every conversion;
//!   [`TorchLoadOptions::exact_dtypes`] refuses them. An integer tensor never loads into a
//!   floating variable, nor the other way. Non-finite weights are refused.
//! - **`num_batches_tracked`**: tch's batch norm has no such counter, so these entries are
//!   skipped (listed in [`TorchLoadReport::ignored`], never "unexpected"). torch reads the counter
//!   only for `momentum=None` (a cumulative average), which tch's batch norm does not offer; with
//!   a momentum (torch's default, 0.1) the running statistics evolve the same without it. A
//!   VarStore variable of that name, if the user made one, loads like any other.
//! - **Tied parameters** (one tensor saved under two names, as torch's `state_dict()` lists
//!   nanoGPT's `lm_head.weight` and `transformer.wte.weight`): the second name is skipped and
//!   reported unless the VarStore has a variable of that name.
//! - **Optimizer**: torch.optim's state dict (or an `apex.optimizers` one: FusedSGD,
//!   FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad) is keyed by parameter index, in
//!   `param_groups` order. The mapping ([`TorchParamOrder`], per torch group the VarStore names in
//!   index order) is taken, in this order of preference, from [`TorchLoadOptions::param_order`];
//!   from the groups' `param_names` (torch >= 2.6 writes them for optimizers made from
//!   `named_parameters()`, tch-amp always does); or from the model state dict's order, which is
//!   `model.parameters()`'s order (both are the module registration order): file group `i` is
//!   the optimizer's parameter group `i` (torch's own `load_state_dict` assumes the same), its
//!   parameters in that order, when the sizes agree; else the model order cut into the file's
//!   group sizes, each within one tch parameter group (`Path::set_group`). Anything else is
//!   [`TorchCheckpointError::ParamOrder`]. Every state tensor's shape is checked against its
//!   parameter, so a wrong mapping of differently shaped parameters cannot load.
//! - **Hyper-parameters**: each file group's `lr` and hyper-parameters (momentum, dampening,
//!   nesterov, betas, eps, weight_decay, amsgrad, alpha, centered, maximize; Apex's
//!   bias_correction, grad_averaging, norm_type, init_zero; the class's defaults where an old
//!   file lacks one) become those of the optimizer's parameter groups its parameters are in, as
//!   torch's `optimizer.load_state_dict` does; two file groups giving one parameter group
//!   different values are [`TorchCheckpointError::HyperParameter`].
//!   [`TorchLoadOptions::strict_hyper_parameters`] refuses values (but `lr`) other than the
//!   group's own instead. Options Apex reads from the optimizer rather than its groups
//!   (`adam_w_mode`, `use_nvlamb`, `wd_after_momentum`, ...; FusedLAMB's `max_grad_norm`, which
//!   its groups repeat) keep the optimizer's values. `foreach`, `fused`, `capturable` and
//!   `differentiable` choose torch's implementation and are not compared; other keys
//!   (`initial_lr` from an LR scheduler) are listed in [`TorchLoadReport::ignored_group_keys`].
//! - **State**: `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, `momentum_buffer`, `square_avg`,
//!   `grad_avg`, `sum` go into the optimizer's state in the dtype it keeps them (fp32 for O2's
//!   masters), `step` (tensor, float or int) into each parameter's step count; Apex's group
//!   `step` into the group's. torch's SGD keeps no step count: an SGD optimizer's step counts
//!   restart at 0 (they are not used by its update).
//! - **Masters (O2)**: the fp32 masters are the model state dict's values — what Apex does
//!   too. A state dict Apex wrote under O2 holds the fp16 model cast to fp32 (its state-dict
//!   hook does not read the masters), so the masters' low bits were already lost when the
//!   Python run saved; tch-amp's own checkpoints ([`crate::save_checkpoint`]) and
//!   [`crate::save_torch_checkpoint`]'s files hold the masters and resume bit-exactly, and so
//!   does an Apex-era file with `'master params'` ([`TorchLoadOptions::master_params`]).
//! - **Scalers**: Apex's `{'loss_scaler0': {'loss_scale', 'unskipped'}, ...}` (or a
//!   `GradScaler.state_dict()`) into an `Amp`'s scalers, checked as
//!   [`crate::Amp::load_state_dict`] checks it; `scaler.state_dict()` into a GradScaler. An
//!   entry the options name that the file lacks is [`TorchCheckpointError::MissingEntry`],
//!   which names the option that leaves it out.
//!
//! ## How a resumed run differs from Apex's own resume
//! Resumed here, a run continues bit for bit as a Python run continues from the file's values
//! with its optimizer state kept in fp32 (tests/torch_checkpoint.rs, at O0 and O2). For a file
//! Apex wrote under O2 that is not the uninterrupted run: the file holds the fp16 model cast to
//! fp32, not the masters, so the resumed masters are fp16 values and the run drifts from the
//! uninterrupted one from its first steps, about as far as Apex's own resume. Apex's own resume (README recipe) does not: `optimizer.load_state_dict` runs before Apex
//! swaps the fp32 masters into the optimizer, so torch casts the saved fp32 state to the fp16
//! model parameters' dtype, and Apex casts it back to fp32 when it makes the masters. The state
//! makes a round trip through fp16: SGD's momentum lands up to 5.7e-5 off in the test's model,
//! and Adam's second moments below fp16's smallest subnormal (6e-8; 1e-14 for the biases of a
//! layer followed by batch norm) become 0, so the first resumed Adam step divides by `eps`
//! alone and moves those parameters by up to 0.09 where the uninterrupted run moves them by
//! 1e-3. tch-amp loads the state straight into fp32 and does neither. (Apex's masters come from
//! the fp16 model as tch-amp's do from the fp32 state dict: for a file Apex wrote, the same
//! values.)
//!
//! ## What saving writes
//! A plain dict: the caller's entries ([`TorchSaveOptions::entry`]: `epoch`, `arch`,
//! `best_prec1`, ...), then the model state dict (an OrderedDict in torch's module order as far
//! as tch knows it, floating variables in fp32 taken from the masters where there are masters
//! — what Apex's O2 hook writes, without its rounding — running statistics as they are, and
//! the second names of tied parameters, [`TorchSaveOptions::tied`], viewing the same storage),
//! one state dict per optimizer in its class's layout (torch.optim's: `{'state': {index:
//! {'step': tensor(n.), buffers...}}, 'param_groups': [{'lr', hyper-parameters, implementation
//! flags as torch 2.13 writes them, 'param_names', 'params': [index, ...]}]}`; Apex's: its group
//! keys and group `step`), one torch group per parameter group of the optimizer with that
//! group's own values ([`default_param_order`], or [`TorchSaveOptions::param_order`]), and
//! `amp` (`{'loss_scaler0': {'loss_scale': float, 'unskipped': int}}`) or `scaler`
//! (`scaler.state_dict()`), and, when asked, `'master params'`. A user's
//! [`crate::UpdateRule`] has no torch form: [`TorchCheckpointError::NoTorchForm`]. A Python
//! script resumes the file with its usual code; under O2 Apex then rounds the masters to the
//! fp16 model and round-trips the state through fp16 as above, so only a resume that builds its
//! masters from the file (as tch-amp does) continues exactly.

mod error;
mod model;
mod optim;
mod options;

pub(crate) mod file;

pub use error::{Result, TorchCheckpointError};
pub use file::{
    load_torch_checkpoint_value, optimizer_config, optimizer_record_from_torch, optimizer_record_to_torch,
    param_order_from_torch, torch_checkpoint_value, TorchLoadReport,
};
pub use optim::default_param_order;
pub use options::{KeyPrefix, TorchLoadOptions, TorchParamOrder, TorchSaveOptions};
