//! The model wrapper and the cast of its variables (see the module above).
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

impl<M> AmpModel<M> {
    /// Casts any number of inputs as [`Self::forward`] casts one: every floating tensor of
    /// `inputs` (a tensor, a reference to one, a tuple of up to 8 of these, an array, a `Vec`
    /// or a slice, nested) to the model's input dtype; integer and bool tensors unchanged
    /// (Apex casts every floating tensor argument of `forward`).
    pub fn cast_inputs<I: AmpInputs>(&self, inputs: I) -> I::Cast {
        inputs.cast_each(&|t| cast(t, self.input_kind))
    }

    /// A forward pass of a model with several inputs: `inputs` cast as [`Self::cast_inputs`]
    /// casts them, `f` called with the wrapped model and the cast inputs, and its floating
    /// output cast as [`Self::forward`] casts an output.
    ///
    /// ```
    /// use tch::nn::{self, Module, VarStore};
    /// use tch::{Device, Kind, Tensor};
    /// use tch_amp::{Amp, AmpConfig, OptLevel};
    /// # fn main() -> Result<(), tch_amp::AmpError> {
    /// let vs = VarStore::new(Device::Cpu);
    /// let (emb, fc) = (nn::embedding(vs.root() / "emb", 10, 4, Default::default()),
    ///                  nn::linear(vs.root() / "fc", 4, 2, Default::default()));
    /// let amp = Amp::new(&AmpConfig::new(OptLevel::O2).verbosity(0))?;
    /// let model = amp.cast_model(&vs, (emb, fc))?;
    /// let ids = Tensor::from_slice(&[1i64, 7]);              // int64: left alone
    /// let mask = Tensor::ones([2, 1], (Kind::Float, Device::Cpu)); // fp32: cast to fp16
    /// let out = model.forward_many((&ids, &mask), |(emb, fc), (ids, mask)| {
    ///     fc.forward(&(emb.forward(&ids) * mask))
    /// });
    /// assert_eq!(out.kind(), Kind::Float); // O2 outputs come back fp32
    /// # Ok(())
    /// # }
    /// ```
    pub fn forward_many<I: AmpInputs>(&self, inputs: I, f: impl FnOnce(&M, I::Cast) -> Tensor) -> Tensor {
        self.cast_output(&f(&self.inner, self.cast_inputs(inputs)))
    }
}

/// Inputs [`AmpModel::cast_inputs`] and [`AmpModel::forward_many`] cast: a [`Tensor`] or
/// `&Tensor`, tuples of up to 8 inputs, arrays, `Vec`s and slices of inputs, nested as needed.
/// Implement it for a struct of inputs to cast its floating tensors the same way.
pub trait AmpInputs {
    /// The inputs after the cast (owned tensors in the same arrangement).
    type Cast;
    /// Applies `cast` to each tensor (it leaves integer and bool tensors as they are).
    fn cast_each(&self, cast: &dyn Fn(&Tensor) -> Tensor) -> Self::Cast;
}

impl AmpInputs for Tensor {
    type Cast = Tensor;
    fn cast_each(&self, cast: &dyn Fn(&Tensor) -> Tensor) -> Tensor {
        cast(self)
    }
}

impl<T: AmpInputs + ?Sized> AmpInputs for &T {
    type Cast = T::Cast;
    fn cast_each(&self, cast: &dyn Fn(&Tensor) -> Tensor) -> T::Cast {
        (**self).cast_each(cast)
    }
}

impl<T: AmpInputs> AmpInputs for [T] {
    type Cast = Vec<T::Cast>;
    fn cast_each(&self, cast: &dyn Fn(&Tensor) -> Tensor) -> Vec<T::Cast> {
        self.iter().map(|t| t.cast_each(cast)).collect()
    }
}

impl<T: AmpInputs> AmpInputs for Vec<T> {
    type Cast = Vec<T::Cast>;
    fn cast_each(&self, cast: &dyn Fn(&Tensor) -> Tensor) -> Vec<T::Cast> {
        self.as_slice().cast_each(cast)
    }
}

impl<T: AmpInputs, const N: usize> AmpInputs for [T; N] {
    type Cast = [T::Cast; N];
    fn cast_each(&self, cast: &dyn Fn(&Tensor) -> Tensor) -> [T::Cast; N] {
        std::array::from_fn(|i| self[i].cast_each(cast))
    }
}

macro_rules! tuple_inputs {
    ($($name:ident $idx:tt),+) => {
        impl<$($name: AmpInputs),+> AmpInputs for ($($name,)+) {
            type Cast = ($($name::Cast,)+);
            fn cast_each(&self, cast: &dyn Fn(&Tensor) -> Tensor) -> Self::Cast {
                ($(self.$idx.cast_each(cast),)+)
            }
        }
    };
}
tuple_inputs!(A 0);
tuple_inputs!(A 0, B 1);
tuple_inputs!(A 0, B 1, C 2);
tuple_inputs!(A 0, B 1, C 2, D 3);
tuple_inputs!(A 0, B 1, C 2, D 3, E 4);
tuple_inputs!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple_inputs!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_inputs!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);

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

/// What a cast of a VarStore does with the variables of affine batch norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BatchNormCast {
    /// Cast like every other variable.
    Cast,
    /// Made fp32 (Apex's `keep_batchnorm_fp32`).
    Fp32,
    /// Left in whatever dtype they have (Apex's `convert_network`).
    Keep,
}

/// Casts every floating variable of `vs` to `kind` in place, except affine batch-norm
/// variables when `keep_batchnorm_fp32` (those are made fp32).
pub(crate) fn cast_var_store(vs: &VarStore, kind: Kind, keep_batchnorm_fp32: bool) -> Result<CastReport> {
    cast_var_store_as(vs, kind, if keep_batchnorm_fp32 { BatchNormCast::Fp32 } else { BatchNormCast::Cast })
}

/// Casts every floating variable of `vs` to `kind` in place, affine batch norms' as `batchnorm`
/// says. Variables are visited in name order; the report lists what was cast and kept.
pub(crate) fn cast_var_store_as(vs: &VarStore, kind: Kind, batchnorm: BatchNormCast) -> Result<CastReport> {
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
        let in_bn = bn.contains(parent_path(name));
        let target = match (in_bn, batchnorm) {
            (true, BatchNormCast::Fp32) => Some(Kind::Float),
            (true, BatchNormCast::Keep) => None,
            _ => Some(kind),
        };
        if let Some(target) = target {
            if var.kind() != target {
                set_kind(var, target)?;
            }
        }
        if in_bn && batchnorm != BatchNormCast::Cast {
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
