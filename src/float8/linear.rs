//! The float8 linear layer: torchao's `Float8Linear` forward and its autograd function
//! (`matmul_with_hp_or_float8_args`), with Transformer Engine's delayed scaling as an option.
use std::sync::{Arc, Mutex, MutexGuard};

use tch::nn::Module;
use tch::{Device, Kind, Tensor};

use super::cast::{cast, cast_with, mm, Gemm, Operand};
use super::config::{Cast, Resolved};
use super::delayed::DelayedLayer;
use crate::cast::disable::disable_casts;
use crate::cast::scope::autocast_state;
use crate::error::{AmpError, Result, TorchContext};
use crate::sys::autograd::{custom_function, BackwardArgs};

const CTX: &str = "float8 linear";

/// The scales of a layer's last forward and backward: for each operand of each GEMM the scale
/// that took it to float8 (fp32; 0-dim for a tensorwise scale, one per row or column for an
/// axiswise one), `None` for an operand left in high precision or not computed (the
/// grad_input GEMM of the first layer, whose input needs no gradient).
#[derive(Debug, Default)]
pub struct Float8Scales {
    /// `input` in the output GEMM.
    pub input: Option<Tensor>,
    /// `weight` in the output GEMM.
    pub weight: Option<Tensor>,
    /// `grad_output` in the grad_input GEMM.
    pub grad_output: Option<Tensor>,
    /// `weight` in the grad_input GEMM.
    pub weight_for_grad_input: Option<Tensor>,
    /// `grad_output` in the grad_weight GEMM.
    pub grad_output_for_grad_weight: Option<Tensor>,
    /// `input` in the grad_weight GEMM.
    pub input_for_grad_weight: Option<Tensor>,
}

impl Clone for Float8Scales {
    fn clone(&self) -> Self {
        let c = |t: &Option<Tensor>| t.as_ref().map(Tensor::shallow_clone);
        Self {
            input: c(&self.input),
            weight: c(&self.weight),
            grad_output: c(&self.grad_output),
            weight_for_grad_input: c(&self.weight_for_grad_input),
            grad_output_for_grad_weight: c(&self.grad_output_for_grad_weight),
            input_for_grad_weight: c(&self.input_for_grad_weight),
        }
    }
}

/// One converted layer: its name, config, delayed-scaling state and last scales.
#[derive(Debug)]
pub(crate) struct Layer {
    pub name: String,
    pub config: Resolved,
    pub delayed: Option<Mutex<DelayedLayer>>,
    pub last: Mutex<Float8Scales>,
}

/// Locks a mutex, recovering the data of one a panic poisoned (the state is replaced whole, so
/// it is never half-written).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn scale_of(o: &Operand) -> Option<Tensor> {
    o.scale.as_ref().map(Tensor::shallow_clone)
}

impl Layer {
    fn gemm(&self, out: Kind, fast_accum: bool) -> Gemm {
        Gemm { out, fast_accum, emulate: self.config.emulate, pad_inner_dim: self.config.pad_inner_dim }
    }

    fn dtype(how: Cast) -> Result<super::config::Float8Dtype> {
        match how {
            Cast::Dynamic { dtype, .. } => Ok(dtype),
            Cast::Disabled => Err(AmpError::torch(CTX, "delayed scaling needs float8 casts")),
        }
    }

    /// `x2 @ w.T` for a 2-D input; returns the output and the tensors the backward needs.
    fn forward_2d(&self, x2: &Tensor, w: &Tensor, out: Kind, grad: bool) -> Result<(Tensor, Vec<Tensor>)> {
        let c = &self.config;
        let gemm = self.gemm(out, c.fast_accum_output);
        let Some(delayed) = &self.delayed else {
            let input = cast(x2, c.input, -1, c.pow2)?;
            let weight_t = cast(&w.f_tr().ctx(CTX)?, c.weight, 0, c.pow2)?;
            let y = mm(&input, &weight_t, gemm)?;
            let mut last = lock(&self.last);
            last.input = scale_of(&input);
            last.weight = scale_of(&weight_t);
            return Ok((y, vec![x2.shallow_clone(), w.shallow_clone()]));
        };
        let recipe = c.delayed.as_ref().ok_or_else(|| AmpError::torch(CTX, "delayed state without a recipe"))?;
        let mut st = lock(delayed);
        let input = cast_with(x2, &st.input.scale, Self::dtype(c.input)?)?;
        st.input.record(x2)?;
        let weight = cast_with(w, &st.weight.scale, Self::dtype(c.weight)?)?;
        st.weight.record(w)?;
        let y = mm(&input, &weight.t()?, gemm)?;
        if grad {
            st.input.update(recipe, Self::dtype(c.input)?)?;
            st.weight.update(recipe, Self::dtype(c.weight)?)?;
        }
        let mut last = lock(&self.last);
        last.input = scale_of(&input);
        last.weight = scale_of(&weight);
        let (Some(si), Some(sw)) = (input.scale, weight.scale) else {
            return Err(AmpError::torch(CTX, "delayed casts without scales"));
        };
        Ok((y, vec![input.data, si, weight.data, sw]))
    }

    /// The gradients of the 2-D input and of the weight, as torchao's backward computes them
    /// (or with the forward's float8 tensors under delayed scaling).
    fn backward(&self, args: BackwardArgs) -> Result<Vec<Option<Tensor>>> {
        let c = &self.config;
        let go = match args.grads.first() {
            Some(Some(g)) => g.shallow_clone(),
            _ => return Ok(vec![None, None]),
        };
        let needs = |i: usize| args.needs_input_grad.get(i).copied().unwrap_or(false);
        let saved = &args.saved;
        let _off = disable_casts()?;
        let gi_gemm = self.gemm(go.kind(), c.fast_accum_grad_input);
        let gw_gemm = self.gemm(go.kind(), c.fast_accum_grad_weight);
        let (mut grad_input, mut grad_weight) = (None, None);
        let mut scales = Float8Scales::default();
        if let Some(delayed) = &self.delayed {
            let recipe = c.delayed.as_ref().ok_or_else(|| AmpError::torch(CTX, "delayed state without a recipe"))?;
            let [x, sx, w, sw] = saved.as_slice() else {
                return Err(AmpError::torch(CTX, "unexpected saved tensors"));
            };
            let mut st = lock(delayed);
            let g = cast_with(&go, &st.grad_output.scale, Self::dtype(c.grad_output)?)?;
            st.grad_output.record(&go)?;
            if needs(0) {
                let w = Operand { data: w.shallow_clone(), scale: Some(sw.shallow_clone()), axis: None };
                grad_input = Some(mm(&g, &w, gi_gemm)?);
                scales.grad_output = scale_of(&g);
                scales.weight_for_grad_input = Some(sw.shallow_clone());
            }
            if needs(1) {
                let x = Operand { data: x.shallow_clone(), scale: Some(sx.shallow_clone()), axis: None };
                grad_weight = Some(mm(&g.t()?, &x, gw_gemm)?);
                scales.grad_output_for_grad_weight = scale_of(&g);
                scales.input_for_grad_weight = Some(sx.shallow_clone());
            }
            st.grad_output.update(recipe, Self::dtype(c.grad_output)?)?;
        } else {
            let [x, w] = saved.as_slice() else {
                return Err(AmpError::torch(CTX, "unexpected saved tensors"));
            };
            if needs(0) {
                let g = cast(&go, c.grad_output, -1, c.pow2)?;
                let w_t = cast(&w.f_tr().ctx(CTX)?, c.weight_for_grad_input, -1, c.pow2)?;
                grad_input = Some(mm(&g, &w_t.t()?, gi_gemm)?);
                scales.grad_output = scale_of(&g);
                scales.weight_for_grad_input = scale_of(&w_t);
            }
            if needs(1) {
                let g = cast(&go, c.grad_output_for_grad_weight, 0, c.pow2)?;
                let x = cast(x, c.input_for_grad_weight, 0, c.pow2)?;
                grad_weight = Some(mm(&g.t()?, &x, gw_gemm)?);
                scales.grad_output_for_grad_weight = scale_of(&g);
                scales.input_for_grad_weight = scale_of(&x);
            }
        }
        let mut last = lock(&self.last);
        last.grad_output = scales.grad_output;
        last.weight_for_grad_input = scales.weight_for_grad_input;
        last.grad_output_for_grad_weight = scales.grad_output_for_grad_weight;
        last.input_for_grad_weight = scales.input_for_grad_weight;
        Ok(vec![grad_input, grad_weight])
    }
}

/// The autocast state of `device`'s type (CPU or CUDA; others have none).
fn autocast_of(device: Device) -> Result<Option<Kind>> {
    if !matches!(device, Device::Cpu | Device::Cuda(_)) {
        return Ok(None);
    }
    let st = autocast_state(device)?;
    Ok(st.enabled.then_some(st.dtype))
}

/// The float8 forward of `layer`: `x @ w.T + b` with the GEMMs in float8 (see
/// [`Float8Linear`]).
fn forward(layer: &Arc<Layer>, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let mut x = x.shallow_clone();
    // torchao's Float8Linear casts the input to CUDA autocast's dtype (only CUDA's).
    if x.device().is_cuda() {
        if let Some(kind) = autocast_of(x.device())? {
            x = x.f_to_kind(kind).ctx(CTX)?;
        }
    }
    // Under autocast the output GEMM returns autocast's dtype, as torchao's `mm` on float8
    // tensors does after autocast recasts them.
    let out = autocast_of(x.device())?.unwrap_or(x.kind());
    let size = x.size();
    let (Some(&k), [lead @ .., _]) = (size.last(), size.as_slice()) else {
        return Err(AmpError::torch(CTX, format!("a float8 linear needs an input with dimensions, got {size:?}")));
    };
    let x2 = x.f_reshape([-1, k]).ctx(CTX)?;
    let grad = crate::sys::distributed::grad_mode_enabled().map_err(|m| AmpError::torch(CTX, m))?;
    let fp8_output_gemm = layer.config.input != Cast::Disabled;
    let (y2, saved) = {
        let _off = if fp8_output_gemm { Some(disable_casts()?) } else { None };
        let _no_grad = tch::no_grad_guard();
        layer.forward_2d(&x2, w, out, grad)?
    };
    let me = Arc::clone(layer);
    let y2 = custom_function(&[&x2, w], &[y2], &saved, Box::new(move |args| me.backward(args)))?
        .pop()
        .ok_or_else(|| AmpError::torch(CTX, "no output"))?;
    let mut shape = lead.to_vec();
    shape.push(y2.size()[1]);
    let y = y2.f_reshape(shape.as_slice()).ctx(CTX)?;
    match b {
        Some(b) => y.f_add(&b.f_to_kind(y.kind()).ctx(CTX)?).ctx(CTX),
        None => Ok(y),
    }
}

/// A linear layer (tch's `nn::Linear`: `ws` `[out, in]`, `bs` `[out]`) that trains in float8
/// when converted (torchao's `Float8Linear`), and runs as `nn::Linear` otherwise. Made by
/// [`super::Float8Training::linear`] or [`super::Float8Training::convert`].
///
/// Converted, its forward casts the input and the weight to float8 and multiplies them with
/// `_scaled_mm` (inverse scales, fp32 accumulation), the output in the input's dtype (in
/// autocast's under autocast); its backward casts the output gradient and runs the grad_input
/// and grad_weight GEMMs in float8 too; the bias is added in high precision. The weight stays
/// in its own dtype: float8 copies exist only inside the GEMMs.
#[derive(Debug)]
pub struct Float8Linear {
    /// The weight, `[out_features, in_features]`.
    pub ws: Tensor,
    /// The bias, `[out_features]`.
    pub bs: Option<Tensor>,
    name: String,
    layer: Option<Arc<Layer>>,
}

impl Float8Linear {
    pub(crate) fn new(name: String, ws: Tensor, bs: Option<Tensor>, layer: Option<Arc<Layer>>) -> Self {
        Self { ws, bs, name, layer }
    }

    /// The layer's VarStore path (`blocks.0.attn.q`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the layer trains in float8 (else it is a plain linear layer).
    pub fn is_float8(&self) -> bool {
        self.layer.is_some()
    }

    /// The forward pass: `xs @ ws.T + bs` over the last dimension of `xs`.
    ///
    /// # Errors
    /// [`AmpError::Torch`] when libtorch refuses (an input whose last dimension is not
    /// `in_features`, a dtype `_scaled_mm` does not take).
    pub fn f_forward(&self, xs: &Tensor) -> Result<Tensor> {
        match &self.layer {
            Some(layer) => forward(layer, xs, &self.ws, self.bs.as_ref()),
            None => xs.f_linear(&self.ws, self.bs.as_ref()).ctx(CTX),
        }
    }
}

impl Module for Float8Linear {
    /// [`Float8Linear::f_forward`], panicking on error as tch's modules do.
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.f_forward(xs).unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }
}
