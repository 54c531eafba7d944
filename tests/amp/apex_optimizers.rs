//! Apex's optimizers (FusedSGD, FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad) against the
//! Python reference of their kernels' algorithm, bit for bit: 17 cases (FusedAdam with
//! adam_w_mode on and off and without bias correction; FusedLAMB with max_grad_norm clipping,
//! L2 mode without grad_averaging, use_nvlamb, without bias correction; FusedNovoGrad l2 and max
//! norm, reg_inside_moment, init_zero; FusedAdagrad with and without adagrad_w_mode; FusedSGD
//! with momentum, wd_after_momentum, Nesterov), two parameter groups with their own learning
//! rate and hyper-parameters (weight decay 0 in the second: the `no_decay` pattern; other betas
//! or eps), 12 steps, for fp32 parameters (O0) and for the fp32 masters of fp16 parameters (O2,
//! dynamic loss scale 65536). Every step's parameters and the final state must equal the
//! reference's bits; a run saved with `save_checkpoint` after 6 steps and resumed into a fresh
//! model, optimizer and Amp with `load_checkpoint` must continue with the same bits.
//!
//! Bit for bit because tch-amp (src/optim/apex.rs) and the reference compute the kernels'
//! arithmetic as the same fp32 torch ops in the same order; Apex's CUDA kernels themselves
//! differ from both in the last bits (`--use_fast_math`, fused multiply-adds, block-wise norm
//! sums, LAMB's single sum of squares; see the script). FusedSGD is torch.optim.SGD's ops. The expected values are written by scripts/reference/apex_optim_fixtures.py
//! (PyTorch 2.13.0, CPU), run by the test on the machine that runs it ([`Fixture::generated`]).
use crate::common::reference::{
    bits_equal, case_shapes as shapes, describe_diff, split_flat as split, torch_hyper, Fixture,
};
use serde_json::Value;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};
use tch_amp::error::ConfigError;
use tch_amp::optim::NovoGradNorm;
use tch_amp::{
    load_checkpoint, save_checkpoint, Amp, AmpConfig, AmpError, AmpOptimizer, FusedAdagrad, FusedAdam, FusedLamb,
    FusedNovoGrad, FusedSgd, OptLevel, OptimizerConfig, ParamGroup,
};

const CASES: usize = 17;
/// Where the resumed run is saved and reloaded.
const SAVE_AT: i64 = 6;

fn fixture() -> Fixture {
    Fixture::generated("apex_optim_fixtures.py")
}

/// A group's (or the optimizer-wide options') values under tch-amp's names, `lr` left out.
fn hyper(map: &Value) -> Vec<(String, f64)> {
    torch_hyper(map).into_iter().filter(|(k, _)| k != "lr").collect()
}

fn get(h: &[(String, f64)], key: &str) -> f64 {
    h.iter().find(|(k, _)| k == key).unwrap_or_else(|| panic!("no {key} in {h:?}")).1
}

fn flag(h: &[(String, f64)], key: &str) -> bool {
    get(h, key) != 0.0
}

/// The tch-amp configuration of a case: group 0's hyper-parameters and the optimizer-wide
/// options (group 1 overrides what differs).
fn config(case: &Value) -> OptimizerConfig {
    let mut h = hyper(&case["param_groups"][0]);
    h.extend(hyper(&case["options"]));
    match case["optimizer"].as_str().unwrap() {
        "FusedSGD" => FusedSgd {
            momentum: get(&h, "momentum"),
            dampening: get(&h, "dampening"),
            weight_decay: get(&h, "weight_decay"),
            nesterov: flag(&h, "nesterov"),
            wd_after_momentum: flag(&h, "wd_after_momentum"),
        }
        .into(),
        "FusedAdam" => FusedAdam {
            beta1: get(&h, "beta1"),
            beta2: get(&h, "beta2"),
            eps: get(&h, "eps"),
            weight_decay: get(&h, "weight_decay"),
            adam_w_mode: flag(&h, "adam_w_mode"),
            bias_correction: flag(&h, "bias_correction"),
            amsgrad: false,
        }
        .into(),
        "FusedLAMB" => FusedLamb {
            beta1: get(&h, "beta1"),
            beta2: get(&h, "beta2"),
            eps: get(&h, "eps"),
            weight_decay: get(&h, "weight_decay"),
            bias_correction: flag(&h, "bias_correction"),
            adam_w_mode: flag(&h, "adam_w_mode"),
            grad_averaging: flag(&h, "grad_averaging"),
            max_grad_norm: get(&h, "max_grad_norm"),
            use_nvlamb: flag(&h, "use_nvlamb"),
            amsgrad: false,
        }
        .into(),
        "FusedNovoGrad" => FusedNovoGrad {
            beta1: get(&h, "beta1"),
            beta2: get(&h, "beta2"),
            eps: get(&h, "eps"),
            weight_decay: get(&h, "weight_decay"),
            bias_correction: flag(&h, "bias_correction"),
            reg_inside_moment: flag(&h, "reg_inside_moment"),
            grad_averaging: flag(&h, "grad_averaging"),
            norm_type: if get(&h, "norm_type") == 2.0 { NovoGradNorm::L2 } else { NovoGradNorm::Inf },
            init_zero: flag(&h, "init_zero"),
            amsgrad: false,
        }
        .into(),
        "FusedAdagrad" => FusedAdagrad {
            eps: get(&h, "eps"),
            weight_decay: get(&h, "weight_decay"),
            adagrad_w_mode: flag(&h, "adagrad_w_mode"),
        }
        .into(),
        other => panic!("unknown optimizer {other}"),
    }
}

/// The two groups: "a" and "b" with the optimizer's values, "c" with its own learning rate
/// and the hyper-parameters that differ from group 0's.
fn groups(case: &Value) -> Vec<ParamGroup> {
    let (g0, g1) = (hyper(&case["param_groups"][0]), hyper(&case["param_groups"][1]));
    let mut second = ParamGroup::names(&["c"]).lr(case["param_groups"][1]["lr"].as_f64().unwrap());
    for (k, v) in &g1 {
        if get(&g0, k).to_bits() != v.to_bits() {
            second = second.set(k, *v);
        }
    }
    vec![ParamGroup::names(&["a", "b"]), second]
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Variant {
    Fp32,
    O2,
}

/// A model (the case's parameters at `p0`), its Amp and optimizer.
struct Setup {
    vs: VarStore,
    amp: Amp,
    opt: AmpOptimizer,
}

fn setup(fx: &Fixture, case: &Value, prefix: &str, variant: Variant) -> Setup {
    let shapes = shapes(case);
    let vs = VarStore::new(Device::Cpu);
    for ((n, _), t) in shapes.iter().zip(split(fx.get(&format!("{prefix}p0")), &shapes)) {
        let _ = vs.root().var_copy(n, &t);
    }
    let level = if variant == Variant::Fp32 { OptLevel::O0 } else { OptLevel::O2 };
    let amp = Amp::new(&AmpConfig::new(level).verbosity(0)).unwrap();
    let _model = amp.cast_model(&vs, ()).unwrap();
    let lr0 = case["param_groups"][0]["lr"].as_f64().unwrap();
    let opt = amp.optimizer_groups(&vs, config(case), lr0, &groups(case)).unwrap();
    assert_eq!(opt.param_names(), ["a", "b", "c"], "{prefix}: parameter order");
    Setup { vs, amp, opt }
}

/// Runs steps `from..to` on `s`, comparing every step's parameters with the fixture; returns
/// the mismatches (empty = bit for bit).
fn run_steps(fx: &Fixture, case: &Value, prefix: &str, s: &mut Setup, from: i64, to: i64) -> Vec<String> {
    let shapes = shapes(case);
    let names: Vec<String> = shapes.iter().map(|(n, _)| n.clone()).collect();
    let vars = s.vs.variables();
    let mut failures = Vec::new();
    for step in from..to {
        let ks = split(&fx.get(&format!("{prefix}k")).get(step), &shapes);
        s.opt.zero_grad().unwrap();
        let loss = names
            .iter()
            .zip(&ks)
            .map(|(n, k)| (vars[n].to_kind(Kind::Float) * k.to_kind(Kind::Float)).sum(Kind::Float))
            .reduce(|a, b| a + b)
            .unwrap();
        let out = s.amp.scale_loss(&loss, &mut [&mut s.opt], |l| l.backward()).unwrap();
        assert!(!out.overflow, "{prefix}: unexpected overflow at step {step}");
        assert!(s.opt.step().unwrap().stepped(), "{prefix}: step {step} was skipped");
        let want = split(&fx.get(&format!("{prefix}p")).get(step), &shapes);
        for ((n, got), want) in names.iter().zip(s.opt.master_params()).zip(&want) {
            if !bits_equal(&got, want) {
                failures.push(format!("{prefix} step {step} {n}: {}", describe_diff(&got, want)));
            }
            if got.kind() == Kind::Float
                && vars[n].kind() == Kind::Half
                && !bits_equal(&vars[n], &want.to_kind(Kind::Half))
            {
                failures.push(format!("{prefix} step {step} {n}: the fp16 model is not the rounded master"));
            }
        }
        if !failures.is_empty() {
            return failures; // later steps only repeat the divergence
        }
    }
    failures
}

/// The final optimizer state, read back from a checkpoint, against the fixture's.
fn check_state(fx: &Fixture, case: &Value, prefix: &str, s: &Setup) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    save_checkpoint(&path, &s.vs, &[&s.opt], &s.amp).unwrap();
    let ckpt = Fixture::read(&path);
    let mut failures = Vec::new();
    let buffers: Vec<&str> = fx.tensors.keys().filter_map(|k| k.strip_prefix(&format!("{prefix}state/"))).collect();
    let stateless = case["optimizer"] == "FusedSGD" && case["param_groups"][0]["momentum"] == 0.0;
    assert!(!buffers.is_empty() || stateless, "{prefix}: fixture has no state");
    for buf in buffers {
        let want = fx.get(&format!("{prefix}state/{buf}"));
        let mut at = 0;
        for (n, _) in shapes(case) {
            let key = format!("optimizer0/{n}/{buf}");
            if !ckpt.has(&key) {
                failures.push(format!("{prefix} state {n}/{buf}: missing from tch-amp's state"));
                continue;
            }
            let got = ckpt.get(&key);
            let len = got.numel() as i64;
            let want = want.narrow(0, at, len).reshape(got.size());
            at += len;
            if !bits_equal(got, &want) {
                failures.push(format!("{prefix} state {n}/{buf}: {}", describe_diff(got, &want)));
            }
        }
    }
    failures
}

fn prefix(case: &Value, variant: Variant) -> String {
    let tag = if variant == Variant::Fp32 { "fp32" } else { "o2" };
    format!("{}/{tag}/", case["name"].as_str().unwrap())
}

fn cases(fx: &Fixture) -> Vec<Value> {
    let cases = fx.meta_json("cases").as_array().unwrap().clone();
    assert_eq!(cases.len(), CASES, "fixture cases");
    cases
}

fn run_all(variant: Variant) {
    let fx = fixture();
    let mut failures = Vec::new();
    for case in cases(&fx) {
        let prefix = prefix(&case, variant);
        let steps = case["steps"].as_i64().unwrap();
        assert!(steps >= 10);
        let mut s = setup(&fx, &case, &prefix, variant);
        let mut f = run_steps(&fx, &case, &prefix, &mut s, 0, steps);
        if f.is_empty() {
            f = check_state(&fx, &case, &prefix, &s);
        }
        if f.is_empty() {
            println!("{prefix}: {steps} steps bit for bit");
        }
        failures.extend(f);
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn fp32_parameters_match_the_apex_reference_bit_for_bit() {
    run_all(Variant::Fp32);
}

#[test]
fn fp32_masters_of_fp16_parameters_match_the_apex_reference_bit_for_bit() {
    run_all(Variant::O2);
}

/// Every case saved after 6 steps and resumed into a fresh VarStore, Amp and optimizer (built
/// the same way) continues with the reference's bits: the checkpoint holds every state tensor
/// (NovoGrad's per-tensor norm included), the groups' hyper-parameters and step counts
/// (Apex's bias corrections read the group's step) and the masters.
#[test]
fn checkpoint_round_trip_continues_bit_for_bit() {
    let fx = fixture();
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for variant in [Variant::Fp32, Variant::O2] {
        for case in cases(&fx) {
            let prefix = prefix(&case, variant);
            let steps = case["steps"].as_i64().unwrap();
            let mut first = setup(&fx, &case, &prefix, variant);
            let mut f = run_steps(&fx, &case, &prefix, &mut first, 0, SAVE_AT);
            let path = dir.path().join(format!("{}.safetensors", prefix.replace('/', "_")));
            save_checkpoint(&path, &first.vs, &[&first.opt], &first.amp).unwrap();
            drop(first);
            // A fresh process's view: the initial weights, no state, loaded from the file.
            let mut resumed = setup(&fx, &case, &prefix, variant);
            load_checkpoint(&path, &resumed.vs, &mut [&mut resumed.opt], &mut resumed.amp).unwrap();
            if f.is_empty() {
                f = run_steps(&fx, &case, &prefix, &mut resumed, SAVE_AT, steps);
            }
            if f.is_empty() {
                f = check_state(&fx, &case, &prefix, &resumed);
            }
            failures.extend(f);
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

/// `amsgrad=True` is refused as Apex refuses it ("FusedAdam does not support the AMSGrad
/// variant."), with the typed error naming the option and no optimizer made.
#[test]
fn amsgrad_is_refused_with_a_typed_error() {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var_copy("w", &Tensor::from_slice(&[1.0f32, 2.0]));
    let amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let configs: [OptimizerConfig; 3] = [
        FusedAdam { amsgrad: true, ..Default::default() }.into(),
        FusedLamb { amsgrad: true, ..Default::default() }.into(),
        FusedNovoGrad { amsgrad: true, ..Default::default() }.into(),
    ];
    for cfg in configs {
        match amp.optimizer(&vs, cfg, 1e-3) {
            Err(AmpError::Config(ConfigError::InvalidOption { option: "amsgrad", .. })) => {}
            other => panic!("{cfg:?}: {other:?}"),
        }
    }
}

/// Apex reads `adam_w_mode`, LAMB's `max_grad_norm` and `use_nvlamb`, NovoGrad's
/// `reg_inside_moment`, Adagrad's `adagrad_w_mode` and SGD's `wd_after_momentum` from the
/// optimizer, not from its groups: a group that sets one is refused (typed), as is a value
/// Apex's constructors refuse.
#[test]
fn optimizer_wide_options_and_bad_values_are_refused() {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var_copy("w", &Tensor::from_slice(&[1.0f32, 2.0]));
    let _ = vs.root().var_copy("b", &Tensor::from_slice(&[0.5f32]));
    let amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    // Each set to the other value than the optimizer's.
    let wide: [(OptimizerConfig, &str, f64); 6] = [
        (FusedAdam::default().into(), "adam_w_mode", 0.0),
        (FusedLamb::default().into(), "use_nvlamb", 1.0),
        (FusedLamb::default().into(), "max_grad_norm", 2.0),
        (FusedNovoGrad::default().into(), "reg_inside_moment", 1.0),
        (FusedAdagrad::default().into(), "adagrad_w_mode", 1.0),
        (FusedSgd::default().into(), "wd_after_momentum", 1.0),
    ];
    for (cfg, key, value) in wide {
        let groups = [ParamGroup::names(&["w"]), ParamGroup::rest().set(key, value)];
        match amp.optimizer_groups(&vs, cfg, 1e-3, &groups) {
            Err(AmpError::Config(ConfigError::InvalidOption { option: "param group", value, .. })) => {
                assert!(value.contains(key))
            }
            other => panic!("{key}: {other:?}"),
        }
    }
    match amp.optimizer(&vs, FusedLamb { max_grad_norm: 0.0, ..Default::default() }, 1e-3) {
        Err(AmpError::Config(ConfigError::InvalidOption { option: "max_grad_norm", .. })) => {}
        other => panic!("max_grad_norm 0: {other:?}"),
    }
    match amp.optimizer(&vs, FusedAdam { beta1: 1.0, ..Default::default() }, 1e-3) {
        Err(AmpError::Config(ConfigError::InvalidOption { option: "beta1", .. })) => {}
        other => panic!("beta1 1: {other:?}"),
    }
    let bad_norm = [ParamGroup::all().set("norm_type", 1.0)];
    match amp.optimizer_groups(&vs, FusedNovoGrad::default(), 1e-3, &bad_norm) {
        Err(AmpError::Config(ConfigError::InvalidOption { option: "norm_type", .. })) => {}
        other => panic!("norm_type 1: {other:?}"),
    }
}
