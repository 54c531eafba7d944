//! What [`crate::load_torch_checkpoint`] and [`crate::save_torch_checkpoint`] read and write:
//! the keys of the checkpoint dict, strictness, the `module.` prefix, parameter orders.
use std::collections::BTreeMap;

use tch::Device;

use crate::torch_io::{Limits, Value};

/// torch.optim's parameter order: per param group (in `param_groups` order), the VarStore names
/// of its parameters in the order of the group's `params` list. Index `i` of torch's state
/// dict is the `i`-th name of the groups read one after the other.
pub type TorchParamOrder = Vec<Vec<String>>;

/// What to do with a prefix on every key of the model state dict: `module.`, written by
/// `nn.DataParallel` and `DistributedDataParallel` models (Apex's imagenet example saves
/// `model.state_dict()` of its DDP model), `_orig_mod.`, written by a `torch.compile`d model
/// (nanoGPT saves its compiled model's state dict), or both stacked (`module._orig_mod.`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyPrefix {
    /// Strip `module.` and `_orig_mod.` (one after the other when stacked) while every key
    /// starts with one of them and no variable of the VarStore does (the report's
    /// `stripped_prefix` says what was stripped).
    #[default]
    Auto,
    /// Strip this prefix from the keys that start with it.
    Strip(String),
    /// Use the keys as they are.
    Keep,
}

/// Options of [`crate::load_torch_checkpoint`]. The defaults read the dict of Apex's README
/// recipe, `{'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'amp':
/// amp.state_dict(), ...}`, or torch's AMP examples' `{'model', 'optimizer', 'scaler':
/// scaler.state_dict()}` when GradScalers are passed instead of an `Amp` (and no scaler entry
/// when `()` is); [`TorchLoadOptions::main_amp`] reads Apex's imagenet example (`main_amp.py`:
/// `{'epoch', 'arch', 'state_dict', 'best_prec1', 'optimizer'}`).
#[derive(Debug, Clone)]
pub struct TorchLoadOptions {
    pub(crate) map_location: Option<Device>,
    pub(crate) limits: Limits,
    pub(crate) strict: bool,
    pub(crate) exact_dtypes: bool,
    pub(crate) model_key: String,
    pub(crate) optimizer_keys: Vec<String>,
    /// `None`: the scalers' own key ([`crate::scaling::CheckpointScalers::torch_key`]).
    pub(crate) amp_key: Option<Option<String>>,
    pub(crate) amp_required: bool,
    pub(crate) key_prefix: KeyPrefix,
    pub(crate) param_orders: BTreeMap<usize, TorchParamOrder>,
    pub(crate) strict_hyper_parameters: bool,
    pub(crate) master_params: BTreeMap<usize, String>,
}

impl Default for TorchLoadOptions {
    fn default() -> Self {
        Self {
            map_location: None,
            limits: Limits::default(),
            strict: true,
            exact_dtypes: false,
            model_key: "model".into(),
            optimizer_keys: vec!["optimizer".into()],
            amp_key: None,
            amp_required: true,
            key_prefix: KeyPrefix::Auto,
            param_orders: BTreeMap::new(),
            strict_hyper_parameters: false,
            master_params: BTreeMap::new(),
        }
    }
}

impl TorchLoadOptions {
    /// Apex's README recipe: keys `model`, `optimizer` and `amp` (required) for an `Amp`, or
    /// `scaler` (required) for GradScalers; strict.
    pub fn new() -> Self {
        Self::default()
    }

    /// Apex's imagenet example (`examples/imagenet/main_amp.py`): the model under
    /// `state_dict` (with `module.` prefixes when it was saved from a DDP model: stripped),
    /// the optimizer under `optimizer`, and the amp state under `amp` when the file has one
    /// (main_amp.py writes none: then the loss scalers keep their state, as main_amp.py's
    /// resume does). `epoch`, `arch` and `best_prec1` end up in
    /// [`super::TorchLoadReport::entries`].
    pub fn main_amp() -> Self {
        Self { model_key: "state_dict".into(), amp_required: false, ..Self::default() }
    }

    /// The key of the loss scalers' state for `scalers`: the one set with [`Self::amp_key`],
    /// else the scalers' own.
    pub(crate) fn scaler_key(&self, own: Option<&'static str>) -> Option<String> {
        match &self.amp_key {
            Some(k) => k.clone(),
            None => own.map(str::to_string),
        }
    }

    /// The device every tensor is read onto (`torch.load(map_location=...)`). Default: the
    /// VarStore's device (values end up there anyway, and a CUDA checkpoint then loads on a
    /// CPU machine).
    pub fn map_location(mut self, device: Device) -> Self {
        self.map_location = Some(device);
        self
    }

    /// Bounds on reading the file (default [`Limits::default`]): a server loading untrusted
    /// checkpoints can tighten them.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// As torch's `load_state_dict(strict=...)` (default true): a variable missing from the
    /// state dict or an entry no variable takes is [`StateError::IncompatibleKeys`](crate::error::StateError::IncompatibleKeys).
    /// With `false` the names both have are loaded and the others listed in the report.
    pub fn strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }

    /// Refuse dtype conversions (default false). By default every floating tensor loads into
    /// every floating variable as torch's `copy_` does (an fp32 state dict into O2's fp16 model:
    /// rounded once; the conversions are listed in the report); integer tensors must have the
    /// variable's dtype. With `true` a floating tensor must have the variable's dtype, or be
    /// fp32 for an fp16/bf16 variable (what Apex's O2 state dict hook writes), and optimizer
    /// state must have the dtype the optimizer keeps it in.
    pub fn exact_dtypes(mut self, exact: bool) -> Self {
        self.exact_dtypes = exact;
        self
    }

    /// The key of the model state dict (default `model`).
    pub fn model_key(mut self, key: impl Into<String>) -> Self {
        self.model_key = key.into();
        self
    }

    /// The keys of the optimizers' state dicts, one per optimizer passed, in the same order
    /// (default `["optimizer"]`). When no optimizer is passed, none is read.
    pub fn optimizer_keys<S: Into<String>>(mut self, keys: impl IntoIterator<Item = S>) -> Self {
        self.optimizer_keys = keys.into_iter().map(Into::into).collect();
        self
    }

    /// The key of the loss scalers' state (Apex's `amp.state_dict()` for an `Amp`, which also
    /// takes a `GradScaler.state_dict()`; `scaler.state_dict()` for a GradScaler, a list of them
    /// for several), `None` to leave the scalers alone; `required`: a file without it is an
    /// error (default: the scalers' own key, `amp` or `scaler`, required; nothing for `()`).
    /// BERT's run_pretraining.py saves no scaler state: `amp_key(None, false)`.
    pub fn amp_key(mut self, key: Option<&str>, required: bool) -> Self {
        self.amp_key = Some(key.map(str::to_string));
        self.amp_required = required;
        self
    }

    /// Restore optimizer `optimizer`'s master parameters from the entry `key` (Apex-era
    /// scripts' `'master params': list(amp.master_params(optimizer))`, which BERT's
    /// run_pretraining.py copies back into the masters on resume): a list of tensors in the
    /// optimizer's torch order (its param groups one after the other, see [`super`]). Each goes
    /// to the fp32 master of its parameter, or to the parameter itself where it has none (fp32
    /// parameters are their own masters), after the model state dict, so under O2 the masters
    /// get the saved fp32 values instead of the model's fp16 ones. A list of another length, or
    /// an entry whose shape does not fit its parameter, is an error.
    pub fn master_params(mut self, optimizer: usize, key: impl Into<String>) -> Self {
        self.master_params.insert(optimizer, key.into());
        self
    }

    /// What to do with a `module.` / `_orig_mod.` prefix on the model's keys (default
    /// [`KeyPrefix::Auto`]). The same prefix is stripped from torch's `param_names`.
    pub fn key_prefix(mut self, prefix: KeyPrefix) -> Self {
        self.key_prefix = prefix;
        self
    }

    /// Refuse a param group whose hyper-parameters (all but `lr`) differ from those of the
    /// optimizer's parameter group it goes to; the error names the group, the key and both
    /// values (default false: the file's values are taken, as torch's
    /// `optimizer.load_state_dict` takes them).
    pub fn strict_hyper_parameters(mut self, strict: bool) -> Self {
        self.strict_hyper_parameters = strict;
        self
    }

    /// torch's parameter order for optimizer `optimizer` (its position in the slice passed),
    /// when neither the file's `param_names` nor the model state dict's order gives it (see
    /// [`super`]): per param group, the VarStore names of its parameters, in the order the
    /// Python script put them into the group.
    pub fn param_order(mut self, optimizer: usize, order: TorchParamOrder) -> Self {
        self.param_orders.insert(optimizer, order);
        self
    }
}

/// Options of [`crate::save_torch_checkpoint`]. The defaults write the dict of Apex's README
/// recipe (with an `Amp`), or of torch's AMP examples (`'scaler'` with GradScalers; no scaler
/// entry with `()`); [`TorchSaveOptions::main_amp`] writes Apex's imagenet example's.
#[derive(Debug)]
pub struct TorchSaveOptions {
    pub(crate) model_key: String,
    pub(crate) optimizer_keys: Vec<String>,
    /// `None`: the scalers' own key ([`crate::scaling::CheckpointScalers::torch_key`]).
    pub(crate) amp_key: Option<Option<String>>,
    pub(crate) master_params: BTreeMap<usize, String>,
    pub(crate) key_prefix: Option<String>,
    pub(crate) param_names: bool,
    pub(crate) param_orders: BTreeMap<usize, TorchParamOrder>,
    pub(crate) num_batches_tracked: Option<i64>,
    pub(crate) tied: Vec<(String, String)>,
    pub(crate) entries: Vec<(String, Value)>,
}

impl Default for TorchSaveOptions {
    fn default() -> Self {
        Self {
            model_key: "model".into(),
            optimizer_keys: vec!["optimizer".into()],
            amp_key: None,
            master_params: BTreeMap::new(),
            key_prefix: None,
            param_names: true,
            param_orders: BTreeMap::new(),
            num_batches_tracked: None,
            tied: Vec::new(),
            entries: Vec::new(),
        }
    }
}

impl TorchSaveOptions {
    /// Apex's README recipe: `{'model', 'optimizer', 'amp'}` (`'scaler'` for GradScalers)
    /// plus the entries added with [`Self::entry`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Apex's imagenet example (`main_amp.py`): the model under `state_dict`, the optimizer
    /// under `optimizer`, plus `amp` (main_amp.py ignores it; tch-amp restores the scaler
    /// from it). Add `epoch`, `arch` and `best_prec1` with [`Self::entry`], and
    /// `key_prefix("module.")` for a script that loads into its DDP model.
    pub fn main_amp() -> Self {
        Self { model_key: "state_dict".into(), ..Self::default() }
    }

    /// The key of the model state dict (default `model`).
    pub fn model_key(mut self, key: impl Into<String>) -> Self {
        self.model_key = key.into();
        self
    }

    /// The keys of the optimizers' state dicts, one per optimizer passed (default
    /// `["optimizer"]`).
    pub fn optimizer_keys<S: Into<String>>(mut self, keys: impl IntoIterator<Item = S>) -> Self {
        self.optimizer_keys = keys.into_iter().map(Into::into).collect();
        self
    }

    /// The key of the loss scalers' state, `None` to write none (default: the scalers' own,
    /// `amp` for an `Amp`, `scaler` for GradScalers; none for `()`).
    pub fn amp_key(mut self, key: Option<&str>) -> Self {
        self.amp_key = Some(key.map(str::to_string));
        self
    }

    /// Write optimizer `optimizer`'s master parameters under `key`, as Apex-era scripts save
    /// `'master params': list(amp.master_params(optimizer))` (BERT's run_pretraining.py): a
    /// list of tensors in the optimizer's torch order (its param groups one after the other),
    /// each the fp32 master of its parameter, or the parameter itself where it has none.
    pub fn master_params(mut self, optimizer: usize, key: impl Into<String>) -> Self {
        self.master_params.insert(optimizer, key.into());
        self
    }

    /// The key of the loss scalers' state for `scalers`: the one set with [`Self::amp_key`],
    /// else the scalers' own.
    pub(crate) fn scaler_key(&self, own: Option<&'static str>) -> Option<String> {
        match &self.amp_key {
            Some(k) => k.clone(),
            None => own.map(str::to_string),
        }
    }

    /// A prefix put before every model key and parameter name (`"module."` for a script that
    /// loads into its `DistributedDataParallel` model; default none).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = Some(prefix.into());
        self
    }

    /// Whether each param group carries `param_names` (torch >= 2.6 writes them for optimizers
    /// made from `named_parameters()`; default true). They make the parameter order explicit
    /// for any reader; torch's `load_state_dict` does not use them, but copies them into the
    /// Python optimizer's groups (which then refuse `add_param_group` without names).
    pub fn param_names(mut self, on: bool) -> Self {
        self.param_names = on;
        self
    }

    /// The param groups torch's optimizer has in the Python script that will load the file,
    /// for optimizer `optimizer`: per group, the VarStore names in the group's order (default:
    /// one group per tch parameter group, see [`super::default_param_order`]).
    pub fn param_order(mut self, optimizer: usize, order: TorchParamOrder) -> Self {
        self.param_orders.insert(optimizer, order);
        self
    }

    /// Write `<module>.num_batches_tracked = tensor(n)` for every batch norm of the VarStore
    /// (a prefix with `running_mean` and `running_var` variables). tch's batch norm does not
    /// count batches; by default nothing is written and torch's `load_state_dict` keeps the
    /// module's own counter (it fills a missing `num_batches_tracked` in when the state dict
    /// carries no `_metadata`, as tch-amp's do not).
    pub fn num_batches_tracked(mut self, n: i64) -> Self {
        self.num_batches_tracked = Some(n);
        self
    }

    /// A second name of a tied parameter, as torch's `state_dict()` lists it: a model that uses
    /// one tensor under two module names (nanoGPT's `lm_head.weight`, tied to
    /// `transformer.wte.weight`) has one VarStore variable, and Python's strict
    /// `model.load_state_dict` wants both names. `alias` is written after the model's own
    /// entries (in the order given; torch writes it where its module is registered, which
    /// `load_state_dict` does not look at), viewing the same storage as `variable`'s entry, so
    /// the file holds the tensor once and `torch.load` gives one tensor under both names.
    pub fn tied(mut self, alias: impl Into<String>, variable: impl Into<String>) -> Self {
        self.tied.push((alias.into(), variable.into()));
        self
    }

    /// An entry of the checkpoint dict beside the model, optimizer and amp state (`epoch`,
    /// `arch`, `best_prec1`, ...), written first, in the order given.
    pub fn entry(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.entries.push((key.into(), value.into()));
        self
    }
}
