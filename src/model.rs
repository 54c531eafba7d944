//! The model wrapper `initialize` returns: floating inputs go in as the model's dtype,
//! floating outputs come back as fp32 (or `cast_model_outputs`).
use tch::nn::{Module, ModuleT};
use tch::{Kind, Tensor};

use crate::dtype::is_floating;

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
