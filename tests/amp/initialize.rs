//! `initialize` and the O2/O3 model handling: in-place casts every layer sees, batch norm kept
//! fp32 by whole path segments, the input/output casting wrapper, master weights that the
//! model always equals after a step, gradient accumulation with delay_unscale, and the
//! typed errors of misuse.

use crate::common::*;
use tch::nn::{self, Module, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::cast::CpuFeatures;
use tch_amp::error::{ConfigError, UsageError};
use tch_amp::{initialize, Amp, AmpConfig, AmpError, CpuKernelChoice, CpuKernels, OpClass, OptLevel, ScaleLossOptions};

/// Two batch norms whose names share a prefix (`bn1`, `bn10`) and a linear named `bn1x`,
/// to catch prefix matching.
fn tricky_store() -> VarStore {
    let vs = VarStore::new(Device::Cpu);
    let r = vs.root();
    let _a = nn::batch_norm1d(&r / "bn1", 4, Default::default());
    let _b = nn::batch_norm1d(&r / "bn10", 4, nn::BatchNormConfig { affine: false, ..Default::default() });
    let _c = nn::linear(&r / "bn1x", 4, 4, Default::default());
    let _d = nn::linear(&r / "layer" / "bn1", 4, 4, Default::default());
    let _e = (&r / "bn1").add("num_batches_tracked", Tensor::zeros([1], (Kind::Int64, Device::Cpu)), false);
    vs
}

#[test]
fn o2_casts_in_place_and_keeps_affine_batchnorm_fp32_by_segment() {
    let vs = tricky_store();
    let amp = Amp::new(&AmpConfig::new(OptLevel::O2)).unwrap();
    let (_m, report) = amp.cast_model_with_report(&vs, ()).unwrap();
    let v = vs.variables();
    let mut keys: Vec<_> = v.keys().collect();
    keys.sort();
    assert_eq!(keys.len(), 11, "{keys:?}");
    for name in ["bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var"] {
        assert_eq!(v[name].kind(), Kind::Float, "{name}");
    }
    // Non-affine batch norm: cast like any module (as Apex).
    for name in ["bn10.running_mean", "bn10.running_var", "bn1x.weight", "bn1x.bias", "layer.bn1.weight"] {
        assert_eq!(v[name].kind(), Kind::Half, "{name}");
    }
    assert_eq!(v["bn1.num_batches_tracked"].kind(), Kind::Int64);
    assert_eq!(report.kept_batchnorm, vec!["bn1.bias", "bn1.running_mean", "bn1.running_var", "bn1.weight"]);
    assert!(report.non_floating.contains(&"bn1.num_batches_tracked".to_string()));
    assert!(v["bn1x.weight"].requires_grad(), "set_data keeps requires_grad");
}

#[test]
fn o3_casts_batchnorm_too_and_o0_keeps_fp32() {
    let vs = tricky_store();
    Amp::new(&AmpConfig::new(OptLevel::O3)).unwrap().cast_model(&vs, ()).unwrap();
    assert_eq!(vs.variables()["bn1.weight"].kind(), Kind::Half);
    assert_eq!(vs.variables()["bn1.running_var"].kind(), Kind::Half);
    let vs = tricky_store();
    Amp::new(&AmpConfig::new(OptLevel::O0)).unwrap().cast_model(&vs, ()).unwrap();
    assert!(vs.variables().values().filter(|t| t.is_floating_point()).all(|t| t.kind() == Kind::Float));
    // O2 with keep_batchnorm_fp32 = false casts everything.
    let vs = tricky_store();
    Amp::new(&AmpConfig::new(OptLevel::O2).keep_batchnorm_fp32(false)).unwrap().cast_model(&vs, ()).unwrap();
    assert_eq!(vs.variables()["bn1.weight"].kind(), Kind::Half);
}

#[test]
fn every_layer_sees_the_cast_and_wrapper_casts_io() {
    let vs = VarStore::new(Device::Cpu);
    let linear = nn::linear(vs.root() / "fc", 3, 2, Default::default());
    let amp = Amp::new(&AmpConfig::new(OptLevel::O2)).unwrap();
    let model = amp.cast_model(&vs, linear).unwrap();
    // The layer struct holds the same tensors: its weight is half now.
    assert_eq!(model.inner().ws.kind(), Kind::Half);
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).reshape([1, 3]);
    let y = model.forward(&x);
    assert_eq!(y.kind(), Kind::Float);
    // The output equals the fp16 computation, cast to fp32.
    let expected = model.inner().forward(&x.to_kind(Kind::Half)).to_kind(Kind::Float);
    assert!(same(&y, &expected));
    // fp64 inputs are floating: cast too. Integer tensors pass through.
    assert_eq!(model.cast_input(&x.to_kind(Kind::Double)).kind(), Kind::Half);
    let idx = Tensor::from_slice(&[1i64, 2]);
    assert_eq!(model.cast_input(&idx).kind(), Kind::Int64);
    // cast_model_outputs picks the output dtype.
    let vs2 = VarStore::new(Device::Cpu);
    let l2 = nn::linear(vs2.root(), 3, 2, Default::default());
    let amp2 = Amp::new(&AmpConfig::new(OptLevel::O2).cast_model_outputs(Kind::Half)).unwrap();
    assert_eq!(amp2.cast_model(&vs2, l2).unwrap().forward(&x).kind(), Kind::Half);
}

#[test]
fn disabled_amp_passes_everything_through() {
    let vs = VarStore::new(Device::Cpu);
    let net = Mlp::new(&vs.root());
    let cfg = AmpConfig::new(OptLevel::O2).enabled(false);
    let (model, mut opt, mut amp) = initialize(&vs, net, nn::Sgd::default(), 0.1, &cfg).unwrap();
    assert!(vs.variables().values().all(|t| t.kind() != Kind::Half));
    let (x, y) = batch(0, 8);
    let loss = model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
    let mut seen = None;
    let o = amp.scale_loss(&loss, &mut [&mut opt], |s| {
        seen = Some(s.shallow_clone());
        s.backward()
    });
    let o = o.unwrap();
    assert!(o.passed_through);
    assert!(same(&seen.unwrap(), &loss), "the loss itself goes to backward");
}

#[test]
fn o2_model_equals_masters_after_every_step_and_state_is_fp32() {
    let vs = VarStore::new(Device::Cpu);
    let net = Mlp::new(&vs.root());
    deterministic_init(&vs);
    let (model, mut opt, mut amp) =
        initialize(&vs, net, nn::Adam::default(), 1e-2, &AmpConfig::new(OptLevel::O2)).unwrap();
    let vars = vs.variables();
    assert_eq!(vars["fc1.weight"].kind(), Kind::Half);
    assert_eq!(vars["bn1.weight"].kind(), Kind::Float);
    let (x, y) = batch(1, 32);
    let mut losses = vec![];
    for _ in 0..15 {
        let loss = model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
        losses.push(loss.double_value(&[]));
        opt.zero_grad().unwrap();
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        // After unscaling: master grads fp32, fp16 model grads released.
        for (name, m) in opt.param_names().iter().zip(opt.master_params()) {
            assert_eq!(m.kind(), Kind::Float, "{name}");
            assert_eq!(m.grad().kind(), Kind::Float, "{name}");
            assert!(!vars[*name].grad().defined() || vars[*name].kind() == Kind::Float, "{name}: fp16 grad kept");
        }
        assert!(opt.step().unwrap().stepped());
        for (name, m) in opt.param_names().iter().zip(opt.master_params()) {
            let v = &vars[*name];
            assert!(same(v, &m.to_kind(v.kind())), "{name}: model != master cast to model dtype");
        }
    }
    assert!(losses[14] < losses[0] * 0.8, "{losses:?}");
    // fp32 batch norm variables are their own masters (shared storage).
    let names = opt.param_names();
    let i = names.iter().position(|n| *n == "bn1.weight").unwrap();
    assert!(opt.master_params()[i].is_set_to(&vars["bn1.weight"]));
    let j = names.iter().position(|n| *n == "fc1.weight").unwrap();
    assert!(!opt.master_params()[j].is_set_to(&vars["fc1.weight"]));
}

/// delay_unscale accumulates scaled grads over micro-batches; the result equals one
/// backward over the summed loss.
#[test]
fn delay_unscale_accumulates_like_one_big_backward() {
    let run = |micro: bool| -> Vec<Tensor> {
        let vs = VarStore::new(Device::Cpu);
        let net = Mlp::new(&vs.root());
        deterministic_init(&vs);
        let (model, mut opt, mut amp) =
            initialize(&vs, net, nn::Sgd::default(), 0.1, &AmpConfig::new(OptLevel::O2)).unwrap();
        let (x, y) = batch(2, 16);
        opt.zero_grad().unwrap();
        if micro {
            let n = 4;
            for k in 0..n {
                let xs = x.narrow(0, k * 4, 4);
                let ys = y.narrow(0, k * 4, 4);
                let loss = model.forward_t(&xs, false).mse_loss(&ys, tch::Reduction::Mean) / n as f64;
                let opts = ScaleLossOptions { loss_id: 0, delay_unscale: k + 1 < n };
                let o = amp.scale_loss_with(&loss, &mut [&mut opt], opts, |s| s.backward()).unwrap();
                assert_eq!(o.delayed, k + 1 < n);
                if k + 1 < n {
                    // Stepping now is a typed error: the grads are still scaled.
                    assert!(matches!(opt.step(), Err(AmpError::Usage(UsageError::CallOrder { .. }))));
                }
            }
        } else {
            let loss = model.forward_t(&x, false).mse_loss(&y, tch::Reduction::Mean);
            amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        }
        opt.master_params().iter().map(|m| m.grad().copy()).collect()
    };
    let a = run(true);
    let b = run(false);
    for (ga, gb) in a.iter().zip(&b) {
        // Sums in another order in fp16: close, not identical.
        assert!(max_abs_diff(ga, gb) <= 2e-3 * (1.0 + gb.abs().max().double_value(&[])), "{} vs {}", ga, gb);
    }
}

#[test]
fn misuse_is_a_typed_error() {
    let vs = VarStore::new(Device::Cpu);
    let net = Mlp::new(&vs.root());
    deterministic_init(&vs);
    let (model, mut opt, mut amp) =
        initialize(&vs, net, nn::Sgd::default(), 0.1, &AmpConfig::new(OptLevel::O2)).unwrap();
    let (x, y) = batch(0, 4);
    let loss = model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
    let bad = ScaleLossOptions { loss_id: 1, delay_unscale: false };
    let err = amp.scale_loss_with(&loss, &mut [&mut opt], bad, |s| s.backward()).unwrap_err();
    assert!(matches!(err, AmpError::Config(ConfigError::LossIdOutOfRange { loss_id: 1, num_losses: 1 })), "{err}");
    // An optimizer of another Amp.
    let other = Amp::new(&AmpConfig::new(OptLevel::O2)).unwrap();
    let mut foreign = other.optimizer(&vs, nn::Sgd::default(), 0.1).unwrap();
    let err = amp.scale_loss(&loss, &mut [&mut foreign], |s| s.backward()).unwrap_err();
    assert!(matches!(err, AmpError::Usage(UsageError::ForeignOptimizer { .. })), "{err}");
    // Prefixes select whole segments; an unknown one is an error.
    let o = amp.optimizer_for(&vs, &["fc1"], nn::Sgd::default(), 0.1).unwrap();
    assert_eq!(o.param_names(), vec!["fc1.bias", "fc1.weight"]);
    assert!(matches!(
        amp.optimizer_for(&vs, &["fc"], nn::Sgd::default(), 0.1),
        Err(AmpError::Config(ConfigError::NoVariablesUnder { .. }))
    ));
    assert!(matches!(
        amp.optimizer(&vs, nn::Sgd::default(), f64::NAN),
        Err(AmpError::Config(ConfigError::InvalidOption { option: "lr", .. }))
    ));
    // A loss without a graph is refused before backward (tch's backward would fail), and
    // leaves the optimizer usable.
    let no_grad_loss = Tensor::ones([], (Kind::Float, Device::Cpu));
    let err = amp
        .f_scale_loss_with(&no_grad_loss, &mut [&mut opt], ScaleLossOptions::default(), |s| s.f_backward())
        .unwrap_err();
    assert!(matches!(err, AmpError::Usage(UsageError::BadLoss { .. })), "{err}");
    opt.zero_grad().unwrap();
    amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
    assert!(opt.step().unwrap().stepped());
}

#[test]
fn inf_never_reaches_the_weights() {
    for level in [OptLevel::O1, OptLevel::O2] {
        let vs = VarStore::new(Device::Cpu);
        let net = Mlp::new(&vs.root());
        let (model, mut opt, mut amp) =
            initialize(&vs, net, nn::Adam::default(), 1e-2, &AmpConfig::new(level).verbosity(0)).unwrap();
        let before: Vec<Tensor> = vs.trainable_variables().iter().map(|t| t.copy()).collect();
        let masters_before: Vec<Tensor> = opt.master_params().iter().map(|t| t.copy()).collect();
        let (x, y) = batch(0, 4);
        let loss = model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean) * f64::NAN;
        opt.zero_grad().unwrap();
        let o = amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        assert!(o.overflow);
        assert_eq!(o.new_loss_scale, 32768.0);
        let step = opt.step().unwrap();
        assert!(!step.stepped());
        for (b, a) in before.iter().zip(vs.trainable_variables()) {
            assert!(same(b, &a), "{level}: a weight changed on a skipped step");
        }
        for (b, a) in masters_before.iter().zip(opt.master_params()) {
            assert!(same(b, &a), "{level}: a master changed on a skipped step");
        }
        assert_eq!(opt.step_counts(), (0, 1));
    }
}

#[test]
fn o1_initialize_activates_the_policy_for_the_amp_lifetime() {
    let vs = VarStore::new(Device::Cpu);
    let lin = nn::linear(vs.root() / "a", 4, 4, Default::default());
    let probe = nn::linear(vs.root() / "probe", 4, 4, Default::default());
    let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
    {
        let (model, mut opt, mut amp) =
            initialize(&vs, lin, nn::Sgd::default(), 0.1, &AmpConfig::new(OptLevel::O1)).unwrap();
        assert!(amp.casts_active());
        let y = model.forward(&x);
        assert_eq!(y.kind(), Kind::Half, "linear is on Apex's fp16 list");
        assert_eq!(y.softmax(-1, None).kind(), Kind::Float, "softmax is on Apex's fp32 list");
        let loss = y.softmax(-1, None).sum(Kind::Float);
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        assert!(opt.step().unwrap().stepped());
        // Weights, their grads and the update stay fp32 under O1.
        assert_eq!(vs.variables()["a.weight"].kind(), Kind::Float);
        assert_eq!(opt.master_params()[0].kind(), Kind::Float);
    }
    // Once the Amp is gone, plain libtorch again.
    assert_eq!(probe.forward(&x).kind(), Kind::Float);
    assert!(!tch_amp::diagnostics::policy_active().unwrap());
}

#[test]
fn o1_user_casts_and_bf16() {
    let vs = VarStore::new(Device::Cpu);
    let lin = nn::linear(vs.root(), 4, 4, Default::default());
    let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
    let mut policy = tch_amp::CastPolicy::apex();
    policy.register_float_function("linear").unwrap();
    let amp = Amp::new(&AmpConfig::new(OptLevel::O1).cast_policy(policy.clone())).unwrap();
    assert_eq!(lin.forward(&x).kind(), Kind::Float, "the user's float cast wins");
    drop(amp);
    let err = AmpConfig::new(OptLevel::O2).cast_policy(policy).build().unwrap_err();
    assert!(matches!(err, AmpError::Config(ConfigError::IncompatibleOption { option: "cast_policy", .. })), "{err}");
    let amp = Amp::new(&AmpConfig::new(OptLevel::O1).low_precision_dtype(Kind::BFloat16)).unwrap();
    assert_eq!(lin.forward(&x).kind(), Kind::BFloat16);
    assert!(!amp.scaler(0).unwrap().is_dynamic(), "bf16 needs no loss scaling");
}

#[test]
fn o2_on_cpu_emulates_half_gemms() {
    let vs = VarStore::new(Device::Cpu);
    let lin = nn::linear(vs.root(), 16, 8, Default::default());
    let x = Tensor::randn([4, 16], (Kind::Float, Device::Cpu));
    let amp = Amp::new(&AmpConfig::new(OptLevel::O2).cpu_kernels(CpuKernels::Emulate)).unwrap();
    assert!(amp.casts_active());
    assert_eq!(amp.properties().cpu_kernels(), Some(CpuKernelChoice::all(CpuKernels::Emulate)));
    let model = amp.cast_model(&vs, lin).unwrap();
    let y = model.forward(&x);
    // Emulation: fp32 compute of the fp16-rounded inputs, rounded once to fp16.
    let (w, b) = (&model.inner().ws, model.inner().bs.as_ref().unwrap());
    let xh = x.to_kind(Kind::Half);
    let expected = xh.to_kind(Kind::Float).matmul(&w.to_kind(Kind::Float).tr()) + b.to_kind(Kind::Float);
    let expected = expected.to_kind(Kind::Half).to_kind(Kind::Float);
    assert!(same(&y, &expected), "{y} vs {expected}");
    let native = Amp::new(&AmpConfig::new(OptLevel::O2).emulate_low_precision_on_cpu(false)).unwrap();
    assert!(!native.casts_active());
    assert_eq!(native.properties().cpu_kernels(), Some(CpuKernelChoice::all(CpuKernels::Native)));
}

/// `Auto` (the default) is resolved at initialize, per dtype and operation class, from this
/// CPU's features (the table of `CpuFeatures::native_is_fast`), and either choice can be forced
/// per dtype and per class.
#[test]
fn cpu_kernels_are_chosen_per_dtype_and_class_from_the_cpu_and_overridable() {
    let cpu = CpuFeatures::detect();
    for kind in [Kind::Half, Kind::BFloat16] {
        // The table: bf16 GEMMs and convolutions native with AMX_BF16; fp16 GEMMs native with
        // AVX512_FP16 or AMX_FP16; the rest emulated (each needs oneDNN's support of the type).
        let native = |class: OpClass| match (class, kind) {
            (OpClass::Gemm | OpClass::Convolution, Kind::BFloat16) => cpu.onednn_bf16 && cpu.amx_bf16,
            (OpClass::Gemm, Kind::Half) => cpu.onednn_fp16 && (cpu.avx512_fp16 || cpu.amx_fp16),
            _ => false,
        };
        let expected = OpClass::ALL.iter().fold(CpuKernelChoice::default(), |c, &class| {
            c.with(class, if native(class) { CpuKernels::Native } else { CpuKernels::Emulate })
        });
        eprintln!("{kind:?} on {}: Auto chooses {expected}", cpu.summary());
        assert_eq!(cpu.auto_choice(kind), expected, "{kind:?} on {}", cpu.summary());
        let props = AmpConfig::new(OptLevel::O2).cast_model_type(Some(kind)).build().unwrap();
        assert_eq!(props.low_precision_kind(), Some(kind));
        assert_eq!(props.cpu_kernels(), Some(expected), "Auto resolved at build");
        let amp = Amp::from_properties(props).unwrap();
        let any_emulated = OpClass::ALL.iter().any(|c| expected.get(*c) == CpuKernels::Emulate);
        assert_eq!(amp.casts_active(), any_emulated, "the emulation policy only when emulating");
        drop(amp);
        let o1 = AmpConfig::new(OptLevel::O1).low_precision_dtype(kind).build().unwrap();
        assert_eq!(o1.cpu_kernels(), Some(expected));
        // Forced either way, for one dtype only.
        let other = if kind == Kind::Half { Kind::BFloat16 } else { Kind::Half };
        for forced in [CpuKernels::Emulate, CpuKernels::Native] {
            let p =
                AmpConfig::new(OptLevel::O2).cast_model_type(Some(kind)).cpu_kernels_for(kind, forced).build().unwrap();
            assert_eq!(p.cpu_kernels(), Some(CpuKernelChoice::all(forced)));
            assert_eq!(p.cast_settings().cpu_kernels_of(other), cpu.auto_choice(other), "the other dtype stays Auto");
            // Forced for one class only, for both dtypes: the other classes stay Auto.
            for class in OpClass::ALL {
                let p = AmpConfig::new(OptLevel::O2)
                    .cast_model_type(Some(kind))
                    .cpu_kernels_class(class, forced)
                    .build()
                    .unwrap();
                assert_eq!(p.cpu_kernels(), Some(expected.with(class, forced)), "{kind:?} {class} {forced}");
                assert_eq!(p.cast_settings().cpu_kernels_of(other), cpu.auto_choice(other).with(class, forced));
            }
        }
        // From a string, as a command line gives it.
        let parsed: CpuKernelChoice = "native,attention=emulate".parse().unwrap();
        let p =
            AmpConfig::new(OptLevel::O2).cast_model_type(Some(kind)).cpu_kernel_choice(kind, parsed).build().unwrap();
        assert_eq!(
            p.cpu_kernels(),
            Some(CpuKernelChoice::all(CpuKernels::Native).with(OpClass::Attention, CpuKernels::Emulate))
        );
    }
    assert_eq!(AmpConfig::new(OptLevel::O0).build().unwrap().cpu_kernels(), None, "O0 computes in fp32");
}

/// O3 with Adam on tiny gradients: as under Apex (the optimizer on the fp16 parameters with fp16
/// state, tch-amp's default) eps = 1e-8 rounds to 0 in fp16 and the squared gradients underflow,
/// so the first step divides by zero and the weights stop being finite; with
/// `fp32_optimizer_state(true)` the fp16 weights are updated in fp32 with fp32 state and stay
/// finite.
#[test]
fn o3_adam_on_tiny_gradients_apex_state_and_fp32_state() {
    let run = |fp32_state: bool| {
        let vs = VarStore::new(Device::Cpu);
        let fc = nn::linear(vs.root() / "fc", 64, 10, Default::default());
        deterministic_init(&vs);
        let cfg = AmpConfig::new(OptLevel::O3).fp32_optimizer_state(fp32_state).verbosity(0);
        let (model, mut opt, mut amp) = initialize(&vs, fc, nn::Adam::default(), 1e-3, &cfg).unwrap();
        let x = (Tensor::arange(32 * 64, (Kind::Float, Device::Cpu)) * 0.37).sin().reshape([32, 64]) * 1e-3;
        let y = Tensor::arange(32, (Kind::Int64, Device::Cpu)).remainder(10);
        let mut finite_after = Vec::new();
        for _ in 0..5 {
            opt.zero_grad().unwrap();
            let loss = model.forward(&x).cross_entropy_for_logits(&y);
            amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
            assert!(opt.step().unwrap().stepped(), "static scale 1: O3 never skips");
            let w = &vs.variables()["fc.weight"];
            assert_eq!(w.kind(), Kind::Half);
            finite_after.push(w.isfinite().all().int64_value(&[]) == 1);
        }
        (finite_after, opt.memory().bytes_per_param(), opt.to_record())
    };
    let (finite, bytes, record) = run(true);
    assert_eq!(finite, vec![true; 5], "fp32 state keeps the fp16 weights finite");
    // fp32 state: 2 (weight) + 2 (fp16 grad, kept until zero_grad) + 8 (Adam's two moments).
    assert_eq!(bytes, 12.0);
    assert!(record.params.iter().all(|p| p.buffers.values().all(|b| b.kind() == Kind::Float)));
    let (finite, bytes, record) = run(false);
    assert!(!finite[0], "Apex's O3 Adam on fp16 state: non-finite weights after the first step");
    // fp16 state: 2 + 2 + 4.
    assert_eq!(bytes, 8.0);
    assert!(record.params.iter().all(|p| p.buffers.values().all(|b| b.kind() == Kind::Half)));
}

/// A CPU kernel setting from a string: an unknown class or mode, a class named twice or an
/// empty item is a typed error that names what is accepted.
#[test]
fn bad_cpu_kernel_strings_are_typed_errors() {
    for (bad, option) in [
        ("fast", "CPU kernels"),
        ("gemm=fast", "CPU kernels"),
        ("gpu=native", "CPU operation class"),
        ("native,tensor_core=emulate", "CPU operation class"),
        ("gemm=native,conv=emulate,gemm=emulate", "CPU kernel choice"),
        ("native,", "CPU kernel choice"),
        ("", "CPU kernels"),
    ] {
        match bad.parse::<CpuKernelChoice>() {
            Err(ConfigError::InvalidOption { option: o, value, .. }) => {
                assert_eq!(o, option, "{bad:?}");
                assert!(bad.contains(value.as_str()), "{bad:?}: the message names what was given ({value:?})");
            }
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    assert!(matches!("Conv".parse::<OpClass>(), Ok(OpClass::Convolution)));
    assert!(matches!("EMULATE".parse::<CpuKernels>(), Ok(CpuKernels::Emulate)));
    let err = AmpError::from("gemm=fast".parse::<CpuKernelChoice>().unwrap_err());
    assert!(err.to_string().contains("\"auto\", \"emulate\" or \"native\""), "{err}");
}
