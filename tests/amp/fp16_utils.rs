//! The legacy API (`tch_amp::fp16_utils`, Apex's `apex.fp16_utils`).
//!
//! - `Fp16Optimizer` against `scripts/reference/fp16_optimizer_reference.py` (our Python
//!   re-implementation of FP16_Optimizer's documented algorithm, torch 2.13.0, CPU), run by the
//!   test on the machine that runs it (`Fixture::generated`): three cases (SGD with momentum and weight
//!   decay under a dynamic scale with window 3; Adam with init_scale 2^32 capped at
//!   max_loss_scale 2^16 and min_loss_scale 2^10; SGD under a static scale of 128), 12 steps
//!   each with injected overflows (targets * 1e4) and two-loss steps
//!   (`backward_with(.., false)` twice, then `update_master_grads()`) and a step that leaves the
//!   bias out of the forward (its zeroed gradient still moves it through momentum and weight
//!   decay, as in Apex). Every step's scale
//!   before and after, overflow flag, clip norm (-1 on overflow), stepped flag, fp32 masters
//!   and fp32 parameter, and fp16 parameters must equal the reference bit for bit.
//! - Apex's tests/L0/run_fp16util (FP16Model keeps affine batch norms fp32, casts everything
//!   else, outputs fp16), for `fp16_model` and `network_to_half`.
//! - The manual recipe (`prep_param_lists`, flat or not, `model_grads_to_master_grads`,
//!   `master_params_to_model_params`, `to_python_float`, `clip_grad_norm`) from first
//!   principles; the state dict round trip; typed errors that change nothing.
use crate::common::reference::{bits_equal, describe_diff, Fixture};
use serde_json::Value;
use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::error::{ConfigError, StateError, UsageError};
use tch_amp::fp16_utils::{
    bn_convert_float, clip_grad_norm, convert_network, fp16_model, master_params_to_model_params,
    model_grads_to_master_grads, network_to_half, prep_param_lists, to_python_float, DynamicLossArgs, Fp16Optimizer,
    Fp16OptimizerOptions,
};
use tch_amp::AmpError;

fn fixture() -> Fixture {
    Fixture::generated("fp16_optimizer_reference.py")
}

/// The reference model: fc.weight fp16 [4, 8], fc.bias fp16 [4], gain fp32 [4], created in
/// that order, with the fixture's initial values.
fn model(fx: &Fixture, case: &str) -> VarStore {
    let vs = VarStore::new(Device::Cpu);
    let root = vs.root();
    let fc = &root / "fc";
    let make = |p: &nn::Path, name: &str, key: &str| {
        let init = fx.get(&format!("{case}/init/{key}"));
        let v = p.var_copy(name, &init.to_kind(Kind::Float));
        if init.kind() == Kind::Half {
            let _g = tch::no_grad_guard();
            v.shallow_clone().set_data(&init.detach());
        }
        v
    };
    let _ = make(&fc, "weight", "fc.weight");
    let _ = make(&fc, "bias", "fc.bias");
    let _ = make(&root, "gain", "gain");
    vs
}

fn forward(vs: &VarStore, x: &Tensor, y: &Tensor) -> Tensor {
    forward_with(vs, x, y, true)
}

fn forward_with(vs: &VarStore, x: &Tensor, y: &Tensor, bias: bool) -> Tensor {
    let v = vs.variables();
    let (w, b, gain) = (&v["fc.weight"], &v["fc.bias"], &v["gain"]);
    let mut h = (x.to_kind(Kind::Half).unsqueeze(1) * w.unsqueeze(0)).sum_dim_intlist(-1, false, None::<Kind>);
    if bias {
        h = &h + b;
    }
    (h.to_kind(Kind::Float) * gain).mse_loss(y, tch::Reduction::Mean)
}

fn options(case: &Value) -> Fp16OptimizerOptions {
    let o = Fp16OptimizerOptions::default().verbose(false);
    if case["dynamic"].as_bool().unwrap() {
        let mut a = DynamicLossArgs::default()
            .init_scale(case["init_scale"].as_f64().unwrap())
            .scale_window(case["scale_window"].as_u64().unwrap())
            .max_loss_scale(case["max_loss_scale"].as_f64().unwrap());
        if let Some(m) = case["min_loss_scale"].as_f64() {
            a = a.min_loss_scale(m);
        }
        o.dynamic_loss_scale(true).dynamic_loss_args(a)
    } else {
        o.static_loss_scale(case["static_loss_scale"].as_f64().unwrap())
    }
}

fn optimizer(vs: &VarStore, case: &Value) -> Fp16Optimizer {
    let lr = case["lr"].as_f64().unwrap();
    let wd = case["weight_decay"].as_f64().unwrap();
    let cfg: tch_amp::OptimizerConfig = match case["optimizer"].as_str().unwrap() {
        "SGD" => nn::Sgd { momentum: case["momentum"].as_f64().unwrap(), wd, ..Default::default() }.into(),
        "Adam" => nn::Adam {
            beta1: case["betas"][0].as_f64().unwrap(),
            beta2: case["betas"][1].as_f64().unwrap(),
            eps: case["eps"].as_f64().unwrap(),
            wd,
            amsgrad: false,
        }
        .into(),
        other => panic!("unknown optimizer {other}"),
    };
    Fp16Optimizer::new(vs, cfg, lr, options(case)).unwrap()
}

fn cases(fx: &Fixture) -> Vec<Value> {
    fx.meta_json("cases").as_array().unwrap().clone()
}

fn plan(fx: &Fixture, case: &Value) -> Vec<String> {
    let key = if case["dynamic"].as_bool().unwrap() { "plan" } else { "static_plan" };
    fx.meta_json(key).as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
}

/// What one step gave: scale before/after, overflow, norm, stepped, fp32 values, fp16 values.
struct StepRecord {
    scale_before: f64,
    scale_after: f64,
    overflow: bool,
    norm: f64,
    stepped: bool,
    p32: Tensor,
    p16: Tensor,
}

/// One step of the reference's loop.
fn train_step(vs: &VarStore, opt: &mut Fp16Optimizer, fx: &Fixture, case: &Value, s: usize, kind: &str) -> StepRecord {
    let name = case["name"].as_str().unwrap();
    let x = fx.get(&format!("{name}/x")).get(s as i64);
    let y = fx.get(&format!("{name}/y")).get(s as i64);
    let scale_before = opt.loss_scale();
    opt.zero_grad().unwrap();
    if kind == "two" {
        let n = x.size()[0];
        opt.backward_with(&forward(vs, &x.narrow(0, 0, n / 2), &y.narrow(0, 0, n / 2)), false).unwrap();
        opt.backward_with(&forward(vs, &x.narrow(0, n / 2, n / 2), &y.narrow(0, n / 2, n / 2)), false).unwrap();
        opt.update_master_grads().unwrap();
    } else {
        opt.backward(&forward_with(vs, &x, &y, kind != "nobias")).unwrap();
    }
    let norm = opt.clip_master_grads(case["max_norm"].as_f64().unwrap()).unwrap();
    let stepped = opt.step().unwrap().stepped();
    let masters = opt.master_params();
    let v = vs.variables();
    StepRecord {
        scale_before,
        scale_after: opt.loss_scale(),
        overflow: opt.overflow(),
        norm,
        stepped,
        p32: Tensor::cat(&masters.iter().map(|t| t.flatten(0, -1)).collect::<Vec<_>>(), 0),
        p16: Tensor::cat(&[v["fc.weight"].flatten(0, -1), v["fc.bias"].flatten(0, -1)], 0),
    }
}

fn check_step(fx: &Fixture, case: &Value, s: usize, got: &StepRecord) {
    let name = case["name"].as_str().unwrap();
    let scalar = |k: &str| fx.get(&format!("{name}/{k}")).double_value(&[s as i64]);
    assert_eq!(got.scale_before, scalar("scale_before"), "{name} step {s}: scale before");
    assert_eq!(got.scale_after, scalar("scale_after"), "{name} step {s}: scale after");
    assert_eq!(got.overflow, scalar("overflow") == 1.0, "{name} step {s}: overflow");
    assert_eq!(got.stepped, scalar("stepped") == 1.0, "{name} step {s}: stepped");
    assert_eq!(
        got.norm.to_bits(),
        scalar("norm").to_bits(),
        "{name} step {s}: norm {} vs {}",
        got.norm,
        scalar("norm")
    );
    let want32 = fx.get(&format!("{name}/p32")).get(s as i64);
    assert!(bits_equal(&got.p32, &want32), "{name} step {s}: fp32 values {}", describe_diff(&got.p32, &want32));
    let want16 = fx.get(&format!("{name}/p16")).get(s as i64);
    assert!(bits_equal(&got.p16, &want16), "{name} step {s}: fp16 values {}", describe_diff(&got.p16, &want16));
}

#[test]
fn fp16_optimizer_matches_the_reference_bit_for_bit() {
    let fx = fixture();
    let mut overflows = 0;
    let mut growths = 0;
    for case in cases(&fx) {
        let name = case["name"].as_str().unwrap();
        let vs = model(&fx, name);
        let mut opt = optimizer(&vs, &case);
        assert_eq!(opt.param_names(), ["fc.weight", "fc.bias", "gain"], "Apex's order: creation order");
        for (s, kind) in plan(&fx, &case).iter().enumerate() {
            let got = train_step(&vs, &mut opt, &fx, &case, s, kind);
            check_step(&fx, &case, s, &got);
            overflows += usize::from(got.overflow);
            growths += usize::from(got.scale_after > got.scale_before);
        }
    }
    // The fixture exercises what it claims: skipped steps and scale growth.
    assert_eq!(overflows, 5, "overflows across the cases");
    assert!(growths >= 3, "scale growths across the cases: {growths}");
}

#[test]
fn fp16_optimizer_state_dict_round_trip_resumes_bit_for_bit() {
    let fx = fixture();
    let case = cases(&fx).into_iter().find(|c| c["name"] == "adam_dynamic").unwrap();
    let plan = plan(&fx, &case);
    let vs = model(&fx, "adam_dynamic");
    let mut opt = optimizer(&vs, &case);
    for (s, kind) in plan.iter().enumerate().take(6) {
        train_step(&vs, &mut opt, &fx, &case, s, kind);
    }
    let state = opt.state_dict().unwrap();
    assert_eq!(state.loss_scaler.loss_scale, opt.loss_scale());
    assert_eq!(state.loss_scaler.unskipped, opt.loss_scaler().unskipped());
    assert!(state.dynamic_loss_scale && !state.overflow && state.first_closure_call_this_step);
    assert_eq!(state.fp32_from_fp16.len(), 1);
    assert_eq!(state.fp32_from_fp16[0].len(), 2, "fc.weight and fc.bias have masters, gain does not");
    let weights: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(k, v)| (k, v.detach().copy())).collect();
    let mut continued = Vec::new();
    for (s, kind) in plan.iter().enumerate().skip(6) {
        continued.push(train_step(&vs, &mut opt, &fx, &case, s, kind));
    }
    // A fresh model and optimizer: the weights loaded first (as Apex expected), then the state.
    let vs2 = model(&fx, "adam_dynamic");
    {
        let _g = tch::no_grad_guard();
        let v2 = vs2.variables();
        for (k, t) in &weights {
            v2[k].shallow_clone().copy_(t);
        }
    }
    let mut opt2 = optimizer(&vs2, &case);
    opt2.load_state_dict(state).unwrap();
    for (i, (s, kind)) in plan.iter().enumerate().skip(6).enumerate() {
        let got = train_step(&vs2, &mut opt2, &fx, &case, s, kind);
        let want = &continued[i];
        assert_eq!(got.scale_after, want.scale_after, "step {s}");
        assert_eq!(got.stepped, want.stepped, "step {s}");
        assert!(bits_equal(&got.p32, &want.p32), "step {s}: {}", describe_diff(&got.p32, &want.p32));
        assert!(bits_equal(&got.p16, &want.p16), "step {s}");
        // and the reference agrees
        check_step(&fx, &case, s, &got);
    }
}

#[test]
fn fp16_optimizer_dynamic_loss_args_follow_apex() {
    let vs = VarStore::new(Device::Cpu);
    let _lin = nn::linear(vs.root() / "fc", 3, 2, Default::default());
    network_to_half(&vs, ()).unwrap();
    // amp's LossScaler: init_scale capped at max_loss_scale (2^24 by default).
    let dynamic = |a: DynamicLossArgs| {
        Fp16Optimizer::new(
            &vs,
            nn::Sgd::default(),
            0.1,
            Fp16OptimizerOptions::default().dynamic_loss_scale(true).dynamic_loss_args(a).verbose(false),
        )
    };
    assert_eq!(dynamic(DynamicLossArgs::default().init_scale(2f64.powi(32))).unwrap().loss_scale(), 16_777_216.0);
    assert_eq!(dynamic(DynamicLossArgs::default()).unwrap().loss_scale(), 65536.0);
    let plain =
        Fp16Optimizer::new(&vs, nn::Sgd::default(), 0.1, Fp16OptimizerOptions::default().verbose(false)).unwrap();
    assert_eq!(plain.loss_scale(), 1.0);
    assert!(!plain.dynamic_loss_scale());
    // Apex ignored scale_factor; a value other than 2 would not reproduce the Python run.
    let err = dynamic(DynamicLossArgs::default().scale_factor(4.0)).unwrap_err();
    assert!(matches!(err, AmpError::Config(ConfigError::InvalidOption { option: "scale_factor", .. })), "{err}");
    let err = dynamic(DynamicLossArgs::default().scale_window(0)).unwrap_err();
    assert!(matches!(err, AmpError::Config(ConfigError::InvalidOption { option: "scale_window", .. })), "{err}");
    let err = Fp16Optimizer::new(&vs, nn::Sgd::default(), 0.1, Fp16OptimizerOptions::default().static_loss_scale(0.0))
        .unwrap_err();
    assert!(matches!(err, AmpError::Config(ConfigError::InvalidOption { option: "static_loss_scale", .. })), "{err}");
}

#[test]
fn fp16_optimizer_bad_calls_are_typed_and_change_nothing() {
    let fx = fixture();
    let case = cases(&fx).into_iter().find(|c| c["name"] == "sgd_dynamic").unwrap();
    let vs = model(&fx, "sgd_dynamic");
    let mut opt = optimizer(&vs, &case);
    let before: Vec<Tensor> = opt.master_params().iter().map(|t| t.detach().copy()).collect();
    let unchanged =
        |opt: &Fp16Optimizer| opt.master_params().iter().zip(&before).all(|(a, b)| bits_equal(&a.detach(), b));
    // step before any backward
    assert!(matches!(opt.step(), Err(AmpError::Usage(UsageError::NoGradients))));
    assert!(unchanged(&opt));
    // step after backward_with(.., false) without update_master_grads
    let x = fx.get("sgd_dynamic/x").get(0);
    let y = fx.get("sgd_dynamic/y").get(0);
    opt.backward_with(&forward(&vs, &x, &y), false).unwrap();
    assert!(matches!(opt.step(), Err(AmpError::Usage(UsageError::CallOrder { .. }))));
    assert!(unchanged(&opt));
    opt.update_master_grads().unwrap();
    assert!(opt.step().unwrap().stepped());
    // a second step without a new backward
    assert!(matches!(opt.step(), Err(AmpError::Usage(UsageError::NoGradients))));
    // a loss that is not a scalar, or has no graph
    let err = opt.backward(&Tensor::ones([2], (Kind::Float, Device::Cpu))).unwrap_err();
    assert!(matches!(err, AmpError::Usage(UsageError::BadLoss { .. })), "{err}");
    let err = opt.backward(&Tensor::ones([], (Kind::Float, Device::Cpu))).unwrap_err();
    assert!(matches!(err, AmpError::Usage(UsageError::BadLoss { .. })), "{err}");

    // load_state_dict with a master of the wrong shape: an error, and nothing changes.
    let after: Vec<Tensor> = opt.master_params().iter().map(|t| t.detach().copy()).collect();
    let scale = opt.loss_scale();
    let mut state = opt.state_dict().unwrap();
    state.fp32_from_fp16[0][0] = Tensor::zeros([3, 8], (Kind::Float, Device::Cpu));
    state.loss_scaler.loss_scale = 4.0;
    let err = opt.load_state_dict(state).unwrap_err();
    assert!(matches!(err, AmpError::State(StateError::StateMismatch { .. })), "{err}");
    assert_eq!(opt.loss_scale(), scale);
    assert!(opt.master_params().iter().zip(&after).all(|(a, b)| bits_equal(&a.detach(), b)));
    // a scaler state that disagrees with dynamic_loss_scale
    let mut state = opt.state_dict().unwrap();
    state.dynamic_loss_scale = false;
    assert!(matches!(opt.load_state_dict(state), Err(AmpError::State(StateError::StateMismatch { .. }))));
    // a master holding NaN (checked by the optimizer record): nothing changes either
    let mut state = opt.state_dict().unwrap();
    state.fp32_from_fp16[0][1] = Tensor::full([4], f64::NAN, (Kind::Float, Device::Cpu));
    assert!(matches!(opt.load_state_dict(state), Err(AmpError::State(StateError::StateMismatch { .. }))));
    assert!(opt.master_params().iter().zip(&after).all(|(a, b)| bits_equal(&a.detach(), b)));

    // bf16 (or f64) trainable variables: Apex's TypeError
    let vs = VarStore::new(Device::Cpu);
    let _lin = nn::linear(vs.root() / "fc", 3, 2, Default::default());
    convert_network(&vs, Kind::BFloat16).unwrap();
    let err = Fp16Optimizer::new(&vs, nn::Sgd::default(), 0.1, Default::default()).unwrap_err();
    assert!(matches!(err, AmpError::Config(ConfigError::LegacyParamDtype { kind: Kind::BFloat16, .. })), "{err}");
}

/// Apex's tests/L0/run_fp16util: DummyNetWrapper (bn, dn.conv1, dn.bn1 without affine,
/// dn.db1/db2 = conv + affine bn).
#[derive(Debug)]
struct DummyNetWrapper {
    bn: nn::BatchNorm,
    conv1: nn::Conv2D,
    bn1: nn::BatchNorm,
    blocks: Vec<(nn::BatchNorm, nn::Conv2D)>,
}

impl DummyNetWrapper {
    fn new(p: &nn::Path) -> Self {
        let dn = p / "dn";
        let affine = nn::BatchNormConfig { affine: true, ..Default::default() };
        let block = |q: nn::Path| {
            (nn::batch_norm2d(&q / "bn", 10, affine), nn::conv2d(&q / "conv", 10, 10, 2, Default::default()))
        };
        Self {
            bn: nn::batch_norm2d(p / "bn", 3, affine),
            conv1: nn::conv2d(&dn / "conv1", 3, 10, 2, Default::default()),
            bn1: nn::batch_norm2d(&dn / "bn1", 10, nn::BatchNormConfig { affine: false, ..Default::default() }),
            blocks: vec![block(&dn / "db1"), block(&dn / "db2")],
        }
    }
}

impl ModuleT for DummyNetWrapper {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut out = self.bn1.forward_t(&xs.apply_t(&self.bn, train).apply(&self.conv1), train);
        for (bn, conv) in &self.blocks {
            out = out.apply_t(bn, train).apply(conv);
        }
        out
    }
}

fn check_run_fp16util(vs: &VarStore, out: &Tensor) {
    let exempted = ["bn.", "dn.db1.bn.", "dn.db2.bn."];
    let vars = vs.variables();
    assert!(vars.len() >= 18, "every parameter and buffer is covered: {:?}", vars.keys());
    for (name, v) in &vars {
        let expected = if exempted.iter().any(|e| name.starts_with(e)) { Kind::Float } else { Kind::Half };
        assert!(v.kind() == expected || v.kind() == Kind::Int64, "{name}: {:?}, expected {expected:?}", v.kind());
    }
    // the non-affine batch norm's running statistics are cast like any other module's
    assert_eq!(vars["dn.bn1.running_mean"].kind(), Kind::Half);
    assert_eq!(out.kind(), Kind::Half, "test_output_is_half");
    assert_eq!(out.size(), [4, 10, 13, 29]);
    assert!(bool::try_from(out.isfinite().all()).unwrap());
}

#[test]
fn run_fp16util_fp16_model_params_buffers_and_output() {
    let vs = VarStore::new(Device::Cpu);
    let net = DummyNetWrapper::new(&vs.root());
    let (model, report) = fp16_model(&vs, net).unwrap();
    assert_eq!(report.kept_batchnorm.len(), 12, "3 affine batch norms x (weight, bias, running_mean, running_var)");
    let x = Tensor::randn([4, 3, 16, 32], (Kind::Float, Device::Cpu));
    let out = model.forward_t(&x, true);
    check_run_fp16util(&vs, &out);
}

#[test]
fn run_fp16util_network_to_half_and_bn_convert_float() {
    let vs = VarStore::new(Device::Cpu);
    let net = DummyNetWrapper::new(&vs.root());
    let model = network_to_half(&vs, net).unwrap();
    let x = Tensor::randn([4, 3, 16, 32], (Kind::Float, Device::Cpu));
    let out = model.forward_t(&x, true);
    check_run_fp16util(&vs, &out);
    // BN_convert_float on an all-fp16 store makes only the affine batch norms fp32 again.
    convert_network(&vs, Kind::Half).unwrap();
    let before = vs.variables();
    for (name, v) in &before {
        if !name.starts_with("bn.") && !name.contains(".bn.") {
            assert!(v.kind() == Kind::Half || v.kind() == Kind::Int64, "{name}");
        }
    }
    let mut vs2 = VarStore::new(Device::Cpu);
    let _net2 = DummyNetWrapper::new(&vs2.root());
    vs2.half();
    let done = bn_convert_float(&vs2).unwrap();
    assert_eq!(done.len(), 12);
    for (name, v) in vs2.variables() {
        let bn = done.contains(&name);
        assert_eq!(v.kind() == Kind::Float, bn, "{name}: {:?}", v.kind());
    }
}

/// fp16 parameters a [2, 3] and b [4] (created in that order), with known values.
fn half_store() -> VarStore {
    let vs = VarStore::new(Device::Cpu);
    let root = vs.root();
    let a = Tensor::from_slice(&[0.5f32, -1.25, 2.0, 0.125, 3.5, -0.75]).reshape([2, 3]);
    let b = Tensor::from_slice(&[1.0f32, -2.0, 0.25, 4.0]);
    let _ = root.var_copy("a", &a);
    let _ = root.var_copy("b", &b);
    convert_network(&vs, Kind::Half).unwrap();
    vs
}

/// Gradients k_a, k_b (exact in fp16) through backward of sum(a * k_a) + sum(b * k_b).
fn half_grads(vs: &VarStore) -> (Tensor, Tensor) {
    let v = vs.variables();
    let ka = Tensor::from_slice(&[1.5f32, -0.5, 0.25, 8.0, -3.0, 0.0625]).reshape([2, 3]).to_kind(Kind::Half);
    let kb = Tensor::from_slice(&[-1.0f32, 2.5, 0.75, 16.0]).to_kind(Kind::Half);
    let loss = (&v["a"] * &ka).sum(Kind::Float) + (&v["b"] * &kb).sum(Kind::Float);
    loss.backward();
    (ka, kb)
}

#[test]
fn prep_param_lists_and_the_manual_master_recipe() {
    let vs = half_store();
    let (model, masters) = prep_param_lists(&vs, false).unwrap();
    assert_eq!(model.len(), 2);
    assert_eq!(masters.len(), 2);
    for (p, m) in model.iter().zip(&masters) {
        assert_eq!(m.kind(), Kind::Float);
        assert!(m.requires_grad());
        assert!(bits_equal(m, &p.to_kind(Kind::Float)), "the master is the fp16 value, exactly");
        assert_ne!(m.data_ptr(), p.data_ptr());
    }
    let (ka, kb) = half_grads(&vs);
    model_grads_to_master_grads(&model, &masters, false).unwrap();
    assert!(bits_equal(&masters[0].grad(), &ka.to_kind(Kind::Float)));
    assert!(bits_equal(&masters[1].grad(), &kb.to_kind(Kind::Float)));
    // An update on the masters (m -= 0.5 * g), then the model follows, rounded to fp16.
    {
        let _g = tch::no_grad_guard();
        for m in &masters {
            let g = m.grad();
            let _ = m.shallow_clone().g_add_(&(g * -0.5));
        }
    }
    master_params_to_model_params(&model, &masters, false).unwrap();
    for (p, m) in model.iter().zip(&masters) {
        assert!(bits_equal(p, &m.to_kind(Kind::Half)));
    }
    // a = [0.5, ..] with grad 1.5: 0.5 - 0.75 = -0.25 exactly
    assert_eq!(model[0].double_value(&[0, 0]), -0.25);
    // A parameter without a gradient: its master gets none.
    let vs2 = half_store();
    let (model2, masters2) = prep_param_lists(&vs2, false).unwrap();
    (&model2[0] * 2.0).sum(Kind::Float).backward();
    model_grads_to_master_grads(&model2, &masters2, false).unwrap();
    assert!(bits_equal(&masters2[0].grad(), &Tensor::full([2, 3], 2.0, (Kind::Float, Device::Cpu))));
    assert!(!masters2[1].grad().defined());
    // Lists that do not pair up: typed error, nothing changes.
    let before = model[0].copy();
    let err = master_params_to_model_params(&model, &masters[..1], false).unwrap_err();
    assert!(matches!(err, AmpError::Usage(UsageError::ParamListMismatch { .. })), "{err}");
    assert!(bits_equal(&model[0], &before));
}

#[test]
fn prep_param_lists_flat_master() {
    let vs = half_store();
    let (model, masters) = prep_param_lists(&vs, true).unwrap();
    assert_eq!(masters.len(), 1, "one flat master");
    let flat = &masters[0];
    assert_eq!(flat.size(), [10]);
    assert_eq!(flat.kind(), Kind::Float);
    let want = Tensor::cat(&[model[0].flatten(0, -1), model[1].flatten(0, -1)], 0).to_kind(Kind::Float);
    assert!(bits_equal(flat, &want));
    assert!(flat.grad().defined(), "Apex attaches a gradient to the flat master");
    let (ka, kb) = half_grads(&vs);
    model_grads_to_master_grads(&model, &masters, true).unwrap();
    let want = Tensor::cat(&[ka.flatten(0, -1), kb], 0).to_kind(Kind::Float);
    assert!(bits_equal(&flat.grad(), &want));
    {
        let _g = tch::no_grad_guard();
        let _ = flat.shallow_clone().fill_(0.375);
    }
    master_params_to_model_params(&model, &masters, true).unwrap();
    assert_eq!(model[0].size(), [2, 3]);
    assert!(bits_equal(&model[0], &Tensor::full([2, 3], 0.375, (Kind::Half, Device::Cpu))));
    assert!(bits_equal(&model[1], &Tensor::full([4], 0.375, (Kind::Half, Device::Cpu))));
    // flat with the wrong number of masters / mixed dtypes: typed errors
    let err = model_grads_to_master_grads(&model, &[flat.shallow_clone(), flat.shallow_clone()], true).unwrap_err();
    assert!(matches!(err, AmpError::Usage(UsageError::ParamListMismatch { .. })), "{err}");
    let mixed = VarStore::new(Device::Cpu);
    let _ = mixed.root().var_copy("a", &Tensor::ones([2], (Kind::Float, Device::Cpu)));
    let h = mixed.root().var_copy("b", &Tensor::ones([2], (Kind::Float, Device::Cpu)));
    {
        let _g = tch::no_grad_guard();
        h.shallow_clone().set_data(&h.to_kind(Kind::Half));
    }
    let err = prep_param_lists(&mixed, true).unwrap_err();
    assert!(matches!(err, AmpError::Usage(UsageError::ParamListMismatch { .. })), "{err}");
    assert_eq!(prep_param_lists(&mixed, false).unwrap().1.len(), 2, "non-flat accepts mixed dtypes");
}

#[test]
fn to_python_float_and_clip_grad_norm() {
    assert_eq!(to_python_float(&Tensor::from_slice(&[2.5f32])).unwrap(), 2.5);
    assert_eq!(to_python_float(&Tensor::from(-3.0f64)).unwrap(), -3.0);
    let err = to_python_float(&Tensor::from_slice(&[1.0f32, 2.0])).unwrap_err();
    assert!(matches!(err, AmpError::Usage(UsageError::ParamListMismatch { .. })), "{err}");

    // grads [3, 4] and [0]: norm 5; coefficient max_norm / (5 + 1e-6) in fp32, as torch.
    let p1 = Tensor::zeros([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let p2 = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let k1 = Tensor::from_slice(&[3.0f32, 4.0]);
    ((&p1 * &k1).sum(Kind::Float) + p2.sum(Kind::Float) * 0.0).backward();
    let norm = clip_grad_norm(&[p1.shallow_clone(), p2.shallow_clone()], 1.0, 2.0).unwrap();
    assert_eq!(norm, 5.0);
    let coef = 1.0f32 / (5.0f32 + 1e-6f32);
    assert!(bits_equal(&p1.grad(), &Tensor::from_slice(&[3.0f32 * coef, 4.0f32 * coef])));
    // below max_norm nothing changes (coefficient clamped to 1)
    let before = p1.grad().copy();
    // the norm of the clipped gradients is 5 / (5 + 1e-6) up to fp32 rounding
    assert!((clip_grad_norm(&[p1.shallow_clone()], 10.0, 2.0).unwrap() - 1.0).abs() < 1e-6);
    assert!(bits_equal(&p1.grad(), &before));
    // the inf norm; no gradients: 0
    assert_eq!(clip_grad_norm(&[p1.shallow_clone()], 10.0, f64::INFINITY).unwrap(), f64::from(4.0f32 * coef));
    let bare = Tensor::zeros([2], (Kind::Float, Device::Cpu));
    assert_eq!(clip_grad_norm(&[bare], 1.0, 2.0).unwrap(), 0.0);
    assert!(matches!(
        clip_grad_norm(&[p1], -1.0, 2.0),
        Err(AmpError::Config(ConfigError::InvalidOption { option: "max_norm", .. }))
    ));
}

#[test]
fn legacy_dynamic_loss_scaler_follows_apex() {
    use tch_amp::fp16_utils::{DynamicLossScaler, StaticLossScaler};
    let mut s = DynamicLossScaler::default();
    assert_eq!(s.loss_scale(), 2f64.powi(32));
    // From iteration -1: the first growth comes at iteration 999, after 1000 clean ones.
    for _ in 0..999 {
        s.update_scale(false);
    }
    assert_eq!(s.loss_scale(), 2f64.powi(32));
    s.update_scale(false);
    assert_eq!(s.loss_scale(), 2f64.powi(33));
    assert_eq!(s.iterations(), (1000, -1));
    // An overflow at iteration 1000 halves; the next growth is 1000 iterations after it.
    s.update_scale(true);
    assert_eq!(s.loss_scale(), 2f64.powi(32));
    assert_eq!(s.iterations(), (1001, 1000));
    for _ in 0..999 {
        s.update_scale(false);
    }
    assert_eq!(s.loss_scale(), 2f64.powi(32), "iteration 1999 is 999 after the overflow");
    s.update_scale(false);
    assert_eq!(s.loss_scale(), 2f64.powi(33), "iteration 2000 is 1000 after it");
    // The floor is 1; scale_factor and scale_window are honoured.
    let mut s = DynamicLossScaler::new(8.0, 4.0, 3).unwrap();
    s.update_scale(true);
    assert_eq!(s.loss_scale(), 2.0);
    s.update_scale(true);
    assert_eq!(s.loss_scale(), 1.0);
    s.update_scale(true);
    assert_eq!(s.loss_scale(), 1.0);
    s.update_scale(false); // iteration 3, 1 after the overflow at 2
    s.update_scale(false);
    assert_eq!(s.loss_scale(), 1.0);
    s.update_scale(false); // iteration 5: 3 after it
    assert_eq!(s.loss_scale(), 4.0);
    assert!(matches!(
        DynamicLossScaler::new(8.0, 2.0, 0),
        Err(AmpError::Config(ConfigError::InvalidOption { option: "scale_window", .. }))
    ));
    // has_overflow sums each gradient in fp32 (Apex's check): a finite fp32 gradient whose sum
    // overflows counts; an fp16 inf too.
    let p = Tensor::zeros([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    (&p * Tensor::from_slice(&[3e38f32, 3e38])).sum(Kind::Float).backward();
    assert!(s.has_overflow(&[p.shallow_clone()]).unwrap());
    let q = Tensor::zeros([2], (Kind::Half, Device::Cpu)).set_requires_grad(true);
    (&q * Tensor::from_slice(&[1.0f32, 2.0]).to_kind(Kind::Half)).sum(Kind::Float).backward();
    assert!(!s.has_overflow(&[q.shallow_clone()]).unwrap());
    // backward multiplies the loss by the scale
    let r = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    s.backward(&(&r * 3.0).sum(Kind::Float)).unwrap();
    assert_eq!(r.grad().double_value(&[0]), 12.0);
    let st = StaticLossScaler::new(128.0).unwrap();
    assert_eq!(st.loss_scale(), 128.0);
    assert!(!st.has_overflow(&[p]));
    assert!(StaticLossScaler::new(f64::NAN).is_err());
}

#[test]
fn fp16_optimizer_orders_by_param_group_then_creation() {
    // torch's param_groups order: group 0's parameters (as created), then group 1's.
    let vs = VarStore::new(Device::Cpu);
    let g1 = vs.root().set_group(1);
    let _late = g1.var_copy("z_first_made", &Tensor::ones([2], (Kind::Float, Device::Cpu)));
    let g0 = vs.root().set_group(0);
    let _w = g0.var_copy("w", &Tensor::ones([3], (Kind::Float, Device::Cpu)));
    let _a = g0.var_copy("a", &Tensor::ones([1], (Kind::Float, Device::Cpu)));
    convert_network(&vs, Kind::Half).unwrap();
    let extra = vs.root().set_group(1).var_copy("fp32", &Tensor::ones([1], (Kind::Float, Device::Cpu)));
    let mut opt = Fp16Optimizer::new(&vs, nn::Sgd::default(), 0.5, Fp16OptimizerOptions::default()).unwrap();
    assert_eq!(opt.param_names(), ["w", "a", "z_first_made", "fp32"]);
    let state = opt.state_dict().unwrap();
    let sizes: Vec<Vec<Vec<i64>>> = state.fp32_from_fp16.iter().map(|g| g.iter().map(Tensor::size).collect()).collect();
    assert_eq!(sizes, [vec![vec![3], vec![1]], vec![vec![2]]], "masters per group, fp32 variables excluded");
    // per-group learning rates reach the masters: lr 0.5 in group 0, 0.25 in group 1
    opt.set_lr_group(1, 0.25).unwrap();
    let v = vs.variables();
    let loss = v["w"].sum(Kind::Float) + v["z_first_made"].sum(Kind::Float) + extra.sum(Kind::Float);
    opt.backward(&loss).unwrap();
    assert!(opt.step().unwrap().stepped());
    assert_eq!(v["w"].double_value(&[0]), 0.5);
    assert_eq!(v["z_first_made"].double_value(&[0]), 0.75);
    assert_eq!(extra.double_value(&[0]), 0.75);
    assert_eq!(v["a"].double_value(&[0]), 1.0, "no gradient: not stepped");
    let grads = opt.inspect_master_grad_data().unwrap();
    assert_eq!(grads.len(), 2);
}

#[test]
fn fp16_optimizer_checkpoint_file_resumes_bit_for_bit() {
    let fx = fixture();
    let case = cases(&fx).into_iter().find(|c| c["name"] == "sgd_dynamic").unwrap();
    let plan = plan(&fx, &case);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fp16_optimizer.safetensors");
    let vs = model(&fx, "sgd_dynamic");
    let mut opt = optimizer(&vs, &case);
    for (s, kind) in plan.iter().enumerate().take(5) {
        train_step(&vs, &mut opt, &fx, &case, s, kind);
    }
    opt.save_checkpoint(&path, &vs).unwrap();
    // A fresh model (initial weights) and optimizer, resumed from the file: the reference's
    // steps 5.. follow bit for bit (scale, unskipped count, momentum, masters).
    let vs2 = model(&fx, "sgd_dynamic");
    let mut opt2 = optimizer(&vs2, &case);
    opt2.load_checkpoint(&path, &vs2).unwrap();
    assert_eq!(opt2.loss_scale(), opt.loss_scale());
    assert_eq!(opt2.loss_scaler().unskipped(), opt.loss_scaler().unskipped());
    for (s, kind) in plan.iter().enumerate().skip(5) {
        let got = train_step(&vs2, &mut opt2, &fx, &case, s, kind);
        check_step(&fx, &case, s, &got);
    }
    // An optimizer built differently refuses the file and keeps its state.
    let vs3 = model(&fx, "sgd_dynamic");
    let mut adam = Fp16Optimizer::new(&vs3, nn::Adam::default(), 1e-3, Fp16OptimizerOptions::default()).unwrap();
    let before = adam.master_params()[0].detach().copy();
    assert!(matches!(adam.load_checkpoint(&path, &vs3), Err(AmpError::State(StateError::StateMismatch { .. }))));
    assert!(bits_equal(&adam.master_params()[0].detach(), &before));
}
