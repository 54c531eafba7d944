//! Converting linear layers to float8 training (torchao's `convert_to_float8_training`), the
//! layer filter, the conversion report and the delayed-scaling state of every layer.
use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tch::nn::{self, Init, LinearConfig};
use tch::{Kind, Tensor};

use super::config::{Float8LinearConfig, Resolved};
use super::delayed::DelayedLayer;
use super::linear::{lock, Float8Linear, Float8Scales, Layer};
use crate::error::{mismatch, AmpError, ConfigError, Result, TorchContext};
use crate::optim::params::under_prefix;
use crate::torch_io::{Dict, Value};

/// Which linear layers to convert, by VarStore path (`blocks.0.mlp.fc1`). A path selects the
/// layer itself and every layer under it, compared by whole segments (`layer1` does not select
/// `layer10`). A layer named exactly in [`Self::only`] is *named explicitly*: if it cannot train
/// in float8 the conversion refuses it ([`ConfigError::Float8LayerRefused`]); one selected
/// otherwise is skipped and reported.
///
/// torchao's `module_filter_fn(module, fqn)`; torchtitan's `filter_fqns` is [`Self::except`].
#[derive(Debug, Clone, Default)]
pub struct LayerFilter {
    only: Vec<String>,
    except: Vec<String>,
}

impl LayerFilter {
    /// Every linear layer.
    pub fn all() -> Self {
        Self::default()
    }

    /// Only the layers at or under these paths.
    pub fn only<S: AsRef<str>>(paths: &[S]) -> Self {
        Self { only: paths.iter().map(|p| p.as_ref().to_string()).collect(), except: Vec::new() }
    }

    /// Leaves out the layers at or under these paths (a model's output layer, say).
    pub fn except<S: AsRef<str>>(mut self, paths: &[S]) -> Self {
        self.except.extend(paths.iter().map(|p| p.as_ref().to_string()));
        self
    }

    fn selects(&self, name: &str) -> bool {
        let only: Vec<&str> = self.only.iter().map(String::as_str).collect();
        let except: Vec<&str> = self.except.iter().map(String::as_str).collect();
        under_prefix(name, &only) && (except.is_empty() || !under_prefix(name, &except))
    }

    fn names(&self, name: &str) -> bool {
        self.only.iter().any(|p| p == name)
    }
}

/// Why a linear layer was left in high precision.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SkipReason {
    /// The [`LayerFilter`] does not select it.
    Filtered,
    /// `in_features` or `out_features` is not a multiple of 16 (what CUDA's `_scaled_mm` takes;
    /// torchao's recipe filters and torchtitan skip these layers; the rule holds on every
    /// device so that a model converts the same way on CPU and CUDA).
    Dimensions {
        /// The layer's input features.
        in_features: i64,
        /// The layer's output features.
        out_features: i64,
    },
    /// A weight that is not fp32, bf16 or fp16 (`_scaled_mm` has no fp64 output).
    Dtype(Kind),
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SkipReason::Filtered => write!(f, "not selected by the layer filter"),
            SkipReason::Dimensions { in_features, out_features } => {
                write!(f, "{in_features} input and {out_features} output features: float8 GEMMs need multiples of 16")
            }
            SkipReason::Dtype(kind) => {
                write!(f, "weight dtype {kind:?}: float8 layers take fp32, bf16 or fp16 weights")
            }
        }
    }
}

/// What a conversion did: the layers now in float8 and the layers left in high precision, in
/// the order they were made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConversionReport {
    /// The converted layers.
    pub converted: Vec<String>,
    /// The layers left in high precision, and why.
    pub skipped: Vec<(String, SkipReason)>,
}

/// Float8 training of a model's linear layers: torchao's `convert_to_float8_training(model,
/// config=..., module_filter_fn=...)`. tch modules cannot be swapped after the fact, so the
/// model makes its linear layers through [`Self::linear`] (in place of `nn::linear`, with the
/// same variables and initialisation) or hands existing ones to [`Self::convert`]; each is
/// converted when the filter selects it and it can train in float8, else it stays a plain
/// linear layer and the [`Self::report`] says why.
///
/// Holds each layer's last scales ([`Self::scales`]) and, under delayed scaling, its amax
/// histories and scales ([`Self::state_dict`], saved with the checkpoint).
#[derive(Debug)]
pub struct Float8Training {
    config: Float8LinearConfig,
    resolved: Resolved,
    filter: LayerFilter,
    layers: Mutex<BTreeMap<String, Arc<Layer>>>,
    report: Mutex<ConversionReport>,
}

impl Float8Training {
    /// Float8 training with `config` for the layers `filter` selects.
    ///
    /// # Errors
    /// As [`Float8LinearConfig::validate`].
    pub fn new(config: Float8LinearConfig, filter: LayerFilter) -> Result<Self> {
        let resolved = config.resolve()?;
        Ok(Self {
            config,
            resolved,
            filter,
            layers: Mutex::new(BTreeMap::new()),
            report: Mutex::new(ConversionReport::default()),
        })
    }

    /// The config.
    pub fn config(&self) -> &Float8LinearConfig {
        &self.config
    }

    /// A linear layer at `path` with `nn::linear`'s variables (`weight`, `bias`) and
    /// initialisation, converted to float8 when the filter selects it and it can train in float8.
    ///
    /// # Errors
    /// As [`Self::convert`]; [`AmpError::Torch`] when the VarStore refuses the variables (a name
    /// taken).
    pub fn linear<'a, T: Borrow<nn::Path<'a>>>(
        &self,
        path: T,
        in_dim: i64,
        out_dim: i64,
        c: LinearConfig,
    ) -> Result<Float8Linear> {
        let path = path.borrow();
        let name = path.components().collect::<Vec<_>>().join(".");
        let mut layers = lock(&self.layers);
        let skip = self.decide(&layers, &name, &[out_dim, in_dim], path.kind())?;
        const CREATE: &str = "creating a float8 linear layer";
        let bs = if c.bias {
            let bound = 1.0 / (in_dim as f64).sqrt();
            let init = c.bs_init.unwrap_or(Init::Uniform { lo: -bound, up: bound });
            Some(path.f_var("bias", &[out_dim], init).ctx(CREATE)?)
        } else {
            None
        };
        let ws = path.f_var("weight", &[out_dim, in_dim], c.ws_init).ctx(CREATE)?;
        let layer = self.register(&mut layers, &name, &ws, skip)?;
        Ok(Float8Linear::new(name, ws, bs, layer))
    }

    /// Converts an existing linear layer whose VarStore path is `name` (tch's modules do not
    /// know their path), or keeps it in high precision when the filter leaves it out or it
    /// cannot train in float8 (reported).
    ///
    /// # Errors
    /// [`ConfigError::Float8LayerRefused`] for a layer the filter names explicitly that cannot
    /// train in float8 (dimensions not multiples of 16, a weight neither fp32, bf16 nor fp16)
    /// or whose weight is not 2-D; [`ConfigError::InvalidOption`] for a name converted before.
    /// Nothing changes on error.
    pub fn convert(&self, name: &str, linear: nn::Linear) -> Result<Float8Linear> {
        let nn::Linear { ws, bs } = linear;
        let mut layers = lock(&self.layers);
        let skip = self.decide(&layers, name, &ws.size(), ws.kind())?;
        let layer = self.register(&mut layers, name, &ws, skip)?;
        Ok(Float8Linear::new(name.to_string(), ws, bs, layer))
    }

    /// Whether a layer with this weight shape and dtype is skipped (and why), or refused.
    fn decide(
        &self,
        layers: &BTreeMap<String, Arc<Layer>>,
        name: &str,
        size: &[i64],
        kind: Kind,
    ) -> Result<Option<SkipReason>> {
        if layers.contains_key(name) || lock(&self.report).skipped.iter().any(|(n, _)| n == name) {
            return Err(AmpError::Config(ConfigError::InvalidOption {
                option: "float8 layer",
                value: name.to_string(),
                expected: "a layer path converted once",
            }));
        }
        let refuse =
            |reason: String| AmpError::Config(ConfigError::Float8LayerRefused { layer: name.to_string(), reason });
        let [out_features, in_features] = size else {
            return Err(refuse(format!("its weight has shape {size:?}, not [out_features, in_features]")));
        };
        let reason = if !self.filter.selects(name) {
            Some(SkipReason::Filtered)
        } else if !matches!(kind, Kind::Float | Kind::BFloat16 | Kind::Half) {
            Some(SkipReason::Dtype(kind))
        } else if in_features % 16 != 0 || out_features % 16 != 0 {
            Some(SkipReason::Dimensions { in_features: *in_features, out_features: *out_features })
        } else {
            None
        };
        match reason {
            Some(r) if r != SkipReason::Filtered && self.filter.names(name) => Err(refuse(r.to_string())),
            other => Ok(other),
        }
    }

    fn register(
        &self,
        layers: &mut BTreeMap<String, Arc<Layer>>,
        name: &str,
        ws: &Tensor,
        skip: Option<SkipReason>,
    ) -> Result<Option<Arc<Layer>>> {
        if let Some(reason) = skip {
            if reason != SkipReason::Filtered {
                log::info!("float8: {name} stays in high precision: {reason}");
            }
            lock(&self.report).skipped.push((name.to_string(), reason));
            return Ok(None);
        }
        let delayed = match &self.resolved.delayed {
            Some(recipe) => Some(Mutex::new(DelayedLayer::new(recipe, ws.device())?)),
            None => None,
        };
        let layer = Arc::new(Layer {
            name: name.to_string(),
            config: self.resolved,
            delayed,
            last: Mutex::new(Float8Scales::default()),
        });
        layers.insert(name.to_string(), Arc::clone(&layer));
        lock(&self.report).converted.push(name.to_string());
        Ok(Some(layer))
    }

    /// What was converted and what was skipped, so far.
    pub fn report(&self) -> ConversionReport {
        lock(&self.report).clone()
    }

    /// The scales of the last forward and backward of a converted layer (`None` for a name
    /// that is not one).
    pub fn scales(&self, layer: &str) -> Option<Float8Scales> {
        lock(&self.layers).get(layer).map(|l| lock(&l.last).clone())
    }

    /// The delayed-scaling state: `{layer: {"input" | "weight" | "grad_output": {"amax_history":
    /// fp32 [len], "scale": fp32 0-dim}}}` for every converted layer (an empty dict under dynamic
    /// scaling). A value tree, like a torch `state_dict`: save it with [`crate::torch_io::save`]
    /// or in a tch-amp checkpoint ([`crate::checkpoint::TrainingState::insert_tree`]).
    pub fn state_dict(&self) -> Value {
        let mut d = Dict::new();
        for (name, layer) in lock(&self.layers).iter() {
            if let Some(delayed) = &layer.delayed {
                d.insert(name.as_str(), lock(delayed).to_value());
            }
        }
        Value::Dict(d)
    }

    /// Restores a [`Self::state_dict`], checked in full before anything changes: the same
    /// layers, histories of the recipe's length, scales finite and positive.
    ///
    /// # Errors
    /// [`crate::error::StateError::StateMismatch`] when it does not fit.
    pub fn load_state_dict(&self, state: &Value) -> Result<()> {
        let layers = lock(&self.layers);
        let node = state.node();
        let entries = node.entries().map_err(|e| mismatch(e.to_string()))?;
        let recipe = self.resolved.delayed;
        let expected: Vec<&String> = if recipe.is_some() { layers.keys().collect() } else { Vec::new() };
        let mut checked = Vec::new();
        for (key, n) in entries {
            let crate::torch_io::Key::Str(name) = key else {
                return Err(mismatch(format!("float8 state: key {key} is not a layer name")));
            };
            let (Some(layer), Some(recipe)) = (layers.get(name), recipe.as_ref()) else {
                return Err(mismatch(format!("float8 state: {name:?} is not a layer under delayed scaling")));
            };
            checked.push((Arc::clone(layer), DelayedLayer::from_node(n, recipe, layer_device(layer)?)?));
        }
        if checked.len() != expected.len() {
            let missing: Vec<&&String> =
                expected.iter().filter(|n| !checked.iter().any(|(l, _)| &l.name == **n)).collect();
            return Err(mismatch(format!("float8 state: no state for the layers {missing:?}")));
        }
        for (layer, state) in checked {
            if let Some(d) = &layer.delayed {
                *lock(d) = state;
            }
        }
        Ok(())
    }
}

fn layer_device(layer: &Layer) -> Result<tch::Device> {
    match &layer.delayed {
        Some(d) => Ok(lock(d).input.scale.device()),
        None => Err(mismatch(format!("float8 state: {} has no delayed scaling", layer.name))),
    }
}
