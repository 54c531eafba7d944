//! [`Optimizer`]: the plain optimizer trait (torch.optim's `Optimizer` without AMP, as candle's
//! `Optimizer`), which the AMP features are written against: [`crate::GradScaler`] unscales and
//! steps any of them, [`crate::ema::ModelEma`] averages what they step. Implemented for tch's
//! `nn::Optimizer` and tch-amp's [`AmpOptimizer`] (a plain one from [`AmpOptimizer::new`], or
//! one an [`crate::Amp`] made, which adds the fp32 masters and Apex's protocol).
use tch::nn;
use tch::Tensor;

use crate::error::Result;
use crate::optim::AmpOptimizer;

/// An optimizer: the parameters it updates (torch's `param_groups`, flattened) and one update from
/// their gradients.
///
/// Implement it for an optimizer of your own. [`crate::GradScaler`] identifies an optimizer by
/// its address (as torch by `id(optimizer)`), so do not move it between `unscale_`/`step` and
/// `update`.
pub trait Optimizer {
    /// The parameters it updates (shallow handles: their `.grad` is what `step` reads; a scaler
    /// unscales it in place). Parameters without a gradient are skipped.
    fn params(&self) -> Vec<Tensor>;

    /// One update from the gradients.
    ///
    /// # Errors
    /// The optimizer's own failure; callers pass it on.
    fn step(&mut self) -> Result<()>;

    /// Sets every gradient to zero or None.
    ///
    /// # Errors
    /// The optimizer's own failure.
    fn zero_grad(&mut self) -> Result<()>;

    /// The fp32 masters it steps in place of low-precision model variables, by VarStore name
    /// (Apex's O2); none for a plain optimizer.
    fn masters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// For an optimizer spread over the processes of a group, each updating (and checking the
    /// gradients of) part of the parameters (a sharded optimizer): `found_inf`, this process's
    /// inf/NaN flags (fp32, > 0: found) over the gradients of [`Self::params`], becomes one flag
    /// that is the same on every process, so that all step or skip together.
    /// [`crate::GradScaler`] calls it after unscaling, before it reads the flags. The default
    /// leaves them as they are (one process sees every gradient).
    ///
    /// # Errors
    /// The collective's failure.
    fn agree_on_overflow(&self, found_inf: &mut Vec<Tensor>) -> Result<()> {
        let _ = found_inf;
        Ok(())
    }
}

/// tch's libtorch optimizers (`nn::Sgd`, `nn::Adam`, ... built with `.build(&vs, lr)`). Their
/// `step` panics when libtorch fails (tch unwraps it); callers cannot turn that into an error.
impl Optimizer for nn::Optimizer {
    fn params(&self) -> Vec<Tensor> {
        self.trainable_variables()
    }

    fn step(&mut self) -> Result<()> {
        nn::Optimizer::step(self);
        Ok(())
    }

    fn zero_grad(&mut self) -> Result<()> {
        nn::Optimizer::zero_grad(self);
        Ok(())
    }
}

/// tch-amp's optimizers. A plain one ([`AmpOptimizer::new`]) is torch.optim's; one an
/// [`crate::Amp`] made at O0 or without master weights works under a [`crate::GradScaler`] too.
/// With fp16 parameters the scaler refuses their gradients, as torch does. A sharded one
/// ([`AmpOptimizer::sharded`]) gives its rank's shard as `params` and agrees the inf/NaN verdict
/// with the other ranks.
impl Optimizer for AmpOptimizer {
    fn params(&self) -> Vec<Tensor> {
        self.master_params()
    }

    fn step(&mut self) -> Result<()> {
        self.note_scaler_step();
        AmpOptimizer::step(self)?;
        Ok(())
    }

    fn zero_grad(&mut self) -> Result<()> {
        AmpOptimizer::zero_grad(self)
    }

    fn masters(&self) -> Vec<(String, Tensor)> {
        self.named_masters()
    }

    fn agree_on_overflow(&self, found_inf: &mut Vec<Tensor>) -> Result<()> {
        self.agree_flags(found_inf)
    }
}
