//! The crate's one error type, at the bottom of the module graph: it depends on nothing of
//! tch-amp but the [`OptLevel`] enum (a leaf).
use std::path::PathBuf;

use tch::{Kind, TchError};

use crate::config::OptLevel;

/// Everything that can go wrong in tch-amp. Messages say what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmpError {
    /// A libtorch call made through tch failed.
    #[error("libtorch error while {context}: {source}")]
    Torch {
        /// What tch-amp was doing.
        context: &'static str,
        /// tch's error.
        #[source]
        source: TchError,
    },
    /// A C++ exception caught in tch-amp's shim (the message is libtorch's).
    #[error("{what}: {message}")]
    Shim {
        /// The shim function that failed.
        what: &'static str,
        /// The C++ exception's message.
        message: String,
    },
    /// An opt level name that is not O0, O1, O2 or O3.
    #[error(
        "unknown opt level {name:?}: expected \"O0\", \"O1\", \"O2\" or \"O3\" (the letter O, not the number zero)"
    )]
    UnknownOptLevel {
        /// What was given.
        name: String,
    },
    /// An option that Apex rejects at this opt level.
    #[error("{option} cannot be set under {level}: {why}")]
    IncompatibleOption {
        /// The opt level.
        level: OptLevel,
        /// The option's name as in Apex's `amp.initialize`.
        option: &'static str,
        /// Why, and what to do instead.
        why: &'static str,
    },
    /// An option value that cannot be parsed or is out of range.
    #[error("invalid value {value:?} for {option}: {expected}")]
    InvalidOption {
        /// The option's name.
        option: &'static str,
        /// What was given.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// A data file (opt level table, cast lists, state dict) that does not parse.
    #[error("cannot parse {what}: {message}")]
    Parse {
        /// What was being parsed.
        what: String,
        /// The parser's message.
        message: String,
    },
    /// A loss id outside `0..num_losses`.
    #[error("loss_id {loss_id} is out of range: initialize was given num_losses = {num_losses}")]
    LossIdOutOfRange {
        /// The id given.
        loss_id: usize,
        /// How many losses (and scalers) there are.
        num_losses: usize,
    },
    /// An optimizer made by another [`crate::Amp`] was given to `scale_loss`.
    #[error(
        "an optimizer given to scale_loss was made by another Amp (id {optimizer_amp}), not this one (id {amp}); \
         make the optimizer with this Amp's optimizer()/optimizer_for()"
    )]
    ForeignOptimizer {
        /// The id of the `Amp` that made the optimizer.
        optimizer_amp: u64,
        /// The id of the `Amp` whose `scale_loss` was called.
        amp: u64,
    },
    /// The same optimizer was given twice to one `scale_loss` call.
    #[error("the same optimizer was given twice to scale_loss; pass each optimizer once")]
    DuplicateOptimizer,
    /// `step()` was called while the gradients still hold a scaled, not yet unscaled,
    /// contribution (the last `scale_loss` used `delay_unscale`).
    #[error(
        "step() called while the gradients are still scaled: the last scale_loss used delay_unscale; \
         run a scale_loss without delay_unscale before stepping"
    )]
    GradientsStillScaled,
    /// A call out of the per-step order each optimizer keeps: `zero_grad` -> `scale_loss` (one
    /// pass or more) -> `clip_grad_norm` -> `step`, as torch's GradScaler keeps `OptState`.
    /// Examples: `step()` twice with no `scale_loss` in between (the second would apply the
    /// same gradients again); `clip_grad_norm` before `scale_loss` (it would clip nothing) or
    /// on gradients a `delay_unscale` pass left scaled; `step()` on gradients a backward
    /// outside `scale_loss` made while the loss is scaled (they would be unscaled by nobody).
    /// Nothing was changed.
    #[error("{call} called {when}: {remedy}")]
    CallOrder {
        /// The call refused.
        call: &'static str,
        /// When it came.
        when: &'static str,
        /// The order to use.
        remedy: &'static str,
    },
    /// Under O2, the model's fp16 gradients that `step` unscales into the fp32 master
    /// gradients changed after `scale_loss` returned: they are still scaled then, so clipping
    /// them (the usual tch habit, `clip_grad_norm` over `vs.trainable_variables()`) or any
    /// other change would make `step` use wrong values. Clip with
    /// [`crate::AmpOptimizer::clip_grad_norm`], which clips the fp32 master gradients (Apex's
    /// `clip_grad_norm_(amp.master_params(optimizer))`). Nothing was changed.
    #[error(
        "the fp16 gradients of {params:?} changed between scale_loss and step(): they are still scaled; clip with \
         opt.clip_grad_norm (it clips the fp32 master gradients)"
    )]
    ModelGradsChanged {
        /// The parameters (at most five).
        params: Vec<String>,
    },
    /// No trainable variable of the `VarStore` lies under the path prefixes given.
    #[error("no variable of the VarStore lies under {prefixes:?} (prefixes are compared by whole path segments)")]
    NoVariablesUnder {
        /// The prefixes given.
        prefixes: Vec<String>,
    },
    /// A lock inside tch (the `VarStore`'s) was poisoned by a panic in another thread.
    #[error("{what}'s lock is poisoned: another thread panicked while holding it")]
    PoisonedLock {
        /// What the lock protects.
        what: &'static str,
    },
    /// More tensors than the shim's C `int` counts can carry in one call.
    #[error("too many tensors ({count}) for one {what} call")]
    TooManyTensors {
        /// How many were given.
        count: usize,
        /// The operation.
        what: &'static str,
    },
    /// A tensor of an unexpected dtype.
    #[error("{name} has dtype {found:?}, expected {expected}")]
    DtypeMismatch {
        /// The variable or argument.
        name: String,
        /// What was expected, in words.
        expected: &'static str,
        /// What was found.
        found: Kind,
    },
    /// A state dict or checkpoint that does not match what it is loaded into; nothing was changed.
    #[error("state does not match: {message}; nothing was loaded")]
    StateMismatch {
        /// What differs.
        message: String,
    },
    /// A strict partial load ([`crate::checkpoint::load_model_weights`], [`crate::checkpoint::load_optimizer_state`])
    /// found keys on one side only (torch's `load_state_dict(strict=True)` error); nothing was
    /// changed. Load with `strict = false` to load what matches and get these as a
    /// [`crate::checkpoint::LoadReport`].
    #[error(
        "strict load of {what}: missing keys {missing_keys:?}, unexpected keys {unexpected_keys:?}; nothing was \
         loaded (load with strict = false to load the keys that match)"
    )]
    IncompatibleKeys {
        /// What was being loaded: `"model weights"` or `"optimizer <i> state"`.
        what: String,
        /// Keys this side has that the checkpoint lacks.
        missing_keys: Vec<String>,
        /// Keys of the checkpoint this side does not have.
        unexpected_keys: Vec<String>,
    },
    /// Reading a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Writing a checkpoint failed; any previous file at `path` is intact and no temporary
    /// file is left behind.
    #[error("cannot write the checkpoint {path}: {source}; any previous file there is intact")]
    Save {
        /// The checkpoint's path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An aten operator name that the dispatcher does not know.
    #[error("unknown aten op {name:?}: {message}")]
    UnknownOp {
        /// The name given.
        name: String,
        /// libtorch's message.
        message: String,
    },
    /// The loss scale collapsed: `passes` consecutive backward passes of loss `loss_id`
    /// overflowed with the scale already at its floor (`collapse_limit`, see
    /// [`crate::AmpConfig::collapse_limit`]). Returned by `step()` after skipping the step.
    #[error(
        "loss scaler {loss_id} collapsed: {passes} consecutive backward passes (passes {first_pass}..={last_pass}) \
         overflowed with the loss scale at its floor {loss_scale:e}; first non-finite gradients: {params:?}. \
         The loss or the gradients are inf/NaN at every step: look for a NaN in the data or the loss, a too high \
         learning rate, or an op that overflows in fp16 (see Amp::last_overflow for the counts); \
         AmpConfig::collapse_limit(0) skips forever, as Apex"
    )]
    ScaleCollapsed {
        /// The loss whose scaler collapsed.
        loss_id: usize,
        /// The first pass of the run (index of the non-delayed `scale_loss` exit, from 0).
        first_pass: u64,
        /// The last pass of the run.
        last_pass: u64,
        /// How many passes in a row.
        passes: u64,
        /// The scale (the floor).
        loss_scale: f64,
        /// The first parameters (model order, at most 5) with non-finite gradients at the last
        /// overflow.
        params: Vec<String>,
    },
    /// The loss scale sits at its floor and the gradients of `passes` consecutive clean
    /// backward passes were all exactly zero: the scaled gradients underflow and the model has
    /// silently stopped learning. Returned by `step()`, which does not step.
    #[error(
        "loss scaler {loss_id} collapsed: the loss scale sits at its floor {loss_scale:e} and every gradient was \
         exactly zero for {passes} consecutive backward passes (passes {first_pass}..={last_pass}): the scaled \
         gradients underflow and the model stopped learning. An overflow storm drove the scale down; raise \
         min_loss_scale, or let it regrow faster with AmpConfig::recovery_growth_interval; \
         AmpConfig::collapse_limit(0) turns the check off"
    )]
    GradientsVanished {
        /// The loss whose scaler sits at its floor.
        loss_id: usize,
        /// The first pass of the run.
        first_pass: u64,
        /// The last pass of the run.
        last_pass: u64,
        /// How many passes in a row.
        passes: u64,
        /// The scale (the floor).
        loss_scale: f64,
    },
    /// `step()` found gradients on low-precision model variables whose fp32 masters have none:
    /// a backward pass ran outside `scale_loss`, so the masters (which the optimizer steps)
    /// never saw it. Nothing was changed.
    #[error(
        "step() found gradients on the fp16 model variables {params:?} but none on their fp32 masters: the \
         backward pass ran outside scale_loss, and the optimizer steps the masters; run backward inside \
         amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward())"
    )]
    GradientsNotUnscaled {
        /// The variables (at most 5) holding such gradients.
        params: Vec<String>,
    },
    /// `step()` found no gradient on any parameter: there is nothing to step (no backward since
    /// the last step or zero_grad; a skipped step clears the gradients, so a second `step()`
    /// after an overflow lands here). Nothing was changed.
    #[error(
        "step() found no gradient on any of the optimizer's parameters: run amp.scale_loss(..) (the backward \
         pass) before each step(); a skipped step clears the gradients, so call step() once per backward"
    )]
    NoGradients,
    /// A parameter group id the optimizer does not have (`set_lr_group` and friends).
    #[error("parameter group {group} is not one of this optimizer's (its groups are {groups:?})")]
    UnknownParamGroup {
        /// The group given.
        group: usize,
        /// The optimizer's groups.
        groups: Vec<usize>,
    },
    /// A hyper-parameter name the optimizer does not have (a group override, a record, or a
    /// rule asking for a key its defaults lack).
    #[error("unknown hyper-parameter {name:?}: this optimizer's are {known:?}")]
    UnknownHyperParameter {
        /// The name given.
        name: String,
        /// The optimizer's hyper-parameters.
        known: Vec<String>,
    },
    /// A variable selected by two parameter groups, or added to an optimizer that already
    /// holds it (torch: "some parameters appear in more than one parameter group").
    #[error(
        "parameter {name:?} would be in more than one parameter group: make the groups' selections disjoint \
         (ParamGroup::rest() takes only what the other groups leave)"
    )]
    ParamInTwoGroups {
        /// The variable.
        name: String,
    },
    /// A parameter group names a variable that is not a trainable variable of the VarStore.
    #[error("{name:?} is not a trainable variable of the VarStore (check the name: VarStore paths are dotted)")]
    UnknownVariable {
        /// The name given.
        name: String,
    },
    /// `scale_loss` was given a loss that is not a single number (backward needs a scalar).
    #[error(
        "the loss given to scale_loss has shape {shape:?}, not a single value: reduce it first \
         (loss.mean() or loss.sum())"
    )]
    LossNotScalar {
        /// The loss's shape (empty for an undefined tensor).
        shape: Vec<i64>,
    },
    /// `scale_loss` was given a loss that does not require grad: no graph to run backward on.
    #[error(
        "the loss given to scale_loss does not require grad (no autograd graph): compute it from the model's \
         trainable variables, outside no_grad, and do not detach it"
    )]
    LossWithoutGraph,
    /// The loss lives on another device than an optimizer's parameters.
    #[error(
        "the loss is on {loss:?} but an optimizer's parameters are on {params:?}: compute the loss on the \
         parameters' device"
    )]
    LossDeviceMismatch {
        /// The loss's device.
        loss: tch::Device,
        /// The parameters' device.
        params: tch::Device,
    },
    /// `scale_loss` was given no optimizer. Apex accepts `[]` and leaves the gradients scaled
    /// (then stepped with the scale in them); tch-amp refuses.
    #[error(
        "scale_loss was given no optimizer: pass every optimizer whose parameters the loss reaches \
         (&mut [&mut opt]); without one the gradients would stay multiplied by the loss scale"
    )]
    NoOptimizers,
    /// An op on O1's banned list (binary_cross_entropy) was called with fp16/bf16 inputs.
    #[error(
        "{op} is banned under O1 on fp16/bf16 inputs (its log saturates where a low-precision sigmoid \
         rounds to 0 or 1): pass the logits to binary_cross_entropy_with_logits (BCEWithLogitsLoss) \
         instead, or set AmpConfig::allow_banned to run {op} in fp32"
    )]
    BannedOp {
        /// The aten op (`"binary_cross_entropy"`).
        op: String,
    },
    /// An op on O1's fp32 list was called in place on an fp16/bf16 tensor (Apex's in-place rule).
    #[error(
        "{op} cannot run in place on a {dtype:?} tensor under O1: the op is on the fp32 list, so its \
         result cannot be written back in low precision; call the out-of-place op, or cast the tensor \
         to fp32 first"
    )]
    InPlaceFp32OnHalf {
        /// The in-place aten op (`"exp_"`).
        op: String,
        /// The tensor's dtype.
        dtype: Kind,
    },
    /// [`crate::fp16_utils::Fp16Optimizer`] was given a trainable variable that is neither fp16
    /// nor fp32 (Apex's `FP16_Optimizer` raised a `TypeError`).
    #[error(
        "FP16_Optimizer wraps fp16 and fp32 parameters only, but {name} is {kind:?}: cast the model with \
         fp16_utils::network_to_half (or keep the variable fp32), or use tch_amp::initialize for bf16"
    )]
    LegacyParamDtype {
        /// The variable.
        name: String,
        /// Its dtype.
        kind: Kind,
    },
    /// `Fp16Optimizer::step` after `backward_with(loss, false)` without `update_master_grads()`:
    /// the master gradients are stale and the fp32 gradients still scaled.
    #[error(
        "step() after backward_with(loss, false): call update_master_grads() first (it unscales the \
         gradients into the fp32 masters and checks them for overflow)"
    )]
    MasterGradsNotUpdated,
    /// Loaded optimizer state that would poison the next step: a negative second moment (its
    /// square root is NaN), or a hyper-parameter finite in f64 that becomes inf or 0 in fp32,
    /// where the update is computed (`lr = 1e308`, `eps = 5e-324`). Found by
    /// [`crate::optim::OptimizerRecord::validate`] before anything is applied; nothing was loaded.
    #[error("optimizer state {param}: {message}; nothing was loaded (the checkpoint is corrupt or crafted)")]
    PoisonedState {
        /// The parameter (its VarStore name, with the buffer: `fc.weight exp_avg_sq`) or the
        /// hyper-parameter (`group 0 lr`).
        param: String,
        /// What is wrong.
        message: String,
    },
    /// A tch-amp cast policy (Apex's O1, or the CPU emulation of O2/O3) was activated on a
    /// thread where a torch.amp autocast scope ([`crate::AutocastScope`]) is alive. Both drive
    /// libtorch's autocast state; only one may be active on a thread at a time.
    #[error(
        "the Apex path's cast policy cannot start while torch.amp autocast is active on this thread: drop the \
         AutocastScope first, or run them on different threads"
    )]
    TorchAutocastActive,
    /// Model and master parameter lists of `fp16_utils` that do not belong together.
    #[error("fp16_utils: {message}")]
    ParamListMismatch {
        /// What differs, and what to do.
        message: String,
    },
}

/// `Result` with [`AmpError`].
pub type Result<T, E = AmpError> = std::result::Result<T, E>;

/// Attaches a context to tch's errors.
pub(crate) trait TorchContext<T> {
    fn ctx(self, context: &'static str) -> Result<T>;
}

impl<T> TorchContext<T> for std::result::Result<T, TchError> {
    fn ctx(self, context: &'static str) -> Result<T> {
        self.map_err(|source| AmpError::Torch { context, source })
    }
}

/// [`AmpError::StateMismatch`] with `message`.
pub(crate) fn mismatch(message: impl Into<String>) -> AmpError {
    AmpError::StateMismatch { message: message.into() }
}

/// A tch error from a fallible call (`f_*`) in user code that returns tch-amp's `Result`, such
/// as an [`crate::UpdateRule`] (`param.f_mul_(..)?`).
impl From<TchError> for AmpError {
    fn from(source: TchError) -> Self {
        AmpError::Torch { context: "a tch call in user code (an update rule)", source }
    }
}

impl From<crate::config::ParseOptLevelError> for AmpError {
    fn from(e: crate::config::ParseOptLevelError) -> Self {
        AmpError::UnknownOptLevel { name: e.name().to_string() }
    }
}
