//! Loss scaling: Apex's dynamic loss scaler (one per loss), the scalers' state dict in
//! Apex's and torch `GradScaler`'s forms, and the scalers a checkpoint holds
//! ([`CheckpointScalers`]: an `Amp`'s or torch.amp's `GradScaler`s).
mod checkpoint;
mod overflow;
pub(crate) mod scale_loss;
mod scaler;
mod state_dict;

pub use checkpoint::CheckpointScalers;
pub use overflow::{NonFiniteGrad, OverflowReport};
pub(crate) use scale_loss::ScaleLossOptions;
pub use scale_loss::ScaleLossOutcome;
pub(crate) use scaler::Collapse;
pub use scaler::{LossScaler, ScaleChange, ScaleChangeReason, ScalerState};
pub(crate) use state_dict::{amp_state, amp_state_value, apply_state, parse_state, state_value, AmpState, ParsedState};
