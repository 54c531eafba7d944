//! What a diagnostic run reports: per op and per module, forward and backward, the target run's
//! statistics against the fp32 run's, where the first inf/NaN appeared, and the findings.
use std::fmt;

use serde::Serialize;

use crate::dtype::DtypeRange;

/// The op name of a weight's gradient in reports.
pub(crate) const WEIGHT_GRADIENT: &str = "weight gradient";

/// Forward or backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// The forward pass: an op's outputs.
    Forward,
    /// The backward pass: the gradients of an op's outputs, or of the weights.
    Backward,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
        })
    }
}

/// The values of one op's outputs (forward) or of the gradients of its outputs (backward) in the
/// target run, as the target run held them: gradients at the loss scale.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorStats {
    /// The dtype they were held in (`fp16`, `bf16`, `fp32`, ...; `mixed` across several).
    pub dtype: String,
    /// Number of values.
    pub numel: u64,
    /// The largest finite |x| (0 when none is finite).
    pub max_abs: f64,
    /// The smallest non-zero finite |x| (`None` when there is none).
    pub min_nonzero_abs: Option<f64>,
    /// Values that are inf or NaN.
    pub non_finite: u64,
    /// Values that are exactly zero.
    pub zeros: u64,
    /// Values that are subnormal in their 16-bit dtype (0 for fp32/fp64 values).
    pub subnormal: u64,
    /// The same values in the fp32 run (`None` when no op of the fp32 run matched).
    pub fp32: Option<Fp32Comparison>,
}

/// The fp32 run's values of the same op, scaled as the target run's (gradients times the loss
/// scale), and what the target's 16-bit dtype does to them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fp32Comparison {
    /// The largest finite |x| in the fp32 run.
    pub max_abs: f64,
    /// The smallest non-zero finite |x| in the fp32 run.
    pub min_nonzero_abs: Option<f64>,
    /// Non-zero finite values in the fp32 run.
    pub nonzero: u64,
    /// inf/NaN values the fp32 run itself produced.
    pub non_finite: u64,
    /// fp32 values that overflow the target's 16-bit dtype when rounded to it (0 when the
    /// target held them in fp32).
    pub overflow: u64,
    /// Non-zero fp32 values that round to zero in the 16-bit dtype.
    pub underflow: u64,
    /// Non-zero fp32 values that round to a subnormal of the 16-bit dtype.
    pub subnormal: u64,
    /// Non-zero fp32 values below the 16-bit dtype's smallest normal number that the target run
    /// holds as exactly zero: underflow that happened in the target run (in this op, or before
    /// it and carried along).
    pub flushed: u64,
    /// ‖target − fp32‖₂ / ‖fp32‖₂ over the values (the target's gradients unscaled first);
    /// `None` when the fp32 values are all zero; not finite (JSON `null`) when the target's are
    /// not.
    pub relative_error: Option<f64>,
}

impl TensorStats {
    /// Share of the fp32 values that overflow the 16-bit dtype.
    pub fn overflow_share(&self) -> f64 {
        self.fp32.as_ref().map_or(0.0, |c| share(c.overflow, self.numel))
    }

    /// Share of the non-zero fp32 values that round to zero in the 16-bit dtype.
    pub fn underflow_share(&self) -> f64 {
        self.fp32.as_ref().map_or(0.0, |c| share(c.underflow, c.nonzero))
    }

    /// Share of the non-zero fp32 values that round to a subnormal of the 16-bit dtype.
    pub fn subnormal_share(&self) -> f64 {
        self.fp32.as_ref().map_or(0.0, |c| share(c.subnormal, c.nonzero))
    }

    /// Share of the non-zero fp32 values the target run holds as zero after an underflow.
    pub fn flushed_share(&self) -> f64 {
        self.fp32.as_ref().map_or(0.0, |c| share(c.flushed, c.nonzero))
    }

    /// Share of the values that are exactly zero in the target run.
    pub fn zero_share(&self) -> f64 {
        share(self.zeros, self.numel)
    }

    /// The relative error against the fp32 run (`None` when not compared).
    pub fn relative_error(&self) -> Option<f64> {
        self.fp32.as_ref().and_then(|c| c.relative_error)
    }
}

/// `n / of`, 0 when `of` is 0.
pub(crate) fn share(n: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        n as f64 / of as f64
    }
}

/// One top-level op of the target run's forward (an aten op the model's code called), in call
/// order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpReport {
    /// Position in the target run's forward (0 = first op).
    pub index: usize,
    /// The aten op (`conv2d`, `linear`, `add`, ...), or `input cast` / `output cast` for the casts
    /// of O2/O3's model wrapper.
    pub op: String,
    /// The module: the VarStore path prefix of the first weight among its inputs (`fc1` for
    /// `fc1.weight`), `""` for the root.
    pub module: String,
    /// The op reads no weight: `module` is the module whose weights the last op before it read
    /// (`(input)` before any).
    pub module_inferred: bool,
    /// Dtypes of its floating inputs.
    pub input_dtypes: Vec<String>,
    /// Its floating outputs.
    pub forward: Option<TensorStats>,
    /// The gradients of its outputs (`None` when none reached its backward).
    pub backward: Option<TensorStats>,
}

/// One module (a VarStore path prefix): its ops together, and its weights' gradients.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModuleReport {
    /// The VarStore path prefix (`block0.conv1`); `(input)` for ops before any weight is read.
    pub module: String,
    /// Its ops ([`OpReport::index`]), own and inferred.
    pub ops: Vec<usize>,
    /// Its ops' outputs together; `relative_error` is the largest of its ops'.
    pub forward: Option<TensorStats>,
    /// The gradients of its ops' outputs together; `relative_error` is the largest of its ops'.
    pub backward: Option<TensorStats>,
    /// The gradients of its trainable variables (in the variables' dtype: fp16 under O2/O3,
    /// fp32 under O1 and autocast), at the loss scale.
    pub weight_grads: Option<TensorStats>,
    /// The most severe finding about it (`None`: nothing found).
    pub severity: Option<Severity>,
}

/// Where the target run first produced inf or NaN.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NonFiniteOrigin {
    /// In the forward (an op's outputs) or the backward (the gradients of an op's outputs, or a
    /// weight's gradient).
    pub phase: Phase,
    /// The op (`linear`), or `weight gradient`.
    pub op: String,
    /// Its module (VarStore path prefix), or the variable for a weight gradient.
    pub module: String,
    /// The dtype the values were held in.
    pub dtype: String,
    /// The loss scale of the backward pass (1 for a forward origin found without scaling).
    pub loss_scale: f64,
}

impl fmt::Display for NonFiniteOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let module = if self.module.is_empty() { "the root module" } else { &self.module };
        match self.phase {
            Phase::Forward => write!(f, "forward: {} in {module} ({} output)", self.op, self.dtype),
            Phase::Backward if self.op == WEIGHT_GRADIENT => {
                write!(f, "backward: the gradient of {module} ({}, loss scale {})", self.dtype, self.loss_scale)
            }
            Phase::Backward => write!(
                f,
                "backward: the gradient of {}'s output in {module} ({}, loss scale {})",
                self.op, self.dtype, self.loss_scale
            ),
        }
    }
}

/// The two runs' losses.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Losses {
    /// The fp32 run's loss.
    pub fp32: f64,
    /// The target run's loss (before scaling; not finite: JSON `null`).
    pub target: f64,
}

/// A range of loss scales (powers of two) in which no gradient overflows the 16-bit dtype and
/// the share of each module's non-zero gradients that underflow stays under 1%.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScaleWindow {
    /// The smallest scale that keeps the underflow under 1% in every module.
    pub min: f64,
    /// The largest scale at which no gradient of the fp32 run overflows.
    pub max: f64,
    /// The module whose gradients set `min` (`None` when nothing underflows even at scale 1).
    pub min_set_by: Option<String>,
    /// The module whose gradients set `max`.
    pub max_set_by: Option<String>,
}

impl ScaleWindow {
    /// Whether some scale fits both bounds.
    pub fn is_empty(&self) -> bool {
        self.min > self.max
    }

    /// Whether `scale` lies in the window.
    pub fn contains(&self, scale: f64) -> bool {
        scale >= self.min && scale <= self.max
    }
}

/// What [`crate::doctor::Doctor::run`] found, for one batch: JSON through serde
/// ([`DoctorReport::to_json`]); the table and plots are the caller's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DoctorReport {
    /// The set-up diagnosed: `O1 fp16`, `O2 fp16`, `autocast bf16`, ...
    pub target: String,
    /// The 16-bit dtype of the target and its range.
    pub range: DtypeRange,
    /// The model's device.
    pub device: String,
    /// The loss scale of the target run's backward.
    pub loss_scale: f64,
    /// Whether the loss scale is the dynamic kind (Apex's dynamic scaler, torch's GradScaler),
    /// which backs off on its own after an overflow.
    pub dynamic_scale: bool,
    /// The two runs' losses.
    pub loss: Losses,
    /// Every top-level op of the target run's forward, in call order.
    pub ops: Vec<OpReport>,
    /// Per module, most severe first, then in the order of their first op.
    pub modules: Vec<ModuleReport>,
    /// Where the target run first produced inf or NaN (`None`: nowhere).
    pub first_non_finite: Option<NonFiniteOrigin>,
    /// The loss scales that fit this batch's gradients (`None` when the target needs no scale:
    /// bf16, or no gradient reached a 16-bit tensor).
    pub scale_window: Option<ScaleWindow>,
    /// What to do, most severe first.
    pub findings: Vec<Finding>,
}

impl DoctorReport {
    /// Whether the set-up trains this batch fine: no finding of severity
    /// [`Severity::Warning`](Severity::Warning) or above.
    pub fn trains_fine(&self) -> bool {
        self.findings.iter().all(|f| f.severity < Severity::Warning)
    }

    /// The module named `name`.
    pub fn module(&self, name: &str) -> Option<&ModuleReport> {
        self.modules.iter().find(|m| m.module == name)
    }

    /// The findings about module `name`.
    pub fn findings_for<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Finding> + 'a {
        self.findings.iter().filter(move |f| f.module.as_deref() == Some(name))
    }

    /// One line: the verdict, with the worst finding or, when it trains fine, the largest forward
    /// relative error.
    pub fn summary(&self) -> String {
        if let Some(worst) = self.findings.iter().find(|f| f.severity >= Severity::Warning) {
            return format!("{} at loss scale {}: {}", self.target, self.loss_scale, worst.message);
        }
        let worst = self
            .ops
            .iter()
            .filter_map(|o| Some((o, o.forward.as_ref()?.relative_error()?)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let detail = worst.map_or(String::new(), |(o, e)| {
            format!("; largest forward relative error {e:.1e} ({} in {})", o.op, display_module(&o.module))
        });
        format!(
            "{} trains fine at loss scale {}: no overflow, no underflow above 1% of a module's values{detail}",
            self.target, self.loss_scale
        )
    }

    /// The report as pretty-printed JSON (non-finite numbers become `null`).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// A module's name for messages: `(root)` for the empty path.
pub(crate) fn display_module(m: &str) -> &str {
    if m.is_empty() {
        "(root)"
    } else {
        m
    }
}

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Worth knowing; training is fine.
    Info,
    /// Training goes on but learns less well (lost gradients, lost precision).
    Warning,
    /// Steps are skipped, the scale collapses, or inf/NaN reach the weights.
    Error,
}

/// What a finding is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// Forward values exceed the 16-bit dtype's range (or turn inf/NaN).
    ActivationOverflow,
    /// Non-zero forward values become zero in the 16-bit dtype.
    ActivationUnderflow,
    /// Gradients at the loss scale exceed the 16-bit dtype's range.
    GradientOverflow,
    /// Non-zero gradients at the loss scale become zero in the 16-bit dtype.
    GradientUnderflow,
    /// An op's result is far from the fp32 run's although its values are in range.
    PrecisionLoss,
    /// Why a dynamic loss scale falls to its floor, or settles where gradients vanish.
    ScaleCollapse,
    /// The fp32 run itself produces inf/NaN: not a mixed-precision problem.
    Fp32NonFinite,
}

/// One thing to do, and the call that does it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Advice {
    /// What to do, in words.
    pub action: String,
    /// The Rust to write (`<...>` marks the user's names).
    pub code: String,
}

/// A problem (or a fact) the numbers show, with its evidence and what to do.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    /// How bad it is.
    pub severity: Severity,
    /// What it is about.
    pub kind: FindingKind,
    /// The module (VarStore path prefix), when it is about one.
    pub module: Option<String>,
    /// The op, when it is about one.
    pub op: Option<String>,
    /// Forward or backward, when it is about one.
    pub phase: Option<Phase>,
    /// One sentence.
    pub message: String,
    /// The numbers behind it.
    pub evidence: String,
    /// What to do, best first.
    pub advice: Vec<Advice>,
}
