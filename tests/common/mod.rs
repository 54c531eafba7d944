//! Shared helpers of the integration test binaries (tests/amp, tests/o1, tests/cuda).
#![allow(dead_code)]
pub mod reference;

use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};
use tch_amp::cast::{install_policy, ActivePolicyGuard, PolicyHandle};
use tch_amp::{CastPolicy, CastSettings};

/// Element-wise exact equality (same shape, same dtype, same bits for finite values).
pub fn same(a: &Tensor, b: &Tensor) -> bool {
    a.size() == b.size() && a.kind() == b.kind() && a.equal(b)
}

/// Max |a - b| computed in fp64.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
}

/// A small MLP with batch norm: `fc1` (8→16), `bn1`, relu, `fc2` (16→4).
#[derive(Debug)]
pub struct Mlp {
    pub fc1: nn::Linear,
    pub bn1: nn::BatchNorm,
    pub fc2: nn::Linear,
}

impl Mlp {
    pub fn new(p: &nn::Path) -> Self {
        Self {
            fc1: nn::linear(p / "fc1", 8, 16, Default::default()),
            bn1: nn::batch_norm1d(p / "bn1", 16, Default::default()),
            fc2: nn::linear(p / "fc2", 16, 4, Default::default()),
        }
    }
}

impl ModuleT for Mlp {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.fc2.forward(&self.bn1.forward_t(&self.fc1.forward(xs), train).relu())
    }
}

/// A deterministic batch: inputs [n, 8] and targets [n, 4]. Computed from `seed` without the
/// global RNG, which tests running in parallel threads share.
pub fn batch(seed: i64, n: i64) -> (Tensor, Tensor) {
    let t = |len: i64, k: f64| (Tensor::arange(len, (Kind::Float, Device::Cpu)) * k + seed as f64).sin();
    (t(n * 8, 0.731).reshape([n, 8]), t(n * 4, 1.37).reshape([n, 4]))
}

/// Overwrites every floating trainable variable of `vs` with deterministic values (no RNG),
/// so two stores built in parallel-running tests start identical.
pub fn deterministic_init(vs: &nn::VarStore) {
    let _g = tch::no_grad_guard();
    let mut names: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (_, v)) in names.iter().enumerate() {
        if v.requires_grad() && v.is_floating_point() {
            let vals = ((Tensor::arange(v.numel() as i64, (Kind::Float, Device::Cpu)) * 0.37 + i as f64).sin() * 0.3)
                .reshape(v.size())
                .to_kind(v.kind());
            v.shallow_clone().copy_(&vals);
        }
    }
}

/// Apex's O1 policy, installed with the default settings.
pub fn apex() -> PolicyHandle {
    install_policy(CastPolicy::apex(), CastSettings::default()).unwrap()
}

pub fn apex_with(settings: CastSettings) -> PolicyHandle {
    install_policy(CastPolicy::apex(), settings).unwrap()
}

pub fn on_cpu(handle: &PolicyHandle) -> ActivePolicyGuard {
    handle.activate(Device::Cpu).unwrap()
}

pub fn randn(shape: &[i64], kind: Kind) -> Tensor {
    Tensor::randn(shape, (Kind::Float, Device::Cpu)).to_kind(kind)
}

pub fn leaf(shape: &[i64], kind: Kind) -> Tensor {
    randn(shape, kind).set_requires_grad(true)
}

pub fn to_vec(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}
