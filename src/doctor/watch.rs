//! The doctor's hook into training: while a [`Watch`] is alive on a thread, the op observer flags
//! each top-level op of the thread's forward, and the gradients of its outputs in backward, that
//! hold inf/NaN (one reduction per tensor, on its device, read only when a scaler skips a step).
//! A scaler that skips asks where the first inf/NaN of the batch was; the answer rides on Apex's
//! overflow report and `ScaleCollapsed` error, and on torch.amp's GradScaler's log line.
use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use super::record::Modules;
use super::report::{NonFiniteOrigin, Phase};
use crate::dtype::dtype_name;
use crate::error::{Result, TorchContext};
use crate::sys::observer::{Observed, ObservedKind, Observer};

/// More flags than this in one batch (no scaler asks): the oldest are dropped.
const MAX_FLAGS: usize = 1 << 16;

#[derive(Debug)]
struct Flag {
    phase: Phase,
    name: String,
    module: String,
    dtype: Kind,
    non_finite: Tensor,
}

#[derive(Debug)]
struct Inner {
    modules: Modules,
    ops: HashMap<usize, (String, String)>,
    flags: Vec<Flag>,
    last: Option<NonFiniteOrigin>,
}

#[derive(Debug)]
struct State {
    inner: Mutex<Inner>,
}

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn observe(&self, ev: Observed) {
        let Some(first) = ev.tensors.first() else { return };
        let dtype = first.kind();
        // Any inf/NaN among the tensors, as a 0-dim bool on their device.
        let mut flag: Option<Tensor> = None;
        for t in &ev.tensors {
            let Ok(bad) = t.f_isfinite().and_then(|f| f.f_logical_not()).and_then(|b| b.f_any()) else { return };
            flag = Some(match flag {
                None => bad,
                Some(f) => match f.f_logical_or(&bad.f_to_device(f.device()).unwrap_or(bad)) {
                    Ok(t) => t,
                    Err(_) => return,
                },
            });
        }
        let Some(non_finite) = flag else { return };
        let mut s = self.lock();
        if s.flags.len() >= MAX_FLAGS {
            s.flags.clear();
        }
        let (phase, name, module) = match ev.kind {
            ObservedKind::Forward => {
                let (module, _) = s.modules.attribute(&ev.weights);
                s.ops.insert(ev.op, (ev.name.clone(), module.clone()));
                (Phase::Forward, ev.name, module)
            }
            ObservedKind::Backward => match s.ops.get(&ev.op) {
                Some((name, module)) => (Phase::Backward, name.clone(), module.clone()),
                None => return,
            },
        };
        s.flags.push(Flag { phase, name, module, dtype, non_finite });
    }

    /// The first flagged tensor of the batch (one transfer), then a fresh batch.
    fn first(&self, loss_scale: f64) -> Result<Option<NonFiniteOrigin>> {
        let mut s = self.lock();
        let flags = std::mem::take(&mut s.flags);
        s.ops.clear();
        s.modules.restart();
        if flags.is_empty() {
            return Ok(None);
        }
        let on_cpu = flags
            .iter()
            .map(|f| f.non_finite.f_to_device(Device::Cpu).and_then(|t| t.f_to_kind(Kind::Int64)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .ctx("reading the watch's flags")?;
        let all = Tensor::f_stack(&on_cpu, 0).ctx("reading the watch's flags")?;
        let values = Vec::<i64>::try_from(&all).ctx("reading the watch's flags")?;
        let origin = flags.iter().zip(values).find(|(_, v)| *v != 0).map(|(f, _)| NonFiniteOrigin {
            phase: f.phase,
            op: f.name.clone(),
            module: f.module.clone(),
            dtype: dtype_name(f.dtype),
            loss_scale,
        });
        if origin.is_some() {
            s.last.clone_from(&origin);
        }
        Ok(origin)
    }

    fn forget(&self) {
        let mut s = self.lock();
        s.flags.clear();
        s.ops.clear();
        s.modules.restart();
    }
}

struct Active {
    id: u64,
    observer: Observer,
    state: Arc<State>,
}

thread_local! {
    static WATCHES: RefCell<Vec<Active>> = const { RefCell::new(Vec::new()) };
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// An opt-in localization of each overflow in training (see the module docs): while alive on
/// this thread, a skipped step of Apex's `scale_loss` carries, in its
/// [`OverflowReport::first_non_finite`](crate::scaling::OverflowReport::first_non_finite) (and
/// in the log line at verbosity >= 1, and in
/// [`Divergence::ScaleCollapsed`](crate::error::Divergence::ScaleCollapsed)), the op and module
/// where the batch's first inf/NaN appeared; a skipped step of [`crate::GradScaler`] logs it as a
/// warning. [`Watch::last`] gives the latest.
///
/// It costs one reduction per top-level op output and per gradient of one, on the device, and
/// one transfer when a step is skipped; nothing once dropped.
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch::nn::{self, Module};
/// use tch::{Device, Kind, Tensor};
/// use tch_amp::{AmpConfig, CpuKernels, OptLevel};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let big = nn::linear(vs.root() / "big", 4, 4, Default::default());
/// let config = AmpConfig::new(OptLevel::O1).cpu_kernels(CpuKernels::Emulate).verbosity(0);
/// let (model, mut opt, mut amp) = tch_amp::initialize(&vs, big, nn::Sgd::default(), 0.1, &config)?;
/// let watch = tch_amp::doctor::watch(&vs)?;
/// let x = Tensor::full([2, 4], 1e5, (Kind::Float, Device::Cpu)); // overflows fp16 in `big`
/// let loss = model.forward(&x).to_kind(Kind::Float).sum(Kind::Float);
/// let outcome = amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward())?;
/// assert!(outcome.overflow);
/// let origin = amp.last_overflow(0)?.unwrap().first_non_finite.clone().unwrap();
/// assert_eq!((origin.op.as_str(), origin.module.as_str()), ("linear", "big"));
/// assert_eq!(watch.last(), Some(origin));
/// # Ok(())
/// # }
/// ```
#[must_use = "the watch ends as soon as it is dropped"]
#[derive(Debug)]
pub struct Watch {
    id: u64,
    state: Arc<State>,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Active {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Active").field("id", &self.id).finish_non_exhaustive()
    }
}

/// Starts a [`Watch`] on this thread; modules are named from `vs`'s variables (their VarStore
/// path prefixes).
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) if libtorch refuses the observer.
pub fn watch(vs: &VarStore) -> Result<Watch> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
    let tensors: Vec<Tensor> = named.into_iter().map(|(_, t)| t).collect();
    let state = Arc::new(State {
        inner: Mutex::new(Inner { modules: Modules::new(&names), ops: HashMap::new(), flags: Vec::new(), last: None }),
    });
    let handler_state = Arc::clone(&state);
    let observer = Observer::start(&tensors, Arc::new(move |ev: Observed| handler_state.observe(ev)))?;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    WATCHES.with(|w| w.borrow_mut().push(Active { id, observer, state: Arc::clone(&state) }));
    Ok(Watch { id, state, _not_send: PhantomData })
}

impl Watch {
    /// The latest localization a scaler asked for on this thread while the watch was alive.
    pub fn last(&self) -> Option<NonFiniteOrigin> {
        self.state.lock().last.clone()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Closing its observer session (the watches of a thread end in reverse order of start;
        // one dropped out of order takes the later ones' sessions down with it).
        WATCHES.with(|w| {
            let mut w = w.borrow_mut();
            if let Some(at) = w.iter().position(|a| a.id == self.id) {
                while w.len() > at {
                    w.pop();
                }
            }
        });
    }
}

/// Where the current batch's first inf/NaN appeared, when a [`Watch`] is alive on this thread;
/// a scaler calls it when it skips a step. The watch then starts a fresh batch.
pub(crate) fn overflow_origin(loss_scale: f64) -> Option<NonFiniteOrigin> {
    WATCHES.with(|w| {
        let w = w.borrow();
        let active = w.last()?;
        let origin = active.state.first(loss_scale).unwrap_or_else(|e| {
            log::warn!("tch-amp watch: {e}");
            None
        });
        let _ = active.observer.reset();
        origin
    })
}

/// Forgets the current batch's flags (a scaler calls it after a clean pass); nothing without a
/// [`Watch`].
pub(crate) fn next_batch() {
    WATCHES.with(|w| {
        if let Some(active) = w.borrow().last() {
            active.state.forget();
            let _ = active.observer.reset();
        }
    });
}
