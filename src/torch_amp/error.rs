//! The error type of [`crate::torch_amp`]: torch.amp's refusals (GradScaler's per-optimizer
//! protocol, bad options and state dicts), autocast's conflict with the Apex path, and
//! Lightning's rejected precision flags. It wraps [`AmpError`] (libtorch and shim failures) and
//! [`TorchIoError`] (torch.save files); neither knows about it.
use tch::{Device, Kind};

use crate::error::AmpError;
use crate::torch_io::TorchIoError;

/// Everything that can go wrong in [`crate::torch_amp`]. Nothing was changed when one is
/// returned, except where a variant says otherwise.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TorchAmpError {
    /// An option out of range: a non-finite or non-positive scale, `growth_factor <= 1`,
    /// `backoff_factor` outside (0, 1), `growth_interval < 1`, an autocast dtype other than
    /// fp16/bf16/fp32, a device other than CPU/CUDA.
    #[error("invalid value {value} for {option}: expected {expected}")]
    InvalidOption {
        /// The option's name, as torch spells it.
        option: &'static str,
        /// What was given.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// `GradScaler::scale` was given a tensor that is not floating point (torch would promote
    /// it to fp32; a scaled integer loss is a bug).
    #[error("GradScaler::scale was given a {dtype:?} tensor: scale the floating-point loss (or outputs), not an integer tensor")]
    NotFloatingPoint {
        /// The tensor's dtype.
        dtype: Kind,
    },
    /// An optimizer holds fp16 gradients (torch's "Attempting to unscale FP16 gradients."): the
    /// scaler unscales fp32 (or bf16) gradients only; keep fp32 parameters (and let autocast cast
    /// them per op) or use the Apex path's O2 with fp32 master weights.
    #[error(
        "Attempting to unscale FP16 gradients (parameter {index} of the optimizer): keep the parameters in fp32 \
         under autocast, or use tch_amp::initialize with O2 for fp32 master weights"
    )]
    UnscaleFp16Gradients {
        /// The parameter's position in [`crate::torch_amp::ScalerOptimizer::params`].
        index: usize,
    },
    /// `unscale_` twice for one optimizer within one iteration.
    #[error("unscale_() has already been called on this optimizer since the last update(): call it once per step")]
    UnscaleTwice,
    /// `unscale_` after `step` for the same optimizer in one iteration.
    #[error("unscale_() is being called after step(): unscale before stepping, then call update()")]
    UnscaleAfterStep,
    /// `step` twice for one optimizer without `update` in between.
    #[error("step() has already been called since the last update(): call scaler.update() after each step")]
    StepTwice,
    /// `update` with no optimizer unscaled or stepped since the last update (torch: "No inf
    /// checks were recorded prior to update.").
    #[error(
        "No inf checks were recorded prior to update(): call scaler.step(optimizer) (or unscale_) before update()"
    )]
    NoInfChecks,
    /// `step` for an optimizer none of whose parameters has a gradient (torch: "No inf checks
    /// were recorded for this optimizer.").
    #[error("No inf checks were recorded for this optimizer: run backward on scaler.scale(&loss) before step()")]
    NoInfChecksForOptimizer,
    /// `unscale_`, `step` or `update` before the first `scale` (torch: "Attempted step but
    /// _scale is None").
    #[error(
        "Attempted {call} but the scale is not initialized: scale the loss with scaler.scale(&loss) earlier in the iteration"
    )]
    ScaleNotInitialized {
        /// The call.
        call: &'static str,
    },
    /// A GradScaler state dict that lacks a key, holds one of the wrong type or an
    /// out-of-range value, or is empty (saved from a disabled scaler).
    #[error("GradScaler state dict: {message}; nothing was loaded (save it with GradScaler::state_dict or torch's scaler.state_dict())")]
    StateDict {
        /// What is wrong.
        message: String,
    },
    /// torch.amp's autocast was entered while tch-amp's Apex O1 policy (or the CPU emulation
    /// under O2/O3) is active on this thread, or the other way round. Both drive libtorch's
    /// autocast state; mixing them would cast by the wrong lists.
    #[error(
        "{entering} cannot start on this thread while {active} is active: drop the other's guard (or Amp) \
         first, or run them on different threads"
    )]
    AutocastConflict {
        /// What was being started.
        entering: &'static str,
        /// What is already active.
        active: &'static str,
    },
    /// A Lightning precision flag, or a combination of Lightning flags, that Lightning rejects.
    #[error("precision {value:?}: {why}")]
    Precision {
        /// What was given.
        value: String,
        /// Why Lightning refuses it, and what to pass instead.
        why: String,
    },
    /// A tensor on a device the scaler cannot use.
    #[error("tensor on {device:?}: GradScaler and autocast support Device::Cpu and Device::Cuda(_)")]
    UnsupportedDevice {
        /// The device.
        device: Device,
    },
    /// libtorch or tch-amp's shim failed.
    #[error(transparent)]
    Amp(#[from] AmpError),
    /// Reading or writing a torch.save file failed.
    #[error(transparent)]
    TorchIo(#[from] TorchIoError),
}

/// `Result` with [`TorchAmpError`].
pub type Result<T, E = TorchAmpError> = std::result::Result<T, E>;

impl From<tch::TchError> for TorchAmpError {
    fn from(source: tch::TchError) -> Self {
        TorchAmpError::Amp(AmpError::Torch { context: "a torch.amp call", source })
    }
}
