//! Shared helpers of the integration test binaries (tests/amp, tests/o1, tests/cuda).
#![allow(dead_code)]
pub mod python;
pub mod reference;

use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};
use tch_amp::cast::CastSettings;
use tch_amp::cast::{install_policy, PolicyHandle};
use tch_amp::AutocastScope;
use tch_amp::CastPolicy;

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

pub fn on_cpu(handle: &PolicyHandle) -> AutocastScope {
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

/// A seeded ChaCha generator (proptest's), for the randomized reliability tests.
pub fn rng(seed: u64) -> proptest::test_runner::TestRng {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    proptest::test_runner::TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &bytes)
}

/// Whether every tensor of `tensors` holds only finite values (one host read).
pub fn all_finite(tensors: &[Tensor]) -> bool {
    let flags: Vec<Tensor> = tensors
        .iter()
        .filter(|t| t.defined() && t.is_floating_point())
        .map(|t| t.isfinite().all().reshape([1]))
        .collect();
    flags.is_empty() || Tensor::cat(&flags, 0).all().int64_value(&[]) == 1
}

/// Runs `body` in a child process of this test binary with one intra-op thread
/// (`OMP_NUM_THREADS=1`): the test binary is started again with `--exact name`, and the child
/// (which sees `TCH_AMP_ISOLATED`) runs the body. For long loops of tiny ops, where OpenMP's
/// spinning worker threads cost more than they bring on a loaded 2-core machine (batch norm
/// on CPU opens a parallel region whatever the size). The child is killed after
/// `limit_s` seconds; its output is forwarded.
pub fn isolated(name: &str, limit_s: u64, body: impl FnOnce()) {
    if std::env::var_os("TCH_AMP_ISOLATED").is_some() {
        body();
        return;
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("TCH_AMP_ISOLATED", "1")
        .env("OMP_NUM_THREADS", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if start.elapsed().as_secs() > limit_s {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    eprint!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let status = status.unwrap_or_else(|| panic!("{name}: the child ran past {limit_s} s and was killed"));
    assert!(status.success(), "{name}: the child failed ({status})");
    let ran = String::from_utf8_lossy(&out.stdout).contains("1 passed");
    assert!(ran, "{name}: the child ran no test");
}

/// A seeded, reproducible random source for the fuzz tests (proptest's ChaCha generator).
pub struct SeededRng(proptest::test_runner::TestRng);

impl SeededRng {
    /// The generator for `seed`.
    pub fn new(seed: u64) -> Self {
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        Self(proptest::test_runner::TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &bytes))
    }

    /// 64 random bits.
    pub fn next(&mut self) -> u64 {
        proptest::prelude::Rng::next_u64(&mut self.0)
    }

    /// Uniform-ish in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// A JSON literal as the `torch.save` value a Python dict of numbers and strings is (ints stay
/// ints, floats floats): the amp states tests write inline with `json!`.
pub fn value(j: serde_json::Value) -> tch_amp::torch_io::Value {
    use serde_json::Value as J;
    use tch_amp::torch_io::{Dict, Value};
    match j {
        J::Null => Value::None,
        J::Bool(b) => Value::Bool(b),
        J::Number(n) => n.as_i64().map(Value::Int).unwrap_or_else(|| Value::Float(n.as_f64().unwrap())),
        J::String(s) => Value::Str(s),
        J::Array(a) => Value::List(a.into_iter().map(value).collect()),
        J::Object(m) => Value::Dict(m.into_iter().fold(Dict::new(), |d, (k, v)| d.with(k, value(v)))),
    }
}

/// An amp state (dicts of numbers) as JSON, for comparisons and messages.
pub fn json(v: &tch_amp::torch_io::Value) -> serde_json::Value {
    use serde_json::Value as J;
    use tch_amp::torch_io::{Key, Value};
    match v {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::Float(f) => J::from(*f),
        Value::Str(s) => J::String(s.clone()),
        Value::List(items) => J::Array(items.iter().map(json).collect()),
        Value::Dict(d) => J::Object(
            d.iter()
                .map(|(k, v)| {
                    let k = match k {
                        Key::Str(s) => s.clone(),
                        Key::Int(i) => i.to_string(),
                    };
                    (k, json(v))
                })
                .collect(),
        ),
        other => panic!("a {} in an amp state", other.type_name()),
    }
}
