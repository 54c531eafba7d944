//! Loading parts of a tch-amp checkpoint (torch's `model.load_state_dict(ckpt["model"], strict)`
//! and `optimizer.load_state_dict(ckpt["optimizer"])`): model weights alone (the fp32 masters
//! follow), optimizer state alone, strict and not, with the missing and unexpected keys reported
//! (typed: [`LoadReport`] and [`StateError::IncompatibleKeys`]); weights plus optimizer state
//! loaded separately continue exactly as a full `load_checkpoint`; a failed load changes nothing.
use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::checkpoint::{load_model_weights, load_optimizer_state, LoadReport};
use tch_amp::error::StateError;
use tch_amp::optim::OptimizerRecord;
use tch_amp::{load_checkpoint, save_checkpoint, Amp, AmpConfig, AmpError, AmpModel, AmpOptimizer, OptLevel};

use crate::common::{batch, deterministic_init, Mlp};

struct Run {
    vs: VarStore,
    model: AmpModel<Mlp>,
    opt: AmpOptimizer,
    amp: Amp,
}

/// An O2 Mlp with Adam; `extra`: one more trainable variable ("extra.w") the checkpoints lack.
fn setup(extra: bool) -> Run {
    let vs = VarStore::new(Device::Cpu);
    let net = Mlp::new(&vs.root());
    if extra {
        let _ = vs.root().sub("extra").zeros("w", &[2]);
    }
    deterministic_init(&vs);
    let amp = Amp::new(&AmpConfig::new(OptLevel::O2).verbosity(0)).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let opt = amp.optimizer(&vs, nn::Adam { wd: 1e-3, ..Default::default() }, 1e-2).unwrap();
    Run { vs, model, opt, amp }
}

fn train(r: &mut Run, steps: std::ops::Range<i64>) {
    for s in steps {
        let (x, y) = batch(s, 6);
        r.opt.zero_grad().unwrap();
        let out = r.model.forward_t(&x, true).to_kind(Kind::Float);
        let loss = (out - y).square().mean(Kind::Float);
        r.amp.scale_loss(&loss, &mut [&mut r.opt], |l| l.backward()).unwrap();
        r.opt.step().unwrap();
    }
}

/// Every variable and master, copied, sorted by name.
fn snapshot(r: &Run) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = r.vs.variables().into_iter().map(|(k, t)| (k, t.copy())).collect();
    for (n, m) in r.opt.param_names().into_iter().zip(r.opt.master_params()) {
        v.push((format!("master/{n}"), m.copy()));
    }
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn same(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|((na, ta), (nb, tb))| na == nb && crate::common::same(ta, tb))
}

/// A parameter's name, step count and state tensors.
type ParamStateCopy = (String, u64, Vec<(String, Tensor)>);

/// Every state tensor and step count of an optimizer, copied.
fn state(o: &AmpOptimizer) -> Vec<ParamStateCopy> {
    let OptimizerRecord { params, .. } = o.to_record();
    params.into_iter().map(|p| (p.name, p.step, p.buffers.into_iter().map(|(k, t)| (k, t.copy())).collect())).collect()
}

fn same_state(a: &AmpOptimizer, b: &AmpOptimizer) -> bool {
    let (a, b) = (state(a), state(b));
    a.len() == b.len()
        && a.iter().zip(&b).all(|((na, sa, ba), (nb, sb, bb))| {
            na == nb
                && sa == sb
                && ba.len() == bb.len()
                && ba.iter().zip(bb).all(|((ka, ta), (kb, tb))| ka == kb && crate::common::same(ta, tb))
        })
}

/// A checkpoint after 3 steps, and the run that wrote it.
fn saved(dir: &tempfile::TempDir) -> (std::path::PathBuf, Run) {
    let mut r = setup(false);
    train(&mut r, 0..3);
    let path = dir.path().join("ckpt.safetensors");
    save_checkpoint(&path, &r.vs, &[&r.opt], &r.amp).unwrap();
    (path, r)
}

/// Weights alone, then optimizer state alone, into a fresh run: it continues exactly as the
/// saved run and as a run restored with `load_checkpoint` (every variable, master and state
/// tensor bit for bit after 3 more steps).
#[test]
fn weights_then_optimizer_state_continue_like_a_full_load() {
    let dir = tempfile::tempdir().unwrap();
    let (path, mut original) = saved(&dir);
    let mut full = setup(false);
    load_checkpoint(&path, &full.vs, &mut [&mut full.opt], &mut full.amp).unwrap();
    let mut parts = setup(false);
    let report = load_model_weights(&path, &parts.vs, &mut [&mut parts.opt], true).unwrap();
    assert!(report.is_complete(), "{report:?}");
    // The weights and masters are the saved ones, the optimizer still has no state.
    let weights_of = |r: &Run| snapshot(r).into_iter().filter(|(n, _)| !n.contains("running")).collect::<Vec<_>>();
    assert!(same(&weights_of(&parts), &weights_of(&original)));
    assert!(state(&parts.opt).iter().all(|(_, step, bufs)| *step == 0 && bufs.is_empty()));
    let reports = load_optimizer_state(&path, &mut [&mut parts.opt], true).unwrap();
    assert_eq!(reports, [LoadReport::default()]);
    assert!(same_state(&parts.opt, &original.opt));
    // The loss scale is not part of either: both start from the default; the saved run's has
    // not changed in 3 clean steps either.
    assert_eq!(parts.amp.loss_scale(0).unwrap(), original.amp.loss_scale(0).unwrap());
    for r in [&mut original, &mut full, &mut parts] {
        train(r, 3..6);
    }
    assert!(same(&snapshot(&parts), &snapshot(&original)), "weights + state differ from the uninterrupted run");
    assert!(same(&snapshot(&parts), &snapshot(&full)), "weights + state differ from load_checkpoint");
    assert!(same_state(&parts.opt, &full.opt));
}

/// Strict: a model with a variable the file lacks is refused with the typed error naming it,
/// and nothing changes. Not strict: the matching variables load, the report names the extra
/// one (missing), which keeps its value.
#[test]
fn model_weights_strict_and_not() {
    let dir = tempfile::tempdir().unwrap();
    let (path, original) = saved(&dir);
    let mut r = setup(true);
    let before = snapshot(&r);
    match load_model_weights(&path, &r.vs, &mut [&mut r.opt], true) {
        Err(AmpError::State(StateError::IncompatibleKeys { missing_keys, unexpected_keys, .. })) => {
            assert_eq!(missing_keys, ["extra.w"]);
            assert!(unexpected_keys.is_empty());
        }
        other => panic!("strict load with a missing key: {other:?}"),
    }
    assert!(same(&snapshot(&r), &before), "a failed load changed something");
    let extra_before = r.vs.variables()["extra.w"].copy();
    let report = load_model_weights(&path, &r.vs, &mut [&mut r.opt], false).unwrap();
    assert_eq!(report, LoadReport { missing_keys: vec!["extra.w".into()], unexpected_keys: vec![] });
    let vars = r.vs.variables();
    for (name, t) in original.vs.variables() {
        assert!(crate::common::same(&vars[&name], &t), "{name} not loaded");
    }
    assert!(crate::common::same(&vars["extra.w"], &extra_before), "a missing key kept its value");
    // The masters follow the loaded weights (else the next step would write stale masters
    // back into the model).
    for (n, m) in r.opt.param_names().iter().zip(r.opt.master_params()) {
        if *n != "extra.w" {
            assert!(crate::common::same(
                &m,
                &original.opt.master_params()[original.opt.param_names().iter().position(|x| x == n).unwrap()]
            ));
        }
    }

    // The other way round: the file has a variable this model lacks (unexpected).
    let mut with_extra = setup(true);
    train(&mut with_extra, 0..1);
    let extra_path = dir.path().join("extra.safetensors");
    save_checkpoint(&extra_path, &with_extra.vs, &[&with_extra.opt], &with_extra.amp).unwrap();
    let mut plain = setup(false);
    match load_model_weights(&extra_path, &plain.vs, &mut [&mut plain.opt], true) {
        Err(AmpError::State(StateError::IncompatibleKeys { unexpected_keys, .. })) => {
            assert_eq!(unexpected_keys, ["extra.w"])
        }
        other => panic!("{other:?}"),
    }
    let report = load_model_weights(&extra_path, &plain.vs, &mut [], false).unwrap();
    assert_eq!(report.unexpected_keys, ["extra.w"]);
    assert!(report.missing_keys.is_empty());
}

/// A shape mismatch is an error strict or not (as in torch), and nothing is loaded, not even
/// the variables that matched.
#[test]
fn a_shape_mismatch_loads_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = saved(&dir);
    let vs = VarStore::new(Device::Cpu);
    let _fc1 = nn::linear(vs.root() / "fc1", 8, 16, Default::default());
    let _fc2 = nn::linear(vs.root() / "fc2", 16, 5, Default::default()); // 4 in the file
    let before: Vec<Tensor> = ["fc1.weight", "fc2.weight"].iter().map(|n| vs.variables()[*n].copy()).collect();
    for strict in [true, false] {
        match load_model_weights(&path, &vs, &mut [], strict) {
            Err(AmpError::State(StateError::StateMismatch { message })) => {
                assert!(message.contains("fc2"), "{message}")
            }
            other => panic!("strict {strict}: {other:?}"),
        }
    }
    let after: Vec<Tensor> = ["fc1.weight", "fc2.weight"].iter().map(|n| vs.variables()[*n].copy()).collect();
    assert!(before.iter().zip(&after).all(|(a, b)| crate::common::same(a, b)));
}

/// Optimizer state into an optimizer over more parameters: strict refuses (typed, nothing
/// changes); not strict loads the saved parameters' state and reports the extra one missing,
/// which keeps no state.
#[test]
fn optimizer_state_strict_and_not() {
    let dir = tempfile::tempdir().unwrap();
    let (path, original) = saved(&dir);
    let mut r = setup(true);
    match load_optimizer_state(&path, &mut [&mut r.opt], true) {
        Err(AmpError::State(StateError::IncompatibleKeys { missing_keys, unexpected_keys, what, .. })) => {
            assert_eq!((missing_keys, unexpected_keys), (vec!["extra.w".to_string()], vec![]));
            assert_eq!(what, "optimizer 0 state");
        }
        other => panic!("{other:?}"),
    }
    assert!(state(&r.opt).iter().all(|(_, step, bufs)| *step == 0 && bufs.is_empty()), "a failed load changed state");
    let reports = load_optimizer_state(&path, &mut [&mut r.opt], false).unwrap();
    assert_eq!(reports, [LoadReport { missing_keys: vec!["extra.w".into()], unexpected_keys: vec![] }]);
    let loaded = state(&r.opt);
    for (name, step, bufs) in state(&original.opt) {
        let (_, s, b) = loaded.iter().find(|(n, ..)| *n == name).unwrap();
        assert_eq!(*s, step, "{name}");
        assert_eq!(b.len(), bufs.len());
        assert!(b.iter().zip(&bufs).all(|((ka, ta), (kb, tb))| ka == kb && crate::common::same(ta, tb)), "{name}");
    }
    let (_, s, b) = loaded.iter().find(|(n, ..)| n == "extra.w").unwrap();
    assert!(*s == 0 && b.is_empty());
    assert_eq!(r.opt.step_counts(), original.opt.step_counts());

    // Another rule: refused even when not strict.
    let mut sgd = setup(false);
    sgd.opt = sgd.amp.optimizer(&sgd.vs, nn::Sgd::default(), 0.1).unwrap();
    match load_optimizer_state(&path, &mut [&mut sgd.opt], false) {
        Err(AmpError::State(StateError::StateMismatch { message })) => assert!(message.contains("adam"), "{message}"),
        other => panic!("{other:?}"),
    }
}
