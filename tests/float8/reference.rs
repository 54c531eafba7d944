//! The harness of the bit-for-bit float8 tests (bitwise.rs here, tests/cuda/float8.rs): runs a
//! case of scripts/reference/float8_reference.py on a device and compares per step the output,
//! the loss, the gradients of the input and of every parameter, every scale, the
//! delayed-scaling state and the parameters after SGD (torch.optim.SGD, momentum 0.9, through
//! tch-amp's O0 optimizer).
use tch::nn::{Module, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::float8::Float8Training;
use tch_amp::Autocast;
use tch_amp::{Amp, AmpConfig, AmpModel, AmpOptimizer, CpuKernels, LossScale, OptLevel};

use super::models::{training, Model};
use crate::common::reference::{bits_equal, describe_diff, Fixture};

/// Copies the case's initial parameters into `vs` (cast to the variables' dtype first where
/// the case runs bf16: the fixture's are bf16 then).
pub fn load_init(fx: &Fixture, case: &str, vs: &VarStore) {
    let _g = tch::no_grad_guard();
    for (name, var) in vs.variables() {
        let want = fx.get(&format!("{case}/init/{name}"));
        var.shallow_clone().copy_(want);
    }
}

/// One forward and backward pass (through `scale_loss` when there is an optimizer); returns
/// the output and the loss.
pub fn step(
    run: Run<'_>,
    x: &Tensor,
    target: &Tensor,
    autocast: bool,
    opt: Option<(&mut Amp, &mut AmpOptimizer)>,
) -> (Tensor, Tensor) {
    let Run { device, model, io, .. } = run;
    let y = if let Some(io) = io {
        io.cast_output(&model.forward(&io.cast_input(x)))
    } else if autocast {
        Autocast::new(device).dtype(Kind::BFloat16).cpu_kernels(CpuKernels::Native).run(|| model.forward(x)).unwrap()
    } else {
        model.forward(x)
    };
    let loss = y.to_kind(Kind::Float).mse_loss(target, tch::Reduction::Mean);
    match opt {
        Some((amp, opt)) => {
            opt.zero_grad().unwrap();
            amp.scale_loss(&loss, &mut [&mut *opt], |l| l.backward()).unwrap();
        }
        None => loss.backward(),
    }
    (y, loss)
}

fn check(failures: &mut Vec<String>, what: &str, got: &Tensor, want: &Tensor) {
    let got = got.to_device(Device::Cpu);
    let got = if got.size() != want.size() && got.numel() == want.numel() {
        got.reshape(want.size())
    } else {
        got.shallow_clone()
    };
    if !bits_equal(&got, want) {
        failures.push(format!("{what}: {}", describe_diff(&got, want)));
    }
}

/// The delayed-scaling tensor at `layer/role/key` of a state dict.
pub fn state_tensor(fp8: &Float8Training, layer: &str, role: &str, key: &str) -> Tensor {
    let state = fp8.state_dict();
    state.get(layer).unwrap().get(role).unwrap().get(key).unwrap().as_tensor().unwrap().shallow_clone()
}

/// What a case runs on.
#[derive(Clone, Copy)]
pub struct Run<'a> {
    pub device: Device,
    pub vs: &'a VarStore,
    pub model: &'a Model,
    pub fp8: &'a Float8Training,
    /// O2's input and output casts (None under O0).
    pub io: Option<&'a AmpModel<()>>,
}

/// Runs `case` from step `from` (with the model, store and training given), comparing every
/// step with the fixture; returns the mismatches.
pub fn run_steps(
    fx: &Fixture,
    case: &serde_json::Value,
    run: Run<'_>,
    mut opt: Option<(&mut Amp, &mut AmpOptimizer)>,
    steps: std::ops::Range<i64>,
) -> Vec<String> {
    let Run { device, vs, fp8, io, .. } = run;
    let name = case["name"].as_str().unwrap();
    let autocast = case["mode"] == "autocast";
    let mut failures = Vec::new();
    let vars = vs.variables();
    for s in steps {
        let pre = format!("{name}/step{s}/");
        let x = fx.get(&format!("{pre}x")).copy().to_device(device).set_requires_grad(true);
        let target = &fx.get(&format!("{pre}target")).to_device(device);
        let (y, loss) = step(run, &x, target, autocast, opt.as_mut().map(|(a, o)| (&mut **a, &mut **o)));
        check(&mut failures, &format!("{pre}y"), &y, fx.get(&format!("{pre}y")));
        check(&mut failures, &format!("{pre}loss"), &loss.reshape([1]), fx.get(&format!("{pre}loss")));
        check(&mut failures, &format!("{pre}x_grad"), &x.grad(), fx.get(&format!("{pre}x_grad")));
        // Under O2 the gradients compared are the fp32 masters'.
        let grads: Vec<(String, Tensor)> = match (&opt, io) {
            (Some((_, o)), Some(_)) => {
                o.param_names().into_iter().map(String::from).zip(o.master_params().iter().map(Tensor::grad)).collect()
            }
            _ => vars.iter().map(|(n, v)| (n.clone(), v.grad())).collect(),
        };
        for (n, g) in &grads {
            check(&mut failures, &format!("{pre}grad/{n}"), g, fx.get(&format!("{pre}grad/{n}")));
        }
        if let Some((_, opt)) = opt.as_mut() {
            assert!(opt.step().unwrap().stepped(), "{pre}: the step was skipped");
            if io.is_some() {
                for (n, m) in opt.param_names().into_iter().zip(opt.master_params()) {
                    check(&mut failures, &format!("{pre}master/{n}"), &m, fx.get(&format!("{pre}master/{n}")));
                }
            }
        }
        for (n, v) in &vars {
            check(&mut failures, &format!("{pre}param/{n}"), v, fx.get(&format!("{pre}param/{n}")));
        }
        let scale_prefix = format!("{pre}scale/");
        let mut scale_keys: Vec<&String> = fx.tensors.keys().filter(|k| k.starts_with(&scale_prefix)).collect();
        scale_keys.sort();
        assert!(!scale_keys.is_empty(), "{pre}: the fixture has no scales");
        for key in scale_keys {
            let (layer, role) = key[scale_prefix.len()..].split_once('/').unwrap();
            let scales = fp8.scales(layer).unwrap_or_else(|| panic!("{layer} is not converted"));
            let got = match role {
                "input" => scales.input,
                "weight" => scales.weight,
                "grad_output" => scales.grad_output,
                "weight_for_grad_input" => scales.weight_for_grad_input,
                "grad_output_for_grad_weight" => scales.grad_output_for_grad_weight,
                "input_for_grad_weight" => scales.input_for_grad_weight,
                other => panic!("unknown role {other}"),
            };
            match got {
                Some(t) => check(&mut failures, key, &t, fx.get(key)),
                None => failures.push(format!("{key}: tch-amp recorded no scale")),
            }
        }
        if case["kind"] == "delayed" {
            let state_prefix = format!("{pre}state/");
            for key in fx.tensors.keys().filter(|k| k.starts_with(&state_prefix)) {
                let parts: Vec<&str> = key[state_prefix.len()..].split('/').collect();
                check(&mut failures, key, &state_tensor(fp8, parts[0], parts[1], parts[2]), fx.get(key));
            }
        }
        if !failures.is_empty() {
            return failures; // later steps only repeat the divergence
        }
    }
    failures
}

/// Builds the case's model, loads its initial values and runs every step.
fn run_case(device: Device, fx: &Fixture, case: &serde_json::Value) -> Vec<String> {
    let name = case["name"].as_str().unwrap();
    let mut vs = VarStore::new(device);
    let fp8 = training(case);
    let model = Model::new(case["model"].as_str().unwrap(), &vs.root(), &fp8);
    let (converted, skipped) = model.layers();
    let report = fp8.report();
    assert_eq!(report.converted, converted, "{name}: converted layers");
    assert_eq!(report.skipped.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), skipped, "{name}: skipped");
    if case["mode"] == "bf16" {
        vs.bfloat16();
    }
    load_init(fx, name, &vs);
    let steps = 0..case["steps"].as_i64().unwrap();
    let run = Run { device, vs: &vs, model: &model, fp8: &fp8, io: None };
    if case["optimizer"].as_bool().unwrap() {
        // O2 as Apex: an fp16 model with fp32 masters, a static loss scale of 128, libtorch's
        // fp16 kernels for the layers left in high precision (as PyTorch runs them).
        let o2 = case["mode"] == "o2";
        let config = if o2 {
            AmpConfig::new(OptLevel::O2).loss_scale(LossScale::Static(128.0)).cpu_kernels(CpuKernels::Native)
        } else {
            AmpConfig::new(OptLevel::O0)
        };
        let mut amp = Amp::new(&config.verbosity(0)).unwrap();
        let io = amp.cast_model(&vs, ()).unwrap();
        let sgd = tch::nn::Sgd { momentum: 0.9, ..Default::default() };
        let mut opt = amp.optimizer(&vs, sgd, 0.05).unwrap();
        let run = Run { io: o2.then_some(&io), ..run };
        run_steps(fx, case, run, Some((&mut amp, &mut opt)), steps)
    } else {
        run_steps(fx, case, run, None, steps)
    }
}

/// Runs the fixture's cases that `filter` keeps on `device` (`expected` of them) and fails with
/// every mismatch.
pub fn run_cases(device: Device, fx: &Fixture, filter: impl Fn(&serde_json::Value) -> bool, expected: usize) {
    tch::set_num_threads(1);
    let cases = fx.meta_json("cases");
    let mut failures = Vec::new();
    let mut ran = 0;
    for case in cases.as_array().unwrap().iter().filter(|c| filter(c)) {
        let f = run_case(device, fx, case);
        if f.is_empty() {
            println!("{}: bit for bit", case["name"]);
        }
        failures.extend(f);
        ran += 1;
    }
    assert_eq!(ran, expected, "cases run");
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}
