//! GradScaler against torch.amp.GradScaler: the loop's loss, scale, growth tracker, skips and
//! weights bit for bit; its state dict through torch.save files both ways; the protocol's
//! errors, each leaving the scaler as it was.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_amp::error::{ConfigError, StateError, UsageError};
use tch_amp::torch_amp::GradScalerOptions;
use tch_amp::torch_io::{Dict, Value};
use tch_amp::GradScaler;
use tch_amp::{AmpError, StepOutcome};

use crate::common::{batch, deterministic_init};
use crate::support::{mlp, poisoned, torch_reference, Rows};

/// fp32 model, SGD, a scale that grows every 3 clean steps and backs off at the poisoned
/// steps 3 and 7.
const FP32_LOOP: &str = r#"
model = mlp(); det_init(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", growth_interval=3)
for step in range(12):
    x, y = batch(step, 8)
    if step in (3, 7):
        x[0, 0] = float("inf")
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    found = sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
    scaler.update()
    push("loss", loss); push("scale", scaler._scale); push("tracker", scaler._growth_tracker)
    push("stepped", torch.tensor(int(found == 0)))
    push_model("", model)
"#;

#[test]
fn fp32_loop_matches_torch_bit_for_bit() {
    let torch = torch_reference(FP32_LOOP, "");
    let vs = nn::VarStore::new(Device::Cpu);
    let model = mlp(&vs.root());
    deterministic_init(&vs);
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut scaler = GradScaler::with_options(Device::Cpu, GradScalerOptions::default().growth_interval(3)).unwrap();
    let mut rows = Rows::default();
    for step in 0..12 {
        let (mut x, y) = batch(step, 8);
        if step == 3 || step == 7 {
            x = poisoned(&x);
        }
        opt.zero_grad();
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        scaler.scale(&loss).unwrap().backward();
        let outcome = scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        assert_eq!(!outcome.stepped(), step == 3 || step == 7, "step {step}");
        rows.push("loss", &loss);
        rows.push("scale", scaler.scale_tensor().unwrap());
        rows.push("tracker", &Tensor::from(scaler.growth_tracker() as i32));
        rows.push("stepped", &Tensor::from(i64::from(outcome.stepped())));
        rows.push_model("", &vs);
    }
    rows.assert_matches(&torch);
    assert_eq!(scaler.get_scale(), 65536.0 * 2.0 * 0.5 * 2.0 * 0.5 * 2.0);
}

/// torch writes a scaler state (after growth and a backoff) with torch.save; tch-amp loads it,
/// saves its own, and torch loads that back.
const STATE_WRITE: &str = r#"
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
p = torch.nn.Parameter(torch.ones(3))
opt = torch.optim.SGD([p], lr=0.1)
for step in range(5):
    scaler.scale((p * (float("inf") if step == 3 else 1.0)).sum()).backward()
    scaler.step(opt); scaler.update(); opt.zero_grad()
torch.save(scaler.state_dict(), ARG)
push("scale", torch.tensor(scaler.get_scale()))
"#;

const STATE_READ: &str = r#"
sd = torch.load(ARG)
assert sorted(sd) == ["_growth_tracker", "backoff_factor", "growth_factor", "growth_interval", "scale"], sd
assert all(isinstance(sd[k], float) for k in ("scale", "growth_factor", "backoff_factor")), sd
assert all(isinstance(sd[k], int) for k in ("growth_interval", "_growth_tracker")), sd
scaler = torch.amp.GradScaler("cpu")
scaler.load_state_dict(sd)
push("scale", torch.tensor(scaler.get_scale()))
push("tracker", torch.tensor(scaler._init_growth_tracker))
push("growth", torch.tensor(scaler.get_growth_factor()))
"#;

#[test]
fn state_dict_round_trips_through_torch_save_files() {
    let dir = tempfile::tempdir().unwrap();
    let from_torch = dir.path().join("torch.pt");
    let torch = torch_reference(STATE_WRITE, from_torch.to_str().unwrap());
    let mut scaler = GradScaler::new(Device::Cpu);
    scaler.load(&from_torch).unwrap();
    // 1024 *4 (2 clean) then *0.25 (inf at step 3), one clean since: tracker 1.
    assert_eq!(scaler.get_scale(), torch["scale"].get(0).double_value(&[]));
    assert_eq!(scaler.get_scale(), 1024.0);
    assert_eq!((scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()), (4.0, 0.25, 2));
    assert_eq!(scaler.growth_tracker(), 1);
    // The loaded state drives the next updates: one more clean step grows the scale.
    let p = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let mut opt = Plain(vec![p.shallow_clone()]);
    scaler.scale(&p.sum(None)).unwrap().backward();
    scaler.step(&mut opt).unwrap();
    scaler.update().unwrap();
    assert_eq!((scaler.get_scale(), scaler.growth_tracker()), (4096.0, 0));
    let ours = dir.path().join("ours.pt");
    scaler.save(&ours).unwrap();
    let back = torch_reference(STATE_READ, ours.to_str().unwrap());
    assert_eq!(back["scale"].get(0).double_value(&[]), 4096.0);
    assert_eq!(back["tracker"].get(0).int64_value(&[]), 0);
    assert_eq!(back["growth"].get(0).double_value(&[]), 4.0);
}

/// A user's optimizer: plain SGD with lr 1 over its tensors.
struct Plain(Vec<Tensor>);

impl tch_amp::optim::Optimizer for Plain {
    fn params(&self) -> Vec<Tensor> {
        self.0.iter().map(Tensor::shallow_clone).collect()
    }
    fn zero_grad(&mut self) -> tch_amp::Result<()> {
        self.0.iter().for_each(|p| p.shallow_clone().zero_grad());
        Ok(())
    }
    fn step(&mut self) -> tch_amp::Result<()> {
        let _g = tch::no_grad_guard();
        for p in &self.0 {
            let _ = p.shallow_clone().f_sub_(&p.grad())?;
        }
        Ok(())
    }
}

fn scaled_backward(scaler: &mut GradScaler, p: &Tensor) {
    scaler.scale(&(p * 3.0).sum(None)).unwrap().backward();
}

/// Whether `r` is the call-order error for `call` whose `when` says `when`.
fn call_order<T>(r: Result<T, AmpError>, call: &str, when: &str) -> bool {
    matches!(r, Err(AmpError::Usage(UsageError::CallOrder { call: c, when: w, .. })) if c == call && w.contains(when))
}

#[test]
fn protocol_errors_are_torchs_and_change_nothing() {
    let p = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let mut opt = Plain(vec![p.shallow_clone()]);
    let mut scaler = GradScaler::new(Device::Cpu);
    assert!(call_order(scaler.unscale_(&opt), "unscale_()", "before the scale is initialized"));
    assert!(call_order(scaler.step(&mut opt), "step()", "before the scale is initialized"));
    assert!(call_order(scaler.update(), "update()", "before the scale is initialized"));
    scaled_backward(&mut scaler, &p);
    assert!(call_order(scaler.update(), "update()", "no inf checks recorded"));
    scaler.unscale_(&opt).unwrap();
    assert_eq!(Vec::<f32>::try_from(p.grad()).unwrap(), [3.0, 3.0]);
    assert!(call_order(scaler.unscale_(&opt), "unscale_()", "twice"));
    assert_eq!(Vec::<f32>::try_from(p.grad()).unwrap(), [3.0, 3.0], "the second unscale_ changed nothing");
    assert_eq!(scaler.step(&mut opt).unwrap(), StepOutcome::Stepped);
    assert_eq!(Vec::<f32>::try_from(&p).unwrap(), [-2.0, -2.0]);
    assert!(call_order(scaler.unscale_(&opt), "unscale_()", "after step()"));
    assert!(call_order(scaler.step(&mut opt), "step()", "twice"));
    scaler.update().unwrap();
    // No gradient at all: torch's "No inf checks were recorded for this optimizer."
    let q = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let mut empty = Plain(vec![q]);
    assert!(call_order(scaler.step(&mut empty), "scaler.step()", "no gradient"));
    // fp16 gradients are refused before anything is unscaled.
    let h = Tensor::ones([2], (Kind::Half, Device::Cpu)).set_requires_grad(true);
    let mut opt16 = Plain(vec![p.shallow_clone(), h.shallow_clone()]);
    let _ = p.grad().zero_();
    scaler.scale(&((&p * 3.0).sum(None) + h.to_kind(Kind::Float).sum(None))).unwrap().backward();
    let e = scaler.unscale_(&opt16).unwrap_err();
    assert!(matches!(e, AmpError::Usage(UsageError::UnscaleFp16Gradients { index: 1 })), "{e}");
    assert!(e.to_string().starts_with("Attempting to unscale FP16 gradients"));
    assert_eq!(Vec::<f32>::try_from(p.grad()).unwrap(), [3.0 * 65536.0; 2]);
    assert!(matches!(scaler.step(&mut opt16), Err(AmpError::Usage(UsageError::UnscaleFp16Gradients { .. }))));
    // Scaling an integer tensor.
    let ints = Tensor::from_slice(&[1i64, 2]);
    let e = scaler.scale(&ints).unwrap_err();
    assert!(matches!(&e, AmpError::Usage(UsageError::BadLoss { call: "GradScaler::scale", .. })), "{e}");
    assert!(e.to_string().contains("Int64"), "{e}");
    // update_to: a scale of 0 or inf is refused, a good one is set.
    for bad in [0.0, f64::INFINITY, f64::NAN, -1.0] {
        assert!(matches!(scaler.update_to(bad), Err(AmpError::Config(ConfigError::InvalidOption { .. }))));
    }
    assert_eq!(scaler.get_scale(), 65536.0);
    scaler.update_to(3.0).unwrap();
    assert_eq!(scaler.get_scale(), 3.0);
}

#[test]
fn bad_options_and_setters_are_refused() {
    let bad = [
        GradScalerOptions::default().init_scale(f64::INFINITY),
        GradScalerOptions::default().init_scale(0.0),
        GradScalerOptions::default().growth_factor(1.0),
        GradScalerOptions::default().backoff_factor(1.0),
        GradScalerOptions::default().backoff_factor(0.0),
        GradScalerOptions::default().growth_interval(0),
    ];
    for o in bad {
        assert!(
            matches!(
                GradScaler::with_options(Device::Cpu, o),
                Err(AmpError::Config(ConfigError::InvalidOption { .. }))
            ),
            "{o:?}"
        );
    }
    let mut s = GradScaler::new(Device::Cpu);
    assert!(s.set_growth_factor(0.5).is_err());
    assert!(s.set_backoff_factor(2.0).is_err());
    assert!(s.set_growth_interval(-1).is_err());
    assert_eq!((s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()), (2.0, 0.5, 2000));
    s.set_growth_factor(3.0).unwrap();
    s.set_backoff_factor(0.125).unwrap();
    s.set_growth_interval(7).unwrap();
    assert_eq!((s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()), (3.0, 0.125, 7));
}

fn good_state() -> Dict {
    Dict::new()
        .with("scale", Value::Float(8.0))
        .with("growth_factor", Value::Float(2.0))
        .with("backoff_factor", Value::Float(0.5))
        .with("growth_interval", Value::Int(10))
        .with("_growth_tracker", Value::Int(4))
}

#[test]
fn bad_state_dicts_are_refused_and_change_nothing() {
    let mut s = GradScaler::new(Device::Cpu);
    let p = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    scaled_backward(&mut s, &p);
    let mut cases: Vec<Value> = vec![Value::Dict(Dict::new()), Value::Int(3)];
    for key in ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"] {
        let mut missing = good_state();
        missing.remove(&key.into());
        cases.push(Value::Dict(missing));
        cases.push(Value::Dict(good_state().with(key, Value::Str("x".into()))));
    }
    for (key, v) in [
        ("scale", Value::Float(0.0)),
        ("scale", Value::Float(f64::INFINITY)),
        ("growth_factor", Value::Float(1.0)),
        ("backoff_factor", Value::Float(1.5)),
        ("growth_interval", Value::Float(10.0)),
        ("_growth_tracker", Value::Int(-1)),
    ] {
        cases.push(Value::Dict(good_state().with(key, v)));
    }
    for case in &cases {
        let e = s.load_state_dict(case).unwrap_err();
        assert!(matches!(e, AmpError::State(StateError::StateMismatch { .. })), "{case:?}: {e}");
        assert_eq!((s.get_scale(), s.growth_tracker(), s.get_growth_interval()), (65536.0, 0, 2000), "{case:?}");
    }
    s.load_state_dict(&Value::Dict(good_state())).unwrap();
    assert_eq!((s.get_scale(), s.growth_tracker(), s.get_growth_interval()), (8.0, 4, 10));
    let state = s.state_dict();
    let Value::Dict(d) = &state else { panic!() };
    let keys: Vec<String> = d.keys().map(|k| k.to_string()).collect();
    assert_eq!(
        keys,
        ["\"scale\"", "\"growth_factor\"", "\"backoff_factor\"", "\"growth_interval\"", "\"_growth_tracker\""]
    );
}

#[test]
fn a_disabled_scaler_passes_everything_through() {
    let mut s = GradScaler::with_options(Device::Cpu, GradScalerOptions::default().enabled(false)).unwrap();
    assert!(!s.is_enabled());
    let p = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let mut opt = Plain(vec![p.shallow_clone()]);
    let loss = (&p * 3.0).sum(None);
    let scaled = s.scale(&loss).unwrap();
    assert!(scaled.equal(&loss));
    scaled.backward();
    s.unscale_(&opt).unwrap();
    assert_eq!(s.step(&mut opt).unwrap(), StepOutcome::Stepped);
    assert_eq!(s.step(&mut opt).unwrap(), StepOutcome::Stepped);
    s.update().unwrap();
    s.update_to(0.0).unwrap();
    assert_eq!(s.get_scale(), 1.0);
    let state = s.state_dict();
    let Value::Dict(d) = &state else { panic!() };
    assert!(d.is_empty());
    s.load_state_dict(&Value::Int(0)).unwrap();
    // A CUDA scaler without CUDA disables itself, as torch's.
    if !tch::Cuda::is_available() {
        assert!(!GradScaler::new(Device::Cuda(0)).is_enabled());
    }
}
