//! [`Amp`], the handle `initialize` returns: the resolved options, one loss scaler per loss,
//! the cast engine's activation on this thread, `scale_loss`, and the factory for cast models
//! and AMP optimizers.
use crate::error::{ConfigError, UsageError};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

use tch::nn::VarStore;
use tch::{Device, Kind, TchError, Tensor};

use crate::cast::disable::without_casts;
use crate::cast::{clear_cast_cache, install_policy, CastPolicy, CpuFeatures, PolicyHandle};
use crate::config::{AmpConfig, LossScale, Properties};
use crate::error::{AmpError, Result, TorchContext};
use crate::model::{cast_var_store, AmpModel, CastReport};
use crate::optim::{
    build_entries, Algorithm, AmpOptimizer, CollapseInfo, Layout, OptimizerConfig, OptimizerSetup, ParamGroup,
    UpdateRule,
};
use crate::scaling::{self, Collapse, LossScaler, OverflowReport, ScaleLossOptions, ScaleLossOutcome};
use crate::torch_io::{Node, Value};
use crate::AutocastScope;

static NEXT_AMP_ID: AtomicU64 = AtomicU64::new(1);

/// What the properties mean for this `Amp`, resolved once (`enabled` folded in).
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Not `enabled`: everything passes through.
    disabled: bool,
    /// Optimizers step fp32 masters of the low-precision variables.
    masters: bool,
    /// O1's per-op casts are active; the step runs with them off.
    o1: bool,
    /// The model's variables are cast to this dtype, floating outputs to `.1`.
    model_cast: Option<(Kind, Kind)>,
    /// Floating outputs are cast to this dtype although the model is not (O1/O0 with
    /// `cast_model_outputs`).
    outputs_only: Option<Kind>,
}

impl Plan {
    fn new(p: &Properties) -> Self {
        let enabled = p.enabled();
        Self {
            disabled: !enabled,
            masters: enabled && p.master_weights(),
            o1: enabled && p.patch_torch_functions(),
            model_cast: p
                .cast_model_type()
                .filter(|_| enabled)
                .map(|k| (k, p.cast_model_outputs().unwrap_or(Kind::Float))),
            outputs_only: p.cast_model_outputs().filter(|_| enabled && p.cast_model_type().is_none()),
        }
    }
}

/// The cast policy an `Amp` keeps active on its thread: Apex's O1 lists, or under O2/O3 on CPU
/// the emulation-only policy. Guards drop before the handle (field order).
#[derive(Debug)]
struct CastRuntime {
    _active: Vec<AutocastScope>,
    _handle: PolicyHandle,
}

impl CastRuntime {
    fn for_properties(p: &Properties, plan: Plan) -> Result<Option<Self>> {
        let settings = p.cast_settings();
        let (policy, settings, devices) = if plan.o1 {
            let mut devices = vec![Device::Cpu];
            if tch::Cuda::is_available() {
                devices.push(Device::Cuda(0));
            }
            (p.cast_policy().clone(), settings, devices)
        } else {
            match plan.model_cast {
                Some((k @ (Kind::Half | Kind::BFloat16), _)) if settings.emulates(k) => {
                    (CastPolicy::emulation_only(), settings.low_precision_dtype(k), vec![Device::Cpu])
                }
                _ => return Ok(None),
            }
        };
        let handle = install_policy(policy, settings)?;
        let active = devices.into_iter().map(|d| handle.activate(d)).collect::<Result<Vec<_>>>()?;
        Ok(Some(Self { _active: active, _handle: handle }))
    }
}

/// The state `initialize` creates: resolved [`Properties`] and one [`LossScaler`] per loss.
///
/// Not `Send`: the cast policy (O1, or the CPU emulation under O2/O3) is active on the thread
/// that created it.
#[derive(Debug)]
pub struct Amp {
    id: u64,
    props: Properties,
    plan: Plan,
    scalers: Vec<LossScaler>,
    last_overflows: Vec<Option<OverflowReport>>,
    casts: Option<CastRuntime>,
    _thread_bound: PhantomData<*const ()>,
}

impl Amp {
    /// Resolves `config` (Apex's rules checked), makes the scalers and, under O1, activates the
    /// cast policy on this thread (CPU, and CUDA when available) for as long as the `Amp` lives.
    /// Under O2/O3 with an fp16/bf16 model whose type is emulated on this CPU (see
    /// [`crate::CpuKernels`]), the emulation-only policy is activated for CPU the same way. The
    /// first `Amp` that needs the cast engine registers its kernels with libtorch, once for the
    /// process.
    ///
    /// # Errors
    /// Any rejection of [`AmpConfig::build`]; the policy's errors (an unknown op in a user cast:
    /// [`ConfigError::UnknownOp`]).
    pub fn new(config: &AmpConfig) -> Result<Self> {
        Self::from_properties(config.build()?)
    }

    /// An `Amp` from already resolved properties.
    ///
    /// # Errors
    /// As [`Self::new`], for the cast policy.
    pub fn from_properties(props: Properties) -> Result<Self> {
        let plan = Plan::new(&props);
        let scalers: Vec<LossScaler> = (0..props.num_losses()).map(|_| LossScaler::new(&props)).collect();
        let last_overflows = vec![None; scalers.len()];
        if props.verbosity() >= 2 {
            log::info!("tch-amp: {props:?}");
            let s = props.cast_settings();
            log::info!(
                "tch-amp: CPU fp16/bf16 GEMMs and convolutions: fp16 {:?}, bf16 {:?} (CPU {:?}: {})",
                s.cpu_fp16,
                s.cpu_bf16,
                CpuFeatures::detect().name,
                CpuFeatures::detect().summary()
            );
        }
        let casts = CastRuntime::for_properties(&props, plan)?;
        Ok(Self {
            id: NEXT_AMP_ID.fetch_add(1, Ordering::Relaxed),
            props,
            plan,
            scalers,
            last_overflows,
            casts,
            _thread_bound: PhantomData,
        })
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
    /// [`ConfigError::LossIdOutOfRange`].
    pub fn scaler(&self, loss_id: usize) -> Result<&LossScaler> {
        self.scalers
            .get(loss_id)
            .ok_or(AmpError::Config(ConfigError::LossIdOutOfRange { loss_id, num_losses: self.scalers.len() }))
    }

    /// The diagnostics of the last overflow of `loss_id` (`None` before the first): which
    /// parameters had inf/NaN gradients, in model order, with counts. The scale changes that led
    /// there are in [`LossScaler::history`].
    ///
    /// # Errors
    /// [`ConfigError::LossIdOutOfRange`].
    pub fn last_overflow(&self, loss_id: usize) -> Result<Option<&OverflowReport>> {
        self.scaler(loss_id)?;
        Ok(self.last_overflows[loss_id].as_ref())
    }

    /// The current scale of `loss_id`.
    ///
    /// # Errors
    /// [`ConfigError::LossIdOutOfRange`].
    pub fn loss_scale(&self, loss_id: usize) -> Result<f64> {
        Ok(self.scaler(loss_id)?.loss_scale())
    }

    /// The scalers' state in Apex's form (`amp.state_dict()`), the value `torch.save` writes:
    /// `{'loss_scaler0': {'loss_scale': 65536.0, 'unskipped': 0}, ...}`. Growth interval and
    /// factors are not part of it (Apex fixes them at 2000, 2 and 0.5); after loading a
    /// `GradScaler` state with other values, keep that dict (or set them again) to restore them.
    pub fn state_dict(&self) -> Value {
        scaling::state_value(&self.scalers)
    }

    /// Restores the scalers from Apex's form (one `loss_scalerN` entry per loss, each with
    /// `loss_scale` and `unskipped`) or, for a single loss, from torch's `GradScaler.state_dict()`
    /// (`scale`, `growth_factor`, `backoff_factor`, `growth_interval`, `_growth_tracker`).
    ///
    /// # Errors
    /// [`StateError::StateMismatch`](crate::error::StateError::StateMismatch) for an unknown key, a
    /// missing scaler, a count that differs from `num_losses`, or a non-positive / non-finite
    /// scale. Nothing is applied then (Apex applies the valid entries and raises afterwards).
    pub fn load_state_dict(&mut self, state: &Value) -> Result<()> {
        let parsed = scaling::parse_state(&self.scalers, &state.node())?;
        scaling::apply_state(&mut self.scalers, parsed);
        Ok(())
    }

    /// Checks a state against this `Amp` without applying it (checkpoint loading).
    pub(crate) fn check_state_dict(&self, state: &Node<'_>) -> Result<scaling::ParsedState> {
        scaling::parse_state(&self.scalers, state)
    }

    /// tch-amp's own checkpoint format's record of the scalers.
    pub(crate) fn amp_state(&self) -> scaling::AmpState {
        scaling::amp_state(&self.scalers)
    }

    /// Applies a state checked by [`Self::check_state_dict`].
    pub(crate) fn apply_checked_state(&mut self, parsed: scaling::ParsedState) {
        scaling::apply_state(&mut self.scalers, parsed)
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
        match self.plan.model_cast {
            Some((kind, out)) => {
                let report = cast_var_store(vs, kind, self.props.keep_batchnorm_fp32())?;
                Ok((AmpModel::new(model, Some(kind), Some(out)), report))
            }
            None => Ok((AmpModel::new(model, None, self.plan.outputs_only), CastReport::default())),
        }
    }

    /// An optimizer over every trainable variable of `vs` (fp32 masters of the fp16 ones when
    /// master weights are on). Cast the model first.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for a bad learning rate.
    pub fn optimizer(&self, vs: &VarStore, config: impl Into<OptimizerConfig>, lr: f64) -> Result<AmpOptimizer> {
        self.optimizer_for(vs, &[], config, lr)
    }

    /// An optimizer over the trainable variables of `vs` under the given path prefixes (whole
    /// segments: `"layer1"` selects `layer1.*`, never `layer10.*`); an empty list selects all.
    ///
    /// # Errors
    /// [`ConfigError::NoVariablesUnder`] when no variable lies under the prefixes; as
    /// [`Self::optimizer`].
    pub fn optimizer_for(
        &self,
        vs: &VarStore,
        prefixes: &[&str],
        config: impl Into<OptimizerConfig>,
        lr: f64,
    ) -> Result<AmpOptimizer> {
        let entries = build_entries(vs, prefixes, self.plan.masters)?;
        let config = config.into();
        let opt = AmpOptimizer::build(
            self.optimizer_setup(),
            Box::new(config.rule()),
            Some(config),
            lr,
            Layout::TchGroups(entries),
        )?;
        self.warn_fp16_adam(&opt, config);
        Ok(opt)
    }

    /// An optimizer over parameter groups with their own hyper-parameters (torch.optim's
    /// `Optimizer([{"params": ..., "weight_decay": 0.0}, ...], lr=lr, ...)`): the variables of `vs`
    /// each [`ParamGroup`] selects, each group with `config`'s hyper-parameters and `lr` unless it
    /// sets its own. Group ids are the groups' positions. Trainable variables no group selects are
    /// not optimized (as in torch); an empty `groups` means one group per tch group, as
    /// [`Self::optimizer`].
    ///
    /// ```
    /// use tch::nn::{self, VarStore};
    /// use tch::Device;
    /// use tch_amp::{Amp, AmpConfig, OptLevel, ParamGroup};
    /// # fn main() -> Result<(), tch_amp::AmpError> {
    /// let vs = VarStore::new(Device::Cpu);
    /// let _layer = nn::linear(vs.root() / "fc", 4, 4, Default::default());
    /// let amp = Amp::new(&AmpConfig::new(OptLevel::O2).verbosity(0))?;
    /// // torch: AdamW([{"params": weights, "weight_decay": 0.01},
    /// //               {"params": biases, "weight_decay": 0.0}], lr=1e-3)
    /// let opt = amp.optimizer_groups(
    ///     &vs,
    ///     nn::AdamW::default(),
    ///     1e-3,
    ///     &[ParamGroup::matching(|n| !n.ends_with("bias")).weight_decay(0.01), ParamGroup::rest().weight_decay(0.0)],
    /// )?;
    /// assert_eq!(opt.group_param_names(1), ["fc.bias"]);
    /// assert_eq!(opt.hyper_parameters_group(1).unwrap().get("weight_decay")?, 0.0);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`Self::optimizer`]; [`ConfigError::ParamInTwoGroups`], [`ConfigError::UnknownVariable`],
    /// [`ConfigError::NoVariablesUnder`] for the selections; [`ConfigError::UnknownHyperParameter`]
    /// and [`ConfigError::InvalidOption`] for a group's settings.
    pub fn optimizer_groups(
        &self,
        vs: &VarStore,
        config: impl Into<OptimizerConfig>,
        lr: f64,
        groups: &[ParamGroup],
    ) -> Result<AmpOptimizer> {
        self.built_optimizer(vs, config.into(), lr, groups, None)
    }

    /// An optimizer running a user's [`UpdateRule`] (or a built-in one) over parameter groups
    /// as [`Self::optimizer_groups`] (empty `groups`: one group per tch group). Masters, the
    /// skip after an overflow, clipping, records and checkpoints work as for the built-ins.
    ///
    /// # Errors
    /// As [`Self::optimizer_groups`]; the rule's [`UpdateRule::validate`] errors.
    pub fn optimizer_with_rule(
        &self,
        vs: &VarStore,
        rule: impl UpdateRule + 'static,
        lr: f64,
        groups: &[ParamGroup],
    ) -> Result<AmpOptimizer> {
        let layout = self.layout(vs, groups)?;
        AmpOptimizer::build(self.optimizer_setup(), Box::new(rule), None, lr, layout)
    }

    /// Apex's `DistributedFusedAdam` / `DistributedFusedLAMB` (with [`crate::FusedAdam`] /
    /// [`crate::FusedLamb`]), or torch's `ZeroRedundancyOptimizer` under Apex's amp: the
    /// optimizer of [`Self::optimizer_groups`] sharded over the ranks of `pg` (ZeRO stage 1, see
    /// [`AmpOptimizer::sharded`] for the partition and the collectives). Under master weights each
    /// rank makes the fp32 masters of its shard only: with Adam at O2 a rank holds `12 / world
    /// size` bytes of masters and state per parameter on average (the partition's balance
    /// decides), where every rank of an unsharded run holds 12.
    ///
    /// `scale_loss` works as for an unsharded optimizer: the gradients of other ranks'
    /// parameters (averaged by DDP) are released at its exit, each rank checks its shard's
    /// gradients, and the ranks agree on the inf/NaN verdict (one collective) before the scale
    /// changes, so every rank skips or steps together and the loss scalers stay equal.
    ///
    /// # Errors
    /// As [`Self::optimizer_groups`].
    pub fn sharded_optimizer(
        &self,
        pg: &crate::distributed::ProcessGroup,
        vs: &VarStore,
        config: impl Into<OptimizerConfig>,
        lr: f64,
        groups: &[ParamGroup],
    ) -> Result<AmpOptimizer> {
        self.built_optimizer(vs, config.into(), lr, groups, Some(pg))
    }

    /// A built-in optimizer over `groups`, sharded over `pg`'s ranks when given.
    fn built_optimizer(
        &self,
        vs: &VarStore,
        config: OptimizerConfig,
        lr: f64,
        groups: &[ParamGroup],
        pg: Option<&crate::distributed::ProcessGroup>,
    ) -> Result<AmpOptimizer> {
        // A sharded optimizer makes the masters of its rank's shard when the partition is known.
        let layout = crate::optim::amp_optimizer::layout(vs, groups, self.plan.masters && pg.is_none())?;
        let comm = pg.map(|pg| Box::new(pg.clone()) as Box<dyn crate::optim::Collectives>);
        let rule = Box::new(config.rule());
        let opt = AmpOptimizer::build_sharded(self.optimizer_setup(), rule, Some(config), lr, layout, comm)?;
        self.warn_fp16_adam(&opt, config);
        Ok(opt)
    }

    fn layout(&self, vs: &VarStore, groups: &[ParamGroup]) -> Result<Layout> {
        crate::optim::amp_optimizer::layout(vs, groups, self.plan.masters)
    }

    fn optimizer_setup(&self) -> OptimizerSetup {
        OptimizerSetup {
            amp_id: self.id,
            disable_casts_in_step: self.plan.o1,
            fp32_optimizer_state: self.props.fp32_optimizer_state(),
            master_weights: self.plan.masters,
            pass_through: self.plan.disabled
                || (!self.plan.masters
                    && self.props.loss_scale() == LossScale::Static(1.0)
                    && !self.props.check_static_overflow()),
        }
    }

    /// Apex's O3 Adam pitfall, said once.
    fn warn_fp16_adam(&self, opt: &AmpOptimizer, config: OptimizerConfig) {
        if self.props.verbosity() >= 1
            && !self.props.fp32_optimizer_state()
            && opt.has_low_precision_params_without_masters()
        {
            if let Algorithm::Adam(_) | Algorithm::AdamW(_) = config.algorithm() {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    log::warn!(
                        "tch-amp: Adam/AdamW over fp16/bf16 parameters without fp32 masters (O3) keeps its \
                         state in fp16, as Apex does: eps=1e-8 rounds to 0 and small squared gradients underflow, so \
                         the weights can turn NaN; AmpConfig::fp32_optimizer_state(true) updates them in fp32"
                    )
                });
            }
        }
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
    /// At an overflow the parameters with inf/NaN gradients are counted (only then: a clean pass
    /// reads one flag) into an [`OverflowReport`] ([`Self::last_overflow`],
    /// [`AmpOptimizer::last_overflow`]), printed at verbosity >= 1 after Apex's line. With the
    /// scale at its floor, the gradients of a clean pass are checked for being all zero (the silent
    /// collapse; see [`crate::AmpConfig::collapse_limit`]).
    ///
    /// # Errors
    /// Checked before `backward` runs, nothing changed then: [`ConfigError::LossIdOutOfRange`];
    /// [`UsageError::NoOptimizers`] for an empty list (Apex accepts it and leaves the gradients
    /// scaled); [`UsageError::ForeignOptimizer`] for an optimizer of another `Amp`;
    /// [`UsageError::DuplicateOptimizer`];
    /// [`UsageError::BadLoss`](crate::error::UsageError::BadLoss) for a loss that is not a single
    /// value; [`UsageError::BadLoss`](crate::error::UsageError::BadLoss) for a loss that does not
    /// require grad; [`UsageError::BadLoss`](crate::error::UsageError::BadLoss) for a loss on
    /// another device than an optimizer's parameters. Afterwards: [`AmpError::Torch`] from
    /// `backward` or from unscaling.
    pub fn f_scale_loss_with(
        &mut self,
        loss: &Tensor,
        optimizers: &mut [&mut AmpOptimizer],
        options: ScaleLossOptions,
        backward: impl FnOnce(&Tensor) -> std::result::Result<(), TchError>,
    ) -> Result<ScaleLossOutcome> {
        let ScaleLossOptions { loss_id, delay_unscale } = options;
        self.check_call(loss_id, optimizers)?;
        check_loss(loss, optimizers)?;
        let scaler = &self.scalers[loss_id];
        let (scale, checks) = (scaler.loss_scale(), scaler.checks_overflow());
        let outcome = |overflow, new_loss_scale, delayed, passed_through| ScaleLossOutcome {
            loss_id,
            loss_scale: scale,
            overflow,
            new_loss_scale,
            delayed,
            passed_through,
        };
        // Apex: disabled, or a static scale of 1 without masters, hands loss.float() straight
        // to backward: no unscale, no check (unless static scales are checked).
        if self.plan.disabled || (!self.plan.masters && !checks && scale == 1.0) {
            let l = if self.plan.disabled {
                loss.shallow_clone()
            } else {
                loss.f_to_kind(Kind::Float).ctx("loss.float()")?
            };
            self.run_backward(backward, &l)?;
            crate::doctor::watch::next_batch();
            optimizers.iter_mut().for_each(|o| o.note_pass_through());
            return Ok(outcome(false, scale, false, true));
        }
        if !delay_unscale {
            for o in optimizers.iter_mut() {
                o.begin_backward()?;
            }
        }
        let scaled = loss.f_to_kind(Kind::Float).ctx("loss.float()")? * scale;
        self.run_backward(backward, &scaled)?;
        if delay_unscale {
            optimizers.iter_mut().for_each(|o| o.keep_scaled());
            return Ok(outcome(false, scale, true, false));
        }
        let overflow = Self::unscale(optimizers, scale, checks)?;
        let new_scale = self.update_scale(loss_id, overflow, optimizers)?;
        Ok(outcome(overflow, new_scale, false, false))
    }

    /// The loss id exists; every optimizer is this `Amp`'s, each given once.
    fn check_call(&self, loss_id: usize, optimizers: &[&mut AmpOptimizer]) -> Result<()> {
        self.scaler(loss_id)?;
        if optimizers.is_empty() {
            return Err(AmpError::Usage(UsageError::NoOptimizers));
        }
        if let Some(o) = optimizers.iter().find(|o| o.amp_id() != self.id) {
            return Err(AmpError::Usage(UsageError::ForeignOptimizer { optimizer_amp: o.amp_id(), amp: self.id }));
        }
        for (i, a) in optimizers.iter().enumerate() {
            if optimizers[..i].iter().any(|b| std::ptr::eq(&**a, &**b)) {
                return Err(AmpError::Usage(UsageError::DuplicateOptimizer));
            }
        }
        Ok(())
    }

    /// Runs the user's backward with the cast policy off on this thread, so that backward ops
    /// (on CUDA, also those on autograd's device threads, which inherit autocast's state) are
    /// never cast: as under Apex, backward runs in the dtypes the forward's casts gave it.
    /// The weight-cast cache is emptied afterwards, as Apex did at each exit under O1; under
    /// O2/O3 with CPU emulation it holds the fp32 copies of the fp16 weights the forward made,
    /// which the step is about to change (keeping them would hold 4 more bytes per parameter
    /// through the step).
    fn run_backward(
        &self,
        backward: impl FnOnce(&Tensor) -> std::result::Result<(), TchError>,
        loss: &Tensor,
    ) -> Result<()> {
        let result = if self.casts.is_some() {
            without_casts(|| backward(loss).ctx("backward"))?
        } else {
            backward(loss).ctx("backward")
        };
        if self.casts.is_some() {
            clear_cast_cache()?;
        }
        result
    }

    /// Unscales every optimizer's new gradients by 1/`scale` (fused, no host sync) and, for a
    /// checking scaler, reads the inf/NaN flag: the one host sync of a dynamic step.
    fn unscale(optimizers: &mut [&mut AmpOptimizer], scale: f64, dynamic: bool) -> Result<bool> {
        let device = optimizers.iter().find_map(|o| o.device()).unwrap_or(Device::Cpu);
        let found_inf = Tensor::f_zeros([1], (Kind::Float, device)).ctx("found_inf")?;
        let inv_scale = Tensor::f_full([1], 1.0 / scale, (Kind::Float, device)).ctx("inv_scale")?;
        for o in optimizers.iter_mut() {
            o.end_backward(&found_inf, &inv_scale)?;
        }
        if !dynamic {
            return Ok(false);
        }
        // A sharded optimizer checked its shard only: the ranks agree before anyone steps.
        for o in optimizers.iter() {
            o.agree_found_inf(&found_inf)?;
        }
        crate::counters::note_host_read();
        Ok(found_inf.f_double_value(&[0]).ctx("reading the overflow flag")? != 0.0)
    }

    /// Updates the scaler of `loss_id`; on a skip, every optimizer skips its next step and
    /// gets the overflow's diagnostics; a collapse is handed to every optimizer's next step.
    fn update_scale(&mut self, loss_id: usize, overflow: bool, optimizers: &mut [&mut AmpOptimizer]) -> Result<f64> {
        let scaler = &self.scalers[loss_id];
        let (scale, pass) = (scaler.loss_scale(), scaler.passes());
        // The silent collapse: only looked for with the scale at its floor.
        let all_zero_at_floor = !overflow && scaler.is_dynamic() && scaler.at_floor() && {
            let mut verdict = None;
            for o in optimizers.iter() {
                match (o.grads_all_zero_agreed()?, verdict) {
                    (Some(false), _) => {
                        verdict = Some(false);
                        break;
                    }
                    (Some(true), None) => verdict = Some(true),
                    _ => {}
                }
            }
            verdict == Some(true)
        };
        let scaler = &mut self.scalers[loss_id];
        let skip = scaler.record_pass(overflow, all_zero_at_floor);
        let new_scale = scaler.loss_scale();
        let collapse = scaler.collapse();
        let floor = scaler.min_loss_scale();
        if skip {
            // The overflow path: only here are the gradients inspected.
            let mut params = Vec::new();
            for o in optimizers.iter() {
                params.extend(o.non_finite_grads()?);
            }
            let report = OverflowReport {
                loss_id,
                pass,
                loss_scale: scale,
                new_loss_scale: new_scale,
                dynamic: scaler.is_dynamic(),
                overflows_at_floor: scaler.overflows_at_floor(),
                params,
                first_non_finite: crate::doctor::watch::overflow_origin(scale),
            };
            if self.props.verbosity() >= 1 {
                log::warn!("{report}");
                if scaler.is_dynamic() && new_scale <= floor && scale > floor {
                    log::warn!(
                        "loss scaler {loss_id} reached its floor {floor:e} (min_loss_scale): {} more overflows in a row \
                         there end in AmpError::Diverged(Divergence::ScaleCollapsed)",
                        self.props.collapse_limit()
                    );
                }
            }
            let collapse = match collapse {
                Some(Collapse::OverflowAtFloor { first_pass, passes }) => Some(CollapseInfo {
                    overflow: true,
                    loss_id,
                    first_pass,
                    passes,
                    loss_scale: new_scale,
                    params: report.first_params(5),
                    first_non_finite: report.first_non_finite.as_ref().map(ToString::to_string),
                }),
                _ => None,
            };
            for o in optimizers.iter_mut() {
                o.mark_skip(loss_id, new_scale, report.clone(), collapse.clone());
            }
            self.last_overflows[loss_id] = Some(report);
        } else if let Some(Collapse::ZeroGradients { first_pass, passes }) = collapse {
            let info = CollapseInfo {
                overflow: false,
                loss_id,
                first_pass,
                passes,
                loss_scale: new_scale,
                params: vec![],
                first_non_finite: None,
            };
            for o in optimizers.iter_mut() {
                o.mark_vanished(info.clone());
            }
        }
        if !skip {
            // A clean pass: a watch starts the next batch afresh.
            crate::doctor::watch::next_batch();
        }
        Ok(new_scale)
    }
}

/// The loss is one value with an autograd graph, on the optimizers' device. Checked before
/// `backward` (tch's `backward` panics with a C++ trace on each of these).
fn check_loss(loss: &Tensor, optimizers: &[&mut AmpOptimizer]) -> Result<()> {
    crate::error::check_loss_value(loss, "scale_loss")?;
    let device = loss.device();
    if let Some(params) = optimizers.iter().filter_map(|o| o.device()).find(|&d| d != device) {
        let problem = format!("is on {device:?} but an optimizer's parameters are on {params:?}: compute it there");
        return Err(AmpError::Usage(UsageError::BadLoss { call: "scale_loss", problem }));
    }
    Ok(())
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
