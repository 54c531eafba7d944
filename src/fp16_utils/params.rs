//! The manual master-weight recipe of `apex.fp16_utils` (`prep_param_lists`,
//! `model_grads_to_master_grads`, `master_params_to_model_params`, `to_python_float`, the
//! `clip_grad_norm` it re-exports), for scripts that drive the fp32 masters themselves.
use crate::error::UsageError;
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::error::{AmpError, Result, TorchContext};
use crate::sys;

fn mismatch(message: impl Into<String>) -> AmpError {
    AmpError::Usage(UsageError::ParamListMismatch { message: message.into() })
}

/// The trainable variables of `vs` that require grad, in creation order (torch's
/// `[p for p in model.parameters() if p.requires_grad]`).
pub fn model_params(vs: &VarStore) -> Vec<Tensor> {
    vs.trainable_variables().into_iter().filter(Tensor::requires_grad).collect()
}

/// Apex's `prep_param_lists(model, flat_master)`: the model's parameters ([`model_params`]) and
/// their fp32 masters: one detached fp32 copy per parameter, or with `flat_master` a single flat
/// fp32 tensor holding them all, end to end, with a zero gradient already attached (Apex attaches
/// an uninitialized one). The masters require grad, as Apex's.
///
/// # Errors
/// [`UsageError::ParamListMismatch`] with `flat_master` when the parameters are not all of one
/// dtype (Apex's flatten fails there too) or there are none; [`AmpError::Torch`] if a copy fails.
pub fn prep_param_lists(vs: &VarStore, flat_master: bool) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let params = model_params(vs);
    let _no_grad = tch::no_grad_guard();
    if flat_master {
        let Some(first) = params.first() else {
            return Err(mismatch("prep_param_lists(flat_master=true): the model has no trainable parameter"));
        };
        if let Some(other) = params.iter().find(|p| p.kind() != first.kind()) {
            return Err(mismatch(format!(
                "prep_param_lists(flat_master=true) needs parameters of one dtype, found {:?} and {:?}: use \
                 flat_master=false, or Fp16Optimizer",
                first.kind(),
                other.kind()
            )));
        }
        let flat = flatten(&params)?.f_to_kind(Kind::Float).ctx("flat master")?.f_detach().ctx("flat master")?;
        let master = flat.f_contiguous().ctx("flat master")?.set_requires_grad(true);
        let grad = master.f_zeros_like().ctx("flat master gradient")?;
        sys::set_grad(&master, Some(&grad))?;
        return Ok((params, vec![master]));
    }
    let masters = params
        .iter()
        .map(|p| {
            p.f_detach_copy()
                .and_then(|d| d.f_to_kind(Kind::Float))
                .map(|m| m.set_requires_grad(true))
                .ctx("master copy")
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((params, masters))
}

/// The tensors flattened and concatenated (torch's `_flatten_dense_tensors`).
fn flatten(tensors: &[Tensor]) -> Result<Tensor> {
    let flat: Vec<Tensor> = tensors.iter().map(|t| t.f_reshape([-1])).collect::<Result<_, _>>().ctx("flatten")?;
    Tensor::f_cat(&flat, 0).ctx("flatten")
}

fn check_pairs(model_params: &[Tensor], master_params: &[Tensor], flat_master: bool) -> Result<()> {
    if flat_master {
        let n: i64 = model_params.iter().map(|p| p.numel() as i64).sum();
        match master_params {
            [m] if m.numel() as i64 == n => Ok(()),
            [m] => Err(mismatch(format!(
                "the flat master holds {} elements, the model parameters {n}: pass the lists prep_param_lists made",
                m.numel()
            ))),
            _ => Err(mismatch(format!(
                "flat_master=true expects one master tensor, got {}: pass flat_master as prep_param_lists had it",
                master_params.len()
            ))),
        }
    } else {
        if model_params.len() != master_params.len() {
            return Err(mismatch(format!(
                "{} model parameters but {} masters: pass the lists prep_param_lists made (flat_master as there)",
                model_params.len(),
                master_params.len()
            )));
        }
        for (i, (p, m)) in model_params.iter().zip(master_params).enumerate() {
            if p.size() != m.size() {
                return Err(mismatch(format!("parameter {i} has shape {:?}, its master {:?}", p.size(), m.size())));
            }
        }
        Ok(())
    }
}

/// Apex's `model_grads_to_master_grads(model_params, master_params, flat_master)`: each master's
/// gradient becomes a copy of its model parameter's gradient (converted to the master's dtype); a
/// master whose parameter has no gradient loses its own. With `flat_master` every model gradient is
/// copied, end to end, into the flat master's gradient.
///
/// # Errors
/// [`UsageError::ParamListMismatch`] for lists that do not pair up (checked before anything
/// changes), or with `flat_master` when a model parameter has no gradient or the flat master none;
/// [`AmpError::Torch`] if a copy fails.
pub fn model_grads_to_master_grads(model_params: &[Tensor], master_params: &[Tensor], flat_master: bool) -> Result<()> {
    check_pairs(model_params, master_params, flat_master)?;
    let _no_grad = tch::no_grad_guard();
    if flat_master {
        let grads: Vec<Tensor> = model_params.iter().map(Tensor::grad).collect();
        if let Some(i) = grads.iter().position(|g| !g.defined()) {
            return Err(mismatch(format!(
                "model parameter {i} has no gradient: with flat_master every parameter needs one (run backward first)"
            )));
        }
        let mut target = master_params[0].grad();
        if !target.defined() {
            return Err(mismatch("the flat master has no gradient tensor: make it with prep_param_lists"));
        }
        target.f_copy_(&flatten(&grads)?).ctx("copying model gradients")?;
        return Ok(());
    }
    for (p, m) in model_params.iter().zip(master_params) {
        let g = p.grad();
        if !g.defined() {
            sys::set_grad(m, None)?;
            continue;
        }
        let mut mg = m.grad();
        if mg.defined() {
            mg.f_copy_(&g).ctx("copying a model gradient")?;
        } else {
            let copy = g.f_detach_copy().and_then(|c| c.f_to_kind(m.kind())).ctx("copying a model gradient")?;
            sys::set_grad(m, Some(&copy))?;
        }
    }
    Ok(())
}

/// Apex's `master_params_to_model_params(model_params, master_params, flat_master)`: each model
/// parameter becomes its master, rounded to the parameter's dtype (with `flat_master`, its slice of
/// the flat master).
///
/// # Errors
/// [`UsageError::ParamListMismatch`] for lists that do not pair up (nothing changes then);
/// [`AmpError::Torch`] if a copy fails.
pub fn master_params_to_model_params(
    model_params: &[Tensor],
    master_params: &[Tensor],
    flat_master: bool,
) -> Result<()> {
    check_pairs(model_params, master_params, flat_master)?;
    let _no_grad = tch::no_grad_guard();
    if flat_master {
        let flat = master_params[0].f_reshape([-1]).ctx("flat master")?;
        let mut at = 0i64;
        for p in model_params {
            let n = p.numel() as i64;
            let part = flat.f_narrow(0, at, n).and_then(|s| s.f_view(p.size().as_slice())).ctx("unflatten")?;
            p.shallow_clone().f_copy_(&part).ctx("copying a master into the model")?;
            at += n;
        }
        return Ok(());
    }
    for (p, m) in model_params.iter().zip(master_params) {
        p.shallow_clone().f_copy_(m).ctx("copying a master into the model")?;
    }
    Ok(())
}

/// Apex's `to_python_float(t)` (`t.item()`): the value of a one-element tensor as `f64`.
///
/// # Errors
/// [`UsageError::ParamListMismatch`] for a tensor that does not hold exactly one element;
/// [`AmpError::Torch`] if reading fails.
pub fn to_python_float(t: &Tensor) -> Result<f64> {
    if !t.defined() || t.numel() != 1 {
        return Err(mismatch(format!(
            "to_python_float needs a one-element tensor, got shape {:?}",
            if t.defined() { t.size() } else { Vec::new() }
        )));
    }
    t.f_double_value(&[]).or_else(|_| t.f_reshape([-1]).and_then(|f| f.f_double_value(&[0]))).ctx("to_python_float")
}

/// torch's `clip_grad_norm_(params, max_norm, norm_type)` (which `apex.fp16_utils` re-exports as
/// `clip_grad_norm`), op for op: per-tensor norms in the order given, the norm of their stack,
/// every gradient multiplied by `min(max_norm / (norm + 1e-6), 1)` computed as torch computes it
/// (a non-finite norm scales by NaN, as torch's does). Parameters without a gradient are skipped; with none the norm is 0 and
/// nothing changes. Returns the total norm.
///
/// # Errors
/// [`ConfigError::InvalidOption`](crate::error::ConfigError::InvalidOption) for a negative or
/// non-finite `max_norm`, or a `norm_type` that is not positive;
/// [`UsageError::CallOrder`](crate::error::UsageError::CallOrder) for fp16/bf16 parameters none
/// of which has a gradient (O2's are on the masters); [`AmpError::Torch`] if an op fails.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64, norm_type: f64) -> Result<f64> {
    let total = crate::optim::clip_grads(params, max_norm, norm_type, crate::optim::NonFiniteNorm::Scale)?;
    total.f_double_value(&[]).ctx("reading the gradient norm")
}
