//! tch-amp's optimizers (SGD, Adam, AdamW, RMSprop) against `torch.optim` in PyTorch 2.13.
//!
//! Every case: parameters `b = [0.1, -0.2]`, `w = [0.5, -1.0, 2.0, 0.25]`, the loss
//! `sum((w * x + sum(b) - y)^2)` with `x = [1, 2, -0.5, 3]`, `y = [0.3, -1.5, 1, 0.5]`, three
//! steps (zero_grad, backward, step), every hyper-parameter given explicitly on both sides
//! (tch's defaults differ from torch's). The expected values come from this script:
//!
//! ```python
//! import torch
//! x = torch.tensor([1.0, 2.0, -0.5, 3.0]); y = torch.tensor([0.3, -1.5, 1.0, 0.5])
//! def run(make):
//!     w = torch.tensor([0.5, -1.0, 2.0, 0.25], requires_grad=True)
//!     b = torch.tensor([0.1, -0.2], requires_grad=True)
//!     opt = make([b, w])
//!     for _ in range(3):
//!         opt.zero_grad()
//!         loss = ((w * x + b.sum() - y) ** 2).sum()
//!         loss.backward()
//!         opt.step()
//!     return b.tolist(), w.tolist()
//! ```
//! Each test quotes its `make`; the results must equal PyTorch's bit for bit. The expected
//! values come from scripts/reference/optim_small.py (this snippet over every case), run once
//! per test process on the machine that runs the tests: libtorch's element-wise CPU kernels
//! differ in the last bit between vector ISAs (AVX2, AVX512), so values pasted from another
//! CPU do not hold.

use std::sync::OnceLock;
use std::time::Duration;
use tch_amp::error::{ConfigError, UsageError};

use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::{Amp, AmpConfig, AmpError, AmpOptimizer, OptLevel, OptimizerConfig};

fn t(v: &[f32]) -> Tensor {
    Tensor::from_slice(v)
}

/// The VarStore of the fixture: `b`, `w`, and `z`, a variable the loss never uses.
fn fixture() -> VarStore {
    let vs = VarStore::new(Device::Cpu);
    let root = vs.root();
    let _ = root.var_copy("b", &t(&[0.1, -0.2]));
    let _ = root.var_copy("w", &t(&[0.5, -1.0, 2.0, 0.25]));
    let _ = root.var_copy("z", &t(&[3.0, -4.0]));
    vs
}

fn var(vs: &VarStore, name: &str) -> Tensor {
    vs.variables()[name].shallow_clone()
}

/// One zero_grad / backward / step, through O0's scale_loss (a pass-through).
fn train_step(vs: &VarStore, amp: &mut Amp, opt: &mut AmpOptimizer) {
    let x = t(&[1.0, 2.0, -0.5, 3.0]);
    let y = t(&[0.3, -1.5, 1.0, 0.5]);
    let (b, w) = (var(vs, "b"), var(vs, "w"));
    opt.zero_grad().unwrap();
    let loss = (&w * &x + b.sum(Kind::Float) - &y).square().sum(Kind::Float);
    let out = amp.scale_loss(&loss, &mut [&mut *opt], |l| l.backward()).unwrap();
    assert!(out.passed_through && !out.overflow);
    assert!(opt.step().unwrap().stepped());
}

/// Three steps of `config` at `lr`; returns `b` and `w`.
fn run(config: impl Into<OptimizerConfig>, lr: f64) -> (Vec<f32>, Vec<f32>) {
    let vs = fixture();
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let mut opt = amp.optimizer(&vs, config, lr).unwrap();
    let z0 = var(&vs, "z").copy();
    for _ in 0..3 {
        train_step(&vs, &mut amp, &mut opt);
    }
    // `z` has no gradient: torch.optim leaves it alone (even with weight decay), so do we.
    assert!(crate::common::same(&var(&vs, "z"), &z0), "a parameter without a gradient was updated");
    let v = |n: &str| Vec::<f32>::try_from(var(&vs, n)).unwrap();
    (v("b"), v("w"))
}

/// got == want bit for bit, element by element (tch-amp runs torch.optim's single-tensor
/// algorithm op for op; tests/optim_bitwise.rs covers every option over 20+ steps).
fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.to_bits() == w.to_bits(), "{what}[{i}]: got {g:e}, PyTorch {w:e} (all: {got:?} vs {want:?})");
    }
}

/// PyTorch's `b` and `w` after three steps of `case` (scripts/reference/optim_small.py).
fn torch_result(case: &str) -> (Vec<f32>, Vec<f32>) {
    static RESULTS: OnceLock<serde_json::Value> = OnceLock::new();
    let all = RESULTS.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optim_small.json");
        crate::common::python::run_reference_script(
            "optim_small.py",
            &[path.to_str().unwrap()],
            Duration::from_secs(120),
        );
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    });
    let list = |k: &str| -> Vec<f32> {
        all[case][k]
            .as_array()
            .unwrap_or_else(|| panic!("no {case}/{k}"))
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect()
    };
    (list("b"), list("w"))
}

fn check(case: &str, config: impl Into<OptimizerConfig>, lr: f64) {
    let (b, w) = run(config, lr);
    let (want_b, want_w) = torch_result(case);
    assert_close(&format!("{case}: b"), &b, &want_b);
    assert_close(&format!("{case}: w"), &w, &want_w);
}

fn sgd(momentum: f64, dampening: f64, wd: f64, nesterov: bool) -> nn::Sgd {
    nn::Sgd { momentum, dampening, wd, nesterov }
}

fn adam(beta1: f64, beta2: f64, eps: f64, wd: f64, amsgrad: bool) -> nn::Adam {
    nn::Adam { beta1, beta2, wd, eps, amsgrad }
}

fn adamw(beta1: f64, beta2: f64, eps: f64, wd: f64, amsgrad: bool) -> nn::AdamW {
    nn::AdamW { beta1, beta2, wd, eps, amsgrad }
}

fn rmsprop(alpha: f64, eps: f64, wd: f64, momentum: f64, centered: bool) -> nn::RmsProp {
    nn::RmsProp { alpha, eps, wd, momentum, centered }
}

// torch.optim.SGD(p, lr=0.01, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
#[test]
fn sgd_plain() {
    check("sgd_plain", sgd(0.0, 0.0, 0.0, false), 0.01);
}

// torch.optim.SGD(p, lr=0.01, momentum=0.9, dampening=0.1, weight_decay=0.0, nesterov=False)
#[test]
fn sgd_momentum_dampening() {
    check("sgd_momentum_dampening", sgd(0.9, 0.1, 0.0, false), 0.01);
}

// torch.optim.SGD(p, lr=0.01, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True)
#[test]
fn sgd_nesterov() {
    check("sgd_nesterov", sgd(0.9, 0.0, 0.0, true), 0.01);
}

// torch.optim.SGD(p, lr=0.01, momentum=0.5, dampening=0.0, weight_decay=0.1, nesterov=False)
#[test]
fn sgd_weight_decay() {
    check("sgd_weight_decay", sgd(0.5, 0.0, 0.1, false), 0.01);
}

// torch.optim.Adam(p, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False)
#[test]
fn adam_default() {
    check("adam_default", adam(0.9, 0.999, 1e-8, 0.0, false), 0.1);
}

// torch.optim.Adam(p, lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=False)
#[test]
fn adam_weight_decay() {
    check("adam_weight_decay", adam(0.8, 0.99, 1e-6, 0.1, false), 0.1);
}

// torch.optim.Adam(p, lr=0.1, betas=(0.9, 0.5), eps=1e-8, weight_decay=0.0, amsgrad=True)
// beta2 = 0.5 lets the second moment fall, so amsgrad's maximum matters (the results differ
// without it).
#[test]
fn adam_amsgrad() {
    check("adam_amsgrad", adam(0.9, 0.5, 1e-8, 0.0, true), 0.1);
    // ... and the same config without amsgrad does give torch's other answer.
    check("adam_amsgrad_off", adam(0.9, 0.5, 1e-8, 0.0, false), 0.1);
    assert_ne!(torch_result("adam_amsgrad").0, torch_result("adam_amsgrad_off").0, "amsgrad changes nothing here");
}

// torch.optim.AdamW(p, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False)
// (weight_decay=0.01 is torch's AdamW default, and tch's.)
#[test]
fn adamw_default() {
    assert_eq!(nn::AdamW::default().wd, 0.01);
    check("adamw_default", adamw(0.9, 0.999, 1e-8, 0.01, false), 0.1);
}

// torch.optim.AdamW(p, lr=0.1, betas=(0.9, 0.5), eps=1e-8, weight_decay=0.01, amsgrad=True)
#[test]
fn adamw_amsgrad() {
    check("adamw_amsgrad", adamw(0.9, 0.5, 1e-8, 0.01, true), 0.1);
}

// torch.optim.RMSprop(p, lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False)
#[test]
fn rmsprop_plain() {
    check("rmsprop_plain", rmsprop(0.99, 1e-8, 0.0, 0.0, false), 0.01);
}

// torch.optim.RMSprop(p, lr=0.01, alpha=0.9, eps=1e-8, weight_decay=0.0, momentum=0.9, centered=False)
#[test]
fn rmsprop_momentum() {
    check("rmsprop_momentum", rmsprop(0.9, 1e-8, 0.0, 0.9, false), 0.01);
}

// torch.optim.RMSprop(p, lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=True)
#[test]
fn rmsprop_centered() {
    check("rmsprop_centered", rmsprop(0.99, 1e-8, 0.0, 0.0, true), 0.01);
}

// torch.optim.RMSprop(p, lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.1, momentum=0.5, centered=True)
#[test]
fn rmsprop_weight_decay() {
    check("rmsprop_weight_decay", rmsprop(0.99, 1e-8, 0.1, 0.5, true), 0.01);
}

/// A parameter with no gradient keeps its value for every optimizer, even
/// with weight decay and momentum (torch.optim skips `p.grad is None` the same way); `run`
/// checks `z` for each, this checks it also stays untouched when it is the only parameter.
#[test]
fn param_without_grad_is_not_touched() {
    let configs: [OptimizerConfig; 4] = [
        sgd(0.9, 0.0, 0.1, true).into(),
        adam(0.9, 0.999, 1e-8, 0.1, true).into(),
        adamw(0.9, 0.999, 1e-8, 0.1, false).into(),
        rmsprop(0.99, 1e-8, 0.1, 0.9, true).into(),
    ];
    for config in configs {
        let vs = fixture();
        let amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
        let mut opt = amp.optimizer_for(&vs, &["z"], config, 0.5).unwrap();
        assert_eq!(opt.param_names(), ["z"]);
        let z0 = var(&vs, "z").copy();
        for _ in 0..3 {
            // Nothing to step: a typed error, never a reported step that did not happen.
            assert!(matches!(opt.step(), Err(tch_amp::AmpError::Usage(UsageError::NoGradients))));
        }
        assert!(crate::common::same(&var(&vs, "z"), &z0), "{config:?} updated a parameter with no gradient");
    }
}

/// `set_lr` with a negative or non-finite rate is `ConfigError::InvalidOption` and changes
/// nothing: the following steps use the old rate and still match torch's SGD(lr=0.01).
#[test]
fn set_lr_rejects_bad_rates_and_changes_nothing() {
    let vs = fixture();
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let mut opt = amp.optimizer(&vs, sgd(0.0, 0.0, 0.0, false), 0.01).unwrap();
    for _ in 0..3 {
        for bad in [-0.1, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            match opt.set_lr(bad) {
                Err(AmpError::Config(ConfigError::InvalidOption { option: "lr", .. })) => {}
                other => panic!("set_lr({bad}) gave {other:?}"),
            }
            assert_eq!(opt.lr(), 0.01);
        }
        train_step(&vs, &mut amp, &mut opt);
    }
    let v = |n: &str| Vec::<f32>::try_from(var(&vs, n)).unwrap();
    // Same as `sgd_plain`.
    let (want_b, want_w) = torch_result("sgd_plain");
    assert_close("b", &v("b"), &want_b);
    assert_close("w", &v("w"), &want_w);

    // A valid rate is taken; zero is valid (torch allows lr=0).
    opt.set_lr(0.0).unwrap();
    assert_eq!(opt.lr(), 0.0);
    let w0 = var(&vs, "w").copy();
    train_step(&vs, &mut amp, &mut opt);
    assert!(crate::common::same(&var(&vs, "w"), &w0), "lr = 0 moved the weights");

    // The same check at construction.
    for bad in [-1.0, f64::NAN] {
        match amp.optimizer(&vs, sgd(0.0, 0.0, 0.0, false), bad) {
            Err(AmpError::Config(ConfigError::InvalidOption { option: "lr", .. })) => {}
            other => panic!("optimizer(lr = {bad}) gave {other:?}"),
        }
    }
}

/// `OptimizerConfig::state_dtype(Kind::BFloat16)`: between steps the moments are stored in
/// bf16, each update runs in fp32 on their widened values and rounds them to nearest once. The
/// twin is the fp32 optimizer (torch.optim's bits, tests above) whose state is rounded to bf16
/// through its record after each step: the weights and the state must be bit for bit the same,
/// over 10 steps of the fixture with a random-ish gradient each step. Any other dtype but fp32
/// is refused.
#[test]
fn bf16_state_is_fp32_arithmetic_on_rounded_moments() {
    use tch_amp::optim::OptimizerRecord;
    let round = |mut r: OptimizerRecord| {
        for p in &mut r.params {
            for (k, v) in p.buffers.iter_mut() {
                if k != "step" {
                    *v = v.to_kind(Kind::BFloat16).to_kind(Kind::Float);
                }
            }
        }
        r
    };
    let configs: [OptimizerConfig; 3] = [
        adam(0.9, 0.999, 1e-8, 0.0, false).into(),
        adamw(0.8, 0.99, 1e-6, 0.1, true).into(),
        sgd(0.9, 0.0, 0.0, true).into(),
    ];
    for config in configs {
        let (vs_a, vs_b) = (fixture(), fixture());
        let mut a = AmpOptimizer::new(&vs_a, config.state_dtype(Kind::BFloat16), 1e-2, &[]).unwrap();
        let mut b = AmpOptimizer::new(&vs_b, config, 1e-2, &[]).unwrap();
        for step in 0..10 {
            for (vs, opt) in [(&vs_a, &mut a), (&vs_b, &mut b)] {
                let x = t(&[1.0, 2.0, -0.5, 3.0]) * (1.0 + 0.37 * step as f64);
                let (bv, w) = (var(vs, "b"), var(vs, "w"));
                opt.zero_grad().unwrap();
                (&w * &x + bv.sum(Kind::Float) - t(&[0.3, -1.5, 1.0, 0.5])).square().sum(Kind::Float).backward();
                assert!(opt.step().unwrap().stepped());
            }
            b.load_record(round(b.to_record())).unwrap();
            for n in ["b", "w"] {
                assert!(var(&vs_a, n).equal(&var(&vs_b, n)), "{config:?} step {step}: {n}");
            }
            for (pa, pb) in a.to_record().params.iter().zip(b.to_record().params) {
                for (k, va) in &pa.buffers {
                    let want =
                        if k == "step" { pb.buffers[k].shallow_clone() } else { pb.buffers[k].to_kind(Kind::BFloat16) };
                    assert!(va.equal(&want), "{config:?} step {step}: {} {k} ({:?})", pa.name, va.kind());
                }
            }
        }
        let state_bytes = |o: &AmpOptimizer| o.memory().optimizer_state;
        assert!(2 * state_bytes(&a) >= state_bytes(&b) && state_bytes(&a) < state_bytes(&b));
    }
    let half =
        AmpOptimizer::new(&fixture(), OptimizerConfig::from(nn::Adam::default()).state_dtype(Kind::Half), 1e-2, &[]);
    assert!(
        matches!(half, Err(AmpError::Config(ConfigError::InvalidOption { option: "state_dtype", .. }))),
        "{half:?}"
    );
}
