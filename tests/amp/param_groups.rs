//! torch.optim's parameter groups with their own hyper-parameters, `add_param_group` after
//! `initialize`, and a user-defined [`UpdateRule`], against torch.optim bit for bit: AdamW with
//! a `no_decay` group (weight decay 0, other betas, eps and lr), Adam with per-group betas and
//! eps, SGD with per-group momentum, dampening, Nesterov and weight decay, AdamW with a group
//! added after 4 steps (an fp16 parameter under O2 gets its fp32 master then), and BertAdam (the
//! pytorch-pretrained-bert AdamW variant) implemented here as a user's rule. 12 steps each, fp32
//! parameters (O0) and fp32 masters of fp16 parameters (O2); the model's variables and the
//! masters must equal the Python run's bits at every step, and the optimizer state at the end.
//! The add_param_group and BertAdam cases are also saved after 8 steps and resumed into a fresh
//! setup, continuing with the same bits.
//!
//! Expected values: written by scripts/reference/param_group_fixtures.py (PyTorch 2.13.0, CPU),
//! run by the test on the machine that runs it ([`Fixture::generated`]).
use crate::common::reference::{bits_equal, describe_diff, split_flat, torch_hyper, Fixture};
use serde_json::Value;
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::error::{ConfigError, StateError};
use tch_amp::optim::{GroupView, HyperParams, StateSpec};
use tch_amp::{
    load_checkpoint, save_checkpoint, Amp, AmpConfig, AmpError, AmpOptimizer, OptLevel, OptimizerConfig, ParamGroup,
    UpdateRule,
};

const SAVE_AT: i64 = 8;

/// BertAdam as a training script defines it (no bias correction, weight decay added to the
/// update): m = b1 m + g (1 - b1); v = b2 v + g g (1 - b2); p -= (m / (sqrt(v) + eps) + wd p) lr.
#[derive(Debug)]
struct BertAdam {
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

impl UpdateRule for BertAdam {
    fn kind(&self) -> &str {
        "bert_adam"
    }

    fn defaults(&self) -> HyperParams {
        HyperParams::new()
            .with("beta1", self.beta1)
            .with("beta2", self.beta2)
            .with("eps", self.eps)
            .with("weight_decay", self.weight_decay)
    }

    fn validate(&self, _lr: f64, hyper: &HyperParams) -> tch_amp::Result<()> {
        let eps = hyper.get("eps")?;
        if eps > 0.0 {
            Ok(())
        } else {
            Err(AmpError::Config(ConfigError::InvalidOption { option: "eps", value: eps.to_string(), expected: "> 0" }))
        }
    }

    fn state_spec(&self, _: &HyperParams) -> Vec<StateSpec> {
        vec![StateSpec::like_param("exp_avg"), StateSpec::like_param("exp_avg_sq")]
    }

    fn step(&self, groups: &mut [GroupView<'_>]) -> tch_amp::Result<()> {
        for g in groups.iter_mut() {
            let h = g.hyper();
            let (b1, b2, eps, wd, lr) =
                (h.get("beta1")?, h.get("beta2")?, h.get("eps")?, h.get("weight_decay")?, g.lr());
            for p in g.params_mut() {
                let (param, grad, st) = p.parts();
                let mut m = st.buffer_or_zeros("exp_avg", param)?;
                let mut v = st.buffer_or_zeros("exp_avg_sq", param)?;
                let _ = m.f_mul_scalar_(b1)?.f_add_(&grad.f_mul_scalar(1.0 - b1)?)?;
                let _ = v.f_mul_scalar_(b2)?.f_add_(&grad.f_mul(grad)?.f_mul_scalar(1.0 - b2)?)?;
                let mut update = m.f_div(&v.f_sqrt()?.f_add_scalar(eps)?)?;
                if wd != 0.0 {
                    update = update.f_add(&param.f_mul_scalar(wd)?)?;
                }
                let _ = param.shallow_clone().f_sub_(&update.f_mul_scalar(lr)?)?;
            }
        }
        Ok(())
    }
}

fn fixture() -> Fixture {
    Fixture::generated("param_group_fixtures.py")
}

fn get(h: &[(String, f64)], key: &str, default: f64) -> f64 {
    h.iter().find(|(k, _)| k == key).map_or(default, |(_, v)| *v)
}

fn group(names: &[&str], over: &Value) -> ParamGroup {
    torch_hyper(over).into_iter().fold(ParamGroup::names(names), |g, (k, v)| g.set(&k, v))
}

struct Setup {
    vs: VarStore,
    amp: Amp,
    opt: AmpOptimizer,
}

const NAMES: [&str; 3] = ["a", "b", "c"];
const SHAPES: [&[i64]; 3] = [&[3], &[2, 3], &[33]];

fn split(flat: &Tensor) -> Vec<Tensor> {
    let shapes: Vec<(String, Vec<i64>)> = NAMES.iter().zip(SHAPES).map(|(n, s)| (n.to_string(), s.to_vec())).collect();
    split_flat(flat, &shapes)
}

/// The model at `p0` and the optimizer over group 0 (and group 1 unless it is added later,
/// or `with_late_group`: a resumed run builds the optimizer as it was when saved).
fn setup(fx: &Fixture, case: &Value, prefix: &str, o2: bool, with_late_group: bool) -> Setup {
    let vs = VarStore::new(Device::Cpu);
    for (n, t) in NAMES.iter().zip(split(fx.get(&format!("{prefix}p0")))) {
        let _ = vs.root().var_copy(n, &t);
    }
    let amp = Amp::new(&AmpConfig::new(if o2 { OptLevel::O2 } else { OptLevel::O0 }).verbosity(0)).unwrap();
    let _model = amp.cast_model(&vs, ()).unwrap();
    let d = torch_hyper(&case["defaults"]);
    let lr = case["lr"].as_f64().unwrap();
    let late = case["add_at"].as_i64().unwrap() > 0;
    let mut groups = vec![group(&["a", "b"], &case["group0"])];
    if !late {
        groups.push(group(&["c"], &case["group1"]));
    }
    let (beta1, beta2, eps, wd) =
        (get(&d, "beta1", 0.9), get(&d, "beta2", 0.999), get(&d, "eps", 1e-8), get(&d, "weight_decay", 0.0));
    let mut opt = match case["optimizer"].as_str().unwrap() {
        "BertAdam" => amp.optimizer_with_rule(&vs, BertAdam { beta1, beta2, eps, weight_decay: wd }, lr, &groups),
        kind => {
            let cfg: OptimizerConfig = match kind {
                "AdamW" => nn::AdamW { beta1, beta2, eps, wd, amsgrad: false }.into(),
                "Adam" => nn::Adam { beta1, beta2, eps, wd, amsgrad: false }.into(),
                "SGD" => nn::Sgd { momentum: get(&d, "momentum", 0.0), dampening: 0.0, wd, nesterov: false }.into(),
                other => panic!("unknown optimizer {other}"),
            };
            amp.optimizer_groups(&vs, cfg, lr, &groups)
        }
    }
    .unwrap();
    if late && with_late_group {
        opt.add_param_group(&vs, group(&["c"], &case["group1"])).unwrap();
    }
    Setup { vs, amp, opt }
}

fn run_steps(fx: &Fixture, case: &Value, prefix: &str, s: &mut Setup, from: i64, to: i64) -> Vec<String> {
    let vars = s.vs.variables();
    let add_at = case["add_at"].as_i64().unwrap();
    let mut failures = Vec::new();
    for step in from..to {
        if add_at > 0 && step == add_at {
            let id = s.opt.add_param_group(&s.vs, group(&["c"], &case["group1"])).unwrap();
            assert_eq!(id, 1);
            assert_eq!(s.opt.group_param_names(1), ["c"]);
            // Under O2 the new fp16 parameter gets an fp32 master (Apex's patched
            // add_param_group).
            let c = &s.opt.master_params()[2];
            assert_eq!(c.kind(), Kind::Float, "{prefix}: the added parameter is updated in fp32");
        }
        let ks = split(&fx.get(&format!("{prefix}k")).get(step));
        s.opt.zero_grad().unwrap();
        for v in vars.values() {
            let mut g = v.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let loss = NAMES
            .iter()
            .zip(&ks)
            .map(|(n, k)| (vars[*n].to_kind(Kind::Float) * k.to_kind(Kind::Float)).sum(Kind::Float))
            .reduce(|a, b| a + b)
            .unwrap();
        let out = s.amp.scale_loss(&loss, &mut [&mut s.opt], |l| l.backward()).unwrap();
        assert!(!out.overflow, "{prefix}: overflow at step {step}");
        assert!(s.opt.step().unwrap().stepped(), "{prefix}: step {step} skipped");
        let want = split(&fx.get(&format!("{prefix}p")).get(step));
        for (n, want) in NAMES.iter().zip(&want) {
            let var = &vars[*n];
            if !bits_equal(var, &want.to_kind(var.kind())) {
                failures.push(format!("{prefix} step {step} {n}: {}", describe_diff(var, want)));
            }
        }
        for (n, m) in s.opt.param_names().iter().zip(s.opt.master_params()) {
            let i = NAMES.iter().position(|x| x == n).unwrap();
            if !bits_equal(&m, &want[i]) {
                failures.push(format!("{prefix} step {step} master {n}: {}", describe_diff(&m, &want[i])));
            }
        }
        if !failures.is_empty() {
            return failures;
        }
    }
    failures
}

fn check_state(fx: &Fixture, prefix: &str, s: &Setup) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    save_checkpoint(&path, &s.vs, &[&s.opt], &s.amp).unwrap();
    let ckpt = Fixture::read(&path);
    let mut failures = Vec::new();
    let buffers: Vec<&str> = fx.tensors.keys().filter_map(|k| k.strip_prefix(&format!("{prefix}state/"))).collect();
    assert!(!buffers.is_empty(), "{prefix}: no state in the fixture");
    for buf in buffers {
        for (n, want) in NAMES.iter().zip(split(fx.get(&format!("{prefix}state/{buf}")))) {
            let key = format!("optimizer0/{n}/{buf}");
            if !ckpt.has(&key) {
                failures.push(format!("{prefix} {key}: missing"));
            } else if !bits_equal(ckpt.get(&key), &want) {
                failures.push(format!("{prefix} {key}: {}", describe_diff(ckpt.get(&key), &want)));
            }
        }
    }
    failures
}

fn cases() -> (Fixture, Vec<Value>) {
    let fx = fixture();
    let cases = fx.meta_json("cases").as_array().unwrap().clone();
    assert_eq!(cases.len(), 5);
    (fx, cases)
}

fn run_all(o2: bool) {
    let (fx, cases) = cases();
    let mut failures = Vec::new();
    for case in &cases {
        let prefix = format!("{}/{}/", case["name"].as_str().unwrap(), if o2 { "o2" } else { "fp32" });
        let mut s = setup(&fx, case, &prefix, o2, false);
        let mut f = run_steps(&fx, case, &prefix, &mut s, 0, case["steps"].as_i64().unwrap());
        if f.is_empty() {
            f = check_state(&fx, &prefix, &s);
        }
        if f.is_empty() {
            println!("{prefix}: bit for bit");
        }
        failures.extend(f);
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn per_group_hyper_parameters_match_torch_optim_fp32() {
    run_all(false);
}

#[test]
fn per_group_hyper_parameters_match_torch_optim_o2_masters() {
    run_all(true);
}

/// The add_param_group case (saved after the group was added) and the user's BertAdam are
/// saved after 8 steps and resumed into a fresh VarStore, Amp and optimizer built the same way:
/// the continuation equals the uninterrupted Python run's bits.
#[test]
fn added_group_and_user_rule_resume_from_checkpoint_bit_for_bit() {
    let (fx, cases) = cases();
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for o2 in [false, true] {
        for case in cases.iter().filter(|c| c["name"] == "adamw_add_param_group" || c["name"] == "bert_adam") {
            let prefix = format!("{}/{}/", case["name"].as_str().unwrap(), if o2 { "o2" } else { "fp32" });
            let mut first = setup(&fx, case, &prefix, o2, false);
            let mut f = run_steps(&fx, case, &prefix, &mut first, 0, SAVE_AT);
            let path = dir.path().join(format!("{}.safetensors", prefix.replace('/', "_")));
            save_checkpoint(&path, &first.vs, &[&first.opt], &first.amp).unwrap();
            drop(first);
            let mut resumed = setup(&fx, case, &prefix, o2, true);
            assert_eq!(resumed.opt.rule_kind(), if case["name"] == "bert_adam" { "bert_adam" } else { "adamw" });
            load_checkpoint(&path, &resumed.vs, &mut [&mut resumed.opt], &mut resumed.amp).unwrap();
            if f.is_empty() {
                f = run_steps(&fx, case, &prefix, &mut resumed, SAVE_AT, case["steps"].as_i64().unwrap());
            }
            if f.is_empty() {
                f = check_state(&fx, &prefix, &resumed);
            }
            failures.extend(f);
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

/// A checkpoint written after add_param_group does not load into an optimizer without the
/// added group (typed, nothing changes), nor a BertAdam record into AdamW.
#[test]
fn checkpoint_groups_and_rule_must_match() {
    let (fx, cases) = cases();
    let dir = tempfile::tempdir().unwrap();
    let case = cases.iter().find(|c| c["name"] == "adamw_add_param_group").unwrap();
    let prefix = "adamw_add_param_group/o2/";
    let mut first = setup(&fx, case, prefix, true, false);
    assert!(run_steps(&fx, case, prefix, &mut first, 0, SAVE_AT).is_empty());
    let path = dir.path().join("added.safetensors");
    save_checkpoint(&path, &first.vs, &[&first.opt], &first.amp).unwrap();
    let mut without = setup(&fx, case, prefix, true, false);
    let snapshot = |vs: &VarStore| -> Vec<Tensor> {
        let vars = vs.variables();
        NAMES.iter().map(|n| vars[*n].copy()).collect()
    };
    let before = snapshot(&without.vs);
    match load_checkpoint(&path, &without.vs, &mut [&mut without.opt], &mut without.amp) {
        Err(AmpError::State(StateError::StateMismatch { .. })) => {}
        other => panic!("loaded into an optimizer without the added group: {other:?}"),
    }
    let after = snapshot(&without.vs);
    assert!(before.iter().zip(&after).all(|(a, b)| bits_equal(a, b)), "a failed load changed the model");

    let bert = cases.iter().find(|c| c["name"] == "bert_adam").unwrap();
    let mut adamw = setup(&fx, bert, "bert_adam/fp32/", false, false);
    let mut bert_setup = setup(&fx, bert, "bert_adam/fp32/", false, false);
    assert!(run_steps(&fx, bert, "bert_adam/fp32/", &mut bert_setup, 0, 2).is_empty());
    let bert_path = dir.path().join("bert.safetensors");
    save_checkpoint(&bert_path, &bert_setup.vs, &[&bert_setup.opt], &bert_setup.amp).unwrap();
    let cfg = nn::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-6, wd: 0.01, amsgrad: false };
    adamw.opt = adamw.amp.optimizer_groups(&adamw.vs, cfg, 1e-2, &[ParamGroup::all()]).unwrap();
    match load_checkpoint(&bert_path, &adamw.vs, &mut [&mut adamw.opt], &mut adamw.amp) {
        Err(AmpError::State(StateError::StateMismatch { message })) => {
            assert!(message.contains("bert_adam"), "{message}")
        }
        other => panic!("a BertAdam record loaded into AdamW: {other:?}"),
    }
}

/// add_param_group refuses a variable the optimizer already holds and a hyper-parameter the
/// rule does not have (typed; the optimizer is unchanged).
#[test]
fn add_param_group_errors_change_nothing() {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var_copy("w", &Tensor::from_slice(&[1.0f32, 2.0]));
    let _ = vs.root().var_copy("b", &Tensor::from_slice(&[0.5f32]));
    let amp = Amp::new(&AmpConfig::new(OptLevel::O2).verbosity(0)).unwrap();
    let _model = amp.cast_model(&vs, ()).unwrap();
    let mut opt = amp.optimizer_groups(&vs, nn::AdamW::default(), 1e-3, &[ParamGroup::names(&["w"])]).unwrap();
    match opt.add_param_group(&vs, ParamGroup::names(&["w"])) {
        Err(AmpError::Config(ConfigError::ParamInTwoGroups { .. })) => {}
        other => panic!("{other:?}"),
    }
    match opt.add_param_group(&vs, ParamGroup::names(&["b"]).set("momentum", 0.9)) {
        Err(AmpError::Config(ConfigError::UnknownHyperParameter { .. })) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(opt.param_groups(), [0]);
    assert_eq!(opt.param_names(), ["w"]);
    let id = opt.add_param_group(&vs, ParamGroup::rest().weight_decay(0.0).lr(1e-2)).unwrap();
    assert_eq!((id, opt.lr_group(1)), (1, 1e-2));
    assert_eq!(opt.hyper_parameters_group(1).unwrap().get("weight_decay").unwrap(), 0.0);
    // fp16 under O2: the new parameter got an fp32 master.
    assert_eq!(vs.variables()["b"].kind(), Kind::Half);
    assert_eq!(opt.master_params()[1].kind(), Kind::Float);
}

/// timm's no-weight-decay rule selects by shape (`param.ndim <= 1`, biases and norm
/// parameters), which a name predicate cannot see: `ParamGroup::matching_var` gets the variable
/// too. Under O2 the selection looks at the model's (fp16) variable; the group holds its master.
#[test]
fn groups_select_by_name_and_variable() {
    for level in [tch_amp::OptLevel::O0, tch_amp::OptLevel::O2] {
        let vs = VarStore::new(Device::Cpu);
        let root = vs.root();
        let _ = nn::linear(&root / "fc1", 4, 3, Default::default());
        let _ = nn::batch_norm1d(&root / "bn", 3, Default::default());
        let _ = nn::linear(&root / "fc2", 3, 2, Default::default());
        let amp = tch_amp::Amp::new(&tch_amp::AmpConfig::new(level).verbosity(0)).unwrap();
        let groups =
            [ParamGroup::matching_var(|_, v| v.dim() > 1).weight_decay(0.05), ParamGroup::rest().weight_decay(0.0)];
        let opt = amp.optimizer_groups(&vs, nn::AdamW::default(), 1e-3, &groups).unwrap();
        let ids = opt.param_groups();
        assert_eq!(opt.group_param_names(ids[0]), ["fc1.weight", "fc2.weight"], "{level}");
        assert_eq!(opt.group_param_names(ids[1]), ["bn.bias", "bn.weight", "fc1.bias", "fc2.bias"], "{level}");
        assert_eq!(opt.hyper_parameters_group(ids[0]).unwrap().get("weight_decay").unwrap(), 0.05);
        assert_eq!(opt.hyper_parameters_group(ids[1]).unwrap().get("weight_decay").unwrap(), 0.0);
    }
}

/// A rule that records the order it is handed each group's parameters in.
#[derive(Debug, Default)]
struct OrderSpy(std::sync::Arc<std::sync::Mutex<Vec<Vec<String>>>>);

impl UpdateRule for OrderSpy {
    fn kind(&self) -> &str {
        "order_spy"
    }
    fn defaults(&self) -> HyperParams {
        HyperParams::new()
    }
    fn state_spec(&self, _: &HyperParams) -> Vec<StateSpec> {
        Vec::new()
    }
    fn step(&self, groups: &mut [GroupView<'_>]) -> tch_amp::Result<()> {
        let seen = groups.iter().map(|g| g.params().iter().map(|p| p.name().to_string()).collect()).collect();
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = seen;
        Ok(())
    }
}

/// A rule sees each group's parameters in torch's order: the model's creation order with each
/// weight before its bias (how torch.optim and Apex iterate a group built from
/// `model.parameters()`, which LAMB's global gradient norm sums in), not the VarStore-name order
/// of `param_names()`.
#[test]
fn rules_see_each_group_in_creation_order_weight_before_bias() {
    let vs = VarStore::new(Device::Cpu);
    let root = vs.root();
    let _z = nn::linear(&root / "z_first", 2, 2, Default::default());
    let _a = nn::linear(&root / "a_second", 2, 2, Default::default());
    let _m = nn::layer_norm(&root / "m_third", vec![2], Default::default());
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let groups = [ParamGroup::matching(|n| n.ends_with("weight")), ParamGroup::rest()];
    let seen = std::sync::Arc::default();
    let mut opt = amp.optimizer_with_rule(&vs, OrderSpy(std::sync::Arc::clone(&seen)), 0.1, &groups).unwrap();
    assert_eq!(opt.group_param_names(0), ["a_second.weight", "m_third.weight", "z_first.weight"]);
    let loss = vs.trainable_variables().iter().map(|t| t.sum(Kind::Float)).fold(Tensor::from(0f32), |a, b| a + b);
    amp.scale_loss(&loss, &mut [&mut opt], |l| l.backward()).unwrap();
    opt.step().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        [
            vec!["z_first.weight", "a_second.weight", "m_third.weight"],
            vec!["z_first.bias", "a_second.bias", "m_third.bias"]
        ]
    );
}
