//! Transformer Engine's delayed scaling: per tensor an amax history and a scale, recorded and
//! updated as TE's `amax_and_scale_update` kernel does (`common/recipe/delayed_scaling.cu`).
use tch::{Device, Kind, Tensor};

use super::config::{AmaxComputeAlgo, DelayedScaling, Float8Dtype};
use crate::error::{mismatch, Result, TorchContext};
use crate::torch_io::{Dict, Key, Node, Value};

const CTX: &str = "float8 delayed scaling";

/// One tensor's state: the amax history (fp32, `[amax_history_len]`, slot 0 the current step)
/// and the scale the next cast uses (fp32, 0-dim; 1 at first, as TE initialises it).
#[derive(Debug)]
pub(crate) struct AmaxState {
    pub history: Tensor,
    pub scale: Tensor,
}

impl AmaxState {
    fn new(len: usize, device: Device) -> Result<Self> {
        Ok(Self {
            history: Tensor::f_zeros([len as i64], (Kind::Float, device)).ctx(CTX)?,
            scale: Tensor::f_ones([], (Kind::Float, device)).ctx(CTX)?,
        })
    }

    /// Adds `x`'s amax to slot 0, as TE's cast kernels do (a running max, so a forward under
    /// no_grad, which updates nothing, adds to the next step's amax). NaN elements are left out
    /// of the amax (TE reduces with `fmaxf`).
    pub fn record(&mut self, x: &Tensor) -> Result<()> {
        let len = self.history.size()[0];
        let amax = x
            .f_abs()
            .and_then(|a| a.f_nan_to_num(0.0, f64::INFINITY, f64::NEG_INFINITY))
            .and_then(|a| a.f_max())
            .and_then(|a| a.f_to_kind(Kind::Float))
            .and_then(|a| a.f_reshape([1]))
            .ctx(CTX)?;
        let first = self.history.f_narrow(0, 0, 1).and_then(|h| h.f_maximum(&amax)).ctx(CTX)?;
        let rest = self.history.f_narrow(0, 1, len - 1).ctx(CTX)?;
        self.history = Tensor::f_cat(&[first, rest], 0).ctx(CTX)?;
        Ok(())
    }

    /// TE's update after a step: when slot 0 holds an amax, the history rolls (slot 0's amax
    /// moves to the end, the oldest entry leaves, slot 0 restarts at 0) and the scale becomes
    /// `fp8_max * 2^-margin / amax` (amax: the largest of the history before the roll, or slot
    /// 0 for `most_recent`), kept as it was when that amax is 0 or not finite, and fp32's largest
    /// value where the division overflows. A tensor that recorded nothing (slot 0 still 0) keeps
    /// its history and scale.
    pub fn update(&mut self, recipe: &DelayedScaling, dtype: Float8Dtype) -> Result<()> {
        let len = self.history.size()[0];
        let device = self.history.device();
        let h = &self.history;
        let last = h.f_select(0, 0).ctx(CTX)?;
        let zero = Tensor::f_zeros([1], (Kind::Float, device)).ctx(CTX)?;
        let rolled = if len == 1 {
            zero.shallow_clone()
        } else {
            let middle = h.f_narrow(0, 2, len - 2).ctx(CTX)?;
            Tensor::f_cat(&[zero.shallow_clone(), middle, h.f_narrow(0, 0, 1).ctx(CTX)?], 0).ctx(CTX)?
        };
        let moved = last.f_ne(0.0).ctx(CTX)?;
        let amax = match recipe.amax_compute_algo {
            AmaxComputeAlgo::Max => h.f_max().ctx(CTX)?,
            AmaxComputeAlgo::MostRecent => last.shallow_clone(),
        };
        let amax = amax.f_where_self(&moved, &zero.f_reshape([]).ctx(CTX)?).ctx(CTX)?;
        let scaled_max = dtype.max() * 2f64.powi(-recipe.margin);
        let candidate = Tensor::f_full([], scaled_max, (Kind::Float, device)).and_then(|m| m.f_div(&amax)).ctx(CTX)?;
        let usable = amax.f_isfinite().and_then(|f| f.f_logical_and(&amax.f_gt(0.0)?)).ctx(CTX)?;
        let scale = candidate.f_where_self(&usable, &self.scale).ctx(CTX)?;
        let big = Tensor::f_full([], f64::from(f32::MAX), (Kind::Float, device)).ctx(CTX)?;
        let scale = big.f_where_self(&scale.f_isinf().ctx(CTX)?, &scale).ctx(CTX)?;
        self.history = rolled.f_where_self(&moved, h).ctx(CTX)?;
        self.scale = scale;
        Ok(())
    }

    fn to_value(&self) -> Value {
        Value::Dict(
            Dict::new()
                .with("amax_history", Value::Tensor(self.history.shallow_clone()))
                .with("scale", Value::Tensor(self.scale.shallow_clone())),
        )
    }

    /// Reads and checks a state saved by [`Self::to_value`]: a history of `len` fp32 values
    /// that are >= 0 or inf, a finite positive fp32 scale; copied to `device`.
    fn from_node(node: Node<'_>, len: usize, device: Device) -> Result<Self> {
        let tensor = |key: &str| -> Result<Tensor> {
            let t = node.get(key).and_then(|n| n.as_tensor()).map_err(|e| mismatch(e.to_string()))?;
            if t.kind() != Kind::Float {
                return Err(mismatch(format!("{}/{key} is {:?}, expected Float", node.path(), t.kind())));
            }
            let mut own = Tensor::f_empty(t.size(), (Kind::Float, device)).ctx(CTX)?;
            own.f_copy_(t).ctx(CTX)?;
            Ok(own)
        };
        let (history, scale) = (tensor("amax_history")?, tensor("scale")?);
        let at = node.path();
        if history.size() != [len as i64] {
            return Err(mismatch(format!("{at}/amax_history has shape {:?}, expected [{len}]", history.size())));
        }
        if scale.dim() != 0 {
            return Err(mismatch(format!("{at}/scale has shape {:?}, expected a 0-dim tensor", scale.size())));
        }
        let bad_history =
            history.f_isnan().and_then(|n| n.f_logical_or(&history.f_lt(0.0)?)).and_then(|b| b.f_any()).ctx(CTX)?;
        if bool::try_from(&bad_history).ctx(CTX)? {
            return Err(mismatch(format!("{at}/amax_history holds NaN or negative values")));
        }
        let s = f64::try_from(&scale).ctx(CTX)?;
        if !(s.is_finite() && s > 0.0) {
            return Err(mismatch(format!("{at}/scale is {s}, expected a finite value > 0")));
        }
        Ok(Self { history, scale })
    }
}

/// A layer's three states (TE's `scaling_fwd` input and weight, `scaling_bwd` grad_output).
#[derive(Debug)]
pub(crate) struct DelayedLayer {
    pub input: AmaxState,
    pub weight: AmaxState,
    pub grad_output: AmaxState,
}

const ROLES: [&str; 3] = ["input", "weight", "grad_output"];

impl DelayedLayer {
    pub fn new(recipe: &DelayedScaling, device: Device) -> Result<Self> {
        let len = recipe.amax_history_len;
        Ok(Self {
            input: AmaxState::new(len, device)?,
            weight: AmaxState::new(len, device)?,
            grad_output: AmaxState::new(len, device)?,
        })
    }

    /// `{"input": {"amax_history", "scale"}, "weight": ..., "grad_output": ...}`.
    pub fn to_value(&self) -> Value {
        let mut d = Dict::new();
        for (role, s) in ROLES.into_iter().zip([&self.input, &self.weight, &self.grad_output]) {
            d.insert(role, s.to_value());
        }
        Value::Dict(d)
    }

    /// Reads what [`Self::to_value`] wrote (checked; keys beyond the three are an error).
    pub fn from_node(node: Node<'_>, recipe: &DelayedScaling, device: Device) -> Result<Self> {
        let entries = node.entries().map_err(|e| mismatch(e.to_string()))?;
        if let Some((key, _)) = entries.iter().find(|(k, _)| !ROLES.iter().any(|r| **k == Key::from(*r))) {
            return Err(mismatch(format!("{}: unexpected key {key}", node.path())));
        }
        let len = recipe.amax_history_len;
        let role = |r: &str| -> Result<AmaxState> {
            let n = node.get(r).map_err(|e| mismatch(e.to_string()))?;
            AmaxState::from_node(n, len, device)
        };
        Ok(Self { input: role("input")?, weight: role("weight")?, grad_output: role("grad_output")? })
    }
}
