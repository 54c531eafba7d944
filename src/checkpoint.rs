//! Training checkpoints that resume bit-exactly: model variables (fp32, taken from the
//! masters where there are masters, so nothing is rebuilt from fp16 as in Apex), optimizer
//! state (moments, step counts, learning rate) and the loss scalers, in one safetensors file
//! written atomically. Loading checks everything first and changes nothing on a mismatch.
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::amp::Amp;
use crate::amp_optimizer::AmpOptimizer;
use crate::dtype::is_floating;
use crate::error::{AmpError, Result, TorchContext};

const FORMAT: &str = "tch-amp-checkpoint/1";

fn io_err(path: &Path, source: std::io::Error) -> AmpError {
    AmpError::Io { path: path.to_path_buf(), source }
}

fn mismatch(message: impl Into<String>) -> AmpError {
    AmpError::StateMismatch { message: message.into() }
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
        other => return Err(mismatch(format!("cannot checkpoint a tensor of kind {other:?}"))),
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
        let t = t.f_detach().ctx("checkpoint")?.f_to_device(Device::Cpu).ctx("checkpoint")?.f_contiguous().ctx("checkpoint")?;
        let numel = t.numel();
        let mut bytes = vec![0u8; numel * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut bytes, numel).ctx("reading a tensor for the checkpoint")?;
        let shape = t.size().iter().map(|&d| d as usize).collect();
        Ok(Self { dtype: st_dtype(t.kind())?, shape, bytes })
    }
}

/// Names and tensors that go into a checkpoint, before serialization.
fn collect(vs: &VarStore, optimizers: &[&AmpOptimizer]) -> Result<BTreeMap<String, HostTensor>> {
    let mut out = BTreeMap::new();
    let mut masters: HashMap<&str, &Tensor> = HashMap::new();
    for o in optimizers {
        for e in &o.entries {
            if let Some(m) = &e.master {
                masters.insert(e.name.as_str(), m);
            }
        }
    }
    let _no_grad = tch::no_grad_guard();
    for (name, var) in vs.variables() {
        let t = match masters.get(name.as_str()) {
            Some(m) => m.shallow_clone(),
            None if is_floating(var.kind()) && var.kind() != Kind::Double => var.f_to_kind(Kind::Float).ctx("checkpoint")?,
            None => var,
        };
        out.insert(format!("model/{name}"), HostTensor::from_tensor(&t)?);
    }
    for (i, o) in optimizers.iter().enumerate() {
        for (e, st) in o.entries.iter().zip(&o.inner.state) {
            for (buf, t) in &st.buffers {
                out.insert(format!("optimizer{i}/{}/{buf}", e.name), HostTensor::from_tensor(t)?);
            }
            let step = Tensor::from_slice(&[st.step as i64]);
            out.insert(format!("optimizer{i}/{}/step", e.name), HostTensor::from_tensor(&step)?);
        }
    }
    Ok(out)
}

/// Writes model variables, optimizer state and the AMP state to `path` atomically (a
/// temporary file in the same folder, synced, then renamed over `path`).
///
/// # Errors
/// [`AmpError::Io`] when the file cannot be written (any previous file at `path` is left
/// intact); [`AmpError::Torch`] if a tensor cannot be read.
pub fn save_checkpoint(path: impl AsRef<Path>, vs: &VarStore, optimizers: &[&AmpOptimizer], amp: &Amp) -> Result<()> {
    let path = path.as_ref();
    let tensors = collect(vs, optimizers)?;
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(k, h)| {
            TensorView::new(h.dtype, h.shape.clone(), &h.bytes)
                .map(|v| (k.clone(), v))
                .map_err(|e| mismatch(format!("{k}: {e:?}")))
        })
        .collect::<Result<_>>()?;
    let optim_meta: Vec<serde_json::Value> = optimizers
        .iter()
        .map(|o| {
            let (steps, skipped) = o.step_counts();
            serde_json::json!({
                "lr": o.lr(), "group_lr": o.inner.group_lr, "steps": steps, "skipped": skipped, "params": o.param_names()
            })
        })
        .collect();
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), FORMAT.to_string());
    meta.insert("opt_level".to_string(), amp.properties().opt_level.to_string());
    meta.insert("amp".to_string(), serde_json::to_string(&amp.state_dict()).unwrap_or_default());
    meta.insert("optimizers".to_string(), serde_json::Value::Array(optim_meta).to_string());
    let bytes = safetensors::tensor::serialize(views, &Some(meta)).map_err(|e| mismatch(format!("serializing: {e:?}")))?;
    write_atomically(path, &bytes)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let file_name = path.file_name().ok_or_else(|| io_err(path, std::io::Error::other("not a file path")))?;
    let tmp: PathBuf = dir.join(format!(".{}.tmp-{}", file_name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(path, e));
    }
    Ok(())
}

fn view_to_tensor(name: &str, v: &TensorView<'_>) -> Result<Tensor> {
    let kind = tch_kind(v.dtype())?;
    let shape: Vec<i64> = v.shape().iter().map(|&d| d as i64).collect();
    Tensor::f_from_data_size(v.data(), &shape, kind).map_err(|e| mismatch(format!("{name}: {e}")))
}

/// Restores what [`save_checkpoint`] wrote into the same kind of setup (same VarStore names
/// and shapes, same optimizers over the same parameters, same `num_losses`). Variables keep
/// their current dtype: fp16 model variables are set to the saved fp32 values rounded, which
/// is exact for values saved from fp16 or from masters (unlike `VarStore::load`, nothing is
/// silently recast). Everything is checked before anything is changed.
///
/// # Errors
/// [`AmpError::Io`] if the file cannot be read; [`AmpError::StateMismatch`] for a foreign
/// file, a missing or extra variable, a shape or optimizer mismatch, or an invalid AMP state —
/// in every error case the model, optimizers and `amp` are untouched.
pub fn load_checkpoint(
    path: impl AsRef<Path>,
    vs: &VarStore,
    optimizers: &mut [&mut AmpOptimizer],
    amp: &mut Amp,
) -> Result<()> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| io_err(path, e))?;
    let (_, metadata) = SafeTensors::read_metadata(&bytes).map_err(|e| mismatch(format!("{}: not a safetensors file ({e:?})", path.display())))?;
    let meta = metadata.metadata().clone().unwrap_or_default();
    if meta.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(mismatch(format!("{} is not a tch-amp checkpoint", path.display())));
    }
    let st = SafeTensors::deserialize(&bytes).map_err(|e| mismatch(format!("{}: {e:?}", path.display())))?;
    // Phase 1: check and stage everything.
    let amp_json: serde_json::Value = serde_json::from_str(meta.get("amp").map_or("{}", String::as_str))
        .map_err(|e| mismatch(format!("amp state: {e}")))?;
    let amp_state = amp.parse_state(&amp_json)?;
    let optim_meta: Vec<serde_json::Value> = serde_json::from_str(meta.get("optimizers").map_or("[]", String::as_str))
        .map_err(|e| mismatch(format!("optimizer metadata: {e}")))?;
    if optim_meta.len() != optimizers.len() {
        return Err(mismatch(format!("checkpoint has {} optimizers, {} given", optim_meta.len(), optimizers.len())));
    }
    let vars = vs.variables();
    let mut model_vals: Vec<(Tensor, Tensor)> = Vec::new();
    let saved_model = st.names().iter().filter(|n| n.starts_with("model/")).count();
    if saved_model != vars.len() {
        return Err(mismatch(format!("checkpoint has {saved_model} model variables, the VarStore has {}", vars.len())));
    }
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    let mut staged: HashMap<String, Tensor> = HashMap::new();
    for name in names {
        let var = &vars[name];
        let key = format!("model/{name}");
        let v = st.tensor(&key).map_err(|_| mismatch(format!("variable {name} is missing from the checkpoint")))?;
        let t = view_to_tensor(&key, &v)?;
        if t.size() != var.size() {
            return Err(mismatch(format!("variable {name}: checkpoint shape {:?}, model shape {:?}", t.size(), var.size())));
        }
        if is_floating(var.kind()) != is_floating(t.kind()) {
            return Err(mismatch(format!("variable {name}: checkpoint kind {:?}, model kind {:?}", t.kind(), var.kind())));
        }
        staged.insert(name.clone(), t.shallow_clone());
        model_vals.push((var.shallow_clone(), t));
    }
    let mut optim_vals = Vec::new();
    for (i, (o, m)) in optimizers.iter().zip(&optim_meta).enumerate() {
        let names: Vec<String> = m["params"].as_array().map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect()).unwrap_or_default();
        if names != o.param_names() {
            return Err(mismatch(format!("optimizer {i} covers other parameters than the checkpoint's")));
        }
        let lr = m["lr"].as_f64().ok_or_else(|| mismatch(format!("optimizer {i}: no lr")))?;
        let group_lr: BTreeMap<usize, f64> = serde_json::from_value(m["group_lr"].clone()).unwrap_or_default();
        let steps = m["steps"].as_u64().unwrap_or(0);
        let skipped = m["skipped"].as_u64().unwrap_or(0);
        let mut per_param = Vec::new();
        for (e, _) in o.entries.iter().zip(&o.inner.state) {
            let prefix = format!("optimizer{i}/{}/", e.name);
            let step_t = st.tensor(&format!("{prefix}step")).map_err(|_| mismatch(format!("{prefix}step missing")))?;
            let step = view_to_tensor(&prefix, &step_t)?.f_int64_value(&[0]).map_err(|e| mismatch(e.to_string()))?;
            let mut buffers = BTreeMap::new();
            for buf in o.inner.config.buffer_names() {
                if let Ok(v) = st.tensor(&format!("{prefix}{buf}")) {
                    let t = view_to_tensor(buf, &v)?;
                    let p = e.stepped();
                    if t.size() != p.size() || t.kind() != crate::optim::state_kind(p.kind()) {
                        return Err(mismatch(format!("{prefix}{buf}: shape/kind differ from the parameter")));
                    }
                    buffers.insert(*buf, t.f_to_device(p.device()).ctx("checkpoint")?);
                }
            }
            let master = match &e.master {
                Some(_) => Some(staged.get(&e.name).ok_or_else(|| mismatch(format!("no value for master {}", e.name)))?.shallow_clone()),
                None => None,
            };
            per_param.push((step.max(0) as u64, buffers, master));
        }
        optim_vals.push(((lr, group_lr), steps, skipped, per_param));
    }
    // Phase 2: apply (all checks passed).
    let _no_grad = tch::no_grad_guard();
    for (var, t) in model_vals {
        let mut v = var;
        v.f_copy_(&t).ctx("restoring a model variable")?;
    }
    for (o, (lr, steps, skipped, per_param)) in optimizers.iter_mut().zip(optim_vals) {
        o.restore(lr, steps, skipped, per_param)?;
    }
    amp.apply_state(amp_state);
    Ok(())
}
