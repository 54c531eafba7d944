//! The CPU fast paths of the O2 step and of `scale_loss`'s exit, each against the slower path
//! it replaces: the read-only inf/NaN check against libtorch's check-and-unscale, the
//! single-pass O2 Adam/AdamW update against the slice-wise path (which `tests/o2_step.rs` ties
//! to the full-size one, and `optim_bitwise` to torch.optim), and the allocator setting that
//! `initialize` makes.
use std::sync::Mutex;

use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::diagnostics::{
    o1_weight_copies, o1_weight_copy, o2_single_pass_form, o2_single_pass_updates, set_o1_weight_copies,
    set_o2_single_pass,
};
use tch_amp::{initialize, non_finite_check_, unscale_, AmpConfig, CpuKernels, OptLevel, OptimizerConfig};

/// The single-pass and weight-copy switches are process-wide: the tests that set them run one
/// at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// libtorch's check (multiplying by exactly 1) on clones: what the read-only check must flag.
fn libtorch_flag(grads: &[Tensor]) -> f64 {
    let clones: Vec<Tensor> = grads.iter().map(Tensor::copy).collect();
    let flag = Tensor::zeros([1], (Kind::Float, Device::Cpu));
    unscale_(&clones, &flag, &Tensor::ones([1], (Kind::Float, Device::Cpu))).unwrap();
    flag.double_value(&[0])
}

fn check_flag(grads: &[Tensor]) -> f64 {
    let flag = Tensor::zeros([1], (Kind::Float, Device::Cpu));
    non_finite_check_(grads, &flag).unwrap();
    flag.double_value(&[0])
}

/// Raw bits of a tensor, to prove the check leaves it alone (NaN payloads included).
fn bits(t: &Tensor) -> Vec<u8> {
    let t = t.contiguous();
    let mut out = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut out, t.numel());
    out
}

#[test]
fn read_only_check_flags_what_libtorch_flags() {
    // Lengths around the 16- and 64-element blocks of the vector scan, and a 3-D tensor.
    let lengths = [1i64, 7, 15, 16, 17, 63, 64, 65, 1000, 40_000];
    let kinds = [Kind::Half, Kind::BFloat16, Kind::Float, Kind::Double];
    let specials = [f64::INFINITY, f64::NEG_INFINITY, f64::NAN];
    let mut cases = 0;
    for kind in kinds {
        for &n in &lengths {
            let clean = Tensor::randn([n], (Kind::Float, Device::Cpu)).to_kind(kind);
            assert_eq!(check_flag(&[clean.shallow_clone()]), 0.0, "{kind:?} clean [{n}]");
            // The largest finite values of the type are not flagged.
            let big = match kind {
                Kind::Half => 65504.0,
                Kind::BFloat16 => 3.3895313892515355e38,
                Kind::Float => f32::MAX as f64,
                _ => f64::MAX,
            };
            let edge = Tensor::full([n], -big, (kind, Device::Cpu));
            assert_eq!(check_flag(&[edge]), 0.0, "{kind:?} -max [{n}]");
            for &special in &specials {
                for pos in [0, n / 2, n - 1] {
                    let g = clean.copy();
                    let _ = g.get(pos).fill_(special);
                    let before = bits(&g);
                    let flag = check_flag(&[clean.shallow_clone(), g.shallow_clone()]);
                    assert_eq!(flag, 1.0, "{kind:?} [{n}]: {special} at {pos} not flagged");
                    assert_eq!(flag, libtorch_flag(&[clean.shallow_clone(), g.shallow_clone()]));
                    assert_eq!(bits(&g), before, "{kind:?}: the check wrote into the gradient");
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 4 * 10 * 3 * 3);
    // A non-contiguous gradient (libtorch's own check runs on it) and an empty list.
    let t = Tensor::randn([8, 6], (Kind::Float, Device::Cpu)).to_kind(Kind::Half).transpose(0, 1);
    assert!(!t.is_contiguous());
    assert_eq!(check_flag(&[t.shallow_clone()]), 0.0);
    let _ = t.get(3).get(5).fill_(f64::NAN);
    assert_eq!(check_flag(&[t.shallow_clone()]), 1.0);
    assert_eq!(check_flag(&[]), 0.0);
    // A flag already set stays set.
    let flag = Tensor::ones([1], (Kind::Float, Device::Cpu));
    non_finite_check_(&[Tensor::zeros([5], (Kind::Half, Device::Cpu))], &flag).unwrap();
    assert_eq!(flag.double_value(&[0]), 1.0);
}

/// A model whose parameters have sizes that are and are not multiples of 8 and 16 (the
/// vector widths), so the single pass's vector part and libtorch's tail both run. Its values
/// come from no RNG: the tests of this binary run in parallel threads that share libtorch's.
fn model(vs: &VarStore) -> nn::Sequential {
    let r = vs.root();
    let net = nn::seq()
        .add(nn::linear(&r / "l1", 37, 96, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&r / "l2", 96, 13, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&r / "l3", 13, 5, Default::default()));
    crate::common::deterministic_init(vs);
    net
}

/// A batch of 16 for `model`, from `seed` without the RNG.
fn inputs(seed: i64) -> (Tensor, Tensor) {
    let t = |len: i64, k: f64| (Tensor::arange(len, (Kind::Float, Device::Cpu)) * k + seed as f64).sin() * 1.7;
    (t(16 * 37, 0.731).reshape([16, 37]), t(16 * 5, 1.37).reshape([16, 5]))
}

/// Trains 6 O2 steps with a `low` (fp16 or bf16) model (loss scale 1024, so gradients are
/// unscaled by 2^-10) and returns every master's and model weight's bits, and each optimizer
/// state tensor's, and how many parameter updates the single pass made.
fn train(cfg: OptimizerConfig, single_pass: bool, low: Kind) -> (Vec<(String, Vec<u8>)>, u64) {
    let previous = set_o2_single_pass(single_pass);
    let updates_before = o2_single_pass_updates();
    let vs = VarStore::new(Device::Cpu);
    let net = model(&vs);
    let (x, y) = inputs(7);
    let config = AmpConfig::new(OptLevel::O2).low_precision_dtype(low).loss_scale(1024.0).verbosity(0);
    let (net, mut opt, mut amp) = initialize(&vs, net, cfg, 3e-3, &config).unwrap();
    for _ in 0..6 {
        opt.zero_grad().unwrap();
        let loss = net.forward(&x).to_kind(Kind::Float).mse_loss(&y, tch::Reduction::Mean);
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        assert!(opt.step().unwrap().stepped());
    }
    set_o2_single_pass(previous);
    let updates = o2_single_pass_updates() - updates_before;
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, t) in vars {
        out.push((format!("model {name}"), bits(&t)));
    }
    let record = opt.to_record();
    for p in &record.params {
        if let Some(m) = &p.master {
            out.push((format!("master {}", p.name), bits(m)));
        }
        for (k, t) in &p.buffers {
            out.push((format!("{k} {}", p.name), bits(t)));
        }
    }
    (out, updates)
}

/// Whether this CPU runs the shim's vector kernels (x86-64 with AVX2, FMA and F16C): CI's do.
fn vector_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Asserts that two trainings' named byte dumps are identical, name by name.
fn assert_same_bytes(case: &str, a: &[(String, Vec<u8>)], b: &[(String, Vec<u8>)]) {
    assert_eq!(a.len(), b.len(), "{case}: as many tensors");
    for ((a_name, a), (b_name, b)) in a.iter().zip(b) {
        assert_eq!(a_name, b_name);
        let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
        assert_eq!(differ, 0, "{case}: {a_name} differs in {differ} of {} bytes", a.len());
    }
}

#[test]
fn single_pass_o2_adam_equals_the_slice_wise_step_bit_for_bit_fp16_and_bf16() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // CI's CPUs have AVX2, FMA and F16C and the venv's libtorch: a form must be found there,
    // or the comparison below would compare the slice-wise path with itself.
    if vector_cpu() {
        let adam = o2_single_pass_form(false).unwrap();
        let adamw = o2_single_pass_form(true).unwrap();
        println!("single-pass forms: Adam {adam:?}; AdamW {adamw:?}");
        assert!(adam.is_some() && adamw.is_some(), "no single-pass form reproduces libtorch's fused Adam here");
    }
    let cases: Vec<(&str, OptimizerConfig)> = vec![
        ("adam", OptimizerConfig::from(nn::Adam::default()).fused(true)),
        ("adam l2", OptimizerConfig::from(nn::Adam { wd: 1e-2, ..Default::default() }).fused(true)),
        ("adam amsgrad", OptimizerConfig::from(nn::Adam { amsgrad: true, ..Default::default() }).fused(true)),
        ("adam beta1 0.3", OptimizerConfig::from(nn::Adam { beta1: 0.3, ..Default::default() }).fused(true)),
        ("adamw", OptimizerConfig::from(nn::AdamW { wd: 1e-2, ..Default::default() }).fused(true)),
        (
            "adamw amsgrad maximize",
            OptimizerConfig::from(nn::AdamW { amsgrad: true, ..Default::default() }).fused(true).maximize(true),
        ),
    ];
    let vector_cpu = vector_cpu();
    for low in [Kind::Half, Kind::BFloat16] {
        for (name, cfg) in &cases {
            let (single, updates) = train(*cfg, true, low);
            let (sliced, none) = train(*cfg, false, low);
            // 6 steps of the 6 parameters, all through the single pass where it exists.
            assert_eq!(updates, if vector_cpu { 36 } else { 0 }, "{name} {low:?}: single-pass updates");
            assert_eq!(none, 0, "{name} {low:?}: the single pass ran while off");
            assert_same_bytes(&format!("{name} {low:?}"), &single, &sliced);
        }
    }
}

#[test]
fn initialize_keeps_freed_cpu_memory_by_default() {
    let props = AmpConfig::new(OptLevel::O2).build().unwrap();
    assert!(props.keep_freed_cpu_memory());
    assert!(!AmpConfig::new(OptLevel::O2).keep_freed_cpu_memory(false).build().unwrap().keep_freed_cpu_memory());
    let _amp = tch_amp::Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    // glibc (every Linux CI machine here): the setting took effect and says so.
    if cfg!(all(target_os = "linux", target_env = "gnu")) {
        assert!(tch_amp::cast::freed_cpu_memory_kept());
        assert!(tch_amp::cast::keep_freed_cpu_memory().unwrap());
    }
}

#[test]
fn bad_inputs_to_the_gradient_kernels_are_errors_not_crashes() {
    // An integer flag for a gradient libtorch checks itself: libtorch's typed error.
    let flag = Tensor::zeros([1], (Kind::Int64, Device::Cpu));
    let g = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).transpose(0, 1);
    assert!(non_finite_check_(&[g], &flag).is_err());
}

/// Trains 6 O1 steps with emulated fp16 and fused Adam/AdamW, O1's rounded weight copies on or
/// off; returns every weight's and state tensor's bits, and how many forward uses this thread
/// served from a copy.
fn train_o1(cfg: OptimizerConfig, copies: bool) -> (Vec<(String, Vec<u8>)>, u64) {
    let previous = set_o1_weight_copies(copies).unwrap();
    let served_before = o1_weight_copies().unwrap().served;
    let vs = VarStore::new(Device::Cpu);
    let net = model(&vs);
    let (x, y) = inputs(11);
    let amp_cfg = AmpConfig::new(OptLevel::O1).cpu_kernels(CpuKernels::Emulate).verbosity(0);
    let (net, mut opt, mut amp) = initialize(&vs, net, cfg, 3e-3, &amp_cfg).unwrap();
    for step in 0..6 {
        opt.zero_grad().unwrap();
        let loss = net.forward(&x).to_kind(Kind::Float).mse_loss(&y, tch::Reduction::Mean);
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        let _ = opt.step().unwrap();
        // After an update, a copy exists exactly when they are on and the weight was used once
        // (every one here: scale_loss's exit records the forward's uses before the step), and
        // it holds the weight's values rounded to fp16.
        for (name, w) in vs.variables() {
            let copy = o1_weight_copy(&w).unwrap();
            if copies {
                let copy = copy.unwrap_or_else(|| panic!("step {step}: no copy of {name}"));
                assert_eq!(bits(&copy), bits(&w.to_kind(Kind::Half).to_kind(Kind::Float)), "step {step}: {name}");
            } else if !copies {
                assert!(copy.is_none(), "{name}: a copy with copies off");
            }
        }
    }
    let served = o1_weight_copies().unwrap().served - served_before;
    set_o1_weight_copies(previous).unwrap();
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, t) in vars {
        out.push((format!("weight {name}"), bits(&t)));
    }
    for p in &opt.to_record().params {
        for (k, t) in &p.buffers {
            out.push((format!("{k} {}", p.name), bits(t)));
        }
    }
    (out, served)
}

/// O1's rounded weight copies (written by the fused Adam/AdamW step in the same pass as the
/// update, read by the next forward) change no bit of the training run against the casts
/// made in every forward and libtorch's own fused kernel, for Adam, Adam with L2, amsgrad and
/// AdamW; and the forwards did read them.
#[test]
fn o1_weight_copies_change_no_bit_of_a_training_run() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cases: Vec<(&str, OptimizerConfig)> = vec![
        ("adam", OptimizerConfig::from(nn::Adam::default()).fused(true)),
        ("adam l2", OptimizerConfig::from(nn::Adam { wd: 1e-2, ..Default::default() }).fused(true)),
        ("adam amsgrad", OptimizerConfig::from(nn::Adam { amsgrad: true, ..Default::default() }).fused(true)),
        (
            "adamw maximize",
            OptimizerConfig::from(nn::AdamW { wd: 1e-2, ..Default::default() }).fused(true).maximize(true),
        ),
    ];
    let vector_path = vector_cpu();
    for (name, cfg) in cases {
        let (with, served) = train_o1(cfg, true);
        let (without, served_off) = train_o1(cfg, false);
        assert_eq!(served_off, 0, "{name}: copies served while off");
        if vector_path {
            // 6 parameters, read from their copies in forwards 2 to 6.
            assert_eq!(served, 30, "{name}: forward uses served from a copy");
        }
        assert_same_bytes(name, &with, &without);
    }
}
