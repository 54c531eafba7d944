//! The model under AMP: O0/O2/O3's cast of the `VarStore` in place (batch norm optionally
//! kept fp32) and the wrapper `initialize` returns, whose floating inputs go in as the model's
//! dtype and floating outputs come back as fp32 (or `cast_model_outputs`).
use std::collections::{BTreeMap, BTreeSet};

use tch::nn::{Module, ModuleT, VarStore};
use tch::{Kind, Tensor};

use crate::dtype::is_floating;
use crate::error::{Result, TorchContext};

/// A model whose inputs and outputs are cast as Apex's patched `forward` casts them.
/// Integer and bool tensors pass through untouched. With no cast configured (O1, O0 with
/// `cast_model_type=None`, `enabled=false`) it is the identity around `inner`.
#[derive(Debug)]
pub struct AmpModel<M> {
    inner: M,
    input_kind: Option<Kind>,
    output_kind: Option<Kind>,
}

impl<M> AmpModel<M> {
    pub(crate) fn new(inner: M, input_kind: Option<Kind>, output_kind: Option<Kind>) -> Self {
        Self { inner, input_kind, output_kind }
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The wrapped model, unwrapped.
    pub fn into_inner(self) -> M {
        self.inner
    }

    /// Dtype floating inputs are cast to (`None`: left alone).
    pub fn input_kind(&self) -> Option<Kind> {
        self.input_kind
    }

    /// Dtype floating outputs are cast to (`None`: left alone).
    pub fn output_kind(&self) -> Option<Kind> {
        self.output_kind
    }

    /// Casts a tensor as an input is cast.
    pub fn cast_input(&self, xs: &Tensor) -> Tensor {
        cast(xs, self.input_kind)
    }

    /// Casts a tensor as an output is cast.
    pub fn cast_output(&self, ys: &Tensor) -> Tensor {
        cast(ys, self.output_kind)
    }

    /// `inner.forward` with the casts.
    pub fn forward(&self, xs: &Tensor) -> Tensor
    where
        M: Module,
    {
        self.cast_output(&self.inner.forward(&self.cast_input(xs)))
    }
}

fn cast(t: &Tensor, kind: Option<Kind>) -> Tensor {
    match kind {
        Some(k) if is_floating(t.kind()) && t.kind() != k => t.to_kind(k),
        _ => t.shallow_clone(),
    }
}

impl<M: ModuleT> ModuleT for AmpModel<M> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.cast_output(&self.inner.forward_t(&self.cast_input(xs), train))
    }
}

/// What [`crate::Amp::cast_model`] did to each variable.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CastReport {
    /// Variables cast to the model type, by name.
    pub cast: Vec<String>,
    /// Floating variables kept as they were because they belong to an affine batch norm.
    pub kept_batchnorm: Vec<String>,
    /// Variables left alone because they are not floating (e.g. `num_batches_tracked`).
    pub non_floating: Vec<String>,
}

/// The module path of a variable: everything before the last dot (`""` at the root).
pub(crate) fn parent_path(name: &str) -> &str {
    name.rsplit_once('.').map_or("", |(parent, _)| parent)
}

/// The last path segment of a variable name.
pub(crate) fn leaf_name(name: &str) -> &str {
    name.rsplit_once('.').map_or(name, |(_, leaf)| leaf)
}

/// Module paths that are affine batch norms: they hold `running_mean`, `running_var` and
/// `weight` as direct children. Segments are compared whole, so `layer1` never matches
/// `layer10` (unlike tch's `Path::set_kind`). Apex keeps only affine `_BatchNorm` modules in
/// fp32; a batch norm without affine parameters is cast like any other module.
pub(crate) fn batchnorm_modules<'a>(names: impl IntoIterator<Item = &'a str>) -> BTreeSet<String> {
    let mut children: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for name in names {
        children.entry(parent_path(name)).or_default().insert(leaf_name(name));
    }
    children
        .into_iter()
        .filter(|(_, kids)| ["running_mean", "running_var", "weight"].iter().all(|k| kids.contains(k)))
        .map(|(parent, _)| parent.to_string())
        .collect()
}

/// Casts every floating variable of `vs` to `kind` in place, except affine batch-norm
/// variables when `keep_batchnorm_fp32` (those are made fp32).
pub(crate) fn cast_var_store(vs: &VarStore, kind: Kind, keep_batchnorm_fp32: bool) -> Result<CastReport> {
    let vars = vs.variables();
    let bn = batchnorm_modules(vars.keys().map(String::as_str));
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    let mut report = CastReport::default();
    let _no_grad = tch::no_grad_guard();
    for name in names {
        let var = &vars[name];
        if !is_floating(var.kind()) {
            report.non_floating.push(name.clone());
            continue;
        }
        let keep = keep_batchnorm_fp32 && bn.contains(parent_path(name));
        let target = if keep { Kind::Float } else { kind };
        if var.kind() != target {
            set_kind(var, target)?;
        }
        if keep {
            report.kept_batchnorm.push(name.clone());
        } else {
            report.cast.push(name.clone());
        }
    }
    Ok(report)
}

/// Changes a variable's dtype in place: same TensorImpl, new data, `requires_grad` kept.
pub(crate) fn set_kind(var: &Tensor, kind: Kind) -> Result<()> {
    let data = var.f_to_kind(kind).ctx("casting a model variable")?.f_detach().ctx("casting a model variable")?;
    let mut v = var.shallow_clone();
    v.f_set_data(&data).ctx("set_data on a model variable")?;
    Ok(())
}
