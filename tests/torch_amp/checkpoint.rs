//! The torch.amp path's checkpoints: GradScalers saved and resumed with the model and the
//! optimizer, without an `Amp`, in tch-amp's atomic checkpoint and in a torch.save file under
//! `'scaler'` (torch's AMP examples' layout); the load options that follow the scalers given;
//! call-order errors in torch.amp's words.
use tch::nn::{self, Module};
use tch::{Device, Tensor};
use tch_amp::error::{StateError, UsageError};
use tch_amp::torch_amp::GradScalerOptions;
use tch_amp::torch_checkpoint::{TorchLoadOptions, TorchSaveOptions};
use tch_amp::torch_io::{self, Value};
use tch_amp::{Amp, AmpConfig, AmpError, AmpOptimizer, GradScaler, OptLevel};

use crate::common::{batch, deterministic_init};
use crate::support::mlp;

struct Run {
    vs: nn::VarStore,
    model: crate::support::Mlp,
    opt: AmpOptimizer,
    scaler: GradScaler,
}

/// fp32 model, Adam (an fp32 optimizer made at O0, as a torch.amp script uses one), a scaler
/// whose scale grows every 2 clean steps.
fn run() -> Run {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = mlp(&vs.root());
    deterministic_init(&vs);
    let amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let opt = amp.optimizer(&vs, nn::Adam::default(), 1e-2).unwrap();
    let scaler = GradScaler::with_options(Device::Cpu, GradScalerOptions::default().growth_interval(2)).unwrap();
    Run { vs, model, opt, scaler }
}

impl Run {
    fn steps(&mut self, from: i64, n: i64) {
        for step in from..from + n {
            let (x, y) = batch(step, 8);
            self.opt.zero_grad().unwrap();
            let loss = self.model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
            self.scaler.scale(&loss).unwrap().backward();
            self.scaler.step(&mut self.opt).unwrap();
            self.scaler.update().unwrap();
        }
    }

    fn state(&self) -> Vec<Tensor> {
        let mut out: Vec<Tensor> = self.vs.trainable_variables().iter().map(Tensor::copy).collect();
        for p in self.opt.to_record().params {
            out.extend(p.buffers.values().map(Tensor::copy));
        }
        out.push(Tensor::from_slice(&[self.scaler.get_scale(), self.scaler.growth_tracker() as f64]));
        out
    }
}

fn same(a: &[Tensor], b: &[Tensor]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.kind() == y.kind() && x.equal(y))
}

#[test]
fn grad_scaler_checkpoints_resume_bit_for_bit_without_an_amp() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let mut a = run();
    a.steps(0, 5);
    let atomic = dir.path().join("ckpt.safetensors");
    let torch = dir.path().join("ckpt.pt");
    tch_amp::save_checkpoint(&atomic, &a.vs, &[&a.opt], &a.scaler).unwrap();
    tch_amp::save_torch_checkpoint(&torch, &a.vs, &[&a.opt], &a.scaler, &TorchSaveOptions::new()).unwrap();
    // torch's AMP examples' layout: {'model', 'optimizer', 'scaler'}.
    let tree = torch_io::load(&torch).unwrap();
    let Value::Dict(root) = &tree else { panic!() };
    let keys: Vec<String> = root.keys().map(|k| k.to_string()).collect();
    assert_eq!(keys, ["\"model\"", "\"optimizer\"", "\"scaler\""]);
    assert_eq!(
        tree.get("scaler").unwrap().get("_growth_tracker").unwrap().as_i64().unwrap(),
        a.scaler.growth_tracker()
    );
    a.steps(5, 4);
    let want = a.state();
    for (what, load) in [("atomic", 0), ("torch.save", 1)] {
        let mut b = run();
        if load == 0 {
            tch_amp::load_checkpoint(&atomic, &b.vs, &mut [&mut b.opt], &mut b.scaler).unwrap();
        } else {
            let r = tch_amp::load_torch_checkpoint(
                &torch,
                &b.vs,
                &mut [&mut b.opt],
                &mut b.scaler,
                &TorchLoadOptions::new(),
            )
            .unwrap();
            assert!(r.amp_loaded);
        }
        b.steps(5, 4);
        assert!(same(&want, &b.state()), "{what}: the resumed run differs from the uninterrupted one");
    }
    // Several scalers: a list under 'scaler'.
    let two = [a.scaler, GradScaler::new(Device::Cpu)];
    let v = tch_amp::torch_checkpoint::torch_checkpoint_value(&a.vs, &[&a.opt], &two[..], &TorchSaveOptions::new())
        .unwrap();
    assert_eq!(v.get("scaler").unwrap().get(1).unwrap().get("scale").unwrap().as_f64().unwrap(), 65536.0);
    let mut back = [GradScaler::new(Device::Cpu), GradScaler::new(Device::Cpu)];
    let mut b = run();
    tch_amp::torch_checkpoint::load_torch_checkpoint_value(
        v,
        &b.vs,
        &mut [&mut b.opt],
        &mut back[..],
        &TorchLoadOptions::new(),
    )
    .unwrap();
    assert_eq!(back[0].get_scale(), two[0].get_scale());
}

#[test]
fn load_options_follow_the_scalers_given() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = run();
    a.steps(0, 2);
    // A bf16 script has no scaler: nothing saved, nothing required.
    let none = dir.path().join("none.pt");
    tch_amp::save_torch_checkpoint(&none, &a.vs, &[&a.opt], &(), &TorchSaveOptions::new()).unwrap();
    assert!(torch_io::load(&none).unwrap().get("scaler").is_err());
    let mut b = run();
    let r = tch_amp::load_torch_checkpoint(&none, &b.vs, &mut [&mut b.opt], &mut (), &TorchLoadOptions::new()).unwrap();
    assert!(!r.amp_loaded);
    // A GradScaler for a file without 'scaler': the error names the option.
    let before = b.scaler.get_scale();
    let e = tch_amp::load_torch_checkpoint(&none, &b.vs, &mut [&mut b.opt], &mut b.scaler, &TorchLoadOptions::new())
        .unwrap_err();
    println!("{e}");
    assert!(matches!(&e, AmpError::State(StateError::MissingEntry { key, .. }) if key == "scaler"), "{e:?}");
    assert!(e.to_string().contains("amp_key(None, false)"), "{e}");
    assert_eq!(b.scaler.get_scale(), before);
    tch_amp::load_torch_checkpoint(
        &none,
        &b.vs,
        &mut [&mut b.opt],
        &mut b.scaler,
        &TorchLoadOptions::new().amp_key(None, false),
    )
    .unwrap();
    // An Amp's checkpoint (an 'amp' entry) into a GradScaler: the default key is 'scaler'.
    let amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let apex = dir.path().join("apex.pt");
    tch_amp::save_torch_checkpoint(&apex, &a.vs, &[&a.opt], &amp, &TorchSaveOptions::new()).unwrap();
    let e = tch_amp::load_torch_checkpoint(&apex, &b.vs, &mut [&mut b.opt], &mut b.scaler, &TorchLoadOptions::new())
        .unwrap_err();
    assert!(matches!(&e, AmpError::State(StateError::MissingEntry { key, .. }) if key == "scaler"), "{e:?}");
    // tch-amp's own checkpoint refuses the other kind of scalers, naming what to pass.
    let atomic = dir.path().join("apex.safetensors");
    tch_amp::save_checkpoint(&atomic, &a.vs, &[&a.opt], &amp).unwrap();
    let e = tch_amp::load_checkpoint(&atomic, &b.vs, &mut [&mut b.opt], &mut b.scaler).unwrap_err();
    assert!(
        matches!(&e, AmpError::State(StateError::StateMismatch { message }) if message.contains("pass that Amp")),
        "{e}"
    );
    let atomic = dir.path().join("scaler.safetensors");
    tch_amp::save_checkpoint(&atomic, &a.vs, &[&a.opt], &a.scaler).unwrap();
    let mut amp = amp;
    let e = tch_amp::load_checkpoint(&atomic, &b.vs, &mut [&mut b.opt], &mut amp).unwrap_err();
    assert!(
        matches!(&e, AmpError::State(StateError::StateMismatch { message }) if message.contains("GradScaler")),
        "{e}"
    );
    let e = tch_amp::load_checkpoint(&atomic, &b.vs, &mut [&mut b.opt], &mut ()).unwrap_err();
    assert!(matches!(&e, AmpError::State(StateError::StateMismatch { .. })), "{e}");
}

#[test]
fn call_order_errors_speak_the_api_used() {
    let mut a = run();
    let (x, y) = batch(0, 8);
    a.opt.zero_grad().unwrap();
    let loss = a.model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
    a.scaler.scale(&loss).unwrap().backward();
    a.scaler.step(&mut a.opt).unwrap();
    // optimizer.step() after scaler.step: torch.amp's words.
    let e = a.opt.step().unwrap_err();
    println!("{e}");
    assert!(matches!(e, AmpError::Usage(UsageError::CallOrder { call: "step()", .. })), "{e}");
    assert!(e.to_string().contains("scaler.step") && e.to_string().contains("scaler.update"), "{e}");
    assert!(!e.to_string().contains("scale_loss"), "{e}");
    let e = a.opt.clip_grad_norm(1.0, 2.0).unwrap_err();
    assert!(e.to_string().contains("scaler.unscale_"), "{e}");
    // The same mistake on Apex's path: scale_loss's words.
    let vs = nn::VarStore::new(Device::Cpu);
    let model = mlp(&vs.root());
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let mut opt = amp.optimizer(&vs, nn::Sgd::default(), 0.1).unwrap();
    let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
    amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
    opt.step().unwrap();
    let e = opt.step().unwrap_err();
    assert!(e.to_string().contains("scale_loss") && !e.to_string().contains("scaler."), "{e}");
}
