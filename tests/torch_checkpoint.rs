//! tch_amp::torch_checkpoint against PyTorch 2.13: checkpoints a Python script wrote (torch.optim
//! SGD with momentum and two param groups, Adam, AdamW with out-of-order named groups; O0 and O2;
//! zip and legacy containers) resume in Rust and continue bit for bit as Python continues from
//! the same file; checkpoints Rust wrote load in Python with `weights_only=True` and continue bit
//! for bit as the Rust run continues; bad files give typed errors and change nothing; a seeded
//! fuzz of the checkpoint-level loader; nanoGPT's checkpoint logic both ways (torch.amp fp16, a
//! GradScaler, per-group weight decay, a tied embedding, `_orig_mod.` keys; its Python side is
//! scripts/reference/ported_checkpoints.py); Apex's optimizers through torch files.
//!
//! The Python side is scripts/reference/torch_checkpoint_fixtures.py (its docstring describes
//! the model, the scenarios and how O2 is done by hand), run with the venv's python
//! ($TCH_AMP_PYTHON) into a temporary folder, with one intra-op thread on both sides.
//!
//! The rule compared at O2: the masters are the file's fp32 model values and the optimizer
//! state is loaded straight into fp32 (tch-amp's resume, which a Python O2 loop that builds its
//! masters from the file reproduces). Apex's own resume round-trips the state through fp16; the
//! script also runs that ("<scenario>/apex") and the test checks it differs as the docs say.
#[path = "common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::time::Duration;
use tch_amp::error::StateError;

use common::reference::{bits_equal, describe_diff, Fixture};
use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::torch_checkpoint::{self, load_torch_checkpoint_value, KeyPrefix, TorchLoadOptions, TorchSaveOptions};
use tch_amp::torch_io::{self, Dict, Key, Seg, TorchIoError, Value};
use tch_amp::{
    load_torch_checkpoint, save_torch_checkpoint, Amp, AmpConfig, AmpError, AmpModel, AmpOptimizer, OptLevel,
    OptimizerConfig,
};

// ---------------------------------------------------------------------------------------------
// The Python side

/// Runs the fixture script with a time limit; panics with its stderr on failure.
fn run_script(args: &[&str]) {
    common::python::run_reference_script("torch_checkpoint_fixtures.py", args, Duration::from_secs(300));
}

/// The checkpoints and continuations, in a temporary folder.
struct Fixtures {
    dir: tempfile::TempDir,
    fx: Fixture,
    k: i64,
    m: i64,
    n: i64,
    inject: i64,
    factor: f64,
}

impl Fixtures {
    fn write() -> Fixtures {
        tch::set_num_threads(1);
        let dir = tempfile::tempdir().unwrap();
        run_script(&["write", dir.path().to_str().unwrap()]);
        let fx = Fixture::read(&dir.path().join("expected.safetensors"));
        let steps = fx.meta_json("steps");
        let int = |k: &str| steps[k].as_i64().unwrap();
        let (k, m, n, inject) = (int("K"), int("M"), int("N"), int("inject"));
        let factor = steps["inject_factor"].as_f64().unwrap();
        Fixtures { dir, fx, k, m, n, inject, factor }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

// ---------------------------------------------------------------------------------------------
// The Rust side: the model of the script, as a tch user writes it

const SCENARIOS: [&str; 5] = ["sgd_o0", "sgd_o2", "adam_o0", "adam_o2", "adamw_named_o0"];

#[derive(Debug)]
struct Net {
    fc1: nn::Linear,
    bn1: nn::BatchNorm,
    fc2: nn::Linear,
}

impl ModuleT for Net {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        xs.apply(&self.fc1).apply_t(&self.bn1, train).relu().apply(&self.fc2)
    }
}

/// The model with the scenario's tch parameter groups (the Python optimizer's groups).
fn net(vs: &VarStore, scenario: &str) -> Net {
    let root = vs.root();
    let zeros = nn::Init::Const(0.0);
    if scenario.starts_with("sgd") {
        // Groups [fc1, bn1] and [fc2].
        let g1 = root.set_group(1);
        Net {
            fc1: nn::linear(&root / "fc1", 16, 32, Default::default()),
            bn1: nn::batch_norm1d(&root / "bn1", 32, Default::default()),
            fc2: nn::linear(&g1 / "fc2", 32, 10, Default::default()),
        }
    } else if scenario.starts_with("adam_") {
        Net {
            fc1: nn::linear(&root / "fc1", 16, 32, Default::default()),
            bn1: nn::batch_norm1d(&root / "bn1", 32, Default::default()),
            fc2: nn::linear(&root / "fc2", 32, 10, Default::default()),
        }
    } else {
        // Groups [weights] and [biases, batch norm].
        let g1 = root.set_group(1);
        let fc1 = nn::Linear {
            ws: (&root / "fc1").var("weight", &[32, 16], zeros),
            bs: Some((&g1 / "fc1").var("bias", &[32], zeros)),
        };
        let bn1 = nn::batch_norm1d(&g1 / "bn1", 32, Default::default());
        let fc2 = nn::Linear {
            ws: (&root / "fc2").var("weight", &[10, 32], zeros),
            bs: Some((&g1 / "fc2").var("bias", &[10], zeros)),
        };
        Net { fc1, bn1, fc2 }
    }
}

fn optimizer_config(scenario: &str) -> (OptimizerConfig, f64) {
    if scenario.starts_with("sgd") {
        (nn::Sgd { momentum: 0.9, dampening: 0.0, wd: 1e-4, nesterov: false }.into(), 0.1)
    } else if scenario.starts_with("adam_") {
        (nn::Adam::default().into(), 1e-3) // torch's defaults
    } else {
        (nn::AdamW { beta1: 0.9, beta2: 0.999, wd: 0.01, eps: 1e-8, amsgrad: false }.into(), 1e-3)
    }
}

struct Setup {
    vs: VarStore,
    model: AmpModel<Net>,
    opt: AmpOptimizer,
    amp: Amp,
    dynamic: bool,
}

fn setup(scenario: &str) -> Setup {
    let vs = VarStore::new(Device::Cpu);
    let net = net(&vs, scenario);
    let o2 = scenario.ends_with("o2");
    let level = if o2 { OptLevel::O2 } else { OptLevel::O0 };
    // Native fp16 kernels on CPU, as the Python script runs them.
    let amp = Amp::new(&AmpConfig::new(level).verbosity(0).emulate_low_precision_on_cpu(false)).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let (config, lr) = optimizer_config(scenario);
    let opt = amp.optimizer(&vs, config, lr).unwrap();
    Setup { vs, model, opt, amp, dynamic: o2 }
}

struct Trace {
    loss: Vec<Tensor>,
    scale: Vec<f64>,
    skipped: Vec<bool>,
}

/// `n` training steps on data steps `start..start + n`.
fn train(s: &mut Setup, f: &Fixtures, start: i64, n: i64) -> Trace {
    let (xs, ys) = (f.fx.get("x"), f.fx.get("y"));
    let mut t = Trace { loss: Vec::new(), scale: Vec::new(), skipped: Vec::new() };
    for step in start..start + n {
        s.opt.zero_grad().unwrap();
        let out = s.model.forward_t(&xs.get(step), true);
        let loss = out.cross_entropy_for_logits(&ys.get(step));
        let user = if s.dynamic && step == f.inject { &loss * f.factor } else { loss.shallow_clone() };
        let so = s.amp.scale_loss(&user, &mut [&mut s.opt], |l| l.backward()).unwrap();
        t.skipped.push(!s.opt.step().unwrap().stepped());
        t.scale.push(so.loss_scale);
        t.loss.push(loss.detach().to_kind(Kind::Float));
    }
    t
}

/// Differences between the Rust run and the expectation under `tag` (empty: bit for bit).
fn compare(s: &Setup, t: &Trace, fx: &Fixture, tag: &str) -> Vec<String> {
    let mut bad = Vec::new();
    let (loss, scale, skipped) =
        (fx.get(&format!("{tag}/loss")), fx.get(&format!("{tag}/scale")), fx.get(&format!("{tag}/skipped")));
    for (i, l) in t.loss.iter().enumerate() {
        let i64i = i as i64;
        if !bits_equal(l, &loss.get(i64i)) {
            bad.push(format!("{tag}: loss of step {i}: {} vs {}", l.double_value(&[]), loss.double_value(&[i64i])));
        }
        if t.scale[i] != scale.double_value(&[i64i]) {
            bad.push(format!("{tag}: scale of step {i}: {} vs {}", t.scale[i], scale.double_value(&[i64i])));
        }
        if i64::from(t.skipped[i]) != skipped.int64_value(&[i64i]) {
            bad.push(format!("{tag}: step {i} skipped {} vs Python", t.skipped[i]));
        }
    }
    for (name, v) in s.vs.variables() {
        let want = fx.get(&format!("{tag}/final/{name}"));
        if !bits_equal(&v, want) {
            bad.push(format!("{tag}: {name}: {}", describe_diff(&v, want)));
        }
    }
    let record = s.opt.to_record();
    let mut rust_buffers = 0;
    for p in &record.params {
        let key = format!("{tag}/master/{}", p.name);
        match (&p.master, fx.has(&key)) {
            (Some(m), true) if !bits_equal(m, fx.get(&key)) => {
                bad.push(format!("{tag}: master {}: {}", p.name, describe_diff(m, fx.get(&key))))
            }
            (Some(_), false) | (None, true) => bad.push(format!("{tag}: master {} on one side only", p.name)),
            _ => {}
        }
        for (buf, v) in &p.buffers {
            rust_buffers += 1;
            let key = format!("{tag}/state/{}/{buf}", p.name);
            if !fx.has(&key) {
                bad.push(format!("{tag}: Python has no {buf} for {}", p.name));
            } else if !bits_equal(v, fx.get(&key)) {
                bad.push(format!("{tag}: {} {buf}: {}", p.name, describe_diff(v, fx.get(&key))));
            }
        }
        let key = format!("{tag}/step/{}", p.name);
        if fx.has(&key) && fx.get(&key).double_value(&[]) != p.step as f64 {
            bad.push(format!("{tag}: {} step {} vs {}", p.name, p.step, fx.get(&key).double_value(&[])));
        }
    }
    let python_buffers = fx.tensors.keys().filter(|k| k.starts_with(&format!("{tag}/state/"))).count();
    if python_buffers != rust_buffers {
        bad.push(format!("{tag}: {rust_buffers} state tensors in Rust, {python_buffers} in Python"));
    }
    bad
}

/// Everything a load may change, deep-copied: variables, masters, optimizer state, step
/// counts, learning rates, loss scalers.
fn snapshot(s: &Setup) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = s.vs.variables().into_iter().map(|(n, t)| (n, t.copy())).collect();
    let r = s.opt.to_record();
    for p in &r.params {
        if let Some(m) = &p.master {
            out.push((format!("master/{}", p.name), m.copy()));
        }
        for (b, t) in &p.buffers {
            out.push((format!("state/{}/{b}", p.name), t.copy()));
        }
        out.push((format!("step/{}", p.name), Tensor::from(p.step as i64)));
    }
    let mut scalars = vec![r.lr, r.steps as f64, r.skipped as f64, s.amp.loss_scale(0).unwrap()];
    scalars.extend(r.group_lr.iter().flat_map(|(g, v)| [*g as f64, *v]));
    scalars.push(s.amp.scalers()[0].unskipped() as f64);
    out.push(("scalars".into(), Tensor::from_slice(&scalars)));
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn same_snapshot(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|((n, x), (m, y))| n == m && bits_equal(x, y))
}

// ---------------------------------------------------------------------------------------------
// Python's checkpoints resume in Rust

#[test]
fn python_checkpoints_resume_bit_for_bit_zip_and_legacy() {
    let f = Fixtures::write();
    let mut failures = Vec::new();
    for scenario in SCENARIOS {
        for container in ["zip", "legacy"] {
            let mut s = setup(scenario);
            let path = f.path(&format!("{scenario}.{container}.pt"));
            let report = load_torch_checkpoint(&path, &s.vs, &mut [&mut s.opt], &mut s.amp, &TorchLoadOptions::new())
                .unwrap_or_else(|e| panic!("{scenario} {container}: {e}"));
            assert!(report.amp_loaded && report.missing.is_empty() && report.unexpected.is_empty());
            assert_eq!(report.ignored, ["bn1.num_batches_tracked"], "{scenario}");
            assert_eq!(report.entries.get_str("epoch").map(Value::type_name), Some("int"));
            // O2: the fp32 state dict went into the fp16 layers, rounded; nothing else converts.
            let converted: Vec<&str> = report.converted.iter().map(|c| c.0.as_str()).collect();
            if scenario.ends_with("o2") {
                assert_eq!(converted, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], "{scenario}");
                assert!(report.converted.iter().all(|c| c.1 == Kind::Float && c.2 == Kind::Half));
            } else {
                assert!(converted.is_empty(), "{scenario}: {converted:?}");
            }
            let order = &report.param_orders[0];
            if scenario == "adamw_named_o0" {
                // From the file's param_names (the groups are not in model order).
                assert_eq!(order[0], ["fc1.weight", "fc2.weight"]);
            } else if scenario.starts_with("sgd") {
                // From the model state dict's order (model.parameters()'s), cut into the groups.
                assert_eq!(
                    order,
                    &[vec!["fc1.weight", "fc1.bias", "bn1.weight", "bn1.bias"], vec!["fc2.weight", "fc2.bias"]]
                );
                assert_eq!((s.opt.lr_group(0), s.opt.lr_group(1)), (0.1, 0.05));
            }
            if scenario.ends_with("o2") {
                assert_eq!((s.amp.loss_scale(0).unwrap(), s.amp.scalers()[0].unskipped()), (32768.0, 1998));
            }
            let t = train(&mut s, &f, f.k, f.n);
            let bad = compare(&s, &t, &f.fx, scenario);
            println!("{scenario} {container}: {}", if bad.is_empty() { "bit for bit" } else { "DIFFERS" });
            failures.extend(bad.into_iter().map(|b| format!("{container}: {b}")));
            if scenario.ends_with("o2") && container == "zip" {
                // Apex's own resume of the same file differs from the uninterrupted continuation.
                let apex = compare(&s, &t, &f.fx, &format!("{scenario}/apex"));
                let err = f.fx.get(&format!("{scenario}/apex_state_error")).double_value(&[]);
                println!(
                    "{scenario}: Apex's resume: state off by up to {err:e} after loading; {} differences",
                    apex.len()
                );
                for line in apex.iter().filter(|l| l.contains("master")) {
                    println!("  {line}");
                }
                assert!(!apex.is_empty(), "{scenario}: Apex's lossy resume should differ");
                assert!(err > 1e-7 && err < 1e-4, "{scenario}: state round trip error {err}");
            }
        }
    }
    assert!(failures.is_empty(), "{} differences:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn apex_adam_resume_flushes_small_second_moments_documented_numbers() {
    // The docs' numbers: Apex's resume flushes Adam's second moments below fp16's range to 0;
    // for fc1.bias (a layer followed by batch norm: tiny gradients) the resumed steps then move
    // the bias by far more than the uninterrupted run does.
    let f = Fixtures::write();
    let fx = &f.fx;
    let v = fx.get("adam_o2/state/fc1.bias/exp_avg_sq");
    assert!(v.max().double_value(&[]) < 6e-8, "fc1.bias second moments are below fp16's smallest subnormal");
    let apex = fx.get("adam_o2/apex/master/fc1.bias");
    let ours = fx.get("adam_o2/master/fc1.bias");
    let moved = (apex - ours).abs().max().double_value(&[]);
    println!("Apex's resume moves fc1.bias by up to {moved:e} more than the uninterrupted run");
    assert!(moved > 1e-2, "{moved}");
    let sgd = fx.get("sgd_o2/apex_state_error").double_value(&[]);
    println!("SGD momentum after Apex's load: off by up to {sgd:e}");
    assert!(sgd > 1e-5 && sgd < 1e-4, "{sgd}");
}

#[test]
fn main_amp_layout_ddp_prefix_half_state_dicts_and_param_order() {
    let f = Fixtures::write();
    // Apex's imagenet layout from a DDP model: "module." stripped, no amp entry, the other
    // entries handed back.
    let mut s = setup("sgd_o0");
    let path = f.path("sgd_o0.main_amp.pth");
    let report =
        load_torch_checkpoint(&path, &s.vs, &mut [&mut s.opt], &mut s.amp, &TorchLoadOptions::main_amp()).unwrap();
    assert_eq!(report.stripped_prefix.as_deref(), Some("module."));
    assert!(!report.amp_loaded);
    let keys: Vec<String> = report.entries.keys().map(|k| k.to_string()).collect();
    assert_eq!(keys, ["\"epoch\"", "\"arch\"", "\"best_prec1\""]);
    let e = Value::Dict(report.entries);
    assert_eq!(e.get("best_prec1").unwrap().as_f64().unwrap(), 12.5);
    assert_eq!(e.get("arch").unwrap().as_str().unwrap(), "mlp");
    let t = train(&mut s, &f, f.k, f.n);
    let bad = compare(&s, &t, &f.fx, "sgd_o0");
    assert!(bad.is_empty(), "{bad:?}");
    // The same file with the prefix kept: nothing matches, nothing changes.
    let mut s = setup("sgd_o0");
    let before = snapshot(&s);
    let opts = TorchLoadOptions::main_amp().key_prefix(KeyPrefix::Keep);
    match load_torch_checkpoint(&path, &s.vs, &mut [&mut s.opt], &mut s.amp, &opts) {
        Err(AmpError::State(StateError::IncompatibleKeys {
            missing_keys: missing,
            unexpected_keys: unexpected,
            ..
        })) => {
            // The 8 variables (6 parameters, 2 running statistics) and the file's 8 prefixed keys
            // (its num_batches_tracked is ignored, not unexpected).
            assert_eq!((missing.len(), unexpected.len()), (8, 8), "{missing:?} {unexpected:?}");
            assert!(unexpected.iter().all(|k| k.starts_with("module.")), "{unexpected:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(same_snapshot(&before, &snapshot(&s)));

    // An fp16 state dict into the fp32 model: converted (listed), or refused with exact_dtypes.
    let half = f.path("sgd_o0.half_model.pt");
    let mut s = setup("sgd_o0");
    let r = load_torch_checkpoint(&half, &s.vs, &mut [&mut s.opt], &mut s.amp, &TorchLoadOptions::new()).unwrap();
    assert_eq!(r.converted.len(), 8, "{:?}", r.converted);
    assert!(r.converted.iter().all(|c| c.1 == Kind::Half && c.2 == Kind::Float));
    let mut s = setup("sgd_o0");
    let before = snapshot(&s);
    let err =
        load_torch_checkpoint(&half, &s.vs, &mut [&mut s.opt], &mut s.amp, &TorchLoadOptions::new().exact_dtypes(true))
            .unwrap_err();
    assert!(
        matches!(&err, AmpError::State(StateError::DtypeMismatch { found: Kind::Half, target, .. }) if target == "fc1.weight"),
        "{err}"
    );
    assert!(same_snapshot(&before, &snapshot(&s)));

    // Groups out of model order without param_names: file group i is the optimizer's group i,
    // its parameters in model order (model.parameters()'s), so it loads and continues bit for
    // bit; given explicitly, the same.
    let mut tree = torch_io::load(f.path("adamw_named_o0.zip.pt")).unwrap();
    edit(&mut tree, &["optimizer", "param_groups"], |groups| {
        if let Value::List(gs) = groups {
            for g in gs {
                if let Value::Dict(d) = g {
                    d.remove(&Key::from("param_names"));
                }
            }
        }
    });
    let order = vec![
        vec!["fc1.weight".to_string(), "fc2.weight".to_string()],
        ["fc1.bias", "bn1.weight", "bn1.bias", "fc2.bias"].map(String::from).to_vec(),
    ];
    for explicit in [false, true] {
        let mut s = setup("adamw_named_o0");
        let opts =
            if explicit { TorchLoadOptions::new().param_order(0, order.clone()) } else { TorchLoadOptions::new() };
        let r = load_torch_checkpoint_value(tree.shallow_clone(), &s.vs, &mut [&mut s.opt], &mut s.amp, &opts).unwrap();
        assert_eq!(r.param_orders[0], order);
        assert_eq!((s.opt.lr_group(0), s.opt.lr_group(1)), (1e-3, 2e-3));
        let t = train(&mut s, &f, f.k, f.n);
        let bad = compare(&s, &t, &f.fx, "adamw_named_o0");
        assert!(bad.is_empty(), "{bad:?}");
    }
    // An optimizer with one group for a file with two, which cutting the model order into the
    // file's groups does not line up with either: the order would be a guess, refused.
    let mut s = setup("adam_o0");
    let before = snapshot(&s);
    let err = load_torch_checkpoint_value(
        tree.shallow_clone(),
        &s.vs,
        &mut [&mut s.opt],
        &mut s.amp,
        &TorchLoadOptions::new(),
    )
    .unwrap_err();
    assert!(matches!(err, AmpError::State(StateError::ParamOrder { .. })), "{err}");
    println!("{err}");
    assert!(same_snapshot(&before, &snapshot(&s)));

    // optimizer_config reads the optimizer a state dict was made with.
    for scenario in SCENARIOS {
        let tree = torch_io::load(f.path(&format!("{scenario}.zip.pt"))).unwrap();
        let (config, lr) =
            torch_checkpoint::optimizer_config(&tree.get("optimizer").unwrap().value().shallow_clone()).unwrap();
        let (want, want_lr) = optimizer_config(scenario);
        assert_eq!(lr, want_lr, "{scenario}");
        assert_eq!(config.name(), want.name(), "{scenario}");
        assert_eq!(config.hyper_parameters(), want.hyper_parameters(), "{scenario}");
    }
}

// ---------------------------------------------------------------------------------------------
// Rust's checkpoints resume in Python

#[test]
fn rust_checkpoints_resume_in_python_with_weights_only_bit_for_bit() {
    let f = Fixtures::write();
    let mut failures = Vec::new();
    for scenario in SCENARIOS {
        let mut s = setup(scenario);
        load_torch_checkpoint(
            f.path(&format!("{scenario}.zip.pt")),
            &s.vs,
            &mut [&mut s.opt],
            &mut s.amp,
            &TorchLoadOptions::new(),
        )
        .unwrap();
        train(&mut s, &f, f.k, f.m);
        let ckpt = f.path(&format!("{scenario}.rust.pt"));
        let mut options = TorchSaveOptions::new().entry("epoch", 2i64);
        if scenario == "adamw_named_o0" {
            // The Python script's groups: weights, then biases and batch norm.
            options = options.param_order(
                0,
                vec![
                    vec!["fc1.weight".into(), "fc2.weight".into()],
                    ["fc1.bias", "bn1.weight", "bn1.bias", "fc2.bias"].map(String::from).to_vec(),
                ],
            );
        }
        save_torch_checkpoint(&ckpt, &s.vs, &[&s.opt], &s.amp, &options).unwrap();
        // Rust's own resume of the file: the same state.
        let mut again = setup(scenario);
        load_torch_checkpoint(&ckpt, &again.vs, &mut [&mut again.opt], &mut again.amp, &TorchLoadOptions::new())
            .unwrap();
        let (a, b) = (snapshot(&s), snapshot(&again));
        let steps_differ = |n: &str| n.starts_with("step/") || n == "scalars";
        for ((n, x), (_, y)) in a.iter().zip(&b) {
            // SGD's step counts are not in torch's format; the rest must be equal.
            if !(scenario.starts_with("sgd") && steps_differ(n)) {
                assert!(bits_equal(x, y), "{scenario}: {n} after Rust's own round trip");
            }
        }
        // Python resumes from the file; Rust continues from where it saved.
        let out = f.path(&format!("{scenario}.resume.safetensors"));
        let start = (f.k + f.m).to_string();
        run_script(&["resume", scenario, ckpt.to_str().unwrap(), out.to_str().unwrap(), &start]);
        let t = train(&mut s, &f, f.k + f.m, f.n);
        let bad = compare(&s, &t, &Fixture::read(&out), "resume");
        println!(
            "{scenario}: Python resumed the Rust checkpoint {}",
            if bad.is_empty() { "bit for bit" } else { "DIFFERENTLY" }
        );
        failures.extend(bad.into_iter().map(|b| format!("{scenario}: {b}")));
    }
    assert!(failures.is_empty(), "{} differences:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn saved_layouts_main_amp_prefix_counters_and_option_errors() {
    let s = setup("sgd_o2");
    let opts = TorchSaveOptions::main_amp()
        .entry("epoch", 5i64)
        .entry("arch", "mlp")
        .entry("best_prec1", 71.25)
        .key_prefix("module.")
        .num_batches_tracked(40);
    let v = torch_checkpoint::torch_checkpoint_value(&s.vs, &[&s.opt], &s.amp, &opts).unwrap();
    let root = v.node();
    let keys: Vec<String> = root.as_dict().unwrap().keys().map(|k| k.to_string()).collect();
    assert_eq!(keys, ["\"epoch\"", "\"arch\"", "\"best_prec1\"", "\"state_dict\"", "\"optimizer\"", "\"amp\""]);
    let sd = root.get("state_dict").unwrap();
    let names: Vec<String> =
        sd.as_dict().unwrap().keys().map(|k| k.to_string().trim_matches('"').to_string()).collect();
    assert_eq!(
        names,
        [
            "module.fc1.weight",
            "module.fc1.bias",
            "module.bn1.weight",
            "module.bn1.bias",
            "module.bn1.running_mean",
            "module.bn1.running_var",
            "module.bn1.num_batches_tracked",
            "module.fc2.weight",
            "module.fc2.bias"
        ]
    );
    assert!(sd.as_dict().unwrap().is_ordered());
    // fp32 model state (the masters), an int64 counter.
    assert_eq!(sd.get("module.fc1.weight").unwrap().as_tensor().unwrap().kind(), Kind::Float);
    let counter = sd.get("module.bn1.num_batches_tracked").unwrap().as_tensor().unwrap().shallow_clone();
    assert_eq!((counter.kind(), counter.size(), counter.int64_value(&[])), (Kind::Int64, vec![], 40));
    let groups = root.get("optimizer").unwrap().get("param_groups").unwrap();
    let g1_names = groups.get(1).unwrap().get("param_names").unwrap();
    assert_eq!(g1_names.get(0).unwrap().as_str().unwrap(), "module.fc2.weight");
    let scaler = root.get("amp").unwrap().get("loss_scaler0").unwrap();
    assert_eq!(scaler.get("loss_scale").unwrap().as_f64().unwrap(), 65536.0);
    assert_eq!(scaler.get("unskipped").unwrap().as_i64().unwrap(), 0);

    // Options that do not fit the call.
    let mut s = s;
    s.opt.set_lr_group(1, 0.05).unwrap();
    let bad = |o: TorchSaveOptions| torch_checkpoint::torch_checkpoint_value(&s.vs, &[&s.opt], &s.amp, &o).unwrap_err();
    for e in [
        bad(TorchSaveOptions::new().optimizer_keys(["a", "b"])),
        bad(TorchSaveOptions::new().entry("model", 1i64)),
        bad(TorchSaveOptions::new().param_order(0, vec![vec!["fc1.weight".into()]])),
        // One torch group for parameters of two learning rates.
        bad(TorchSaveOptions::new().param_order(
            0,
            vec![["fc1.weight", "fc1.bias", "bn1.weight", "bn1.bias", "fc2.weight", "fc2.bias"]
                .map(String::from)
                .to_vec()],
        )),
    ] {
        assert!(matches!(e, AmpError::Config(tch_amp::error::ConfigError::OptionsMismatch { .. })), "{e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Bad files

/// Applies `f` to the value at `path` (dict keys) of `tree`.
fn edit(tree: &mut Value, path: &[&str], f: impl FnOnce(&mut Value)) {
    let segs: Vec<Seg> = path.iter().map(|k| Seg::from(*k)).collect();
    f(tree.path_mut(&segs).unwrap_or_else(|e| panic!("{e}")));
}

fn checkpoint_bytes(tree: &Value) -> Vec<u8> {
    torch_io::save_bytes(tree).unwrap()
}

#[test]
fn bad_files_give_typed_errors_and_change_nothing() {
    let f = Fixtures::write();
    let good_path = f.path("sgd_o2.zip.pt");
    let good = std::fs::read(&good_path).unwrap();
    let legacy = std::fs::read(f.path("sgd_o2.legacy.pt")).unwrap();
    let tree = || torch_io::load(&good_path).unwrap();
    let mut s = setup("sgd_o2");
    // Load something first, so that "nothing changed" is checked against a trained state.
    load_torch_checkpoint(&good_path, &s.vs, &mut [&mut s.opt], &mut s.amp, &TorchLoadOptions::new()).unwrap();
    train(&mut s, &f, f.k, 1);
    let before = snapshot(&s);
    let dir = tempfile::tempdir().unwrap();
    let mut case = 0;
    let mut check = |what: &str, bytes: Vec<u8>, ok: &dyn Fn(&AmpError) -> bool| {
        case += 1;
        let p = dir.path().join(format!("case{case}.pt"));
        std::fs::write(&p, bytes).unwrap();
        let err =
            load_torch_checkpoint(&p, &s.vs, &mut [&mut s.opt], &mut s.amp, &TorchLoadOptions::new()).expect_err(what);
        println!("{what}: {err}");
        assert!(ok(&err), "{what}: unexpected error {err:?}");
        assert!(same_snapshot(&before, &snapshot(&s)), "{what}: the failed load changed something");
    };
    let file = |e: &AmpError| matches!(e, AmpError::File(_));
    check("truncated zip", good[..good.len() / 2].to_vec(), &file);
    check("truncated legacy", legacy[..legacy.len() - 100].to_vec(), &file);
    let mut wrong_magic = legacy.clone();
    wrong_magic[5] ^= 0x40; // inside the magic number's LONG1 bytes
    check("wrong magic", wrong_magic, &|e| matches!(e, AmpError::File(TorchIoError::BadMagic { .. })));
    check("not a torch file", b"PK\x03\x04 nothing".to_vec(), &file);
    check(
        "a disallowed global (argparse.Namespace)",
        std::fs::read(f.path("with_args.pt")).unwrap(),
        &|e| matches!(e, AmpError::File(TorchIoError::DisallowedGlobal { module, name, .. }) if module == "argparse" && name == "Namespace"),
    );
    for key in ["optimizer", "amp", "model"] {
        let mut t = tree();
        if let Value::Dict(d) = &mut t {
            d.remove(&Key::from(key));
        }
        check(
            &format!("missing {key}"),
            checkpoint_bytes(&t),
            &|e| matches!(e, AmpError::State(StateError::MissingEntry { key: k, .. }) if k == key),
        );
    }
    let mut t = tree();
    edit(&mut t, &["model"], |m| {
        if let Value::Dict(d) = m {
            d.remove(&Key::from("fc2.bias"));
        }
    });
    check(
        "a missing model key",
        checkpoint_bytes(&t),
        &|e| matches!(e, AmpError::State(StateError::IncompatibleKeys { missing_keys: missing, unexpected_keys: unexpected, .. }) if missing == &["fc2.bias"] && unexpected.is_empty()),
    );
    let mut t = tree();
    edit(&mut t, &["model", "fc1.weight"], |v| *v = Value::Tensor(Tensor::zeros([32, 15], (Kind::Float, Device::Cpu))));
    check(
        "a shape mismatch",
        checkpoint_bytes(&t),
        &|e| matches!(e, AmpError::State(StateError::ShapeMismatch { found, .. }) if found == &[32, 15]),
    );
    let mut t = tree();
    edit(&mut t, &["model", "bn1.running_var"], |v| *v = Value::Tensor(Tensor::ones([32], (Kind::Int64, Device::Cpu))));
    check("a dtype mismatch", checkpoint_bytes(&t), &|e| {
        matches!(e, AmpError::State(StateError::DtypeMismatch { found: Kind::Int64, .. }))
    });
    let mut t = tree();
    edit(&mut t, &["model", "fc2.bias"], |v| {
        *v = Value::Tensor(Tensor::full([10], f64::NAN, (Kind::Float, Device::Cpu)))
    });
    check("a NaN weight", checkpoint_bytes(&t), &|e| matches!(e, AmpError::State(StateError::NonFinite { .. })));
    let mut t = tree();
    edit(&mut t, &["optimizer", "state"], |st| {
        if let Value::Dict(d) = st {
            d.insert(
                Key::Int(0),
                Value::Dict(Dict::new().with(
                    "momentum_buffer",
                    Value::Tensor(Tensor::full([32, 16], f64::INFINITY, (Kind::Float, Device::Cpu))),
                )),
            );
        }
    });
    check(
        "an inf momentum",
        checkpoint_bytes(&t),
        &|e| matches!(e, AmpError::State(StateError::NonFinite { path }) if path == "optimizer.state.0.momentum_buffer"),
    );
    // A learning rate finite in f64, inf in fp32: nothing applied, the parameter named.
    let mut t = tree();
    edit(&mut t, &["optimizer"], |o| {
        let Value::Dict(d) = o else { panic!("optimizer is not a dict") };
        let Some(mut groups) = d.remove(&Key::from("param_groups")) else { panic!("no param_groups") };
        let Value::List(list) = &mut groups else { panic!("param_groups is not a list") };
        for g in list {
            let Value::Dict(g) = g else { panic!("a group is not a dict") };
            g.insert("lr", Value::Float(1e308));
        }
        d.insert("param_groups", groups);
    });
    check(
        "lr 1e308",
        checkpoint_bytes(&t),
        &|e| matches!(e, AmpError::State(StateError::PoisonedState { param, .. }) if param.ends_with("lr")),
    );
    // A file whose rebuild calls nest 100,000 deep: a typed error, not a stack overflow.
    let mut p = b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\nq\x000ctorch\nTensor\nq\x010)q\x020".to_vec();
    for _ in 0..100_000 {
        p.extend(b"(h\x00h\x01h\x02Ntq\x020");
    }
    p.extend(b"h\x00h\x02R.");
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let stored = zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored);
    zip.start_file("archive/data.pkl", stored).unwrap();
    std::io::Write::write_all(&mut zip, &p).unwrap();
    check("nested rebuild calls", zip.finish().unwrap().into_inner(), &|e| {
        matches!(e, AmpError::File(TorchIoError::TooDeep { limit: 256, .. }))
    });
    let mut t = tree();
    edit(&mut t, &["optimizer", "state"], |st| {
        if let Value::Dict(d) = st {
            d.insert(
                Key::Int(1),
                Value::Dict(
                    Dict::new().with("momentum_buffer", Value::Tensor(Tensor::zeros([31], (Kind::Float, Device::Cpu)))),
                ),
            );
        }
    });
    check(
        "a state of the wrong shape",
        checkpoint_bytes(&t),
        &|e| matches!(e, AmpError::State(StateError::ShapeMismatch { target, .. }) if target == "fc1.bias"),
    );
    // An optimizer state for another parameter count: the last parameter of group 1 dropped.
    let mut t = tree();
    edit(&mut t, &["optimizer"], |o| {
        let Value::Dict(d) = o else { panic!() };
        if let Some(mut groups) = d.remove(&Key::from("param_groups")) {
            if let Value::List(list) = &mut groups {
                if let Value::Dict(g) = &mut list[1] {
                    if let Some(mut ids) = g.remove(&Key::from("params")) {
                        if let Value::List(ids) = &mut ids {
                            ids.pop();
                        }
                        g.insert("params", ids);
                    }
                }
            }
            d.insert("param_groups", groups);
        }
    });
    check("another parameter count", checkpoint_bytes(&t), &|e| {
        matches!(e, AmpError::State(StateError::ParamCount { in_file: 5, in_optimizer: 6, .. }))
    });
    // An Adam checkpoint into this SGD optimizer.
    check(
        "another optimizer class",
        std::fs::read(f.path("adam_o2.zip.pt")).unwrap(),
        &|e| matches!(e, AmpError::State(StateError::OptimizerKind { in_file, .. }) if in_file == "Adam"),
    );
    let mut t = tree();
    edit(&mut t, &["amp", "loss_scaler0", "loss_scale"], |v| *v = Value::Float(-1.0));
    check("a negative loss scale", checkpoint_bytes(&t), &|e| {
        matches!(e, AmpError::State(StateError::StateMismatch { .. }))
    });
    let mut t = tree();
    edit(&mut t, &["model"], |m| *m = Value::List(vec![]));
    check("a model that is no dict", checkpoint_bytes(&t), &|e| {
        matches!(e, AmpError::File(TorchIoError::TypeMismatch { .. }))
    });
    // Another momentum: taken by default (as torch's load_state_dict takes it), refused with
    // strict_hyper_parameters.
    let mut t = tree();
    edit(&mut t, &["optimizer", "param_groups"], |gs| {
        let Value::List(groups) = gs else { panic!() };
        if let Value::Dict(g) = &mut groups[0] {
            g.insert("momentum", Value::Float(0.5));
        }
    });
    let p = dir.path().join("momentum.pt");
    std::fs::write(&p, checkpoint_bytes(&t)).unwrap();
    let strict = TorchLoadOptions::new().strict_hyper_parameters(true);
    let e = load_torch_checkpoint(&p, &s.vs, &mut [&mut s.opt], &mut s.amp, &strict).unwrap_err();
    println!("another momentum: {e}");
    assert!(matches!(&e, AmpError::State(StateError::HyperParameter { name, .. }) if name == "momentum"), "{e:?}");
    assert!(same_snapshot(&before, &snapshot(&s)), "another momentum: the failed load changed something");
}

// ---------------------------------------------------------------------------------------------
// Fuzz

use common::SeededRng as Rng;

fn count_nodes(v: &Value) -> usize {
    1 + match v {
        Value::List(x) | Value::Tuple(x) => x.iter().map(count_nodes).sum(),
        Value::Dict(d) => d.iter().map(|(_, x)| count_nodes(x)).sum(),
        _ => 0,
    }
}

/// A replacement for `v`: another type, an odd number, a NaN or reshaped tensor, ...
fn mutant(rng: &mut Rng, v: &Value) -> Option<Value> {
    let cpu = (Kind::Float, Device::Cpu);
    Some(match rng.below(12) {
        0 => Value::None,
        1 => Value::Int([0, -1, 1, i64::MAX, i64::MIN, 7][rng.below(6)]),
        2 => Value::Float([f64::NAN, f64::INFINITY, -1.0, 0.0, 1e300, -0.0][rng.below(6)]),
        3 => Value::Str("x".into()),
        4 => Value::Bool(rng.below(2) == 0),
        5 => Value::Dict(Dict::new()),
        6 => Value::List(vec![]),
        7 => Value::Tensor(Tensor::from(f64::NAN).to_kind(Kind::Float)),
        _ => match v {
            Value::Tensor(t) => Value::Tensor(match rng.below(5) {
                0 if t.is_floating_point() => t.full_like(f64::NAN),
                0 => t.full_like(-1),
                1 => t.to_kind(Kind::Int64),
                2 => t.flatten(0, -1),
                3 => Tensor::zeros([1, 2], cpu),
                _ => t.to_kind(Kind::Half),
            }),
            Value::Int(i) => Value::Int(i.wrapping_neg().wrapping_sub(rng.below(3) as i64)),
            Value::Float(x) => Value::Float(-x * 2.0),
            Value::Dict(_) | Value::List(_) | Value::Tuple(_) => return None, // handled by deletion
            _ => Value::Int(3),
        },
    })
}

/// `v` with node number `target` (pre-order) mutated or, in a container, an element deleted.
fn mutate(rng: &mut Rng, v: &Value, target: usize, at: &mut usize) -> Value {
    let here = *at;
    *at += 1;
    if here == target {
        match (v, mutant(rng, v)) {
            (_, Some(m)) => return m,
            (Value::Dict(d), None) => {
                let drop = rng.below(d.len().max(1));
                let mut out = if d.is_ordered() { Dict::new_ordered() } else { Dict::new() };
                for (i, (k, x)) in d.iter().enumerate() {
                    if i != drop {
                        out.insert(k.clone(), x.shallow_clone());
                    }
                }
                return Value::Dict(out);
            }
            (Value::List(x) | Value::Tuple(x), None) if !x.is_empty() => {
                let mut x: Vec<Value> = x.iter().map(Value::shallow_clone).collect();
                x.remove(rng.below(x.len()));
                return Value::List(x);
            }
            _ => return Value::None,
        }
    }
    match v {
        Value::List(x) => Value::List(x.iter().map(|e| mutate(rng, e, target, at)).collect()),
        Value::Tuple(x) => Value::Tuple(x.iter().map(|e| mutate(rng, e, target, at)).collect()),
        Value::Dict(d) => {
            let mut out = if d.is_ordered() { Dict::new_ordered() } else { Dict::new() };
            for (k, x) in d.iter() {
                let m = mutate(rng, x, target, at);
                out.insert(k.clone(), m);
            }
            Value::Dict(out)
        }
        other => other.shallow_clone(),
    }
}

/// 3,000 mutated checkpoints (one to three mutations each of a valid SGD/O2 or Adam/O2 file:
/// wrong types, missing entries, NaN and reshaped tensors, odd numbers), seeded: no panic; a
/// refused file changes nothing; an accepted one loads.
#[test]
fn fuzz_checkpoint_loader_never_panics_and_refusals_change_nothing() {
    let f = Fixtures::write();
    let mut rng = Rng::new(0x51f1_0c4e_2b7a_9d33);
    let (mut accepted, mut refused) = (0, 0);
    for scenario in ["sgd_o2", "adam_o2"] {
        let seed = torch_io::load(f.path(&format!("{scenario}.zip.pt"))).unwrap();
        let nodes = count_nodes(&seed);
        let mut s = setup(scenario);
        let mut before = snapshot(&s);
        for case in 0..1500 {
            let mut v = seed.shallow_clone();
            for _ in 0..1 + rng.below(3) {
                let target = rng.below(nodes);
                v = mutate(&mut rng, &v, target, &mut 0);
            }
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                load_torch_checkpoint_value(v, &s.vs, &mut [&mut s.opt], &mut s.amp, &TorchLoadOptions::new())
            }));
            match r {
                Err(_) => panic!("{scenario} case {case} panicked"),
                Ok(Ok(_)) => {
                    accepted += 1;
                    before = snapshot(&s);
                }
                Ok(Err(_)) => {
                    refused += 1;
                    assert!(
                        same_snapshot(&before, &snapshot(&s)),
                        "{scenario} case {case}: a refused load changed state"
                    );
                }
            }
        }
    }
    println!("fuzz: {accepted} accepted, {refused} refused");
    assert!(accepted > 50 && refused > 1000, "{accepted} accepted, {refused} refused");
}

// ---------------------------------------------------------------------------------------------
// nanoGPT's checkpoints, both ways (scripts/reference/ported_checkpoints.py describes the run)

/// nanoGPT's GPTConfig of the test, train.py's settings, and its run (see the script).
mod nanogpt {
    use tch::nn::{self, Module};
    use tch::{Device, Kind, Tensor};
    use tch_amp::Autocast;
    use tch_amp::{AmpOptimizer, CpuKernels, GradScaler, ParamGroup};

    pub const VOCAB: i64 = 64;
    pub const BLOCK: i64 = 16;
    pub const LAYERS: i64 = 2;
    pub const HEADS: i64 = 2;
    pub const EMBD: i64 = 32;
    pub const ACCUM: i64 = 2;
    pub const K: i64 = 6;
    pub const M: i64 = 4;
    pub const N: i64 = 20;
    const LEARNING_RATE: f64 = 1e-3;
    const MIN_LR: f64 = 1e-4;
    const WARMUP_ITERS: i64 = 4;
    const LR_DECAY_ITERS: i64 = 60;
    const GRAD_CLIP: f64 = 1.0;
    const OVERFLOW: [i64; 2] = [3, 14];

    pub struct Block {
        ln_1: nn::LayerNorm,
        c_attn: nn::Linear,
        attn_proj: nn::Linear,
        ln_2: nn::LayerNorm,
        c_fc: nn::Linear,
        mlp_proj: nn::Linear,
    }

    /// model.py's GPT with the layers created in its registration order; `lm_head` is the
    /// token embedding (tied), so the VarStore has no `lm_head.weight`.
    pub struct Gpt {
        wte: Tensor,
        wpe: Tensor,
        h: Vec<Block>,
        ln_f: nn::LayerNorm,
    }

    impl Gpt {
        pub fn new(vs: &nn::VarStore) -> Gpt {
            let t = vs.root() / "transformer";
            let lin = |p: nn::Path, i, o| nn::linear(p, i, o, Default::default());
            let ln = |p: nn::Path| nn::layer_norm(p, vec![EMBD], Default::default());
            let wte = nn::embedding(&t / "wte", VOCAB, EMBD, Default::default()).ws;
            let wpe = nn::embedding(&t / "wpe", BLOCK, EMBD, Default::default()).ws;
            let h = (0..LAYERS)
                .map(|i| {
                    let b = &t / "h" / i;
                    Block {
                        ln_1: ln(&b / "ln_1"),
                        c_attn: lin(&b / "attn" / "c_attn", EMBD, 3 * EMBD),
                        attn_proj: lin(&b / "attn" / "c_proj", EMBD, EMBD),
                        ln_2: ln(&b / "ln_2"),
                        c_fc: lin(&b / "mlp" / "c_fc", EMBD, 4 * EMBD),
                        mlp_proj: lin(&b / "mlp" / "c_proj", 4 * EMBD, EMBD),
                    }
                })
                .collect();
            Gpt { wte, wpe, h, ln_f: ln(&t / "ln_f") }
        }

        /// `model.parameters()`'s names: the registration order (the tied weight once).
        pub fn parameter_names() -> Vec<String> {
            let mut n = vec!["transformer.wte.weight".to_string(), "transformer.wpe.weight".into()];
            for i in 0..LAYERS {
                for m in ["ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"] {
                    n.push(format!("transformer.h.{i}.{m}.weight"));
                    n.push(format!("transformer.h.{i}.{m}.bias"));
                }
            }
            n.extend(["transformer.ln_f.weight".to_string(), "transformer.ln_f.bias".into()]);
            n
        }

        fn attn(b: &Block, x: &Tensor) -> Tensor {
            let (bs, t, c) = x.size3().unwrap();
            let qkv = b.c_attn.forward(x).split(EMBD, 2);
            let heads = |y: &Tensor| y.view([bs, t, HEADS, c / HEADS]).transpose(1, 2);
            let (q, k, v) = (heads(&qkv[0]), heads(&qkv[1]), heads(&qkv[2]));
            let y = Tensor::scaled_dot_product_attention::<Tensor>(&q, &k, &v, None, 0.0, true, None, false);
            b.attn_proj.forward(&y.transpose(1, 2).contiguous().view([bs, t, c]))
        }

        /// model.py's forward with targets: the mean cross entropy (ignore_index -1).
        pub fn loss(&self, idx: &Tensor, targets: &Tensor) -> Tensor {
            let t = idx.size()[1];
            let pos = Tensor::arange(t, (Kind::Int64, Device::Cpu));
            let mut x = Tensor::embedding(&self.wte, idx, -1, false, false)
                + Tensor::embedding(&self.wpe, &pos, -1, false, false);
            for b in &self.h {
                x = &x + Self::attn(b, &b.ln_1.forward(&x));
                x = &x + b.mlp_proj.forward(&b.c_fc.forward(&b.ln_2.forward(&x)).gelu("none"));
            }
            let logits = self.ln_f.forward(&x).linear::<Tensor>(&self.wte, None);
            logits.view([-1, VOCAB]).cross_entropy_loss::<Tensor>(
                &targets.view([-1]),
                None,
                tch::Reduction::Mean,
                -1,
                0.0,
            )
        }
    }

    pub fn get_lr(it: i64) -> f64 {
        if it < WARMUP_ITERS {
            return LEARNING_RATE * (it + 1) as f64 / (WARMUP_ITERS + 1) as f64;
        }
        if it > LR_DECAY_ITERS {
            return MIN_LR;
        }
        let decay_ratio = (it - WARMUP_ITERS) as f64 / (LR_DECAY_ITERS - WARMUP_ITERS) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * decay_ratio).cos());
        MIN_LR + coeff * (LEARNING_RATE - MIN_LR)
    }

    /// The port: the model, `configure_optimizers`' two AdamW groups (weight decay `wd` for
    /// parameters of dim >= 2 and `no_wd` for the others; the file's values replace them on
    /// load), train.py's GradScaler.
    pub struct Run {
        pub vs: nn::VarStore,
        pub gpt: Gpt,
        pub opt: AmpOptimizer,
        pub scaler: GradScaler,
        params: Vec<Tensor>,
        pub rec: Vec<(Tensor, f64, Tensor, Tensor, Tensor)>,
    }

    pub fn run(wd: f64, no_wd: f64) -> Run {
        let vs = nn::VarStore::new(Device::Cpu);
        let gpt = Gpt::new(&vs);
        // torch.optim's AdamW without AMP: torch.amp keeps the parameters in fp32.
        let adamw = nn::AdamW { beta1: 0.9, beta2: 0.95, wd: 0.01, eps: 1e-8, amsgrad: false };
        let groups =
            [ParamGroup::matching_var(|_, v| v.dim() >= 2).weight_decay(wd), ParamGroup::rest().weight_decay(no_wd)];
        let opt = tch_amp::AmpOptimizer::new(&vs, adamw, LEARNING_RATE, &groups).unwrap();
        let vars = vs.variables();
        let params = Gpt::parameter_names().iter().map(|n| vars[n].shallow_clone()).collect();
        Run { vs, gpt, opt, scaler: GradScaler::new(Device::Cpu), params, rec: Vec::new() }
    }

    impl Run {
        /// One iteration of train.py's loop.
        pub fn iteration(&mut self, it: i64, xs: &Tensor, ys: &Tensor) {
            let lr = get_lr(it);
            self.opt.set_lr(lr).unwrap();
            let autocast = Autocast::new(Device::Cpu).dtype(Kind::Half).cpu_kernels(CpuKernels::Native);
            let mut losses = Vec::new();
            for micro in 0..ACCUM {
                let (x, y) = (xs.get(it).get(micro), ys.get(it).get(micro));
                let loss = autocast.run(|| self.gpt.loss(&x, &y) / ACCUM as f64).unwrap();
                losses.push(loss.detach().copy());
                let loss = if OVERFLOW.contains(&it) && micro == 0 { loss * 65536.0 } else { loss };
                self.scaler.scale(&loss).unwrap().backward();
            }
            self.scaler.unscale_(&self.opt).unwrap();
            let norm = tch_amp::torch_amp::clip_grad_norm_(&self.params, GRAD_CLIP, 2.0).unwrap();
            self.scaler.step(&mut self.opt).unwrap();
            self.scaler.update().unwrap();
            self.opt.zero_grad().unwrap();
            let scale = self.scaler.scale_tensor().unwrap().copy();
            let tracker = Tensor::from(self.scaler.growth_tracker() as i32);
            self.rec.push((Tensor::stack(&losses, 0), lr, norm, scale, tracker));
        }
    }
}

/// Differences between the nanoGPT port's run and the script's records under `tag`.
fn compare_gpt(r: &nanogpt::Run, fx: &Fixture, tag: &str) -> Vec<String> {
    let mut bad = Vec::new();
    let get = |k: &str| fx.get(&format!("{tag}/{k}"));
    let (loss, lr, norm, scale, tracker) = (get("loss"), get("lr"), get("norm"), get("scale"), get("tracker"));
    assert_eq!(r.rec.len() as i64, loss.size()[0], "{tag}: iterations recorded");
    for (i, (l, rate, n, s, t)) in r.rec.iter().enumerate() {
        let i = i as i64;
        for (what, ours, theirs) in [
            ("loss", l, loss.get(i)),
            ("grad norm", n, norm.get(i)),
            ("scale", s, scale.get(i)),
            ("tracker", t, tracker.get(i)),
        ] {
            if !bits_equal(ours, &theirs) {
                bad.push(format!("{tag}: {what} of iteration {i}: {ours:?} vs {theirs:?}"));
            }
        }
        if *rate != lr.double_value(&[i]) {
            bad.push(format!("{tag}: lr of iteration {i}: {rate} vs {}", lr.double_value(&[i])));
        }
    }
    for (name, v) in r.vs.variables() {
        let want = get(&format!("final/{name}"));
        if !bits_equal(&v, want) {
            bad.push(format!("{tag}: {name}: {}", describe_diff(&v, want)));
        }
    }
    for p in r.opt.to_record().params {
        for (buf, v) in &p.buffers {
            let want = get(&format!("state/{}/{buf}", p.name));
            if !bits_equal(v, want) {
                bad.push(format!("{tag}: {} {buf}: {}", p.name, describe_diff(v, want)));
            }
        }
        let step = get(&format!("state/{}/step", p.name)).double_value(&[]);
        if step != p.step as f64 {
            bad.push(format!("{tag}: {} step {} vs {step}", p.name, p.step));
        }
    }
    bad
}

/// nanoGPT's train.py checkpoint logic (torch.amp fp16 with a GradScaler, AdamW in two groups
/// at weight decay 0.1 and 0.0, the token embedding tied to lm_head, a compiled model's
/// `_orig_mod.` keys): the file Python wrote at iteration 6 resumes in Rust and continues for 20
/// iterations bit for bit as Python's uninterrupted run (losses, gradient norms, learning rates,
/// scale and growth tracker at every iteration, an overflow skipped at iteration 14; weights and
/// AdamW state after); the file Rust wrote at iteration 10 resumes with train.py's own resume
/// code (strict `load_state_dict`) and continues for 20 iterations bit for bit as Rust's
/// uninterrupted run. torch's own fp16 kernels on both sides (CpuKernels::Native), one thread,
/// the same machine.
#[test]
fn nanogpt_checkpoints_resume_both_ways_bit_for_bit() {
    use nanogpt::{K, M, N};
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let script =
        |args: &[&str]| common::python::run_reference_script("ported_checkpoints.py", args, Duration::from_secs(300));
    script(&["nanogpt", "write", d]);
    let fx = Fixture::read(&dir.path().join("nanogpt.expected.safetensors"));
    let (xs, ys) = (fx.get("data/x"), fx.get("data/y"));
    let python_file = dir.path().join("nanogpt.pt");

    // Python's file into a port that forgot the weight decay: the file's per-group values win.
    let mut r = nanogpt::run(0.0, 0.0);
    let report =
        load_torch_checkpoint(&python_file, &r.vs, &mut [&mut r.opt], &mut r.scaler, &TorchLoadOptions::new()).unwrap();
    assert_eq!(report.stripped_prefix.as_deref(), Some("_orig_mod."));
    assert_eq!(report.ignored, ["lm_head.weight (the same tensor as transformer.wte.weight)"]);
    assert!(report.amp_loaded);
    assert_eq!(report.entries.get_str("iter_num").map(|v| v.type_name()), Some("int"));
    let wd = |r: &nanogpt::Run, g| r.opt.hyper_parameters_group(g).unwrap().get("weight_decay").unwrap();
    assert_eq!((wd(&r, 0), wd(&r, 1)), (0.1, 0.0));
    assert_eq!((r.scaler.get_scale(), r.scaler.growth_tracker()), (32768.0, 2));
    for it in K..K + N {
        r.iteration(it, xs, ys);
    }
    let bad = compare_gpt(&r, &fx, "run");
    println!(
        "nanoGPT: Python's checkpoint resumed in Rust: {}",
        if bad.is_empty() { "bit for bit" } else { "DIFFERS" }
    );
    let (first, last) = (&r.rec[0].0, &r.rec[N as usize - 1].0);
    println!(
        "  losses {:?} .. {:?}, scale {}",
        Vec::<f32>::try_from(first).unwrap(),
        Vec::<f32>::try_from(last).unwrap(),
        r.scaler.get_scale()
    );
    assert!(bad.is_empty(), "{} differences:\n{}", bad.len(), bad.join("\n"));

    // The port's own run from Python's file: its checkpoint after iteration 10 resumes in Python.
    let mut r = nanogpt::run(0.1, 0.0);
    load_torch_checkpoint(&python_file, &r.vs, &mut [&mut r.opt], &mut r.scaler, &TorchLoadOptions::new()).unwrap();
    for it in K..K + M {
        r.iteration(it, xs, ys);
    }
    let rust_file = dir.path().join("nanogpt.rust.pt");
    let model_args = Dict::new()
        .with("n_layer", Value::Int(nanogpt::LAYERS))
        .with("n_head", Value::Int(nanogpt::HEADS))
        .with("n_embd", Value::Int(nanogpt::EMBD))
        .with("block_size", Value::Int(nanogpt::BLOCK))
        .with("bias", Value::Bool(true))
        .with("vocab_size", Value::Int(nanogpt::VOCAB))
        .with("dropout", Value::Float(0.0));
    let options = TorchSaveOptions::new()
        .key_prefix("_orig_mod.")
        .tied("lm_head.weight", "transformer.wte.weight")
        .param_names(false)
        .entry("model_args", Value::Dict(model_args))
        .entry("iter_num", K + M)
        .entry("best_val_loss", 1e9)
        .entry("config", Value::Dict(Dict::new().with("dtype", Value::from("float16"))));
    save_torch_checkpoint(&rust_file, &r.vs, &[&r.opt], &r.scaler, &options).unwrap();
    // Both names of the tied weight, one storage; the groups' own weight decay.
    let tree = torch_io::load(&rust_file).unwrap();
    let model = tree.get("model").unwrap();
    let (a, b) = (
        model.get("_orig_mod.lm_head.weight").unwrap().as_tensor().unwrap().data_ptr(),
        model.get("_orig_mod.transformer.wte.weight").unwrap().as_tensor().unwrap().data_ptr(),
    );
    assert_eq!(a, b, "the tied names view one storage");
    let groups = tree.get("optimizer").unwrap().get("param_groups").unwrap();
    let g_wd = |i: i64| groups.get(i).unwrap().get("weight_decay").unwrap().as_f64().unwrap();
    assert_eq!((g_wd(0), g_wd(1)), (0.1, 0.0));
    r.rec.clear();
    for it in K + M..K + M + N {
        r.iteration(it, xs, ys);
    }
    let out = dir.path().join("nanogpt.resume.safetensors");
    script(&["nanogpt", "resume", rust_file.to_str().unwrap(), out.to_str().unwrap()]);
    let bad = compare_gpt(&r, &Fixture::read(&out), "resume");
    println!(
        "nanoGPT: Rust's checkpoint resumed by train.py: {}",
        if bad.is_empty() { "bit for bit" } else { "DIFFERS" }
    );
    assert!(bad.is_empty(), "{} differences:\n{}", bad.len(), bad.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// Apex's optimizers in torch files

/// Deterministic data for the MLP of the scenarios: inputs [32, 16], classes [32].
fn mlp_batch(step: i64) -> (Tensor, Tensor) {
    let x = (Tensor::arange(32 * 16, (Kind::Float, Device::Cpu)) * 0.37 + step as f64).sin().view([32, 16]);
    let y = (Tensor::arange(32, (Kind::Int64, Device::Cpu)) * 3 + step).remainder(10);
    (x, y)
}

/// Apex's optimizers (two groups: weight decay on the weights, none on biases and batch norm;
/// O0 and O2) through torch files: each group with Apex's own keys (as its constructor's
/// `defaults` write them, plus `step`), the group step and the state restored, the run
/// continuing bit for bit; `optimizer_config` reads the class back; an optimizer running a
/// user's rule is a typed error naming it; a `'master params'` list out of order is refused
/// by shape, nothing changed.
#[test]
fn apex_optimizers_round_trip_through_torch_files() {
    use tch_amp::optim::{GroupView, HyperParams, StateSpec};
    use tch_amp::{FusedAdagrad, FusedAdam, FusedLamb, FusedNovoGrad, FusedSgd, ParamGroup, UpdateRule};
    tch::set_num_threads(1);
    let configs: [(OptimizerConfig, &[&str]); 5] = [
        (
            FusedSgd { momentum: 0.9, ..Default::default() }.into(),
            &["lr", "momentum", "dampening", "weight_decay", "nesterov"],
        ),
        (FusedAdam::default().into(), &["lr", "bias_correction", "betas", "eps", "weight_decay", "step"]),
        (
            FusedLamb::default().into(),
            &["lr", "bias_correction", "betas", "eps", "weight_decay", "grad_averaging", "max_grad_norm", "step"],
        ),
        (
            FusedNovoGrad::default().into(),
            &[
                "lr",
                "bias_correction",
                "betas",
                "eps",
                "weight_decay",
                "grad_averaging",
                "norm_type",
                "init_zero",
                "step",
                "exp_avg_sq",
            ],
        ),
        (FusedAdagrad::default().into(), &["lr", "eps", "weight_decay"]),
    ];
    let groups = [
        ParamGroup::matching(|n| n.ends_with("weight") && !n.starts_with("bn")).weight_decay(0.01),
        ParamGroup::rest().weight_decay(0.0),
    ];
    let make = |level: OptLevel, config: OptimizerConfig| {
        let vs = VarStore::new(Device::Cpu);
        let net = net(&vs, "adam_o0");
        let _g = tch::no_grad_guard();
        for (i, (_, v)) in vs.variables().iter().filter(|(n, _)| !n.contains("running")).enumerate() {
            let init = (Tensor::arange(v.numel() as i64, (Kind::Float, Device::Cpu)) * 0.7 + i as f64).sin() * 0.3;
            v.shallow_clone().copy_(&init.view(v.size().as_slice()));
        }
        let amp = Amp::new(&AmpConfig::new(level).verbosity(0).emulate_low_precision_on_cpu(false)).unwrap();
        let model = amp.cast_model(&vs, net).unwrap();
        let opt = amp.optimizer_groups(&vs, config, 1e-2, &groups).unwrap();
        Setup { vs, model, opt, amp, dynamic: false }
    };
    let steps = |s: &mut Setup, from: i64, n: i64| {
        for step in from..from + n {
            let (x, y) = mlp_batch(step);
            s.opt.zero_grad().unwrap();
            let loss = s.model.forward_t(&x, true).cross_entropy_for_logits(&y);
            s.amp.scale_loss(&loss, &mut [&mut s.opt], |l| l.backward()).unwrap();
            s.opt.step().unwrap();
        }
    };
    let dir = tempfile::tempdir().unwrap();
    for level in [OptLevel::O0, OptLevel::O2] {
        for (config, keys) in &configs {
            let what = format!("{} {level}", config.name());
            let mut a = make(level, *config);
            steps(&mut a, 0, 3);
            let path = dir.path().join("apex.pt");
            let options = TorchSaveOptions::new().master_params(0, "master params");
            save_torch_checkpoint(&path, &a.vs, &[&a.opt], &a.amp, &options).unwrap();
            let tree = torch_io::load(&path).unwrap();
            let groups = tree.get("optimizer").unwrap().get("param_groups").unwrap();
            for g in groups.elements().unwrap() {
                let got: Vec<String> =
                    g.as_dict().unwrap().keys().map(|k| k.to_string().trim_matches('"').to_string()).collect();
                let mut want: Vec<&str> = keys.to_vec();
                want.extend(["param_names", "params"]);
                let mut got_sorted = got.clone();
                got_sorted.sort();
                want.sort();
                assert_eq!(got_sorted, want, "{what}: group keys {got:?}");
            }
            let (config_back, lr) =
                torch_checkpoint::optimizer_config(&tree.get("optimizer").unwrap().value().shallow_clone()).unwrap();
            assert_eq!((config_back.name(), lr), (config.name(), 1e-2), "{what}");
            let mut b = make(level, *config);
            let load = TorchLoadOptions::new().master_params(0, "master params");
            load_torch_checkpoint(&path, &b.vs, &mut [&mut b.opt], &mut b.amp, &load).unwrap();
            steps(&mut a, 3, 3);
            steps(&mut b, 3, 3);
            let (sa, sb) = (snapshot(&a), snapshot(&b));
            // FusedSGD and FusedAdagrad keep no step count (their updates do not read one).
            let counts = !matches!(config.name(), "fused_sgd" | "fused_adagrad");
            for ((n, x), (_, y)) in sa.iter().zip(&sb) {
                let step = n.starts_with("step/") || n == "scalars";
                assert!((step && !counts) || bits_equal(x, y), "{what}: {n} differs after the round trip");
            }
            let groups = |s: &Setup| {
                let mut g = s.opt.to_record().groups;
                g.iter_mut().filter(|_| !counts).for_each(|g| g.step = 0);
                g
            };
            assert_eq!(groups(&a), groups(&b), "{what}: groups");
            // 'master params' out of order: refused by shape, nothing changed.
            let mut bad = torch_io::load(&path).unwrap();
            let Value::List(list) = bad.get_mut("master params").unwrap() else { panic!() };
            list.swap(0, 1);
            let before = snapshot(&b);
            let e = load_torch_checkpoint_value(bad, &b.vs, &mut [&mut b.opt], &mut b.amp, &load).unwrap_err();
            assert!(
                matches!(&e, AmpError::State(StateError::ShapeMismatch { path, .. }) if path.starts_with("[\"master params\"]")),
                "{what}: {e}"
            );
            assert!(same_snapshot(&before, &snapshot(&b)), "{what}");
        }
    }
    // A user's rule has no torch form.
    #[derive(Debug)]
    struct Plain;
    impl UpdateRule for Plain {
        fn kind(&self) -> &str {
            "plain_sgd"
        }
        fn defaults(&self) -> HyperParams {
            HyperParams::new()
        }
        fn state_spec(&self, _: &HyperParams) -> Vec<StateSpec> {
            Vec::new()
        }
        fn step(&self, _: &mut [GroupView<'_>]) -> tch_amp::Result<()> {
            Ok(())
        }
    }
    let s = make(OptLevel::O0, FusedSgd::default().into());
    let opt = s.amp.optimizer_with_rule(&s.vs, Plain, 0.1, &[]).unwrap();
    let e = torch_checkpoint::torch_checkpoint_value(&s.vs, &[&opt], &s.amp, &TorchSaveOptions::new()).unwrap_err();
    println!("{e}");
    assert!(
        matches!(&e, AmpError::Config(tch_amp::error::ConfigError::NoTorchForm { optimizer: 0, kind }) if kind == "plain_sgd"),
        "{e}"
    );
}
