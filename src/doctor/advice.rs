//! The advice engine: from the per-op and per-module numbers to findings, each with its
//! evidence and the call to write (bf16 for a range problem, a module kept in fp32, a loss-scale
//! window), and the window of loss scales this batch's gradients allow.
use std::collections::BTreeMap;

use tch::{Device, Kind};

use super::record::{OpRecord, INPUT_MODULE};
use super::report::{display_module, Advice, Finding, FindingKind, ModuleReport, Phase, ScaleWindow, Severity};
use super::stats::{Acc, HIST_MIN};
use crate::config::OptLevel;
use crate::dtype::DtypeRange;

/// A module's values count as underflowing when more than this share of its non-zero fp32
/// values become zero in the 16-bit dtype.
pub const UNDERFLOW_SHARE: f64 = 0.01;
/// An op loses precision when its forward relative error exceeds this many unit roundoffs of
/// the 16-bit dtype (fp16: 2^-5, bf16: 2^-2) and four times every earlier op's.
pub const PRECISION_ROUNDOFFS: f64 = 64.0;

/// The set-up diagnosed, as the advice needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Path {
    /// Apex's path at this opt level.
    Apex(OptLevel),
    /// torch.amp's autocast (with a GradScaler for fp16).
    Autocast,
}

/// Everything the advice depends on besides the numbers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Context {
    pub(crate) path: Path,
    pub(crate) device: Device,
    pub(crate) low: Kind,
    pub(crate) range: DtypeRange,
    pub(crate) scale: f64,
    pub(crate) dynamic: bool,
    /// The dynamic scale's floor (`None`: no floor, torch's GradScaler).
    pub(crate) floor: Option<f64>,
    pub(crate) max_scale: f64,
}

impl Context {
    fn device_expr(&self) -> String {
        match self.device {
            Device::Cuda(i) => format!("Device::Cuda({i})"),
            _ => "Device::Cpu".into(),
        }
    }

    fn unit_roundoff(&self) -> f64 {
        match self.low {
            Kind::BFloat16 => 2f64.powi(-8),
            _ => 2f64.powi(-11),
        }
    }

    fn bf16_advice(&self, why: &str) -> Option<Advice> {
        if self.low != Kind::Half {
            return None;
        }
        let code = match self.path {
            Path::Apex(OptLevel::O1) => "AmpConfig::new(OptLevel::O1).low_precision_dtype(Kind::BFloat16)".to_string(),
            Path::Apex(level) => format!("AmpConfig::new(OptLevel::{level}).cast_model_type(Some(Kind::BFloat16))"),
            Path::Autocast => {
                format!("Autocast::new({}).dtype(Kind::BFloat16) // and no GradScaler", self.device_expr())
            }
        };
        Some(Advice { action: format!("switch to bf16: {why}"), code })
    }

    fn fp32_advice(&self, module: &str) -> Advice {
        let region = format!(
            "let y = tch_amp::fp32_region({}, &[&x], |t| <{}>.forward(&t[0]))?;",
            self.device_expr(),
            display_module(module)
        );
        match self.path {
            Path::Apex(OptLevel::O1) | Path::Autocast => Advice {
                action: format!("run {} in fp32 (its inputs cast to fp32, no casts inside)", display_module(module)),
                code: region,
            },
            Path::Apex(level) => Advice {
                action: format!(
                    "{level} casts every module but batch norms to the 16-bit type: to keep {} in fp32, train \
                     under O1 and run it in fp32",
                    display_module(module)
                ),
                code: format!("AmpConfig::new(OptLevel::O1) // then: {region}"),
            },
        }
    }

    fn window_advice(&self, w: &ScaleWindow) -> Advice {
        let mid = 2f64.powf(((w.min.log2() + w.max.log2()) / 2.0).round());
        let range = format!("[{}, {}]", w.min, w.max);
        match self.path {
            Path::Apex(level) if self.dynamic => Advice {
                action: format!("keep the dynamic loss scale within {range}"),
                code: format!(
                    "AmpConfig::new(OptLevel::{level}).init_loss_scale({mid:?}).min_loss_scale({:?}).max_loss_scale({:?})",
                    w.min, w.max
                ),
            },
            Path::Apex(level) => Advice {
                action: format!("use a loss scale within {range}"),
                code: format!("AmpConfig::new(OptLevel::{level}).loss_scale({mid:?})"),
            },
            Path::Autocast => Advice {
                action: format!("start the GradScaler within {range} (it has no floor or cap: watch its scale)"),
                code: format!(
                    "GradScaler::with_options({}, GradScalerOptions::default().init_scale({mid:?}))?",
                    self.device_expr()
                ),
            },
        }
    }
}

/// The window of loss scales (powers of two) this batch's 16-bit gradients allow: at most the
/// largest scale at which the fp32 run's largest gradient stays below the overflow threshold, at
/// least the smallest at which each module loses at most [`UNDERFLOW_SHARE`] of its non-zero
/// gradients to zero. `None` for bf16, or when no gradient was held in 16 bits.
pub(crate) fn scale_window(
    ctx: &Context,
    ops: &[OpRecord],
    weight_grads: &BTreeMap<String, Acc>,
    histograms: &BTreeMap<String, Vec<u64>>,
) -> Option<ScaleWindow> {
    if ctx.low != Kind::Half {
        return None;
    }
    // The largest unscaled fp32 gradient among those held in 16 bits, and its module.
    let mut largest: Option<(f64, &str)> = None;
    let grads = ops
        .iter()
        .filter_map(|o| o.backward.as_ref().map(|a| (a, o.module.as_str())))
        .chain(weight_grads.iter().map(|(m, a)| (a, m.as_str())));
    for (acc, module) in grads.filter(|(a, _)| a.low_precision()) {
        let g = acc.fp32_max_abs() / ctx.scale;
        if g.is_finite() && largest.map_or(true, |(l, _)| g > l) {
            largest = Some((g, module));
        }
    }
    let (max_grad, max_module) = largest?;
    let cap = ctx.max_scale.log2().floor() as i64;
    let max_k = if max_grad > 0.0 {
        let mut k = (ctx.range.overflow_at / max_grad).log2().floor() as i64;
        while k > -150 && max_grad * 2f64.powi(k as i32) >= ctx.range.overflow_at {
            k -= 1;
        }
        k.min(cap)
    } else {
        cap
    };
    // A value with exponent e becomes zero at scale 2^k when e + k <= zero_exp.
    let zero_exp = ctx.range.min_subnormal.log2().round() as i64 - 2;
    let mut min_k = i64::MIN;
    let mut min_module = None;
    for (module, h) in histograms {
        let total: u64 = h.iter().sum();
        if total == 0 {
            continue;
        }
        let allowed = (UNDERFLOW_SHARE * total as f64).floor() as u64;
        let mut cumulative = 0u64;
        let mut e_t = HIST_MIN - 1;
        for (i, &c) in h.iter().enumerate() {
            cumulative += c;
            if cumulative > allowed {
                break;
            }
            e_t = HIST_MIN + i as i64;
        }
        let k = zero_exp - e_t;
        if k > min_k {
            min_k = k;
            min_module = Some(module.clone());
        }
    }
    let floor_k = ctx.floor.map_or(-24, |f| f.log2().ceil() as i64);
    let min_k = if min_k == i64::MIN { floor_k } else { min_k.max(floor_k) };
    Some(ScaleWindow {
        min: 2f64.powi(min_k.clamp(-1000, 1000) as i32),
        max: 2f64.powi(max_k.clamp(-1000, 1000) as i32),
        min_set_by: min_module,
        max_set_by: Some(max_module.to_string()),
    })
}

/// A module's numbers, gathered from its ops.
#[derive(Debug, Default)]
struct ModuleAcc {
    first_op: usize,
    ops: Vec<usize>,
    forward: Option<Acc>,
    backward: Option<Acc>,
}

fn absorb(into: &mut Option<Acc>, acc: &Acc) {
    match into {
        Some(a) => a.absorb(acc),
        None => {
            let mut a = Acc::default();
            a.absorb(acc);
            *into = Some(a);
        }
    }
}

fn percent(x: f64) -> String {
    format!("{:.3}%", 100.0 * x)
}

/// Findings about the target run, and the modules with their severity, most severe first.
pub(crate) fn diagnose(
    ctx: &Context,
    ops: &[OpRecord],
    weight_grads: &BTreeMap<String, Acc>,
    window: Option<&ScaleWindow>,
    forward_non_finite: Option<usize>,
) -> (Vec<Finding>, Vec<ModuleReport>) {
    let mut findings = Vec::new();
    let low = ctx.range.dtype;

    // The fp32 run's own inf/NaN: nothing mixed precision can fix.
    if let Some(o) =
        ops.iter().find(|o| o.forward.as_ref().is_some_and(|a| a.stats().fp32.is_some_and(|c| c.non_finite > 0)))
    {
        findings.push(Finding {
            severity: Severity::Error,
            kind: FindingKind::Fp32NonFinite,
            module: Some(o.module.clone()),
            op: Some(o.name.clone()),
            phase: Some(Phase::Forward),
            message: format!(
                "the fp32 run already produces inf/NaN at {} in {}: not a mixed-precision problem",
                o.name,
                display_module(&o.module)
            ),
            evidence: "non-finite values in the fp32 run's outputs".into(),
            advice: vec![Advice {
                action: "fix the model, the data or the learning rate first".into(),
                code: String::new(),
            }],
        });
    }

    // Forward overflow: each op whose fp32 values exceed the range, and the first op that made
    // inf/NaN in the target run.
    let mut overflow_modules: Vec<String> = Vec::new();
    for (i, o) in ops.iter().enumerate() {
        let Some(f) = o.forward.as_ref() else { continue };
        let s = f.stats();
        let predicted = s.fp32.as_ref().map_or(0, |c| c.overflow);
        let produced_first = forward_non_finite == Some(i);
        if predicted == 0 && !produced_first {
            continue;
        }
        let ref_max = s.fp32.as_ref().map_or(0.0, |c| c.max_abs);
        let mut advice = Vec::new();
        if ref_max < DtypeRange::bf16().max {
            advice.extend(ctx.bf16_advice("bf16 has fp32's exponent range (a range problem, not a precision one)"));
        }
        advice.push(ctx.fp32_advice(&o.module));
        overflow_modules.push(o.module.clone());
        findings.push(Finding {
            severity: Severity::Error,
            kind: FindingKind::ActivationOverflow,
            module: Some(o.module.clone()),
            op: Some(o.name.clone()),
            phase: Some(Phase::Forward),
            message: format!(
                "activations of {} ({}) overflow {low}{}",
                display_module(&o.module),
                o.name,
                if produced_first { ": the first inf/NaN of the run" } else { "" }
            ),
            evidence: format!(
                "fp32 max |x| {ref_max:.4e} vs {low} max {}; {} of {} values overflow; the {low} run holds {} inf/NaN",
                ctx.range.max, predicted, s.numel, s.non_finite
            ),
            advice,
        });
    }
    if let (Some(first), true) = (overflow_modules.first(), ctx.low == Kind::Half) {
        findings.push(Finding {
            severity: Severity::Error,
            kind: FindingKind::ScaleCollapse,
            module: Some(first.clone()),
            op: None,
            phase: Some(Phase::Forward),
            message: format!(
                "the loss scale collapses because activations of {} overflow: the loss is inf/NaN whatever the \
                 scale, so every step is skipped and a dynamic scale halves down to its floor \
                 (Divergence::ScaleCollapsed)",
                display_module(first)
            ),
            evidence: "the overflow is in the forward pass, before any loss scaling".into(),
            advice: ctx.bf16_advice("its range holds these activations").into_iter().collect(),
        });
    }

    // Per module.
    let mut modules: BTreeMap<&str, ModuleAcc> = BTreeMap::new();
    for (i, o) in ops.iter().enumerate() {
        let m = modules.entry(o.module.as_str()).or_insert_with(|| ModuleAcc { first_op: i, ..ModuleAcc::default() });
        m.ops.push(i);
        if let Some(f) = &o.forward {
            absorb(&mut m.forward, f);
        }
        if let Some(b) = &o.backward {
            absorb(&mut m.backward, b);
        }
    }
    for name in weight_grads.keys() {
        modules.entry(name.as_str()).or_insert_with(|| ModuleAcc { first_op: usize::MAX, ..ModuleAcc::default() });
    }

    let forward_broken = forward_non_finite.is_some();
    for (name, m) in &modules {
        // Forward underflow.
        if let Some(f) = m.forward.as_ref().filter(|f| f.low_precision()) {
            let s = f.stats();
            let worst = s.flushed_share().max(s.underflow_share());
            if worst > UNDERFLOW_SHARE && *name != INPUT_MODULE && !forward_broken {
                let mut advice: Vec<Advice> =
                    ctx.bf16_advice("bf16 reaches fp32's smallest magnitudes").into_iter().collect();
                advice.push(ctx.fp32_advice(name));
                findings.push(Finding {
                    severity: Severity::Warning,
                    kind: FindingKind::ActivationUnderflow,
                    module: Some(name.to_string()),
                    op: None,
                    phase: Some(Phase::Forward),
                    message: format!("activations of {} underflow {low}", display_module(name)),
                    evidence: format!(
                        "{} of its non-zero fp32 values round to zero, {} became zero in the {low} run; fp32 min \
                         |x| {:.3e} vs {low} smallest subnormal {:.3e}",
                        percent(s.underflow_share()),
                        percent(s.flushed_share()),
                        s.fp32.as_ref().and_then(|c| c.min_nonzero_abs).unwrap_or(0.0),
                        ctx.range.min_subnormal
                    ),
                    advice,
                });
            }
        }
        // Backward underflow: the gradients of its outputs, and of its weights.
        if forward_broken {
            continue;
        }
        let mut grads = m.backward.clone();
        if let Some(w) = weight_grads.get(*name) {
            absorb(&mut grads, w);
        }
        let Some(g) = grads.filter(|g| g.low_precision()) else { continue };
        let s = g.stats();
        let worst = s.flushed_share().max(s.underflow_share());
        if worst > UNDERFLOW_SHARE && ctx.low == Kind::Half {
            let mut advice = Vec::new();
            match window {
                Some(w) if !w.is_empty() => advice.push(ctx.window_advice(w)),
                _ => advice.extend(ctx.bf16_advice("no loss scale keeps these gradients in fp16's range")),
            }
            advice.push(ctx.fp32_advice(name));
            findings.push(Finding {
                severity: Severity::Warning,
                kind: FindingKind::GradientUnderflow,
                module: Some(name.to_string()),
                op: None,
                phase: Some(Phase::Backward),
                message: format!(
                    "gradients of {} underflow {low} at loss scale {}: {} of them are zero",
                    display_module(name),
                    ctx.scale,
                    percent(s.zero_share())
                ),
                evidence: format!(
                    "{} of its non-zero fp32 gradients round to zero at this scale, {} became zero in the {low} \
                     run; fp32 min |g| x scale {:.3e} vs {low} smallest subnormal {:.3e}",
                    percent(s.underflow_share()),
                    percent(s.flushed_share()),
                    s.fp32.as_ref().and_then(|c| c.min_nonzero_abs).unwrap_or(0.0),
                    ctx.range.min_subnormal
                ),
                advice,
            });
        }
    }

    // Backward overflow at this scale, and the window.
    if !forward_broken && ctx.low == Kind::Half {
        if let Some(w) = window {
            let over: Vec<&str> = modules
                .iter()
                .filter(|(name, m)| {
                    let w = weight_grads.get(**name);
                    m.backward
                        .iter()
                        .chain(w)
                        .any(|a| a.stats().fp32.is_some_and(|c| c.overflow > 0) || a.non_finite() > 0)
                })
                .map(|(n, _)| *n)
                .collect();
            if w.is_empty() {
                let under = w.min_set_by.clone().unwrap_or_default();
                let overm = w.max_set_by.clone().unwrap_or_default();
                let mut advice: Vec<Advice> =
                    ctx.bf16_advice("no loss scale fits fp16's range for these gradients").into_iter().collect();
                advice.push(ctx.fp32_advice(&under));
                findings.push(Finding {
                    severity: Severity::Error,
                    kind: FindingKind::ScaleCollapse,
                    module: Some(under.clone()),
                    op: None,
                    phase: Some(Phase::Backward),
                    message: format!(
                        "no loss scale fits: the scale must stay at or below {} for gradients of {} not to overflow, \
                         where gradients of {} underflow (they need {} or more): the scale collapses because \
                         gradients of {} underflow",
                        w.max,
                        display_module(&overm),
                        display_module(&under),
                        w.min,
                        display_module(&under)
                    ),
                    evidence: format!("loss-scale window [{}, {}] is empty", w.min, w.max),
                    advice,
                });
            } else if !over.is_empty() || ctx.scale > w.max {
                let name = over.first().copied().or(w.max_set_by.as_deref()).unwrap_or_default().to_string();
                let steps = (ctx.scale / w.max).log2().ceil().max(1.0);
                let (severity, message) = if ctx.dynamic {
                    (
                        Severity::Info,
                        format!(
                            "gradients of {} overflow at loss scale {}: the dynamic scale skips about {steps} step(s) \
                             and settles at or below {}",
                            display_module(&name),
                            ctx.scale,
                            w.max
                        ),
                    )
                } else {
                    (
                        Severity::Error,
                        format!(
                            "gradients of {} overflow at the static loss scale {}: every step overflows",
                            display_module(&name),
                            ctx.scale
                        ),
                    )
                };
                findings.push(Finding {
                    severity,
                    kind: FindingKind::GradientOverflow,
                    module: Some(name),
                    op: None,
                    phase: Some(Phase::Backward),
                    message,
                    evidence: format!("loss-scale window [{}, {}]", w.min, w.max),
                    advice: vec![ctx.window_advice(w)],
                });
            }
            if !w.is_empty() && ctx.floor.is_some_and(|f| w.max < f) {
                findings.push(Finding {
                    severity: Severity::Error,
                    kind: FindingKind::ScaleCollapse,
                    module: w.max_set_by.clone(),
                    op: None,
                    phase: Some(Phase::Backward),
                    message: format!(
                        "the loss scale collapses: gradients of {} overflow even at the scale's floor",
                        display_module(w.max_set_by.as_deref().unwrap_or(""))
                    ),
                    evidence: format!("largest fitting scale {} is below the floor", w.max),
                    advice: ctx.bf16_advice("its range holds these gradients").into_iter().collect(),
                });
            }
        }
    }

    // Precision: an op whose relative error jumps well above every earlier op's, values in range.
    if !forward_broken {
        let threshold = PRECISION_ROUNDOFFS * ctx.unit_roundoff();
        let mut earlier = 0.0f64;
        for o in ops {
            let Some(f) = o.forward.as_ref() else { continue };
            let Some(rel) = f.relative().filter(|r| r.is_finite()) else { continue };
            let s = f.stats();
            let in_range = s.fp32.as_ref().is_some_and(|c| c.overflow == 0) && s.flushed_share() <= UNDERFLOW_SHARE;
            if f.low_precision() && in_range && rel > threshold && rel > 4.0 * earlier {
                let mut advice = vec![ctx.fp32_advice(&o.module)];
                if ctx.low == Kind::BFloat16 {
                    advice.push(Advice {
                        action: "or fp16, which keeps 3 more mantissa bits where its range fits".into(),
                        code: String::new(),
                    });
                }
                findings.push(Finding {
                    severity: Severity::Warning,
                    kind: FindingKind::PrecisionLoss,
                    module: Some(o.module.clone()),
                    op: Some(o.name.clone()),
                    phase: Some(Phase::Forward),
                    message: format!(
                        "{} ({}) loses precision in {low}: relative error {rel:.3e} against fp32 (a precision \
                         problem, not a range one{})",
                        display_module(&o.module),
                        o.name,
                        if ctx.low == Kind::Half { ": bf16 would be worse" } else { "" }
                    ),
                    evidence: format!(
                        "relative error {rel:.3e} > {threshold:.3e} ({PRECISION_ROUNDOFFS} unit roundoffs) and > 4x \
                         the largest before it ({earlier:.3e}); no overflow, no underflow"
                    ),
                    advice,
                });
            }
            earlier = earlier.max(rel);
        }
    }

    findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    let mut reports: Vec<(usize, ModuleReport)> = modules
        .into_iter()
        .map(|(name, m)| {
            let severity = findings.iter().filter(|f| f.module.as_deref() == Some(name)).map(|f| f.severity).max();
            (
                m.first_op,
                ModuleReport {
                    module: name.to_string(),
                    ops: m.ops,
                    forward: m.forward.as_ref().map(Acc::stats),
                    backward: m.backward.as_ref().map(Acc::stats),
                    weight_grads: weight_grads.get(name).map(Acc::stats),
                    severity,
                },
            )
        })
        .collect();
    reports.sort_by(|a, b| b.1.severity.cmp(&a.1.severity).then(a.0.cmp(&b.0)));
    (findings, reports.into_iter().map(|(_, r)| r).collect())
}
