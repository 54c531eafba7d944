//! `Amp::state_dict` / `load_state_dict`: Apex's form (`{"loss_scaler0": {"loss_scale": f,
//! "unskipped": n}, ...}`), torch `GradScaler.state_dict()` accepted for one loss, and every
//! bad state rejected with `StateError::StateMismatch` before anything is applied.
use serde_json::{json, Value};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};
use tch_amp::error::StateError;
use tch_amp::{Amp, AmpConfig, AmpError, AmpOptimizer, LossScale, OptLevel, ScaleLossOptions};

/// An fp32 model (O0) with dynamic loss scaling, so scale_loss runs the scaler: one variable
/// and one optimizer.
fn setup(num_losses: usize) -> (VarStore, Amp, AmpOptimizer) {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var_copy("w", &Tensor::from_slice(&[1.0f32, -2.0]));
    let amp =
        Amp::new(&AmpConfig::new(OptLevel::O0).loss_scale(LossScale::Dynamic).num_losses(num_losses).verbosity(0))
            .unwrap();
    let opt = amp.optimizer(&vs, tch::nn::Sgd::default(), 0.0).unwrap();
    (vs, amp, opt)
}

/// One backward pass of loss `loss_id` (an overflow when `bad`) and a step.
fn pass(vs: &VarStore, amp: &mut Amp, opt: &mut AmpOptimizer, loss_id: usize, bad: bool) {
    opt.zero_grad().unwrap();
    let w = &vs.variables()["w"];
    let mut loss = (w * Tensor::from_slice(&[0.5f32, 0.25])).sum(Kind::Float);
    if bad {
        loss *= f64::from(f32::INFINITY);
    }
    let options = ScaleLossOptions { loss_id, delay_unscale: false };
    let out = amp.scale_loss_with(&loss, &mut [&mut *opt], options, |s| s.backward()).unwrap();
    assert_eq!(out.overflow, bad);
    opt.step().unwrap();
}

fn state(amp: &Amp) -> Value {
    crate::common::json(&amp.state_dict())
}

#[test]
fn state_dict_is_apex_form() {
    let (vs, mut amp, mut opt) = setup(1);
    assert_eq!(state(&amp), json!({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}}));
    // What torch.save writes of it reads back the same.
    let bytes = tch_amp::torch_io::save_bytes(&amp.state_dict()).unwrap();
    let read = tch_amp::torch_io::load_bytes(&bytes, &Default::default()).unwrap();
    assert_eq!(crate::common::json(&read), json!({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}}));
    for _ in 0..3 {
        pass(&vs, &mut amp, &mut opt, 0, false);
    }
    assert_eq!(state(&amp), json!({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 3}}));
    pass(&vs, &mut amp, &mut opt, 0, true);
    pass(&vs, &mut amp, &mut opt, 0, false);
    assert_eq!(state(&amp), json!({"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 1}}));

    // Static scales too (O3's 1.0), one entry per loss.
    let amp = Amp::new(&AmpConfig::new(OptLevel::O3).num_losses(3)).unwrap();
    assert_eq!(
        state(&amp),
        json!({
            "loss_scaler0": {"loss_scale": 1.0, "unskipped": 0},
            "loss_scaler1": {"loss_scale": 1.0, "unskipped": 0},
            "loss_scaler2": {"loss_scale": 1.0, "unskipped": 0},
        })
    );
}

/// num_losses 2: save after different histories per loss, load into a fresh Amp, same state
/// and the same continuation.
#[test]
fn round_trip_two_losses() {
    let (vs, mut amp, mut opt) = setup(2);
    pass(&vs, &mut amp, &mut opt, 0, true);
    pass(&vs, &mut amp, &mut opt, 0, false);
    for _ in 0..4 {
        pass(&vs, &mut amp, &mut opt, 1, false);
    }
    pass(&vs, &mut amp, &mut opt, 1, true);
    pass(&vs, &mut amp, &mut opt, 1, true);
    pass(&vs, &mut amp, &mut opt, 1, false);
    let saved = state(&amp);
    assert_eq!(
        saved,
        json!({
            "loss_scaler0": {"loss_scale": 32768.0, "unskipped": 1},
            "loss_scaler1": {"loss_scale": 16384.0, "unskipped": 1},
        })
    );
    let bytes = tch_amp::torch_io::save_bytes(&amp.state_dict()).unwrap();

    let (vs2, mut amp2, mut opt2) = setup(2);
    amp2.load_state_dict(&tch_amp::torch_io::load_bytes(&bytes, &Default::default()).unwrap()).unwrap();
    assert_eq!(state(&amp2), saved);
    assert_eq!(amp2.loss_scale(1).unwrap(), 16384.0);
    assert_eq!(amp2.scaler(0).unwrap().unskipped(), 1);
    // Continuation: both go on identically.
    for (id, bad) in [(0, false), (1, true), (0, true), (1, false)] {
        pass(&vs, &mut amp, &mut opt, id, bad);
        pass(&vs2, &mut amp2, &mut opt2, id, bad);
        assert_eq!(state(&amp), state(&amp2));
    }
    assert_eq!(amp2.loss_scale(1).unwrap(), 8192.0);

    // A state written by Apex's Python (`json.dumps(amp.state_dict())`, an int scale).
    amp2.load_state_dict(&crate::common::value(json!({
        "loss_scaler0": {"loss_scale": 1024, "unskipped": 1999},
        "loss_scaler1": {"loss_scale": 0.5, "unskipped": 7},
    })))
    .unwrap();
    assert_eq!(amp2.loss_scale(0).unwrap(), 1024.0);
    assert_eq!(amp2.loss_scale(1).unwrap(), 0.5);
    // The restored counter is live: one clean pass completes the 2000.
    pass(&vs2, &mut amp2, &mut opt2, 0, false);
    assert_eq!(amp2.loss_scale(0).unwrap(), 2048.0);
    assert_eq!(amp2.scaler(0).unwrap().unskipped(), 0);
}

/// torch's GradScaler state, produced by:
/// ```python
/// import json, torch
/// w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
/// opt = torch.optim.SGD([w], lr=0.0)
/// scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
/// def it(bad=False):
///     opt.zero_grad()
///     loss = (w * torch.tensor([0.5, 0.25])).sum()
///     if bad: loss = loss * float("inf")
///     scaler.scale(loss).backward()
///     scaler.step(opt)
///     scaler.update()
/// for _ in range(4): it()
/// print(json.dumps(scaler.state_dict()))
/// # {"scale": 2048.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 1}
/// it(); print(scaler.get_scale(), scaler._get_growth_tracker())            # 2048.0 2
/// it(); print(scaler.get_scale(), scaler._get_growth_tracker())            # 4096.0 0
/// it(bad=True); print(scaler.get_scale(), scaler._get_growth_tracker())    # 2048.0 0
/// ```
#[test]
fn loads_grad_scaler_state() {
    let (vs, mut amp, mut opt) = setup(1);
    let gs: Value = serde_json::from_str(
        r#"{"scale": 2048.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 1}"#,
    )
    .unwrap();
    amp.load_state_dict(&crate::common::value(gs.clone())).unwrap();
    assert_eq!(state(&amp), json!({"loss_scaler0": {"loss_scale": 2048.0, "unskipped": 1}}));
    let s = amp.scaler(0).unwrap();
    assert_eq!(s.growth_interval(), 3);
    assert_eq!(s.factors(), (2.0, 0.5));
    // Continues as torch did.
    for (bad, scale, tracker) in [(false, 2048.0, 2), (false, 4096.0, 0), (true, 2048.0, 0)] {
        pass(&vs, &mut amp, &mut opt, 0, bad);
        assert_eq!((amp.loss_scale(0).unwrap(), amp.scaler(0).unwrap().unskipped()), (scale, tracker));
    }
}

/// Non-default factors are taken over too:
/// ```python
/// scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
/// it(bad=True); it()    # (same `it` as above)
/// print(json.dumps(scaler.state_dict()))
/// # {"scale": 64.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 2, "_growth_tracker": 1}
/// it(); print(scaler.get_scale(), scaler._get_growth_tracker())            # 256.0 0
/// it(bad=True); print(scaler.get_scale(), scaler._get_growth_tracker())    # 64.0 0
/// ```
#[test]
fn loads_grad_scaler_factors() {
    let (vs, mut amp, mut opt) = setup(1);
    amp.load_state_dict(&crate::common::value(json!({"scale": 64.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 2, "_growth_tracker": 1})))
        .unwrap();
    assert_eq!(amp.scaler(0).unwrap().factors(), (4.0, 0.25));
    for (bad, scale) in [(false, 256.0), (true, 64.0)] {
        pass(&vs, &mut amp, &mut opt, 0, bad);
        assert_eq!(amp.loss_scale(0).unwrap(), scale);
        assert_eq!(amp.scaler(0).unwrap().unskipped(), 0);
    }
}

/// Loads `bad` into an Amp with `num_losses` scalers (after a history that moved the state
/// away from the initial one) and checks it is `StateMismatch` with nothing applied.
fn rejects(num_losses: usize, bad: Value) {
    let (vs, mut amp, mut opt) = setup(num_losses);
    pass(&vs, &mut amp, &mut opt, 0, true);
    pass(&vs, &mut amp, &mut opt, 0, false);
    let before = state(&amp);
    let before_meta = (amp.scaler(0).unwrap().growth_interval(), amp.scaler(0).unwrap().factors());
    match amp.load_state_dict(&crate::common::value(bad.clone())) {
        Err(AmpError::State(StateError::StateMismatch { .. })) => {}
        other => panic!("{bad} with num_losses {num_losses}: {other:?}"),
    }
    assert_eq!(state(&amp), before, "{bad}: something was applied");
    assert_eq!((amp.scaler(0).unwrap().growth_interval(), amp.scaler(0).unwrap().factors()), before_meta);
}

fn ok_scaler() -> Value {
    json!({"loss_scale": 128.0, "unskipped": 3})
}

#[test]
fn rejects_unknown_keys() {
    rejects(1, json!({"loss_scaler0": ok_scaler(), "extra": 1}));
    rejects(1, json!({"loss_scaler0": ok_scaler(), "loss_scaler": ok_scaler()}));
    rejects(1, json!({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 3, "dynamic": true}}));
    rejects(1, json!({"scale": 128.0, "growth_factor": 2.0, "loss_scaler0": ok_scaler()}));
    rejects(1, json!({"scale": 128.0, "_growth_tracker": 0, "unknown": 1}));
    rejects(1, json!(["loss_scaler0"]));
}

#[test]
fn rejects_count_mismatch_and_missing_scalers() {
    rejects(1, json!({"loss_scaler0": ok_scaler(), "loss_scaler1": ok_scaler()}));
    rejects(2, json!({"loss_scaler0": ok_scaler()}));
    rejects(2, json!({"loss_scaler1": ok_scaler()}));
    rejects(2, json!({"loss_scaler0": ok_scaler(), "loss_scaler2": ok_scaler()}));
    rejects(2, json!({}));
    rejects(1, json!({"loss_scaler0": {"loss_scale": 128.0}}));
    rejects(1, json!({"loss_scaler0": {"unskipped": 3}}));
    // A GradScaler state without its scale.
    rejects(1, json!({"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0}));
}

#[test]
fn rejects_bad_scales() {
    // serde_json turns NaN and inf into null.
    for bad in [json!(-1.0), json!(0.0), json!(f64::NAN), json!(f64::INFINITY), json!("65536"), Value::Null] {
        rejects(1, json!({"loss_scaler0": {"loss_scale": bad, "unskipped": 0}}));
        rejects(
            1,
            json!({"scale": bad, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0}),
        );
    }
    rejects(1, json!({"loss_scaler0": {"loss_scale": 128.0, "unskipped": -1}}));
    // Bad GradScaler factors.
    rejects(1, json!({"scale": 128.0, "growth_factor": 0.5}));
    rejects(1, json!({"scale": 128.0, "backoff_factor": 2.0}));
    rejects(1, json!({"scale": 128.0, "growth_interval": 0}));
    rejects(1, json!({"scale": 128.0, "_growth_tracker": -3}));
}

/// Apex applies the valid entries, then raises; we apply none.
#[test]
fn rejects_without_half_applying() {
    rejects(2, json!({"loss_scaler0": ok_scaler(), "loss_scaler1": {"loss_scale": -1.0, "unskipped": 0}}));
    rejects(2, json!({"loss_scaler0": ok_scaler(), "loss_scaler1": ok_scaler(), "loss_scaler2": ok_scaler()}));
    rejects(2, json!({"loss_scaler0": ok_scaler(), "loss_scaler1": ok_scaler(), "foreign": 0}));
}

/// A GradScaler state holds one scaler: with num_losses 2 it is rejected.
#[test]
fn rejects_grad_scaler_state_for_two_losses() {
    rejects(
        2,
        json!({"scale": 2048.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 1}),
    );
}
