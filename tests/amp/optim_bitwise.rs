//! tch-amp's optimizers against torch.optim bit for bit: 30 cases (SGD with momentum,
//! dampening, Nesterov, weight decay, maximize; Adam and AdamW with amsgrad, weight decay,
//! maximize, and fused; RMSprop with alpha, momentum, centered, weight decay, maximize), two
//! parameter groups with different learning rates, 20 steps each, for fp32 parameters (O0) and
//! for the fp32 masters of fp16 parameters (O2, gradients through a dynamic loss scale of
//! 65536). Every step's parameters and the final optimizer state must equal PyTorch's
//! (`Tensor::equal` on the bits).
//!
//! The expected values are written by scripts/reference/optim_fixtures.py (PyTorch 2.13.0,
//! CPU; only element-wise kernels, so they do not depend on the thread count), run by the test
//! on the machine that runs it ([`Fixture::generated`]: they depend on the CPU's vector ISA).
use crate::common::reference::{bits_equal, case_shapes as shapes, describe_diff, split_flat as split, Fixture};
use serde_json::Value;
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::error::ConfigError;
use tch_amp::{Amp, AmpConfig, OptLevel, OptimizerConfig};

fn fixture() -> Fixture {
    Fixture::generated("optim_fixtures.py")
}

fn f(case: &Value, key: &str) -> f64 {
    case[key].as_f64().unwrap_or_else(|| panic!("{}: {key} is not a number", case["name"]))
}

fn b(case: &Value, key: &str) -> bool {
    case[key].as_bool().unwrap_or_else(|| panic!("{}: {key} is not a bool", case["name"]))
}

/// The tch-amp configuration of a case, every hyper-parameter from the fixture (tch's defaults
/// differ from torch's).
fn config(case: &Value) -> OptimizerConfig {
    let cfg: OptimizerConfig = match case["optimizer"].as_str().unwrap() {
        "SGD" => nn::Sgd {
            momentum: f(case, "momentum"),
            dampening: f(case, "dampening"),
            wd: f(case, "weight_decay"),
            nesterov: b(case, "nesterov"),
        }
        .into(),
        kind @ ("Adam" | "AdamW") => {
            let (beta1, beta2) = (case["betas"][0].as_f64().unwrap(), case["betas"][1].as_f64().unwrap());
            let (wd, eps, amsgrad) = (f(case, "weight_decay"), f(case, "eps"), b(case, "amsgrad"));
            let cfg: OptimizerConfig = if kind == "Adam" {
                nn::Adam { beta1, beta2, wd, eps, amsgrad }.into()
            } else {
                nn::AdamW { beta1, beta2, wd, eps, amsgrad }.into()
            };
            cfg.fused(b(case, "fused"))
        }
        "RMSprop" => nn::RmsProp {
            alpha: f(case, "alpha"),
            eps: f(case, "eps"),
            wd: f(case, "weight_decay"),
            momentum: f(case, "momentum"),
            centered: b(case, "centered"),
        }
        .into(),
        other => panic!("unknown optimizer {other}"),
    };
    cfg.maximize(b(case, "maximize"))
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Variant {
    /// fp32 parameters, O0.
    Fp32,
    /// fp16 parameters with fp32 masters, O2 (dynamic loss scale).
    O2,
}

/// Runs one case; returns the mismatches found (empty = bit for bit).
fn run_case(fx: &Fixture, case: &Value, variant: Variant) -> Vec<String> {
    let name = case["name"].as_str().unwrap();
    let tag = match variant {
        Variant::Fp32 => "fp32",
        Variant::O2 => "o2",
    };
    let prefix = format!("{name}/{tag}/");
    let shapes = shapes(case);
    let (lr0, lr1) = (case["lr"][0].as_f64().unwrap(), case["lr"][1].as_f64().unwrap());
    let steps = case["steps"].as_i64().unwrap();

    let vs = VarStore::new(Device::Cpu);
    let p0 = split(fx.get(&format!("{prefix}p0")), &shapes);
    for ((n, _), t) in shapes.iter().zip(&p0) {
        let group = case["groups"][n.as_str()].as_u64().unwrap() as usize;
        let _ = vs.root().set_group(group).var_copy(n, t);
    }
    let level = if variant == Variant::Fp32 { OptLevel::O0 } else { OptLevel::O2 };
    let mut amp = Amp::new(&AmpConfig::new(level).verbosity(0)).unwrap();
    let _model = amp.cast_model(&vs, ()).unwrap();
    let mut opt = amp.optimizer(&vs, config(case), lr0).unwrap();
    opt.set_lr_group(1, lr1).unwrap();
    let names: Vec<String> = shapes.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(opt.param_names(), names, "{prefix}: parameter order");

    let mut failures = Vec::new();
    let vars = vs.variables();
    for step in 0..steps {
        let ks = split(&fx.get(&format!("{prefix}k")).get(step), &shapes);
        opt.zero_grad().unwrap();
        // fp32: d/dp sum(p * k) = k exactly. O2: the fp32 product scale * k reaches each fp16
        // variable rounded once to fp16 (exactly), as in the script.
        let loss = names
            .iter()
            .zip(&ks)
            .map(|(n, k)| (vars[n].to_kind(Kind::Float) * k.to_kind(Kind::Float)).sum(Kind::Float))
            .reduce(|a, b| a + b)
            .unwrap();
        let out = amp.scale_loss(&loss, &mut [&mut opt], |l| l.backward()).unwrap();
        assert!(!out.overflow, "{prefix}: unexpected overflow at step {step}");
        assert!(opt.step().unwrap().stepped(), "{prefix}: step {step} was skipped");
        let want = split(&fx.get(&format!("{prefix}p")).get(step), &shapes);
        for ((n, got), want) in names.iter().zip(opt.master_params()).zip(&want) {
            if !bits_equal(&got, want) {
                failures.push(format!("{prefix} step {step} {n}: {}", describe_diff(&got, want)));
            }
            if variant == Variant::O2 && !bits_equal(&vars[n], &want.to_kind(Kind::Half)) {
                failures.push(format!("{prefix} step {step} {n}: the fp16 model is not the rounded master"));
            }
        }
        if !failures.is_empty() {
            return failures; // later steps only repeat the divergence
        }
    }

    // The optimizer state after the last step, read back from a checkpoint.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    tch_amp::save_checkpoint(&path, &vs, &[&opt], &amp).unwrap();
    let ckpt = Fixture::read(&path);
    let buffers: Vec<&str> = fx
        .tensors
        .keys()
        .filter_map(|k| k.strip_prefix(&format!("{prefix}state/")))
        .map(|s| s.split('/').next().unwrap())
        .collect();
    assert!(!buffers.is_empty() || case["optimizer"] == "SGD", "{prefix}: fixture has no state");
    for buf in buffers {
        let want = split(fx.get(&format!("{prefix}state/{buf}")), &shapes);
        for (n, want) in names.iter().zip(&want) {
            let key = format!("optimizer0/{n}/{buf}");
            if !ckpt.has(&key) {
                failures.push(format!("{prefix} state {n}/{buf}: missing from tch-amp's state"));
            } else if !bits_equal(ckpt.get(&key), want) {
                failures.push(format!("{prefix} state {n}/{buf}: {}", describe_diff(ckpt.get(&key), want)));
            }
        }
    }
    failures
}

fn run_all(variant: Variant) {
    let fx = fixture();
    let cases = fx.meta_json("cases");
    let cases = cases.as_array().unwrap();
    assert_eq!(cases.len(), 30, "fixture cases");
    let mut failures = Vec::new();
    for case in cases {
        let f = run_case(&fx, case, variant);
        if f.is_empty() {
            println!("{} {variant:?}: bit for bit", case["name"]);
        }
        failures.extend(f);
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn fp32_parameters_match_torch_optim_bit_for_bit() {
    run_all(Variant::Fp32);
}

#[test]
fn fp32_masters_of_fp16_parameters_match_torch_optim_bit_for_bit() {
    run_all(Variant::O2);
}

/// `fused(true)` is refused for SGD and RMSprop (torch has no fused RMSprop; tch-amp has no
/// fused SGD kernel), with the typed error and no optimizer.
#[test]
fn fused_is_only_for_adam_and_adamw() {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var_copy("w", &Tensor::from_slice(&[1.0f32, 2.0]));
    let amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    for cfg in [OptimizerConfig::from(nn::sgd(0.9, 0.0, 0.0, false)), nn::rms_prop(0.99, 1e-8, 0.0, 0.0, false).into()]
    {
        match amp.optimizer(&vs, cfg.fused(true), 0.1) {
            Err(tch_amp::AmpError::Config(ConfigError::InvalidOption { option: "fused", .. })) => {}
            other => panic!("fused {cfg:?}: {other:?}"),
        }
    }
    assert!(amp.optimizer(&vs, OptimizerConfig::from(nn::adam(0.9, 0.999, 0.0)).fused(true), 0.1).is_ok());
}
