//! Writing and reading the checkpoint file (see the module above).
use crate::error::StateError;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::amp::Amp;
use crate::config::OptLevel;
use crate::dtype::is_floating;
use crate::error::{mismatch, AmpError, Result, TorchContext};
use crate::optim::{AmpOptimizer, GroupRecord, OptimizerRecord, ParamRecord};
use crate::scaling::{self, AmpState, CheckpointScalers};
use crate::torch_io::{Dict, Key, Value, MAX_DEPTH};

const FORMAT: &str = "tch-amp-checkpoint/5";
/// The format before checkpoints without an `Amp` (torch.amp's GradScalers, or none): an opt
/// level and Apex's scalers always; still read.
const FORMAT_4: &str = "tch-amp-checkpoint/4";
/// The format before parameter groups had hyper-parameters (per-group learning rates only);
/// still read.
const FORMAT_3: &str = "tch-amp-checkpoint/3";
/// The tensor holding torch.amp's scaler state (format 5, no `Amp`): the bytes of the
/// `torch.save` file of `scaler.state_dict()` (a list of them for several scalers).
const SCALER_TENSOR: &str = "scaler";
const METADATA_KEY: &str = "tch_amp";

/// The checkpoint's metadata. Every field is required; unknown fields are an error.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Metadata {
    format: String,
    /// The `Amp`'s opt level (absent in a format-5 checkpoint saved without an `Amp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    opt_level: Option<OptLevel>,
    /// The `Amp`'s scalers (absent without an `Amp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    amp: Option<AmpState>,
    optimizers: Vec<OptimizerMeta>,
    /// The caller's value of [`TrainingState`] (absent when null).
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    extra: serde_json::Value,
}

/// The rest of a training state, saved in the same file and the same atomic write as the
/// model, the optimizers and the loss scalers ([`save_checkpoint_with`]), so that a crash can
/// never leave an epoch or an EMA from another step than the weights: named tensors (an EMA's
/// weights, a sampler's state) and one JSON value (epoch, arguments, best metric). Read back
/// with [`read_training_state`].
#[derive(Debug, Default)]
pub struct TrainingState {
    /// Named tensors, stored as `extra/<name>` (any dtype the checkpoint format takes).
    pub tensors: BTreeMap<String, Tensor>,
    /// Any JSON value (`serde_json::json!({"epoch": 3, "best_acc": 0.91})`); null saves none.
    pub value: serde_json::Value,
}

impl TrainingState {
    /// Adds a component's state tree (a [`Value`] of dicts with string keys and tensor leaves,
    /// such as [`crate::float8::Float8Training::state_dict`]) as tensors named
    /// `<prefix>/<key>/<key>/...`; [`Self::tree`] reads it back.
    ///
    /// # Errors
    /// [`StateError::StateMismatch`] for a leaf that is not a tensor, a key that is not a
    /// string or holds `/`, or a name already taken.
    pub fn insert_tree(&mut self, prefix: &str, tree: &Value) -> Result<()> {
        let mut flat = Vec::new();
        flatten(prefix, tree, 0, &mut flat)?;
        if let Some((name, _)) = flat.iter().find(|(n, _)| self.tensors.contains_key(n)) {
            return Err(mismatch(format!("training state: {name} is taken")));
        }
        self.tensors.extend(flat);
        Ok(())
    }

    /// The tree [`Self::insert_tree`] stored under `prefix` (an empty dict when there is none).
    pub fn tree(&self, prefix: &str) -> Value {
        let start = format!("{prefix}/");
        let items: Vec<(Vec<&str>, &Tensor)> = self
            .tensors
            .iter()
            .filter_map(|(name, t)| name.strip_prefix(&start).map(|rest| (rest.split('/').collect(), t)))
            .collect();
        unflatten(items, 0)
    }
}

/// The dict tree of `(key path, tensor)` pairs (sorted by path), `depth` levels below the
/// root. Below [`MAX_DEPTH`] levels (a name from a crafted file), the rest of a path is one
/// key: the recursion is bounded.
fn unflatten(items: Vec<(Vec<&str>, &Tensor)>, depth: usize) -> Value {
    let mut groups: BTreeMap<&str, Vec<(Vec<&str>, &Tensor)>> = BTreeMap::new();
    let mut leaves = Dict::new();
    for (path, t) in items {
        match path.split_first() {
            Some((_, rest)) if !rest.is_empty() && depth >= MAX_DEPTH => {
                leaves.insert(path.join("/"), Value::Tensor(t.shallow_clone()));
            }
            Some((key, [])) => {
                leaves.insert(*key, Value::Tensor(t.shallow_clone()));
            }
            Some((key, rest)) => groups.entry(key).or_default().push((rest.to_vec(), t)),
            None => {}
        }
    }
    for (key, children) in groups {
        leaves.insert(key, unflatten(children, depth + 1));
    }
    Value::Dict(leaves)
}

/// `value`'s tensors named by their key paths under `prefix`, `depth` levels below the tree's
/// root; a tree deeper than [`MAX_DEPTH`] is refused (the recursion is bounded).
fn flatten(prefix: &str, value: &Value, depth: usize, out: &mut Vec<(String, Tensor)>) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(mismatch(format!("training state: {prefix}: nested deeper than {MAX_DEPTH} levels")));
    }
    match value {
        Value::Tensor(t) => out.push((prefix.to_string(), t.shallow_clone())),
        Value::Dict(d) => {
            for (key, v) in d.iter() {
                let Key::Str(k) = key else {
                    return Err(mismatch(format!("training state: {prefix}: key {key} is not a string")));
                };
                if k.contains('/') || k.is_empty() {
                    return Err(mismatch(format!("training state: {prefix}: key {k:?} is empty or holds '/'")));
                }
                flatten(&format!("{prefix}/{k}"), v, depth + 1, out)?;
            }
        }
        other => {
            return Err(mismatch(format!("training state: {prefix} is a {}, not a tensor or dict", other.type_name())))
        }
    }
    Ok(())
}

/// Tensors of a [`TrainingState`] are stored under this prefix.
const EXTRA_PREFIX: &str = "extra/";

/// The non-tensor part of an [`OptimizerRecord`]. Format 4 has `groups` and no `group_lr`;
/// format 3 the reverse.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct OptimizerMeta {
    kind: String,
    hyper_parameters: BTreeMap<String, f64>,
    lr: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    group_lr: Option<BTreeMap<usize, f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    groups: Option<Vec<GroupMeta>>,
    steps: u64,
    skipped: u64,
    params: Vec<String>,
}

/// A [`GroupRecord`] in the metadata.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupMeta {
    id: usize,
    lr: f64,
    hyper_parameters: BTreeMap<String, f64>,
    step: u64,
    params: Vec<String>,
}

fn st_dtype(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        other => {
            return Err(AmpError::State(StateError::DtypeMismatch {
                path: "a checkpointed tensor".into(),
                target: "a safetensors file".into(),
                expected: "a dtype safetensors stores".into(),
                found: other,
            }))
        }
    })
}

fn tch_kind(dtype: Dtype) -> Result<Kind> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        other => return Err(mismatch(format!("unsupported dtype {other:?} in checkpoint"))),
    })
}

/// A tensor's bytes on the host, contiguous.
struct HostTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl HostTensor {
    fn from_tensor(t: &Tensor) -> Result<Self> {
        let t = t
            .f_detach()
            .ctx("checkpoint")?
            .f_to_device(Device::Cpu)
            .ctx("checkpoint")?
            .f_contiguous()
            .ctx("checkpoint")?;
        let numel = t.numel();
        let mut bytes = vec![0u8; numel * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut bytes, numel).ctx("reading a tensor for the checkpoint")?;
        let shape = t.size().iter().map(|&d| d as usize).collect();
        Ok(Self { dtype: st_dtype(t.kind())?, shape, bytes })
    }
}

/// Names and tensors that go into a checkpoint, and the optimizers' metadata.
fn collect(vs: &VarStore, records: &[OptimizerRecord]) -> Result<(BTreeMap<String, HostTensor>, Vec<OptimizerMeta>)> {
    let mut out = BTreeMap::new();
    let masters: BTreeMap<&str, &Tensor> = records
        .iter()
        .flat_map(|r| r.params.iter().filter_map(|p| p.master.as_ref().map(|m| (p.name.as_str(), m))))
        .collect();
    let _no_grad = tch::no_grad_guard();
    for (name, var) in vs.variables() {
        let t = match masters.get(name.as_str()) {
            Some(m) => m.shallow_clone(),
            None if is_floating(var.kind()) && var.kind() != Kind::Double => {
                var.f_to_kind(Kind::Float).ctx("checkpoint")?
            }
            None => var,
        };
        out.insert(format!("model/{name}"), HostTensor::from_tensor(&t)?);
    }
    let mut metas = Vec::with_capacity(records.len());
    for (i, r) in records.iter().enumerate() {
        for p in &r.params {
            for (buf, t) in &p.buffers {
                out.insert(format!("optimizer{i}/{}/{buf}", p.name), HostTensor::from_tensor(t)?);
            }
            let step =
                i64::try_from(p.step).map_err(|_| mismatch(format!("{}: step {} overflows i64", p.name, p.step)))?;
            out.insert(format!("optimizer{i}/{}/step", p.name), HostTensor::from_tensor(&Tensor::from_slice(&[step]))?);
        }
        metas.push(OptimizerMeta {
            kind: r.kind.clone(),
            hyper_parameters: r.hyper_parameters.clone(),
            lr: r.lr,
            group_lr: None,
            groups: Some(
                r.groups
                    .iter()
                    .map(|g| GroupMeta {
                        id: g.id,
                        lr: g.lr,
                        hyper_parameters: g.hyper_parameters.clone(),
                        step: g.step,
                        params: g.params.clone(),
                    })
                    .collect(),
            ),
            steps: r.steps,
            skipped: r.skipped,
            params: r.params.iter().map(|p| p.name.clone()).collect(),
        });
    }
    Ok((out, metas))
}

/// Writes model variables, optimizer records and the loss scalers' state to `path` atomically
/// (a temporary file in the same folder, synced, renamed over `path`, the folder synced).
/// `scalers`: an [`Amp`] (its opt level and scalers are recorded), a [`crate::GradScaler`] or a
/// slice of them (torch.amp's path: no `Amp` needed), or `&()` for none.
///
/// A sharded optimizer's whole state must have been gathered on this rank first
/// ([`AmpOptimizer::consolidate_state_dict`]); [`crate::distributed::save_checkpoint_on_rank0`]
/// does both.
///
/// # Errors
/// [`AmpError::Io`](crate::AmpError::Io) when the file cannot be written (any previous file at `path` is left
/// intact, no temporary file is left behind); [`AmpError::Torch`] if a tensor cannot be read;
/// [`UsageError::NotConsolidated`](crate::error::UsageError::NotConsolidated) for a sharded
/// optimizer whose state is not gathered here.
pub fn save_checkpoint<S: CheckpointScalers + ?Sized>(
    path: impl AsRef<Path>,
    vs: &VarStore,
    optimizers: &[&AmpOptimizer],
    scalers: &S,
) -> Result<()> {
    save_checkpoint_with(path, vs, optimizers, scalers, &TrainingState::default())
}

/// [`save_checkpoint`] with the rest of a training state (`extra`) in the same file and the
/// same atomic write; [`read_training_state`] reads it back, and [`load_checkpoint`] ignores
/// it.
///
/// # Errors
/// As [`save_checkpoint`].
pub fn save_checkpoint_with<S: CheckpointScalers + ?Sized>(
    path: impl AsRef<Path>,
    vs: &VarStore,
    optimizers: &[&AmpOptimizer],
    scalers: &S,
    extra: &TrainingState,
) -> Result<()> {
    let records: Vec<OptimizerRecord> = optimizers.iter().map(|o| o.consolidated_record()).collect::<Result<_>>()?;
    save_records(path.as_ref(), vs, &records, scalers, extra)
}

/// [`save_checkpoint_with`] of optimizer records (each optimizer's whole record).
pub(crate) fn save_records<S: CheckpointScalers + ?Sized>(
    path: &Path,
    vs: &VarStore,
    records: &[OptimizerRecord],
    scalers: &S,
    extra: &TrainingState,
) -> Result<()> {
    let (mut tensors, optimizers) = collect(vs, records)?;
    for (name, t) in &extra.tensors {
        tensors.insert(format!("{EXTRA_PREFIX}{name}"), HostTensor::from_tensor(t)?);
    }
    let save_err = |message: String| AmpError::write(path, std::io::Error::other(message));
    let amp = scalers.as_amp();
    if amp.is_none() && scalers.torch_key().is_some() {
        let bytes = crate::torch_io::save_bytes(&scalers.scaler_state())
            .map_err(|e| save_err(format!("the scaler state: {e}")))?;
        tensors.insert(SCALER_TENSOR.into(), HostTensor { dtype: Dtype::U8, shape: vec![bytes.len()], bytes });
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(k, h)| {
            TensorView::new(h.dtype, h.shape.clone(), &h.bytes)
                .map(|v| (k.clone(), v))
                .map_err(|e| save_err(format!("{k}: {e:?}")))
        })
        .collect::<Result<_>>()?;
    let meta = Metadata {
        format: FORMAT.to_string(),
        opt_level: amp.map(|a| a.properties().opt_level()),
        amp: amp.map(Amp::amp_state),
        optimizers,
        extra: extra.value.clone(),
    };
    let json = serde_json::to_string(&meta).map_err(|e| save_err(format!("metadata: {e}")))?;
    let header = std::collections::HashMap::from([(METADATA_KEY.to_string(), json)]);
    let bytes =
        safetensors::tensor::serialize(views, &Some(header)).map_err(|e| save_err(format!("serializing: {e:?}")))?;
    crate::atomic_file::write(path, &bytes).map_err(|source| AmpError::write(path, source))
}

fn view_to_tensor(name: &str, v: &TensorView<'_>) -> Result<Tensor> {
    let kind = tch_kind(v.dtype())?;
    let shape: Vec<i64> = v.shape().iter().map(|&d| d as i64).collect();
    Tensor::f_from_data_size(v.data(), &shape, kind).map_err(|e| mismatch(format!("{name}: {e}")))
}

fn all_finite(name: &str, t: &Tensor) -> Result<()> {
    if !is_floating(t.kind()) {
        return Ok(());
    }
    let finite = t.f_isfinite().and_then(|f| f.f_all()).and_then(|a| a.f_int64_value(&[])).ctx("checkpoint")?;
    if finite == 0 {
        return Err(mismatch(format!("{name} holds inf or NaN")));
    }
    Ok(())
}

/// Reads the optimizer `i`'s record from the file (masters from the checked model values).
fn read_record(
    st: &SafeTensors<'_>,
    i: usize,
    meta: OptimizerMeta,
    masters: &BTreeMap<String, Tensor>,
    with_master: &[bool],
    consumed: &mut BTreeSet<String>,
) -> Result<OptimizerRecord> {
    let mut params = Vec::with_capacity(meta.params.len());
    for (name, &has_master) in meta.params.iter().zip(with_master) {
        let prefix = format!("optimizer{i}/{name}/");
        let step_key = format!("{prefix}step");
        let step_view = st.tensor(&step_key).map_err(|_| mismatch(format!("{step_key} is missing")))?;
        if step_view.dtype() != Dtype::I64 || step_view.shape() != [1] {
            return Err(mismatch(format!(
                "{step_key} must be one I64, found {:?} {:?}",
                step_view.dtype(),
                step_view.shape()
            )));
        }
        let step = view_to_tensor(&step_key, &step_view)?.f_int64_value(&[0]).ctx("checkpoint")?;
        let step = u64::try_from(step).map_err(|_| mismatch(format!("{step_key} = {step} is negative")))?;
        consumed.insert(step_key);
        let mut buffers = BTreeMap::new();
        for (key, view) in st.tensors() {
            if let Some(buf) = key.strip_prefix(&prefix) {
                if buf != "step" {
                    buffers.insert(buf.to_string(), view_to_tensor(&key, &view)?);
                    consumed.insert(key.clone());
                }
            }
        }
        let master = if has_master { masters.get(name).map(Tensor::shallow_clone) } else { None };
        params.push(ParamRecord { name: name.clone(), step, buffers, master });
    }
    Ok(OptimizerRecord {
        kind: meta.kind,
        hyper_parameters: meta.hyper_parameters,
        lr: meta.lr,
        group_lr: meta.group_lr.unwrap_or_default(),
        groups: meta
            .groups
            .unwrap_or_default()
            .into_iter()
            .map(|g| GroupRecord {
                id: g.id,
                lr: g.lr,
                hyper_parameters: g.hyper_parameters,
                step: g.step,
                params: g.params,
            })
            .collect(),
        steps: meta.steps,
        skipped: meta.skipped,
        params,
    })
}

/// Restores what [`save_checkpoint`] wrote into the same kind of setup (same opt level, same
/// VarStore names and shapes, same optimizers over the same parameters, same `num_losses`; the
/// same kind of `scalers`: an [`Amp`] for a checkpoint saved with one, the GradScaler(s) or `()`
/// for one saved without).
/// Variables keep their current dtype: fp16 model variables are set to the saved fp32 values
/// rounded, which is exact for values saved from fp16 or from masters (unlike `VarStore::load`,
/// nothing is silently recast). Everything is checked before anything is changed: the metadata
/// (every field required), every tensor's presence, dtype and shape, finite values in weights and
/// optimizer state, the optimizer kinds and the AMP state.
///
/// Which values come from the file, as with torch's `optimizer.load_state_dict`: every parameter
/// group's learning rate, hyper-parameters (weight decay, betas, momentum, ...) and step count, the
/// optimizer's default learning rate and its step/skip counts. The optimizers must run the same
/// update rule with the same default hyper-parameters as the saved ones (a typed error otherwise);
/// a group built with other values than the file's takes the file's.
///
/// # Errors
/// [`AmpError::Io`] if the file cannot be read; [`StateError::StateMismatch`] for a foreign or
/// damaged file, another opt level, a missing or extra variable, a shape, dtype or optimizer
/// mismatch, non-finite values, an invalid scaler state, or scalers of the other kind (an `Amp`
/// for a checkpoint saved without one, or the reverse). In every error case the model, the
/// optimizers and the scalers are untouched.
pub fn load_checkpoint<S: CheckpointScalers + ?Sized>(
    path: impl AsRef<Path>,
    vs: &VarStore,
    optimizers: &mut [&mut AmpOptimizer],
    scalers: &mut S,
) -> Result<()> {
    let path = path.as_ref();
    let (bytes, meta) = open(path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| mismatch(format!("{}: {e:?}", path.display())))?;
    // Phase 1: check everything, then apply.
    let mut consumed: BTreeSet<String> = BTreeSet::new();
    let scaler_state = match (scalers.as_amp(), meta.opt_level, &meta.amp) {
        (Some(amp), Some(saved), Some(state)) => {
            let level = amp.properties().opt_level();
            if saved != level {
                return Err(mismatch(format!(
                    "the checkpoint was written under {saved}, this Amp is {level}: load_model_weights and \
                     load_optimizer_state load its parts into another opt level"
                )));
            }
            ScalerChecked::Amp(amp.check_state_dict(&scaling::amp_state_value(state).node())?)
        }
        (Some(amp), None, _) => {
            return Err(mismatch(format!(
                "the checkpoint was written without an Amp (torch.amp's GradScaler, or no scaler), this Amp is {}: \
                 pass the GradScaler(s), or () for none",
                amp.properties().opt_level()
            )))
        }
        (None, Some(saved), _) => {
            return Err(mismatch(format!(
                "the checkpoint was written with an Amp under {saved}: pass that Amp to restore its loss scalers"
            )))
        }
        (None, None, _) => match st.tensor(SCALER_TENSOR) {
            Ok(view) => {
                consumed.insert(SCALER_TENSOR.to_string());
                if view.dtype() != Dtype::U8 || view.shape().len() != 1 {
                    return Err(mismatch(format!("{SCALER_TENSOR} must be U8 bytes, found {:?}", view.dtype())));
                }
                let value = crate::torch_io::load_bytes(view.data(), &crate::torch_io::LoadOptions::new())
                    .map_err(|e| mismatch(format!("the scaler state: {e}")))?;
                scalers.check_scaler_state(&value.node())?;
                ScalerChecked::Value(value)
            }
            Err(_) if scalers.torch_key().is_some() => {
                return Err(mismatch(
                    "the checkpoint holds no GradScaler state (it was saved without one): pass () for no scaler",
                ))
            }
            Err(_) => ScalerChecked::None,
        },
        (Some(_), Some(_), None) => return Err(mismatch("the checkpoint records an opt level but no amp state")),
    };
    if meta.optimizers.len() != optimizers.len() {
        return Err(mismatch(format!(
            "checkpoint has {} optimizers, {} given",
            meta.optimizers.len(),
            optimizers.len()
        )));
    }
    let vars = vs.variables();
    let saved_model = st.names().iter().filter(|n| n.starts_with("model/")).count();
    if saved_model != vars.len() {
        return Err(mismatch(format!("checkpoint has {saved_model} model variables, the VarStore has {}", vars.len())));
    }
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    let mut model_vals: Vec<(Tensor, Tensor)> = Vec::new();
    let mut checked: BTreeMap<String, Tensor> = BTreeMap::new();
    for name in names {
        let var = &vars[name];
        let key = format!("model/{name}");
        let v = st.tensor(&key).map_err(|_| mismatch(format!("variable {name} is missing from the checkpoint")))?;
        let t = check_variable(name, var, &v)?;
        consumed.insert(key);
        checked.insert(name.clone(), t.shallow_clone());
        model_vals.push((var.shallow_clone(), t));
    }
    let mut checked_records = Vec::with_capacity(optimizers.len());
    for (i, (o, m)) in optimizers.iter().zip(meta.optimizers).enumerate() {
        let with_master = o.master_flags();
        if m.params.len() != with_master.len() {
            return Err(mismatch(format!("optimizer {i} covers other parameters than the checkpoint's")));
        }
        let record = read_record(&st, i, m, &checked, &with_master, &mut consumed)?;
        checked_records.push(o.check_record(record).map_err(|e| match e {
            AmpError::State(StateError::StateMismatch { message }) => mismatch(format!("optimizer {i}: {message}")),
            other => other,
        })?);
    }
    if let Some(extra) = st.names().into_iter().find(|n| !consumed.contains(n.as_str()) && !n.starts_with(EXTRA_PREFIX))
    {
        return Err(mismatch(format!(
            "{}: tensor {extra:?} belongs to nothing being restored (a renamed or foreign tensor)",
            path.display()
        )));
    }
    // Phase 2: apply (all checks passed).
    let _no_grad = tch::no_grad_guard();
    for (var, t) in model_vals {
        let mut v = var;
        v.f_copy_(&t).ctx("restoring a model variable")?;
    }
    for (o, r) in optimizers.iter_mut().zip(checked_records) {
        o.apply_checked(r)?;
    }
    match scaler_state {
        ScalerChecked::Amp(state) => {
            if let Some(amp) = scalers.as_amp_mut() {
                amp.apply_checked_state(state);
            }
        }
        ScalerChecked::Value(v) => scalers.apply_scaler_state(&v.node())?,
        ScalerChecked::None => {}
    }
    Ok(())
}

/// The scalers' state of a checkpoint, checked, ready to apply.
enum ScalerChecked {
    /// An `Amp`'s (the metadata's `amp`).
    Amp(crate::scaling::ParsedState),
    /// torch.amp's (the `scaler` tensor's).
    Value(crate::torch_io::Value),
    /// None saved, none expected.
    None,
}

/// The [`TrainingState`] a [`save_checkpoint_with`] wrote into `path` (empty for a checkpoint
/// written without one). The file's format is checked; the model and optimizer parts are not read.
///
/// # Errors
/// [`AmpError::Io`] if the file cannot be read; [`StateError::StateMismatch`] for a foreign or
/// damaged file.
pub fn read_training_state(path: impl AsRef<Path>) -> Result<TrainingState> {
    let path = path.as_ref();
    let (bytes, meta) = open(path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| mismatch(format!("{}: {e:?}", path.display())))?;
    let mut tensors = BTreeMap::new();
    for name in st.names() {
        if let Some(short) = name.strip_prefix(EXTRA_PREFIX) {
            let view = st.tensor(name).map_err(|e| mismatch(format!("{name}: {e:?}")))?;
            tensors.insert(short.to_string(), view_to_tensor(name, &view)?);
        }
    }
    Ok(TrainingState { tensors, value: meta.extra })
}

/// Reads `path` and its metadata (format checked).
fn open(path: &Path) -> Result<(Vec<u8>, Metadata)> {
    let bytes = std::fs::read(path).map_err(|source| AmpError::read(path, source))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| mismatch(format!("{}: not a safetensors file ({e:?})", path.display())))?;
    let json = header.metadata().as_ref().and_then(|m| m.get(METADATA_KEY)).ok_or_else(|| {
        mismatch(format!("{} is not a tch-amp checkpoint (no {METADATA_KEY:?} metadata)", path.display()))
    })?;
    let meta: Metadata =
        serde_json::from_str(json).map_err(|e| mismatch(format!("{}: checkpoint metadata: {e}", path.display())))?;
    check_format(path, &meta)?;
    Ok((bytes, meta))
}

/// Format 5 (an `Amp`'s opt level and scalers, or neither), format 4 (parameter groups with
/// hyper-parameters) or format 3 (per-group learning rates), each with exactly its own fields.
fn check_format(path: &Path, meta: &Metadata) -> Result<()> {
    let v5 = meta.format == FORMAT;
    let v4 = v5 || meta.format == FORMAT_4;
    if !v4 && meta.format != FORMAT_3 {
        return Err(mismatch(format!(
            "{}: format {:?}, this tch-amp reads {FORMAT:?}, {FORMAT_4:?} and {FORMAT_3:?}",
            path.display(),
            meta.format
        )));
    }
    // Before format 5 every checkpoint had an Amp; in format 5 both or neither.
    if (!v5 && (meta.opt_level.is_none() || meta.amp.is_none())) || meta.opt_level.is_some() != meta.amp.is_some() {
        return Err(mismatch(format!(
            "{}: format {} needs \"opt_level\" and \"amp\"{}",
            path.display(),
            meta.format,
            if v5 { " together, or neither" } else { "" }
        )));
    }
    for (i, o) in meta.optimizers.iter().enumerate() {
        // Every parameter is in a group: a format-4 optimizer with parameters has groups.
        let groupless = o.groups.as_ref().is_some_and(|g| g.is_empty()) && !o.params.is_empty();
        if v4 != o.groups.is_some() || v4 == o.group_lr.is_some() || groupless {
            return Err(mismatch(format!(
                "{}: optimizer {i}: format {} needs {}",
                path.display(),
                meta.format,
                if v4 { "\"groups\" and no \"group_lr\"" } else { "\"group_lr\" and no \"groups\"" }
            )));
        }
    }
    Ok(())
}

/// The checkpoint's value of variable `name`, checked against `var` (shape; dtype: fp32 for
/// floating variables but fp64, the variable's own otherwise; finite) and moved to its device.
fn check_variable(name: &str, var: &Tensor, view: &TensorView<'_>) -> Result<Tensor> {
    let key = format!("model/{name}");
    let t = view_to_tensor(&key, view)?;
    if t.size() != var.size() {
        return Err(mismatch(format!(
            "variable {name}: checkpoint shape {:?}, model shape {:?}",
            t.size(),
            var.size()
        )));
    }
    let expected = if is_floating(var.kind()) && var.kind() != Kind::Double { Kind::Float } else { var.kind() };
    if t.kind() != expected {
        return Err(mismatch(format!("variable {name}: checkpoint dtype {:?}, expected {expected:?}", t.kind())));
    }
    all_finite(&key, &t)?;
    t.f_to_device(var.device()).ctx("checkpoint")
}

/// What a partial load left out, as torch's `load_state_dict` reports it (its
/// `_IncompatibleKeys`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Keys this side has that the checkpoint lacks (kept as they were).
    pub missing_keys: Vec<String>,
    /// Keys of the checkpoint this side does not have (ignored).
    pub unexpected_keys: Vec<String>,
}

impl LoadReport {
    /// Whether nothing was missing or unexpected.
    pub fn is_complete(&self) -> bool {
        self.missing_keys.is_empty() && self.unexpected_keys.is_empty()
    }
}

/// Loads only the model weights of a checkpoint written by [`save_checkpoint`] (torch's
/// `model.load_state_dict(checkpoint["model"], strict)`): every variable of `vs` found in the file
/// gets its saved value (the fp32 value rounded to an fp16 variable's dtype), and so do the fp32
/// masters of `optimizers` (exactly: the file holds the masters' values), so that the next step
/// does not overwrite the loaded weights with stale masters. Pass every optimizer over `vs` (none
/// for inference). The opt level, optimizer state and loss scale are not touched; a checkpoint of
/// another opt level loads as well.
///
/// `strict`: every variable of `vs` and no other must be in the file, else nothing is loaded and
/// the error names them. Not strict: the variables found are loaded and the report lists the
/// variables of `vs` the file lacks (`missing_keys`, left as they were) and the file's variables
/// `vs` lacks (`unexpected_keys`, ignored). A shape or dtype mismatch is an error either way (as in
/// torch).
///
/// # Errors
/// [`AmpError::Io`]; [`StateError::StateMismatch`] for a foreign or damaged file, a shape or dtype
/// mismatch or non-finite values; [`StateError::IncompatibleKeys`] (strict) for missing or
/// unexpected variables. Nothing is changed then.
pub fn load_model_weights(
    path: impl AsRef<Path>,
    vs: &VarStore,
    optimizers: &mut [&mut AmpOptimizer],
    strict: bool,
) -> Result<LoadReport> {
    let path = path.as_ref();
    let (bytes, _meta) = open(path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| mismatch(format!("{}: {e:?}", path.display())))?;
    let vars = vs.variables();
    let mut report = LoadReport::default();
    let saved: BTreeSet<String> =
        st.names().into_iter().filter_map(|n| n.strip_prefix("model/").map(str::to_string)).collect();
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    let mut checked: BTreeMap<String, Tensor> = BTreeMap::new();
    for name in names {
        match st.tensor(&format!("model/{name}")) {
            Ok(view) => {
                checked.insert(name.clone(), check_variable(name, &vars[name], &view)?);
            }
            Err(_) => report.missing_keys.push(name.clone()),
        }
    }
    report.unexpected_keys = saved.into_iter().filter(|n| !vars.contains_key(n)).collect();
    if strict && !report.is_complete() {
        return Err(AmpError::State(StateError::IncompatibleKeys {
            what: "model weights".to_string(),
            missing_keys: report.missing_keys,
            unexpected_keys: report.unexpected_keys,
            remedy: "load with strict = false".to_string(),
        }));
    }
    let _no_grad = tch::no_grad_guard();
    for (name, t) in &checked {
        let mut v = vars[name].shallow_clone();
        v.f_copy_(t).ctx("restoring a model variable")?;
    }
    for o in optimizers.iter_mut() {
        o.set_masters(&checked)?;
    }
    Ok(report)
}

/// Loads only the optimizer state of a checkpoint written by [`save_checkpoint`] (torch's
/// `optimizer.load_state_dict(checkpoint["optimizer"])`): for each optimizer, the state tensors and
/// step count of each parameter, the groups' learning rates, hyper-parameters and step counts, the
/// default learning rate and the step/skip counters. Model weights and fp32 masters are not touched
/// ([`load_model_weights`] loads both), nor the loss scale. The optimizers must run the same rule
/// with the same default hyper-parameters as the saved ones (the i-th given is the checkpoint's
/// i-th).
///
/// `strict`: each optimizer must cover the same parameters in the same groups as the saved one, and
/// as many optimizers must be given as were saved. Not strict: parameters and groups are matched by
/// name and id; those of the optimizer the file lacks keep their state (`missing_keys`), those of
/// the file the optimizer lacks are ignored (`unexpected_keys`; groups as `param_groups.<id>`), and
/// saved optimizers beyond those given are ignored. One report per optimizer given.
///
/// # Errors
/// [`AmpError::Io`]; [`StateError::StateMismatch`] for a foreign or damaged file, another rule or
/// other defaults, state tensors of the wrong shape, dtype or values, or (strict) the same
/// parameters in other groups or another order; [`StateError::IncompatibleKeys`] (strict) for
/// parameters or groups on one side only. Nothing is changed then.
pub fn load_optimizer_state(
    path: impl AsRef<Path>,
    optimizers: &mut [&mut AmpOptimizer],
    strict: bool,
) -> Result<Vec<LoadReport>> {
    let path = path.as_ref();
    let (bytes, meta) = open(path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| mismatch(format!("{}: {e:?}", path.display())))?;
    if optimizers.len() > meta.optimizers.len() || (strict && optimizers.len() != meta.optimizers.len()) {
        return Err(mismatch(format!(
            "checkpoint has {} optimizers, {} given",
            meta.optimizers.len(),
            optimizers.len()
        )));
    }
    let mut checked = Vec::with_capacity(optimizers.len());
    let mut consumed = BTreeSet::new();
    for (i, (o, m)) in optimizers.iter().zip(meta.optimizers).enumerate() {
        let no_masters = vec![false; m.params.len()];
        let record = read_record(&st, i, m, &BTreeMap::new(), &no_masters, &mut consumed)?;
        checked.push(o.check_state_only(record, strict).map_err(|e| match e {
            AmpError::State(StateError::StateMismatch { message }) => mismatch(format!("optimizer {i}: {message}")),
            AmpError::State(StateError::IncompatibleKeys { missing_keys, unexpected_keys, remedy, .. }) => {
                AmpError::State(StateError::IncompatibleKeys {
                    what: format!("optimizer {i} state"),
                    missing_keys,
                    unexpected_keys,
                    remedy,
                })
            }
            other => other,
        })?);
    }
    let mut reports = Vec::with_capacity(checked.len());
    for (o, s) in optimizers.iter_mut().zip(checked) {
        let (missing_keys, unexpected_keys) = o.apply_state_only(s)?;
        reports.push(LoadReport { missing_keys, unexpected_keys });
    }
    Ok(reports)
}
