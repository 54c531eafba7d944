//! [`CheckpointScalers`]: the loss scalers a checkpoint saves and restores beside the model and
//! the optimizers, whichever front door made them: an [`Amp`]'s (Apex's `amp.state_dict()`),
//! torch.amp's [`GradScaler`] (`scaler.state_dict()`), several GradScalers, or none (`()`: a
//! bf16 script has no scaler). [`crate::save_checkpoint`], [`crate::load_checkpoint`],
//! [`crate::save_torch_checkpoint`] and [`crate::load_torch_checkpoint`] take any of them, so a
//! torch.amp script needs no `Amp` to checkpoint.
use crate::amp::Amp;
use crate::error::{mismatch, Result};
use crate::torch_amp::grad_scaler::GradScaler;
use crate::torch_io::{Node, Value};

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::amp::Amp {}
    impl Sealed for crate::torch_amp::grad_scaler::GradScaler {}
    impl Sealed for [crate::torch_amp::grad_scaler::GradScaler] {}
    impl Sealed for () {}
}

/// The loss scalers of a checkpoint: implemented for [`Amp`] (its loss scalers, Apex's
/// `amp.state_dict()` under the key `amp`), [`GradScaler`] (`scaler.state_dict()` under
/// `scaler`, as torch's "Automatic Mixed Precision examples" page saves it), a slice of
/// GradScalers (a list of their state dicts under `scaler`) and `()` (no scaler; nothing saved
/// or read). Sealed: the checkpoint functions know these four.
pub trait CheckpointScalers: sealed::Sealed {
    /// The key of the state in a `torch.save` checkpoint: `"amp"` for an [`Amp`], `"scaler"`
    /// for GradScalers, `None` for `()`.
    fn torch_key(&self) -> Option<&'static str>;

    /// The state as a `torch.save` checkpoint holds it.
    fn scaler_state(&self) -> Value;

    /// Checks `state` (as [`Self::scaler_state`] writes it, or as Python wrote it) without
    /// changing anything.
    ///
    /// # Errors
    /// [`StateError::StateMismatch`](crate::error::StateError::StateMismatch) naming what
    /// does not fit.
    fn check_scaler_state(&self, state: &Node<'_>) -> Result<()>;

    /// Applies a state [`Self::check_scaler_state`] accepted.
    ///
    /// # Errors
    /// As [`Self::check_scaler_state`] (not expected after it passed).
    fn apply_scaler_state(&mut self, state: &Node<'_>) -> Result<()>;

    /// The [`Amp`] itself, for tch-amp's own checkpoint format, which records Apex's opt level
    /// and scalers in its metadata.
    #[doc(hidden)]
    fn as_amp(&self) -> Option<&Amp> {
        None
    }

    /// [`Self::as_amp`], mutably.
    #[doc(hidden)]
    fn as_amp_mut(&mut self) -> Option<&mut Amp> {
        None
    }
}

impl CheckpointScalers for Amp {
    fn torch_key(&self) -> Option<&'static str> {
        Some("amp")
    }

    fn scaler_state(&self) -> Value {
        super::state_value(self.scalers())
    }

    fn check_scaler_state(&self, state: &Node<'_>) -> Result<()> {
        self.check_state_dict(state).map(|_| ())
    }

    fn apply_scaler_state(&mut self, state: &Node<'_>) -> Result<()> {
        let parsed = self.check_state_dict(state)?;
        self.apply_checked_state(parsed);
        Ok(())
    }

    fn as_amp(&self) -> Option<&Amp> {
        Some(self)
    }

    fn as_amp_mut(&mut self) -> Option<&mut Amp> {
        Some(self)
    }
}

impl CheckpointScalers for GradScaler {
    fn torch_key(&self) -> Option<&'static str> {
        Some("scaler")
    }

    fn scaler_state(&self) -> Value {
        self.state_dict()
    }

    fn check_scaler_state(&self, state: &Node<'_>) -> Result<()> {
        self.check_state_dict(state.value()).map(|_| ()).map_err(|e| mismatch(format!("{}: {e}", state.path())))
    }

    fn apply_scaler_state(&mut self, state: &Node<'_>) -> Result<()> {
        self.load_state_dict(state.value()).map_err(|e| mismatch(format!("{}: {e}", state.path())))
    }
}

impl CheckpointScalers for [GradScaler] {
    fn torch_key(&self) -> Option<&'static str> {
        Some("scaler")
    }

    fn scaler_state(&self) -> Value {
        Value::List(self.iter().map(GradScaler::state_dict).collect())
    }

    fn check_scaler_state(&self, state: &Node<'_>) -> Result<()> {
        let items = state.elements().map_err(|e| mismatch(e.to_string()))?;
        if items.len() != self.len() {
            return Err(mismatch(format!(
                "{} holds {} GradScaler states, {} GradScalers were given",
                state.path(),
                items.len(),
                self.len()
            )));
        }
        self.iter().zip(&items).try_for_each(|(s, n)| s.check_scaler_state(n))
    }

    fn apply_scaler_state(&mut self, state: &Node<'_>) -> Result<()> {
        self.check_scaler_state(state)?;
        let items = state.elements().map_err(|e| mismatch(e.to_string()))?;
        self.iter_mut().zip(&items).try_for_each(|(s, n)| s.apply_scaler_state(n))
    }
}

impl CheckpointScalers for () {
    fn torch_key(&self) -> Option<&'static str> {
        None
    }

    fn scaler_state(&self) -> Value {
        Value::None
    }

    fn check_scaler_state(&self, state: &Node<'_>) -> Result<()> {
        Err(mismatch(format!(
            "{} holds a loss scaler state, but no scaler was given: pass the Amp or the GradScaler(s)",
            state.path()
        )))
    }

    fn apply_scaler_state(&mut self, state: &Node<'_>) -> Result<()> {
        self.check_scaler_state(state)
    }
}
