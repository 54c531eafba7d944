//! The scaler's reliability features: DeepSpeed's hysteresis (against a first-principles
//! replay of DeepSpeed's `update_scale`), the scale collapse at the floor (a NaN loss at every
//! step, the silent all-zero gradients), the opt-in faster regrowth, overflow diagnostics and
//! their cost, the bounded scale history, the opt-in check of static scales, exact floats in
//! checkpoints and byte-reproducible checkpoint files.
use proptest::prelude::RngExt;
use serde_json::json;
use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::error::{ConfigError, Divergence, StateError};
use tch_amp::scaling::{LossScaler, NonFiniteGrad};
use tch_amp::{diagnostics, Amp, AmpConfig, AmpError, AmpModel, AmpOptimizer, OptLevel, StepOutcome};

use crate::common::{batch, deterministic_init, rng, Mlp};

const FLOOR: f64 = LossScaler::DEFAULT_MIN_LOSS_SCALE;

struct Run {
    vs: VarStore,
    model: AmpModel<Mlp>,
    amp: Amp,
    opt: AmpOptimizer,
}

fn run(config: AmpConfig) -> Run {
    let vs = VarStore::new(Device::Cpu);
    let net = Mlp::new(&vs.root());
    deterministic_init(&vs);
    let amp = Amp::new(&config.verbosity(0)).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let opt = amp.optimizer(&vs, nn::Adam::default(), 1e-3).unwrap();
    Run { vs, model, amp, opt }
}

/// One iteration; `nan` multiplies the loss by NaN.
fn iteration(r: &mut Run, seed: i64, nan: bool) -> tch_amp::Result<StepOutcome> {
    let (x, y) = batch(seed, 16);
    let mut loss = r.model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
    if nan {
        loss *= f64::NAN;
    }
    r.opt.zero_grad()?;
    r.amp.scale_loss(&loss, &mut [&mut r.opt], |s| s.backward())?;
    r.opt.step()
}

/// DeepSpeed's `DynamicLossScaler.update_scale` from first principles (hysteresis k =
/// `delayed_shift`), with tch-amp's floor and cap applied to the new scale.
struct DeepSpeedReplay {
    scale: f64,
    iter: i64,
    last_overflow: i64,
    k: u32,
    left: u32,
    consecutive: bool,
    window: i64,
}

impl DeepSpeedReplay {
    fn update(&mut self, overflow: bool) {
        if overflow {
            if self.k == 1 || self.left == 1 {
                self.scale = (self.scale / 2.0).max(1.0);
            } else {
                self.left -= 1;
            }
            self.last_overflow = self.iter;
        } else {
            if self.consecutive {
                self.left = self.k;
            }
            if (self.iter - self.last_overflow) % self.window == 0 {
                if !self.consecutive {
                    self.left = self.k;
                }
                self.scale = (self.scale * 2.0).min(LossScaler::DEFAULT_MAX_LOSS_SCALE);
            }
        }
        self.iter += 1;
    }
}

/// Random overflow sequences (30 % overflows, growth interval 5 from a GradScaler state):
/// the scale follows DeepSpeed's rule for hysteresis 1, 2, 3 and 5, with and without
/// consecutive hysteresis; hysteresis 1 is Apex's scaler.
#[test]
fn hysteresis_follows_deepspeed() {
    let mut r = rng(3);
    for k in [1u32, 2, 3, 5] {
        for consecutive in [false, true] {
            let config = AmpConfig::new(OptLevel::O2)
                .min_loss_scale(1.0)
                .hysteresis(k)
                .consecutive_hysteresis(consecutive)
                .collapse_limit(0);
            let mut amp = Amp::new(&config.verbosity(0)).unwrap();
            amp.load_state_dict(&crate::common::value(
                json!({"scale": 65536.0, "growth_interval": 5, "_growth_tracker": 0}),
            ))
            .unwrap();
            let mut reference =
                DeepSpeedReplay { scale: 65536.0, iter: 0, last_overflow: -1, k, left: k, consecutive, window: 5 };
            let mut scaler = amp.scaler(0).unwrap().clone();
            for pass in 0..5000 {
                let overflow = r.random_bool(0.3);
                assert_eq!(scaler.update(overflow), overflow, "an overflow always skips");
                reference.update(overflow);
                assert_eq!(scaler.loss_scale(), reference.scale, "k={k} consecutive={consecutive} pass {pass}");
                assert_eq!(scaler.hysteresis_left(), reference.left, "k={k} consecutive={consecutive} pass {pass}");
            }
        }
    }
}

/// Hysteresis 3: the first two overflows skip but keep the scale; the third halves it and
/// the counter stays at 1 until the next growth restores it.
#[test]
fn hysteresis_three_by_hand() {
    let props = AmpConfig::new(OptLevel::O2).hysteresis(3).build().unwrap();
    assert_eq!((props.hysteresis(), props.consecutive_hysteresis()), (3, false));
    let mut s = LossScaler::new(&props);
    let mut seen = vec![];
    for _ in 0..5 {
        assert!(s.update(true));
        seen.push((s.loss_scale(), s.hysteresis_left()));
    }
    assert_eq!(seen, [(65536.0, 2), (65536.0, 1), (32768.0, 1), (16384.0, 1), (8192.0, 1)]);
    for _ in 0..2000 {
        assert!(!s.update(false));
    }
    assert_eq!((s.loss_scale(), s.hysteresis_left()), (16384.0, 3));
    // Only real changes enter the history.
    assert_eq!(s.history().len(), 4);
    // Rejected: hysteresis 0.
    assert!(matches!(
        AmpConfig::new(OptLevel::O2).hysteresis(0).build(),
        Err(AmpError::Config(ConfigError::InvalidOption { option: "hysteresis", .. }))
    ));
    // DeepSpeed's option names through from_apex.
    let props = AmpConfig::from_apex("O2", &[("hysteresis", "2"), ("consecutive_hysteresis", "True")])
        .unwrap()
        .build()
        .unwrap();
    assert_eq!((props.hysteresis(), props.consecutive_hysteresis()), (2, true));
    assert!(AmpConfig::from_apex("O2", &[("hysteresis", "two")]).is_err());
}

/// The hysteresis counter is part of the state dict when k > 1 (and only then: a default
/// scaler writes exactly Apex's form); Apex's form loads into a scaler with hysteresis
/// (counter restored to k); checkpoints round-trip it; out-of-range counters are refused.
#[test]
fn hysteresis_state_round_trips() {
    let mut a = run(AmpConfig::new(OptLevel::O2).hysteresis(3));
    assert!(iteration(&mut a, 0, true).unwrap() == StepOutcome::Skipped { loss_id: 0, loss_scale: 65536.0 });
    let state = crate::common::json(&a.amp.state_dict());
    assert_eq!(state, json!({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0, "hysteresis_left": 2}}));
    let text = state.to_string();
    let mut b = run(AmpConfig::new(OptLevel::O2).hysteresis(3));
    b.amp.load_state_dict(&crate::common::value(serde_json::from_str(&text).unwrap())).unwrap();
    assert_eq!(b.amp.scaler(0).unwrap().hysteresis_left(), 2);
    // Apex's form into it: the counter is k.
    b.amp
        .load_state_dict(&crate::common::value(json!({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}})))
        .unwrap();
    assert_eq!(b.amp.scaler(0).unwrap().hysteresis_left(), 3);
    // A default scaler writes Apex's form exactly.
    let d = run(AmpConfig::new(OptLevel::O2));
    assert_eq!(
        crate::common::json(&d.amp.state_dict()),
        json!({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}})
    );
    for bad in [0, 4] {
        let before = crate::common::json(&b.amp.state_dict());
        let err = b
            .amp
            .load_state_dict(&crate::common::value(
                json!({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 0, "hysteresis_left": bad}}),
            ))
            .unwrap_err();
        assert!(matches!(err, AmpError::State(StateError::StateMismatch { .. })), "{err}");
        assert_eq!(crate::common::json(&b.amp.state_dict()), before);
    }
    // Through a checkpoint.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.safetensors");
    assert!(iteration(&mut a, 1, true).unwrap() == StepOutcome::Skipped { loss_id: 0, loss_scale: 65536.0 });
    tch_amp::save_checkpoint(&path, &a.vs, &[&a.opt], &a.amp).unwrap();
    let mut c = run(AmpConfig::new(OptLevel::O2).hysteresis(3));
    tch_amp::load_checkpoint(&path, &c.vs, &mut [&mut c.opt], &mut c.amp).unwrap();
    assert_eq!(c.amp.scaler(0).unwrap().hysteresis_left(), 1);
    assert_eq!(crate::common::json(&c.amp.state_dict()), crate::common::json(&a.amp.state_dict()));
}

/// A loss that is NaN at every step: 40 overflows take the scale from 2^16 to the floor 2^-24
/// (passes 0..=39), 20 more at the floor (passes 40..=59) end in ScaleCollapsed from step(),
/// naming the passes, the scale and the first parameters in model order (creation order:
/// fc1, bn1, fc2; sorted names would start with bn1). With collapse_limit(0) it skips forever,
/// as Apex.
#[test]
fn nan_loss_every_step_ends_in_scale_collapsed() {
    let mut r = run(AmpConfig::new(OptLevel::O2));
    for step in 0..59 {
        let outcome = iteration(&mut r, step, true).unwrap();
        assert!(!outcome.stepped(), "step {step}");
    }
    assert_eq!(r.amp.loss_scale(0).unwrap(), FLOOR);
    assert_eq!(r.amp.scaler(0).unwrap().overflows_at_floor(), 19);
    let err = iteration(&mut r, 59, true).unwrap_err();
    match &err {
        AmpError::Diverged(Divergence::ScaleCollapsed {
            loss_id,
            first_pass,
            last_pass,
            passes,
            loss_scale,
            params,
        }) => {
            assert_eq!((*loss_id, *first_pass, *last_pass, *passes), (0, 40, 59, 20));
            assert_eq!(*loss_scale, FLOOR);
            // tch's linear creates its bias before its weight.
            assert_eq!(params, &["fc1.bias", "fc1.weight", "bn1.weight", "bn1.bias", "fc2.bias"]);
        }
        other => panic!("{other}"),
    }
    let text = err.to_string();
    assert!(text.contains("passes 40..=59") && text.contains("learning rate"), "{text}");
    // The step was skipped all the same (nothing non-finite reached the weights).
    assert_eq!(r.opt.step_counts(), (0, 60));
    assert!(crate::common::all_finite(&r.vs.variables().into_values().collect::<Vec<_>>()));

    let mut r = run(AmpConfig::new(OptLevel::O2).collapse_limit(0));
    for step in 0..200 {
        assert!(!iteration(&mut r, step, true).unwrap().stepped());
    }
}

/// The silent collapse the issue measured: after a storm the scale sits at the 2^-24 floor,
/// where every scaled fp16 gradient underflows to exactly zero. 20 such clean passes end in
/// GradientsVanished (the step is not taken). With recovery_growth_interval(10) the scale
/// regrows ×2 every 10 clean passes back to its pre-storm value, then by Apex's 2000.
#[test]
fn zero_gradients_at_the_floor_are_reported_and_fast_regrowth_recovers() {
    let mut r = run(AmpConfig::new(OptLevel::O2));
    for step in 0..40 {
        assert!(!iteration(&mut r, step, true).unwrap().stepped());
    }
    assert_eq!(r.amp.loss_scale(0).unwrap(), FLOOR);
    for step in 40..59 {
        assert!(iteration(&mut r, step, false).unwrap().stepped(), "step {step}");
    }
    match iteration(&mut r, 59, false).unwrap_err() {
        AmpError::Diverged(Divergence::GradientsVanished {
            loss_id: 0,
            first_pass: 40,
            last_pass: 59,
            passes: 20,
            loss_scale,
        }) => {
            assert_eq!(loss_scale, FLOOR)
        }
        other => panic!("{other}"),
    }
    assert_eq!(r.opt.step_counts(), (19, 40));

    let mut r = run(AmpConfig::new(OptLevel::O2).recovery_growth_interval(10));
    for step in 0..40 {
        assert!(!iteration(&mut r, step, true).unwrap().stepped());
    }
    assert_eq!(r.amp.scaler(0).unwrap().recovery_target(), Some(65536.0));
    for i in 1..=400u32 {
        assert!(iteration(&mut r, 40 + i64::from(i), false).unwrap().stepped());
        let want = FLOOR * 2f64.powi((i / 10) as i32);
        assert_eq!(r.amp.loss_scale(0).unwrap(), want, "clean pass {i}");
    }
    assert_eq!(r.amp.loss_scale(0).unwrap(), 65536.0);
    assert_eq!(r.amp.scaler(0).unwrap().recovery_target(), None);
    for i in 0..10 {
        assert!(iteration(&mut r, 500 + i, false).unwrap().stepped());
    }
    assert_eq!(r.amp.loss_scale(0).unwrap(), 65536.0, "back to Apex's interval");
    assert!(matches!(
        AmpConfig::new(OptLevel::O2).recovery_growth_interval(0).build(),
        Err(AmpError::Config(ConfigError::InvalidOption { option: "recovery_growth_interval", .. }))
    ));
}

/// Diagnostics: the parameters with non-finite gradients in model order with inf and NaN
/// counts, the printed lines, and no gradient inspection at all on clean passes (the thread's
/// scan counter stays put for 300 clean iterations, then moves by one per overflow).
#[test]
fn overflow_diagnostics_and_zero_cost_on_clean_passes() {
    let mut r = run(AmpConfig::new(OptLevel::O2));
    let scans = diagnostics::gradient_scans();
    for step in 0..300 {
        assert!(iteration(&mut r, step, false).unwrap().stepped());
    }
    assert_eq!(diagnostics::gradient_scans(), scans, "a clean pass inspected the gradients");
    assert!(r.opt.last_overflow().is_none() && r.amp.last_overflow(0).unwrap().is_none());

    let (x, y) = batch(7, 16);
    let loss = r.model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
    r.opt.zero_grad().unwrap();
    let v = r.vs.variables();
    r.amp
        .scale_loss(&loss, &mut [&mut r.opt], |s| {
            s.backward();
            let g = v["fc2.weight"].grad().view([-1]);
            for i in [0, 5, 9] {
                let _ = g.get(i).fill_(if i == 5 { f64::NEG_INFINITY } else { f64::INFINITY });
            }
            let g = v["bn1.bias"].grad();
            let _ = g.get(3).fill_(f64::NAN);
            let _ = g.get(4).fill_(f64::NAN);
        })
        .unwrap();
    assert_eq!(diagnostics::gradient_scans(), scans + 1);
    let want = vec![
        NonFiniteGrad { name: "bn1.bias".into(), inf: 0, nan: 2 },
        NonFiniteGrad { name: "fc2.weight".into(), inf: 3, nan: 0 },
    ];
    let report = r.amp.last_overflow(0).unwrap().unwrap().clone();
    assert_eq!(report.params, want);
    assert_eq!((report.pass, report.loss_scale, report.new_loss_scale), (300, 65536.0, 32768.0));
    assert_eq!(
        report.to_string(),
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768\n  non-finite gradients: \
         bn1.bias (0 inf, 2 NaN); fc2.weight (3 inf, 0 NaN)"
    );
    assert_eq!(r.opt.step().unwrap(), StepOutcome::Skipped { loss_id: 0, loss_scale: 32768.0 });
    assert_eq!(r.opt.last_overflow(), Some(&report));
}

/// The history is a ring buffer of the last `scale_history_len` changes.
#[test]
fn scale_history_is_a_ring_buffer() {
    let mut s = LossScaler::new(&AmpConfig::new(OptLevel::O2).scale_history_len(4).build().unwrap());
    for _ in 0..10 {
        s.update(true);
    }
    let passes: Vec<u64> = s.history().iter().map(|c| c.pass).collect();
    assert_eq!(passes, [6, 7, 8, 9]);
    assert_eq!(s.history()[3].to, 65536.0 / 1024.0);
    let s = LossScaler::new(&AmpConfig::new(OptLevel::O2).build().unwrap());
    assert_eq!(LossScaler::DEFAULT_HISTORY_LEN, 256);
    let mut s2 = s.clone();
    for _ in 0..1000 {
        s2.update(true);
    }
    assert_eq!(s2.history().len(), 40, "only real changes: 40 halvings to the floor");
}

/// Static scales: Apex never checks (a NaN loss at O0 reaches the weights, 50 × Stepped); with
/// check_static_overflow the step is skipped with diagnostics, the scale stays, and 20 in a
/// row end in ScaleCollapsed.
#[test]
fn static_scales_opt_in_check() {
    let mut r = run(AmpConfig::new(OptLevel::O0));
    for step in 0..3 {
        assert!(iteration(&mut r, step, true).unwrap().stepped());
    }
    assert!(!crate::common::all_finite(&r.opt.master_params()), "Apex's default: the NaN reaches the weights");

    let mut r = run(AmpConfig::new(OptLevel::O0).check_static_overflow(true));
    let before: Vec<Tensor> = r.vs.variables().into_values().map(|t| t.copy()).collect();
    for step in 0..19 {
        assert_eq!(iteration(&mut r, step, true).unwrap(), StepOutcome::Skipped { loss_id: 0, loss_scale: 1.0 });
    }
    let report = r.amp.last_overflow(0).unwrap().unwrap();
    assert!(!report.dynamic && report.overflows_at_floor == 19 && report.params.len() == 6, "{report:?}");
    assert!(matches!(
        iteration(&mut r, 19, true),
        Err(AmpError::Diverged(Divergence::ScaleCollapsed { passes: 20, .. }))
    ));
    let after: Vec<Tensor> = r.vs.variables().into_values().map(|t| t.copy()).collect();
    assert_eq!(before.len(), after.len());
    // The model's variables, batch-norm statistics aside (the forward updates them), are untouched.
    for (name, t) in r.vs.variables() {
        if name.contains("running") {
            continue;
        }
        assert!(crate::common::all_finite(&[t]), "{name}");
    }
    // A clean pass still steps, and the loss did not pass through unchecked.
    let (x, y) = batch(99, 16);
    let loss = r.model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
    r.opt.zero_grad().unwrap();
    let out = r.amp.scale_loss(&loss, &mut [&mut r.opt], |s| s.backward()).unwrap();
    assert!(!out.passed_through && !out.overflow);
    assert!(r.opt.step().unwrap().stepped());
}

/// Scales and learning rates survive a checkpoint bit for bit: 10^4 random learning rates
/// (any finite non-negative f64, subnormals included) and 10^4 random loss scales in
/// [2^-24, 2^24), 100 of each per file (100 parameter groups, 100 losses), 100 files.
#[test]
fn floats_round_trip_bit_exactly() {
    let mut r = rng(11);
    let dir = tempfile::tempdir().unwrap();
    let setup = || {
        let vs = VarStore::new(Device::Cpu);
        for g in 0..100 {
            let _ = vs.root().set_group(g).var(&format!("p{g:03}"), &[2], nn::Init::Const(0.5));
        }
        let amp = Amp::new(&AmpConfig::new(OptLevel::O1).num_losses(100).verbosity(0)).unwrap();
        let opt = amp.optimizer(&vs, nn::Sgd::default(), 0.1).unwrap();
        (vs, amp, opt)
    };
    // Any f64 bit pattern the loaders accept: finite, and neither inf nor flushed to 0 in the
    // fp32 the update computes in (OptimizerRecord::validate refuses those).
    let mut random_lr = || loop {
        let v = f64::from_bits(r.random::<u64>() & !(1u64 << 63));
        let f = v as f32;
        if v.is_finite() && f.is_finite() && f != 0.0 {
            return v;
        }
    };
    let mut values = 0;
    for file in 0..100 {
        let (vs, mut amp, mut opt) = setup();
        let base = random_lr();
        opt.set_lr(base).unwrap();
        let lrs: Vec<f64> = (0..100).map(|_| random_lr()).collect();
        for (g, &lr) in lrs.iter().enumerate() {
            opt.set_lr_group(g, lr).unwrap();
        }
        let mut state = serde_json::Map::new();
        let mut r2 = rng(1000 + file);
        let scales: Vec<f64> =
            (0..100).map(|_| 2f64.powi(r2.random_range(-24..24)) * (1.0 + r2.random::<f64>())).collect();
        for (i, s) in scales.iter().enumerate() {
            state.insert(format!("loss_scaler{i}"), json!({"loss_scale": s, "unskipped": i}));
        }
        // Through the JSON text, as a user's file would carry it.
        let text = serde_json::to_string(&serde_json::Value::Object(state)).unwrap();
        amp.load_state_dict(&crate::common::value(serde_json::from_str(&text).unwrap())).unwrap();
        let path = dir.path().join(format!("f{file}.safetensors"));
        tch_amp::save_checkpoint(&path, &vs, &[&opt], &amp).unwrap();
        let (vs2, mut amp2, mut opt2) = setup();
        tch_amp::load_checkpoint(&path, &vs2, &mut [&mut opt2], &mut amp2).unwrap();
        assert_eq!(opt2.lr().to_bits(), base.to_bits());
        for (g, lr) in lrs.iter().enumerate() {
            assert_eq!(opt2.lr_group(g).to_bits(), lr.to_bits(), "file {file} group {g}: {lr:e}");
        }
        for (i, s) in scales.iter().enumerate() {
            assert_eq!(amp2.loss_scale(i).unwrap().to_bits(), s.to_bits(), "file {file} scaler {i}: {s:e}");
        }
        values += lrs.len() + scales.len();
    }
    assert_eq!(values, 20_000);
}

/// Two identical runs write identical checkpoint bytes, and saving one state twice too.
#[test]
fn checkpoints_are_byte_reproducible() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = vec![];
    for run_id in 0..2 {
        let mut r = run(AmpConfig::new(OptLevel::O2).num_losses(1));
        for step in 0..3 {
            assert!(iteration(&mut r, step, step == 1).is_ok());
        }
        for copy in 0..2 {
            let path = dir.path().join(format!("run{run_id}-{copy}.safetensors"));
            tch_amp::save_checkpoint(&path, &r.vs, &[&r.opt], &r.amp).unwrap();
            files.push(std::fs::read(&path).unwrap());
        }
    }
    assert!(files.len() == 4 && files.iter().all(|f| f == &files[0]), "checkpoint bytes differ");
    let _ = Kind::Float;
}
