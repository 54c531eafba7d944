//! What a diagnostic run records from the op observer: the fp32 run's tensors (kept to compare
//! with), then per op of the target run its module and its statistics against the fp32 run's
//! matching op (the same op name, the same occurrence of that name).
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tch::{Kind, Tensor};

use super::report::{NonFiniteOrigin, OpReport, Phase, WEIGHT_GRADIENT};
use super::stats::{add_histogram, exponent_histogram, measure, Acc};
use crate::dtype::{dtype_name, is_low_precision, DtypeRange};
use crate::error::{AmpError, Result, TorchContext};
use crate::model::parent_path;
use crate::sys::observer::{Handler, Observed, ObservedKind};

/// The module of ops that run before any weight is read.
pub(crate) const INPUT_MODULE: &str = "(input)";
/// The op name of the input cast of O2/O3's model wrapper.
pub(crate) const INPUT_CAST: &str = "input cast";

/// Names the module of each op: the module of the first weight it reads, else the module of the
/// last op that read one.
#[derive(Debug)]
pub(crate) struct Modules {
    of_weight: Vec<String>,
    last: Option<String>,
}

impl Modules {
    pub(crate) fn new(variables: &[String]) -> Self {
        Self { of_weight: variables.iter().map(|v| parent_path(v).to_string()).collect(), last: None }
    }

    /// The module of an op reading the weights `weights`, and whether it was inferred.
    pub(crate) fn attribute(&mut self, weights: &[usize]) -> (String, bool) {
        match weights.iter().find_map(|&w| self.of_weight.get(w)) {
            Some(m) => {
                self.last = Some(m.clone());
                (m.clone(), false)
            }
            None => (self.last.clone().unwrap_or_else(|| INPUT_MODULE.to_string()), true),
        }
    }

    pub(crate) fn restart(&mut self) {
        self.last = None;
    }
}

/// The first variable whose gradient holds inf/NaN, and the dtype it was held in.
pub(crate) type FirstWeight = (String, String);

/// Which run the observations belong to.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Stage {
    /// Between runs: observations are dropped.
    Idle,
    /// The fp32 run.
    Reference,
    /// The target run, its backward at `scale`.
    Target { scale: f64 },
}

#[derive(Debug)]
struct RefOp {
    outputs: Vec<Tensor>,
    grads: Option<Vec<Tensor>>,
}

/// One op of the target run.
#[derive(Debug)]
pub(crate) struct OpRecord {
    pub(crate) name: String,
    pub(crate) module: String,
    pub(crate) inferred: bool,
    pub(crate) input_kinds: Vec<Kind>,
    pub(crate) forward: Option<Acc>,
    pub(crate) backward: Option<Acc>,
    /// The position of its backward among the backward observations (execution order).
    pub(crate) backward_order: Option<usize>,
    ref_op: Option<usize>,
}

impl OpRecord {
    pub(crate) fn report(&self, index: usize) -> OpReport {
        OpReport {
            index,
            op: self.name.clone(),
            module: self.module.clone(),
            module_inferred: self.inferred,
            input_dtypes: self.input_kinds.iter().map(|&k| dtype_name(k)).collect(),
            forward: self.forward.as_ref().map(Acc::stats),
            backward: self.backward.as_ref().map(Acc::stats),
        }
    }
}

#[derive(Debug)]
struct State {
    stage: Stage,
    modules: Modules,
    /// Whether an op of the target run read each weight and produced 16-bit outputs (its
    /// gradient was then computed in 16 bits).
    weight_low: Vec<bool>,
    ref_ops: Vec<RefOp>,
    ref_slot: HashMap<usize, usize>,
    ref_by_name: HashMap<String, Vec<usize>>,
    ops: Vec<OpRecord>,
    slot: HashMap<usize, usize>,
    seen: HashMap<String, usize>,
    backward_seen: usize,
    /// Per module: exponents of the fp32 run's gradients whose target values were 16-bit.
    histograms: BTreeMap<String, Vec<u64>>,
    error: Option<AmpError>,
}

/// The observation handler of a diagnostic run.
#[derive(Debug)]
pub(crate) struct Recorder {
    state: Mutex<State>,
}

/// What the recorder gives back at the end.
#[derive(Debug)]
pub(crate) struct Recorded {
    pub(crate) ops: Vec<OpRecord>,
    pub(crate) histograms: BTreeMap<String, Vec<u64>>,
}

fn clones(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
    tensors.iter().map(|t| t.f_detach_copy().ctx("doctor: keeping an fp32 value")).collect()
}

/// `measure` over pairs of tensors, one `Acc`.
fn measure_all(targets: &[Tensor], refs: Option<&[Tensor]>, scale: f64) -> Result<Acc> {
    let mut acc = Acc::default();
    for (i, t) in targets.iter().enumerate() {
        let r = refs.and_then(|r| r.get(i));
        acc.add(&measure(t, r, scale, None)?);
    }
    Ok(acc)
}

impl Recorder {
    pub(crate) fn new(variables: &[String]) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                stage: Stage::Idle,
                modules: Modules::new(variables),
                weight_low: vec![false; variables.len()],
                ref_ops: Vec::new(),
                ref_slot: HashMap::new(),
                ref_by_name: HashMap::new(),
                ops: Vec::new(),
                slot: HashMap::new(),
                seen: HashMap::new(),
                backward_seen: 0,
                histograms: BTreeMap::new(),
                error: None,
            }),
        })
    }

    /// The observer's handler for this recorder.
    pub(crate) fn handler(self: &Arc<Self>) -> Arc<Handler> {
        let me = Arc::clone(self);
        Arc::new(move |ev: Observed| me.observe(ev))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a run (the op count of the observer is reset by the caller).
    pub(crate) fn begin(&self, stage: Stage) {
        let mut s = self.lock();
        s.stage = stage;
        s.modules.restart();
        s.slot.clear();
        s.seen.clear();
    }

    /// The first failure of the handler, if any.
    pub(crate) fn take_error(&self) -> Option<AmpError> {
        self.lock().error.take()
    }

    fn observe(&self, ev: Observed) {
        let mut s = self.lock();
        let result = match (s.stage, ev.kind) {
            (Stage::Idle, _) => Ok(()),
            (Stage::Reference, ObservedKind::Forward) => s.reference_forward(ev),
            (Stage::Reference, ObservedKind::Backward) => s.reference_backward(ev),
            (Stage::Target { .. }, ObservedKind::Forward) => s.target_forward(ev),
            (Stage::Target { scale }, ObservedKind::Backward) => s.target_backward(ev, scale),
        };
        if let Err(e) = result {
            s.error.get_or_insert(e);
        }
    }

    /// Records the input cast of O2/O3's model wrapper in the target run, against the fp32 input.
    pub(crate) fn record_input_cast(&self, cast: &Tensor, input: &Tensor) {
        if !matches!(self.lock().stage, Stage::Target { .. }) {
            return;
        }
        // Measured without the lock: the handler takes it for every op it sees.
        let measured = measure(cast, Some(input), 1.0, None);
        let mut s = self.lock();
        match measured {
            Ok(acc) => s.ops.push(OpRecord {
                name: INPUT_CAST.to_string(),
                module: INPUT_MODULE.to_string(),
                inferred: true,
                input_kinds: vec![input.kind()],
                forward: Some(acc),
                backward: None,
                backward_order: None,
                ref_op: None,
            }),
            Err(e) => {
                s.error.get_or_insert(e);
            }
        }
    }

    /// The weights' gradients: per module, the target's (at `scale`) against the fp32 run's;
    /// `low_dtype` is the target's 16-bit dtype, the range a gradient computed in 16 bits is
    /// measured against even when it reaches an fp32 weight. Also returns the first weight with
    /// non-finite gradients.
    pub(crate) fn weight_grads(
        &self,
        variables: &[String],
        target: &[Tensor],
        fp32: &[Tensor],
        scale: f64,
        low_dtype: Kind,
    ) -> Result<(BTreeMap<String, Acc>, Option<FirstWeight>)> {
        let mut s = self.lock();
        let mut out: BTreeMap<String, Acc> = BTreeMap::new();
        let mut first = None;
        for (i, name) in variables.iter().enumerate() {
            let (Some(t), r) = (target.get(i).filter(|t| t.defined()), fp32.get(i).filter(|t| t.defined())) else {
                continue;
            };
            let low = s.weight_low.get(i).copied().unwrap_or(false) || is_low_precision(t.kind());
            let range = if low { DtypeRange::of(low_dtype).or_else(|| DtypeRange::of(t.kind())) } else { None };
            let acc = measure(t, r, scale, range)?;
            if acc.non_finite() > 0 && first.is_none() {
                first = Some((name.clone(), dtype_name(t.kind())));
            }
            let module = parent_path(name).to_string();
            if low {
                if let Some(r) = r {
                    let h = exponent_histogram(r)?;
                    add_histogram(s.histograms.entry(module.clone()).or_default(), &h);
                }
            }
            out.entry(module).or_default().add(&acc);
        }
        Ok((out, first))
    }

    /// Everything recorded; the recorder is left empty.
    pub(crate) fn finish(&self) -> Recorded {
        let mut s = self.lock();
        s.ref_ops.clear();
        Recorded { ops: std::mem::take(&mut s.ops), histograms: std::mem::take(&mut s.histograms) }
    }
}

impl State {
    fn reference_forward(&mut self, ev: Observed) -> Result<()> {
        let index = self.ref_ops.len();
        self.ref_ops.push(RefOp { outputs: clones(&ev.tensors)?, grads: None });
        self.ref_slot.insert(ev.op, index);
        self.ref_by_name.entry(ev.name).or_default().push(index);
        Ok(())
    }

    fn reference_backward(&mut self, ev: Observed) -> Result<()> {
        let Some(&i) = self.ref_slot.get(&ev.op) else { return Ok(()) };
        let grads = clones(&ev.tensors)?;
        self.ref_ops[i].grads = Some(grads);
        Ok(())
    }

    fn target_forward(&mut self, ev: Observed) -> Result<()> {
        let (module, inferred) = self.modules.attribute(&ev.weights);
        let occurrence = self.seen.entry(ev.name.clone()).or_insert(0);
        let ref_op = self.ref_by_name.get(&ev.name).and_then(|v| v.get(*occurrence)).copied();
        *occurrence += 1;
        let refs = ref_op.map(|i| self.ref_ops[i].outputs.as_slice());
        let forward = measure_all(&ev.tensors, refs, 1.0)?;
        if forward.low_precision() {
            for &w in &ev.weights {
                if let Some(flag) = self.weight_low.get_mut(w) {
                    *flag = true;
                }
            }
        }
        self.slot.insert(ev.op, self.ops.len());
        self.ops.push(OpRecord {
            name: ev.name,
            module,
            inferred,
            input_kinds: ev.input_kinds,
            forward: Some(forward),
            backward: None,
            backward_order: None,
            ref_op,
        });
        Ok(())
    }

    fn target_backward(&mut self, ev: Observed, scale: f64) -> Result<()> {
        let Some(&i) = self.slot.get(&ev.op) else { return Ok(()) };
        let ref_grads = self.ops[i].ref_op.and_then(|r| self.ref_ops.get(r)).and_then(|r| r.grads.as_deref());
        let acc = measure_all(&ev.tensors, ref_grads, scale)?;
        if acc.low_precision() {
            if let Some(refs) = ref_grads {
                let module = self.ops[i].module.clone();
                for r in refs {
                    let h = exponent_histogram(r)?;
                    add_histogram(self.histograms.entry(module.clone()).or_default(), &h);
                }
            }
        }
        let order = self.backward_seen;
        self.backward_seen += 1;
        let rec = &mut self.ops[i];
        match rec.backward.as_mut() {
            Some(b) => b.add(&acc),
            None => rec.backward = Some(acc),
        }
        rec.backward_order.get_or_insert(order);
        Ok(())
    }
}

/// Where the target run first produced inf or NaN: the first op in call order whose outputs
/// hold one, else the first gradient of an op's outputs in backward order, else the first
/// weight gradient.
pub(crate) fn first_non_finite(
    ops: &[OpRecord],
    weight: Option<(String, String)>,
    scale: f64,
) -> Option<NonFiniteOrigin> {
    let origin = |phase, op: &OpRecord, acc: &Acc| NonFiniteOrigin {
        phase,
        op: op.name.clone(),
        module: op.module.clone(),
        dtype: acc.stats().dtype,
        loss_scale: scale,
    };
    if let Some((op, acc)) = ops.iter().find_map(|o| o.forward.as_ref().filter(|a| a.non_finite() > 0).map(|a| (o, a)))
    {
        return Some(origin(Phase::Forward, op, acc));
    }
    let mut backward: Vec<(&OpRecord, &Acc, usize)> = ops
        .iter()
        .filter_map(|o| Some((o, o.backward.as_ref().filter(|a| a.non_finite() > 0)?, o.backward_order?)))
        .collect();
    backward.sort_by_key(|(_, _, order)| *order);
    if let Some((op, acc, _)) = backward.first() {
        return Some(origin(Phase::Backward, op, acc));
    }
    weight.map(|(name, dtype)| NonFiniteOrigin {
        phase: Phase::Backward,
        op: WEIGHT_GRADIENT.to_string(),
        module: name,
        dtype,
        loss_scale: scale,
    })
}
