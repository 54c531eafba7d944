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
//! Each test quotes its `make`; the results must equal PyTorch's bit for bit.
// The expected values are pasted verbatim from PyTorch (f32 printed as Python floats).
#![allow(clippy::excessive_precision)]

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

fn check(config: impl Into<OptimizerConfig>, lr: f64, want_b: [f32; 2], want_w: [f32; 4]) {
    let (b, w) = run(config, lr);
    assert_close("b", &b, &want_b);
    assert_close("w", &w, &want_w);
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
    check(
        sgd(0.0, 0.0, 0.0, false),
        0.01,
        [0.22359725832939148, -0.07640276104211807],
        [0.48861560225486755, -0.9443784356117249, 1.940081000328064, 0.21199840307235718],
    );
}

// torch.optim.SGD(p, lr=0.01, momentum=0.9, dampening=0.1, weight_decay=0.0, nesterov=False)
#[test]
fn sgd_momentum_dampening() {
    check(
        sgd(0.9, 0.1, 0.0, false),
        0.01,
        [0.326549768447876, 0.026549754664301872],
        [0.4815426468849182, -0.8960984945297241, 1.892728567123413, 0.18554070591926575],
    );
}

// torch.optim.SGD(p, lr=0.01, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True)
#[test]
fn sgd_nesterov() {
    check(
        sgd(0.9, 0.0, 0.0, true),
        0.01,
        [0.39010119438171387, 0.09010118991136551],
        [0.4597748816013336, -0.8802164793014526, 1.8448675870895386, 0.13050898909568787],
    );
}

// torch.optim.SGD(p, lr=0.01, momentum=0.5, dampening=0.0, weight_decay=0.1, nesterov=False)
#[test]
fn sgd_weight_decay() {
    check(
        sgd(0.5, 0.0, 0.1, false),
        0.01,
        [0.2756494879722595, -0.02307671681046486],
        [0.48211798071861267, -0.916382372379303, 1.9065488576889038, 0.19562548398971558],
    );
}

// torch.optim.Adam(p, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False)
#[test]
fn adam_default() {
    check(
        adam(0.9, 0.999, 1e-8, 0.0, false),
        0.1,
        [0.39156636595726013, 0.09156635403633118],
        [0.20766806602478027, -0.7645087242126465, 1.7020460367202759, 0.001986093819141388],
    );
}

// torch.optim.Adam(p, lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=False)
#[test]
fn adam_weight_decay() {
    check(
        adam(0.8, 0.99, 1e-6, 0.1, false),
        0.1,
        [0.38811397552490234, 0.08824384212493896],
        [0.20061838626861572, -0.7688878178596497, 1.7031021118164062, 0.007661949843168259],
    );
}

// torch.optim.Adam(p, lr=0.1, betas=(0.9, 0.5), eps=1e-8, weight_decay=0.0, amsgrad=True)
// beta2 = 0.5 lets the second moment fall, so amsgrad's maximum matters: without amsgrad
// torch gives b = [0.41363418102264404, 0.11363417655229568] here.
#[test]
fn adam_amsgrad() {
    check(
        adam(0.9, 0.5, 1e-8, 0.0, true),
        0.1,
        [0.39506810903549194, 0.09506809711456299],
        [0.2315303385257721, -0.779793918132782, 1.6963400840759277, 0.01040094718337059],
    );
    // ... and the same config without amsgrad does give torch's other answer.
    check(
        adam(0.9, 0.5, 1e-8, 0.0, false),
        0.1,
        [0.41363418102264404, 0.11363417655229568],
        [0.2315303385257721, -0.741612434387207, 1.693725824356079, -0.011729694902896881],
    );
}

// torch.optim.AdamW(p, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False)
// (weight_decay=0.01 is torch's AdamW default, and tch's.)
#[test]
fn adamw_default() {
    assert_eq!(nn::AdamW::default().wd, 0.01);
    check(
        adamw(0.9, 0.999, 1e-8, 0.01, false),
        0.1,
        [0.39091724157333374, 0.09181632846593857],
        [0.2064187377691269, -0.7624972462654114, 1.6963640451431274, 0.00215747207403183],
    );
}

// torch.optim.AdamW(p, lr=0.1, betas=(0.9, 0.5), eps=1e-8, weight_decay=0.01, amsgrad=True)
// (without amsgrad: b = [0.41306182742118835, 0.11396092921495438])
#[test]
fn adamw_amsgrad() {
    check(
        adamw(0.9, 0.5, 1e-8, 0.01, true),
        0.1,
        [0.3944132328033447, 0.09531231224536896],
        [0.230246439576149, -0.7777291536331177, 1.6906648874282837, 0.010512541979551315],
    );
}

// torch.optim.RMSprop(p, lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False)
#[test]
fn rmsprop_plain() {
    check(
        rmsprop(0.99, 1e-8, 0.0, 0.0, false),
        0.01,
        [0.30183517932891846, 0.0018351748585700989],
        [0.2386685609817505, -0.8654149770736694, 1.781539797782898, 0.07574709504842758],
    );
}

// torch.optim.RMSprop(p, lr=0.01, alpha=0.9, eps=1e-8, weight_decay=0.0, momentum=0.9, centered=False)
#[test]
fn rmsprop_momentum() {
    check(
        rmsprop(0.9, 1e-8, 0.0, 0.9, false),
        0.01,
        [0.24421045184135437, -0.05578954517841339],
        [0.3416195213794708, -0.8643388748168945, 1.8533148765563965, 0.1137135773897171],
    );
}

// torch.optim.RMSprop(p, lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=True)
#[test]
fn rmsprop_centered() {
    check(
        rmsprop(0.99, 1e-8, 0.0, 0.0, true),
        0.01,
        [0.3033161163330078, 0.003316115587949753],
        [0.23628348112106323, -0.8653994202613831, 1.7796562910079956, 0.07441309839487076],
    );
}

// torch.optim.RMSprop(p, lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.1, momentum=0.5, centered=True)
#[test]
fn rmsprop_weight_decay() {
    check(
        rmsprop(0.99, 1e-8, 0.1, 0.5, true),
        0.01,
        [0.3992886543273926, 0.09963520616292953],
        [0.11509302258491516, -0.7987255454063416, 1.6728588342666626, 0.011358378455042839],
    );
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
            assert!(matches!(opt.step(), Err(tch_amp::AmpError::NoGradients)));
        }
        assert!(crate::common::same(&var(&vs, "z"), &z0), "{config:?} updated a parameter with no gradient");
    }
}

/// `set_lr` with a negative or non-finite rate is `AmpError::InvalidOption` and changes
/// nothing: the following steps use the old rate and still match torch's SGD(lr=0.01).
#[test]
fn set_lr_rejects_bad_rates_and_changes_nothing() {
    let vs = fixture();
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let mut opt = amp.optimizer(&vs, sgd(0.0, 0.0, 0.0, false), 0.01).unwrap();
    for _ in 0..3 {
        for bad in [-0.1, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            match opt.set_lr(bad) {
                Err(AmpError::InvalidOption { option: "lr", .. }) => {}
                other => panic!("set_lr({bad}) gave {other:?}"),
            }
            assert_eq!(opt.lr(), 0.01);
        }
        train_step(&vs, &mut amp, &mut opt);
    }
    let v = |n: &str| Vec::<f32>::try_from(var(&vs, n)).unwrap();
    // Same as `sgd_plain`.
    assert_close("b", &v("b"), &[0.22359725832939148, -0.07640276104211807]);
    assert_close("w", &v("w"), &[0.48861560225486755, -0.9443784356117249, 1.940081000328064, 0.21199840307235718]);

    // A valid rate is taken; zero is valid (torch allows lr=0).
    opt.set_lr(0.0).unwrap();
    assert_eq!(opt.lr(), 0.0);
    let w0 = var(&vs, "w").copy();
    train_step(&vs, &mut amp, &mut opt);
    assert!(crate::common::same(&var(&vs, "w"), &w0), "lr = 0 moved the weights");

    // The same check at construction.
    for bad in [-1.0, f64::NAN] {
        match amp.optimizer(&vs, sgd(0.0, 0.0, 0.0, false), bad) {
            Err(AmpError::InvalidOption { option: "lr", .. }) => {}
            other => panic!("optimizer(lr = {bad}) gave {other:?}"),
        }
    }
}
