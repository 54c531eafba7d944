//! One diagnostic step: the same weights and batch forward and backward in fp32, then at the
//! target set-up, with the op observer on; the model's variables, the random generators and the
//! autocast state are as before afterwards.
use tch::nn::{Module, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};

use super::advice::{self, Context, Path};
use super::record::{first_non_finite, Recorder, Stage};
use super::report::{DoctorReport, Losses};
use crate::cast::disable::{disable_casts, without_casts};
use crate::dtype::{dtype_name, is_floating, is_low_precision, DtypeRange};
use crate::error::{check_loss_value, AmpError, ConfigError, Result, TorchContext};
use crate::model::wrapper::set_kind;
use crate::model::{AmpInputs, AmpModel};
use crate::scaling::LossScaler;
use crate::sys::observer::{self, Observer};
use crate::torch_amp::GradScalerOptions;
use crate::{Amp, AmpConfig, Autocast};

/// The set-up a [`Doctor`] diagnoses.
#[derive(Debug, Clone)]
pub enum Target {
    /// Apex's path: an opt level (O1, O2 or O3) with its overrides, as `initialize` takes it.
    Apex(Box<AmpConfig>),
    /// torch.amp's path: the forward under this autocast; fp16 backward at a GradScaler's scale.
    Autocast(Autocast),
}

/// The precision doctor: runs one batch in fp32 and at a target set-up and reports, per op and
/// module, forward and backward, what the 16-bit type does to the values (see the module docs).
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch::nn;
/// use tch::{Device, Kind, Tensor};
/// use tch_amp::doctor::Doctor;
/// use tch_amp::{AmpConfig, CpuKernels, OptLevel};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let net = nn::seq()
///     .add(nn::linear(vs.root() / "fc1", 8, 16, Default::default()))
///     .add_fn(|t| t.relu())
///     .add(nn::linear(vs.root() / "fc2", 16, 4, Default::default()));
/// let x = Tensor::randn([32, 8], (Kind::Float, Device::Cpu));
/// let y = Tensor::randn([32, 4], (Kind::Float, Device::Cpu));
/// let config = AmpConfig::new(OptLevel::O2).cpu_kernels(CpuKernels::Emulate);
/// let report = Doctor::apex(config).run(&vs, |pass| {
///     let out = pass.forward(&net, &x);
///     out.mse_loss(&y, tch::Reduction::Mean)
/// })?;
/// assert!(report.trains_fine(), "{}", report.summary());
/// assert_eq!(report.module("fc1").unwrap().forward.as_ref().unwrap().dtype, "fp16");
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Doctor {
    target: Target,
    loss_scale: Option<f64>,
}

/// One run of the model inside [`Doctor::run`]: the fp32 run, then the target run. Model code
/// passes its inputs and outputs through it (O2/O3's model wrapper casts them, as
/// [`crate::AmpModel`] does in training); everything else it does is as in training.
#[derive(Debug)]
pub struct Pass<'a> {
    wrapper: AmpModel<()>,
    reference: bool,
    recorder: &'a Recorder,
}

/// While alive, the thread's top-level ops are not observed (the doctor's own ops).
struct Paused(bool);

impl Paused {
    fn new() -> Self {
        Paused(observer::pause(true).unwrap_or(false))
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = observer::pause(self.0);
    }
}

impl Pass<'_> {
    /// Whether this is the fp32 run.
    pub fn is_reference(&self) -> bool {
        self.reference
    }

    /// A floating input cast as the target's model wrapper casts it (fp16 under O2/O3;
    /// unchanged otherwise). Integer and bool tensors pass through.
    pub fn cast_input(&self, xs: &Tensor) -> Tensor {
        // The doctor's own ops are not observed.
        let _p = Paused::new();
        let cast = self.wrapper.cast_input(xs);
        if cast.kind() != xs.kind() {
            self.recorder.record_input_cast(&cast, xs);
        }
        cast
    }

    /// Several inputs cast as [`Self::cast_input`] casts one (see [`crate::AmpModel::cast_inputs`]).
    pub fn cast_inputs<I: AmpInputs>(&self, inputs: I) -> I::Cast {
        inputs.cast_each(&|t| self.cast_input(t))
    }

    /// A floating output cast as the target's model wrapper casts it (to fp32 under O2/O3).
    pub fn cast_output(&self, ys: &Tensor) -> Tensor {
        let _p = Paused::new();
        self.wrapper.cast_output(ys)
    }

    /// `model.forward(xs)` with the wrapper's casts.
    pub fn forward<M: Module>(&self, model: &M, xs: &Tensor) -> Tensor {
        self.cast_output(&model.forward(&self.cast_input(xs)))
    }

    /// `model.forward_t(xs, train)` with the wrapper's casts.
    pub fn forward_t<M: ModuleT>(&self, model: &M, xs: &Tensor, train: bool) -> Tensor {
        self.cast_output(&model.forward_t(&self.cast_input(xs), train))
    }
}

/// The model's variables and the random generators as they were, put back before each run and
/// at the end (also when the model's code panics).
struct Saved {
    // (the variable, its data as it was, a copy of its values)
    vars: Vec<(Tensor, Tensor, Tensor)>,
    rng: Vec<(Device, Tensor)>,
}

impl Saved {
    fn capture(vars: &[Tensor], device: Device) -> Result<Self> {
        let _no_grad = tch::no_grad_guard();
        let mut saved = Vec::with_capacity(vars.len());
        for v in vars {
            let data = v.f_detach().ctx("doctor: saving a variable")?;
            let copy = data.f_detach_copy().ctx("doctor: saving a variable")?;
            saved.push((v.shallow_clone(), data, copy));
        }
        let mut rng = vec![(Device::Cpu, observer::rng_state(Device::Cpu)?)];
        if let Device::Cuda(_) = device {
            rng.push((device, observer::rng_state(device)?));
        }
        Ok(Self { vars: saved, rng })
    }

    fn restore(&self) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        for (var, data, copy) in &self.vars {
            let mut v = var.shallow_clone();
            v.f_set_data(data).ctx("doctor: restoring a variable")?;
            if !data.equal(copy) {
                let mut d = data.shallow_clone();
                d.f_copy_(copy).ctx("doctor: restoring a variable")?;
            }
        }
        for (device, state) in &self.rng {
            observer::set_rng_state(*device, state)?;
        }
        Ok(())
    }
}

impl Drop for Saved {
    fn drop(&mut self) {
        let _ = self.restore();
    }
}

/// What the target set-up means for the run.
struct Plan {
    label: String,
    ctx: Context,
}

impl Doctor {
    /// A doctor for `target`.
    pub fn new(target: Target) -> Self {
        Self { target, loss_scale: None }
    }

    /// A doctor for Apex's path at `config` (O1, O2 or O3).
    pub fn apex(config: AmpConfig) -> Self {
        Self::new(Target::Apex(Box::new(config)))
    }

    /// A doctor for torch.amp's path under `autocast`.
    pub fn autocast(autocast: Autocast) -> Self {
        Self::new(Target::Autocast(autocast))
    }

    /// The loss scale of the target run's backward (default: the configuration's initial scale,
    /// 2^16 for a dynamic one; torch.amp: a GradScaler's 2^16 for fp16, 1 for bf16). Pass the
    /// training's current scale (`amp.loss_scale(0)?`, `scaler.get_scale()`) to diagnose it.
    pub fn loss_scale(mut self, scale: f64) -> Self {
        self.loss_scale = Some(scale);
        self
    }

    fn plan(&self, device: Device) -> Result<Plan> {
        let scale_override =
            self.loss_scale.map(|s| crate::config::rules::positive_scale("loss_scale", s)).transpose()?;
        let (label, path, low, scale, dynamic, floor, max_scale) = match &self.target {
            Target::Apex(config) => {
                let props = config.build()?;
                let low = props.low_precision_kind().ok_or_else(|| {
                    AmpError::Config(ConfigError::InvalidOption {
                        option: "opt_level",
                        value: format!("{} (enabled: {})", props.opt_level(), props.enabled()),
                        expected: "an enabled O1, O2 or O3 set-up (O0 is the fp32 run the doctor compares with)",
                    })
                })?;
                // The scaler `initialize` would make: its initial scale, floor and cap.
                let scaler = LossScaler::new(&props);
                let dynamic = scaler.is_dynamic();
                let floor = dynamic.then(|| scaler.min_loss_scale());
                let label = format!("{} {}", props.opt_level(), dtype_name(low));
                (
                    label,
                    Path::Apex(props.opt_level()),
                    low,
                    scaler.loss_scale(),
                    dynamic,
                    floor,
                    scaler.max_loss_scale(),
                )
            }
            Target::Autocast(a) => {
                let same_type =
                    matches!((a.device(), device), (Device::Cpu, Device::Cpu) | (Device::Cuda(_), Device::Cuda(_)));
                if !same_type {
                    return Err(AmpError::Config(ConfigError::InvalidOption {
                        option: "autocast device",
                        value: format!("{:?} (the model is on {device:?})", a.device()),
                        expected: "the device type of the model's VarStore",
                    }));
                }
                let low = a.resolved_dtype()?;
                let fp16 = low == Kind::Half;
                // A GradScaler's default initial scale for fp16; bf16 needs none.
                let scale = if fp16 { GradScalerOptions::default().init_scale } else { 1.0 };
                // No cap but fp32's: the scale multiplies the loss in fp32.
                let cap = LossScaler::SCALE_RANGE.1;
                (format!("autocast {}", dtype_name(low)), Path::Autocast, low, scale, fp16, None, cap)
            }
        };
        let range = DtypeRange::of(low).ok_or_else(|| {
            AmpError::Config(ConfigError::InvalidOption {
                option: "low_precision_dtype",
                value: format!("{low:?}"),
                expected: "Kind::Half or Kind::BFloat16",
            })
        })?;
        let scale = scale_override.unwrap_or(scale);
        Ok(Plan {
            label,
            ctx: Context { path, device, low, range, scale, dynamic, floor, max_scale: max_scale.max(scale) },
        })
    }

    /// Runs the diagnosis on the model whose variables `vs` holds: `forward` computes the loss
    /// of one batch (called twice: the fp32 run, then the target run); its inputs and outputs go
    /// through the [`Pass`] it gets. The backward runs here (`forward` must not call it). The
    /// variables (dtypes, values, `requires_grad`), their gradients, BatchNorm statistics, the
    /// random generators (so dropout draws the same masks in both runs) and the thread's
    /// autocast state are as before afterwards; optimizers and scalers are not touched.
    ///
    /// Run it outside any autocast scope or `Amp` of the thread's training is fine: both runs
    /// start with casts off and set up their own.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for an O0 or disabled configuration, a dtype other than
    /// fp16/bf16, an autocast for another device type than the model's, a VarStore without
    /// trainable floating variables, or a non-positive `loss_scale`; the configuration's own
    /// errors ([`AmpConfig::build`]); [`UsageError::BadLoss`](crate::error::UsageError::BadLoss)
    /// when `forward` returns something that is not a single value with an autograd graph;
    /// [`AmpError::Torch`] from libtorch. The model is restored in every case.
    pub fn run(&self, vs: &VarStore, mut forward: impl FnMut(&Pass<'_>) -> Tensor) -> Result<DoctorReport> {
        let device = vs.device();
        let plan = self.plan(device)?;
        let ctx = plan.ctx;
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
        let tensors: Vec<Tensor> = named.iter().map(|(_, t)| t.shallow_clone()).collect();
        let trainable: Vec<usize> =
            (0..named.len()).filter(|&i| tensors[i].requires_grad() && is_floating(tensors[i].kind())).collect();
        if trainable.is_empty() {
            return Err(AmpError::Config(ConfigError::InvalidOption {
                option: "vs",
                value: "no trainable floating variable".into(),
                expected: "the VarStore of the model the loss is computed from",
            }));
        }
        let train_names: Vec<String> = trainable.iter().map(|&i| names[i].clone()).collect();
        let train_vars: Vec<Tensor> = trainable.iter().map(|&i| tensors[i].shallow_clone()).collect();

        let saved = Saved::capture(&tensors, device)?;
        let recorder = Recorder::new(&names);
        let observer = Observer::start(&tensors, recorder.handler())?;

        // The fp32 run: every floating variable in fp32, no casts.
        saved.restore()?;
        for t in &tensors {
            if is_low_precision(t.kind()) {
                set_kind(t, Kind::Float)?;
            }
        }
        observer.reset()?;
        recorder.begin(Stage::Reference);
        let fp32 = {
            let _off = disable_casts()?;
            let pass = Pass { wrapper: AmpModel::new((), None, None), reference: true, recorder: &recorder };
            let loss = forward(&pass);
            backward(&loss, 1.0, &train_vars)
        };
        recorder.begin(Stage::Idle);
        let (fp32_loss, fp32_grads) = fp32?;
        if let Some(e) = recorder.take_error() {
            return Err(e);
        }

        // The target run.
        saved.restore()?;
        observer.reset()?;
        recorder.begin(Stage::Target { scale: ctx.scale });
        let target = match &self.target {
            Target::Apex(config) => {
                let _off = disable_casts()?;
                let amp = Amp::new(&AmpConfig::clone(config).verbosity(0))?;
                let (wrapper, _) = amp.cast_model_with_report(vs, ())?;
                let pass = Pass { wrapper, reference: false, recorder: &recorder };
                let loss = forward(&pass);
                backward(&loss, ctx.scale, &train_vars)
            }
            Target::Autocast(autocast) => {
                let _off = disable_casts()?;
                let pass = Pass { wrapper: AmpModel::new((), None, None), reference: false, recorder: &recorder };
                let loss = {
                    let _scope = autocast.enter()?;
                    forward(&pass)
                };
                backward(&loss, ctx.scale, &train_vars)
            }
        };
        recorder.begin(Stage::Idle);
        drop(observer);
        let (target_loss, target_grads) = target?;
        if let Some(e) = recorder.take_error() {
            return Err(e);
        }
        let (weight_grads, weight_origin) =
            recorder.weight_grads(&train_names, &target_grads, &fp32_grads, ctx.scale, ctx.low)?;
        let recorded = recorder.finish();
        saved.restore()?;
        drop(saved);

        let window = advice::scale_window(&ctx, &recorded.ops, &weight_grads, &recorded.histograms);
        let forward_non_finite =
            recorded.ops.iter().position(|o| o.forward.as_ref().is_some_and(|a| a.non_finite() > 0));
        let (findings, modules) =
            advice::diagnose(&ctx, &recorded.ops, &weight_grads, window.as_ref(), forward_non_finite);
        Ok(DoctorReport {
            target: plan.label,
            range: ctx.range,
            device: format!("{device:?}"),
            loss_scale: ctx.scale,
            dynamic_scale: ctx.dynamic,
            loss: Losses { fp32: fp32_loss, target: target_loss },
            ops: recorded.ops.iter().enumerate().map(|(i, o)| o.report(i)).collect(),
            modules,
            first_non_finite: first_non_finite(&recorded.ops, weight_origin, ctx.scale),
            scale_window: window,
            findings,
        })
    }
}

/// Back-propagates `loss * scale` (in fp32) to `vars` with casts off, as training does, without
/// touching their `.grad`; returns the loss and the gradients (undefined for unused variables).
fn backward(loss: &Tensor, scale: f64, vars: &[Tensor]) -> Result<(f64, Vec<Tensor>)> {
    check_loss_value(loss, "the precision doctor")?;
    let _p = Paused::new();
    let value = loss.f_double_value(&[]).ctx("doctor: reading the loss")?;
    let scaled = loss.f_to_kind(Kind::Float).and_then(|l| l.f_mul_scalar(scale)).ctx("doctor: scaling the loss")?;
    let grads = without_casts(|| Tensor::f_run_backward(&[&scaled], vars, false, false))?.ctx("doctor: backward")?;
    Ok((value, grads))
}
