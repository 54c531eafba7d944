//! [`ScalerOptimizer`]: what [`crate::GradScaler`] needs of an optimizer, implemented for tch's
//! `nn::Optimizer` and tch-amp's [`AmpOptimizer`] (its built-in rules, Apex's fused ones, and a
//! user's [`crate::UpdateRule`]).
use tch::nn;
use tch::Tensor;

use crate::error::Result;
use crate::optim::AmpOptimizer;

/// An optimizer [`crate::GradScaler`] can unscale and step: torch's `optimizer.param_groups`
/// (the parameters whose `.grad` is unscaled and checked for inf/NaN) and `optimizer.step()`.
///
/// Implement it for an optimizer of your own; the scaler identifies an optimizer by its address
/// (as torch by `id(optimizer)`), so do not move it between `unscale_`/`step` and `update`.
pub trait ScalerOptimizer {
    /// The parameters (shallow handles: their `.grad` is unscaled in place). Parameters
    /// without a gradient are skipped.
    fn params(&self) -> Vec<Tensor>;

    /// One update from the gradients, which the scaler has unscaled.
    ///
    /// # Errors
    /// The optimizer's own failure; the scaler passes it on.
    fn step(&mut self) -> Result<()>;
}

/// tch's libtorch optimizers (`nn::Sgd`, `nn::Adam`, ... built with `.build(&vs, lr)`). Their
/// `step` panics when libtorch fails (tch unwraps it); the scaler cannot turn that into an
/// error.
impl ScalerOptimizer for nn::Optimizer {
    fn params(&self) -> Vec<Tensor> {
        self.trainable_variables()
    }

    fn step(&mut self) -> Result<()> {
        nn::Optimizer::step(self);
        Ok(())
    }
}

/// tch-amp's optimizers on fp32 parameters (an [`crate::Amp`] at O0, or no master weights):
/// [`AmpOptimizer::master_params`] are the parameters themselves. With fp16 parameters the
/// scaler refuses their gradients, as torch does.
impl ScalerOptimizer for AmpOptimizer {
    fn params(&self) -> Vec<Tensor> {
        self.master_params()
    }

    fn step(&mut self) -> Result<()> {
        self.note_scaler_step();
        AmpOptimizer::step(self)?;
        Ok(())
    }
}
