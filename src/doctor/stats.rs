//! The statistics of one tensor of the target run against the same tensor of the fp32 run,
//! computed on the tensors' device and read back in one transfer, and how they add up over an
//! op's outputs and over a module's ops.
use tch::{Device, Kind, Tensor};

use super::report::{Fp32Comparison, TensorStats};
use crate::dtype::{dtype_name, DtypeRange};
use crate::error::{Result, TorchContext};

/// Exponent bins of [`exponent_histogram`]: `floor(log2 |x|)` from `HIST_MIN` to `HIST_MAX`.
pub(crate) const HIST_MIN: i64 = -160;
/// See [`HIST_MIN`].
pub(crate) const HIST_MAX: i64 = 130;
const HIST_BINS: i64 = HIST_MAX - HIST_MIN + 1;

/// Statistics that add up: one tensor's, an op's outputs', a module's.
#[derive(Debug, Clone)]
pub(crate) struct Acc {
    dtype: Option<Kind>,
    mixed: bool,
    // Measured against a 16-bit range.
    low: bool,
    numel: u64,
    max_abs: f64,
    min_nonzero: f64,
    non_finite: u64,
    zeros: u64,
    subnormal: u64,
    compared: bool,
    ref_max: f64,
    ref_min: f64,
    ref_nonzero: u64,
    ref_non_finite: u64,
    overflow: u64,
    underflow: u64,
    ref_subnormal: u64,
    flushed: u64,
    err_sq: f64,
    ref_sq: f64,
    // A module's: the largest relative error among its ops (replaces the sums' ratio).
    worst: Option<f64>,
}

impl Default for Acc {
    fn default() -> Self {
        Self {
            dtype: None,
            mixed: false,
            low: false,
            numel: 0,
            max_abs: 0.0,
            min_nonzero: f64::INFINITY,
            non_finite: 0,
            zeros: 0,
            subnormal: 0,
            compared: false,
            ref_max: 0.0,
            ref_min: f64::INFINITY,
            ref_nonzero: 0,
            ref_non_finite: 0,
            overflow: 0,
            underflow: 0,
            ref_subnormal: 0,
            flushed: 0,
            err_sq: 0.0,
            ref_sq: 0.0,
            worst: None,
        }
    }
}

/// The larger of two relative errors, a non-finite one being the largest.
fn worse(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(_)) if !x.is_finite() => Some(x),
        (Some(_), Some(y)) if !y.is_finite() => Some(y),
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

impl Acc {
    /// Adds another tensor of the same op (its other outputs, or gradients).
    pub(crate) fn add(&mut self, o: &Acc) {
        self.add_counts(o);
        self.err_sq += o.err_sq;
        self.ref_sq += o.ref_sq;
    }

    /// Adds another op's statistics to a module's: counts add up, the relative error is the
    /// largest of the ops'.
    pub(crate) fn absorb(&mut self, o: &Acc) {
        let worst = worse(self.relative(), o.relative());
        self.add_counts(o);
        self.worst = worst;
    }

    fn add_counts(&mut self, o: &Acc) {
        match (self.dtype, o.dtype) {
            (None, d) => self.dtype = d,
            (Some(a), Some(b)) if a != b => self.mixed = true,
            _ => {}
        }
        self.mixed |= o.mixed;
        self.low |= o.low;
        self.numel += o.numel;
        self.max_abs = self.max_abs.max(o.max_abs);
        self.min_nonzero = self.min_nonzero.min(o.min_nonzero);
        self.non_finite += o.non_finite;
        self.zeros += o.zeros;
        self.subnormal += o.subnormal;
        self.compared |= o.compared;
        self.ref_max = self.ref_max.max(o.ref_max);
        self.ref_min = self.ref_min.min(o.ref_min);
        self.ref_nonzero += o.ref_nonzero;
        self.ref_non_finite += o.ref_non_finite;
        self.overflow += o.overflow;
        self.underflow += o.underflow;
        self.ref_subnormal += o.ref_subnormal;
        self.flushed += o.flushed;
    }

    /// ‖target − fp32‖ / ‖fp32‖, or a module's largest.
    pub(crate) fn relative(&self) -> Option<f64> {
        if self.worst.is_some() {
            return self.worst;
        }
        if !self.compared || (self.ref_sq == 0.0 && self.err_sq == 0.0) {
            return None;
        }
        if self.ref_sq == 0.0 {
            return Some(f64::INFINITY);
        }
        Some((self.err_sq / self.ref_sq).sqrt())
    }

    /// Whether these values were measured against a 16-bit range (held, or computed, in one).
    pub(crate) fn low_precision(&self) -> bool {
        self.low
    }

    /// Values that are inf or NaN in the target run.
    pub(crate) fn non_finite(&self) -> u64 {
        self.non_finite
    }

    /// The largest finite |x| of the fp32 run (scaled as the target's).
    pub(crate) fn fp32_max_abs(&self) -> f64 {
        self.ref_max
    }

    /// The public form.
    pub(crate) fn stats(&self) -> TensorStats {
        let finite = |x: f64| Some(x).filter(|v| v.is_finite());
        TensorStats {
            dtype: if self.mixed { "mixed".into() } else { self.dtype.map_or_else(|| "-".into(), dtype_name) },
            numel: self.numel,
            max_abs: self.max_abs,
            min_nonzero_abs: finite(self.min_nonzero),
            non_finite: self.non_finite,
            zeros: self.zeros,
            subnormal: self.subnormal,
            fp32: self.compared.then(|| Fp32Comparison {
                max_abs: self.ref_max,
                min_nonzero_abs: finite(self.ref_min),
                nonzero: self.ref_nonzero,
                non_finite: self.ref_non_finite,
                overflow: self.overflow,
                underflow: self.underflow,
                subnormal: self.ref_subnormal,
                flushed: self.flushed,
                relative_error: self.relative(),
            }),
        }
    }
}

/// Scalars computed on the device, read back together.
struct Reads {
    values: Vec<Tensor>,
}

impl Reads {
    fn push(&mut self, t: std::result::Result<Tensor, tch::TchError>) -> Result<()> {
        self.values.push(t.and_then(|t| t.f_to_kind(Kind::Double)).ctx("doctor statistics")?);
        Ok(())
    }

    fn read(self) -> Result<Vec<f64>> {
        if self.values.is_empty() {
            return Ok(Vec::new());
        }
        let all = Tensor::f_stack(&self.values, 0)
            .and_then(|t| t.f_to_device(Device::Cpu))
            .ctx("reading doctor statistics")?;
        Vec::<f64>::try_from(&all).ctx("reading doctor statistics")
    }
}

/// The statistics of `target` (as held in the target run, gradients at `scale`) and, when the
/// fp32 run has the same tensor, of `fp32` (unscaled) against it. Shapes must match for the
/// comparison; a mismatch compares nothing. Overflow, underflow and subnormals are counted for
/// `range` (default: the range of `target`'s dtype when it is 16-bit).
pub(crate) fn measure(target: &Tensor, fp32: Option<&Tensor>, scale: f64, range: Option<DtypeRange>) -> Result<Acc> {
    let kind = target.kind();
    let calc = if kind == Kind::Double { Kind::Double } else { Kind::Float };
    let range = range.or_else(|| DtypeRange::of(kind));
    let fp32 = fp32.filter(|r| r.size() == target.size());
    let x = target.f_to_kind(calc).ctx("doctor statistics")?;
    let a = x.f_abs().ctx("doctor statistics")?;
    let finite = a.f_isfinite().ctx("doctor statistics")?;
    let a0 = finite.f_logical_not().and_then(|bad| a.f_masked_fill(&bad, 0.0)).ctx("doctor statistics")?;
    let mut q = Reads { values: Vec::with_capacity(20) };
    q.push(finite.f_logical_not().and_then(|b| b.f_sum(Kind::Double)))?;
    q.push(a0.f_max())?;
    q.push(a0.f_eq(0.0).and_then(|z| a0.f_masked_fill(&z, f64::INFINITY)).and_then(|m| m.f_min()))?;
    q.push(x.f_eq(0.0).and_then(|z| z.f_sum(Kind::Double)))?;
    if let Some(r) = range {
        q.push(
            a0.f_gt(0.0).and_then(|p| p.f_logical_and(&a0.f_lt(r.min_normal)?)).and_then(|s| s.f_sum(Kind::Double)),
        )?;
    }
    if let Some(reference) = fp32 {
        let rx = reference.f_to_kind(calc).ctx("doctor statistics")?;
        let ra = rx.f_abs().ctx("doctor statistics")?;
        let rfinite = ra.f_isfinite().ctx("doctor statistics")?;
        let ra0 = rfinite.f_logical_not().and_then(|bad| ra.f_masked_fill(&bad, 0.0)).ctx("doctor statistics")?;
        let nonzero = ra0.f_gt(0.0).ctx("doctor statistics")?;
        q.push(rfinite.f_logical_not().and_then(|b| b.f_sum(Kind::Double)))?;
        q.push(ra0.f_max())?;
        q.push(ra0.f_eq(0.0).and_then(|z| ra0.f_masked_fill(&z, f64::INFINITY)).and_then(|m| m.f_min()))?;
        q.push(nonzero.f_sum(Kind::Double))?;
        if let Some(r) = range {
            // The fp32 values as the target holds them: times the loss scale.
            let v = ra0.f_mul_scalar(scale).ctx("doctor statistics")?;
            q.push(v.f_ge(r.overflow_at).and_then(|o| o.f_sum(Kind::Double)))?;
            q.push(nonzero.f_logical_and(&v.f_le(r.zero_at)?).and_then(|s| s.f_sum(Kind::Double)))?;
            q.push(
                v.f_gt(r.zero_at)
                    .and_then(|s| s.f_logical_and(&v.f_lt(r.subnormal_below)?))
                    .and_then(|s| s.f_sum(Kind::Double)),
            )?;
            q.push(
                x.f_eq(0.0)
                    .and_then(|z| z.f_logical_and(&nonzero))
                    .and_then(|z| z.f_logical_and(&v.f_lt(r.min_normal)?))
                    .and_then(|s| s.f_sum(Kind::Double)),
            )?;
        }
        let xd = x.f_to_kind(Kind::Double).and_then(|t| t.f_div_scalar(scale)).ctx("doctor statistics")?;
        let rd = rx.f_to_kind(Kind::Double).ctx("doctor statistics")?;
        q.push(xd.f_sub(&rd).and_then(|d| d.f_square()).and_then(|d| d.f_sum(Kind::Double)))?;
        q.push(rd.f_square().and_then(|d| d.f_sum(Kind::Double)))?;
    }
    let v = q.read()?;
    let mut it = v.into_iter();
    let mut next = || it.next().unwrap_or(0.0);
    let count = |x: f64| x.max(0.0) as u64;
    let mut acc = Acc { dtype: Some(kind), low: range.is_some(), numel: target.numel() as u64, ..Acc::default() };
    acc.non_finite = count(next());
    acc.max_abs = next();
    acc.min_nonzero = next();
    acc.zeros = count(next());
    if range.is_some() {
        acc.subnormal = count(next());
    }
    if fp32.is_some() {
        acc.compared = true;
        acc.ref_non_finite = count(next());
        acc.ref_max = next() * scale;
        acc.ref_min = next() * scale;
        acc.ref_nonzero = count(next());
        if range.is_some() {
            acc.overflow = count(next());
            acc.underflow = count(next());
            acc.ref_subnormal = count(next());
            acc.flushed = count(next());
        }
        acc.err_sq = next();
        acc.ref_sq = next();
    }
    Ok(acc)
}

/// How many of `values`' non-zero finite elements have each binary exponent
/// `floor(log2 |x|)`, from [`HIST_MIN`] to [`HIST_MAX`] (clamped).
pub(crate) fn exponent_histogram(values: &Tensor) -> Result<Vec<u64>> {
    let calc = if values.kind() == Kind::Double { Kind::Double } else { Kind::Float };
    let a = values.f_to_kind(calc).and_then(|t| t.f_abs()).ctx("doctor histogram")?;
    let keep = a.f_isfinite().and_then(|f| f.f_logical_and(&a.f_gt(0.0)?)).ctx("doctor histogram")?;
    let e = a
        .f_masked_select(&keep)
        .and_then(|t| t.f_log2())
        .and_then(|t| t.f_floor())
        .and_then(|t| t.f_clamp(HIST_MIN as f64, HIST_MAX as f64))
        .and_then(|t| t.f_sub_scalar(HIST_MIN as f64))
        .and_then(|t| t.f_to_kind(Kind::Int64))
        .ctx("doctor histogram")?;
    let counts =
        e.f_bincount(None::<Tensor>, HIST_BINS).and_then(|t| t.f_to_device(Device::Cpu)).ctx("doctor histogram")?;
    Ok(Vec::<i64>::try_from(&counts).ctx("doctor histogram")?.into_iter().map(|c| c.max(0) as u64).collect())
}

/// Adds histogram `b` into `a`.
pub(crate) fn add_histogram(a: &mut Vec<u64>, b: &[u64]) {
    if a.len() < b.len() {
        a.resize(b.len(), 0);
    }
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}
