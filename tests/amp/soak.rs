//! Soak: 2,000 training steps with inf or NaN injected into one gradient element at 100 seeded
//! random steps (a random parameter: fp16 linear weights or fp32 batch-norm parameters under
//! O2; a random element; +inf, -inf or NaN), at O2, at O1, and with two losses and two
//! optimizers. Checked at every step: exactly the injected steps are skipped; no weight, batch-
//! norm statistic, master or optimizer state ever holds a non-finite value; each loss scale
//! (and its `unskipped` count) equals a first-principles replay of Apex's rules (÷2 on
//! overflow, not below the floor; ×2 after 2000 clean passes, not above the cap); and the
//! overflow diagnostics name exactly the injected parameter with one inf or one NaN.
//!
//! The floor is `min_loss_scale = 1` (DeepSpeed's default minimum): 100 overflows take Apex's
//! scale from 2^16 to it after 16 injections, and the model keeps learning there.
//!
//! Under tch-amp's defaults (floor 2^-24, growth interval 2000) this run does not survive: an
//! overflow every 20 steps on average halves the scale 40 times before 2,000 clean passes in a
//! row could double it once, the scale reaches the floor, the scaled gradients underflow to
//! exactly zero there, and after `collapse_limit` (20) such passes `step()` returns
//! `Divergence::GradientsVanished` (see reliability.rs). `min_loss_scale` (a floor the gradients
//! survive, 1 here) or `recovery_growth_interval(n)` (after a storm, double every `n` clean
//! passes until the scale is back where it was) keep such a run training; `collapse_limit(0)`
//! only silences the error.
use std::collections::BTreeMap;
use std::time::Instant;

use proptest::prelude::RngExt;
use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::scaling::NonFiniteGrad;
use tch_amp::{Amp, AmpConfig, AmpOptimizer, OptLevel, ScaleLossOptions, StepOutcome};

use crate::common::{all_finite, batch, deterministic_init, isolated, rng, Mlp};

const STEPS: usize = 2000;
const INJECTIONS: usize = 100;

/// Apex's dynamic scaler from first principles.
#[derive(Debug, Clone, Copy)]
struct Replay {
    scale: f64,
    unskipped: u64,
}

impl Replay {
    const FLOOR: f64 = 1.0;
    const CAP: f64 = 16_777_216.0;
    fn new() -> Self {
        Self { scale: 65536.0, unskipped: 0 }
    }
    fn pass(&mut self, overflow: bool) {
        if overflow {
            self.scale = (self.scale / 2.0).max(Self::FLOOR);
            self.unskipped = 0;
        } else {
            self.unskipped += 1;
            if self.unskipped == 2000 {
                self.scale = (self.scale * 2.0).min(Self::CAP);
                self.unskipped = 0;
            }
        }
    }
}

#[derive(Debug, Clone)]
struct Injection {
    loss_id: usize,
    param: String,
    element: i64,
    value: f64,
}

struct Summary {
    skipped: usize,
    injected: usize,
    final_scales: Vec<f64>,
    seconds: f64,
}

/// Everything that must stay finite: the model's variables (batch-norm statistics included),
/// the masters, and every optimizer buffer.
fn state_tensors(vs: &VarStore, opts: &[AmpOptimizer]) -> Vec<Tensor> {
    let mut out: Vec<Tensor> = vs.variables().into_values().collect();
    for o in opts {
        out.extend(o.master_params());
        for p in o.to_record().params {
            out.extend(p.buffers.into_values());
        }
    }
    out
}

fn soak(level: OptLevel, two: bool, seed: u64) -> Summary {
    let start = Instant::now();
    let num_losses = if two { 2 } else { 1 };
    let vs = VarStore::new(Device::Cpu);
    let net = Mlp::new(&vs.root());
    deterministic_init(&vs);
    let config = AmpConfig::new(level).min_loss_scale(1.0).num_losses(num_losses).verbosity(0);
    let mut amp = Amp::new(&config).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let mut opts: Vec<AmpOptimizer> = if two {
        vec![
            amp.optimizer_for(&vs, &["fc1"], nn::Adam::default(), 1e-3).unwrap(),
            amp.optimizer_for(&vs, &["bn1", "fc2"], nn::Sgd { momentum: 0.9, ..Default::default() }, 1e-2).unwrap(),
        ]
    } else {
        vec![amp.optimizer(&vs, nn::Adam::default(), 1e-3).unwrap()]
    };
    let kinds: BTreeMap<String, Kind> =
        vs.variables().into_iter().filter(|(_, v)| v.requires_grad()).map(|(k, v)| (k, v.kind())).collect();
    if level == OptLevel::O2 {
        assert_eq!(kinds["fc1.weight"], Kind::Half);
        assert_eq!(kinds["bn1.weight"], Kind::Float);
    }
    let names: Vec<String> = kinds.keys().cloned().collect();

    // The injection plan: 100 distinct steps, each with a loss, a parameter, an element, a value.
    let mut r = rng(seed);
    let mut plan: BTreeMap<usize, Injection> = BTreeMap::new();
    while plan.len() < INJECTIONS {
        let step = r.random_range(0..STEPS);
        let param = names[r.random_range(0..names.len())].clone();
        let numel = vs.variables()[&param].numel() as i64;
        let value = [f64::INFINITY, f64::NEG_INFINITY, f64::NAN][r.random_range(0..3usize)];
        let injection =
            Injection { loss_id: r.random_range(0..num_losses), param, element: r.random_range(0..numel), value };
        plan.entry(step).or_insert(injection);
    }

    let mut replays = vec![Replay::new(); num_losses];
    let mut skipped = 0;
    for step in 0..STEPS {
        let injection = plan.get(&step);
        for o in opts.iter_mut() {
            o.zero_grad().unwrap();
        }
        for (loss_id, replay) in replays.iter_mut().enumerate() {
            let (x, y) = batch((step * num_losses + loss_id) as i64, 16);
            let out = model.forward_t(&x, true);
            let loss = if loss_id == 0 {
                out.mse_loss(&y, tch::Reduction::Mean)
            } else {
                (out * 0.5).pow_tensor_scalar(2).mean(Kind::Float)
            };
            let inject = injection.filter(|i| i.loss_id == loss_id);
            let mut refs: Vec<&mut AmpOptimizer> = opts.iter_mut().collect();
            let outcome = amp
                .scale_loss_with(&loss, &mut refs, ScaleLossOptions { loss_id, delay_unscale: false }, |s| {
                    s.backward();
                    if let Some(i) = inject {
                        let g = vs.variables()[&i.param].grad();
                        let _ = g.view([-1]).get(i.element).fill_(i.value);
                    }
                })
                .unwrap();
            assert_eq!(outcome.overflow, inject.is_some(), "step {step} loss {loss_id}: overflow flag");
            replay.pass(inject.is_some());
            let scaler = amp.scaler(loss_id).unwrap();
            assert_eq!(
                (scaler.loss_scale(), scaler.unskipped()),
                (replay.scale, replay.unskipped),
                "step {step} loss {loss_id}: the scale left Apex's trajectory"
            );
            if let Some(i) = inject {
                let report = amp.last_overflow(loss_id).unwrap().unwrap();
                let want = NonFiniteGrad {
                    name: i.param.clone(),
                    inf: u64::from(i.value.is_infinite()),
                    nan: u64::from(i.value.is_nan()),
                };
                assert_eq!(report.params, [want], "step {step}: diagnostics");
                assert_eq!(report.new_loss_scale, replay.scale);
            }
        }
        for (k, o) in opts.iter_mut().enumerate() {
            let outcome = o.step().unwrap();
            match (injection, outcome) {
                (Some(i), StepOutcome::Skipped { loss_id, .. }) => assert_eq!(loss_id, i.loss_id),
                (None, StepOutcome::Stepped) => {}
                (i, o) => panic!("step {step} optimizer {k}: injection {i:?} but {o:?}"),
            }
            if !outcome.stepped() {
                skipped += 1;
            }
        }
        assert!(all_finite(&state_tensors(&vs, &opts)), "step {step}: a non-finite value reached the state");
    }
    let final_scales = (0..num_losses).map(|i| amp.loss_scale(i).unwrap()).collect();
    Summary { skipped, injected: plan.len(), final_scales, seconds: start.elapsed().as_secs_f64() }
}

fn check(level: OptLevel, two: bool, seed: u64) {
    let s = soak(level, two, seed);
    let optimizers = if two { 2 } else { 1 };
    assert_eq!(s.injected, INJECTIONS);
    assert_eq!(s.skipped, INJECTIONS * optimizers, "every injected step skipped by every optimizer, no other");
    eprintln!(
        "soak {level} {} loss(es): {STEPS} steps, {INJECTIONS} injections, {} skips, final scales {:?}, {:.1} s",
        optimizers, s.skipped, s.final_scales, s.seconds
    );
}

// Each soak runs in a child process with one intra-op thread (see `common::isolated`), bounded
// to 300 s; about 4 s each in a debug build on a loaded 2-core machine.

#[test]
fn soak_o2_2000_steps_100_injections() {
    isolated("soak::soak_o2_2000_steps_100_injections", 300, || check(OptLevel::O2, false, 16));
}

#[test]
fn soak_o1_2000_steps_100_injections() {
    isolated("soak::soak_o1_2000_steps_100_injections", 300, || check(OptLevel::O1, false, 17));
}

#[test]
fn soak_o2_two_losses_two_optimizers() {
    isolated("soak::soak_o2_two_losses_two_optimizers", 300, || check(OptLevel::O2, true, 18));
}
