//! The AMP handle: properties, one loss scaler per loss, `scale_loss`, and the factory for
//! cast models and AMP optimizers.
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

use tch::nn::VarStore;
use tch::{Device, Kind, TchError, Tensor};

use crate::amp_optimizer::AmpOptimizer;
use crate::cast_model::{cast_var_store, CastReport};
use crate::config::AmpConfig;
use crate::error::{AmpError, Result, TorchContext};
use crate::master_weights::build_entries;
use crate::model::AmpModel;
use crate::o1::{install_policy, without_casts, ActivePolicyGuard, CastPolicy, O1Settings, PolicyHandle};
use crate::optim::OptimizerConfig;
use crate::properties::Properties;
use crate::scaler::LossScaler;

static NEXT_AMP_ID: AtomicU64 = AtomicU64::new(1);

/// The cast policy an `Amp` keeps active on its thread: Apex's O1 lists, or under O2/O3 on CPU
/// the emulation-only policy. Guards drop before the handle (field order).
#[derive(Debug)]
struct CastRuntime {
    _active: Vec<ActivePolicyGuard>,
    _handle: PolicyHandle,
}

impl CastRuntime {
    fn for_properties(p: &Properties) -> Result<Option<Self>> {
        if !p.enabled {
            return Ok(None);
        }
        let settings = O1Settings::default()
            .allow_banned(p.allow_banned)
            .emulate_cpu(p.emulate_low_precision_on_cpu);
        let (policy, settings, devices) = if p.patch_torch_functions {
            let mut devices = vec![Device::Cpu];
            if tch::Cuda::is_available() {
                devices.push(Device::Cuda(0));
            }
            (p.cast_policy.clone(), settings.low_dtype(p.low_precision_dtype), devices)
        } else {
            match p.cast_model_type {
                Some(k @ (Kind::Half | Kind::BFloat16)) if p.emulate_low_precision_on_cpu => {
                    (CastPolicy::emulation_only(), settings.low_dtype(k), vec![Device::Cpu])
                }
                _ => return Ok(None),
            }
        };
        let handle = install_policy(policy, settings)?;
        let active = devices.into_iter().map(|d| handle.activate(d)).collect::<Result<Vec<_>>>()?;
        Ok(Some(Self { _active: active, _handle: handle }))
    }
}

/// Options of one [`Amp::scale_loss_with`] call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScaleLossOptions {
    /// Which loss scaler (`0..num_losses`).
    pub loss_id: usize,
    /// Keep the gradients scaled and accumulate them; no unscale, no overflow check, no scale
    /// update until a later call without it (Apex's `delay_unscale`).
    pub delay_unscale: bool,
}

/// What one `scale_loss` did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleLossOutcome {
    /// The loss scaler used.
    pub loss_id: usize,
    /// The scale the loss was multiplied by.
    pub loss_scale: f64,
    /// inf/NaN found in the new gradients (always false for static scaling and delayed passes).
    pub overflow: bool,
    /// The scaler's scale after this pass.
    pub new_loss_scale: f64,
    /// The gradients were left scaled (`delay_unscale`).
    pub delayed: bool,
    /// The loss went to `backward` unscaled and unchecked (disabled AMP, or static scale 1.0
    /// without master weights, as in Apex).
    pub passed_through: bool,
}

/// The state `initialize` creates: resolved [`Properties`] and one [`LossScaler`] per loss.
///
/// Not `Send`: under O1 the cast policy is active on the thread that created it.
#[derive(Debug)]
pub struct Amp {
    id: u64,
    props: Properties,
    scalers: Vec<LossScaler>,
    casts: Option<CastRuntime>,
    _thread_bound: PhantomData<*const ()>,
}

impl Amp {
    /// Resolves `config` (Apex's rules checked), makes the scalers and, under O1, installs the
    /// cast policy and activates it on this thread (CPU, and CUDA when available) for as long as
    /// the `Amp` lives. Under O2/O3 with an fp16/bf16 model and CPU emulation on (the default),
    /// the emulation-only policy is activated for CPU the same way.
    ///
    /// # Errors
    /// Any rejection of [`AmpConfig::build`]; the policy's errors (an unknown op in a user
    /// cast: [`AmpError::UnknownOp`]).
    pub fn new(config: &AmpConfig) -> Result<Self> {
        Self::from_properties(config.build()?)
    }

    /// An `Amp` from already resolved properties.
    ///
    /// # Errors
    /// As [`Self::new`], for the cast policy.
    pub fn from_properties(props: Properties) -> Result<Self> {
        let scalers = (0..props.num_losses).map(|_| LossScaler::new(&props)).collect();
        if props.verbosity >= 2 {
            println!("tch-amp: {props:?}");
        }
        let casts = CastRuntime::for_properties(&props)?;
        Ok(Self { id: NEXT_AMP_ID.fetch_add(1, Ordering::Relaxed), props, scalers, casts, _thread_bound: PhantomData })
    }

    /// Whether a cast policy (O1, or the CPU emulation under O2/O3) is active on this thread
    /// through this `Amp`.
    pub fn casts_active(&self) -> bool {
        self.casts.is_some()
    }

    /// The resolved options.
    pub fn properties(&self) -> &Properties {
        &self.props
    }

    /// All loss scalers, by loss id.
    pub fn scalers(&self) -> &[LossScaler] {
        &self.scalers
    }

    /// The scaler of `loss_id`.
    ///
    /// # Errors
    /// [`AmpError::LossIdOutOfRange`].
    pub fn scaler(&self, loss_id: usize) -> Result<&LossScaler> {
        self.scalers.get(loss_id).ok_or(AmpError::LossIdOutOfRange { loss_id, num_losses: self.scalers.len() })
    }

    pub(crate) fn scalers_mut(&mut self) -> &mut [LossScaler] {
        &mut self.scalers
    }

    /// The current scale of `loss_id`.
    ///
    /// # Errors
    /// [`AmpError::LossIdOutOfRange`].
    pub fn loss_scale(&self, loss_id: usize) -> Result<f64> {
        Ok(self.scaler(loss_id)?.loss_scale())
    }

    /// Casts the model held by `vs` as the opt level says (O2/O3: floating variables to fp16
    /// in place, affine batch norms kept fp32 under `keep_batchnorm_fp32`; O0: to fp32) and
    /// wraps `model` so floating inputs are cast to the model's dtype and outputs to fp32 (or
    /// `cast_model_outputs`).
    ///
    /// # Errors
    /// [`AmpError::Torch`] if a cast fails.
    pub fn cast_model<M>(&self, vs: &VarStore, model: M) -> Result<AmpModel<M>> {
        Ok(self.cast_model_with_report(vs, model)?.0)
    }

    /// [`Self::cast_model`], also saying which variables were cast and which kept.
    ///
    /// # Errors
    /// As [`Self::cast_model`].
    pub fn cast_model_with_report<M>(&self, vs: &VarStore, model: M) -> Result<(AmpModel<M>, CastReport)> {
        let p = &self.props;
        match (p.enabled, p.cast_model_type) {
            (true, Some(kind)) => {
                let report = cast_var_store(vs, kind, p.keep_batchnorm_fp32)?;
                let out = p.cast_model_outputs.unwrap_or(Kind::Float);
                Ok((AmpModel::new(model, Some(kind), Some(out)), report))
            }
            (true, None) => Ok((AmpModel::new(model, None, p.cast_model_outputs), CastReport::default())),
            (false, _) => Ok((AmpModel::new(model, None, None), CastReport::default())),
        }
    }

    /// An optimizer over every trainable variable of `vs` (fp32 masters of the fp16 ones when
    /// master weights are on). Cast the model first.
    ///
    /// # Errors
    /// [`AmpError::InvalidOption`] for a bad learning rate.
    pub fn optimizer(&self, vs: &VarStore, config: impl Into<OptimizerConfig>, lr: f64) -> Result<AmpOptimizer> {
        self.optimizer_for(vs, &[], config, lr)
    }

    /// An optimizer over the trainable variables of `vs` under the given path prefixes (whole
    /// segments: `"layer1"` selects `layer1.*`, never `layer10.*`); an empty list selects all.
    ///
    /// # Errors
    /// [`AmpError::Usage`] when no variable lies under the prefixes; as [`Self::optimizer`].
    pub fn optimizer_for(
        &self,
        vs: &VarStore,
        prefixes: &[&str],
        config: impl Into<OptimizerConfig>,
        lr: f64,
    ) -> Result<AmpOptimizer> {
        let p = &self.props;
        let masters = p.enabled && p.master_weights;
        let entries = build_entries(vs, prefixes, masters)?;
        let disable_casts = p.enabled && p.patch_torch_functions;
        AmpOptimizer::new(self.id, config.into(), lr, entries, disable_casts, p.verbosity)
    }

    /// [`Self::scale_loss_with`] for loss 0, no delay.
    ///
    /// # Errors
    /// As [`Self::f_scale_loss_with`].
    pub fn scale_loss(
        &mut self,
        loss: &Tensor,
        optimizers: &mut [&mut AmpOptimizer],
        backward: impl FnOnce(&Tensor),
    ) -> Result<ScaleLossOutcome> {
        self.scale_loss_with(loss, optimizers, ScaleLossOptions::default(), backward)
    }

    /// Apex's `with amp.scale_loss(loss, optimizers, loss_id, delay_unscale=..) as scaled:
    /// scaled.backward()`: `backward` gets `loss.float() * scale`; afterwards the new
    /// gradients are unscaled into the fp32 master gradients (or in place), checked for
    /// inf/NaN (dynamic scaling, one host sync), the scale updated, and on overflow every
    /// optimizer given here skips its next step. Pass every optimizer whose parameters this
    /// loss reaches.
    ///
    /// # Errors
    /// As [`Self::f_scale_loss_with`].
    pub fn scale_loss_with(
        &mut self,
        loss: &Tensor,
        optimizers: &mut [&mut AmpOptimizer],
        options: ScaleLossOptions,
        backward: impl FnOnce(&Tensor),
    ) -> Result<ScaleLossOutcome> {
        self.f_scale_loss_with(loss, optimizers, options, |scaled| {
            backward(scaled);
            Ok(())
        })
    }

    /// [`Self::scale_loss_with`] with a fallible `backward` (e.g. `|s| s.f_backward()`).
    ///
    /// # Errors
    /// [`AmpError::LossIdOutOfRange`]; [`AmpError::Usage`] for an optimizer of another
    /// `Amp`; [`AmpError::Torch`] from `backward` or from unscaling.
    pub fn f_scale_loss_with(
        &mut self,
        loss: &Tensor,
        optimizers: &mut [&mut AmpOptimizer],
        options: ScaleLossOptions,
        backward: impl FnOnce(&Tensor) -> std::result::Result<(), TchError>,
    ) -> Result<ScaleLossOutcome> {
        let ScaleLossOptions { loss_id, delay_unscale } = options;
        let num_losses = self.scalers.len();
        let scaler = self.scalers.get(loss_id).ok_or(AmpError::LossIdOutOfRange { loss_id, num_losses })?;
        if let Some(o) = optimizers.iter().find(|o| o.amp_id != self.id) {
            return Err(AmpError::Usage(format!(
                "an optimizer given to scale_loss was made by another Amp (id {}), not this one (id {})",
                o.amp_id, self.id
            )));
        }
        for (i, a) in optimizers.iter().enumerate() {
            if optimizers[..i].iter().any(|b| std::ptr::eq(&**a, &**b)) {
                return Err(AmpError::Usage("the same optimizer was given twice to scale_loss".into()));
            }
        }
        let scale = scaler.loss_scale();
        let dynamic = scaler.is_dynamic();
        let p = &self.props;
        let patch = p.enabled && p.patch_torch_functions;
        let pass_through = !p.enabled || (!p.master_weights && !dynamic && scale == 1.0);
        if pass_through {
            let l = if p.enabled { loss.f_to_kind(Kind::Float).ctx("loss.float()")? } else { loss.shallow_clone() };
            let r = self.run_backward(backward, &l)?;
            if patch {
                crate::o1::clear_cast_cache()?;
            }
            r?;
            return Ok(ScaleLossOutcome {
                loss_id,
                loss_scale: scale,
                overflow: false,
                new_loss_scale: scale,
                delayed: false,
                passed_through: true,
            });
        }
        if !delay_unscale {
            for o in optimizers.iter_mut() {
                o.prepare_backward()?;
            }
        }
        let scaled = (loss.f_to_kind(Kind::Float).ctx("loss.float()")? * scale).shallow_clone();
        let r = self.run_backward(backward, &scaled)?;
        if patch {
            crate::o1::clear_cast_cache()?;
        }
        r?;
        if delay_unscale {
            for o in optimizers.iter_mut() {
                o.scaled_pending = true;
            }
            return Ok(ScaleLossOutcome {
                loss_id,
                loss_scale: scale,
                overflow: false,
                new_loss_scale: scale,
                delayed: true,
                passed_through: false,
            });
        }
        let device = optimizers
            .iter()
            .flat_map(|o| o.entries.first().map(|e| e.model.device()))
            .next()
            .unwrap_or(Device::Cpu);
        let found_inf = Tensor::f_zeros([1], (Kind::Float, device)).ctx("found_inf")?;
        let inv_scale = Tensor::f_full([1], 1.0 / scale, (Kind::Float, device)).ctx("inv_scale")?;
        for o in optimizers.iter_mut() {
            o.post_backward(&found_inf, &inv_scale)?;
        }
        // The one host sync of a dynamic step.
        let overflow = dynamic && found_inf.f_double_value(&[0]).ctx("reading the overflow flag")? != 0.0;
        let scaler = &mut self.scalers[loss_id];
        let skip = scaler.update(overflow);
        let new_scale = scaler.loss_scale();
        if skip {
            for o in optimizers.iter_mut() {
                o.mark_skip(loss_id, new_scale);
            }
        }
        Ok(ScaleLossOutcome {
            loss_id,
            loss_scale: scale,
            overflow,
            new_loss_scale: new_scale,
            delayed: false,
            passed_through: false,
        })
    }

}

impl Amp {
    /// Runs the user's backward with the cast policy off on this thread, so that backward ops
    /// (on CUDA, also those on autograd's device threads, which inherit autocast's state) are
    /// never cast: as under Apex, backward runs in the dtypes the forward's casts gave it.
    fn run_backward(
        &self,
        backward: impl FnOnce(&Tensor) -> std::result::Result<(), TchError>,
        loss: &Tensor,
    ) -> Result<std::result::Result<(), AmpError>> {
        if self.casts.is_some() {
            Ok(without_casts(|| backward(loss).ctx("backward"))?)
        } else {
            Ok(backward(loss).ctx("backward"))
        }
    }
}

/// Apex's `model, optimizer = amp.initialize(model, optimizer, opt_level=...)` for the common
/// case of one model (all of `vs`) and one optimizer: casts the model, builds the optimizer
/// over its trainable variables, and returns both with the [`Amp`] handle.
///
/// # Errors
/// As [`AmpConfig::build`], [`Amp::cast_model`] and [`Amp::optimizer`].
pub fn initialize<M>(
    vs: &VarStore,
    model: M,
    optimizer: impl Into<OptimizerConfig>,
    lr: f64,
    config: &AmpConfig,
) -> Result<(AmpModel<M>, AmpOptimizer, Amp)> {
    let amp = Amp::new(config)?;
    let model = amp.cast_model(vs, model)?;
    let opt = amp.optimizer(vs, optimizer, lr)?;
    Ok((model, opt, amp))
}

