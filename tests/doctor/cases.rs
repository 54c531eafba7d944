//! Constructed models whose answer is known from first principles: an fp16 forward overflow,
//! a gradient underflow at scale 1, a precision-sensitive layer; the errors. The fp32 values
//! the answers rest on are computed here, and the CPU's 16-bit kernels play no part
//! (`CpuKernels::Emulate`: fp32 compute of the rounded operands, one rounding of the result).
use tch::nn::{Module, VarStore};
use tch::{Device, Kind, Reduction, Tensor};
use tch_amp::doctor::{Doctor, DoctorReport, FindingKind, Phase};
use tch_amp::error::{ConfigError, UsageError};
use tch_amp::{AmpConfig, AmpError, CpuKernels, OptLevel};

use crate::models::{batch, Cancelling, ThreeLayers};

fn o1(dtype: Kind) -> Doctor {
    Doctor::apex(AmpConfig::new(OptLevel::O1).cpu_kernels(CpuKernels::Emulate).low_precision_dtype(dtype))
}

fn diagnose<M: Module>(doctor: &Doctor, vs: &VarStore, net: &M, x: &Tensor, y: &Tensor) -> DoctorReport {
    doctor
        .run(vs, |p| p.forward(net, x).to_kind(Kind::Float).mse_loss(y, Reduction::Mean))
        .unwrap_or_else(|e| panic!("doctor: {e}"))
}

fn kinds(r: &DoctorReport, module: &str) -> Vec<FindingKind> {
    r.findings_for(module).map(|f| f.kind).collect()
}

/// `big`'s activations reach 7.2e4 in fp32 (> 65520, where fp16 rounds to inf) while fc1's stay
/// small: O1 fp16 names big's linear, in forward, as the first inf, and advises bf16 and an fp32
/// region for big; at bf16 (range 3.4e38) the same batch has no overflow anywhere.
#[test]
fn forward_overflow_names_the_layer_and_advises_bf16_or_fp32() {
    let vs = VarStore::new(Device::Cpu);
    let net = ThreeLayers::new(&vs, 1000.0);
    let (x, y) = batch(100.0);
    // The premise, in fp32.
    let h = net.fc1.forward(&x).relu();
    let big = net.big.forward(&h);
    let fc1_max = h.abs().max().double_value(&[]);
    let big_max = big.abs().max().double_value(&[]);
    assert!(fc1_max < 65504.0 && big_max >= 65520.0, "fc1 {fc1_max}, big {big_max}");

    let r = diagnose(&o1(Kind::Half), &vs, &net, &x, &y);
    let origin = r.first_non_finite.clone().expect("an inf in the fp16 run");
    assert_eq!((origin.phase, origin.op.as_str(), origin.module.as_str()), (Phase::Forward, "linear", "big"));
    assert_eq!(origin.dtype, "fp16");
    let op = r.ops.iter().find(|o| o.op == "linear" && o.module == "big").unwrap();
    let f = op.forward.as_ref().unwrap();
    let c = f.fp32.as_ref().unwrap();
    assert_eq!(c.max_abs, big_max);
    // The fp32 values at or above 65520 are those fp16 cannot hold ...
    let over = big.abs().ge(65520.0).sum(Kind::Int64).int64_value(&[]) as u64;
    assert!(over > 0);
    assert_eq!(c.overflow, over);
    assert_eq!(f.overflow_share(), over as f64 / big.numel() as f64);
    // ... and the fp16 run's infs are where the emulated linear (fp32 compute of the rounded
    // operands) reaches 65520.
    let r16 = |t: &Tensor| t.to_kind(Kind::Half).to_kind(Kind::Float);
    let h16 = r16(&r16(&net.fc1.ws).matmul(&r16(&x).tr()).tr().g_add(&r16(net.fc1.bs.as_ref().unwrap()))).relu();
    let big16 = h16.matmul(&r16(&net.big.ws).tr()) + r16(net.big.bs.as_ref().unwrap());
    let inf16 = big16.abs().ge(65520.0).sum(Kind::Int64).int64_value(&[]) as u64;
    assert_eq!(f.non_finite, inf16);

    let first = r.findings.first().unwrap();
    assert_eq!(
        (first.kind, first.module.as_deref(), first.op.as_deref()),
        (FindingKind::ActivationOverflow, Some("big"), Some("linear"))
    );
    assert!(first.message.contains("the first inf/NaN"), "{}", first.message);
    let codes: Vec<&str> = first.advice.iter().map(|a| a.code.as_str()).collect();
    assert_eq!(codes[0], "AmpConfig::new(OptLevel::O1).low_precision_dtype(Kind::BFloat16)");
    assert!(codes[1].contains("tch_amp::fp32_region(Device::Cpu") && codes[1].contains("<big>"), "{codes:?}");
    assert!(kinds(&r, "fc1").is_empty(), "{:?}", kinds(&r, "fc1"));
    assert!(!r.trains_fine());
    assert!(r.summary().contains("activations of big (linear) overflow fp16"), "{}", r.summary());

    let r = diagnose(&o1(Kind::BFloat16), &vs, &net, &x, &y);
    assert_eq!(r.first_non_finite, None);
    assert!(r.findings.iter().all(|f| f.kind != FindingKind::ActivationOverflow), "{:#?}", r.findings);
    for o in &r.ops {
        let f = o.forward.as_ref().unwrap();
        assert_eq!((f.non_finite, f.fp32.as_ref().map_or(0, |c| c.overflow)), (0, 0), "{} in {}", o.op, o.module);
    }
}

/// `big`'s weights are 1e-6 times the others: the gradients flowing back through it to fc1's
/// output are ~1e-9, below fp16's smallest subnormal (2^-24 = 6e-8) at loss scale 1, so fc1's
/// gradients (of its output, and of its weights, computed from them) are all zero in fp16, while
/// head's and big's (~1e-3) are not. At the default scale 2^16 they are in range again.
#[test]
fn gradient_underflow_at_scale_one_names_the_layer() {
    let vs = VarStore::new(Device::Cpu);
    let net = ThreeLayers::new(&vs, 1e-6);
    let (x, y) = batch(1.0);
    let r = diagnose(&o1(Kind::Half).loss_scale(1.0), &vs, &net, &x, &y);
    let fc1 = r.ops.iter().find(|o| o.op == "linear" && o.module == "fc1").unwrap();
    let b = fc1.backward.as_ref().expect("fc1's output has a gradient");
    let c = b.fp32.as_ref().unwrap();
    // The premise: every fp32 gradient of fc1's output is non-zero only where relu passes, and
    // all of those are below half of fp16's smallest subnormal.
    assert!(c.nonzero > 0 && c.max_abs <= 2f64.powi(-25), "{c:?}");
    assert_eq!((b.dtype.as_str(), c.underflow, b.zeros), ("fp16", c.nonzero, b.numel));
    assert_eq!(b.underflow_share(), 1.0);
    let head = r.ops.iter().find(|o| o.op == "linear" && o.module == "head").unwrap();
    assert_eq!(head.backward.as_ref().unwrap().underflow_share(), 0.0);

    let finding = r.findings_for("fc1").find(|f| f.kind == FindingKind::GradientUnderflow).expect("fc1 named");
    assert_eq!(finding.phase, Some(Phase::Backward));
    assert!(finding.message.contains("gradients of fc1 underflow fp16 at loss scale 1"), "{}", finding.message);
    // A window of scales that fits, and the call that sets it.
    let w = r.scale_window.clone().expect("a window");
    assert!(!w.is_empty() && !w.contains(1.0) && w.contains(65536.0), "{w:?}");
    assert_eq!(w.min_set_by.as_deref(), Some("fc1"));
    assert!(finding.advice[0].code.contains(".min_loss_scale("), "{:?}", finding.advice);
    assert!(kinds(&r, "head").is_empty() && kinds(&r, "big").is_empty(), "{:#?}", r.findings);

    let r = diagnose(&o1(Kind::Half), &vs, &net, &x, &y);
    assert_eq!(r.loss_scale, 65536.0);
    assert!(r.trains_fine(), "{:#?}", r.findings);
}

/// `cancel`'s output is a sum of ±1000 terms that cancel exactly once rounded to 16 bits (see
/// `Cancelling`): no value leaves the range, and the doctor names it by its relative error (1),
/// at fp16 and at bf16.
#[test]
fn precision_loss_names_the_layer_by_relative_error() {
    let vs = VarStore::new(Device::Cpu);
    let net = Cancelling::new(&vs);
    let (x, y) = batch(1.0);
    for dtype in [Kind::Half, Kind::BFloat16] {
        let r = diagnose(&o1(dtype), &vs, &net, &x, &y);
        let op = r.ops.iter().find(|o| o.op == "linear" && o.module == "cancel").unwrap();
        let f = op.forward.as_ref().unwrap();
        assert_eq!(f.zeros, f.numel, "the 16-bit output is all zero");
        assert_eq!(f.relative_error(), Some(1.0));
        assert_eq!(f.fp32.as_ref().unwrap().overflow, 0);
        assert!(f.flushed_share() <= 0.01, "{f:?}");
        let finding = r.findings_for("cancel").find(|f| f.kind == FindingKind::PrecisionLoss).expect("cancel named");
        assert_eq!(finding.op.as_deref(), Some("linear"));
        assert!(finding.advice[0].code.contains("fp32_region"), "{:?}", finding.advice);
        // fc1 loses nothing (its error is a rounding's); its gradients, through ±1000 weights
        // at 2^16, overflow fp16, which a dynamic scale handles (a finding of severity Info).
        assert!(!kinds(&r, "fc1").contains(&FindingKind::PrecisionLoss), "{:?}", kinds(&r, "fc1"));
    }
}

/// O0 is the reference, not a target; a loss without a graph is the caller's error; neither
/// changes the model.
#[test]
fn bad_targets_and_losses_are_typed_errors() {
    let vs = VarStore::new(Device::Cpu);
    let net = ThreeLayers::new(&vs, 1.0);
    let (x, y) = batch(1.0);
    let before = vs.variables()["big.weight"].copy();
    let e = Doctor::apex(AmpConfig::new(OptLevel::O0))
        .run(&vs, |p| p.forward(&net, &x).mse_loss(&y, Reduction::Mean))
        .unwrap_err();
    assert!(matches!(e, AmpError::Config(ConfigError::InvalidOption { option: "opt_level", .. })), "{e}");
    let e = o1(Kind::Half).run(&vs, |p| p.forward(&net, &x).mse_loss(&y, Reduction::Mean).detach()).unwrap_err();
    assert!(matches!(&e, AmpError::Usage(UsageError::BadLoss { call: "the precision doctor", .. })), "{e}");
    let e = o1(Kind::Half).loss_scale(0.0).run(&vs, |p| p.forward(&net, &x).sum(Kind::Float)).unwrap_err();
    assert!(matches!(e, AmpError::Config(_)), "{e}");
    let after = &vs.variables()["big.weight"];
    assert!(after.kind() == Kind::Float && after.requires_grad() && after.equal(&before));
}
