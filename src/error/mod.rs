//! The groups of [`crate::AmpError`], one enum per thing a caller can do about a failure, at the
//! bottom of the module graph: they depend on nothing of tch-amp but the [`OptLevel`] enum
//! (a leaf).
//!
//! ```
//! # fn main() -> Result<(), tch_amp::AmpError> {
//! use tch_amp::error::ConfigError;
//! use tch_amp::{AmpError, OptLevel};
//! let err = "o2".parse::<OptLevel>().map_err(AmpError::from).unwrap_err();
//! assert!(matches!(err, AmpError::Config(ConfigError::UnknownOptLevel { .. })));
//! # Ok(())
//! # }
//! ```
use tch::Kind;

use crate::config::OptLevel;

pub(crate) mod amp_error;

pub(crate) use amp_error::{mismatch, AmpError, Result, TorchContext};

/// A set-up that is not valid ([`AmpError::Config`]): fix the configuration. Nothing was
/// changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// An opt level name that is not O0, O1, O2 or O3 (the letter O, not the digit zero).
    #[error("unknown opt level {name:?}: use \"O0\", \"O1\", \"O2\" or \"O3\" (the letter O, not zero)")]
    UnknownOptLevel {
        /// What was given.
        name: String,
    },
    /// An option that Apex rejects at this opt level (`why` says what to do instead).
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
    /// A cast list (TOML) that does not parse, has unknown keys or puts one overload in two
    /// categories.
    #[error("cannot parse {what}: {message}")]
    Parse {
        /// What was being parsed.
        what: String,
        /// The parser's message.
        message: String,
    },
    /// An aten operator name that the dispatcher does not know (a typo in a cast list, or an
    /// op this libtorch does not have).
    #[error("unknown aten op {name:?}: {message}")]
    UnknownOp {
        /// The name given.
        name: String,
        /// libtorch's message.
        message: String,
    },
    /// No trainable variable of the `VarStore` lies under the path prefixes given. Prefixes
    /// are compared by whole path segments (`layer1` does not select `layer10`).
    #[error("no variable of the VarStore lies under {prefixes:?}: check the prefixes")]
    NoVariablesUnder {
        /// The prefixes given.
        prefixes: Vec<String>,
    },
    /// A parameter group names a variable that is not a trainable variable of the VarStore
    /// (VarStore paths are dotted: `layer1.conv.weight`).
    #[error("{name:?} is not a trainable variable of the VarStore: check the name")]
    UnknownVariable {
        /// The name given.
        name: String,
    },
    /// A variable selected by two parameter groups, or added to an optimizer that already
    /// holds it (torch: "some parameters appear in more than one parameter group").
    /// `ParamGroup::rest()` takes only what the other groups leave.
    #[error("parameter {name:?} is in more than one parameter group: make the selections disjoint")]
    ParamInTwoGroups {
        /// The variable.
        name: String,
    },
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
    /// A loss id outside `0..num_losses` (`num_losses` as given to `initialize`).
    #[error("loss_id {loss_id} is out of range: num_losses is {num_losses}")]
    LossIdOutOfRange {
        /// The id given.
        loss_id: usize,
        /// How many losses (and scalers) there are.
        num_losses: usize,
    },
    /// [`crate::fp16_utils::Fp16Optimizer`] was given a trainable variable that is neither
    /// fp16 nor fp32 (Apex's `FP16_Optimizer` raised a `TypeError`). Cast the model with
    /// `fp16_utils::network_to_half` (or keep the variable fp32), or use
    /// [`crate::initialize`] for bf16.
    #[error("FP16_Optimizer takes fp16 and fp32 parameters only, but {name} is {kind:?}")]
    LegacyParamDtype {
        /// The variable.
        name: String,
        /// Its dtype.
        kind: Kind,
    },
    /// A linear layer named explicitly in a float8 layer filter
    /// ([`crate::float8::LayerFilter::only`]) that cannot train in float8: its dimensions are not
    /// multiples of 16 (CUDA's `_scaled_mm` needs them), its weight is neither fp32, bf16 nor
    /// fp16, or it is not 2-D. A layer selected by a prefix instead is skipped and reported
    /// ([`crate::float8::ConversionReport`]).
    #[error("layer {layer:?} cannot train in float8 ({reason}): leave it out of the filter")]
    Float8LayerRefused {
        /// The layer's VarStore path.
        layer: String,
        /// Why.
        reason: String,
    },
    /// An optimizer whose update rule has no torch.optim or `apex.optimizers` form (a user's
    /// [`crate::UpdateRule`]): a torch checkpoint cannot hold its state. tch-amp's own
    /// checkpoints ([`crate::save_checkpoint`]) hold any rule's.
    #[error(
        "optimizer {optimizer} runs the update rule {kind:?}, which has no torch.optim or apex.optimizers form: save \
         it with tch_amp::save_checkpoint"
    )]
    NoTorchForm {
        /// Which optimizer.
        optimizer: usize,
        /// Its rule's kind ([`crate::UpdateRule::kind`]).
        kind: String,
    },
    /// Checkpoint options that do not fit the call: another number of optimizers than optimizer
    /// keys, an extra entry named like the model, optimizer or amp entry, a `param_order` for an
    /// optimizer that was not given.
    #[error("{message}")]
    OptionsMismatch {
        /// What is wrong and what to do.
        message: String,
    },
}

/// A call out of order, or with arguments that cannot work ([`AmpError::Usage`]): fix the
/// training loop. Nothing was changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UsageError {
    /// A call out of the per-step order each optimizer keeps: `zero_grad` -> `scale_loss` (one
    /// pass or more) -> `clip_grad_norm` -> `step`, as torch's GradScaler keeps `OptState`.
    /// Examples: `step()` twice with no `scale_loss` in between (the second would apply the
    /// same gradients again); `clip_grad_norm` before `scale_loss` (it would clip nothing) or
    /// on gradients a `delay_unscale` pass left scaled; `step()` while the last `scale_loss`
    /// used `delay_unscale` (the gradients are still scaled: run a `scale_loss` without it
    /// first); `step()` on gradients a backward outside `scale_loss` made while the loss is
    /// scaled; `Fp16Optimizer::step` after `backward_with(loss, false)` without
    /// `update_master_grads()`.
    #[error("{call} called {when}: {remedy}")]
    CallOrder {
        /// The call refused.
        call: &'static str,
        /// When it came.
        when: &'static str,
        /// The order to use.
        remedy: &'static str,
    },
    /// `step()` found gradients on low-precision model variables whose fp32 masters have none:
    /// a backward pass ran outside `scale_loss`, so the masters (which the optimizer steps)
    /// never saw it. Run backward inside `amp.scale_loss(&loss, &mut [&mut opt], |s|
    /// s.backward())`.
    #[error(
        "the fp16 variables {params:?} have gradients but their fp32 masters none: run backward inside scale_loss"
    )]
    GradientsNotUnscaled {
        /// The variables (at most 5) holding such gradients.
        params: Vec<String>,
    },
    /// `step()` found no gradient on any parameter: there is nothing to step (no backward since
    /// the last step or zero_grad; a skipped step clears the gradients, so a second `step()`
    /// after an overflow lands here).
    #[error("step() found no gradients: run scale_loss (the backward pass) once before each step()")]
    NoGradients,
    /// The whole state of a sharded optimizer was asked for (a checkpoint of it, its
    /// consolidated record) on a rank that does not hold it: each rank keeps the state and fp32
    /// masters of its shard only. Call `opt.consolidate_state_dict(to)` on every rank after the
    /// last step (torch's `consolidate_state_dict(to=0)`), then save on rank `to`; or use
    /// `distributed::save_checkpoint_on_rank0`, which does both.
    #[error(
        "the optimizer's state is sharded and was not consolidated on rank {rank} since its last change: call \
         consolidate_state_dict({rank}) on every rank first"
    )]
    NotConsolidated {
        /// This rank.
        rank: usize,
    },
    /// The loss given to `scale_loss` (or `GradScaler::scale`) cannot be back-propagated as it
    /// is: it is not a single value (reduce it with `mean()` or `sum()`), it does not require
    /// grad (compute it from the model's trainable variables, outside `no_grad`, without
    /// `detach`), it lives on another device than an optimizer's parameters, or it is not
    /// floating point (a scaled integer loss is a bug; torch would promote it to fp32).
    #[error("the loss given to {call} {problem}")]
    BadLoss {
        /// The call: `"scale_loss"` or `"GradScaler::scale"`.
        call: &'static str,
        /// What is wrong with it, and what to do.
        problem: String,
    },
    /// A [`crate::GradScaler`] was asked to unscale fp16 gradients (torch's "Attempting to
    /// unscale FP16 gradients."): it unscales fp32 (or bf16) gradients only. Keep the
    /// parameters in fp32 under autocast (it casts them per op), or use the Apex path's O2
    /// for fp32 master weights.
    #[error(
        "Attempting to unscale FP16 gradients (parameter {index} of the optimizer): keep the parameters in fp32 \
         under autocast, or use tch_amp::initialize with O2 for fp32 master weights"
    )]
    UnscaleFp16Gradients {
        /// The parameter's position in the optimizer's parameters.
        index: usize,
    },
    /// `scale_loss` was given no optimizer. Apex accepts `[]` and leaves the gradients scaled
    /// (then stepped with the scale in them); tch-amp refuses. Pass every optimizer whose
    /// parameters the loss reaches (`&mut [&mut opt]`).
    #[error("scale_loss was given no optimizer: pass every optimizer the loss reaches")]
    NoOptimizers,
    /// An optimizer made by another [`crate::Amp`] was given to `scale_loss`. Make the
    /// optimizer with this `Amp`'s `optimizer()` / `optimizer_for()`.
    #[error("an optimizer given to scale_loss was made by another Amp (id {optimizer_amp}, this is {amp})")]
    ForeignOptimizer {
        /// The id of the `Amp` that made the optimizer.
        optimizer_amp: u64,
        /// The id of the `Amp` whose `scale_loss` was called.
        amp: u64,
    },
    /// The same optimizer was given twice to one `scale_loss` call.
    #[error("the same optimizer was given twice to scale_loss: pass each once")]
    DuplicateOptimizer,
    /// torch.amp's autocast ([`crate::Autocast`]) was entered while tch-amp's Apex cast policy
    /// (O1, or the CPU emulation under O2/O3) is active on this thread, or the other way round.
    /// Both drive libtorch's autocast state, and mixing them would cast by the wrong lists:
    /// drop the other's guard (or `Amp`) first, or run them on different threads.
    #[error("{entering} cannot start on this thread while {active} is active: drop the other first")]
    AutocastConflict {
        /// What was being started.
        entering: &'static str,
        /// What is already active.
        active: &'static str,
    },
    /// Model and master parameter lists of `fp16_utils` that do not belong together.
    #[error("fp16_utils: {message}")]
    ParamListMismatch {
        /// What differs, and what to do.
        message: String,
    },
}

/// An op the O1 cast policy refused ([`AmpError::OpRefused`]). The cast engine raises these
/// inside libtorch's dispatcher, so a tch `f_*` call returns them as tch errors;
/// [`crate::cast::classify_torch_error`] recovers the type.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpRefused {
    /// An op on O1's banned list (`binary_cross_entropy`) was called with fp16/bf16 inputs.
    /// Its log saturates where a low-precision sigmoid has rounded to 0 or 1. Models usually
    /// apply a sigmoid right before it: pass the logits to
    /// `binary_cross_entropy_with_logits` (`BCEWithLogitsLoss`) instead, which is safe and runs
    /// in fp32 under O1; or set [`crate::AmpConfig::allow_banned`] to run the op in fp32.
    #[error("{op} is banned under O1 on fp16/bf16 inputs: use binary_cross_entropy_with_logits on the logits")]
    BannedOp {
        /// The aten op (`"binary_cross_entropy"`).
        op: String,
    },
    /// An op on O1's fp32 list was called in place on an fp16/bf16 tensor (Apex's in-place
    /// rule): the op runs in fp32, so its result cannot be written back into the
    /// low-precision tensor. Call the out-of-place op, or cast the tensor to fp32 first.
    #[error("{op} runs in fp32 under O1 and cannot write in place into a {dtype:?} tensor: call it out of place")]
    InPlaceFp32OnHalf {
        /// The in-place aten op (`"exp_"`).
        op: String,
        /// The tensor's dtype.
        dtype: Kind,
    },
}

/// The loss scaler collapsed ([`AmpError::Diverged`]). `step()` returns these after skipping
/// the step; the model is as before it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Divergence {
    /// `passes` consecutive backward passes of loss `loss_id` overflowed with the scale
    /// already at its floor (`collapse_limit`, see [`crate::AmpConfig::collapse_limit`]): the
    /// loss or the gradients are inf/NaN at every step. Look for a NaN in the data or the
    /// loss, a too high learning rate, or an op that overflows in fp16 (see
    /// `Amp::last_overflow` for the counts). `AmpConfig::collapse_limit(0)` skips forever, as
    /// Apex.
    #[error(
        "loss scaler {loss_id} collapsed: passes {first_pass}..={last_pass} overflowed at the floor scale \
         {loss_scale:e} (first non-finite: {params:?}); look for NaN in the data or loss, or lower the learning rate"
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
    /// silently stopped learning. An overflow storm drove the scale down: raise
    /// `min_loss_scale`, or let it regrow faster with
    /// `AmpConfig::recovery_growth_interval`; `AmpConfig::collapse_limit(0)` turns the check
    /// off.
    #[error(
        "loss scaler {loss_id} at its floor {loss_scale:e}: all gradients were zero in passes \
         {first_pass}..={last_pass}; raise min_loss_scale"
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
}

/// A checkpoint or state that does not fit, or is corrupt ([`AmpError::State`]). Validation
/// runs before anything is applied: nothing was loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// A state dict or checkpoint that does not match what it is loaded into.
    #[error("state does not match: {message}; nothing was loaded")]
    StateMismatch {
        /// What differs.
        message: String,
    },
    /// A strict load found keys on one side only (torch's `load_state_dict(strict=True)` error):
    /// a partial load ([`crate::checkpoint::load_model_weights`],
    /// [`crate::checkpoint::load_optimizer_state`]; `strict = false` loads what matches and
    /// reports these as a [`crate::checkpoint::LoadReport`]), or a torch checkpoint's model state
    /// dict against the `VarStore` (`TorchLoadOptions::strict(false)` loads the names both have;
    /// when the two sides differ by a prefix on every key, `remedy` names the
    /// [`KeyPrefix`](crate::torch_checkpoint::KeyPrefix) that fixes it).
    #[error("strict load of {what}: missing {missing_keys:?}, unexpected {unexpected_keys:?}; {remedy}")]
    IncompatibleKeys {
        /// What was being loaded: `"model weights"`, `"optimizer <i> state"`, `"the model state dict"`.
        what: String,
        /// Keys this side has that the checkpoint lacks.
        missing_keys: Vec<String>,
        /// Keys of the checkpoint this side does not have.
        unexpected_keys: Vec<String>,
        /// What to do.
        remedy: String,
    },
    /// Optimizer state that would poison the next step: a negative second moment (its square
    /// root is NaN), or a hyper-parameter finite in f64 that becomes inf or 0 in fp32, where
    /// the update is computed (`lr = 1e308`, `eps = 5e-324`). Found by
    /// [`crate::optim::OptimizerRecord::validate`] before anything is applied; the checkpoint
    /// is corrupt or crafted.
    #[error("optimizer state {param}: {message}; nothing was loaded")]
    PoisonedState {
        /// The parameter (its VarStore name, with the buffer: `fc.weight exp_avg_sq`) or the
        /// hyper-parameter (`group 0 lr`).
        param: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor whose dtype cannot go where it should: a checkpoint tensor of another dtype than
    /// the variable it is loaded into, an integer tensor for a floating variable or the other way
    /// round, or any difference under
    /// [`TorchLoadOptions::exact_dtypes`](crate::torch_checkpoint::TorchLoadOptions::exact_dtypes).
    #[error(
        "{path} has dtype {found:?}, which cannot be loaded into {target}: expected {expected}; nothing was loaded"
    )]
    DtypeMismatch {
        /// Where in the file.
        path: String,
        /// The variable or parameter (VarStore name).
        target: String,
        /// What is accepted, in words.
        expected: String,
        /// The file's dtype.
        found: Kind,
    },
    /// A tensor of another shape than the variable or parameter it goes to.
    #[error("{path} has shape {found:?}, but {target} has shape {expected:?}")]
    ShapeMismatch {
        /// Where in the file.
        path: String,
        /// The variable or parameter (VarStore name).
        target: String,
        /// Its shape.
        expected: Vec<i64>,
        /// The file's shape.
        found: Vec<i64>,
    },
    /// A weight, buffer or optimizer state holding inf or NaN.
    #[error("{path} holds inf or NaN: the run that wrote it had already diverged; resume from an earlier checkpoint")]
    NonFinite {
        /// Where in the file.
        path: String,
    },
    /// An optimizer state dict over another number of parameters than the optimizer holds.
    #[error(
        "{path}: the file's param_groups list {in_file} parameters, optimizer {optimizer} holds {in_optimizer}: the \
         checkpoint was written for another model or another parameter selection"
    )]
    ParamCount {
        /// Which optimizer (position in the slice given).
        optimizer: usize,
        /// The optimizer state dict's path in the file.
        path: String,
        /// Parameters in the file.
        in_file: usize,
        /// Parameters of the optimizer.
        in_optimizer: usize,
    },
    /// A state dict of another optimizer class.
    #[error("{path} holds the state of a {in_file} optimizer, but optimizer {optimizer} is {in_optimizer}")]
    OptimizerKind {
        /// Which optimizer.
        optimizer: usize,
        /// The optimizer state dict's path in the file.
        path: String,
        /// The class the file's hyper-parameters describe.
        in_file: String,
        /// The optimizer's kind.
        in_optimizer: String,
    },
    /// A hyper-parameter of a param group that differs from the optimizer's group's own under
    /// [`crate::torch_checkpoint::TorchLoadOptions::strict_hyper_parameters`] (by default the file's values are
    /// taken, as torch's `load_state_dict` takes them), or two values (learning rates,
    /// hyper-parameters) that two of the file's groups give one parameter group of the optimizer.
    #[error("{path}: {name} is {in_file} in the file, {in_optimizer} in optimizer {optimizer}: {remedy}")]
    HyperParameter {
        /// Which optimizer.
        optimizer: usize,
        /// The param group's path in the file.
        path: String,
        /// torch's name of the hyper-parameter.
        name: String,
        /// The file's value.
        in_file: String,
        /// The optimizer's value.
        in_optimizer: String,
        /// What to do.
        remedy: &'static str,
    },
    /// torch's parameter order (the `params` lists of `param_groups`) cannot be mapped onto
    /// the optimizer's parameters without guessing.
    #[error(
        "optimizer {optimizer}: cannot tell which parameter each index of the file's param_groups is: {reason}; \
         give the order with TorchLoadOptions::param_order"
    )]
    ParamOrder {
        /// Which optimizer.
        optimizer: usize,
        /// Why.
        reason: String,
    },
    /// The checkpoint dict lacks an entry the options say to read (the model's, an
    /// optimizer's, the loss scalers', the master parameters'). The message names the option
    /// that names the entry, or leaves it out.
    #[error("the checkpoint has no {key:?} entry ({holds}): {remedy}")]
    MissingEntry {
        /// The key looked for.
        key: String,
        /// What it would hold.
        holds: &'static str,
        /// The option to use.
        remedy: &'static str,
    },
}

/// [`UsageError::BadLoss`] unless `loss` is one value with an autograd graph (what `backward`
/// needs; tch's `backward` panics with a C++ trace otherwise).
pub(crate) fn check_loss_value(loss: &tch::Tensor) -> Result<()> {
    let problem = if !loss.defined() {
        "is undefined: pass the loss tensor itself".to_string()
    } else if loss.numel() != 1 {
        format!("has shape {:?}, not a single value: reduce it with mean() or sum()", loss.size())
    } else if !loss.requires_grad() {
        "does not require grad: compute it from the model's trainable variables, outside no_grad".to_string()
    } else {
        return Ok(());
    };
    Err(AmpError::Usage(UsageError::BadLoss { call: "scale_loss", problem }))
}
