//! Port of the expectations of Apex's tests/L0/run_amp/test_checkpointing.py, made stricter:
//! a restored run continues bit-exactly (Apex's O2 resume is lossy: it rebuilds the masters
//! from fp16), loss scales decrease exactly as often as they overflow, saved model state holds
//! no half tensors, and a failed load changes nothing.

use safetensors::tensor::{Dtype, SafeTensors};
use tch::nn::{self, Module, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::error::StateError;
use tch_amp::{
    load_checkpoint, save_checkpoint, Amp, AmpConfig, AmpError, AmpModel, AmpOptimizer, OptLevel, OptimizerConfig,
    ScaleLossOptions,
};

#[derive(Debug)]
struct MyModel {
    conv1: nn::Conv2D,
    bn1: nn::BatchNorm,
    param: Tensor,
}

impl MyModel {
    fn new(p: &nn::Path) -> Self {
        let cfg = nn::ConvConfig { padding: 1, ..Default::default() };
        Self {
            conv1: nn::conv2d(p / "conv1", 3, 6, 3, cfg),
            bn1: nn::batch_norm2d(p / "bn1", 6, Default::default()),
            param: p.randn("param", &[1], 0.0, 1.0),
        }
    }
}

impl ModuleT for MyModel {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let x = xs * &self.param;
        self.bn1.forward_t(&self.conv1.forward(&x).relu(), train)
    }
}

struct Run {
    vs: VarStore,
    model: AmpModel<MyModel>,
    opt: AmpOptimizer,
    amp: Amp,
}

fn setup(level: OptLevel, num_losses: usize, seed: i64, optim: OptimizerConfig) -> Run {
    tch::manual_seed(seed);
    let vs = VarStore::new(Device::Cpu);
    let net = MyModel::new(&vs.root());
    let amp = Amp::new(&AmpConfig::new(level).num_losses(num_losses).verbosity(0)).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let opt = amp.optimizer(&vs, optim, 1e-3).unwrap();
    Run { vs, model, opt, amp }
}

fn train_step(r: &mut Run, x: &Tensor, loss_ids: std::ops::Range<usize>) -> Tensor {
    r.opt.zero_grad().unwrap();
    let mut last = None;
    for id in loss_ids {
        let out = r.model.forward_t(x, true);
        let loss = out.mean(Kind::Float);
        let opts = ScaleLossOptions { loss_id: id, delay_unscale: false };
        r.amp.scale_loss_with(&loss, &mut [&mut r.opt], opts, |s| s.backward()).unwrap();
        last = Some(out);
    }
    r.opt.step().unwrap();
    last.unwrap()
}

fn snapshot(r: &Run) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = r.vs.variables().into_iter().map(|(k, t)| (k, t.copy())).collect();
    v.extend(
        r.opt
            .param_names()
            .into_iter()
            .map(String::from)
            .zip(r.opt.master_params().iter().map(|t| t.copy()))
            .map(|(k, t)| (format!("master/{k}"), t)),
    );
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn assert_identical(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for ((ka, ta), (kb, tb)) in a.iter().zip(b) {
        assert_eq!(ka, kb, "{what}");
        assert!(crate::common::same(ta, tb), "{what}: {ka} differs: {ta:?} vs {tb:?}");
    }
}

fn restoring(level: OptLevel, optim: OptimizerConfig) {
    let dir = tempfile::tempdir().unwrap();
    for num_losses in 1..=2 {
        let what = format!("{level} num_losses={num_losses} {optim:?}");
        let path = dir.path().join(format!("ckpt-{level}-{num_losses}.safetensors"));
        let mut run = setup(level, num_losses * 2, 2809, optim);
        tch::manual_seed(7);
        let xs: Vec<Tensor> = (0..10).map(|_| Tensor::randn([4, 3, 8, 8], (Kind::Float, Device::Cpu))).collect();
        let mut restored: Option<Run> = None;
        for (epoch, x) in xs.iter().enumerate() {
            let out = train_step(&mut run, x, 0..num_losses);
            if epoch == 4 {
                save_checkpoint(&path, &run.vs, &[&run.opt], &run.amp).unwrap();
                // A different initialisation, then the checkpoint.
                let mut r = setup(level, num_losses * 2, 1234, optim);
                load_checkpoint(&path, &r.vs, &mut [&mut r.opt], &mut r.amp).unwrap();
                assert_identical(&snapshot(&run), &snapshot(&r), &format!("{what}: right after load"));
                assert_eq!(crate::common::json(&run.amp.state_dict()), crate::common::json(&r.amp.state_dict()));
                restored = Some(r);
            } else if epoch > 4 {
                let r = restored.as_mut().unwrap();
                let out_r = train_step(r, x, 0..num_losses);
                assert!(crate::common::same(&out, &out_r), "{what}: outputs differ at epoch {epoch}");
                assert_identical(&snapshot(&run), &snapshot(r), &format!("{what}: epoch {epoch}"));
            }
        }
        // Variables keep the model's dtypes (VarStore::load would recast them).
        let r = restored.unwrap();
        for (name, t) in r.vs.variables() {
            assert_eq!(t.kind(), run.vs.variables()[&name].kind(), "{what}: {name}");
        }
    }
}

#[test]
fn restoring_o0_continues_identically() {
    restoring(OptLevel::O0, nn::Sgd { momentum: 0.9, ..Default::default() }.into());
}

#[test]
fn restoring_o1_continues_identically() {
    restoring(OptLevel::O1, nn::Sgd { momentum: 0.9, ..Default::default() }.into());
}

#[test]
fn restoring_o2_continues_identically() {
    restoring(OptLevel::O2, nn::Sgd { momentum: 0.9, ..Default::default() }.into());
    restoring(OptLevel::O2, nn::Adam::default().into());
}

#[test]
fn restoring_o3_continues_identically() {
    restoring(OptLevel::O3, nn::Sgd { momentum: 0.9, ..Default::default() }.into());
}

#[test]
fn loss_scale_decreases_once_per_overflow() {
    for level in OptLevel::ALL {
        let mut r = setup(level, 3, 0, nn::Sgd::default().into());
        if !r.amp.scaler(0).unwrap().is_dynamic() {
            continue;
        }
        let x = Tensor::randn([4, 3, 8, 8], (Kind::Float, Device::Cpu)) * 2f64.powi(17);
        for (idx, decreases) in [0, 1, 2].into_iter().enumerate() {
            for _ in 0..decreases {
                r.opt.zero_grad().unwrap();
                let loss = r.model.forward_t(&x, true).mean(Kind::Float);
                let opts = ScaleLossOptions { loss_id: idx, delay_unscale: false };
                let o = r.amp.scale_loss_with(&loss, &mut [&mut r.opt], opts, |s| s.backward()).unwrap();
                assert!(o.overflow, "{level}: 2^17 inputs must overflow in fp16");
                assert!(!r.opt.step().unwrap().stepped());
            }
        }
        let state = crate::common::json(&r.amp.state_dict());
        for (idx, expected) in [65536.0, 32768.0, 16384.0].into_iter().enumerate() {
            let s = &state[&format!("loss_scaler{idx}")];
            assert_eq!(s["loss_scale"], expected, "{level} scaler {idx}");
            assert_eq!(s["unskipped"], 0, "{level} scaler {idx}");
        }
    }
}

#[test]
fn saved_model_state_has_no_half_tensors_and_adam_decreases_loss() {
    let dir = tempfile::tempdir().unwrap();
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2] {
        let mut r = setup(level, 1, 0, nn::Adam::default().into());
        let path = dir.path().join(format!("{level}.safetensors"));
        save_checkpoint(&path, &r.vs, &[&r.opt], &r.amp).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut n = 0;
        for (name, view) in st.tensors() {
            if let Some(var) = name.strip_prefix("model/") {
                n += 1;
                let expected = if var.ends_with("num_batches_tracked") { Dtype::I64 } else { Dtype::F32 };
                assert_eq!(view.dtype(), expected, "{level}: {name}");
            }
        }
        assert_eq!(n, r.vs.variables().len());
        // No temporary file is left next to the checkpoint.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(names.iter().all(|n| !n.to_string_lossy().contains(".tmp-")), "{names:?}");

        tch::manual_seed(3);
        let data = Tensor::randn([10, 3, 4, 4], (Kind::Float, Device::Cpu));
        let target = Tensor::randn([10, 6, 4, 4], (Kind::Float, Device::Cpu));
        let mut losses = Vec::new();
        for _ in 0..11 {
            r.opt.zero_grad().unwrap();
            let loss = r.model.forward_t(&data, true).mse_loss(&target, tch::Reduction::Mean);
            losses.push(loss.double_value(&[]));
            r.amp.scale_loss(&loss, &mut [&mut r.opt], |s| s.backward()).unwrap();
            r.opt.step().unwrap();
        }
        assert!(losses[10] < losses[0], "{level}: {losses:?}");
    }
}

#[test]
fn failed_load_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.safetensors");
    let mut a = setup(OptLevel::O2, 1, 0, nn::Adam::default().into());
    let x = Tensor::randn([4, 3, 8, 8], (Kind::Float, Device::Cpu));
    let _ = train_step(&mut a, &x, 0..1);
    save_checkpoint(&path, &a.vs, &[&a.opt], &a.amp).unwrap();

    // A model with another shape: nothing may change in it.
    tch::manual_seed(5);
    let vs = VarStore::new(Device::Cpu);
    let root = vs.root();
    let _conv = nn::conv2d(&root / "conv1", 3, 4, 3, Default::default());
    let _bn = nn::batch_norm2d(&root / "bn1", 4, Default::default());
    let _p = root.randn("param", &[1], 0.0, 1.0);
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O2).verbosity(0)).unwrap();
    amp.cast_model(&vs, ()).unwrap();
    let mut opt = amp.optimizer(&vs, nn::Adam::default(), 1e-3).unwrap();
    amp.load_state_dict(&crate::common::value(
        serde_json::json!({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}}),
    ))
    .unwrap();
    let before: Vec<(String, Tensor)> = {
        let mut v: Vec<_> = vs.variables().into_iter().map(|(k, t)| (k, t.copy())).collect();
        v.sort_by(|x, y| x.0.cmp(&y.0));
        v
    };
    let err = load_checkpoint(&path, &vs, &mut [&mut opt], &mut amp).unwrap_err();
    assert!(matches!(err, AmpError::State(StateError::StateMismatch { .. })), "{err}");
    let mut after: Vec<_> = vs.variables().into_iter().map(|(k, t)| (k, t.copy())).collect();
    after.sort_by(|x, y| x.0.cmp(&y.0));
    assert_identical(&before, &after, "mismatched load");
    assert_eq!(amp.loss_scale(0).unwrap(), 8.0);
    assert_eq!(amp.scaler(0).unwrap().unskipped(), 3);

    // num_losses mismatch: the model would fit, the amp state does not; nothing changes.
    let mut b = setup(OptLevel::O2, 2, 9, nn::Adam::default().into());
    let snap = snapshot(&b);
    let err = load_checkpoint(&path, &b.vs, &mut [&mut b.opt], &mut b.amp).unwrap_err();
    assert!(matches!(err, AmpError::State(StateError::StateMismatch { .. })), "{err}");
    assert_identical(&snap, &snapshot(&b), "num_losses mismatch");
    assert_eq!(b.amp.loss_scale(0).unwrap(), 65536.0);

    // Not a checkpoint / missing file.
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a checkpoint").unwrap();
    assert!(matches!(
        load_checkpoint(&junk, &b.vs, &mut [&mut b.opt], &mut b.amp),
        Err(AmpError::State(StateError::StateMismatch { .. }))
    ));
    assert!(matches!(
        load_checkpoint(dir.path().join("missing"), &b.vs, &mut [&mut b.opt], &mut b.amp),
        Err(AmpError::Io { .. })
    ));
    assert_identical(&snap, &snapshot(&b), "junk loads");
    // Saving into a folder that does not exist is a Save error naming the path.
    let target = dir.path().join("no/such/dir/x.safetensors");
    let err = save_checkpoint(&target, &b.vs, &[&b.opt], &b.amp).unwrap_err();
    assert!(matches!(&err, AmpError::Io { path, writing: true, .. } if *path == target), "{err}");
}

/// The rest of a training state (epoch, arguments, best metric, an EMA's weights) goes into the
/// same file and the same atomic write as the model and the optimizers: it reads back exactly,
/// load_checkpoint ignores it and resumes as before, and a checkpoint without one reads back
/// empty.
#[test]
fn training_state_rides_in_the_checkpoint() {
    use tch_amp::checkpoint::{read_training_state, save_checkpoint_with, TrainingState};
    let mut r = setup(OptLevel::O2, 1, 3, nn::Adam::default().into());
    let x = Tensor::randn([2, 3, 4, 4], (Kind::Float, Device::Cpu));
    let _ = train_step(&mut r, &x, 0..1);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let ema = Tensor::arange(6, (Kind::Float, Device::Cpu)) * 0.25;
    let counts = Tensor::from_slice(&[7i64, -2]);
    let value = serde_json::json!({"epoch": 3, "best_acc": 0.9125, "args": {"lr": 1e-3, "arch": "resnet"}});
    let extra = TrainingState {
        tensors: [("ema.conv1.weight".to_string(), ema.copy()), ("sampler".to_string(), counts.copy())].into(),
        value: value.clone(),
    };
    save_checkpoint_with(&path, &r.vs, &[&r.opt], &r.amp, &extra).unwrap();
    let back = read_training_state(&path).unwrap();
    assert_eq!(back.value, value);
    assert_eq!(back.tensors.keys().collect::<Vec<_>>(), ["ema.conv1.weight", "sampler"]);
    assert!(back.tensors["ema.conv1.weight"].equal(&ema));
    assert!(back.tensors["sampler"].equal(&counts));
    // The same file resumes as a plain checkpoint does.
    let before = snapshot(&r);
    let mut s = setup(OptLevel::O2, 1, 4, nn::Adam::default().into());
    load_checkpoint(&path, &s.vs, &mut [&mut s.opt], &mut s.amp).unwrap();
    assert_identical(&before, &snapshot(&s), "resumed from a checkpoint with a training state");
    // Without one: empty.
    save_checkpoint(&path, &r.vs, &[&r.opt], &r.amp).unwrap();
    let none = read_training_state(&path).unwrap();
    assert!(none.tensors.is_empty() && none.value.is_null());
}

/// State that would poison the next step, which the finite-value checks let through: refused
/// by `OptimizerRecord::validate`, which every loader runs before applying anything.
#[test]
fn poisoned_optimizer_state_is_refused() {
    let mut a = setup(OptLevel::O0, 1, 0, nn::Adam::default().into());
    let x = Tensor::randn([4, 3, 8, 8], (Kind::Float, Device::Cpu));
    let _ = train_step(&mut a, &x, 0..1);
    let snap = snapshot(&a);
    let poisoned = |opt: &AmpOptimizer, edit: &dyn Fn(&mut tch_amp::optim::OptimizerRecord)| {
        let mut r = opt.to_record();
        edit(&mut r);
        r
    };
    // A negative second moment: sqrt(-1) is NaN at the next step.
    let r = poisoned(&a.opt, &|r| {
        let p = &mut r.params[0];
        let v = p.buffers["exp_avg_sq"].full_like(-1.0);
        p.buffers.insert("exp_avg_sq".into(), v);
    });
    let name = r.params[0].name.clone();
    let err = r.validate().unwrap_err();
    assert!(
        matches!(&err, AmpError::State(StateError::PoisonedState { param, .. }) if *param == format!("{name} exp_avg_sq")),
        "{err}"
    );
    let err = a.opt.load_record(r).unwrap_err();
    assert!(matches!(err, AmpError::State(StateError::PoisonedState { .. })), "{err}");
    // Hyper-parameters finite in f64, inf or 0 in fp32.
    for (key, v) in [("lr", 1e308), ("eps", 5e-324)] {
        let r = poisoned(&a.opt, &|r| {
            for g in &mut r.groups {
                if key == "lr" {
                    g.lr = v;
                } else {
                    g.hyper_parameters.insert(key.into(), v);
                }
            }
        });
        let err = a.opt.load_record(r).unwrap_err();
        assert!(
            matches!(&err, AmpError::State(StateError::PoisonedState { param, .. }) if *param == format!("group 0 {key}")),
            "{key}: {err}"
        );
    }
    assert_identical(&snap, &snapshot(&a), "poisoned loads");
    // The record as saved loads.
    a.opt.load_record(a.opt.to_record()).unwrap();
}

/// A training-state tree of any depth is refused with a typed error instead of overflowing the
/// stack, and tensor names deeper than the tree limit read back as one key at that depth.
#[test]
fn training_state_trees_are_bounded() {
    use tch_amp::checkpoint::TrainingState;
    use tch_amp::torch_io::{Dict, Value};
    let leaf = Tensor::from_slice(&[1.0f32]);
    let mut deep = Value::Tensor(leaf.copy());
    for _ in 0..100_000 {
        deep = Value::Dict(Dict::new().with("k", deep));
    }
    let mut state = TrainingState::default();
    let err = state.insert_tree("deep", &deep).unwrap_err();
    assert!(matches!(err, AmpError::State(StateError::StateMismatch { .. })), "{err}");
    assert!(state.tensors.is_empty());
    // 300 levels by name: the tree goes 256 dicts deep, the rest of the path is the last key.
    let name = format!("p/{}", vec!["k"; 300].join("/"));
    state.tensors.insert(name, leaf.copy());
    let tree = state.tree("p");
    let mut node = &tree;
    for _ in 0..256 {
        let Value::Dict(d) = node else { panic!("a dict expected") };
        assert_eq!(d.len(), 1);
        node = d.get_str("k").unwrap();
    }
    let Value::Dict(d) = node else { panic!("a dict expected") };
    assert!(matches!(d.get_str(&vec!["k"; 44].join("/")), Some(Value::Tensor(t)) if t.equal(&leaf)));
}
