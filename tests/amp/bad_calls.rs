//! Calls a new user gets wrong, each a typed error with nothing changed: a backward outside
//! scale_loss under O2, step() without gradients or twice after an overflow, checkpoints into
//! another optimizer kind, other hyper-parameters or another opt level, hyper-parameters that
//! torch.optim rejects (tests/fixtures/optim_validation.json, made by optim_validation.py with
//! torch 2.13), an unknown parameter group, bad losses and an empty optimizer list, and loaded
//! states whose values would make the next step panic.
use serde_json::{json, Value};
use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::error::{ConfigError, StateError, UsageError};
use tch_amp::{Amp, AmpConfig, AmpError, AmpModel, AmpOptimizer, OptLevel, OptimizerConfig, StepOutcome};

use crate::common::{batch, deterministic_init, same, Mlp};

struct Run {
    vs: VarStore,
    model: AmpModel<Mlp>,
    amp: Amp,
    opt: AmpOptimizer,
}

fn run(config: AmpConfig, optim: impl Into<OptimizerConfig>) -> Run {
    let vs = VarStore::new(Device::Cpu);
    let net = Mlp::new(&vs.root());
    deterministic_init(&vs);
    let amp = Amp::new(&config.verbosity(0)).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let opt = amp.optimizer(&vs, optim, 1e-2).unwrap();
    Run { vs, model, amp, opt }
}

fn loss(r: &Run, seed: i64) -> Tensor {
    let (x, y) = batch(seed, 8);
    r.model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean)
}

/// Weights, masters and optimizer state, the AMP state, the step counts.
type Snapshot = (Vec<(String, Tensor)>, Vec<Tensor>, String, (u64, u64));

/// Everything a call could change, for "nothing changed".
fn snapshot(r: &Run) -> Snapshot {
    let mut vars: Vec<(String, Tensor)> = r.vs.variables().into_iter().map(|(k, v)| (k, v.copy())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut state: Vec<Tensor> = r.opt.master_params().iter().map(Tensor::copy).collect();
    for p in r.opt.to_record().params {
        state.extend(p.buffers.values().map(Tensor::copy));
    }
    (vars, state, crate::common::json(&r.amp.state_dict()).to_string(), r.opt.step_counts())
}

fn assert_unchanged(before: &Snapshot, r: &Run, what: &str) {
    let after = snapshot(r);
    assert_eq!(before.0.len(), after.0.len());
    for ((n, a), (_, b)) in before.0.iter().zip(&after.0) {
        assert!(same(a, b), "{what}: {n} changed");
    }
    assert!(before.1.iter().zip(&after.1).all(|(a, b)| same(a, b)), "{what}: optimizer state changed");
    assert_eq!(before.2, after.2, "{what}: amp state changed");
    assert_eq!(before.3, after.3, "{what}: step counts changed");
}

fn good_step(r: &mut Run, seed: i64) {
    r.opt.zero_grad().unwrap();
    let l = loss(r, seed);
    r.amp.scale_loss(&l, &mut [&mut r.opt], |s| s.backward()).unwrap();
    assert!(r.opt.step().unwrap().stepped());
}

/// O2: a plain backward() then step() used to return Stepped and change nothing (the masters
/// got no gradients). Now: GradientsNotUnscaled naming the fp16 variables, nothing changed.
#[test]
fn o2_backward_without_scale_loss_is_an_error() {
    let mut r = run(AmpConfig::new(OptLevel::O2), nn::Adam::default());
    good_step(&mut r, 0);
    r.opt.zero_grad().unwrap();
    let l = loss(&r, 1);
    let before = snapshot(&r);
    l.backward();
    match r.opt.step() {
        Err(AmpError::Usage(UsageError::GradientsNotUnscaled { params })) => {
            assert_eq!(params, ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"])
        }
        other => panic!("{other:?}"),
    }
    assert_unchanged(&before, &r, "plain backward");
}

/// step() with no gradient at all (NoGradients), and step() twice after one overflow (the
/// skip clears the gradients; the second step is out of order: CallOrder), nothing changed.
#[test]
fn step_without_gradients_and_twice_after_an_overflow() {
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        let mut r = run(AmpConfig::new(level), nn::Sgd { momentum: 0.9, ..Default::default() });
        let before = snapshot(&r);
        assert!(matches!(r.opt.step(), Err(AmpError::Usage(UsageError::NoGradients))), "{level}");
        assert_unchanged(&before, &r, "no gradients");
        if level == OptLevel::O0 || level == OptLevel::O3 {
            continue; // static scales: no overflow, no skip
        }
        good_step(&mut r, 0);
        r.opt.zero_grad().unwrap();
        let l = loss(&r, 1) * f64::INFINITY;
        r.amp.scale_loss(&l, &mut [&mut r.opt], |s| s.backward()).unwrap();
        assert!(matches!(r.opt.step(), Ok(StepOutcome::Skipped { .. })));
        let before = snapshot(&r);
        assert!(
            matches!(r.opt.step(), Err(AmpError::Usage(UsageError::CallOrder { call: "step()", .. }))),
            "{level}: second step after a skip"
        );
        assert_unchanged(&before, &r, "second step");
    }
}

/// step() twice after a clean step used to return Stepped at every level (O1 applied the whole
/// update again; O2 moved only its fp32 parameters). Now the second is CallOrder at O0-O3,
/// nothing changed, and the next scale_loss pass makes step() work again.
#[test]
fn step_twice_is_refused_at_every_level() {
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        let mut r = run(AmpConfig::new(level), nn::Sgd { momentum: 0.9, ..Default::default() });
        good_step(&mut r, 0);
        let before = snapshot(&r);
        match r.opt.step() {
            Err(AmpError::Usage(UsageError::CallOrder { call: "step()", when, .. })) => {
                assert!(when.contains("twice"), "{level}: {when}")
            }
            other => panic!("{level}: {other:?}"),
        }
        assert_unchanged(&before, &r, "second step");
        // Without zero_grad too: a new pass is what the order asks for.
        let l = loss(&r, 1);
        r.amp.scale_loss(&l, &mut [&mut r.opt], |s| s.backward()).unwrap();
        assert!(r.opt.step().unwrap().stepped(), "{level}");
    }
}

/// clip_grad_norm before scale_loss used to return Ok(0.0) (clipping silently off); after
/// step() it clipped gradients already used. Both are CallOrder at every level.
#[test]
fn clip_outside_the_order_is_refused() {
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        let mut r = run(AmpConfig::new(level), nn::Sgd::default());
        r.opt.zero_grad().unwrap();
        let e = r.opt.clip_grad_norm(1.0, 2.0).unwrap_err();
        assert!(
            matches!(
                e,
                AmpError::Usage(UsageError::CallOrder { call: "clip_grad_norm()", when: "before scale_loss", .. })
            ),
            "{level}: {e}"
        );
        good_step(&mut r, 0);
        let e = r.opt.clip_grad_norm(1.0, 2.0).unwrap_err();
        assert!(matches!(e, AmpError::Usage(UsageError::CallOrder { call: "clip_grad_norm()", .. })), "{level}: {e}");
        assert!(e.to_string().starts_with("clip_grad_norm() called after step()"), "{e}");
    }
    // Where scale_loss passes the loss through (O0), a plain backward is the same pass: clipping
    // and stepping on it work.
    let mut r = run(AmpConfig::new(OptLevel::O0), nn::Sgd::default());
    loss(&r, 0).backward();
    assert!(r.opt.clip_grad_norm(1.0, 2.0).unwrap() > 0.0);
    assert!(r.opt.step().unwrap().stepped());
}

/// O1: a plain loss.backward() outside scale_loss used to train with no loss scale at all.
/// step() now refuses those gradients (CallOrder), nothing changed.
#[test]
fn o1_backward_outside_scale_loss_is_refused() {
    let mut r = run(AmpConfig::new(OptLevel::O1), nn::Adam::default());
    good_step(&mut r, 0);
    r.opt.zero_grad().unwrap();
    loss(&r, 1).backward();
    let before = snapshot(&r);
    match r.opt.step() {
        Err(AmpError::Usage(UsageError::CallOrder { call: "step()", when, .. })) => {
            assert!(when.contains("no scale_loss"), "{when}")
        }
        other => panic!("{other:?}"),
    }
    assert_unchanged(&before, &r, "backward outside scale_loss");
}

/// timm's native-AMP habit ported to O2: clipping the model's own parameters after scale_loss.
/// Their gradients are on the fp32 masters by then (scale_loss made them and released the fp16
/// ones), so such a clip would clip nothing: it is refused, naming the masters, and changes
/// nothing; clipping with opt.clip_grad_norm (the fp32 master gradients, Apex's way) steps. At
/// O1 the model's gradients are the unscaled ones, so clipping them is fine.
#[test]
fn clipping_the_fp16_model_gradients_under_o2_is_refused() {
    let clip_model = |vs: &VarStore| tch_amp::torch_amp::clip_grad_norm_(&vs.trainable_variables(), 0.5, 2.0);
    let mut r = run(AmpConfig::new(OptLevel::O2), nn::Adam::default());
    good_step(&mut r, 0);
    r.opt.zero_grad().unwrap();
    let l = loss(&r, 1);
    r.amp.scale_loss(&l, &mut [&mut r.opt], |s| s.backward()).unwrap();
    let before = snapshot_without_masters(&r);
    match clip_model(&r.vs) {
        Err(AmpError::Usage(UsageError::CallOrder { call: "clip_grad_norm", when, .. })) => {
            assert!(when.contains("masters"), "{when}")
        }
        other => panic!("{other:?}"),
    }
    assert_unchanged_without_masters(&before, &r, "refused clip of the fp16 model");
    // The right way: clip the fp32 master gradients.
    assert!(r.opt.clip_grad_norm(1.0, 2.0).unwrap() > 0.0);
    assert!(r.opt.step().unwrap().stepped());
    // O1: the model's gradients are the unscaled ones; clipping them is the user's choice.
    let mut r = run(AmpConfig::new(OptLevel::O1), nn::Adam::default());
    let l = loss(&r, 1);
    r.amp.scale_loss(&l, &mut [&mut r.opt], |s| s.backward()).unwrap();
    assert!(f64::try_from(clip_model(&r.vs).unwrap()).unwrap() > 0.0);
    assert!(r.opt.step().unwrap().stepped());
}

/// [`snapshot`] without the masters.
fn snapshot_without_masters(r: &Run) -> (Vec<(String, Tensor)>, String, (u64, u64)) {
    let mut vars: Vec<(String, Tensor)> = r.vs.variables().into_iter().map(|(k, v)| (k, v.copy())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    (vars, crate::common::json(&r.amp.state_dict()).to_string(), r.opt.step_counts())
}

fn assert_unchanged_without_masters(before: &(Vec<(String, Tensor)>, String, (u64, u64)), r: &Run, what: &str) {
    let after = snapshot_without_masters(r);
    for ((n, a), (_, b)) in before.0.iter().zip(&after.0) {
        assert!(same(a, b), "{what}: {n} changed");
    }
    assert_eq!((&before.1, before.2), (&after.1, after.2), "{what}: amp state or step counts changed");
}

fn checkpoint_of(r: &Run, dir: &tempfile::TempDir, name: &str) -> std::path::PathBuf {
    let path = dir.path().join(name);
    tch_amp::save_checkpoint(&path, &r.vs, &[&r.opt], &r.amp).unwrap();
    path
}

fn expect_refused(path: &std::path::Path, r: &mut Run, needle: &str) {
    let before = snapshot(r);
    match tch_amp::load_checkpoint(path, &r.vs, &mut [&mut r.opt], &mut r.amp) {
        Err(AmpError::State(StateError::StateMismatch { message })) => assert!(message.contains(needle), "{message}"),
        other => panic!("expected a StateMismatch about {needle:?}, got {other:?}"),
    }
    assert_unchanged(&before, r, needle);
}

/// Checkpoints record the optimizer kind, its hyper-parameters and the opt level: an Adam
/// checkpoint does not load into SGD, nor into an Adam with another beta1 or amsgrad, nor an O2
/// checkpoint into O1; nothing changes.
#[test]
fn checkpoints_into_other_setups_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut adam = run(AmpConfig::new(OptLevel::O2), nn::Adam::default());
    good_step(&mut adam, 0);
    let path = checkpoint_of(&adam, &dir, "adam-o2.safetensors");
    let text = String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into_owned();
    assert!(
        text.contains(r#"\"hyper_parameters\":{\"amsgrad\":0.0,\"beta1\":0.9"#),
        "{}",
        &text[..400.min(text.len())]
    );

    let mut sgd = run(AmpConfig::new(OptLevel::O2), nn::Sgd::default());
    good_step(&mut sgd, 0);
    expect_refused(&path, &mut sgd, "adam optimizer, this one is sgd");
    let mut other_beta = run(AmpConfig::new(OptLevel::O2), nn::Adam { beta1: 0.8, ..Default::default() });
    good_step(&mut other_beta, 0);
    expect_refused(&path, &mut other_beta, "hyper-parameters");
    let mut amsgrad = run(AmpConfig::new(OptLevel::O2), nn::Adam { amsgrad: true, ..Default::default() });
    expect_refused(&path, &mut amsgrad, "hyper-parameters");
    let mut o1 = run(AmpConfig::new(OptLevel::O1), nn::Adam::default());
    good_step(&mut o1, 0);
    expect_refused(&path, &mut o1, "written under O2, this Amp is O1");
    expect_refused(&path, &mut o1, "load_model_weights and load_optimizer_state load its parts");
    // The same setup loads it.
    let mut same_setup = run(AmpConfig::new(OptLevel::O2), nn::Adam::default());
    tch_amp::load_checkpoint(&path, &same_setup.vs, &mut [&mut same_setup.opt], &mut same_setup.amp).unwrap();
}

fn num(v: &Value) -> f64 {
    match v {
        Value::Number(n) => n.as_f64().unwrap(),
        Value::String(s) => s.parse().unwrap(),
        other => panic!("{other}"),
    }
}

/// Every hyper-parameter set torch.optim 2.13 rejects is rejected (as InvalidOption naming the
/// same value), and every set it accepts is accepted, except those holding an infinite or NaN
/// value, which tch-amp rejects too (torch accepts an infinite lr, a NaN SGD dampening, ...).
#[test]
fn hyper_parameters_are_validated_as_torch_optim() {
    let fixture: Value = serde_json::from_str(include_str!("../fixtures/optim_validation.json")).unwrap();
    assert_eq!(fixture["torch"].as_str().unwrap().split('+').next(), Some("2.13.0"));
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var("w", &[2], nn::Init::Const(0.0));
    let amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let (mut rejected, mut stricter) = (0, 0);
    for case in fixture["cases"].as_array().unwrap() {
        let h = &case["hyper"];
        let f = |k: &str| num(&h[k]);
        let b = |k: &str| h[k].as_bool().unwrap();
        let config: OptimizerConfig = match case["kind"].as_str().unwrap() {
            "sgd" => {
                nn::Sgd { momentum: f("momentum"), dampening: f("dampening"), wd: f("wd"), nesterov: b("nesterov") }
                    .into()
            }
            "adam" => {
                nn::Adam { beta1: f("beta1"), beta2: f("beta2"), eps: f("eps"), wd: f("wd"), amsgrad: b("amsgrad") }
                    .into()
            }
            "adamw" => {
                nn::AdamW { beta1: f("beta1"), beta2: f("beta2"), eps: f("eps"), wd: f("wd"), amsgrad: b("amsgrad") }
                    .into()
            }
            _ => nn::RmsProp {
                alpha: f("alpha"),
                eps: f("eps"),
                wd: f("wd"),
                momentum: f("momentum"),
                centered: b("centered"),
            }
            .into(),
        };
        let lr = num(&case["lr"]);
        let ours = amp.optimizer(&vs, config, lr);
        assert_eq!(config.validate(lr).is_ok(), ours.is_ok());
        let finite = lr.is_finite() && h.as_object().unwrap().values().all(|v| v.is_boolean() || num(v).is_finite());
        match (&case["torch_error"], ours) {
            (Value::String(msg), Err(AmpError::Config(ConfigError::InvalidOption { option, .. }))) => {
                let torch_option = [
                    ("Invalid learning rate", "lr"),
                    ("Invalid epsilon value", "eps"),
                    ("Invalid beta parameter at index 0", "beta1"),
                    ("Invalid beta parameter at index 1", "beta2"),
                    ("Invalid weight_decay value", "weight_decay"),
                    ("Invalid momentum value", "momentum"),
                    ("Invalid alpha value", "alpha"),
                    ("Nesterov momentum requires", "nesterov"),
                ]
                .iter()
                .find(|(prefix, _)| msg.starts_with(prefix))
                .map(|(_, o)| *o)
                .unwrap_or_else(|| panic!("unknown torch message {msg}"));
                assert_eq!(option, torch_option, "{case}");
                rejected += 1;
            }
            (Value::Null, Ok(_)) => assert!(finite, "accepted a non-finite value: {case}"),
            (Value::Null, Err(AmpError::Config(ConfigError::InvalidOption { .. }))) if !finite => stricter += 1,
            (_, other) => panic!("{case}: {other:?}"),
        }
    }
    assert_eq!((rejected, stricter), (68, 19));
}

/// set_lr_group for a group that holds none of the optimizer's parameters.
#[test]
fn set_lr_group_of_an_unknown_group_is_an_error() {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().set_group(3).var("a", &[2], nn::Init::Const(0.0));
    let _ = vs.root().var("b", &[2], nn::Init::Const(0.0));
    let amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let mut opt = amp.optimizer(&vs, nn::Sgd::default(), 0.1).unwrap();
    assert_eq!(opt.param_groups(), [0, 3]);
    match opt.set_lr_group(99, 0.5) {
        Err(AmpError::Config(ConfigError::UnknownParamGroup { group: 99, groups })) => assert_eq!(groups, [0, 3]),
        other => panic!("{other:?}"),
    }
    assert_eq!((opt.lr_group(99), opt.lr_group(3)), (0.1, 0.1));
    opt.set_lr_group(3, 0.5).unwrap();
    assert_eq!(opt.lr_group(3), 0.5);
}

/// Bad losses and an empty optimizer list are refused before backward runs: the closure is
/// not called, no scaler counts a pass, nothing changes.
#[test]
fn bad_losses_are_refused_before_backward() {
    let mut r = run(AmpConfig::new(OptLevel::O2), nn::Adam::default());
    good_step(&mut r, 0);
    let passes = r.amp.scaler(0).unwrap().passes();
    let (x, y) = batch(1, 8);
    let out = r.model.forward_t(&x, true);
    let before = snapshot(&r);
    let cases: Vec<(Tensor, &str)> = vec![
        (out.mse_loss(&y, tch::Reduction::None), "non-scalar"),
        (out.mse_loss(&y, tch::Reduction::Mean).detach(), "no graph"),
        (Tensor::new(), "undefined"),
    ];
    for (loss, what) in &cases {
        let mut called = false;
        let err = r
            .amp
            .scale_loss(loss, &mut [&mut r.opt], |s| {
                called = true;
                s.backward()
            })
            .unwrap_err();
        match (*what, &err) {
            ("non-scalar", AmpError::Usage(UsageError::BadLoss { call: "scale_loss", problem })) => {
                assert!(problem.contains("[8, 4]"), "{problem}")
            }
            ("no graph", AmpError::Usage(UsageError::BadLoss { call: "scale_loss", problem })) => {
                assert!(problem.contains("require grad"), "{problem}")
            }
            ("undefined", AmpError::Usage(UsageError::BadLoss { call: "scale_loss", problem })) => {
                assert!(problem.contains("undefined"), "{problem}")
            }
            _ => panic!("{what}: {err:?}"),
        }
        assert!(!called, "{what}: backward ran");
    }
    let l = out.mse_loss(&y, tch::Reduction::Mean);
    assert!(matches!(r.amp.scale_loss(&l, &mut [], |s| s.backward()), Err(AmpError::Usage(UsageError::NoOptimizers))));
    assert_eq!(r.amp.scaler(0).unwrap().passes(), passes);
    assert_unchanged(&before, &r, "bad losses");
    // A scalar of shape [1] is a single value: accepted, as torch's backward accepts it.
    r.opt.zero_grad().unwrap();
    r.amp.scale_loss(&l.reshape([1]), &mut [&mut r.opt], |s| s.backward()).unwrap();
    assert!(r.opt.step().unwrap().stepped());
}

/// Values a loaded state may not carry: scales outside [min_loss_scale, max_loss_scale]
/// (1e30, 1e-30, 1e-300, 1.7e308), counters at or past the growth interval (u64::MAX); static
/// scales and config scales outside 2^-126..2^127. Refused, nothing applied; the accepted
/// extremes step without panicking.
#[test]
fn out_of_range_states_and_scales_are_refused() {
    let mut r = run(AmpConfig::new(OptLevel::O2), nn::Adam::default());
    let before = crate::common::json(&r.amp.state_dict());
    for bad in [
        json!({"loss_scaler0": {"loss_scale": 1e30, "unskipped": 0}}),
        json!({"loss_scaler0": {"loss_scale": 1e-30, "unskipped": 0}}),
        json!({"loss_scaler0": {"loss_scale": 1e-300, "unskipped": 0}}),
        json!({"loss_scaler0": {"loss_scale": 1.7e308, "unskipped": 0}}),
        json!({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": u64::MAX}}),
        json!({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 2000}}),
        json!({"scale": 65536.0, "_growth_tracker": u64::MAX}),
        json!({"scale": 65536.0, "growth_interval": 1e300}),
        json!({"scale": 1e-40}),
    ] {
        assert!(
            matches!(
                r.amp.load_state_dict(&crate::common::value(bad.clone())),
                Err(AmpError::State(StateError::StateMismatch { .. }))
            ),
            "{bad}"
        );
        assert_eq!(crate::common::json(&r.amp.state_dict()), before, "{bad}");
    }
    // The extremes that are accepted step without a panic.
    for ok in [
        json!({"loss_scaler0": {"loss_scale": 16_777_216.0, "unskipped": 1999}}),
        json!({"loss_scaler0": {"loss_scale": LossScalerFloor::FLOOR, "unskipped": 0}}),
        json!({"scale": 2.0, "growth_interval": 9_007_199_254_740_992u64, "_growth_tracker": 9_007_199_254_740_991u64}),
    ] {
        r.amp.load_state_dict(&crate::common::value(ok)).unwrap();
        r.opt.zero_grad().unwrap();
        let l = loss(&r, 3);
        r.amp.scale_loss(&l, &mut [&mut r.opt], |s| s.backward()).unwrap();
        r.opt.step().unwrap();
    }
    // A static scaler counts forever (Apex; at O3's 1.0 the loss passes through uncounted, so a
    // static 128 with masters); the largest count a file holds (a Python int within i64) loads
    // and keeps counting without a panic.
    let mut s = run(AmpConfig::new(OptLevel::O2).loss_scale(128.0), nn::Sgd::default());
    s.amp
        .load_state_dict(&crate::common::value(json!({"loss_scaler0": {"loss_scale": 128.0, "unskipped": i64::MAX}})))
        .unwrap();
    good_step(&mut s, 0);
    assert_eq!(s.amp.scaler(0).unwrap().unskipped(), i64::MAX as u64 + 1);
    assert!(s
        .amp
        .load_state_dict(&crate::common::value(json!({"loss_scaler0": {"loss_scale": 1e-300, "unskipped": 0}})))
        .is_err());
    for bad in [1e-300, 1e39, f64::INFINITY] {
        let err = AmpConfig::new(OptLevel::O2).loss_scale(bad).build().unwrap_err();
        assert!(matches!(err, AmpError::Config(ConfigError::InvalidOption { option: "loss_scale", .. })), "{err}");
    }
    assert!(AmpConfig::new(OptLevel::O2).max_loss_scale(1e300).build().is_err());
    assert!(AmpConfig::new(OptLevel::O2).min_loss_scale(1e-300).build().is_err());
    let _ = Kind::Float;
}

struct LossScalerFloor;
impl LossScalerFloor {
    const FLOOR: f64 = tch_amp::scaling::LossScaler::DEFAULT_MIN_LOSS_SCALE;
}
