//! Port of the expectations of Apex's tests/L0/run_amp/test_multiple_models_optimizers_losses.py:
//! several models, losses and optimizers; inf injected into an fp16 or fp32 gradient during
//! one backward; the master gradients of unskipped iterations and the final parameters equal a
//! non-AMP reference computed here, and exactly the optimizers Apex skips are skipped.
//!
//! Each model has an fp32 `weight0 = unique + [0, 1]` and an fp16 `weight1 = 1 + unique +
//! [0, 1]` (`cast_model_type=None`, as Apex's test passes `cast_model_type=False`), and
//! computes `sum(x * weight0.float() * weight1.float())` with `x = [1, 1]`.

use std::collections::BTreeSet;

use serde_json::json;
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::{Amp, AmpConfig, AmpOptimizer, OptLevel, ScaleLossOptions, StepOutcome};

struct Optim {
    /// (model index, learning rate) per parameter group.
    groups: Vec<(usize, f64)>,
    momentum: f64,
}

struct Scenario {
    uniques: Vec<f64>,
    optimizers: Vec<Optim>,
    /// Per loss: the models summed into it and the optimizers passed to its scale_loss.
    losses: Vec<(Vec<usize>, Vec<usize>)>,
}

#[derive(Clone, Copy, Debug)]
struct Injection {
    iter: usize,
    backward: usize,
    model: usize,
    fp16: bool,
}

fn build(s: &Scenario) -> VarStore {
    let vs = VarStore::new(Device::Cpu);
    for (i, &u) in s.uniques.iter().enumerate() {
        let p = vs.root().set_group(i) / format!("m{i}");
        let w0 = Tensor::arange(2, (Kind::Float, Device::Cpu)) + u;
        let w1 = (Tensor::arange(2, (Kind::Float, Device::Cpu)) + 1.0 + u).to_kind(Kind::Half);
        let _ = p.add("weight0", w0, true);
        let _ = p.add("weight1", w1, true);
    }
    vs
}

fn model_loss(vs: &VarStore, models: &[usize]) -> Tensor {
    let vars = vs.variables();
    let x = Tensor::ones([2], (Kind::Float, Device::Cpu));
    models
        .iter()
        .map(|m| {
            let w0 = &vars[&format!("m{m}.weight0")];
            let w1 = &vars[&format!("m{m}.weight1")];
            (&x * w0.to_kind(Kind::Float) * w1.to_kind(Kind::Float)).sum(Kind::Float)
        })
        .reduce(|a, b| a + b)
        .unwrap()
}

fn optimizers(amp: &Amp, vs: &VarStore, s: &Scenario) -> Vec<AmpOptimizer> {
    s.optimizers
        .iter()
        .map(|o| {
            let prefixes: Vec<String> = o.groups.iter().map(|(m, _)| format!("m{m}")).collect();
            let prefixes: Vec<&str> = prefixes.iter().map(String::as_str).collect();
            let cfg = nn::Sgd { momentum: o.momentum, dampening: 0.0, wd: 0.0, nesterov: false };
            let mut opt = amp.optimizer_for(vs, &prefixes, cfg, 0.0).unwrap();
            for &(m, lr) in &o.groups {
                opt.set_lr_group(m, lr).unwrap();
            }
            opt
        })
        .collect()
}

fn all_model_params(vs: &VarStore, s: &Scenario) -> Vec<Tensor> {
    let vars = vs.variables();
    (0..s.uniques.len())
        .flat_map(|m| [vars[&format!("m{m}.weight0")].shallow_clone(), vars[&format!("m{m}.weight1")].shallow_clone()])
        .collect()
}

/// The optimizers Apex skips after an inf in `backward`: those passed to that loss.
fn skipped_by(s: &Scenario, inj: Option<Injection>) -> BTreeSet<usize> {
    inj.map(|i| s.losses[i.backward].1.iter().copied().collect()).unwrap_or_default()
}

/// Non-AMP reference: plain backward of each loss, then every optimizer steps except, at the
/// injected iteration, those Apex skips. Returns the grads (per optimizer, per parameter) of
/// every iteration that is not the injected one, and the final model parameters.
fn reference(s: &Scenario, iters: usize, inj: Option<Injection>) -> (Vec<Vec<Tensor>>, Vec<Tensor>) {
    let vs = build(s);
    let amp = Amp::new(&AmpConfig::new(OptLevel::O0).enabled(false).verbosity(0)).unwrap();
    let mut opts = optimizers(&amp, &vs, s);
    let skip = skipped_by(s, inj);
    let mut grads = Vec::new();
    for i in 0..iters {
        for o in opts.iter_mut() {
            o.zero_grad().unwrap();
        }
        for (models, _) in &s.losses {
            model_loss(&vs, models).backward();
        }
        let injected_here = inj.is_some_and(|j| j.iter == i);
        if !injected_here {
            grads.push(opts.iter().flat_map(|o| o.master_params()).map(|p| p.grad().copy()).collect());
        }
        for (k, o) in opts.iter_mut().enumerate() {
            if !(injected_here && skip.contains(&k)) {
                assert!(o.step().unwrap().stepped());
            }
        }
    }
    (grads, all_model_params(&vs, s))
}

fn assert_close(actual: &Tensor, expected: &Tensor, what: &str) {
    // torch.testing.assert_close defaults: fp16 rtol 1e-3 atol 1e-5; fp32 rtol 1.3e-6 atol 1e-5.
    let (rtol, atol) =
        if actual.kind() == Kind::Half || expected.kind() == Kind::Half { (1e-3, 1e-5) } else { (1.3e-6, 1e-5) };
    let a = actual.to_kind(Kind::Double);
    let e = expected.to_kind(Kind::Double);
    let ok = (&a - &e).abs().le_tensor(&(e.abs() * rtol + atol)).all().int64_value(&[]) == 1;
    assert!(ok, "{what}: {a:?} vs expected {e:?}");
}

fn run_case(s: &Scenario, level: OptLevel, zero_with_model: bool, multiple_scalers: bool, inj: Option<Injection>) {
    let what = format!("{level} zero_with_model={zero_with_model} multiple_scalers={multiple_scalers} {inj:?}");
    let iters = if inj.is_some() { 3 } else { 2 };
    let (ref_grads, ref_final) = reference(s, iters, inj);
    let vs = build(s);
    let num_losses = if multiple_scalers { 2 } else { 1 };
    let loss_ids = if multiple_scalers { [0, 1] } else { [0, 0] };
    let cfg = AmpConfig::new(level).verbosity(0).cast_model_type(None).num_losses(num_losses);
    let mut amp = Amp::new(&cfg).unwrap();
    let mut opts = optimizers(&amp, &vs, s);
    // As Apex's test: scaler 0 at 4.0, scaler 1 at 16.0 (static scalers too).
    let state = if multiple_scalers {
        json!({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}, "loss_scaler1": {"loss_scale": 16.0, "unskipped": 0}})
    } else {
        json!({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}})
    };
    amp.load_state_dict(&crate::common::value(state)).unwrap();
    let skip = skipped_by(s, inj);
    let mut unskipped = 0;
    for i in 0..iters {
        if zero_with_model {
            for mut v in vs.trainable_variables() {
                v.zero_grad();
            }
        } else {
            for o in opts.iter_mut() {
                o.zero_grad().unwrap();
            }
        }
        for (b, (models, opt_ids)) in s.losses.iter().enumerate() {
            let loss = model_loss(&vs, models);
            let mut selected: Vec<&mut AmpOptimizer> =
                opts.iter_mut().enumerate().filter(|(k, _)| opt_ids.contains(k)).map(|(_, o)| o).collect();
            let options = ScaleLossOptions { loss_id: loss_ids[b], delay_unscale: false };
            let vars = vs.variables();
            let outcome = amp
                .scale_loss_with(&loss, &mut selected, options, |scaled| {
                    scaled.backward();
                    if let Some(j) = inj.filter(|j| j.iter == i && j.backward == b) {
                        let name = format!("m{}.{}", j.model, if j.fp16 { "weight1" } else { "weight0" });
                        let _ = vars[&name].grad().get(0).fill_(f64::INFINITY);
                    }
                })
                .unwrap();
            let injected = inj.is_some_and(|j| j.iter == i && j.backward == b);
            assert_eq!(outcome.overflow, injected, "{what}: overflow flag at iter {i} backward {b}");
        }
        let injected_here = inj.is_some_and(|j| j.iter == i);
        if !injected_here {
            let masters: Vec<Tensor> = opts.iter().flat_map(|o| o.master_params()).collect();
            assert_eq!(masters.len(), ref_grads[unskipped].len());
            for (k, (m, r)) in masters.iter().zip(&ref_grads[unskipped]).enumerate() {
                assert_close(
                    &m.grad().to_kind(Kind::Float),
                    &r.to_kind(Kind::Float),
                    &format!("{what}: grad {k} iter {i}"),
                );
            }
            unskipped += 1;
        }
        for (k, o) in opts.iter_mut().enumerate() {
            let outcome = o.step().unwrap();
            let expect_skip = injected_here && skip.contains(&k);
            assert_eq!(!outcome.stepped(), expect_skip, "{what}: optimizer {k} at iter {i}: {outcome:?}");
            if let StepOutcome::Skipped { loss_id, loss_scale } = outcome {
                let b = inj.unwrap().backward;
                assert_eq!(loss_id, loss_ids[b]);
                // The affected scaler halved.
                let start = if loss_ids[b] == 0 { 4.0 } else { 16.0 };
                assert_eq!(loss_scale, start / 2.0, "{what}");
            }
        }
    }
    let masters: Vec<Tensor> = opts.iter().flat_map(|o| o.master_params()).collect();
    let model_params = all_model_params(&vs, s);
    for (k, ((p, m), r)) in model_params.iter().zip(&masters).zip(&ref_final).enumerate() {
        assert_close(p, r, &format!("{what}: final param {k}"));
        assert!(crate::common::same(p, &m.to_kind(p.kind())), "{what}: model param {k} != master cast to model dtype");
    }
}

fn run_all(s: &Scenario) {
    for level in OptLevel::ALL {
        for zero_with_model in [false, true] {
            for multiple_scalers in [true, false] {
                run_case(s, level, zero_with_model, multiple_scalers, None);
                if !matches!(level, OptLevel::O1 | OptLevel::O2) {
                    continue;
                }
                for iter in [0, 1] {
                    for fp16 in [true, false] {
                        for (backward, (models, _)) in s.losses.iter().enumerate() {
                            for &model in models {
                                let inj = Injection { iter, backward, model, fp16 };
                                run_case(s, level, zero_with_model, multiple_scalers, Some(inj));
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn two_models_two_losses_one_optimizer() {
    run_all(&Scenario {
        uniques: vec![1.0, 2.0],
        optimizers: vec![Optim { groups: vec![(0, 0.25), (1, 0.5)], momentum: 0.125 }],
        losses: vec![(vec![0], vec![0]), (vec![1], vec![0])],
    });
}

#[test]
fn three_models_two_losses_one_optimizer() {
    run_all(&Scenario {
        uniques: vec![1.0, 2.0, 3.0],
        optimizers: vec![Optim { groups: vec![(0, 0.25), (1, 0.5), (2, 0.125)], momentum: 0.125 }],
        losses: vec![(vec![0, 2], vec![0]), (vec![1, 2], vec![0])],
    });
}

#[test]
fn two_models_two_losses_two_optimizers() {
    run_all(&Scenario {
        uniques: vec![1.0, 2.0],
        optimizers: vec![
            Optim { groups: vec![(0, 0.25)], momentum: 0.125 },
            Optim { groups: vec![(1, 0.5)], momentum: 0.25 },
        ],
        losses: vec![(vec![0], vec![0]), (vec![1], vec![1])],
    });
}

#[test]
fn three_models_two_losses_two_optimizers_loss1_touching_both() {
    run_all(&Scenario {
        uniques: vec![1.0, 2.0, 3.0],
        optimizers: vec![
            Optim { groups: vec![(0, 0.25), (1, 1.0)], momentum: 0.5 },
            Optim { groups: vec![(2, 0.5)], momentum: 0.25 },
        ],
        losses: vec![(vec![0, 1], vec![0]), (vec![2, 1], vec![0, 1])],
    });
}
