//! The loss scaler's state machine (Apex's `apex/amp/scaler.py`: initial min(2^16, max),
//! ÷2 on overflow with `unskipped` reset, ×2 after 2000 clean backward passes, capped at
//! `max_loss_scale`, floored at `min_loss_scale`; static scales never check nor skip), and a
//! real overflow under O2 through `scale_loss` and `step`.

use std::collections::BTreeMap;

use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::scaling::{LossScaler, ScaleChange, ScaleChangeReason};
use tch_amp::{Amp, AmpConfig, AmpOptimizer, LossScale, OptLevel, ScaleLossOptions, StepOutcome};

fn scaler(config: AmpConfig) -> LossScaler {
    LossScaler::new(&config.build().unwrap())
}

fn o2() -> AmpConfig {
    AmpConfig::new(OptLevel::O2).verbosity(0)
}

/// Runs `n` clean passes; none may ask for a skip.
fn clean(s: &mut LossScaler, n: u64) {
    for _ in 0..n {
        assert!(!s.update(false));
    }
}

/// `init_loss_scale` (BERT's `amp._amp_state.loss_scalers[0]._loss_scale = args.init_loss_scale`):
/// every dynamic scaler starts there; refused with a static scale or outside [min, max].
#[test]
fn init_loss_scale_sets_the_dynamic_start() {
    assert_eq!(scaler(o2().init_loss_scale(1024.0)).loss_scale(), 1024.0);
    let amp = Amp::new(&o2().num_losses(2).init_loss_scale(2f64.powi(20))).unwrap();
    assert_eq!((amp.loss_scale(0).unwrap(), amp.loss_scale(1).unwrap()), (2f64.powi(20), 2f64.powi(20)));
    for bad in [
        o2().loss_scale(128.0).init_loss_scale(1024.0),
        o2().max_loss_scale(512.0).init_loss_scale(1024.0),
        o2().min_loss_scale(2048.0).init_loss_scale(1024.0),
        o2().init_loss_scale(0.0),
        o2().init_loss_scale(f64::NAN),
    ] {
        let e = bad.build().unwrap_err();
        assert!(e.to_string().contains("init_loss_scale"), "{e}");
    }
}

#[test]
fn initial_scale_is_2_pow_16_capped_by_max() {
    assert_eq!(LossScaler::INITIAL_DYNAMIC_SCALE, 65536.0);
    assert_eq!(LossScaler::DEFAULT_MAX_LOSS_SCALE, 16_777_216.0);
    let s = scaler(o2());
    assert!(s.is_dynamic());
    assert_eq!(s.loss_scale(), 65536.0);
    assert_eq!(s.max_loss_scale(), 2f64.powi(24));
    assert_eq!((s.unskipped(), s.passes(), s.overflows()), (0, 0, 0));
    assert!(s.history().is_empty());
    // min(max_loss_scale, 2^16), as Apex.
    assert_eq!(scaler(o2().max_loss_scale(1024.0)).loss_scale(), 1024.0);
    assert_eq!(scaler(o2().max_loss_scale(1e6)).loss_scale(), 65536.0);
    // O1 is dynamic too; O0 and O3 are static 1.0.
    assert_eq!(scaler(AmpConfig::new(OptLevel::O1)).loss_scale(), 65536.0);
    for level in [OptLevel::O0, OptLevel::O3] {
        let s = scaler(AmpConfig::new(level));
        assert!(!s.is_dynamic());
        assert_eq!(s.loss_scale(), 1.0);
    }
}

/// The scale doubles exactly at the 2000th consecutive clean pass, not at the 1999th.
#[test]
fn growth_exactly_at_2000_clean_passes() {
    assert_eq!(LossScaler::GROWTH_INTERVAL, 2000);
    let mut s = scaler(o2());
    assert_eq!(s.growth_interval(), 2000);
    clean(&mut s, 1999);
    assert_eq!(s.loss_scale(), 65536.0, "grew before the 2000th pass");
    assert_eq!(s.unskipped(), 1999);
    assert!(s.history().is_empty());
    clean(&mut s, 1);
    assert_eq!(s.loss_scale(), 131072.0);
    assert_eq!(s.unskipped(), 0);
    assert_eq!(
        s.history(),
        [ScaleChange { pass: 1999, from: 65536.0, to: 131072.0, reason: ScaleChangeReason::Growth }]
    );
    clean(&mut s, 1999);
    assert_eq!(s.loss_scale(), 131072.0);
    clean(&mut s, 1);
    assert_eq!(s.loss_scale(), 262144.0);
    assert_eq!(s.history().len(), 2);
    assert_eq!(s.history()[1].pass, 3999);
    assert_eq!(s.passes(), 4000);
}

/// Growth stops at max_loss_scale; the counter still resets at each interval (Apex).
#[test]
fn growth_capped_at_max_loss_scale() {
    let mut s = scaler(o2().max_loss_scale(131072.0));
    clean(&mut s, 2000);
    assert_eq!(s.loss_scale(), 131072.0);
    clean(&mut s, 2000);
    assert_eq!(s.loss_scale(), 131072.0);
    assert_eq!(s.unskipped(), 0);
    // A cap that is not a power of two is reached exactly: min(2 * 65536, 100000).
    let mut s = scaler(o2().max_loss_scale(100_000.0));
    clean(&mut s, 2000);
    assert_eq!(s.loss_scale(), 100_000.0);
    clean(&mut s, 4000);
    assert_eq!(s.loss_scale(), 100_000.0);
    // At Apex's default cap 2^24 (8 doublings from 2^16).
    let mut s = scaler(o2());
    clean(&mut s, 2000 * 10);
    assert_eq!(s.loss_scale(), 16_777_216.0);
}

/// An overflow halves the scale, asks for a skip and resets `unskipped`; growth then needs
/// 2000 new clean passes.
#[test]
fn overflow_halves_and_resets_unskipped() {
    let mut s = scaler(o2());
    clean(&mut s, 5);
    assert_eq!(s.unskipped(), 5);
    assert!(s.update(true), "an overflow must ask for a skipped step");
    assert_eq!(s.loss_scale(), 32768.0);
    assert_eq!(s.unskipped(), 0);
    assert_eq!(s.overflows(), 1);
    clean(&mut s, 1998);
    assert!(s.update(true));
    assert_eq!(s.loss_scale(), 16384.0, "1998 clean passes after an overflow must not grow");
    clean(&mut s, 2000);
    assert_eq!(s.loss_scale(), 32768.0);
    // Every change, in order, with its reason and the index of the pass that caused it.
    assert_eq!(
        s.history(),
        [
            ScaleChange { pass: 5, from: 65536.0, to: 32768.0, reason: ScaleChangeReason::Overflow },
            ScaleChange { pass: 2004, from: 32768.0, to: 16384.0, reason: ScaleChangeReason::Overflow },
            ScaleChange { pass: 4004, from: 16384.0, to: 32768.0, reason: ScaleChangeReason::Growth },
        ]
    );
    assert_eq!((s.passes(), s.overflows(), s.unskipped()), (4005, 2, 0));
}

/// `max(min_loss_scale, scale / 2)`, as Apex when min_loss_scale is given; the step is still
/// skipped at the floor.
#[test]
fn overflow_floors_at_min_loss_scale() {
    let mut s = scaler(o2().min_loss_scale(1000.0));
    assert_eq!(s.min_loss_scale(), 1000.0);
    let mut seen = vec![];
    for _ in 0..10 {
        assert!(s.update(true));
        seen.push(s.loss_scale());
    }
    assert_eq!(seen, [32768.0, 16384.0, 8192.0, 4096.0, 2048.0, 1024.0, 1000.0, 1000.0, 1000.0, 1000.0]);
    // Growth from the floor doubles it.
    clean(&mut s, 2000);
    assert_eq!(s.loss_scale(), 2000.0);
}

/// Without min_loss_scale, Apex halves forever (users saw 1e-316); tch-amp stops at
/// LossScaler::DEFAULT_MIN_LOSS_SCALE = 2^-24, a normal number in f32 and f64, never zero.
#[test]
fn default_floor_is_2_pow_minus_24() {
    assert_eq!(LossScaler::DEFAULT_MIN_LOSS_SCALE, 2f64.powi(-24));
    let mut s = scaler(o2());
    assert_eq!(s.min_loss_scale(), LossScaler::DEFAULT_MIN_LOSS_SCALE);
    for i in 1..=2000 {
        assert!(s.update(true));
        let v = s.loss_scale();
        assert!(v > 0.0 && v.is_normal() && (v as f32).is_normal(), "scale {v} after {i} overflows");
        if i <= 40 {
            assert_eq!(v, 65536.0 * 0.5f64.powi(i), "halving {i}");
        }
    }
    assert_eq!(s.loss_scale(), LossScaler::DEFAULT_MIN_LOSS_SCALE);
    assert_eq!(s.overflows(), 2000);
}

/// A static scale never checks, never skips, never changes.
#[test]
fn static_scaler_never_skips_nor_changes() {
    let props = o2().loss_scale(128.0).build().unwrap();
    assert_eq!(props.loss_scale(), LossScale::Static(128.0));
    let mut s = LossScaler::new(&props);
    assert!(!s.is_dynamic());
    for i in 0..5000u32 {
        assert!(!s.update(i % 3 == 0), "a static scaler skipped");
        assert_eq!(s.loss_scale(), 128.0);
    }
    assert!(s.history().is_empty());
    assert_eq!(s.overflows(), 0);
}

// ---------------------------------------------------------------------------------------
// Through Amp: scale_loss and step under O2.

const C_W: [f32; 4] = [0.5, -0.25, 0.75, 0.125];
const C_BN: [f32; 2] = [0.375, -0.625];

/// An O2 model: `w` [4] (cast to fp16, with an fp32 master) and an affine batch norm `bn`
/// (kept fp32: its own master); Adam.
fn o2_model(config: AmpConfig) -> (VarStore, Amp, AmpOptimizer) {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var_copy("w", &Tensor::from_slice(&[1.0f32, -2.0, 0.5, 3.0]));
    // Deterministic init (the global RNG is shared by tests running in parallel).
    let bn_config =
        nn::BatchNormConfig { ws_init: nn::Init::Const(0.8), bs_init: nn::Init::Const(0.1), ..Default::default() };
    let _bn = nn::batch_norm1d(vs.root() / "bn", 2, bn_config);
    let amp = Amp::new(&config).unwrap();
    let _model = amp.cast_model(&vs, ()).unwrap();
    assert_eq!(vs.variables()["w"].kind(), Kind::Half);
    assert_eq!(vs.variables()["bn.weight"].kind(), Kind::Float);
    let opt =
        amp.optimizer(&vs, nn::Adam { beta1: 0.9, beta2: 0.999, wd: 0.0, eps: 1e-8, amsgrad: false }, 0.01).unwrap();
    (vs, amp, opt)
}

/// A linear loss: its gradients are C_W and C_BN exactly, and stay exact in fp16 under any
/// power-of-two scale in use here.
fn loss_of(vs: &VarStore) -> Tensor {
    let v = vs.variables();
    (v["w"].to_kind(Kind::Float) * Tensor::from_slice(&C_W)).sum(Kind::Float)
        + (&v["bn.weight"] * Tensor::from_slice(&C_BN)).sum(Kind::Float)
        + v["bn.bias"].sum(Kind::Float)
}

/// Where to put the inf.
#[derive(Debug, Clone, Copy)]
enum Inject {
    None,
    /// `loss * inf`.
    Loss,
    /// One element of the fp16 `w`'s grad set to inf inside the backward closure.
    Fp16Grad,
    /// One element of the fp32 `bn.weight`'s grad set to NaN inside the backward closure.
    Fp32Grad,
}

fn iteration(vs: &VarStore, amp: &mut Amp, opt: &mut AmpOptimizer, inject: Inject) -> (bool, StepOutcome) {
    opt.zero_grad().unwrap();
    let mut loss = loss_of(vs);
    if let Inject::Loss = inject {
        loss *= f64::from(f32::INFINITY);
    }
    let v = vs.variables();
    let out = amp
        .scale_loss(&loss, &mut [&mut *opt], |s| {
            s.backward();
            let _ = match inject {
                Inject::Fp16Grad => v["w"].grad().get(2).fill_(f64::INFINITY),
                Inject::Fp32Grad => v["bn.weight"].grad().get(0).fill_(f64::NAN),
                _ => Tensor::new(),
            };
        })
        .unwrap();
    assert!(!out.passed_through);
    (out.overflow, opt.step().unwrap())
}

/// Everything a step could change: model variables (fp16 and fp32, batch-norm stats
/// included) and the masters.
fn snapshot(vs: &VarStore, opt: &AmpOptimizer) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(k, v)| (k, v.copy())).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, m) in opt.param_names().iter().zip(opt.master_params()) {
        out.push((format!("master:{name}"), m.copy()));
    }
    out
}

/// The optimizer state (Adam's moments and per-parameter step counts) as saved in a
/// checkpoint: name -> bytes.
fn optimizer_state(vs: &VarStore, opt: &AmpOptimizer, amp: &Amp) -> BTreeMap<String, Vec<u8>> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.safetensors");
    tch_amp::save_checkpoint(&path, vs, &[opt], amp).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .filter(|(name, _)| name.starts_with("optimizer"))
        .map(|(name, view)| (name, view.data().to_vec()))
        .collect()
}

fn assert_same(what: &str, a: &[(String, Tensor)], b: &[(String, Tensor)]) {
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        assert!(crate::common::same(ta, tb), "{what}: {na} differs (max diff {})", crate::common::max_abs_diff(ta, tb));
    }
}

/// A real overflow under O2: scale_loss reports it, the scale halves, step() is
/// `Skipped{..}` and changes nothing (weights, masters, Adam's moments and step count: the
/// run continues exactly as if the bad iteration had never happened), then the next clean
/// iteration steps at the halved scale.
#[test]
fn o2_overflow_skips_the_step_and_touches_nothing() {
    for inject in [Inject::Loss, Inject::Fp16Grad, Inject::Fp32Grad] {
        let (vs, mut amp, mut opt) = o2_model(o2());
        let (overflow, outcome) = iteration(&vs, &mut amp, &mut opt, Inject::None);
        assert!(!overflow && outcome == StepOutcome::Stepped);

        let before = snapshot(&vs, &opt);
        let state_before = optimizer_state(&vs, &opt, &amp);
        assert!(state_before.keys().any(|k| k.ends_with("w/exp_avg_sq")), "{:?}", state_before.keys());
        let (overflow, outcome) = iteration(&vs, &mut amp, &mut opt, inject);
        assert!(overflow, "{inject:?}: scale_loss did not report the overflow");
        assert_eq!(outcome, StepOutcome::Skipped { loss_id: 0, loss_scale: 32768.0 }, "{inject:?}");
        assert!(!outcome.stepped());
        assert_eq!(amp.loss_scale(0).unwrap(), 32768.0);
        assert_eq!(amp.scaler(0).unwrap().unskipped(), 0);
        assert_same(&format!("{inject:?}: after the skipped step"), &before, &snapshot(&vs, &opt));
        assert!(state_before == optimizer_state(&vs, &opt, &amp), "{inject:?}: the skipped step changed Adam's state");
        // Every gradient of the optimizer is dropped on a skipped step (they hold the inf):
        // the masters' (as Apex) and also the model's own, fp32 self-mastered ones included
        // (Apex keeps those until zero_grad, so accumulating callers re-overflow).
        for (name, p) in opt.param_names().iter().zip(opt.master_params()) {
            assert!(!p.grad().defined(), "{inject:?}: the grad of {name} survived the skipped step");
            assert!(!vs.variables()[*name].grad().defined(), "{inject:?}: the model grad of {name} survived");
        }
        assert_eq!(opt.step_counts(), (1, 1));
        assert!(!opt.will_skip());

        let (overflow, outcome) = iteration(&vs, &mut amp, &mut opt, Inject::None);
        assert!(!overflow && outcome.stepped(), "{inject:?}: the next clean step did not step");
        assert_eq!(amp.loss_scale(0).unwrap(), 32768.0);
        assert_eq!(amp.scaler(0).unwrap().unskipped(), 1);
        assert_eq!(opt.step_counts(), (2, 1));

        // The reference: two clean iterations, no overflow in between.
        let (vs_ref, mut amp_ref, mut opt_ref) = o2_model(o2());
        for _ in 0..2 {
            assert!(iteration(&vs_ref, &mut amp_ref, &mut opt_ref, Inject::None).1.stepped());
        }
        assert_same(
            &format!("{inject:?}: vs the run without the overflow"),
            &snapshot(&vs_ref, &opt_ref),
            &snapshot(&vs, &opt),
        );
        // And the model equals the masters cast to fp16.
        let w = vs.variables()["w"].shallow_clone();
        let master_w = opt.master_params()[opt.param_names().iter().position(|n| *n == "w").unwrap()].shallow_clone();
        assert!(crate::common::same(&w, &master_w.to_kind(Kind::Half)));
    }
}

/// A static scale under O2 (masters, so not a pass-through) never checks: the inf reaches the
/// weights, as in Apex.
#[test]
fn static_scale_never_skips_even_on_inf() {
    let (vs, mut amp, mut opt) = o2_model(o2().loss_scale(128.0));
    let (overflow, outcome) = iteration(&vs, &mut amp, &mut opt, Inject::Fp16Grad);
    assert!(!overflow);
    assert!(outcome.stepped());
    assert_eq!(amp.loss_scale(0).unwrap(), 128.0);
    assert!(amp.scaler(0).unwrap().history().is_empty());
    let w =
        Vec::<f32>::try_from(&opt.master_params()[opt.param_names().iter().position(|n| *n == "w").unwrap()]).unwrap();
    assert!(!w[2].is_finite(), "the inf gradient should have reached the master weight: {w:?}");
}

/// `unskipped` counts non-delayed scale_loss exits (backward passes), not optimizer steps;
/// delayed passes neither count nor check.
#[test]
fn unskipped_counts_backward_passes_not_steps() {
    let (vs, mut amp, mut opt) = o2_model(o2());
    opt.zero_grad().unwrap();
    for _ in 0..3 {
        amp.scale_loss(&loss_of(&vs), &mut [&mut opt], |s| s.backward()).unwrap();
    }
    assert_eq!(amp.scaler(0).unwrap().unskipped(), 3);
    let delayed = ScaleLossOptions { loss_id: 0, delay_unscale: true };
    let out = amp
        .scale_loss_with(&(loss_of(&vs) * f64::from(f32::INFINITY)), &mut [&mut opt], delayed, |s| s.backward())
        .unwrap();
    assert!(out.delayed && !out.overflow);
    assert_eq!(amp.scaler(0).unwrap().unskipped(), 3);
    assert_eq!(amp.scaler(0).unwrap().passes(), 3);
    // The inf accumulated in the delayed pass is caught by the next non-delayed exit.
    let out = amp.scale_loss(&loss_of(&vs), &mut [&mut opt], |s| s.backward()).unwrap();
    assert!(out.overflow);
    assert_eq!(amp.scaler(0).unwrap().unskipped(), 0);
    assert_eq!(amp.loss_scale(0).unwrap(), 32768.0);
    assert!(!opt.step().unwrap().stepped());
}

/// Growth through scale_loss: 2000 clean backward passes (with one step each) double the
/// scale, at exactly the 2000th.
#[test]
fn growth_through_scale_loss() {
    let (vs, mut amp, mut opt) = o2_model(o2().max_loss_scale(131072.0));
    opt.set_lr(0.0).unwrap();
    for i in 1..=2000 {
        let (overflow, outcome) = iteration(&vs, &mut amp, &mut opt, Inject::None);
        assert!(!overflow && outcome.stepped());
        let want = if i < 2000 { 65536.0 } else { 131072.0 };
        assert_eq!(amp.loss_scale(0).unwrap(), want, "after pass {i}");
    }
    assert_eq!(amp.scaler(0).unwrap().history()[0].pass, 1999);
}
