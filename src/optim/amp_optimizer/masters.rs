//! O2's master-gradient path: the fp16 gradients a `scale_loss` pass leaves for `step`, made
//! into fp32 master gradients a slice at a time inside `step`, or all at once when something
//! needs them earlier.
use crate::error::UsageError;
use tch::{Kind, Tensor};

use super::{AmpOptimizer, Stage};
use crate::error::{AmpError, Result, TorchContext};
use crate::optim::engine::GradSlice;
use crate::optim::grads::{clear_grad, set_grad, take_grad, unscale_};
use crate::optim::params::ParamEntry;

/// O2's gradients on CPU between `scale_loss` and `step`: still the model's fp16/bf16 `.grad`,
/// checked for inf/NaN but not unscaled. `step` turns them into fp32 master gradients a slice
/// at a time, right before each slice's update, so that no full-size fp32 gradient is ever
/// held: 16 bytes per parameter at the peak with Adam (2 fp16 weight, 4 master, 2 fp16 grad,
/// 8 state) instead of 18. Anything that needs the fp32 master gradients before `step`
/// (clipping, [`AmpOptimizer::master_params`], another `scale_loss` accumulating into them)
/// makes them all at once, as before. On CUDA the master gradients are always made at once at
/// `scale_loss` exit (as Apex does; a slice costs kernel launches there, not memory traffic).
#[derive(Debug)]
pub(super) struct HalfGrads {
    /// The fp32 `1 / loss_scale` of the pass that made them.
    pub(super) inv_scale: Tensor,
    /// Each waiting gradient as the pass left it: (entry, data pointer, version counter).
    pub(super) seen: Vec<(usize, usize, i64)>,
}

impl HalfGrads {
    /// Records the fp16 gradients of `entries` that wait for `step`, as they are now.
    pub(super) fn new(inv_scale: Tensor, entries: &[ParamEntry]) -> Result<Self> {
        let mut seen = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let g = e.model().grad();
            if e.master().is_some() && g.defined() {
                seen.push((i, g.data_ptr() as usize, g.f_internal_version().ctx("a gradient's version")?));
            }
        }
        Ok(Self { inv_scale, seen })
    }
}

/// Largest slice (elements) of a master gradient made at once in `step` (see [`HalfGrads`]):
/// 256 Ki elements, 1 MiB of fp32 gradient. A multiple of 64, so every slice starts where the
/// kernels' own vector blocks and thread ranges would, and each element takes the same code
/// path as in a whole-tensor update.
const SLICE_MAX: i64 = 1 << 18;

impl AmpOptimizer {
    /// Under O2, the fp16 gradients `step` is about to unscale must be exactly what
    /// `scale_loss` left: a change in between (clipping the model's own gradients, which are
    /// still scaled) would step from scaled or altered values.
    pub(super) fn check_unchanged(&self, half: Option<&HalfGrads>) -> Result<()> {
        let Some(half) = half else { return Ok(()) };
        let mut changed = Vec::new();
        for &(i, ptr, version) in &half.seen {
            let e = &self.entries[i];
            let g = e.model().grad();
            let same = g.defined()
                && g.data_ptr() as usize == ptr
                && g.f_internal_version().ctx("a gradient's version")? == version;
            if !same {
                changed.push(e.name().to_string());
            }
        }
        if changed.is_empty() {
            Ok(())
        } else {
            changed.truncate(5);
            Err(AmpError::Usage(UsageError::ModelGradsChanged { params: changed }))
        }
    }

    /// Makes the pending fp32 master gradients of an O2 pass at once: each fp16 model gradient
    /// is copied to fp32, unscaled and added to its master's (`scale_loss` did this itself
    /// before the slice-wise step existed). Nothing to do when none are pending.
    pub(super) fn make_master_grads(&self) -> Result<()> {
        let half = match &mut *self.stage() {
            Stage::Unscaled { half } => half.take(),
            _ => None,
        };
        let Some(half) = half else { return Ok(()) };
        let _no_grad = tch::no_grad_guard();
        let mut made: Vec<(usize, Tensor)> = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            if e.master().is_some() {
                if let Some(g) = take_grad(e.model())? {
                    made.push((i, g.f_to_kind(Kind::Float).ctx("copying a model gradient to fp32")?));
                }
            }
        }
        let grads: Vec<Tensor> = made.iter().map(|(_, g)| g.shallow_clone()).collect();
        let flag = Tensor::f_zeros([1], (Kind::Float, half.inv_scale.device())).ctx("found_inf")?;
        unscale_(&grads, &flag, &half.inv_scale)?;
        for (i, g) in made {
            let Some(master) = self.entries[i].master() else { continue };
            let existing = master.grad();
            if existing.defined() {
                let mut ex = existing;
                let _ = ex.f_add_(&g).ctx("accumulating a master gradient")?;
            } else {
                set_grad(master, &g)?;
            }
        }
        Ok(())
    }

    /// The slice-wise O2 update (see [`HalfGrads`]): for each parameter with a master and an
    /// fp16 gradient, each slice of at most [`SLICE_MAX`] elements of the gradient is unscaled
    /// into one reused fp32 buffer (`fp16 -> fp32`, then times `inv_scale`: what the full-size
    /// path computes), the master slice updated from it and rounded into the model.
    pub(super) fn step_from_half_grads(&mut self, half: &HalfGrads) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let order: Vec<usize> = (0..self.entries.len())
            .filter(|&i| self.entries[i].master().is_some() && self.entries[i].model().grad().defined())
            .collect();
        let Some(largest) = order.iter().map(|&i| self.entries[i].model().numel() as i64).max() else {
            return Ok(());
        };
        let device = self.entries[order[0]].model().device();
        let buffer = Tensor::f_empty([largest.min(SLICE_MAX)], (Kind::Float, device)).ctx("a master-gradient slice")?;
        for i in order {
            let e = &self.entries[i];
            let (model, master) =
                (e.model().shallow_clone(), e.master().map(Tensor::shallow_clone).unwrap_or_default());
            let grad = model.grad().f_view([-1]).ctx("an fp16 gradient")?;
            let n = grad.numel() as i64;
            let (model_flat, master_flat) = (model.f_view([-1]).ctx("a weight")?, master.f_view([-1]).ctx("a master")?);
            let narrow = |t: &Tensor, at: i64, len: i64| -> Result<Tensor> {
                if len == n {
                    Ok(t.shallow_clone())
                } else {
                    t.f_narrow(0, at, len).ctx("a parameter slice")
                }
            };
            let mut start = 0i64;
            let mut next = || -> Result<Option<GradSlice>> {
                if start >= n {
                    return Ok(None);
                }
                let len = (n - start).min(SLICE_MAX);
                let mut g = buffer.f_narrow(0, 0, len).ctx("a master-gradient slice")?;
                g.f_copy_(&narrow(&grad, start, len)?).ctx("an fp16 gradient slice to fp32")?;
                let _ = g.f_mul_(&half.inv_scale).ctx("unscaling a gradient slice")?;
                let out = GradSlice { start, grad: g };
                start += len;
                Ok(Some(out))
            };
            let mut done = |at: i64, len: i64| -> Result<()> {
                let mut w = narrow(&model_flat, at, len)?;
                w.f_copy_(&narrow(&master_flat, at, len)?).ctx("copying master weights into the model").map(|_| ())
            };
            self.inner.update_in_slices(i, &mut next, &mut done)?;
            clear_grad(&model)?;
        }
        Ok(())
    }
}
