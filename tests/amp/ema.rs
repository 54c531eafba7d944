//! ModelEma against PyTorch: the average `decay * ema + (1 - decay) * weight` (timm's
//! ModelEmaV2 update, with and without the warmup) over a real training run, bit for bit with
//! the same arithmetic in the venv's torch on the same weight sequence; under O2 the average is
//! of the fp32 masters. No update after a skipped step; evaluation swaps the weights in and
//! back; the average round-trips through a checkpoint's training state.
use std::process::Command;

use tch::nn::{ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::ema::ModelEma;
use tch_amp::{Amp, AmpConfig, AmpModel, AmpOptimizer, OptLevel, StepOutcome};

use crate::common::python::python;
use crate::common::{batch, deterministic_init, Mlp};

/// The reference: reads the initial values and each step's weights (float32 bits) and the
/// decay, applies timm's update as timm writes it, prints the result's bits.
const PYTHON: &str = r#"
import json, sys, torch
d = json.load(open(sys.argv[1]))
def t(bits): return torch.tensor(bits, dtype=torch.int32).view(torch.float32)
ema = t(d['init'])
for n, w in enumerate(d['weights'], start=1):
    decay = d['decay'] if d['power'] is None else min(d['decay'], 1 - (1 + n) ** -d['power'])
    ema.copy_(decay * ema + (1. - decay) * t(w))
print(json.dumps(ema.view(torch.int32).tolist()))
"#;

fn bits(t: &Tensor) -> Vec<i32> {
    let f = t.to_kind(Kind::Float).flatten(0, -1);
    Vec::<f32>::try_from(&f).unwrap().iter().map(|v| v.to_bits() as i32).collect()
}

/// Every floating weight the EMA averages (masters under O2), flattened in name order.
fn flat(vs: &VarStore, opt: &AmpOptimizer) -> Tensor {
    let mut w: std::collections::BTreeMap<String, Tensor> =
        vs.variables().into_iter().filter(|(_, v)| v.is_floating_point()).collect();
    for (n, m) in opt.param_names().into_iter().zip(opt.master_params()) {
        w.insert(n.to_string(), m);
    }
    Tensor::cat(&w.values().map(|t| t.to_kind(Kind::Float).flatten(0, -1)).collect::<Vec<_>>(), 0)
}

fn ema_flat(ema: &ModelEma) -> Tensor {
    let parts: Vec<Tensor> =
        ema.tensors().values().filter(|t| t.is_floating_point()).map(|t| t.flatten(0, -1)).collect();
    Tensor::cat(&parts, 0)
}

fn run(level: OptLevel, power: Option<f64>) {
    let vs = VarStore::new(Device::Cpu);
    let net = Mlp::new(&vs.root());
    deterministic_init(&vs);
    let mut amp = Amp::new(&AmpConfig::new(level).verbosity(0)).unwrap();
    let model: AmpModel<Mlp> = amp.cast_model(&vs, net).unwrap();
    let mut opt = amp.optimizer(&vs, tch::nn::Adam::default(), 1e-2).unwrap();
    let mut ema = ModelEma::new(&vs, &[&opt], 0.9).unwrap();
    if let Some(p) = power {
        ema = ema.warmup(p);
    }
    let init = bits(&flat(&vs, &opt));
    let mut weights = Vec::new();
    for step in 0..6 {
        let (x, y) = batch(step, 8);
        opt.zero_grad().unwrap();
        let loss = model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
        let loss = if step == 3 && level == OptLevel::O2 { loss * f64::INFINITY } else { loss };
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        let outcome = opt.step().unwrap();
        ema.update(&vs, &[&opt], outcome).unwrap();
        if outcome == StepOutcome::Stepped {
            weights.push(bits(&flat(&vs, &opt)));
        } else {
            assert_eq!(level, OptLevel::O2, "only the injected overflow skips");
        }
    }
    assert_eq!(ema.updates(), weights.len() as u64);
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("ema.json");
    let json = serde_json::json!({"init": init, "weights": weights, "decay": 0.9, "power": power});
    std::fs::write(&input, json.to_string()).unwrap();
    let out = Command::new(python()).arg("-c").arg(PYTHON).arg(&input).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want: Vec<i32> = serde_json::from_slice(&out.stdout).unwrap();
    let got = bits(&ema_flat(&ema));
    let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    assert_eq!((got.len(), differ), (want.len(), 0), "{level} warmup {power:?}: {differ} values differ");

    // Evaluation with the averages, then the model's own weights back.
    let before: Vec<Tensor> = vs.trainable_variables().iter().map(Tensor::copy).collect();
    let (x, _) = batch(9, 8);
    let with_ema = ema.with_weights(&vs, || model.forward_t(&x, false)).unwrap();
    let own = model.forward_t(&x, false);
    assert!(!with_ema.equal(&own), "{level}: the EMA weights were not used");
    assert!(vs.trainable_variables().iter().zip(&before).all(|(a, b)| a.equal(b)), "{level}: weights not restored");

    // Saved and restored through a checkpoint's training state.
    let path = dir.path().join("ckpt.safetensors");
    let state = tch_amp::checkpoint::TrainingState {
        tensors: ema.tensors().iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect(),
        value: serde_json::json!({"ema_updates": ema.updates()}),
    };
    tch_amp::checkpoint::save_checkpoint_with(&path, &vs, &[&opt], &amp, &state).unwrap();
    let back = tch_amp::checkpoint::read_training_state(&path).unwrap();
    let mut fresh = ModelEma::new(&vs, &[&opt], 0.9).unwrap();
    fresh.load(&back.tensors, back.value["ema_updates"].as_u64().unwrap()).unwrap();
    assert_eq!(bits(&ema_flat(&fresh)), got);
    assert_eq!(fresh.updates(), ema.updates());
}

#[test]
fn ema_matches_torch_o0_o1_o2() {
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2] {
        run(level, None);
    }
    run(OptLevel::O2, Some(0.75));
}

#[test]
fn ema_decay_outside_0_1_is_refused() {
    let vs = VarStore::new(Device::Cpu);
    let _ = Mlp::new(&vs.root());
    let amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let opt = amp.optimizer(&vs, tch::nn::Sgd::default(), 0.1).unwrap();
    for bad in [-0.1, 1.5, f64::NAN] {
        assert!(ModelEma::new(&vs, &[&opt], bad).is_err(), "{bad}");
    }
}

/// The torch.amp path: a GradScaler loop over tch's own optimizer on fp32 parameters (no Amp,
/// no masters: `&[]`). A stepped update is `decay * ema + (1 - decay) * weight` in fp32; a step
/// the scaler skipped (inf in the loss) leaves the average as it was.
#[test]
fn ema_follows_a_grad_scaler_loop() {
    use tch::nn::{self, Module, OptimizerConfig};
    let vs = VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "fc", 4, 2, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut scaler = tch_amp::GradScaler::new(Device::Cpu);
    let mut ema = ModelEma::new(&vs, &[], 0.75).unwrap();
    let x = Tensor::ones([3, 4], (Kind::Float, Device::Cpu));
    for poison in [false, true] {
        let before = ema_flat(&ema);
        opt.zero_grad();
        let mut loss =
            tch_amp::autocast(Device::Cpu, || net.forward(&x)).unwrap().to_kind(Kind::Float).square().mean(None);
        if poison {
            loss *= f64::INFINITY;
        }
        scaler.scale(&loss).unwrap().backward();
        let outcome = scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        assert_eq!(outcome.stepped(), !poison);
        ema.update(&vs, &[], outcome).unwrap();
        let mut w: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        let w = Tensor::cat(&w.iter().map(|(_, t)| t.flatten(0, -1)).collect::<Vec<_>>(), 0);
        let want = if poison { before.shallow_clone() } else { &before * 0.75 + &w * (1.0 - 0.75) };
        assert_eq!(bits(&ema_flat(&ema)), bits(&want), "poisoned: {poison}");
    }
}
