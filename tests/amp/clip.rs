//! `AmpOptimizer::clip_grad_norm` against `torch.nn.utils.clip_grad_norm_` (PyTorch 2.13).
//!
//! The gradients are set by a backward of a linear loss, `sum(a * ga) + sum(w * gw)`, so they
//! equal `ga` and `gw` exactly. The expected values come from:
//!
//! ```python
//! import torch
//! def clip(max_norm, norm_type):
//!     a = torch.zeros(3, requires_grad=True); w = torch.zeros(2, 2, requires_grad=True)
//!     a.grad = torch.tensor([3.0, -4.0, 0.5]); w.grad = torch.tensor([[1.0, -2.0], [0.25, 6.0]])
//!     total = torch.nn.utils.clip_grad_norm_([a, w], max_norm, norm_type)
//!     return total.item(), a.grad.tolist(), w.grad.flatten().tolist()
//! ```
// The expected values are pasted verbatim from PyTorch (f32 printed as Python floats).
#![allow(clippy::excessive_precision)]

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};
use tch_amp::error::{ConfigError, UsageError};
use tch_amp::{Amp, AmpConfig, AmpError, AmpOptimizer, OptLevel};

const GA: [f32; 3] = [3.0, -4.0, 0.5];
const GW: [f32; 4] = [1.0, -2.0, 0.25, 6.0];

fn t(v: &[f32]) -> Tensor {
    Tensor::from_slice(v)
}

fn var(vs: &VarStore, name: &str) -> Tensor {
    vs.variables()[name].shallow_clone()
}

fn grad_of(vs: &VarStore, name: &str) -> Vec<f32> {
    Vec::<f32>::try_from(var(vs, name).grad().flatten(0, -1)).unwrap()
}

/// O0 with `a` [3], `w` [2, 2] and `unused` [2] (no gradient); grads of a and w set to
/// `ga`, `gw` by a backward through O0's scale_loss.
fn setup(ga: &[f32], gw: &[f32]) -> (VarStore, Amp, AmpOptimizer) {
    let vs = VarStore::new(Device::Cpu);
    let root = vs.root();
    let _ = root.zeros("a", &[3]);
    let _ = root.zeros("w", &[2, 2]);
    let _ = root.var_copy("unused", &t(&[1.0, 2.0]));
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let mut opt = amp.optimizer(&vs, tch::nn::Sgd::default(), 0.1).unwrap();
    let (a, w) = (var(&vs, "a"), var(&vs, "w"));
    let loss = (&a * t(ga)).sum(Kind::Float) + (&w * t(gw).view([2, 2])).sum(Kind::Float);
    amp.scale_loss(&loss, &mut [&mut opt], |l| l.backward()).unwrap();
    assert_eq!(bits(&grad_of(&vs, "a")), bits(ga));
    assert_eq!(bits(&grad_of(&vs, "w")), bits(gw));
    (vs, amp, opt)
}

/// The bit patterns, so that NaN compares equal to itself.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = 1e-6 * f64::max(1.0, f64::from(w.abs()));
        assert!((f64::from(*g) - f64::from(*w)).abs() <= tol, "{what}[{i}]: got {g:e}, PyTorch {w:e}");
    }
}

/// Clips with (max_norm, norm_type) and compares with PyTorch's total norm and clipped grads.
fn check(max_norm: f64, norm_type: f64, total: f32, want_a: [f32; 3], want_w: [f32; 4]) {
    let (vs, _amp, mut opt) = setup(&GA, &GW);
    let got = opt.clip_grad_norm(max_norm, norm_type).unwrap();
    assert_eq!(got, f64::from(total), "total {norm_type}-norm");
    assert_close("a.grad", &grad_of(&vs, "a"), &want_a);
    assert_close("w.grad", &grad_of(&vs, "w"), &want_w);
    assert!(!var(&vs, "unused").grad().defined(), "clipping gave a gradient to a variable without one");
}

// clip(1.0, 2.0)
#[test]
fn norm2_clips() {
    check(
        1.0,
        2.0,
        8.143248558044434,
        [0.3684033155441284, -0.4912044107913971, 0.06140055134892464],
        [0.12280110269784927, -0.24560220539569855, 0.03070027567446232, 0.7368066310882568],
    );
}

// clip(100.0, 2.0): under the limit, gradients unchanged (exactly).
#[test]
fn norm2_under_the_limit_does_not_clip() {
    let (vs, _amp, mut opt) = setup(&GA, &GW);
    assert_eq!(opt.clip_grad_norm(100.0, 2.0).unwrap(), f64::from(8.143248558044434f32));
    assert_eq!(grad_of(&vs, "a"), GA);
    assert_eq!(grad_of(&vs, "w"), GW);
}

// clip(5.0, 1.0)
#[test]
fn norm1_clips() {
    check(
        5.0,
        1.0,
        16.75,
        [0.8955223560333252, -1.1940298080444336, 0.1492537260055542],
        [0.2985074520111084, -0.5970149040222168, 0.0746268630027771, 1.7910447120666504],
    );
}

// clip(2.0, float("inf"))
#[test]
fn norm_inf_clips() {
    check(
        2.0,
        f64::INFINITY,
        6.0,
        [0.9999998807907104, -1.333333134651184, 0.166666641831398],
        [0.333333283662796, -0.666666567325592, 0.083333320915699, 1.999999761581421],
    );
}

// clip(10.0, float("inf"))
#[test]
fn norm_inf_under_the_limit_does_not_clip() {
    check(10.0, f64::INFINITY, 6.0, GA, GW);
}

// clip(3.0, 3.0)
#[test]
fn norm3_clips() {
    check(
        3.0,
        3.0,
        6.812295436859131,
        [1.3211405277252197, -1.7615206241607666, 0.22019007802009583],
        [0.44038015604019165, -0.8807603120803833, 0.11009503901004791, 2.6422810554504395],
    );
}

// clip(0.0, 2.0): max_norm 0 zeroes the gradients (allowed by torch, and by us).
#[test]
fn max_norm_zero_zeroes_the_grads() {
    check(0.0, 2.0, 8.143248558044434, [0.0; 3], [0.0; 4]);
}

/// O3: fp16 variables, no masters, fp16 gradients. The total norm is computed in fp32:
/// ```python
/// g = torch.full((4096,), 200.0, dtype=torch.float16)
/// (g * g).sum()                          # inf in fp16
/// torch.linalg.vector_norm(g.float())    # 12800.0
/// coef = torch.clamp(1.0 / (torch.tensor(12800.0) + 1e-6), max=1.0)
/// (torch.tensor(200.0, dtype=torch.float16) * coef.half()).item()   # 0.015625
/// g2 = torch.full((1 << 18,), 256.0, dtype=torch.float16)
/// torch.linalg.vector_norm(g2)           # inf in fp16 (131072 > 65504)
/// torch.linalg.vector_norm(g2.float())   # 131072.0
/// coef2 = torch.clamp(1.0 / (torch.tensor(131072.0) + 1e-6), max=1.0)
/// (torch.tensor(256.0, dtype=torch.float16) * coef2.half()).item()  # 0.001953125
/// ```
#[test]
fn fp16_grads_norm_in_fp32() {
    for (n, value, total, clipped) in
        [(4096i64, 200.0f32, 12800.0, 0.015625f32), (1 << 18, 256.0, 131072.0, 0.001953125)]
    {
        let vs = VarStore::new(Device::Cpu);
        let _ = vs.root().zeros("g", &[n]);
        let mut amp = Amp::new(&AmpConfig::new(OptLevel::O3).verbosity(0)).unwrap();
        let _model = amp.cast_model(&vs, ()).unwrap();
        let g = var(&vs, "g");
        assert_eq!(g.kind(), Kind::Half);
        let mut opt = amp.optimizer(&vs, tch::nn::Sgd::default(), 0.1).unwrap();
        let loss = (g.to_kind(Kind::Float) * f64::from(value)).sum(Kind::Float);
        amp.scale_loss(&loss, &mut [&mut opt], |l| l.backward()).unwrap();
        let grad = g.grad();
        assert_eq!(grad.kind(), Kind::Half);
        assert_eq!(grad.max().double_value(&[]), f64::from(value));
        // What a norm in fp16 would give.
        assert!(grad.square().sum(Kind::Half).double_value(&[]).is_infinite());

        let norm = opt.clip_grad_norm(1.0, 2.0).unwrap();
        assert!(norm.is_finite());
        assert_eq!(norm, total);
        let grad = g.grad();
        assert_eq!(grad.kind(), Kind::Half, "clipping changed the gradient's dtype");
        let full = Tensor::full([n], f64::from(clipped), (Kind::Half, Device::Cpu));
        assert!(
            crate::common::same(&grad, &full),
            "clipped fp16 grads: max diff {}",
            crate::common::max_abs_diff(&grad, &full)
        );
    }
}

/// No gradient anywhere after a `scale_loss` pass: 0.0, no panic (tch's own `clip_grad_norm`
/// panics on an empty list). Before any pass (clipping would be silently off) it is a typed
/// error.
#[test]
fn no_grads_returns_zero() {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var_copy("w", &t(&[1.0, 2.0]));
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let mut opt = amp.optimizer(&vs, tch::nn::Sgd::default(), 0.1).unwrap();
    assert!(matches!(opt.clip_grad_norm(1.0, 2.0), Err(AmpError::Usage(UsageError::CallOrder { .. }))));
    // A pass whose loss does not reach this optimizer's parameters.
    let other = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
    let loss = (&other * 2.0).sum(Kind::Float);
    amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
    for norm_type in [1.0, 2.0, f64::INFINITY] {
        assert_eq!(opt.clip_grad_norm(1.0, norm_type).unwrap(), 0.0);
    }
    assert!(!var(&vs, "w").grad().defined());
}

/// A bad `max_norm` or `norm_type` is `ConfigError::InvalidOption` naming it, and the
/// gradients are left as they were.
#[test]
fn invalid_arguments_are_typed_errors() {
    let (vs, _amp, mut opt) = setup(&GA, &GW);
    for bad in [-1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        match opt.clip_grad_norm(bad, 2.0) {
            Err(AmpError::Config(ConfigError::InvalidOption { option: "max_norm", .. })) => {}
            other => panic!("max_norm {bad}: {other:?}"),
        }
    }
    for bad in [0.0, -2.0, f64::NAN, f64::NEG_INFINITY] {
        match opt.clip_grad_norm(1.0, bad) {
            Err(AmpError::Config(ConfigError::InvalidOption { option: "norm_type", .. })) => {}
            other => panic!("norm_type {bad}: {other:?}"),
        }
    }
    assert_eq!(grad_of(&vs, "a"), GA);
    assert_eq!(grad_of(&vs, "w"), GW);
}

/// An inf or NaN gradient: the non-finite norm is returned and the gradients are left
/// unscaled (torch would multiply them by 0 or NaN).
#[test]
fn non_finite_norm_is_returned_and_grads_left_alone() {
    for (bad, norm_type) in
        [(f32::INFINITY, 2.0), (f32::NEG_INFINITY, 1.0), (f32::INFINITY, f64::INFINITY), (f32::NAN, 2.0)]
    {
        let ga = [3.0, bad, 0.5];
        let (vs, _amp, mut opt) = setup(&ga, &GW);
        let a_before = grad_of(&vs, "a");
        let norm = opt.clip_grad_norm(1.0, norm_type).unwrap();
        if bad.is_nan() {
            assert!(norm.is_nan(), "norm {norm}");
        } else {
            assert_eq!(norm, f64::INFINITY);
        }
        // Bit-exact, NaN included.
        assert_eq!(bits(&grad_of(&vs, "a")), bits(&a_before), "norm_type {norm_type}");
        assert_eq!(bits(&a_before), bits(&ga));
        assert_eq!(grad_of(&vs, "w"), GW, "norm_type {norm_type}");
    }
}

/// O2: clipping after `scale_loss` acts on the fp32 master gradients, already unscaled.
/// The fp16 model grad of the scaled loss is fp16(c * 65536); unscaled it becomes the fp32
/// master grad, whose norm is the reference:
/// ```python
/// c = torch.tensor([0.3, -0.7, 0.05, 0.9, -0.45, 0.2])
/// g16 = (c * 65536.0).half()
/// master = torch.zeros(6, requires_grad=True)
/// master.grad = g16.float() * (1.0 / 65536.0)
/// # [0.300048828125, -0.7001953125, 0.04998779296875, 0.89990234375, -0.449951171875, 0.199951171875]
/// total = torch.nn.utils.clip_grad_norm_([master], 0.5, 2.0)   # 1.2786954641342163
/// master.grad.tolist()
/// # [0.11732605844736099, -0.2737926244735718, 0.0195463877171278, 0.3518826961517334,
/// #  -0.1759413480758667, 0.0781855508685112]
/// torch.linalg.vector_norm(c)   # 1.278671145439148: the fp16 rounding shows
/// ```
#[test]
fn o2_clips_unscaled_fp32_master_grads() {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var_copy("p", &t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O2).verbosity(0)).unwrap();
    let _model = amp.cast_model(&vs, ()).unwrap();
    let p = var(&vs, "p");
    assert_eq!(p.kind(), Kind::Half);
    let mut opt = amp.optimizer(&vs, tch::nn::Sgd::default(), 0.1).unwrap();
    let c = t(&[0.3, -0.7, 0.05, 0.9, -0.45, 0.2]);
    let loss = (p.to_kind(Kind::Float) * &c).sum(Kind::Float);
    let out = amp.scale_loss(&loss, &mut [&mut opt], |l| l.backward()).unwrap();
    assert_eq!(out.loss_scale, 65536.0);
    assert!(!out.overflow);

    let master = opt.master_params().remove(0);
    assert_eq!(master.kind(), Kind::Float);
    let unscaled = [0.300048828125f32, -0.7001953125, 0.04998779296875, 0.89990234375, -0.449951171875, 0.199951171875];
    assert_eq!(Vec::<f32>::try_from(master.grad()).unwrap(), unscaled);
    let master_before = master.copy();

    let norm = opt.clip_grad_norm(0.5, 2.0).unwrap();
    assert_eq!(norm, f64::from(1.2786954641342163f32), "not the norm of the unscaled fp32 master grads");
    let clipped = [
        0.11732605844736099f32,
        -0.2737926244735718,
        0.0195463877171278,
        0.3518826961517334,
        -0.1759413480758667,
        0.0781855508685112,
    ];
    assert_close("master.grad", &Vec::<f32>::try_from(master.grad()).unwrap(), &clipped);
    assert!(!p.grad().defined(), "the fp16 model keeps no gradient after scale_loss");

    // The step uses the clipped master grads: master -= 0.1 * clipped; model = fp16(master).
    assert!(opt.step().unwrap().stepped());
    let want = &master_before - t(&clipped) * 0.1;
    assert!(crate::common::max_abs_diff(&master, &want) <= 1e-6);
    assert!(crate::common::same(&p, &master.to_kind(Kind::Half)));
}

/// The timm/BERT porters' mistake: clipping the O2 model's fp16 parameters after `scale_loss`,
/// whose gradients live on the fp32 masters. torch's form, the fp16_utils form and the masters'.
#[test]
fn clipping_the_o2_models_fp16_parameters_is_refused() {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var_copy("w", &t(&[1.0, 2.0, 3.0]));
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O2).verbosity(0)).unwrap();
    let _model = amp.cast_model(&vs, ()).unwrap();
    let mut opt = amp.optimizer(&vs, tch::nn::Sgd::default(), 0.1).unwrap();
    let w = var(&vs, "w");
    assert_eq!(w.kind(), Kind::Half);
    let loss = (w.to_kind(Kind::Float) * t(&[0.375, -0.5, 0.0])).sum(Kind::Float);
    amp.scale_loss(&loss, &mut [&mut opt], |l| l.backward()).unwrap();
    let model = vs.trainable_variables();
    for e in [
        tch_amp::torch_amp::clip_grad_norm_(&model, 1.0, 2.0).map(|_| ()).unwrap_err(),
        tch_amp::fp16_utils::clip_grad_norm(&model, 1.0, 2.0).map(|_| ()).unwrap_err(),
    ] {
        assert!(matches!(&e, AmpError::Usage(UsageError::CallOrder { call: "clip_grad_norm", .. })), "{e}");
        assert!(e.to_string().contains("master"), "{e}");
    }
    // The masters hold the gradient (0.375, -0.5, 0): norm 0.625, clipped to 0.5.
    assert_eq!(opt.clip_grad_norm(0.5, 2.0).unwrap() as f32, 0.625);
}
