//! The statistics of one tensor of the target run against the same tensor of the fp32 run,
//! computed in one pass on the host (the tensors are copied there), and how they add up over an
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

/// A tensor's values on the host, in the precision the statistics are computed in: fp32, or
/// fp64 for fp64 tensors (16-bit values widen exactly to fp32).
enum Host {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Host {
    fn of(t: &Tensor, what: &'static str) -> Result<Self> {
        let flat = t.f_detach().and_then(|t| t.f_to_device(Device::Cpu)).and_then(|t| t.f_reshape([-1])).ctx(what)?;
        Ok(if t.kind() == Kind::Double {
            Host::F64(Vec::<f64>::try_from(&flat).ctx(what)?)
        } else {
            Host::F32(Vec::<f32>::try_from(&flat.f_to_kind(Kind::Float).ctx(what)?).ctx(what)?)
        })
    }
}

/// An element type the statistics are computed in.
trait Elem: Copy {
    fn wide(self) -> f64;
    /// `|x| * scale` rounded in this type (a tensor times a scalar rounds in the tensor's
    /// precision).
    fn scaled(abs: f64, scale: f64) -> f64;
}

impl Elem for f32 {
    fn wide(self) -> f64 {
        f64::from(self)
    }
    fn scaled(abs: f64, scale: f64) -> f64 {
        f64::from(abs as f32 * scale as f32)
    }
}

impl Elem for f64 {
    fn wide(self) -> f64 {
        self
    }
    fn scaled(abs: f64, scale: f64) -> f64 {
        abs * scale
    }
}

/// `|x|` for a finite `x`, 0 for inf and NaN.
fn finite_abs(x: f64) -> f64 {
    if x.is_finite() {
        x.abs()
    } else {
        0.0
    }
}

/// The statistics of `target` (as held in the target run, gradients at `scale`) and, when the
/// fp32 run has the same tensor, of `fp32` (unscaled) against it, in one pass over both on the
/// host. Shapes must match for the comparison; a mismatch compares nothing. Overflow,
/// underflow and subnormals are counted for `range` (default: the range of `target`'s dtype when
/// it is 16-bit); the range's thresholds are exact in fp32, so comparing in fp64 counts as fp32
/// does.
pub(crate) fn measure(target: &Tensor, fp32: Option<&Tensor>, scale: f64, range: Option<DtypeRange>) -> Result<Acc> {
    let kind = target.kind();
    let range = range.or_else(|| DtypeRange::of(kind));
    let fp32 = fp32.filter(|r| r.size() == target.size());
    let x = Host::of(target, "doctor statistics")?;
    let reference = fp32.map(|r| Host::of(r, "doctor statistics")).transpose()?;
    let mut acc = Acc { dtype: Some(kind), low: range.is_some(), numel: target.numel() as u64, ..Acc::default() };
    let bits = F32Bits::new(range, scale);
    match (&x, &reference, &bits) {
        (Host::F32(x), None, Some(t)) => scan_f32(&mut acc, x, None, t),
        (Host::F32(x), Some(Host::F32(r)), Some(t)) => scan_f32(&mut acc, x, Some(r), t),
        (Host::F32(x), None, _) => scan::<f32>(&mut acc, x, None, scale, range),
        (Host::F32(x), Some(Host::F32(r)), _) => scan(&mut acc, x, Some(r), scale, range),
        (Host::F64(x), None, _) => scan::<f64>(&mut acc, x, None, scale, range),
        (Host::F64(x), Some(Host::F64(r)), _) => scan(&mut acc, x, Some(r), scale, range),
        // Same shapes, other precisions (an fp64 tensor against an fp32 one): compared in fp64.
        (x, Some(r), _) => {
            let wide = |h: &Host| match h {
                Host::F32(v) => v.iter().map(|&e| f64::from(e)).collect::<Vec<f64>>(),
                Host::F64(v) => v.clone(),
            };
            scan(&mut acc, &wide(x), Some(&wide(r)), scale, range)
        }
    }
    Ok(acc)
}

/// [`measure`]'s pass over the host values.
fn scan<T: Elem>(acc: &mut Acc, x: &[T], reference: Option<&[T]>, scale: f64, range: Option<DtypeRange>) {
    // Without a range nothing counts as subnormal: no magnitude is below 0.
    let min_normal = range.map_or(0.0, |r| r.min_normal);
    for &xi in x {
        let xi = xi.wide();
        let a = finite_abs(xi);
        acc.non_finite += u64::from(!xi.is_finite());
        acc.max_abs = acc.max_abs.max(a);
        if a > 0.0 {
            acc.min_nonzero = acc.min_nonzero.min(a);
        }
        acc.zeros += u64::from(xi == 0.0);
        acc.subnormal += u64::from(a > 0.0 && a < min_normal);
    }
    let Some(reference) = reference else { return };
    acc.compared = true;
    let (mut ref_max, mut ref_min) = (0.0f64, f64::INFINITY);
    for (&xi, &ri) in x.iter().zip(reference) {
        let (xi, ri) = (xi.wide(), ri.wide());
        let ra = finite_abs(ri);
        let nonzero = ra > 0.0;
        acc.ref_non_finite += u64::from(!ri.is_finite());
        ref_max = ref_max.max(ra);
        if nonzero {
            ref_min = ref_min.min(ra);
        }
        acc.ref_nonzero += u64::from(nonzero);
        if let Some(r) = range {
            // The fp32 value as the target holds it: times the loss scale.
            let v = T::scaled(ra, scale);
            acc.overflow += u64::from(v >= r.overflow_at);
            acc.underflow += u64::from(nonzero && v <= r.zero_at);
            acc.ref_subnormal += u64::from(v > r.zero_at && v < r.subnormal_below);
            acc.flushed += u64::from(xi == 0.0 && nonzero && v < r.min_normal);
        }
        let d = xi / scale - ri;
        acc.err_sq += d * d;
        acc.ref_sq += ri * ri;
    }
    acc.ref_max = ref_max * scale;
    acc.ref_min = ref_min * scale;
}

/// fp32 bit patterns of the thresholds [`scan_f32`] compares with: non-negative non-NaN floats
/// order as their bits do.
struct F32Bits {
    scale: f32,
    scale_f64: f64,
    inv_scale: f64,
    range: Option<[u32; 4]>,
}

impl F32Bits {
    /// `None` when the scale or a threshold is not exact in fp32 ([`scan`] then compares).
    fn new(range: Option<DtypeRange>, scale: f64) -> Option<Self> {
        let exact = |t: f64| Some(t as f32).filter(|f| f64::from(*f) == t && *f >= 0.0).map(f32::to_bits);
        let range = match range {
            Some(r) => {
                Some([exact(r.min_normal)?, exact(r.overflow_at)?, exact(r.zero_at)?, exact(r.subnormal_below)?])
            }
            None => None,
        };
        exact(scale).filter(|&b| b > 0)?;
        Some(Self { scale: scale as f32, scale_f64: scale, inv_scale: 1.0 / scale, range })
    }
}

/// [`scan`] for fp32 values on the bits of their magnitudes, in loops the compiler vectorizes;
/// the same counts, the sums of squares in eight lanes.
fn scan_f32(acc: &mut Acc, x: &[f32], reference: Option<&[f32]>, t: &F32Bits) {
    // Counts per block in u32 lanes (a block holds fewer than 2^32 elements).
    const BLOCK: usize = 1 << 20;
    let [min_normal, overflow_at, zero_at, subnormal_below] = t.range.unwrap_or([0, u32::MAX, 0, 0]);
    let (mut max, mut min) = (0u32, u32::MAX);
    for xb in x.chunks(BLOCK) {
        let (mut non_finite, mut zeros, mut subnormal) = (0u32, 0u32, 0u32);
        for &xi in xb {
            let raw = xi.to_bits() & 0x7fff_ffff;
            let a = if raw < 0x7f80_0000 { raw } else { 0 };
            non_finite += u32::from(raw >= 0x7f80_0000);
            max = max.max(a);
            min = min.min(a.wrapping_sub(1));
            zeros += u32::from(raw == 0);
            subnormal += u32::from((a > 0) & (a < min_normal));
        }
        acc.non_finite += u64::from(non_finite);
        acc.zeros += u64::from(zeros);
        acc.subnormal += u64::from(subnormal);
    }
    // `min` holds the smallest non-zero magnitude's bits less one (u32::MAX: none).
    acc.max_abs = f64::from(f32::from_bits(max));
    acc.min_nonzero = if min == u32::MAX { f64::INFINITY } else { f64::from(f32::from_bits(min + 1)) };
    let Some(reference) = reference else { return };
    acc.compared = true;
    let (mut rmax, mut rmin) = (0u32, u32::MAX);
    for (xb, rb) in x.chunks(BLOCK).zip(reference.chunks(BLOCK)) {
        let (mut r_non_finite, mut nonzeros) = (0u32, 0u32);
        let (mut overflow, mut underflow, mut r_subnormal, mut flushed) = (0u32, 0u32, 0u32, 0u32);
        for (&xi, &ri) in xb.iter().zip(rb) {
            let raw = ri.to_bits() & 0x7fff_ffff;
            let ra = if raw < 0x7f80_0000 { raw } else { 0 };
            let nonzero = ra > 0;
            r_non_finite += u32::from(raw >= 0x7f80_0000);
            rmax = rmax.max(ra);
            rmin = rmin.min(ra.wrapping_sub(1));
            nonzeros += u32::from(nonzero);
            // The fp32 value as the target holds it: times the loss scale (never NaN).
            let v = (f32::from_bits(ra) * t.scale).to_bits();
            overflow += u32::from(v >= overflow_at);
            underflow += u32::from(nonzero & (v <= zero_at));
            r_subnormal += u32::from((v > zero_at) & (v < subnormal_below));
            flushed += u32::from((xi.to_bits() & 0x7fff_ffff == 0) & nonzero & (v < min_normal));
        }
        acc.ref_non_finite += u64::from(r_non_finite);
        acc.ref_nonzero += u64::from(nonzeros);
        if t.range.is_some() {
            acc.overflow += u64::from(overflow);
            acc.underflow += u64::from(underflow);
            acc.ref_subnormal += u64::from(r_subnormal);
            acc.flushed += u64::from(flushed);
        }
    }
    acc.ref_max = f64::from(f32::from_bits(rmax)) * t.scale_f64;
    acc.ref_min = if rmin == u32::MAX { f64::INFINITY } else { f64::from(f32::from_bits(rmin + 1)) * t.scale_f64 };
    let (mut err, mut sq) = ([0f64; 8], [0f64; 8]);
    let (xs, rs) = (x.chunks_exact(8), reference.chunks_exact(8));
    let tail = xs.remainder().iter().zip(rs.remainder());
    for (xc, rc) in xs.zip(rs) {
        for k in 0..8 {
            let (xi, ri) = (f64::from(xc[k]), f64::from(rc[k]));
            let d = xi * t.inv_scale - ri;
            err[k] += d * d;
            sq[k] += ri * ri;
        }
    }
    for (&xi, &ri) in tail {
        let (xi, ri) = (f64::from(xi), f64::from(ri));
        let d = xi * t.inv_scale - ri;
        err[0] += d * d;
        sq[0] += ri * ri;
    }
    acc.err_sq += err.iter().sum::<f64>();
    acc.ref_sq += sq.iter().sum::<f64>();
}

/// How many of `values`' non-zero finite elements have each binary exponent
/// `floor(log2 |x|)`, from [`HIST_MIN`] to [`HIST_MAX`] (clamped).
pub(crate) fn exponent_histogram(values: &Tensor) -> Result<Vec<u64>> {
    let mut counts = vec![0u64; HIST_BINS as usize];
    let mut count = |e: i64| counts[(e.clamp(HIST_MIN, HIST_MAX) - HIST_MIN) as usize] += 1;
    match Host::of(values, "doctor histogram")? {
        Host::F32(v) => {
            for x in v {
                let b = x.to_bits() & 0x7fff_ffff;
                if b == 0 || b >= 0x7f80_0000 {
                    continue;
                }
                // Normal: the biased exponent less 127; subnormal: 2^-149 times the mantissa.
                let biased = i64::from(b >> 23);
                count(if biased > 0 { biased - 127 } else { i64::from(31 - b.leading_zeros()) - 149 });
            }
        }
        Host::F64(v) => {
            for x in v {
                let a = finite_abs(x);
                if a > 0.0 {
                    // The binary exponent of an fp64 normal; fp64 subnormals lie below HIST_MIN.
                    let biased = ((a.to_bits() >> 52) & 0x7ff) as i64;
                    count(if biased == 0 { HIST_MIN } else { biased - 1023 });
                }
            }
        }
    }
    Ok(counts)
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Finite values across fp32's range, the specials, and the 16-bit thresholds' neighbours.
    fn value() -> impl Strategy<Value = f32> {
        let edges: Vec<f32> = [DtypeRange::fp16(), DtypeRange::bf16()]
            .iter()
            .flat_map(|r| [r.min_normal, r.overflow_at, r.zero_at, r.subnormal_below])
            .flat_map(|t| {
                let b = (t as f32).to_bits();
                [b - 1, b, b + 1].map(f32::from_bits)
            })
            .collect();
        prop_oneof![
            4 => any::<u32>().prop_map(f32::from_bits),
            2 => (-40i32..40, -1.0f32..1.0).prop_map(|(e, m)| m * 2f32.powi(e)),
            1 => prop::sample::select(vec![0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-45, -1e-45]),
            2 => prop::sample::select(edges),
        ]
    }

    /// `a` and `b` agree: every count and extreme exactly, the sums of squares to rounding.
    fn same(mut a: Acc, mut b: Acc) -> std::result::Result<(), TestCaseError> {
        for (x, y) in [(a.err_sq, b.err_sq), (a.ref_sq, b.ref_sq)] {
            let close = x == y || (x - y).abs() <= 1e-12 * x.abs().max(y.abs()) || (x.is_nan() && y.is_nan());
            prop_assert!(close, "{x} vs {y}");
        }
        (a.err_sq, a.ref_sq, b.err_sq, b.ref_sq) = (0.0, 0.0, 0.0, 0.0);
        prop_assert_eq!(format!("{a:?}"), format!("{b:?}"));
        Ok(())
    }

    proptest! {
        /// The vectorised fp32 pass counts what the per-element definition counts.
        #[test]
        fn fp32_pass_matches_the_per_element_pass(
            pairs in prop::collection::vec((value(), value()), 0..300),
            scale in prop::sample::select(vec![1.0, 2f64.powi(16), 2f64.powi(-19), 128.0]),
            range in prop::sample::select(vec![None, Some(DtypeRange::fp16()), Some(DtypeRange::bf16())]),
            compare in any::<bool>(),
        ) {
            let (x, r): (Vec<f32>, Vec<f32>) = pairs.into_iter().unzip();
            let reference = compare.then_some(r.as_slice());
            let t = F32Bits::new(range, scale).expect("exact in fp32");
            let (mut fast, mut plain) = (Acc::default(), Acc::default());
            scan_f32(&mut fast, &x, reference, &t);
            scan::<f32>(&mut plain, &x, reference, scale, range);
            same(fast, plain)?;
        }

        /// Exponent bins are floor(log2 |x|) of the non-zero finite values.
        #[test]
        fn histogram_bins_are_binary_exponents(x in prop::collection::vec(value(), 0..300)) {
            let h = exponent_histogram(&Tensor::from_slice(&x)).unwrap();
            let mut expected = vec![0u64; HIST_BINS as usize];
            for v in x.iter().map(|&v| f64::from(v).abs()).filter(|a| a.is_finite() && *a > 0.0) {
                expected[((v.log2().floor() as i64).clamp(HIST_MIN, HIST_MAX) - HIST_MIN) as usize] += 1;
            }
            prop_assert_eq!(h, expected);
        }
    }

    /// A scale or threshold that fp32 cannot hold takes the per-element pass.
    #[test]
    fn inexact_scales_take_the_per_element_pass() {
        assert!(F32Bits::new(Some(DtypeRange::fp16()), 0.1).is_none());
        assert!(F32Bits::new(None, 2f64.powi(-200)).is_none());
        assert!(F32Bits::new(Some(DtypeRange::bf16()), 2f64.powi(24)).is_some());
    }
}
