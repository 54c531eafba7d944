//! Runs a PyTorch script (a shared prelude + the test's own body) under the venv's python and
//! compares per-step records bit for bit.
use std::collections::BTreeMap;
use std::process::Command;

use tch::nn::{self, Module};
use tch::Tensor;
use tch_amp::torch_io::{self, Value};

use crate::common::python::python;
use crate::common::reference::{bits_equal, describe_diff};

/// Shared by every script: `batch(seed, n)` and `det_init(model)` as `tests/common` computes
/// them, the model `mlp()` (`fc1` 8→16, relu, `fc2` 16→4), `push(key, tensor)` to record a row
/// and `save()` to write the rows, stacked, to `OUT` with torch.save.
pub const PRELUDE: &str = r#"
import sys, collections, torch
import torch.nn.functional as F
torch.set_num_threads(1)
OUT = sys.argv[1]
ARG = sys.argv[2] if len(sys.argv) > 2 else ""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
def batch(seed, n):
    t = lambda length, k: torch.sin(torch.arange(length, dtype=torch.float32) * k + seed)
    return t(n * 8, 0.731).reshape(n, 8), t(n * 4, 1.37).reshape(n, 4)
def det_init(model):
    named = sorted(model.named_parameters(), key=lambda np: np[0])
    with torch.no_grad():
        for i, (_, p) in enumerate(named):
            p.copy_((torch.sin(torch.arange(p.numel(), dtype=torch.float32) * 0.37 + i) * 0.3).reshape(p.shape))
def mlp():
    return torch.nn.Sequential(collections.OrderedDict(
        fc1=torch.nn.Linear(8, 16), act=torch.nn.ReLU(), fc2=torch.nn.Linear(16, 4)))
rec = collections.defaultdict(list)
def push(key, t):
    rec[key].append(torch.as_tensor(t).detach().clone())
def push_model(prefix, model):
    for n, p in model.named_parameters():
        push(prefix + n, p)
def save():
    torch.save({k: torch.stack(v) for k, v in rec.items()}, OUT)
"#;

/// Runs `PRELUDE + body` with `arg` as `ARG`; returns the saved rows by key.
pub fn torch_reference(body: &str, arg: &str) -> BTreeMap<String, Tensor> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let script = dir.path().join("reference.py");
    let out = dir.path().join("rows.pt");
    std::fs::write(&script, format!("{PRELUDE}\n{body}\nsave()\n")).expect("writing the script");
    let run = Command::new(python()).arg(&script).arg(&out).arg(arg).output().expect("starting python");
    assert!(run.status.success(), "the torch script failed:\n{}", String::from_utf8_lossy(&run.stderr));
    let value = torch_io::load(&out).expect("reading the torch.save file");
    let Value::Dict(d) = &value else { panic!("expected a dict") };
    d.iter()
        .map(|(k, v)| match v {
            Value::Tensor(t) => (k.to_string().trim_matches('"').to_string(), t.shallow_clone()),
            other => panic!("{k}: not a tensor but {}", other.type_name()),
        })
        .collect()
}

/// The Rust side's rows.
#[derive(Default)]
pub struct Rows(pub BTreeMap<String, Vec<Tensor>>);

impl Rows {
    pub fn push(&mut self, key: &str, t: &Tensor) {
        self.0.entry(key.to_string()).or_default().push(t.detach().copy());
    }

    pub fn push_model(&mut self, prefix: &str, vs: &nn::VarStore) {
        for (n, t) in vs.variables() {
            self.push(&format!("{prefix}{n}"), &t);
        }
    }

    /// Every row equal bit for bit to torch's, same keys and steps; panics listing mismatches.
    pub fn assert_matches(&self, torch: &BTreeMap<String, Tensor>) {
        let mut bad = Vec::new();
        let ours: Vec<&String> = self.0.keys().collect();
        let theirs: Vec<&String> = torch.keys().collect();
        assert_eq!(ours, theirs, "recorded keys differ");
        for (key, rows) in &self.0 {
            let want = &torch[key];
            assert_eq!(want.size()[0], rows.len() as i64, "{key}: step count");
            for (step, got) in rows.iter().enumerate() {
                let w = want.get(step as i64);
                let g = if got.kind() != w.kind() && key.starts_with("stepped") {
                    got.to_kind(w.kind())
                } else {
                    got.shallow_clone()
                };
                if !bits_equal(&g, &w) {
                    bad.push(format!("{key} step {step}: {}", describe_diff(&g, &w)));
                }
            }
        }
        assert!(bad.is_empty(), "{} mismatches against torch:\n{}", bad.len(), bad.join("\n"));
    }
}

/// `mlp()` of the prelude under `p` (initialise with `deterministic_init`, as `det_init`).
#[derive(Debug)]
pub struct Mlp {
    pub fc1: nn::Linear,
    pub fc2: nn::Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.fc2.forward(&self.fc1.forward(x).relu())
    }
}

pub fn mlp(p: &nn::Path) -> Mlp {
    Mlp { fc1: nn::linear(p / "fc1", 8, 16, Default::default()), fc2: nn::linear(p / "fc2", 16, 4, Default::default()) }
}

/// A batch with an inf at [0, 0] (to force a skipped step).
pub fn poisoned(x: &Tensor) -> Tensor {
    let x = x.copy();
    let _ = x.get(0).get(0).fill_(f64::INFINITY);
    x
}
