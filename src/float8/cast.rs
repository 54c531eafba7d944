//! Casting a tensor to float8 and multiplying float8 operands, as torchao computes them
//! (`float8_utils.py` `amax_to_scale`/`tensor_to_scale`/`to_fp8_saturated`,
//! `float8_ops.py` `preprocess_addmm`/`addmm_float8_unwrapped`), op for op so that the bits
//! match.
use tch::{Kind, Tensor};

use super::config::{Cast, Float8Dtype};
use crate::error::{Result, TorchContext};

/// torchao's `EPS`: the smallest amax a scale is computed from.
const EPS: f64 = 1e-12;
const CTX: &str = "float8 cast";

/// One GEMM operand: float8 data with its scale (the factor that took it to float8), or a
/// high-precision tensor (`scale` None). `axis` is the dimension an axiswise scale reduced
/// (0 or -1), None for a tensorwise scale (torchao's `Float8TrainingTensor`).
#[derive(Debug)]
pub(crate) struct Operand {
    pub data: Tensor,
    pub scale: Option<Tensor>,
    pub axis: Option<i64>,
}

impl Operand {
    /// torchao's `float8_transpose`: the data transposed, an axiswise scale too.
    pub fn t(&self) -> Result<Operand> {
        let scale = match &self.scale {
            Some(s) if s.dim() > 1 => Some(s.f_tr().ctx(CTX)?),
            other => other.as_ref().map(Tensor::shallow_clone),
        };
        let axis = self.axis.map(|a| if a == 0 { -1 } else { 0 });
        Ok(Operand { data: self.data.f_tr().ctx(CTX)?, scale, axis })
    }
}

/// torchao's `amax_to_scale`: `fp8_max / max(amax, EPS)` in fp64, then fp32; rounded down to a
/// power of two when `pow2`. (Python's `float / tensor` is `tensor.reciprocal() * float`.)
pub(crate) fn amax_to_scale(amax: &Tensor, dtype: Float8Dtype, pow2: bool) -> Result<Tensor> {
    let scale = amax
        .f_to_kind(Kind::Double)
        .and_then(|a| a.f_clamp_min(EPS))
        .and_then(|a| a.f_reciprocal())
        .and_then(|r| r.f_mul_scalar(dtype.max()))
        .and_then(|r| r.f_to_kind(Kind::Float))
        .ctx(CTX)?;
    if pow2 {
        scale.f_log2().and_then(|l| l.f_floor()).and_then(|f| f.f_exp2()).ctx(CTX)
    } else {
        Ok(scale)
    }
}

/// torchao's `tensor_to_amax`: `max(|x|)`, or along `axis` (kept) for an axiswise scale.
fn tensor_to_amax(x: &Tensor, axis: Option<i64>) -> Result<Tensor> {
    let abs = x.f_abs().ctx(CTX)?;
    match axis {
        None => abs.f_max().ctx(CTX),
        Some(a) => abs.f_amax([a], true).ctx(CTX),
    }
}

/// torchao's `to_fp8_saturated(x.to(float32) * scale)`: scaled in fp32, clamped to the type's
/// range, rounded to float8.
pub(crate) fn quantize(x: &Tensor, scale: &Tensor, dtype: Float8Dtype) -> Result<Tensor> {
    x.f_to_kind(Kind::Float)
        .and_then(|x| x.f_mul(scale))
        .and_then(|s| s.f_clamp(-dtype.max(), dtype.max()))
        .and_then(|s| s.f_to_kind(dtype.kind()))
        .ctx(CTX)
}

/// torchao's `hp_tensor_to_float8_dynamic`, or the tensor itself for a disabled cast. `axis` is
/// the dimension an axiswise scale reduces.
pub(crate) fn cast(x: &Tensor, how: Cast, axis: i64, pow2: bool) -> Result<Operand> {
    match how {
        Cast::Disabled => Ok(Operand { data: x.shallow_clone(), scale: None, axis: None }),
        Cast::Dynamic { dtype, axiswise } => {
            let axis = axiswise.then_some(axis);
            let scale = amax_to_scale(&tensor_to_amax(x, axis)?, dtype, pow2)?;
            let data = quantize(x, &scale, dtype)?;
            Ok(Operand { data, scale: Some(scale), axis })
        }
    }
}

/// A cast with a given scale (delayed scaling): tensorwise.
pub(crate) fn cast_with(x: &Tensor, scale: &Tensor, dtype: Float8Dtype) -> Result<Operand> {
    Ok(Operand { data: quantize(x, scale, dtype)?, scale: Some(scale.shallow_clone()), axis: None })
}

fn is_row_major(t: &Tensor) -> bool {
    let s = t.stride();
    s.len() == 2 && s[0] > s[1] && s[1] == 1
}

/// torchao's `pad_tensor_for_matmul`: zeros up to a multiple of 16 along `dim` (0 or 1).
fn pad16(t: &Tensor, dim: usize) -> Result<Tensor> {
    let size = t.size()[dim];
    let extra = (16 - size % 16) % 16;
    let pad = if dim == 1 { [0, extra, 0, 0] } else { [0, 0, 0, extra] };
    t.f_constant_pad_nd(pad).ctx(CTX)
}

/// How a GEMM runs: its output dtype and torchao's per-GEMM options.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gemm {
    pub out: Kind,
    pub fast_accum: bool,
    pub emulate: bool,
    pub pad_inner_dim: bool,
}

/// `a @ b` as torchao's `float8_mm` computes it: `torch.mm` for high-precision operands;
/// emulated in fp32; or `_scaled_mm` with inverse scales (row-major `a`, column-major `b`), a
/// tensorwise scale repeated when the other operand is axiswise, and for axiswise operands
/// without fast accumulation the scales applied after a tensorwise GEMM; axiswise GEMMs whose
/// output is fp32/fp16 run to bf16 and are cast (`_scaled_mm` has no such output there).
pub(crate) fn mm(a: &Operand, b: &Operand, gemm: Gemm) -> Result<Tensor> {
    const MM: &str = "float8 GEMM";
    let (a_scale, b_scale) = match (&a.scale, &b.scale) {
        (Some(x), Some(y)) => (x, y),
        _ => return a.data.f_mm(&b.data).ctx(MM),
    };
    if gemm.emulate {
        let deq = |o: &Operand, s: &Tensor| o.data.f_to_kind(Kind::Float).and_then(|d| d.f_div(s));
        return deq(a, a_scale)
            .and_then(|x| Ok((x, deq(b, b_scale)?)))
            .and_then(|(x, y)| x.f_mm(&y))
            .and_then(|o| o.f_to_kind(gemm.out))
            .ctx(MM);
    }
    let (mut ad, mut bd) = (a.data.shallow_clone(), b.data.shallow_clone());
    if gemm.pad_inner_dim {
        ad = pad16(&ad, 1)?;
        bd = pad16(&bd, 0)?;
    }
    if !is_row_major(&ad) {
        ad = ad.f_contiguous().ctx(MM)?;
    }
    if is_row_major(&bd) {
        bd = bd.f_tr().and_then(|t| t.f_contiguous()).and_then(|t| t.f_tr()).ctx(MM)?;
    }
    let (mut asc, mut bsc) = (a_scale.shallow_clone(), b_scale.shallow_clone());
    if a.axis.is_none() && b.axis.is_some() {
        asc = asc.f_repeat([ad.size()[0]]).and_then(|s| s.f_reshape([-1, 1])).ctx(MM)?;
    } else if a.axis.is_some() && b.axis.is_none() {
        bsc = bsc.f_repeat([bd.size()[1]]).and_then(|s| s.f_reshape([1, -1])).ctx(MM)?;
    }
    let rowwise = asc.size() == [ad.size()[0], 1] && bsc.size() == [1, bd.size()[1]];
    let mut a_inv = asc.f_reciprocal().ctx(MM)?;
    let mut b_inv = bsc.f_reciprocal().ctx(MM)?;
    let mut post = None;
    if rowwise && !gemm.fast_accum {
        post = Some(a_inv.f_mul(&b_inv).ctx(MM)?);
        let one = Tensor::f_ones([], (a_inv.kind(), a_inv.device())).ctx(MM)?;
        a_inv = one.shallow_clone();
        b_inv = one;
    }
    let out = if rowwise && matches!(gemm.out, Kind::Half | Kind::Float) { Kind::BFloat16 } else { gemm.out };
    let mut o = ad.f_internal_scaled_mm::<Tensor>(&bd, &a_inv, &b_inv, None, None, out, gemm.fast_accum).ctx(MM)?;
    if let Some(p) = post {
        o = o.f_mul_(&p).ctx(MM)?;
    }
    if out != gemm.out {
        o = o.f_to_kind(gemm.out).ctx(MM)?;
    }
    Ok(o)
}
